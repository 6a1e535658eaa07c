"""The cost of checking files before an incremental save links them (ftrain.ckpt.links):
later LoRA saves of GPT-2 small with the checks as shipped and with them off (a size check
and the link, as before 2026-12-07), interleaved in one process on one manager, each from
a settled disk (``ckpt_incremental.timed_save``).

    .venv/bin/python -W ignore benchmarks/ckpt_link_checks.py [--reps 12]
"""

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ckpt_incremental as b  # noqa: E402

from ftrain.ckpt import CheckpointManager, links, store  # noqa: E402

CHECKED = (store.link_chunk, store.link_document)


def _size_only(src, dst, size, crc, *, whole):
    return CHECKED[0](src, dst, size, crc, whole=False)


def _plain_document(src, dst, data):
    return links._link(src, dst)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/ckpt_link_checks")
    p.add_argument("--reps", type=int, default=12)
    ns = p.parse_args()
    root = Path(ns.dir)
    shutil.rmtree(root, ignore_errors=True)
    state, step, batch = b.lora_run(256, "small")
    m = CheckpointManager(root / "incr", async_save=False)
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    for rep in range(ns.reps + 1):  # the first save has nothing to link from
        state, _ = step(state, batch)
        mode = "checked" if rep % 2 else "unchecked"
        plain = (_size_only, _plain_document)
        store.link_chunk, store.link_document = CHECKED if mode == "checked" else plain
        seconds = b.timed_save(m, state)["seconds"]
        if rep:
            times[mode].append(seconds)
    store.link_chunk, store.link_document = CHECKED
    for mode, ts in times.items():
        print(
            f"{mode}: median {statistics.median(ts):.4f} s  ({', '.join(f'{t:.3f}' for t in ts)})"
        )
    ratio = statistics.median(times["checked"]) / statistics.median(times["unchecked"])
    print(f"checked / unchecked: {ratio:.3f}")


if __name__ == "__main__":
    main()
