"""What faulting in a fresh snapshot arena costs on this machine, and who pays for it.

Two parts, each repetition in a fresh process started ``--pause`` seconds after the last
(so the memory the previous one freed has gone back to the host where the VM reports free
pages, as a new training process finds it):

* ``fault``: the time and CPU to fault in ``--size`` bytes of anonymous memory, twice in
  the same process, on 2 MiB (transparent huge) and on 4 KiB pages.
* ``beside``: training steps (the async bench's MLP) while another thread faults in a
  2 MiB-page arena of ``--size`` bytes after the first step, the way
  ``AsyncCheckpointer(policy="auto")`` warms its arena on the writer: with 1 or 2 threads,
  at nice 0 or 19. Training's loss is the steps' total minus ``steps x`` the median of the
  steps after the warm-up.

    python benchmarks/fresh_memory.py [--size 1.13e9] [--reps 3] [--pause 15] [--batch 975] \
        > benchmarks/results/fresh-memory.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp_core import _native  # noqa: E402
from fp_core.io.arena import Arena as _Arena  # noqa: E402


def fault(size: int) -> str:
    out = []
    for huge in (True, True, False, False):
        t0, c0 = time.perf_counter(), time.process_time()
        arena = _Arena(size, False, huge=huge)
        _native.populate(arena.buf.data_ptr(), size)
        out.append(f"{'2 MiB' if huge else '4 KiB'} {time.perf_counter() - t0:.2f} s (CPU {time.process_time() - c0:.2f})")
        del arena
    return "; ".join(out)


def beside(size: int, threads: int, nice: int, batch: int) -> str:
    from fp_core.tools.bench_async import Trainer

    tr = Trainer(3072, 10, batch)
    tr.step()
    took: list[float] = []

    def part(addr: int, n: int) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        _native.populate(addr, n)

    def warm() -> None:
        t0 = time.perf_counter()
        arena = _Arena(size, False, huge=True)
        per = -(-size // threads)
        parts = [threading.Thread(target=part, args=(arena.buf.data_ptr() + off, min(per, size - off)))
                 for off in range(0, size, per)]
        for p in parts:
            p.start()
        for p in parts:
            p.join()
        took.append(time.perf_counter() - t0)

    steps, warmer = [], None
    for i in range(6):
        t0 = time.perf_counter()
        tr.step()
        if i == 0:
            warmer = threading.Thread(target=warm)
            warmer.start()
        steps.append(time.perf_counter() - t0)
    assert warmer is not None
    warmer.join()
    quiet = statistics.median(steps[3:])
    return (f"threads {threads} nice {nice:2d}: warm-up {took[0]:.2f} s, steps " + " ".join(f"{s:.2f}" for s in steps)
            + f", training lost {sum(steps) - len(steps) * quiet:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=1.13e9)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pause", type=float, default=15.0)
    ap.add_argument("--batch", type=int, default=975)
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    size = int(a.size)
    if a.child is not None:
        kind, *rest = a.child
        print(fault(size) if kind == "fault" else beside(size, int(rest[0]), int(rest[1]), a.batch), flush=True)
        return
    print(f"# python benchmarks/fresh_memory.py --size {a.size:g} --reps {a.reps} --pause {a.pause:g} --batch {a.batch}")
    runs = [("fault",)] + [("beside", str(t), str(n)) for t, n in ((1, 0), (2, 0), (1, 19))]
    for rep in range(a.reps):
        for r in runs:
            time.sleep(a.pause)
            out = subprocess.run([sys.executable, __file__, "--size", str(size), "--batch", str(a.batch), "--child", *r],
                                 capture_output=True, text=True, check=True).stdout.strip()
            print(f"rep {rep + 1} {r[0]:6s} {out}", flush=True)


if __name__ == "__main__":
    main()
