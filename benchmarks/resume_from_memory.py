"""Resume from the process writer's shared-memory image against resume from disk (issue #40).

    python benchmarks/resume_from_memory.py --gib 2 --rounds 3 --dir DIR > benchmarks/results/resume-from-memory.txt

A state of ``--gib`` GiB (float32 tensors of 256 MiB and a few small ones) is saved with
``AsyncCheckpointer(writer="process", resume_from_memory=True)`` to ``DIR/ckpt.pt`` by a
trainer that is then SIGKILLed (its image stays); the "restart" (this process) then times,
alternated over the rounds:

* ``load``: ``fp_core.load`` from the image (every byte checked: verify=True) against the
  file with the page cache dropped first, verify=True and verify=False;
* ``load_into``: the same into preallocated tensors (``fp_core.load_into``).

Medians over the rounds. Needs root for ``/proc/sys/vm/drop_caches``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fp_core  # noqa: E402
from fp_core.io import memory_image  # noqa: E402
from fp_core.loading import loader
from fp_core.loading.load_in_place import load_into as load_into_file  # noqa: E402


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "fp-resume"))
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "ckpt.pt")
    n = int(a.gib * (1 << 30)) // (256 << 20)
    # The trainer that saved it is killed after its save committed, as a crash would: its
    # image stays in shared memory for the restart (this process), which nobody writes into
    # again (so it is loaded mapped).
    code = ("import os, signal, sys, torch\n"
            f"sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})\n"
            "import fp_core\n"
            "torch.manual_seed(0)\n"
            f"state = {{f'w{{i}}': torch.randn(64 << 20) for i in range({n})}}\n"
            "state.update(step=torch.tensor(7), meta={'lr': 1e-4})\n"
            "ck = fp_core.AsyncCheckpointer(writer='process', resume_from_memory=True)\n"
            f"ck.save(state, {path!r}).result()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(64 << 20) for i in range(n)}
    state.update(step=torch.tensor(7), meta={"lr": 1e-4})
    image = memory_image.find(path)
    assert image is not None and memory_image.frozen(image), "no image left by the killed trainer"
    size = os.path.getsize(path)
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    rows: dict[str, list[float]] = {}
    try:
        for r_ in range(a.rounds):
            hits = memory_image.hits
            rows.setdefault("load, memory image (verify)", []).append(timed(lambda: fp_core.load(path)))
            assert memory_image.hits == hits + 1
            drop_caches()
            rows.setdefault("load, disk (verify)", []).append(timed(lambda: loader.load(path, verify=True)))
            drop_caches()
            rows.setdefault("load, disk (no verify)", []).append(timed(lambda: loader.load(path)))
            rows.setdefault("load_into, memory image (verify)", []).append(
                timed(lambda: fp_core.load_into(target, path)))
            assert memory_image.hits == hits + 2
            drop_caches()
            rows.setdefault("load_into, disk (verify)", []).append(
                timed(lambda: load_into_file(target, path, verify=True)))
            drop_caches()
            rows.setdefault("load_into, disk (no verify)", []).append(timed(lambda: load_into_file(target, path)))
            print(f"round {r_ + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()),
                  flush=True)
        assert all(torch.equal(target[k], state[k]) for k in state if isinstance(state[k], torch.Tensor))
    finally:
        memory_image.clean_stale(memory_image.directory(), superseded_dir=os.path.dirname(os.path.abspath(path)))
    print(f"\ncheckpoint {size / 2**30:.2f} GiB, {a.rounds} rounds alternated, medians "
          f"(page cache dropped before each disk load)")
    print(f"{'':40s} {'s':>7s} {'GB/s':>7s}")
    for k, v in rows.items():
        m = statistics.median(v)
        print(f"{k:40s} {m:7.2f} {size / m / 1e9:7.2f}")


if __name__ == "__main__":
    main()
