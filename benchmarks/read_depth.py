"""How many reads in flight, and how large, a cold read wants: the native reader into memory
touched before (the device row), ``fp_core.load_into`` (into a built state) and
``fp_core.load`` (into fresh memory), each at several ``threads:chunk MiB`` settings,
alternated in every round, page cache dropped before each read.

    python benchmarks/read_depth.py --dir D --size 2GiB --rounds 6 \\
        --device 4:4,8:8,16:4,32:2 --into 4:4,32:2 --load 4:4,32:2 > benchmarks/results/read-depth-2GiB.txt

Prints each setting's median seconds and its median per-round ratio to the first device
setting's. The settings FastPersist uses are ``fp_core.io.read_depth``'s.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

from fp_core import _native
from fp_core.api import load_into, prepare
from fp_core.format.sizes import parse_size
from fp_core.io import read_depth
from fp_core.loading.loader import load
from fp_core.tools.bench import _aligned_buffer, drop_cache, make_state_dict, save_device, settle

MiB = 1 << 20


def settings(text: str) -> list[tuple[int, int]]:
    """``"4:4,32:2"`` -> [(4, 4 MiB), (32, 2 MiB less two pages)]: a 2 MiB chunk is
    FastPersist's own (fp_core.io.read_depth.CHUNK), whose staging buffer stays within one huge page."""
    out = []
    for part in filter(None, text.split(",")):
        threads, mib = part.split(":")
        chunk = int(mib) * MiB
        out.append((int(threads), read_depth.CHUNK if chunk == 2 * MiB else chunk))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--device", default="4:4,8:8,16:4,32:2", help="threads:chunk MiB settings of the device row")
    ap.add_argument("--into", default="4:4,32:2", help="... of load_into's scatter read")
    ap.add_argument("--load", default="4:4,32:2", help="... of fp_core.load's whole-file read")
    args = ap.parse_args()
    size = parse_size(args.size)
    os.makedirs(args.dir, exist_ok=True)
    ckpt, raw = os.path.join(args.dir, "depth.ckpt"), os.path.join(args.dir, "depth.bin")
    buf = _aligned_buffer(size, 2 * MiB)  # numpy puts it on huge pages, as the bench's device row
    for p in (ckpt, raw):
        if os.path.exists(p):
            os.unlink(p)
    sd = make_state_dict(size, seed=0)
    prepare(sd, ckpt).run()
    save_device(raw, buf, {})
    del sd
    gc.collect()
    target = make_state_dict(size, seed=1) if args.into else None

    def device(threads: int, chunk: int) -> None:
        with _native.Reader(raw, direct=True) as r:
            r.read_into(0, buf.ctypes.data, size, checksum=False, threads=threads, chunk_bytes=chunk)

    def into(threads: int, chunk: int) -> None:
        read_depth.THREADS, read_depth.CHUNK = threads, chunk
        load_into(target, ckpt)

    def fresh(threads: int, chunk: int) -> None:
        read_depth.THREADS, read_depth.CHUNK = threads, chunk
        load(ckpt, weights_only=True)

    rows: dict[str, tuple[str, Callable[[], None]]] = {}
    for name, fn, text, path in (("device", device, args.device, raw), ("load_into", into, args.into, ckpt),
                                 ("fp_core.load", fresh, args.load, ckpt)):
        for threads, chunk in settings(text):
            rows[f"{name} {threads}x{chunk / MiB:.2f} MiB"] = (path, lambda fn=fn, t=threads, c=chunk: fn(t, c))
    times: dict[str, list[float]] = {k: [] for k in rows}
    for rnd in range(args.rounds):
        order = list(rows) if rnd % 2 == 0 else list(rows)[::-1]
        for key in order:
            path, fn = rows[key]
            drop_cache(path)
            settle(0.3)
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    ref = next(iter(rows))
    for key, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(times[ref], ts))
        print(f"{key:32s} {statistics.median(ts):.3f} s  {size / statistics.median(ts) / 1e9:.2f} GB/s  "
              f"vs {ref}: {ratio:.3f}")
    for p in (ckpt, raw):
        os.unlink(p)


if __name__ == "__main__":
    main()
