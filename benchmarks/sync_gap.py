"""Where a synchronous save's time goes against the device row, step by step.

The bench's device row writes one buffer (numpy's: huge pages) zero-copy, without
checksums, of constant bytes. A save differs in five ways: it checksums, it stages through
the copy threads, its bytes are the model's (not constant), they come from thousands of
tensors in torch's memory (4 KiB pages unless torch is told otherwise), and it serialises
(pickle, zip layout) and keeps books (extents, CRC assembly, the tail) around the write.
Each row adds one of them, on the same state, alternated in every round so a drift of this
VM's disk hits all alike:

    device             one aligned buffer, zero-copy, no CRC (the bench's row (a))
    device again       the same write once more in the round: how far the disk alone
                       moves one round's ratio (an A/A pair)
    staged+crc         the same buffer through the staging copy with the CRC fused in
    random staged+crc  a buffer of random bytes, the same way
    extents, huge      the plan's extents (every tensor and zip header), staged, with the
                       large tensors' bytes copied into huge-page memory first
    extents            the plan's extents as fp_core.save hands them over (torch's memory)
    fp_core.save       the whole save; its serialize and engine.write times are printed too
    save, plan first   the whole save without the early write (fp_core.saving.early_write): the
                       plan made before the first byte is written
    save, no handover  the whole save with the early write's thread left to wake on its
                       own while the caller pickles (early_write.HANDOVER_S = 0)
    save, congruent    the whole save laid out congruent to the tensors' addresses (the async
                       pipeline's layout) and written zero-copy from torch's memory

Ratios are medians of per-round ratios to the device row.

    python benchmarks/sync_gap.py --dir DIR --size 2GiB --rounds 6 [--only fp_core.save --only ...] \
        > benchmarks/results/sync-gap-2GiB.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fp_core import _native, save
from fp_core.api import prepare  # noqa: E402
from fp_core.format.plan import build  # noqa: E402
from fp_core.format.sizes import parse_size  # noqa: E402
from fp_core.io.writer import _extents  # noqa: E402
from fp_core.saving import early_write  # noqa: E402
from fp_core.tools.bench import _aligned_buffer, make_state_dict, settle  # noqa: E402
from fp_core.tools.common import describe_pages, payload_bytes, remove  # noqa: E402


def engine_write(path: str, extents: list[tuple], end: int, *, checksum: bool, zero_copy: bool) -> float:
    eng = _native.Engine(path, create=True)
    try:
        t0 = time.perf_counter()
        eng.write(extents, 0, end, checksum=checksum, zero_copy=zero_copy)
        eng.sync()
        return time.perf_counter() - t0
    finally:
        eng.close()


def in_huge_pages(obj: object, keep: list) -> object:
    """``obj`` with every tensor of 4 MiB or more copied into memory madvised for huge pages
    (numpy's large arrays are) at a page-aligned address."""
    if isinstance(obj, dict):
        return {k: in_huge_pages(v, keep) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(in_huge_pages(v, keep) for v in obj)
    if not isinstance(obj, torch.Tensor) or obj.nbytes < 4 << 20:
        return obj
    arr = np.empty(obj.nbytes + (2 << 20), dtype=np.uint8)
    at = (-arr.ctypes.data) % (2 << 20)
    keep.append(arr)
    out = torch.from_numpy(arr[at: at + obj.nbytes]).view(obj.dtype).view(obj.shape)
    out.copy_(obj)
    return out


def extents_of(obj: object, keep: list) -> tuple[list[tuple], int]:
    plan = build(obj, 4096)
    keep.append(plan)
    rows = _extents(plan, plan.storages_in(0, plan.tail_start), 0, plan.tail_start, 4096, keep)
    return [r[:4] for r in rows], plan.tail_start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--only", action="append", default=[], help="a row to run (repeat it; device is always run)")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    sd = make_state_dict(parse_size(a.size))
    n = payload_bytes(sd)
    buf = _aligned_buffer((n + 4095) // 4096 * 4096, 4096)
    one = [(0, buf.ctypes.data, buf.nbytes)]
    rbuf = _aligned_buffer(buf.nbytes, 4096)
    rng = np.random.default_rng(1)
    for at in range(0, rbuf.nbytes, 64 << 20):
        m = min(64 << 20, rbuf.nbytes - at)
        rbuf[at: at + m] = rng.integers(0, 256, m, dtype=np.uint8)
    rnd = [(0, rbuf.ctypes.data, rbuf.nbytes)]
    keep: list = []
    ext, end = extents_of(sd, keep)
    ext_huge, end_huge = extents_of(in_huge_pages(sd, keep), keep)
    raw = os.path.join(a.dir, "gap.bin")
    split: dict[str, list[float]] = {"serialize": [], "engine.write": []}

    def fp_save() -> float:
        t0 = time.perf_counter()
        st = save(sd, os.path.join(a.dir, "gap.pt"))
        split["serialize"].append(st.serialize_seconds)
        split["engine.write"].append(st.write_seconds)
        return time.perf_counter() - t0

    def fp_save_with(setting: str, value: object) -> Callable[[], float]:
        """The whole save with ``early_write.<setting>`` at ``value`` while it runs."""
        def run() -> float:
            saved = getattr(early_write, setting)
            setattr(early_write, setting, value)
            try:
                t0 = time.perf_counter()
                save(sd, os.path.join(a.dir, "gap.pt"))
                return time.perf_counter() - t0
            finally:
                setattr(early_write, setting, saved)
        return run

    def fp_save_congruent() -> float:
        t0 = time.perf_counter()
        prepare(sd, os.path.join(a.dir, "gap.pt"), congruent=True).run()
        return time.perf_counter() - t0

    rows: dict[str, Callable[[], float]] = {
        "device": lambda: engine_write(raw, one, buf.nbytes, checksum=False, zero_copy=True),
        "device again": lambda: engine_write(raw, one, buf.nbytes, checksum=False, zero_copy=True),
        "staged+crc": lambda: engine_write(raw, one, buf.nbytes, checksum=True, zero_copy=False),
        "random staged+crc": lambda: engine_write(raw, rnd, rbuf.nbytes, checksum=True, zero_copy=False),
        "extents, huge": lambda: engine_write(raw, ext_huge, end_huge, checksum=True, zero_copy=False),
        "extents": lambda: engine_write(raw, ext, end, checksum=True, zero_copy=True),
        "fp_core.save": fp_save,
        "save, plan first": fp_save_with("MIN_BYTES", 1 << 62),
        "save, no handover": fp_save_with("HANDOVER_S", 0),
        "save, congruent": fp_save_congruent,
    }
    if a.only:
        wanted = {"device", *a.only}
        unknown = wanted - set(rows)
        if unknown:
            ap.error(f"unknown rows {sorted(unknown)}; rows: {', '.join(rows)}")
        rows = {k: v for k, v in rows.items() if k in wanted}
    print(f"{n / 2**30:.2f} GiB in {len(ext)} extents (tensors and zip headers); "
          f"{a.rounds} rounds, order alternated", flush=True)
    print(describe_pages(sd)[1], flush=True)
    times: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(a.rounds + 1):  # round 0 warms up
        order = list(rows) if r % 2 else list(reversed(rows))
        for k in order:
            for name in os.listdir(a.dir):
                remove(os.path.join(a.dir, name))
            settle()
            dt = rows[k]()
            if r:
                times[k].append(dt)
        if not r:
            for v in split.values():
                v.clear()
            continue
        print(f"round {r}: " + ", ".join(f"{k} {times[k][-1]:.3f} s" for k in rows), flush=True)
    dev = times["device"]
    for k, ts in list(times.items()) + [(f"  {k}", v) for k, v in split.items() if v]:  # v: fp_core.save ran
        ratios = [d / t for d, t in zip(dev, ts)]
        print(f"{k:18s} median {statistics.median(ts):.3f} s  {n / statistics.median(ts) / 1e9:6.2f} GB/s  "
              f"vs device {statistics.median(ratios):.2f}x  per round {' '.join(f'{x:.2f}' for x in ratios)}")
    for name in os.listdir(a.dir):
        remove(os.path.join(a.dir, name))


if __name__ == "__main__":
    main()
