"""What a disk write alone costs a CPU-bound training step on this machine, measured
with fio (an independent writer: its own buffer, no checksums, no Python, little CPU),
and with the native engine writing from 4 KiB pages and from 2 MiB (transparent huge)
pages, alternated (``--pages``): the measurement behind AsyncCheckpointer(huge_pages=True).

The async benchmark's ``disk`` row measures the same floor with FastPersist's engine;
this script checks it with a tool that shares no code with FastPersist. Each repetition
times training steps with no I/O, with fio writing O_DIRECT in the background, and with
no I/O again; the cost is the step's slowdown against the mean of the two quiet runs,
and the training seconds lost per GB fio wrote meanwhile.

    python benchmarks/disk_interference.py --dir /path/on/the/disk [--reps 4] [--batch N] [--pages] \
        > benchmarks/results/disk-interference.txt

Needs ``fio`` (``apt-get install fio``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp_core.tools.bench_async import Trainer, calibrate_batch  # noqa: E402


def median_step(tr: Trainer, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        tr.step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def with_fio(tr: Trainer, args: argparse.Namespace, workdir: str) -> tuple[float, float]:
    """Median step while fio writes; fio's bandwidth in MB/s."""
    out = os.path.join(workdir, "fio.json")
    cmd = ["fio", "--name=floor", f"--filename={os.path.join(workdir, 'fio.dat')}", "--rw=write",
           f"--bs={args.bs}", "--direct=1", "--ioengine=io_uring", f"--iodepth={args.iodepth}",
           f"--size={args.size}", "--time_based", "--runtime=600", "--zero_buffers",
           "--output-format=json", f"--output={out}"]
    p = subprocess.Popen(cmd)
    try:
        time.sleep(0.5)  # fio's start-up (file layout) is not part of the write
        step = median_step(tr, args.steps)
    finally:
        p.terminate()
        p.wait()
    with open(out) as f:
        text = f.read()
    job = json.loads(text[text.index("{"):])["jobs"][0]["write"]
    return step, job["bw_bytes"] / 1e6


def with_engine(tr: Trainer, args: argparse.Namespace, path: str, addr: int, nbytes: int) -> tuple[float, float]:
    """Median step while the native engine rewrites ``path`` from [addr, addr+nbytes) in a loop."""
    import threading

    from fp_core import _native
    stop, rate = threading.Event(), []

    def loop() -> None:
        with _native.Engine(path, backend="auto", create=False) as eng:
            t0, done = time.perf_counter(), 0
            while not stop.is_set():
                eng.write([(0, addr, nbytes)], 0, nbytes, checksum=False, zero_copy=True)
                done += nbytes
            rate.append(done / (time.perf_counter() - t0) / 1e6)

    th = threading.Thread(target=loop)
    th.start()
    try:
        time.sleep(0.3)
        step = median_step(tr, args.steps)
    finally:
        stop.set()
        th.join()
    return step, rate[0]


def pages(tr: Trainer, args: argparse.Namespace, workdir: str) -> None:
    import mmap

    import torch

    from fp_core import _native
    nbytes = 1 << 30
    bufs = {}
    for kind in ("4 KiB", "2 MiB"):
        mm = mmap.mmap(-1, nbytes + (4 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        start = -whole.data_ptr() % (2 << 20)
        buf = whole[start:start + nbytes]
        if kind == "2 MiB":
            _native.advise_huge(buf.data_ptr(), nbytes)  # before the first touch
        buf.fill_(7)
        bufs[kind] = (mm, buf)
    path = os.path.join(workdir, "engine.dat")
    with _native.Engine(path, backend="auto", create=True) as eng:
        eng.write([(0, bufs["4 KiB"][1].data_ptr(), nbytes)], 0, nbytes, checksum=False, zero_copy=True)
    median_step(tr, 2)  # filling 2 GiB just now leaves the next steps slow: settle first
    print("\nnative engine rewriting 1 GiB in a loop (O_DIRECT, zero-copy), source pages alternated")
    print(f"{'rep':>3}  {'pages':>5}  {'quiet step s':>12}  {'with writes s':>13}  {'slowdown':>8}  {'MB/s':>6}  {'s lost per GB':>13}")
    lost: dict[str, list[float]] = {k: [] for k in bufs}
    for rep in range(args.reps):
        for kind in (list(bufs) if rep % 2 == 0 else list(bufs)[::-1]):
            before = median_step(tr, args.steps)
            busy, mbps = with_engine(tr, args, path, bufs[kind][1].data_ptr(), nbytes)
            after = median_step(tr, args.steps)
            quiet = (before + after) / 2
            per_gb = (busy - quiet) / (busy * mbps / 1e3)
            lost[kind].append(per_gb)
            print(f"{rep + 1:>3}  {kind:>5}  {quiet:>12.3f}  {busy:>13.3f}  {busy / quiet - 1:>+8.1%}  {mbps:>6.0f}  "
                  f"{per_gb:>13.3f}", flush=True)
    for kind, v in lost.items():
        print(f"from {kind} pages: training seconds lost per GB written, median {statistics.median(v):.3f} "
              f"(min {min(v):.3f}, max {max(v):.3f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="directory on the disk to measure")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed run (median)")
    ap.add_argument("--batch", type=int, help="default: a ~2 s step, as bench --async")
    ap.add_argument("--bs", default="8M")
    ap.add_argument("--iodepth", type=int, default=8)
    ap.add_argument("--size", default="4G")
    ap.add_argument("--pages", action="store_true", help="also: the engine from 4 KiB vs 2 MiB pages")
    ap.add_argument("--no-fio", action="store_true", help="skip the fio part")
    args = ap.parse_args()
    if not args.no_fio and shutil.which("fio") is None:
        raise SystemExit("fio not found: apt-get install fio (or --no-fio)")
    workdir = tempfile.mkdtemp(prefix="disk-interference-", dir=args.dir)
    try:
        tr = Trainer(3072, 10, args.batch or 8)
        batch = args.batch or calibrate_batch(tr, 2000.0)
        tr.set_batch(batch)
        tr.step()
        print(f"MLP 10x3072, batch {batch}")
        if args.pages:
            pages(tr, args, workdir)
        if args.no_fio:
            return 0
        print(f"\nfio O_DIRECT io_uring bs={args.bs} iodepth={args.iodepth}")
        print(f"{'rep':>3}  {'quiet step s':>12}  {'with fio s':>10}  {'slowdown':>8}  {'fio MB/s':>8}  {'s lost per GB':>13}")
        lost = []
        for rep in range(args.reps):
            before = median_step(tr, args.steps)
            busy, mbps = with_fio(tr, args, workdir)
            after = median_step(tr, args.steps)
            quiet = (before + after) / 2
            per_gb = (busy - quiet) / (busy * mbps / 1e3)
            lost.append(per_gb)
            print(f"{rep + 1:>3}  {quiet:>12.3f}  {busy:>10.3f}  {busy / quiet - 1:>+8.1%}  {mbps:>8.0f}  {per_gb:>13.3f}",
                  flush=True)
        print(f"training seconds lost per GB written: median {statistics.median(lost):.3f} "
              f"(min {min(lost):.3f}, max {max(lost):.3f})")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
