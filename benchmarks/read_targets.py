"""What a read lands in: O_DIRECT reads into huge pages or 4 KiB pages, and ``load_into``
into torch's tensors (read through the reader's staging buffers and copied, where their
addresses do not agree with the file's offsets modulo the block) or into tensors placed
where they agree (read straight in), on 4 KiB pages or on huge pages.

``fastpersist bench``'s device row reads into numpy's buffer, which asks for transparent
huge pages; torch's tensors sit on 4 KiB pages, 64 bytes past a page, unless
``THP_MEM_ALLOC_ENABLE=1``; a file written by a sync ``fp_core.save`` starts its storages
on 4 KiB blocks. This script separates those effects on one file, cold (its pages dropped,
2 s of settling before each row), the rows' order rotated from round to round; ratios are
medians of per-round ratios to the device row.

    python benchmarks/read_targets.py --dir DIR --size 2GiB --rounds 8 > benchmarks/results/read-targets-2GiB.txt
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
from fp_core.loading import load_in_place  # noqa: E402
from fp_core.tools.bench import (  # noqa: E402
    _aligned_buffer,
    _small_page_buffer,
    drop_cache,
    load_device,
    make_state_dict,
    settle,
)


def file_offsets(target: Any, path: str) -> dict[int, int]:
    """id of each target tensor -> the file offset of its bytes (a first load_into, recorded)."""
    seen: dict[int, int] = {}
    real = load_in_place._read_fills

    def record(cf: Any, view: Any, fills: list, *rest: Any) -> None:
        for f in fills:
            seen[id(f.target)] = f.offset
        real(cf, view, fills, *rest)

    load_in_place._read_fills = record
    try:
        fp_core.load_into(target, path)
    finally:
        load_in_place._read_fills = real
    return seen


def placed_like_the_file(target: Any, offsets: dict[int, int], arena: np.ndarray) -> Any:
    """``target`` with every tensor replaced by one of the same shape and dtype at
    ``arena``'s address + its bytes' offset in the file: aligned like the file."""
    base = torch.from_numpy(arena)

    def place(o: Any) -> Any:
        if isinstance(o, torch.Tensor) and id(o) in offsets:
            off = offsets[id(o)]
            return base[off: off + o.numel() * o.element_size()].view(o.dtype).view(o.shape)
        if isinstance(o, dict):
            return {k: place(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(place(v) for v in o)
        return o

    return place(target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--verify", action="store_true", help="load_into(verify=True)")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    nbytes = parse_size(args.size)
    fp_file, raw_file = os.path.join(args.dir, "targets-fp.pt"), os.path.join(args.dir, "targets-raw.bin")
    sd = make_state_dict(nbytes)
    fp_core.save(sd, fp_file)
    del sd
    gc.collect()
    size = os.path.getsize(fp_file)
    with open(raw_file, "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(-(-size // len(block))):
            f.write(block)
        os.fsync(f.fileno())
    target = make_state_dict(nbytes, seed=1)  # torch's allocations, as a resume builds them
    offsets = file_offsets(target, fp_file)
    huge = _aligned_buffer(size, 4096)  # numpy's: transparent huge pages where the kernel gives them
    small = _small_page_buffer(size)
    on_small, on_huge = placed_like_the_file(target, offsets, small), placed_like_the_file(target, offsets, huge)
    gb = size / 1e9

    def into(t: Any) -> Callable[[], Any]:
        return lambda: fp_core.load_into(t, fp_file, verify=args.verify)

    table: list[tuple[str, str, Callable[[], Any]]] = [
        ("device row: into huge pages (numpy's buffer)", raw_file, lambda: load_device(raw_file, huge, size)),
        ("native reader into 4 KiB pages", raw_file, lambda: load_device(raw_file, small, size)),
        ("load_into torch's tensors (staged: page + 64)", fp_file, into(target)),
        ("load_into tensors aligned like the file, 4 KiB pages", fp_file, into(on_small)),
        ("load_into tensors aligned like the file, huge pages", fp_file, into(on_huge)),
    ]
    secs: dict[str, list[float]] = {name: [] for name, _, _ in table}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in table}
    try:
        for r in range(args.rounds):
            k = r % len(table)
            for name, path, fn in table[k:] + table[:k]:  # a drift of the disk hits all rows alike
                drop_cache(path)
                settle(2.0)
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                secs[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{s[-1]:.2f}" for s in secs.values()), flush=True)
    finally:
        for p in (fp_file, raw_file):
            os.remove(p)
    base = secs[table[0][0]]
    print(f"\n{nbytes / 2**30:.2f} GiB state ({size / 1e9:.2f} GB file), {args.rounds} rounds (order rotated), "
          f"load_into verify={args.verify}; medians, ratios of per-round ratios")
    print(f"{'row':56} {'s':>6} {'GB/s':>6} {'vs device':>10} {'CPU s':>6}")
    for name, _, _ in table:
        s = secs[name]
        ratio = statistics.median(b / x for b, x in zip(base, s))
        print(f"{name:56} {statistics.median(s):6.2f} {gb / statistics.median(s):6.2f} {ratio:9.2f}x "
              f"{statistics.median(cpu[name]):6.2f}")


if __name__ == "__main__":
    main()
