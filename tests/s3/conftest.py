"""A real S3 API server on 127.0.0.1 for the object-storage tests (moto's ThreadedMotoServer).

Session-scoped: one server for all S3 tests, started here and stopped at the end; no
network beyond loopback. Each test gets its own fresh bucket (``bucket`` fixture). The
environment that ftrain (obstore) and subprocesses of the real CLI read is set for the
session: ``AWS_ENDPOINT_URL``, dummy credentials, ``AWS_REGION``, ``AWS_ALLOW_HTTP=true``.
"""

import itertools
import os
import socket

import pytest

moto_server = pytest.importorskip("moto.server", reason="moto[server] is a test extra")
boto3 = pytest.importorskip("boto3")

_names = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """``{"endpoint": url, "env": {...}}`` of a running moto S3 server on loopback."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield {"endpoint": env["AWS_ENDPOINT_URL"], "env": env}
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(s3_server):
    """A boto3 S3 client of the server (to create buckets and inspect or damage objects)."""
    return boto3.client("s3", endpoint_url=s3_server["endpoint"])


@pytest.fixture
def bucket(s3):
    """A fresh, empty bucket name for this test."""
    name = f"ftrain-test-{next(_names)}-{os.getpid()}"
    s3.create_bucket(Bucket=name)
    return name


def objects(s3, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """``{key: bytes}`` of every object under ``prefix``."""
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out
