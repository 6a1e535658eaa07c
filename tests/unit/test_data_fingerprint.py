"""Fingerprints: what changes them, the cheap cache, and the resume check."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from ftrain.data import DataFingerprintError, TokenFileSource, check_fingerprint, file_digest
from ftrain.data import fingerprint as fp_mod


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def tokens(path, values):
    np.asarray(values, dtype=np.uint16).tofile(path)
    return path


def test_fingerprint_parts(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    tokens(a / "train.bin", range(200))
    tokens(b / "train.bin", range(200))
    fa = TokenFileSource(a, block_size=8).fingerprint
    assert fa.startswith("tokens:raw:train:bs8:")
    assert TokenFileSource(b, block_size=8).fingerprint == fa, "location must not matter"
    assert TokenFileSource(a, block_size=9).fingerprint != fa
    assert TokenFileSource(a, block_size=8, tokenizer="gpt2").fingerprint != fa
    tokens(b / "train.bin", [*range(199), 7])
    assert TokenFileSource(b, block_size=8).fingerprint != fa


def test_file_digest_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    f = tokens(tmp_path / "t.bin", range(50_000))
    calls = []
    real = fp_mod._full_digest
    monkeypatch.setattr(fp_mod, "_full_digest", lambda p, fd=None: calls.append(p) or real(p, fd))
    d1 = file_digest(f)
    d2 = file_digest(f)
    assert d1 == d2 and len(calls) == 1, "a second start must not re-read the whole file"
    # same size, restored mtime, changed bytes in a probed region: caught by the probe check
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.write(b"\xff\xff")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    d3 = file_digest(f)
    assert d3 != d1 and len(calls) == 2
    # a new mtime re-hashes
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert file_digest(f) == d3 and len(calls) == 3
    # same size, restored mtime, bytes changed between the probes: the ctime moved (no
    # tool sets it back), so it re-hashes; the old key reused the old hash
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(100_000 - 200)
        fh.write(b"\x01" * 8)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(f) != d3 and len(calls) == 4


def test_a_token_file_renamed_over_the_path_is_not_the_one_fingerprinted(tmp_path):
    """The source reads the file it opened; its fingerprint hashed whatever the path named
    when first asked, so a file renamed in between was recorded while the run trained on
    the other, and a resume on it passed the check."""
    (tmp_path / "a").mkdir()
    a = tokens(tmp_path / "a" / "train.bin", range(200))
    b = tokens(tmp_path / "b.bin", [*range(199), 7])
    expected = TokenFileSource(tmp_path / "a", block_size=8).fingerprint
    src = TokenFileSource(tmp_path / "a", block_size=8, cache_dir=tmp_path / "c")
    os.replace(b, a)
    assert src.fingerprint == expected
    assert src.get([0])["x"].flatten()[0].item() == 0
    assert TokenFileSource(tmp_path / "a", block_size=8).fingerprint != expected


def test_tokens_use_data_cache_dir_and_an_unusable_cache_only_costs_a_rehash(
    tmp_path, monkeypatch, caplog
):
    """data=tokens ignored data.cache_dir (the fingerprint went to $FTRAIN_CACHE_DIR), and
    a cache that could not be created (a read-only HOME, a file in its place) crashed the
    start with a traceback."""
    f = tokens(tmp_path / "t.bin", range(5_000))
    monkeypatch.setenv("FTRAIN_CACHE_DIR", str(tmp_path / "env_cache"))
    src = TokenFileSource(f, block_size=8, cache_dir=tmp_path / "mine")
    expected = src.fingerprint
    assert list((tmp_path / "mine" / "fingerprints").glob("*.json"))
    assert not (tmp_path / "env_cache").exists()
    (tmp_path / "blocked").write_text("a file where the cache would go")
    with caplog.at_level(logging.WARNING):
        again = TokenFileSource(f, block_size=8, cache_dir=tmp_path / "blocked" / "cache")
        assert again.fingerprint == expected
    assert "fingerprint cache" in caplog.text and "hashing" in caplog.text


def test_check_fingerprint_mismatch_names_both_and_the_override():
    assert check_fingerprint("x", "x", allow_changed=False) is False
    assert check_fingerprint(None, "x") is False
    with pytest.raises(DataFingerprintError) as e:
        check_fingerprint(
            "tokens:raw:train:bs8:aaaa", "tokens:raw:train:bs8:bbbb", allow_changed=False
        )
    msg = str(e.value)
    assert "tokens:raw:train:bs8:aaaa" in msg and "tokens:raw:train:bs8:bbbb" in msg
    assert "data.allow_changed=true" in msg


def test_check_fingerprint_allowed_change_is_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="ftrain.data.fingerprint"):
        assert check_fingerprint("old", "new", allow_changed=True) is True
    assert "old" in caplog.text and "new" in caplog.text


def test_cache_files_get_the_umask_mode_so_a_shared_cache_is_readable(tmp_path):
    """The corpus cache and the fingerprint records were written through mkstemp (0600):
    a data.cache_dir shared by two users was unreadable to the second."""
    from ftrain.data.text import tokenize_corpus

    corpus = tmp_path / "a.txt"
    corpus.write_text("hello shared cache\n" * 50)
    old = os.umask(0o022)
    try:
        token_file, _, made = tokenize_corpus([corpus], cache=tmp_path / "cache")
        file_digest(corpus, cache=tmp_path / "cache")
    finally:
        os.umask(old)
    written = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert made and token_file in written and len(written) >= 3, written
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {
        p.name: "0o644" for p in written
    }


def test_a_sweep_never_removes_a_live_writers_temporary_file(tmp_path):
    """A cache sweep judged a temporary file dead by its age alone: a writer stopped for
    an hour (or a clock stepped ahead in the sweeping process) lost its file, and failed
    with "cannot be written ... free that much space", exit 2. A live writer holds a lock
    on it; a dead one's (no lock) is still swept."""
    from ftrain.data.fingerprint import remove_stale_tmp, unique_tmp

    target = tmp_path / "tokens.u8"
    dead = tmp_path / "tokens.u8.tmp-dead"
    dead.write_bytes(b"left by a killed writer")
    with unique_tmp(target) as tmp:
        tmp.write_bytes(b"half written")
        assert remove_stale_tmp(tmp_path, older_than_s=-1) == 1  # everything looks old
        assert tmp.exists() and not dead.exists()
        tmp.replace(target)
    assert target.read_bytes() == b"half written"


def test_no_home_directory_is_one_line_naming_the_cache_settings(monkeypatch):
    """`docker run --user 12345` with no HOME: Path.home() raised a RuntimeError traceback
    at the data's first hash."""
    from pathlib import Path

    from ftrain.cli.build import check_cache_home
    from ftrain.config import ConfigError, load_config

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    for var in ("HOME", "FTRAIN_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(ConfigError, match="set FTRAIN_CACHE_DIR .or data.cache_dir"):
        check_cache_home(load_config([]))
    check_cache_home(load_config(["data.cache_dir=/tmp/x"]))  # named: nothing to find
    check_cache_home(load_config(["data=tokens", "data.path=/x"]))  # hashed uncached instead
    monkeypatch.setenv("FTRAIN_CACHE_DIR", "/tmp/y")
    check_cache_home(load_config([]))
