"""Collective-save scaling: 1, 2 and 4 writer processes writing one checkpoint together.

    python benchmarks/partition_bench.py --dir /path/on/nvme --size 4GiB --writers 1,2,4 \
        > benchmarks/results/partition-4GiB.txt

Each process holds the same state (as data-parallel replicas do), joins a gloo group on
loopback and calls ``fp_core.save(state, path, group=WORLD)``. Reported per run: the bytes
each rank wrote, the wall time of the collective save (max over ranks, from a barrier to
the durable rename) and the aggregate GB/s. On one disk the aggregate cannot grow with
W — the point is that splitting costs nothing and each rank carries 1/W of the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fp_core.format.sizes import parse_size  # noqa: E402


def rank_main(rank: int, world: int, port: str, d: str, size: int, repeat: int) -> None:
    import torch
    import torch.distributed as dist

    import fp_core

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    n_big = 8
    per = size // (n_big * 4)
    state = {f"layer{i}": torch.randn(per, generator=g) for i in range(n_big)}
    state["step"] = 1
    fp_core.save({"warm": torch.ones(1)}, os.path.join(d, "warm.pt"), group=dist.group.WORLD)
    runs = []
    for r in range(repeat):
        path = os.path.join(d, f"ckpt{r}.pt")
        dist.barrier()
        t0 = time.perf_counter()
        st = fp_core.save(state, path, group=dist.group.WORLD)
        dt = time.perf_counter() - t0
        times = [None] * world
        dist.all_gather_object(times, (dt, st.extra["rank_bytes"]))
        runs.append(times)
        if rank == 0:
            os.unlink(path)
    if rank == 0:
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump({"runs": runs, "bytes": st.bytes}, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_world(world: int, d: str, size: int, repeat: int) -> dict:
    os.makedirs(d, exist_ok=True)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port", port,
                               "--dir", d, "--size", str(size), "--repeat", str(repeat)]) for r in range(world)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"rank exited with {p.returncode}")
    with open(os.path.join(d, "result.json")) as f:
        res = json.load(f)
    shutil.rmtree(d)
    walls = [max(t for t, _ in run) for run in res["runs"]]
    wall = statistics.median(walls)
    per_rank = [b for _, b in res["runs"][0]]
    return {"writers": world, "bytes": res["bytes"], "seconds": wall, "gbps": res["bytes"] / wall / 1e9,
            "rank_bytes": per_rank}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="bench-out/partition")
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--writers", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = parse_size(args.size)
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args.dir, size, args.repeat)
        return 0
    rows = [run_world(int(w), os.path.join(args.dir, f"w{w}"), size, args.repeat) for w in args.writers.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    base = rows[0]["gbps"]
    print(f"collective save of {rows[0]['bytes'] / 2**30:.2f} GiB, median of {args.repeat}")
    print(f"{'writers':>7} {'GB/s':>7} {'vs 1':>6} {'seconds':>8}  bytes per rank (N/W = ...)")
    for r in rows:
        nw = r["bytes"] / r["writers"]
        spread = max(abs(b - nw) for b in r["rank_bytes"][1:]) if r["writers"] > 1 else 0
        print(f"{r['writers']:>7} {r['gbps']:>7.2f} {r['gbps'] / base:>6.2f} {r['seconds']:>8.2f}  "
              f"{', '.join(f'{b / 2**20:.1f} MiB' for b in r['rank_bytes'])} (N/W {nw / 2**20:.1f} MiB, "
              f"ranks 1.. within {spread / 1024:.1f} KiB; rank 0 also writes the tail)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
