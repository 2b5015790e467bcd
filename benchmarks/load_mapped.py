"""Mapped loads side by side on the same files: ``fp_core.load(mmap=True)`` against
``torch.load(mmap=True)``, each followed by a touch of every page, on a file written by
``fp_core.save`` and on one written by ``torch.save`` of the same state.

``fastpersist bench`` reads torch's rows from torch's file and ours from ours; on this VM
the same bytes read through the page cache at different speeds from two files of the same
layout on disk (written at different times), so this script compares readers on one file
at a time. Each round runs every row once, cold (the file's pages dropped, 2 s of settling),
and the ratios are medians of per-round ratios.

    python benchmarks/load_mapped.py --dir DIR --size 4GiB --rounds 3 > benchmarks/results/load-mapped-4GiB.txt
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

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fp_core  # noqa: E402
from fp_core.format.sizes import parse_size  # noqa: E402
from fp_core.tools.bench import drop_cache, load_device, make_state_dict, settle, touch_pages  # noqa: E402


def rows(fp_file: str, torch_file: str, buf: np.ndarray) -> list[tuple[str, str, Callable[[], Any]]]:
    n = os.path.getsize(fp_file) // 4096 * 4096
    return [
        ("device: native Reader, O_DIRECT (fp_core file)", fp_file, lambda: load_device(fp_file, buf, n)),
        ("fp_core file: torch.load(mmap=True) + touch", fp_file,
         lambda: touch_pages(torch.load(fp_file, mmap=True, weights_only=True))),
        ("fp_core file: fp_core.load(mmap=True) + touch", fp_file,
         lambda: touch_pages(fp_core.load(fp_file, mmap=True, weights_only=True))),
        ("fp_core file: fp_core.load(mmap=True, verify=True) + touch", fp_file,
         lambda: touch_pages(fp_core.load(fp_file, mmap=True, verify=True, weights_only=True))),
        ("fp_core file: fp_core.load", fp_file, lambda: fp_core.load(fp_file, weights_only=True)),
        ("torch file: torch.load(mmap=True) + touch", torch_file,
         lambda: touch_pages(torch.load(torch_file, mmap=True, weights_only=True))),
        ("torch file: fp_core.load(mmap=True) + touch", torch_file,
         lambda: touch_pages(fp_core.load(torch_file, mmap=True, weights_only=True))),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    fp_file, torch_file = os.path.join(args.dir, "mapped-fp.pt"), os.path.join(args.dir, "mapped-torch.pt")
    sd = make_state_dict(parse_size(args.size))
    fp_core.save(sd, fp_file)
    torch.save(sd, torch_file)
    del sd
    gc.collect()
    buf = np.empty(os.path.getsize(fp_file), dtype=np.uint8)
    buf[:] = 1  # the device row reads into memory touched before
    table = rows(fp_file, torch_file, buf)
    secs: dict[str, list[float]] = {name: [] for name, _, _ in table}
    try:
        for r in range(args.rounds):
            for name, path, fn in table:
                drop_cache(path)
                settle()
                time.sleep(2.0)
                t0 = time.perf_counter()
                fn()
                gc.collect()
                secs[name].append(time.perf_counter() - t0)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{s[-1]:.2f}" for s in secs.values()), flush=True)
    finally:
        for p in (fp_file, torch_file):
            os.remove(p)
    device = secs[table[0][0]]
    ref_fp, ref_torch = secs[table[1][0]], secs[table[5][0]]
    print(f"\n{parse_size(args.size) / 2**30:.2f} GiB state, {args.rounds} rounds; medians of per-round ratios")
    print(f"{'row':60} {'s':>6} {'vs device':>10} {'vs torch mmap, same file':>25}")
    for i, (name, _, _) in enumerate(table):
        s = secs[name]
        ref = ref_torch if i >= 5 else ref_fp
        vs_dev = statistics.median(d / x for d, x in zip(device, s))
        vs_ref = statistics.median(t / x for t, x in zip(ref, s))
        print(f"{name:60} {statistics.median(s):6.2f} {vs_dev:9.2f}x {vs_ref:24.2f}x")


if __name__ == "__main__":
    main()
