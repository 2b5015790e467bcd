"""Soak: many async saves with rotation in one process; fds, threads and RSS must not grow.

    python benchmarks/soak.py --saves 1000 [--mib 4] [--keep 3] [--every 100] [--json benchmarks/results/reliability-soak.json]

One ``AsyncCheckpointer`` (policy ``--policy``, default ``auto``) saves ``step-{i}.pt``
(``--mib`` MiB, fresh values every save, mutated only after ``fence()``) and keeps the last
``--keep`` files by queueing ``os.unlink`` of the oldest on the worker after each save
(``ckpt.enqueue(os.unlink, old)``, which runs only after the pending saves succeeded).
Every ``--every`` saves it samples open fds (/proc/self/fd), threads and VmRSS, and at
the end checks: no fd or thread growth after warm-up, RSS growth under ``--rss-slack``
MiB, exactly ``--keep`` checkpoints left, none of them torn (the newest is verified), and
no temporary file left.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

import fp_core  # noqa: E402
from fp_core.tools.procinfo import fd_count as fds  # noqa: E402
from fp_core.tools.procinfo import status_field as status  # noqa: E402


def sample(i: int, t0: float) -> dict:
    return {"saves": i, "fds": fds(), "threads": status("Threads"), "rss_mib": round(status("VmRSS") / 1024, 1),
            "elapsed_s": round(time.monotonic() - t0, 1)}


def soak(directory: str, saves: int = 1000, mib: int = 4, keep: int = 3, every: int = 100, policy: str = "auto",
         rss_slack_mib: float = 64.0, log=print) -> dict:
    os.makedirs(directory, exist_ok=True)
    n = mib * (1 << 20) // 4
    model = {"w": torch.empty(n - 4096), "b": torch.empty(4096), "step": 0}
    samples = []
    t0 = time.monotonic()
    with fp_core.AsyncCheckpointer(policy=policy) as ckpt:
        for i in range(1, saves + 1):
            ckpt.fence()  # the "optimizer step"
            model["w"].fill_(float(i))
            model["b"].fill_(-float(i))
            model["step"] = i
            ckpt.save(model, os.path.join(directory, f"step-{i}.pt"))
            if i > keep:
                ckpt.enqueue(os.unlink, os.path.join(directory, f"step-{i - keep}.pt"))
            if i % every == 0:
                ckpt.wait()
                gc.collect()
                s = sample(i, t0)
                samples.append(s)
                log(f"[soak] {json.dumps(s)}")
    wall = time.monotonic() - t0
    gc.collect()
    final = sample(saves, t0)
    left = sorted(os.listdir(directory))
    temps = [x for x in left if x.endswith(".fptmp")]
    finals = [x for x in left if not x.startswith(".")]
    newest = os.path.join(directory, f"step-{saves}.pt")
    fp_core.verify(newest)
    got = fp_core.load(newest, verify=True)
    ok_newest = bool(got["step"] == saves and (got["w"] == float(saves)).all() and (got["b"] == -float(saves)).all())
    # growth measured from the first sample (after warm-up: staging pool, worker, arena)
    base = samples[0] if samples else final
    res = {
        "saves": saves, "mib_per_save": mib, "keep": keep, "policy": policy, "wall_s": round(wall, 1),
        "saves_per_s": round(saves / wall, 1), "samples": samples,
        "fd_growth": max(s["fds"] for s in samples) - base["fds"] if samples else 0,
        "thread_growth": max(s["threads"] for s in samples) - base["threads"] if samples else 0,
        "rss_growth_mib": round(max(s["rss_mib"] for s in samples) - base["rss_mib"], 1) if samples else 0,
        "files_left": finals, "temps_left": temps, "newest_ok": ok_newest,
    }
    res["problems"] = []
    if res["fd_growth"] > 0:
        res["problems"].append(f"fd count grew by {res['fd_growth']}")
    if res["thread_growth"] > 0:
        res["problems"].append(f"thread count grew by {res['thread_growth']}")
    if res["rss_growth_mib"] > rss_slack_mib:
        res["problems"].append(f"RSS grew by {res['rss_growth_mib']} MiB")
    if finals != sorted(f"step-{i}.pt" for i in range(saves - keep + 1, saves + 1)):
        res["problems"].append(f"rotation left {finals}")
    if temps:
        res["problems"].append(f"temporary files left: {temps}")
    if not ok_newest:
        res["problems"].append("newest checkpoint does not hold the last state")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=1000)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--policy", default="auto", choices=["auto", "overlap", "snapshot"])
    ap.add_argument("--rss-slack", type=float, default=64.0, help="allowed RSS growth in MiB")
    ap.add_argument("--root", default="/work/bench-tmp")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    d = os.path.join(a.root, f"soak-{uuid.uuid4().hex[:8]}")
    try:
        res = soak(d, a.saves, a.mib, a.keep, a.every, a.policy, a.rss_slack)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    summary = {k: v for k, v in res.items() if k != "samples"}
    print(f"[soak] RESULT {json.dumps(summary)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
