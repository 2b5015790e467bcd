"""What a disk write alone costs a CPU-bound training step on this machine, measured
with fio (an independent writer: its own buffer, no checksums, no Python, ~2% of a core).

The async benchmark's ``disk`` row measures the same floor with FastPersist's engine;
this script checks it with a tool that shares no code with FastPersist. Each repetition
times training steps with no I/O, with fio writing O_DIRECT in the background, and with
no I/O again; the cost is the step's slowdown against the mean of the two quiet runs,
and the training seconds lost per GB fio wrote meanwhile.

    python benchmarks/disk_interference.py --dir /path/on/the/disk [--reps 4] [--batch N]

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

from fp_core.bench_async import Trainer, calibrate_batch  # noqa: E402


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="directory on the disk to measure")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed run (median)")
    ap.add_argument("--batch", type=int, help="default: a ~2 s step, as bench --async")
    ap.add_argument("--bs", default="8M")
    ap.add_argument("--iodepth", type=int, default=8)
    ap.add_argument("--size", default="4G")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio not found: apt-get install fio")
    workdir = tempfile.mkdtemp(prefix="disk-interference-", dir=args.dir)
    try:
        tr = Trainer(3072, 10, args.batch or 8)
        batch = args.batch or calibrate_batch(tr, 2000.0)
        tr.set_batch(batch)
        tr.step()
        print(f"MLP 10x3072, batch {batch}; fio O_DIRECT io_uring bs={args.bs} iodepth={args.iodepth}")
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
