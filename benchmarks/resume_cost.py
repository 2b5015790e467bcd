"""What a resume pays for its memory: a load, then one write to every page of every tensor
(the first optimizer step updates the parameters and their states in place).

A mapped load (``torch.load(mmap=True)``, ``fp_core.load(mmap=True)``) returns tensors on
the file's page-cache pages, mapped private: reading them is as fast as the page cache,
but the first write to a page copies it into a new anonymous page, the memory a load into
new tensors (``fp_core.load``) faults in while it reads. On this VM fresh anonymous memory
is the slow part of a load (``benchmarks/results/fresh-memory.txt``), so this script asks whether a
mapped load saves that cost or only moves it to the first step. Each row runs on the file
its reader's table row reads in ``fastpersist bench`` (torch's rows on a file written by
torch.save, ours on ours), cold (the file's pages dropped, 2 s of settling); ratios are
medians of per-round ratios.

    python benchmarks/resume_cost.py --dir DIR --size 2GiB --rounds 4 > benchmarks/results/resume-cost-2GiB.txt
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fp_core  # noqa: E402
from fp_core.format.sizes import parse_size  # noqa: E402
from fp_core.tools.bench import drop_cache, flatten_tensors, make_state_dict, settle, touch_pages  # noqa: E402


def write_pages(obj: Any) -> Any:
    """Add one to a byte of every 4 KiB page of every CPU tensor: a private mapping's
    page is copied on this first write, as an optimizer step's in-place update copies it."""
    for t in flatten_tensors(obj).values():
        if t.numel() and t.device.type == "cpu":
            t.reshape(-1).view(torch.uint8)[::4096].add_(1)
    return obj


def rows(fp_file: str, torch_file: str) -> list[tuple[str, str, Callable[[], Any]]]:
    return [
        ("fp_core.load", fp_file, lambda: fp_core.load(fp_file, weights_only=True)),
        ("fp_core.load + first write", fp_file, lambda: write_pages(fp_core.load(fp_file, weights_only=True))),
        ("torch.load(mmap=True) + touch", torch_file,
         lambda: touch_pages(torch.load(torch_file, mmap=True, weights_only=True))),
        ("torch.load(mmap=True) + touch + first write", torch_file,
         lambda: write_pages(touch_pages(torch.load(torch_file, mmap=True, weights_only=True)))),
        ("fp_core.load(mmap=True) + touch + first write", fp_file,
         lambda: write_pages(touch_pages(fp_core.load(fp_file, mmap=True, weights_only=True)))),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    fp_file, torch_file = os.path.join(args.dir, "resume-fp.pt"), os.path.join(args.dir, "resume-torch.pt")
    sd = make_state_dict(parse_size(args.size))
    fp_core.save(sd, fp_file)
    torch.save(sd, torch_file)
    del sd
    gc.collect()
    table = rows(fp_file, torch_file)
    secs: dict[str, list[float]] = {name: [] for name, _, _ in table}
    try:
        for r in range(args.rounds):
            order = table if r % 2 == 0 else table[::-1]  # a drift of the disk hits all rows alike
            for name, path, fn in order:
                drop_cache(path)
                settle()
                time.sleep(2.0)
                t0 = time.perf_counter()
                out = fn()
                secs[name].append(time.perf_counter() - t0)
                del out
                gc.collect()
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{s[-1]:.2f}" for s in secs.values()), flush=True)
    finally:
        for p in (fp_file, torch_file):
            os.remove(p)
    base = secs[table[1][0]]
    print(f"\n{parse_size(args.size) / 2**30:.2f} GiB state, {args.rounds} rounds (order alternated); "
          "medians of per-round ratios")
    print(f"{'row':50} {'s':>6} {'vs fp_core.load + first write':>30}")
    for name, _, _ in table:
        s = secs[name]
        print(f"{name:50} {statistics.median(s):6.2f} {statistics.median(b / x for b, x in zip(base, s)):29.2f}x")


if __name__ == "__main__":
    main()
