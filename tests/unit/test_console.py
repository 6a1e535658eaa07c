"""The command's console streams: whole lines handed on, a lost stream never raising."""

import io
import re
import sys

from ftrain.cli.console import TolerantStream, tolerate_lost_console


class Recording(io.StringIO):
    """A stream that keeps each write call apart (what the terminal or pipe receives)."""

    def __init__(self, fail: OSError | None = None) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail = fail

    def write(self, text: str) -> int:
        if self.fail is not None:
            raise self.fail
        self.calls.append(text)
        return super().write(text)


def test_a_print_reaches_the_stream_as_one_write_of_its_whole_line():
    """print() writes the text and its newline in two calls: under torchrun two ranks'
    lines ran together (``...in 0.05s[rank=1][step=5] resumed``)."""
    inner = Recording()
    out = TolerantStream(inner, "stdout")
    print("[rank=0][step=5] resumed from step 5", file=out)
    print("a", "b", sep=" ", end="", file=out)  # a partial line waits for its newline
    assert inner.calls == ["[rank=0][step=5] resumed from step 5\n"]
    out.write(" c\nd")
    assert inner.calls[-1] == "a b c\n"
    out.flush()  # or a flush
    assert inner.calls[-1] == "d" and inner.getvalue().endswith("a b c\nd")
    out.write("x" * 70_000)  # no newline coming: handed on, not held without bound
    assert inner.calls[-1] == "x" * 70_000


def test_a_partial_line_is_handed_on_when_the_command_ends(monkeypatch):
    inner = Recording()
    monkeypatch.setattr(sys, "stdout", inner)
    with tolerate_lost_console():
        print("no newline", end="")
        assert inner.calls == []
    assert inner.calls == ["no newline"] and sys.stdout is inner


def test_a_lost_stream_is_said_once_on_the_other_and_drops_the_rest():
    err = Recording()
    out = TolerantStream(Recording(fail=BrokenPipeError(32, "Broken pipe")), "stdout", lambda: err)
    print("first", file=out)
    print("second", file=out)
    assert isinstance(out.lost, BrokenPipeError)
    assert len(err.calls) == 1 and "stdout is gone (Broken pipe)" in err.calls[0]


def test_lines_from_threads_and_writelines_reach_a_block_buffered_pipe_whole():
    """The prefetch and save threads print beside the loop: each line reaches the
    descriptor whole (a block-buffered pipe flushed at its 8 KiB boundary, mid-line)."""
    import threading

    class Raw(io.RawIOBase):
        def __init__(self):
            self.chunks: list[bytes] = []

        def writable(self):
            return True

        def write(self, b):
            self.chunks.append(bytes(b))
            return len(b)

    raw = Raw()
    inner = io.TextIOWrapper(io.BufferedWriter(raw, buffer_size=8192), encoding="utf-8")
    out = TolerantStream(inner, "stdout")

    def talk(tag):
        for i in range(3000):  # print: the text, then the newline, in two writes
            print(f"[rank={tag}][step={i}] " + "x" * 37, file=out)

    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between print's two writes
    try:
        threads = [threading.Thread(target=talk, args=(t,)) for t in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switching)
    out.writelines(["a\n", "b", "c\n"])
    assert all(chunk.endswith(b"\n") for chunk in raw.chunks)
    lines = b"".join(raw.chunks).decode().splitlines()
    assert len(lines) == 6002 and lines[-2:] == ["a", "bc"]
    pattern = re.compile(r"\[rank=[01]\]\[step=\d+\] x{37}")
    assert all(pattern.fullmatch(line) for line in lines[:6000]), "a line was cut or joined"
