"""Checkpoint I/O on an S3 API server: ftrain vs torch.save + one upload vs DCP over fsspec.

Saves and restores the GPT-2 small + AdamW state of ``ckpt_io.py`` (~1.5 GB fp32) to an
S3-compatible server, side by side in one process, interleaved (one round = every method
once), medians of ``--reps`` rounds:

- ``ftrain``: ``CheckpointManager("s3://bucket/...", async_save=False).save`` / ``restore``
  (every chunk and document uploaded and confirmed, manifest, then the marker; restore
  downloads concurrently and verifies every crc32c).
- ``torch.save + upload``: ``torch.save`` into a ``BytesIO``, one boto3 ``upload_fileobj``
  (multipart, 10 threads: what a user would write); restore GETs it in one request and
  ``torch.load``\\ s it from memory.
- ``DCP + fsspec``: ``torch.distributed.checkpoint`` with ``FsspecWriter``/``FsspecReader``
  on ``s3://`` (needs ``s3fs``, which pins botocore against boto3's: run it from a venv of
  its own, see docs/benchmarks.md); skipped with a note when it is missing.

By default the server is moto's on 127.0.0.1 (``ThreadedMotoServer``, in this process, so
its CPU is on this process's cores: every method pays it alike); ``--endpoint URL`` uses
another server (e.g. MinIO) with the ``AWS_*`` credentials of the environment.

    .venv/bin/python benchmarks/ckpt_s3.py --reps 3
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import socket
import statistics
import time

import torch

# the state of the checkpoint I/O benchmark (this script's directory is on sys.path)
from ckpt_io import flat, gpt2_adamw_state

from ftrain.ckpt import CheckpointManager


def start_moto() -> tuple[str, object]:
    """A moto S3 server on a free loopback port: ``(endpoint, server)``."""
    import moto.server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return f"http://127.0.0.1:{port}", server


def s3_environment(endpoint: str) -> None:
    """What obstore, boto3 and s3fs read: the endpoint, dummy credentials, plain HTTP."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    os.environ["AWS_ALLOW_HTTP"] = "true"


def delete_prefix(client, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def stored_bytes(client, bucket: str, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sum(o["Size"] for page in pages for o in page.get("Contents", []))


# ---- the methods: save(prefix) and load(prefix) -> tensors -----------------------------
def ftrain_methods(state, bucket: str):
    def save(prefix: str) -> None:
        CheckpointManager(f"s3://{bucket}/{prefix}", async_save=False).save(state)

    def load(prefix: str):
        return CheckpointManager(f"s3://{bucket}/{prefix}").restore()

    return save, load


def torch_upload_methods(tensors: dict, client, bucket: str):
    from boto3.s3.transfer import TransferConfig

    transfer = TransferConfig(max_concurrency=10)

    def save(prefix: str) -> None:
        buf = io.BytesIO()
        torch.save(tensors, buf)
        buf.seek(0)
        client.upload_fileobj(buf, bucket, f"{prefix}/ckpt.pt", Config=transfer)

    def load(prefix: str):  # one GET (boto3's ranged parallel download is far slower on moto)
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/ckpt.pt")["Body"].read()
        return torch.load(io.BytesIO(body), weights_only=True)

    return save, load


def dcp_methods(tensors: dict, bucket: str):
    """DCP over fsspec's S3 file system, or ``None`` without s3fs."""
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return None
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    def save(prefix: str) -> None:
        dcp.save(dict(tensors), storage_writer=FsspecWriter(f"s3://{bucket}/{prefix}"))

    def load(prefix: str):
        out = {k: torch.empty_like(t) for k, t in tensors.items()}
        dcp.load(out, storage_reader=FsspecReader(f"s3://{bucket}/{prefix}"))
        return out

    return save, load


def bench_once(name: str, methods, client, bucket: str, rep: int, res: dict) -> None:
    prefix = "".join(c if c.isalnum() else "_" for c in name) + f"-{rep}"
    save, load = methods
    t0 = time.perf_counter()
    save(prefix)
    res["save"].append(time.perf_counter() - t0)
    res["bytes"].append(stored_bytes(client, bucket, prefix))
    t0 = time.perf_counter()
    out = load(prefix)
    res["load"].append(time.perf_counter() - t0)
    del out
    delete_prefix(client, bucket, prefix)  # moto keeps objects in memory
    print(f"  {name:<22} save {res['save'][-1]:6.2f} s  load {res['load'][-1]:6.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12, help="fewer for a quick smoke run")
    ap.add_argument("--endpoint", default=None, help="an S3 server to use instead of moto's")
    ap.add_argument("--bucket", default="ftrain-bench")
    args = ap.parse_args()
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        endpoint, server = start_moto()
    s3_environment(endpoint)
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=args.bucket)
    state = gpt2_adamw_state(n_layer=args.layers)
    tensors = flat(state)
    gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    print(f"state: {len(tensors)} tensors, {gb:.2f} GB; reps={args.reps}; {endpoint}")
    methods = {
        "ftrain": ftrain_methods(state, args.bucket),
        "torch.save + upload": torch_upload_methods(tensors, client, args.bucket),
    }
    dcp = dcp_methods(tensors, args.bucket)
    if dcp is None:
        print("  DCP + fsspec: skipped (no s3fs in this environment)")
    else:
        methods["DCP + fsspec"] = dcp
    res = {n: {"save": [], "load": [], "bytes": []} for n in methods}
    try:
        for rep in range(args.reps):  # interleaved, the order rotated per round
            names = list(methods)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                bench_once(name, methods[name], client, args.bucket, rep, res[name])
    finally:
        if server is not None:
            server.stop()
    report(res)


def report(res: dict) -> None:
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    base = med["torch.save + upload"]
    print("\n| method | save s | load s | MB stored | save / torch.save+upload | load / torch |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, m in med.items():
        print(
            f"| {name} | {m['save']:.2f} | {m['load']:.2f} | {m['bytes'] / 1e6:,.0f} | "
            f"{m['save'] / base['save']:.2f}× | {m['load'] / base['load']:.2f}× |"
        )
    for name, r in res.items():
        print(f"{name}: save {r['save']} load {r['load']}")


if __name__ == "__main__":
    main()
