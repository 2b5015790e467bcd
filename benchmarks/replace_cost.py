"""What a save over the previous checkpoint costs (Lightning's ``last.ckpt``, a path
saved every N steps), against a save to a new name.

Replacing a file frees the old one's blocks, which takes time in proportion to its size on
ext4 (more with the ``discard`` mount option): torch.save pays it in its ``O_TRUNC``,
``fp_core.save`` paid it in the rename that commits, and now frees the old file on a
background thread (``fp_core.io.deferred_free``). Rows, alternated in every round, each
writing over its own file of the round before (the frees of one row are waited for and the
disk settled before the next row starts):

    torch.save + fsync        torch.save over its last file, then fsync
    fp_core.save, new name    the file removed (and freed) before the save: no replace
    fp_core.save              over its last file, the old one freed in the background
    fp_core.save, freed inline  over its last file, freed by the rename (the code before)

Ratios are medians of per-round ratios to ``torch.save + fsync``.

    python benchmarks/replace_cost.py --dir DIR --sizes 260MiB,2GiB --rounds 5 > benchmarks/results/replace-cost.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fp_core import save  # noqa: E402
from fp_core.format.sizes import parse_size  # noqa: E402
from fp_core.io import deferred_free
from fp_core.tools.bench import make_state_dict, save_torch, settle  # noqa: E402
from fp_core.tools.common import describe_pages, payload_bytes, remove  # noqa: E402


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fp_save_inline(sd: object, path: str) -> None:
    saved, deferred_free.MAX_PENDING = deferred_free.MAX_PENDING, 0  # every release inline
    try:
        save(sd, path)
    finally:
        deferred_free.MAX_PENDING = saved


def run(size: int, d: str, rounds: int) -> None:
    sd = make_state_dict(size)
    n = payload_bytes(sd)
    files = {k: os.path.join(d, f"replace-{i}.pt") for i, k in enumerate(
        ("torch.save + fsync", "fp_core.save, new name", "fp_core.save", "fp_core.save, freed inline"))}

    rows: dict[str, Callable[[], object]] = {
        "torch.save + fsync": lambda: save_torch(sd, files["torch.save + fsync"]),
        "fp_core.save, new name": lambda: save(sd, files["fp_core.save, new name"]),
        "fp_core.save": lambda: save(sd, files["fp_core.save"]),
        "fp_core.save, freed inline": lambda: fp_save_inline(sd, files["fp_core.save, freed inline"]),
    }
    for fn in rows.values():  # the first file of each row: every counted save replaces one
        fn()
    took: dict[str, list[float]] = {k: [] for k in rows}
    freed_after: list[float] = []
    print(f"{n / 2**20:.0f} MiB in 2412 tensors; {rounds} rounds, order alternated; {describe_pages(sd)[1]}",
          flush=True)
    for r in range(rounds):
        order = list(rows) if r % 2 == 0 else list(rows)[::-1]
        for k in order:
            deferred_free.wait()
            settle()
            if k == "fp_core.save, new name":
                remove(files[k])  # its free not timed: a new name replaces nothing
                settle()
            t = timed(rows[k])
            if k == "fp_core.save":
                t0 = time.perf_counter()
                deferred_free.wait()
                freed_after.append(time.perf_counter() - t0)
            took[k].append(t)
        print(f"round {r + 1}: " + ", ".join(f"{k} {took[k][-1]:.3f} s" for k in rows), flush=True)
    base = took["torch.save + fsync"]
    for k, v in took.items():
        ratios = [b / x for b, x in zip(base, v)]
        print(f"{k:28s} median {statistics.median(v):.3f} s  {n / statistics.median(v) / 1e9:5.2f} GB/s  "
              f"vs torch.save + fsync {statistics.median(ratios):.2f}x  per round "
              + " ".join(f"{x:.2f}" for x in ratios))
    print(f"  fp_core.save's old file freed {statistics.median(freed_after):.3f} s after it returned (median)")
    for p in files.values():
        remove(p)
    deferred_free.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sizes", default="260MiB,2GiB")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    for s in a.sizes.split(","):
        run(parse_size(s), a.dir, a.rounds)


if __name__ == "__main__":
    main()
