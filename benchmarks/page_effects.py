"""How the source memory's pages change O_DIRECT write speed on this machine.

Two questions behind engine defaults, measured side by side in rounds (median GB/s):

1. Zero-copy writes (the engine reads the caller's memory) from a buffer backed by
   transparent huge pages vs by 4 KiB pages, and staged writes (copy + CRC-32C into
   the engine's staging buffers) from the same buffers. Decides whether writing live
   tensors (4 KiB pages, torch's allocator) without staging pays off.
2. Staged writes with the engine's staging pool on huge pages (default) vs
   ``FASTPERSIST_HUGE_STAGING=0``, each in a fresh process (the pool is per process).

    python benchmarks/page_effects.py --dir /work/bench-tmp --size 2GiB --repeat 5 > benchmarks/results/page-effects.txt
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fp_core import _native  # noqa: E402
from fp_core.tools.bench_args import size_arg as parse_size  # noqa: E402

MADV_NOHUGEPAGE = 15


def _buffer(size: int, huge: bool) -> tuple[np.ndarray, int]:
    """A page-aligned, filled buffer; numpy advises large arrays as huge pages itself."""
    raw = np.empty(size + 4096, dtype=np.uint8)
    if not huge:
        libc = ctypes.CDLL(None)
        libc.madvise(ctypes.c_void_p(raw.ctypes.data // 4096 * 4096), ctypes.c_size_t(size + 4096),
                     MADV_NOHUGEPAGE)
    buf = raw[-raw.ctypes.data % 4096:][:size]
    buf[:] = 7
    return raw, buf.ctypes.data


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _write(path: str, addr: int, size: int, zero_copy: bool) -> float:
    if os.path.exists(path):
        os.unlink(path)
    os.sync()
    time.sleep(0.3)
    t0 = time.perf_counter()
    with _native.Engine(path, create=True) as eng:
        eng.write([(0, addr, size)], 0, size, checksum=True, zero_copy=zero_copy)
        eng.sync()
    return size / (time.perf_counter() - t0) / 1e9


_CHILD = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
from benchmarks.page_effects import _buffer, _write
size = int(sys.argv[3])
raw, addr = _buffer(size, huge=False)
print(_write(sys.argv[2], addr + 100, size - 4096, zero_copy=False))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="./bench-out")
    ap.add_argument("--size", type=parse_size, default=parse_size("2GiB"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "page-effects.bin")
    size = args.size // 4096 * 4096
    res: dict[str, list[float]] = {}
    huge_raw, huge_addr = _buffer(size, huge=True)
    huge_kib = _anon_huge_kib()
    small_raw, small_addr = _buffer(size, huge=False)
    for _ in range(args.repeat):
        for label, addr in (("huge pages", huge_addr), ("4 KiB pages", small_addr)):
            res.setdefault(f"zero-copy from {label}", []).append(_write(path, addr, size, True))
            res.setdefault(f"staged from {label}", []).append(_write(path, addr, size, False))
        for flag, label in (("1", "staging pool on huge pages (default)"), ("0", "FASTPERSIST_HUGE_STAGING=0")):
            env = dict(os.environ, FASTPERSIST_HUGE_STAGING=flag, PYTHONPATH=REPO)
            out = subprocess.run([sys.executable, "-c", _CHILD, REPO, path, str(size)], env=env,
                                 capture_output=True, text=True, check=True)
            res.setdefault(f"staged (fresh process), {label}", []).append(float(out.stdout.strip()))
    if os.path.exists(path):
        os.unlink(path)
    del huge_raw, small_raw
    print("# python benchmarks/page_effects.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"{size / 2**30:.2f} GiB per write, CRC-32C on, + fdatasync; huge-page buffer had "
          f"{huge_kib / 2**20:.2f} GiB in huge pages; median of {args.repeat} rounds")
    width = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{width}}  {statistics.median(v):5.2f} GB/s   ({' '.join(f'{x:.2f}' for x in v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
