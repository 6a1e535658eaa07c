"""A real S3 API server on 127.0.0.1 for the object-storage tests (moto's ThreadedMotoServer).

Session-scoped: one server for all S3 tests, started here and stopped at the end; no
network beyond loopback. Each test gets its own fresh bucket (``bucket`` fixture). The
environment that ftrain (obstore) and subprocesses of the real CLI read is set for the
session: ``AWS_ENDPOINT_URL``, dummy credentials, ``AWS_REGION``, ``AWS_ALLOW_HTTP=true``.
"""

import itertools
import os

import pytest

try:  # moto[server] and obstore are in the `test` extra; without them these tests are not collected
    import boto3
    import moto.server as moto_server
    import obstore  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]

_names = itertools.count()


@pytest.fixture(scope="session")
def s3_server():
    """``{"endpoint": url, "env": {...}}`` of a running moto S3 server on loopback."""
    # port 0: the server binds a free port itself (a port picked first could be taken
    # before moto binds it, and moto's start() would then wait forever)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
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


@pytest.fixture
def flaky_endpoint(s3_server, monkeypatch):
    """An HTTP proxy in front of the S3 server that answers some requests with
    ``503 SlowDown`` (S3's throttling reply) instead of forwarding them; ftrain is pointed
    at it. Yields ``{"fail": set of request numbers to refuse, "refused": [..], "seen": n,
    "down_until": time.monotonic() before which every request is refused (an outage),
    "truncate": {object key suffix: how many GET bodies of it to cut in half (a matching
    Content-Length: a proxy or a cut connection)}}``. A suffix, not a substring: ``w/c.1``
    would also cut ``w/c.10.0``..``w/c.19.0`` and spend the count on the wrong chunks."""
    import http.client
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlparse

    upstream = urlparse(s3_server["endpoint"])
    import time

    state = {"fail": set(), "refused": [], "seen": 0, "down_until": 0.0, "truncate": {}}
    lock = threading.Lock()

    class Proxy(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _handle(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                state["seen"] += 1
                refuse = state["seen"] in state["fail"] or time.monotonic() < state["down_until"]
            if refuse:
                state["refused"].append(f"{self.command} {self.path}")
                msg = b"<Error><Code>SlowDown</Code><Message>Reduce your rate</Message></Error>"
                self.send_response(503)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
            conn.request(self.command, self.path, body=body, headers=dict(self.headers))
            resp = conn.getresponse()
            data = resp.read()
            with lock:
                key = self.path.split("?")[0]
                cut = [p for p, n in state["truncate"].items() if key.endswith(p) and n > 0]
                if self.command == "GET" and cut:
                    state["truncate"][cut[0]] -= 1
                    data = data[: len(data) // 2]
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
