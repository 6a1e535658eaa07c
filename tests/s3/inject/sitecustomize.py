"""Kill-mid-upload injector for tests/s3, active only with ``FTRAIN_S3_KILL`` set.

``FTRAIN_S3_KILL="COMMITS:UPLOADS"``: once this process has committed ``COMMITS`` steps
(the object-store protocol's ``marker_written`` phase), it SIGKILLs itself after the
``UPLOADS``-th chunk object of the next save is confirmed (``object_uploaded``): a step
prefix with some chunks, no manifest and no marker is left in the bucket.
"""

import os

_SPEC = os.environ.get("FTRAIN_S3_KILL")

if _SPEC:
    import signal

    from ftrain.ckpt import commit

    _commits, _uploads = (int(x) for x in _SPEC.split(":"))
    _seen = {"commits": 0, "uploads": 0}

    def _hook(phase: str) -> None:
        if phase == "marker_written":
            _seen["commits"] += 1
        elif phase == "object_uploaded" and _seen["commits"] >= _commits:
            _seen["uploads"] += 1
            if _seen["uploads"] >= _uploads:
                os.kill(os.getpid(), signal.SIGKILL)

    commit.fault_hook = _hook
