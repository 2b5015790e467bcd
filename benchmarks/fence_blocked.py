"""Blocked time of a save followed at once by the fence, against torch.save + fsync.

A loop that checkpoints at the end of a step calls ``save()`` and then, at once, the next
``optimizer.step()``: its fence. What the training thread waits for is ``save()`` plus
that fence. Each round runs every mode once on the same state (alternated, so a drift of
this VM's speed hits all alike); the ratio is the median of per-round ratios to
torch.save + fsync of the same state.

    python benchmarks/fence_blocked.py --dir DIR --sizes 100MB,260MB,1GB --rounds 5 [--tensors 48] [--crc-impl sse4.2] \
        > benchmarks/results/fence-blocked.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fp_core  # noqa: E402
from fp_core.format.sizes import parse_size  # noqa: E402
from fp_core.tools.bench import make_state_dict  # noqa: E402

MODES = {
    "overlap, fence copies the rest": dict(policy="overlap"),
    "overlap, fence waits for the write": dict(policy="overlap", fence_copies_rest=False),
    "snapshot (warm arena)": dict(policy="snapshot"),
    "auto (warm arena)": dict(policy="auto"),
}


def torch_save(sd: dict, path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sizes", default="100MB,260MB,1GB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=0,
                    help="a state of this many equal float32 tensors (model + Adam-like), instead of the "
                         "bench's 2412-tensor state, whose pickling (inside save()) then dominates")
    ap.add_argument("--crc-impl", default="best",
                    help="the CRC-32C implementation to measure with (fp_core._native.crc32c_impl): "
                         "software, sse4.2, vpclmulqdq or best")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    print(f"crc32c: {fp_core._native.crc32c_impl(args.crc_impl)}")
    print(f"{'state':>8}  {'mode':<36} {'blocked s':>10} {'vs torch.save+fsync':>20}  per round")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        sd = (make_state_dict(size) if not args.tensors else
              {f"t{i}": torch.randn(size // args.tensors // 4) for i in range(args.tensors)})
        base = os.path.join(args.dir, "fence")
        ckpts = {m: fp_core.AsyncCheckpointer(install_optimizer_hook=False, **o) for m, o in MODES.items()}
        for ck in ckpts.values():  # warm-up: arenas warm, first-save effects gone
            for _ in range(2):
                ck.save(sd, f"{base}.pt")
                ck.fence()
                ck.save(sd, f"{base}.pt").result()  # not wait(): it skips auto's arena warm-up
                time.sleep(1 + size / 1e9)  # the warm-up after it
        torch_s: list[float] = []
        blocked: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            torch_s.append(torch_save(sd, f"{base}-torch.pt"))
            for m, ck in ckpts.items():
                t0 = time.perf_counter()
                ck.save(sd, f"{base}.pt")
                ck.fence()
                blocked[m].append(time.perf_counter() - t0)
                ck.wait()
        for ck in ckpts.values():
            ck.close()
        mb = sum(t.numel() * t.element_size() for t in _tensors(sd)) / 1e6
        print(f"{mb:>6.0f}MB  {'torch.save + fsync':<36} {statistics.median(torch_s):>10.3f} {'100%':>20}")
        for m, xs in blocked.items():
            ratios = [b / t for b, t in zip(xs, torch_s)]
            print(f"{'':>8}  {m:<36} {statistics.median(xs):>10.3f} {statistics.median(ratios) * 100:>19.1f}%  "
                  + ", ".join(f"{r * 100:.0f}" for r in ratios))
        for p in (f"{base}.pt", f"{base}-torch.pt"):
            if os.path.exists(p):
                os.remove(p)
    return 0


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


if __name__ == "__main__":
    sys.exit(main())
