"""Sources: windows, splits, bad paths, the registry, the text corpus cache."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ftrain.data import (
    ByteTokenizer,
    DataFormatError,
    DataPathError,
    Source,
    TensorSource,
    TextCorpusSource,
    TokenFileSource,
    make_source,
    register_source,
    source_from_config,
    source_names,
    stdlib_corpus,
    stdlib_files,
)
from ftrain.data import text as text_mod


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def write_tokens(path, n, dtype=np.uint16):
    np.arange(n, dtype=dtype).tofile(path)
    return path


def test_token_file_windows_are_non_overlapping(tmp_path):
    write_tokens(tmp_path / "train.bin", 101)
    src = TokenFileSource(tmp_path, block_size=10)
    assert len(src) == 10
    td = src.get(torch.tensor([0, 3, 9]))
    assert td["x"].dtype == td["y"].dtype == torch.int64
    assert td["x"].shape == td["y"].shape == (3, 10)
    assert td["x"][1].tolist() == list(range(30, 40))
    assert td["y"][1].tolist() == list(range(31, 41))
    assert td["y"][2, -1].item() == 100  # the last window ends on the last token


def test_token_file_single_file_split_by_range(tmp_path):
    f = write_tokens(tmp_path / "all.bin", 1000, np.uint32)
    train = TokenFileSource(f, block_size=9, dtype="uint32", val_fraction=0.1)
    val = TokenFileSource(f, block_size=9, split="val", dtype="uint32", val_fraction=0.1)
    assert (train.lo, train.hi, val.lo, val.hi) == (0, 900, 900, 1000)
    assert val.get([0])["x"][0, 0].item() == 900
    assert int(train.get([len(train) - 1])["y"].max()) < 900
    assert train.fingerprint != val.fingerprint


def test_token_file_directory_splits(tmp_path):
    write_tokens(tmp_path / "train.bin", 500)
    write_tokens(tmp_path / "val.bin", 50)
    assert len(TokenFileSource(tmp_path, block_size=7, split="val")) == 7
    d = TokenFileSource(tmp_path, block_size=7).describe()
    assert (
        d["num_samples"] == 71 and d["dtype"] == "uint16" and d["fingerprint"].startswith("tokens:")
    )


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataPathError, match="nope.*does not exist"):
        TokenFileSource(missing, block_size=4)


def test_directory_without_split_file_says_what_is_there(tmp_path):
    write_tokens(tmp_path / "train.bin", 100)
    with pytest.raises(DataPathError, match=r"no 'val.bin'.*found \['train.bin'\]"):
        TokenFileSource(tmp_path, block_size=4, split="val")


@pytest.mark.parametrize("where", ["the file", "the split in a directory"])
def test_a_fifo_as_the_token_file_is_refused_not_waited_on(tmp_path, where):
    """A FIFO blocked the start in open() for good, deaf to SIGTERM and SIGINT."""
    fifo = tmp_path / ("train.bin" if where != "the file" else "tokens.fifo")
    os.mkfifo(fifo)
    path = tmp_path if where != "the file" else fifo
    with pytest.raises(
        DataPathError, match=r"train.bin'|tokens.fifo' is a FIFO, not a regular file"
    ):
        TokenFileSource(path, block_size=4)
    (tmp_path / "dir.bin").mkdir()
    with pytest.raises(DataPathError, match="dir.bin' is a directory, not a regular file"):
        TokenFileSource(tmp_path, block_size=4, split="dir")


@pytest.mark.parametrize(
    "written, read", [(np.uint32, "uint16"), (np.uint16, "uint8"), (np.int64, "int32")]
)
def test_a_file_written_twice_as_wide_as_data_dtype_is_refused(tmp_path, written, read):
    """uint32 ids read as uint16: every other id a zero high half, trained on silently."""
    rng = np.random.default_rng(0)
    rng.integers(1, 256, 5000).astype(written).tofile(tmp_path / "train.bin")
    wider = np.dtype(written).name
    with pytest.raises(DataFormatError, match=f"every other id 0 .*set data.dtype={wider}"):
        TokenFileSource(tmp_path, block_size=4, dtype=read)
    assert len(TokenFileSource(tmp_path, block_size=4, dtype=wider)) == (5000 - 1) // 4
    # ids of the right width with zeros in them: not a false alarm
    ids = rng.integers(0, 256, 5000).astype(np.uint16)
    ids[1::2] = 0
    ids[1] = 7
    ids.tofile(tmp_path / "train.bin")
    assert len(TokenFileSource(tmp_path, block_size=4)) == (5000 - 1) // 4


def test_truncated_file_is_a_clear_error(tmp_path):
    f = tmp_path / "train.bin"
    f.write_bytes(b"\x00" * 101)  # odd byte count: not uint16 tokens
    with pytest.raises(DataFormatError, match=r"train.bin.*truncated.*uint16"):
        TokenFileSource(tmp_path, block_size=4)
    f.write_bytes(b"")
    with pytest.raises(DataFormatError, match="empty"):
        TokenFileSource(tmp_path, block_size=4)


_TRUNCATE_WHILE_READING = """
import os, sys, numpy as np
from ftrain.data import DataFormatError, TokenFileSource
f = os.path.join(sys.argv[1], "train.bin")
np.arange(100_000, dtype=np.uint16).tofile(f)
src = TokenFileSource(sys.argv[1], block_size=100)
assert src.get([5])["x"][0, 0].item() == 500
os.truncate(f, 4096)  # regenerated in place while the run reads it
try:
    src.get([len(src) - 1])
except DataFormatError as e:
    print(e)
"""


def test_token_file_truncated_while_read_is_an_error_not_sigbus(tmp_path):
    # in a child: a memory-mapped file cut short killed the process with SIGBUS, which
    # skips the loop's emergency save
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_WHILE_READING, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "train.bin' shrank while the run read it" in proc.stdout
    assert "4096 bytes, 200000 at the start" in proc.stdout
    assert "rename it into place" in proc.stdout


def test_token_file_replaced_by_rename_keeps_the_file_opened(tmp_path):
    write_tokens(tmp_path / "train.bin", 101)
    src = TokenFileSource(tmp_path, block_size=10)
    np.full(101, 7, dtype=np.uint16).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", tmp_path / "train.bin")
    assert src.get([2])["x"][0].tolist() == list(range(20, 30))  # what the fingerprint saw


def test_too_small_for_one_block(tmp_path):
    write_tokens(tmp_path / "train.bin", 8)
    with pytest.raises(DataFormatError, match="fewer than block_size.*add data to train.bin$"):
        TokenFileSource(tmp_path, block_size=8)  # a directory's split: no val_fraction
    with pytest.raises(DataFormatError, match="fewer than block_size.*or change val_fraction$"):
        TokenFileSource(tmp_path / "train.bin", block_size=8)


def test_out_of_range_indices(tmp_path):
    src = TensorSource(torch.arange(20), block_size=4)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        src.get([4])


def test_tensor_source_1d_and_2d():
    src = TensorSource(torch.arange(17), block_size=4)
    assert len(src) == 4 and src.get([3])["x"].tolist() == [[12, 13, 14, 15]]
    rows = torch.arange(15).reshape(3, 5)
    src2 = TensorSource(rows)
    assert src2.block_size == 4 and src2.get([2])["y"].tolist() == [[11, 12, 13, 14]]
    assert TensorSource(torch.arange(17), block_size=4).fingerprint == src.fingerprint
    assert TensorSource(torch.arange(1, 18), block_size=4).fingerprint != src.fingerprint
    with pytest.raises(ValueError, match="integer"):
        TensorSource(torch.rand(10), block_size=2)


def test_registry_round_trip(tmp_path):
    assert {"tokens", "text", "tensor", "stdlib"} <= set(source_names())
    write_tokens(tmp_path / "train.bin", 100)
    assert isinstance(make_source("tokens", path=tmp_path, block_size=9), TokenFileSource)

    @register_source("test-zeros")
    def zeros(*, block_size: int) -> Source:
        return TensorSource(torch.zeros(50, dtype=torch.long), block_size=block_size)

    assert len(make_source("test-zeros", block_size=7)) == 7
    with pytest.raises(ValueError, match="already registered"):
        register_source("test-zeros", lambda **kw: None)
    with pytest.raises(KeyError, match="unknown data source 'nah'.*tokens"):
        make_source("nah")


def make_corpus(root):
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("second file " * 20)
    (root / "a.txt").write_text("first file " * 20)
    (root / "sub" / "c.txt").write_text("nested " * 20)
    return root


def test_text_corpus_tokenizes_once_and_reuses_the_cache(tmp_path, monkeypatch):
    root = make_corpus(tmp_path / "corpus")
    calls = []
    real = text_mod._tokenize_files
    monkeypatch.setattr(text_mod, "_tokenize_files", lambda *a: calls.append(1) or real(*a))
    first = TextCorpusSource(root, block_size=16)
    assert first.tokenized and len(calls) == 1
    second = TextCorpusSource(root, block_size=16)
    assert not second.tokenized and len(calls) == 1, "second start must not re-tokenize"
    assert second.fingerprint == first.fingerprint
    assert torch.equal(second.get([0, 1])["x"], first.get([0, 1])["x"])
    # files in sorted order, joined by EOT
    text = ByteTokenizer().decode(first.get(list(range(len(first))))["x"].flatten())
    assert text.startswith("first file") and "\x00second file" in text
    # an edited file makes a new cache entry and a new fingerprint
    (root / "a.txt").write_text("changed " * 20)
    third = TextCorpusSource(root, block_size=16)
    assert third.tokenized and len(calls) == 2 and third.fingerprint != first.fingerprint


def test_text_corpus_repairs_a_corrupt_cache(tmp_path):
    root = make_corpus(tmp_path / "corpus")
    src = TextCorpusSource(root, block_size=16)
    src.file.write_bytes(b"xx")  # truncated cache file
    again = TextCorpusSource(root, block_size=16)
    assert again.tokenized and again.fingerprint == src.fingerprint


def test_text_corpus_cache_is_checked_against_its_content_and_its_sources(tmp_path):
    """A cache entry zeroed in place (its size kept) was reused with its old fingerprint, so
    every batch was token 0; a source rewritten with its old size and mtime (cp -p, rsync -a)
    reused the old tokens. Both are tokenized again now, and nothing temporary is left."""
    root = make_corpus(tmp_path / "corpus")
    src = TextCorpusSource(root, block_size=16)
    first = src.get([0])["x"].clone()
    src.file.write_bytes(bytes(src.file.stat().st_size))
    again = TextCorpusSource(root, block_size=16)
    assert again.tokenized and again.fingerprint == src.fingerprint
    assert torch.equal(again.get([0])["x"], first)
    a = root / "a.txt"
    st = a.stat()
    a.write_bytes(bytes(b ^ 1 for b in a.read_bytes()))  # same size, other content
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    stale = TextCorpusSource(root, block_size=16)
    assert stale.tokenized and stale.fingerprint != src.fingerprint
    assert not list(src.file.parent.glob("*.tmp-*"))


def test_a_large_text_file_edited_between_its_probes_is_tokenized_again(tmp_path):
    """A 2 MB file rewritten with its old size and mtime, the edit missing the 64 KiB
    probes (rsync -a of an edited copy): its old tokens were reused and a resume on them
    passed the fingerprint check. Its inode and ctime are in the key now."""
    root = tmp_path / "corpus"
    root.mkdir()
    big = root / "big.txt"
    big.write_bytes(b"abcdefghij" * 200_000)
    src = TextCorpusSource(root, block_size=16)
    st = big.stat()
    edited = tmp_path / "edited.txt"
    edited.write_bytes(big.read_bytes()[:150_000] + b"Z" * 10 + big.read_bytes()[150_010:])
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(edited, big)  # what rsync -a does: a new file, the old size and mtime
    again = TextCorpusSource(root, block_size=16)
    assert again.tokenized and again.fingerprint != src.fingerprint


def test_text_corpus_glob_and_errors(tmp_path):
    root = make_corpus(tmp_path / "corpus")
    src = TextCorpusSource(str(root / "**" / "c.txt"), block_size=8)
    assert len(src.files) == 1 and src.describe()["vocab_size"] == 256
    with pytest.raises(DataPathError, match=r"matches no file"):
        TextCorpusSource(tmp_path / "missing" / "*.txt", block_size=8)


def test_text_corpus_old_paths_keyword_still_works(tmp_path):
    root = make_corpus(tmp_path / "corpus")
    with pytest.warns(DeprecationWarning, match="path="):
        src = TextCorpusSource(paths=str(root), block_size=8)
    assert len(src.files) == 3
    with pytest.raises(TypeError, match="needs path="):
        TextCorpusSource(block_size=8)


def test_cache_dir_argument_overrides_env(tmp_path):
    root = make_corpus(tmp_path / "corpus")
    src = TextCorpusSource(root, block_size=8, cache_dir=tmp_path / "mine")
    assert (tmp_path / "mine") in src.file.parents


def test_stdlib_file_list_is_sorted_and_excludes_packages():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    root = os.path.commonpath(files)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert not any(p in ("site-packages", "__pycache__") for f in files for p in f.parts)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.encode("").numel() == 0
    assert tok.decode(tok.encode("ünï\ncode")) == "ünï\ncode"


CONFIG = {  # the union schema of conf/data/*.yaml
    "val_fraction": 0.1,
    "shuffle": True,
    "drop_last": False,
    "prefetch": 2,
    "allow_changed": False,
    "cache_dir": None,
    "dtype": "uint16",
}


def test_source_from_config(tmp_path):
    write_tokens(tmp_path / "all.bin", 1000)
    cfg = CONFIG | {"name": "tokens", "path": str(tmp_path / "all.bin"), "block_size": 9}
    val = source_from_config(cfg, split="val")
    assert isinstance(val, TokenFileSource) and val.split == "val" and val.num_tokens == 100
    root = make_corpus(tmp_path / "corpus")
    text = source_from_config(CONFIG | {"name": "text", "path": str(root), "block_size": 8})
    assert isinstance(text, TextCorpusSource) and text.split == "train"
    with pytest.raises(DataPathError, match="data=text"):
        source_from_config(CONFIG | {"name": "stdlib", "path": str(root), "block_size": 8})
    with pytest.raises(KeyError, match="unknown data source"):
        source_from_config({"name": "nope"})


def test_stdlib_corpus_builds_once(tmp_path):
    cfg = CONFIG | {"name": "stdlib", "path": None, "block_size": 256}
    src = source_from_config(cfg, split="val")
    assert src.tokenized and len(src) > 100 and src.describe()["tokenizer"] == "bytes-v1"
    again = stdlib_corpus(block_size=256)
    assert not again.tokenized and again.file == src.file
    assert again.fingerprint.startswith("text:bytes-v1:train:bs256:")


def test_unreadable_corpus_files_are_a_clear_data_path_error(tmp_path, monkeypatch):
    """A file this user may not read, a directory it may not enter and a read that fails
    are DataPathErrors naming the path (they were PermissionError tracebacks). Root reads
    everything, so the refusals are simulated where the OS would give them."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello")
    (corpus / "secret.txt").write_text("no")
    real_access = os.access
    monkeypatch.setattr(
        text_mod.os, "access", lambda p, m: "secret" not in str(p) and real_access(p, m)
    )
    with pytest.raises(DataPathError, match=r"secret\.txt' is not readable by this user \(1 of 2"):
        text_mod.resolve_text_files(corpus)
    monkeypatch.setattr(text_mod.os, "access", real_access)

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(corpus), "is_dir", denied)
    with pytest.raises(DataPathError, match="cannot be read .*Permission denied"):
        text_mod.resolve_text_files(tmp_path / "other")
    monkeypatch.undo()
    real_open = type(corpus).open
    monkeypatch.setattr(  # the corpus file's read, not the cache's
        type(corpus),
        "open",
        lambda self, *a, **k: denied(self) if self.name == "a.txt" else real_open(self, *a, **k),
    )
    with pytest.raises(DataPathError, match=r"a\.txt' cannot be read"):
        text_mod.tokenize_corpus([corpus / "a.txt"], cache=tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.tmp-*")), "no partial token file is left"


@pytest.mark.parametrize("dtype", ["float16", "bool", "u16", "complex64"])
def test_a_token_dtype_that_is_not_an_integer_is_refused_naming_the_fix(tmp_path, dtype):
    """A uint16 file read as float16 made every id 0 and trained to the end; an unknown
    name was a TypeError from numpy (exit 1)."""
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(DataFormatError, match=f"data.dtype='{dtype}' is not an integer dtype"):
        TokenFileSource(tmp_path, block_size=8, dtype=dtype)
    assert len(TokenFileSource(tmp_path, block_size=8, dtype="uint16")) == 12


def test_a_glob_over_a_symlink_loop_takes_each_file_once(tmp_path):
    from ftrain.data.text import resolve_text_files

    root = make_corpus(tmp_path / "corpus")
    (root / "sub" / "loop").symlink_to("..")  # a recursive glob followed it ~40 times
    plain = resolve_text_files(root)
    files = resolve_text_files(f"{root}/**/*")
    assert [f.resolve() for f in files] == [f.resolve() for f in plain]


def test_a_text_corpus_too_small_or_empty_is_named_by_its_path_not_its_cache(tmp_path):
    """The messages named the internal cache file (and advised data.dtype, which text has
    not)."""
    from ftrain.data import DataFormatError

    root = tmp_path / "corpus"
    root.mkdir()
    (root / "e.txt").write_text("")
    with pytest.raises(DataFormatError, match=f"text corpus '{root}' holds no text"):
        TextCorpusSource(root, block_size=16)
    for i in range(300):  # many empty files: 299 separators were trained on as "text"
        (root / f"e{i}.txt").write_text("")
    with pytest.raises(DataFormatError, match=r"holds no text \(301 empty file"):
        TextCorpusSource(root, block_size=16, cache_dir=tmp_path / "cache")
    for p in root.glob("e*.txt"):
        p.unlink()
    (root / "e.txt").write_text("abc")
    with pytest.raises(DataFormatError, match=f"split 'train' of text corpus '{root}' has 3"):
        TextCorpusSource(root, block_size=16)


def test_a_binary_file_among_the_text_is_named_in_a_warning(tmp_path, caplog):
    """An ELF binary in a text directory was trained on with no word; its NULs read as
    document ends."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("plain text " * 100)
    (root / "tool").write_bytes(b"\x7fELF\x00\x01" * 100)
    with caplog.at_level("WARNING", logger="ftrain.data"):
        TextCorpusSource(root, block_size=16, cache_dir=tmp_path / "cache")
    assert "1 corpus file(s) hold NUL bytes" in caplog.text and str(root / "tool") in caplog.text
    # advice the command line can follow (+data.exclude=[GLOB] was an unknown key there)
    assert "data.exclude" not in caplog.text and "a narrower data.path" in caplog.text
    caplog.clear()
    (root / "tool").unlink()
    with caplog.at_level("WARNING", logger="ftrain.data"):
        TextCorpusSource(root, block_size=16, cache_dir=tmp_path / "cache")
    assert "NUL" not in caplog.text


def test_a_corpus_file_is_copied_piece_by_piece_with_the_same_tokens(tmp_path, monkeypatch, caplog):
    """Each file was read whole (a 533 MB one-line file peaked at 845 MB RSS): it is now
    copied a piece at a time, the token file and digest unchanged; a NUL anywhere in a
    later piece still names the file."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("the quick brown fox " * 50)
    (root / "b.bin").write_bytes(b"x" * 95 + b"\x00")
    whole, meta, _ = text_mod.tokenize_corpus(sorted(root.iterdir()), cache=tmp_path / "c1")
    monkeypatch.setattr(text_mod, "_PIECE", 7)
    with caplog.at_level("WARNING", logger="ftrain.data"):
        pieces, meta7, _ = text_mod.tokenize_corpus(sorted(root.iterdir()), cache=tmp_path / "c2")
    assert pieces.read_bytes() == whole.read_bytes() and meta7["digest"] == meta["digest"]
    assert "1 corpus file(s) hold NUL bytes" in caplog.text and "b.bin" in caplog.text
    caplog.clear()  # a later start reads the cache: said again (it was said only once)
    with caplog.at_level("WARNING", logger="ftrain.data"):
        _, _, tokenized = text_mod.tokenize_corpus(sorted(root.iterdir()), cache=tmp_path / "c2")
    assert not tokenized and "b.bin" in caplog.text


def test_a_corpus_cache_that_cannot_be_written_is_a_data_path_error_naming_the_fix(tmp_path):
    """A real file-size limit (``ulimit -f``; a full disk is the same OSError path) while
    the token file is written: a raw OSError traceback (exit 1) before, now a
    DataPathError naming the cache file, the bytes it takes and data.cache_dir, with no
    partial file left."""
    import subprocess
    import sys

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "big.txt").write_text("a line of text\n" * 20_000)  # 300 kB > the 64 kB limit
    code = f"""
import resource
from ftrain.data import DataPathError
from ftrain.data.text import tokenize_corpus
from pathlib import Path
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
try:
    tokenize_corpus([Path({str(corpus / "big.txt")!r})], cache={str(tmp_path / "cache")!r})
except DataPathError as err:
    print("REFUSED", err)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "REFUSED the text corpus cache file " in out.stdout, out
    assert "cannot be written ([Errno 27] File too large)" in out.stdout, out.stdout
    assert "it takes 300000 bytes" in out.stdout and "data.cache_dir" in out.stdout, out.stdout
    assert not list((tmp_path / "cache").rglob("*.tmp-*")), "no partial token file is left"


def test_temporary_files_a_killed_writer_left_in_the_cache_are_removed(tmp_path):
    """A SIGKILL mid-tokenize (or mid-write of a fingerprint entry) left
    ``<key>.u8.tmp-*`` in the cache forever. A start removes those untouched for an hour;
    a younger one may be another process's write in progress and stays."""
    corpus = make_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    folders = [cache / "corpus", cache / "fingerprints"]
    stale, fresh = [], []
    for folder in folders:
        folder.mkdir(parents=True)
        old = folder / "0123.u8.tmp-dead"
        old.write_bytes(b"x" * 1000)
        os.utime(old, (1e9, 1e9))  # 2001: long untouched
        stale.append(old)
        fresh.append(folder / "4567.u8.tmp-live")
        fresh[-1].write_bytes(b"y")
    TextCorpusSource(corpus, block_size=16, cache_dir=cache)
    from ftrain.data.fingerprint import file_digest

    file_digest(corpus / "a.txt", cache=cache)
    assert not [p for p in stale if p.exists()], "a dead writer's files are removed"
    assert all(p.exists() for p in fresh), "a live writer's file is left alone"
