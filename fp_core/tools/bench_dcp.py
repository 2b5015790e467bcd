"""``fastpersist bench --dcp``: sharded checkpoints, DCP's stock writer and reader against
FastPersist's, side by side in alternated rounds, on an FSDP2 (``fully_shard``) model with
Adam state, every rank a process started by torchrun (gloo, CPU).

Rows, in this order inside every round (the first round warms up and is not counted):

* ``save stock`` / ``save fastpersist``: ``dcp.save`` with ``FileSystemWriter`` (its default
  ``sync_files=True``) / ``FastPersistWriter``, durable when it returns;
* ``async_save blocked stock`` / ``... fastpersist``: the time ``dcp.async_save`` holds the
  caller (its staging copy), with either writer (the rest is waited for, not counted);
* ``AsyncCheckpointer blocked``: ``fp_core.AsyncCheckpointer.save`` of the same state plus
  the fence an optimizer step right after it would wait for (policy ``auto``);
* ``load stock`` / ``load fastpersist`` / ``load fastpersist verify``: ``dcp.load`` into the
  model's state with ``FileSystemReader`` / ``FastPersistReader`` (``verify=True``: every
  byte checked), page cache dropped first when run as root.

Sizes are the bytes of the whole checkpoint (every rank's shards); times are the slowest
rank's (a barrier before and after). Ratios are medians of per-round ratios.
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
import tempfile
import time
from typing import Any

TARGETS = (("save_speedup", ">=", 2.0, "FastPersistWriter save vs FileSystemWriter's"),
           ("async_blocked_ratio", "<=", 1 / 3, "AsyncCheckpointer blocked vs stock dcp.async_save's"),
           ("load_speedup", ">=", 1.5, "FastPersistReader load vs FileSystemReader's"))


def run_dcp(args: argparse.Namespace, log: Any) -> int:
    """Start ``args.ranks`` ranks under torchrun and print (or return as JSON) their report."""
    os.makedirs(args.dir, exist_ok=True)
    if getattr(args, "dry_run", False):
        print(f"dry run: {args.ranks} ranks under torchrun, FSDP2 MLP width {args.width} x {args.layers} layers "
              f"with Adam (~{3 * args.layers * args.width * args.width * 4 / 1e9:.2f} GB), "
              f"{args.warmup_rounds} warm-up + {args.repeat} rounds, dir {args.dir}")
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           "--master-port", str(port), "-m", "fp_core.tools.bench_dcp", "--dir", args.dir,
           "--width", str(args.width), "--layers", str(args.layers), "--rounds", str(args.repeat),
           "--warmup-rounds", str(args.warmup_rounds), "--out", out]
    log(f"running {' '.join(cmd)}")
    try:
        subprocess.run(cmd, check=True)
        with open(out) as f:
            res = json.load(f)
    finally:
        os.unlink(out)
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2) if args.json else format_report(res))
    return 0


def format_report(res: dict) -> str:
    gb = res["bytes"] / 1e9
    lines = [f"{res['ranks']} ranks (torchrun, gloo, CPU), FSDP2 MLP + Adam: {gb:.2f} GB of shards, "
             f"{res['rounds']} rounds after {res['warmup_rounds']} warm-up (medians)",
             f"  {'row':<34} {'seconds':>8} {'GB/s':>7}"]
    for k, v in res["median_s"].items():
        rate = f"{gb / v:7.2f}" if not k.endswith("blocked") and "blocked" not in k and v > 0 else ""
        lines.append(f"  {k:<34} {v:8.3f} {rate}")
    lines.append("")
    for key, op, want, what in TARGETS:
        v = res[key]
        ok = v >= want if op == ">=" else v <= want
        lines.append(f"  [{'PASS' if ok else 'FAIL'}] {what}: {v:.2f}x (target {op} {want:.2f}x)")
    lines.append(f"  per round: save {_fmt(res['per_round']['save_speedup'])}, load "
                 f"{_fmt(res['per_round']['load_speedup'])}, blocked {_fmt(res['per_round']['async_blocked_ratio'])}")
    return "\n".join(lines)


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


# ------------------------------------------------------------------------- a rank


def _build(width: int, layers: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    m(torch.randn(2, width)).sum().backward()
    opt.step()
    return m, opt


def _local_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return (obj.to_local() if hasattr(obj, "to_local") else obj).nbytes
    if isinstance(obj, dict):
        return sum(_local_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_local_bytes(v) for v in obj)
    return 0


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import fp_core
    from fp_core.parallel.dcp import FastPersistReader, FastPersistWriter

    from .bench import drop_all_caches

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    m, opt = _build(args.width, args.layers)
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    total = torch.tensor([_local_bytes(state)], dtype=torch.int64)
    dist.all_reduce(total)
    ckpt = fp_core.AsyncCheckpointer(policy="auto", install_optimizer_hook=False)
    rows: dict[str, list[float]] = {}

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def blocked(fn: Any) -> float:
        """The slowest rank's time inside ``fn``; what ``fn`` returns is then waited for."""
        dist.barrier()
        t0 = time.perf_counter()
        pending = fn()
        t = torch.tensor([time.perf_counter() - t0])
        pending()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def async_save(make: Any, d: str) -> Any:
        fut = dcp.async_save(state, storage_writer=make(d))
        return fut.result

    def checkpointer(d: str) -> Any:
        h = ckpt.save(state, d)
        ckpt.fence()  # what an optimizer step right after the save would wait for
        return h.result

    def one_round(rnd: int) -> dict[str, float]:
        d = {k: os.path.join(args.dir, f"{k}-{rnd}") for k in ("stock", "fastpersist", "async-stock",
                                                                "async-fastpersist", "checkpointer")}
        got = {"save stock": timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(d["stock"]))),
               "save fastpersist": timed(lambda: dcp.save(state, storage_writer=FastPersistWriter(d["fastpersist"]))),
               "async_save blocked stock": blocked(lambda: async_save(dcp.FileSystemWriter, d["async-stock"])),
               "async_save blocked fastpersist": blocked(lambda: async_save(FastPersistWriter,
                                                                            d["async-fastpersist"])),
               "AsyncCheckpointer blocked": blocked(lambda: checkpointer(d["checkpointer"]))}
        for name, make, src in (("load stock", dcp.FileSystemReader, "stock"),
                                ("load fastpersist", FastPersistReader, "fastpersist"),
                                ("load fastpersist verify", lambda p: FastPersistReader(p, verify=True), "fastpersist")):
            dist.barrier()
            if rank == 0:
                os.sync()
                drop_all_caches()
            got[name] = timed(lambda make=make, src=src: dcp.load(state, storage_reader=make(d[src])))
        dist.barrier()
        if rank == 0:
            for p in d.values():
                shutil.rmtree(p, ignore_errors=True)
            os.sync()
        return got

    for rnd in range(args.warmup_rounds + args.rounds):
        got = one_round(rnd)
        if rnd >= args.warmup_rounds:  # the first rounds warm up and are not counted
            for k, v in got.items():
                rows.setdefault(k, []).append(v)
    ckpt.close()
    if rank == 0:
        def ratios(a: str, b: str) -> list[float]:
            return [x / y for x, y in zip(rows[a], rows[b])]

        per_round = {"save_speedup": ratios("save stock", "save fastpersist"),
                     "load_speedup": ratios("load stock", "load fastpersist"),
                     "load_verify_speedup": ratios("load stock", "load fastpersist verify"),
                     "async_blocked_ratio": ratios("AsyncCheckpointer blocked", "async_save blocked stock"),
                     "async_save_blocked_ratio": ratios("async_save blocked fastpersist", "async_save blocked stock")}
        res = {"ranks": world, "bytes": int(total.item()), "rounds": args.rounds, "warmup_rounds": args.warmup_rounds,
               "width": args.width, "layers": args.layers, "page_cache_dropped": os.geteuid() == 0,
               "median_s": {k: statistics.median(v) for k, v in rows.items()}, "rows_s": rows,
               "per_round": per_round, **{k: statistics.median(v) for k, v in per_round.items()}}
        with open(args.out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description="one rank of fastpersist bench --dcp (started by torchrun)")
    p.add_argument("--dir", required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--warmup-rounds", dest="warmup_rounds", type=int, default=1)
    p.add_argument("--out", required=True)
    _worker(p.parse_args())


if __name__ == "__main__":
    main()
