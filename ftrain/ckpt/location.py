"""Where checkpoints live: a local directory, or a URL of an object store.

``parse_location`` is the one place a ``checkpoint.dir`` / ``CheckpointManager(directory)``
value is interpreted, so an object-store URL is never silently taken for a local path:

- ``/abs/path``, ``rel/path``, ``./s3:odd-name``, ``file:///abs/path``: a local directory
  (:class:`pathlib.Path`; the fast local path, :mod:`ftrain.ckpt.store`).
- ``s3://bucket/prefix`` (also ``s3a://``), ``gs://bucket/prefix``,
  ``az://container/prefix`` (also ``azure``, ``abfs``, ``abfss``): an object store,
  reached through zarr-python's ``zarr.storage.ObjectStore`` over ``obstore``
  (:mod:`ftrain.ckpt.objstore`). Credentials, region and endpoint come from the usual
  environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
  ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP=true`` for an ``http://``
  endpoint; ``GOOGLE_SERVICE_ACCOUNT``...; ``AZURE_STORAGE_ACCOUNT_NAME``...), or from
  ``storage`` options (``checkpoint.storage`` in the CLI, ``CheckpointManager(...,
  storage_options=)``), which win over the environment: obstore's store keys
  (``endpoint``, ``region``, ``access_key_id``, ...) and client keys (``allow_http``,
  ``timeout``, ...); see :func:`split_storage_options`.
- anything else that looks like a URL (``http://``, ``ftp://``, ``s3:/bucket``,
  ``s3:bucket``): :class:`CheckpointLocationError`, naming the value and the fix.

Requests are retried by obstore with exponential backoff on throttling (429/503), other
5xx answers and connection errors (:data:`RETRY`); 4xx answers (no such bucket, access
denied, bad credentials) are not retried and become :class:`CheckpointStoreError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

__all__ = [
    "OBJECT_SCHEMES",
    "CheckpointLocationError",
    "CheckpointStoreError",
    "describe_error",
    "is_object_url",
    "parse_location",
    "same_location",
    "split_storage_options",
]

OBJECT_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "azure", "abfs", "abfss"})


def _retry_policy(retries: int, window: timedelta, longest_wait: timedelta) -> dict:
    """obstore's ``retry_config``. object_store draws each wait uniformly between
    ``init_backoff`` and ``base`` x the previous one, so with base 2 the waits hardly grew
    (10 retries gave up after 1.5-7 s of network outage); base 4 doubles the median wait
    each time (100 ms, ~0.2, ~0.4 ...), and the window, not the count, ends the retrying."""
    return {
        "max_retries": retries,
        "retry_timeout": window,
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": longest_wait,
            "base": 4.0,
        },
    }


# the run's requests: a store that does not answer is retried for about 3 minutes before a
# request fails (then a save goes to the fallback)
RETRY = _retry_policy(30, timedelta(minutes=3), timedelta(seconds=15))
# the one listing at start (no such bucket, a mistyped endpoint): a few quick retries, so a
# wrong setting is said in seconds, not after the run's 3-minute window
PROBE_RETRY = _retry_policy(3, timedelta(seconds=20), timedelta(seconds=2))
# obstore's ClientConfig keys (HTTP client settings shared by every backend); any other
# storage option is a key of the backend's own config (S3Config, GCSConfig, AzureConfig)
CLIENT_OPTIONS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "proxy_ca_certificate",
        "proxy_excludes",
        "root_certificate",
        "randomize_addresses",
        "read_timeout",
        "timeout",
        "user_agent",
    }
)
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_URLISH_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")  # "s3:/b", "s3:b", "http:x"
_CODE_RE = re.compile(r"<Code>([^<]+)</Code>(?:\s*<Message>([^<]*)</Message>)?")


class CheckpointLocationError(ValueError):
    """A checkpoint location that is neither a local path nor a supported store URL."""


class CheckpointStoreError(OSError):
    """An object store refused or failed a request (no such bucket, bad credentials,
    access denied, unreachable endpoint after retries). The message names the URL/key
    and the store's reason. An ``OSError``: a failing primary location makes a save go
    to the fallback location, like a full or broken disk."""


def is_object_url(value: object) -> bool:
    """Whether ``value`` is an object-store URL ftrain handles (``s3://``, ``gs://``, ...)."""
    m = _URL_RE.match(value) if isinstance(value, str) else None
    return bool(m) and m.group(1).lower() in OBJECT_SCHEMES


def parse_location(value: str | Path, storage: Mapping | None = None):
    """A ``Path`` for a local directory, an ``ObjectRoot`` for an object-store URL.

    Args:
        value: ``checkpoint.dir``-style text or a path.
        storage: options of the object store (endpoint, region, credentials, ...; see
            :func:`split_storage_options`); ignored for a local directory.

    Returns:
        ``pathlib.Path`` or :class:`ftrain.ckpt.objstore.ObjectRoot`.

    Raises:
        CheckpointLocationError: an unknown scheme, or a local path that looks like a URL.

    Example:
        >>> parse_location("ckpt")
        PosixPath('ckpt')
    """
    from ftrain.ckpt.objstore import ObjectRoot

    if isinstance(value, Path | ObjectRoot):  # parsed already
        return value
    if not isinstance(value, str) or not value:
        raise CheckpointLocationError(f"checkpoint location must be a path or URL, got {value!r}")
    m = _URL_RE.match(value)
    if m:
        scheme, rest = m.group(1).lower(), m.group(2)
        if scheme == "file":
            return Path("/" + rest.lstrip("/"))
        if scheme not in OBJECT_SCHEMES:
            raise CheckpointLocationError(
                f"checkpoint location {value!r}: unknown scheme {scheme!r}; use a local path "
                f"or one of {', '.join(s + '://' for s in sorted(OBJECT_SCHEMES))}"
            )
        if not rest.split("/")[0]:
            raise CheckpointLocationError(
                f"checkpoint location {value!r} names no bucket; write {scheme}://BUCKET/PREFIX"
            )
        _check_object_path(value, scheme, rest.rstrip("/"))
        try:
            from ftrain.ckpt.objstore import ObjectRoot
        except ImportError as e:
            raise CheckpointLocationError(
                f"checkpoint location {value!r} needs obstore ({e}): pip install 'ftrain[s3]'"
            ) from e
        return ObjectRoot.open(f"{scheme}://{rest.rstrip('/')}", storage)
    # two or more letters: "C:" is not a scheme. A directory of that name that exists is
    # read as one ("./col:on/r", as the message below advises, lost its "./" on a trip
    # through pathlib and was refused again), unless it starts with an object store's
    # scheme: a leftover ./s3:bucket would take a typo for s3://bucket again
    urlish = _URLISH_RE.match(value)
    if urlish and (urlish.group(1).lower() in OBJECT_SCHEMES or not Path(value).is_dir()):
        scheme = value.split(":")[0]
        raise CheckpointLocationError(
            f"checkpoint location {value!r} looks like a URL but is not one (it would be "
            f"a local directory of that name); write {scheme}://BUCKET/PREFIX for "
            f"object storage, or ./{value} if you really mean a local directory"
        )
    return Path(value)


def _check_object_path(value: str, scheme: str, rest: str) -> None:
    """Refuse the spellings a store would read as another place than the text says: the
    URL parser drops a ``?query`` or ``#fragment``, decodes ``%xx`` and removes ``.``/``..``
    segments, so ``s3://b/ck#fallback`` was the primary's own prefix (every commit then
    set its own step aside as "another copy") and ``s3://b/a/../ck`` was ``s3://b/ck``.

    Raises:
        CheckpointLocationError: naming the value, the character or segment, and the fix.
    """
    for char, what in (("?", "a query"), ("#", "a fragment"), ("%", "a percent-escape")):
        if char in rest:
            raise CheckpointLocationError(
                f"checkpoint location {value!r} holds {char!r} ({what}): the store's URL "
                "parser would not keep it in the object key, so the checkpoints would land "
                f"elsewhere; use letters, digits and - _ . / in {scheme}://BUCKET/PREFIX"
            )
    bad = [seg for seg in rest.split("/")[1:] if seg in ("", ".", "..")]
    if bad:
        what = f"a {bad[0]!r}" if bad[0] else "an empty"
        raise CheckpointLocationError(
            f"checkpoint location {value!r} has {what} path segment, which "
            f"the store would collapse or resolve away; write {scheme}://BUCKET/PREFIX with "
            "plain segments (no //, ./ or ../)"
        )


def open_store(url: str, storage: Mapping | None = None, retry: Mapping = RETRY):
    """A writable ``zarr.storage.ObjectStore`` rooted at ``url`` (bucket + prefix), its
    requests retried per ``retry`` (:data:`RETRY`, or :data:`PROBE_RETRY`).

    Raises:
        CheckpointLocationError: a storage option the store does not know.
        CheckpointStoreError: obstore refuses the URL or its configuration.
    """
    import obstore.exceptions
    import obstore.store
    from zarr.storage import ObjectStore

    config, client = split_storage_options(storage)
    _check_endpoints(url, config)
    try:
        raw = obstore.store.from_url(
            url, config=config or None, client_options=client or None, retry_config=dict(retry)
        )
    except obstore.exceptions.UnknownConfigurationKeyError as e:
        key = re.search(r"key: '([^']+)'", str(e))
        raise CheckpointLocationError(
            f"{url}: storage option {key.group(1) if key else '?'!r} is not one of this "
            "store's keys (see obstore's S3Config / GCSConfig / AzureConfig, or the client "
            f"keys {', '.join(sorted(CLIENT_OPTIONS))})"
        ) from None
    except Exception as e:  # obstore raises its own (non-OSError) configuration errors
        raise CheckpointStoreError(f"{url}: cannot configure the object store: {e}") from e
    return ObjectStore(raw)


# schemes that name the same store as another (obstore takes both spellings)
_SAME_SCHEME = {"s3a": "s3", "azure": "az"}


def same_location(a, b) -> bool:
    """Whether two parsed locations (:func:`parse_location`) are one place under two
    spellings: local paths resolved, object URLs with ``s3a``/``azure`` read as
    ``s3``/``az``.

    Example:
        >>> same_location(Path("ck"), Path("./ck/"))
        True
    """
    if isinstance(a, Path) and isinstance(b, Path):
        return a.resolve() == b.resolve()
    if isinstance(a, Path) or isinstance(b, Path):
        return False
    return _canonical_url(str(a)) == _canonical_url(str(b))


def _canonical_url(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{_SAME_SCHEME.get(scheme.lower(), scheme.lower())}://{rest.strip('/')}"


# where an S3 endpoint may be given: a storage option, or the environment obstore reads
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")


def _check_endpoints(url: str, config: Mapping) -> None:
    """An endpoint without ``http://``/``https://`` made obstore's client panic on the
    first request (a Rust backtrace, exit 1); say so at once, with the fix.

    Raises:
        CheckpointLocationError: naming the option or variable and its value.
    """
    given = [(f"checkpoint.storage.{k}", v) for k, v in config.items() if "endpoint" in k]
    if not given and url.lower().startswith(("s3://", "s3a://")):  # the option wins
        given += [(k, os.environ[k]) for k in _ENDPOINT_ENV if os.environ.get(k)]
    for where, value in given:
        if not re.match(r"https?://[^/]", str(value), re.IGNORECASE):
            raise CheckpointLocationError(
                f"{where}={value!r} is not a URL; write http://HOST:PORT or https://HOST "
                f"(e.g. http://{str(value).split('://')[-1]}; plain http also needs "
                "AWS_ALLOW_HTTP=true or checkpoint.storage.allow_http=true)"
            )


def split_storage_options(storage: Mapping | None) -> tuple[dict, dict]:
    """``(store config, client options)`` from one flat mapping of storage options.

    Store keys (``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``,
    ``session_token``, ``conditional_put``, ... for S3; the GCS/Azure keys for those) take
    string values, so booleans become ``"true"``/``"false"`` and numbers their text;
    :data:`CLIENT_OPTIONS` (``allow_http``, ``timeout``, ...) keep their type.

    Raises:
        CheckpointLocationError: a key that is not text, or a value that is not a scalar.

    Example:
        >>> split_storage_options({"endpoint": "http://127.0.0.1:9000", "allow_http": True})
        ({'endpoint': 'http://127.0.0.1:9000'}, {'allow_http': True})
    """
    config, client = {}, {}
    for key, value in (storage or {}).items():
        if not isinstance(key, str) or not isinstance(value, (str, bool, int, float)):
            raise CheckpointLocationError(
                f"storage option {key!r}={value!r}: keys are text and values text, numbers "
                "or booleans (e.g. checkpoint.storage.endpoint=http://127.0.0.1:9000)"
            )
        if key in CLIENT_OPTIONS:
            client[key] = value
        else:
            config[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return config, client


def describe_error(err: BaseException) -> str:
    """A one-line reason from an obstore error (the S3 error code and message when the
    server sent one, e.g. ``NoSuchBucket: The specified bucket does not exist``)."""
    text = str(err)
    m = _CODE_RE.search(text)
    if m:
        return f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return first[:300]
