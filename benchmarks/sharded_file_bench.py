"""Issue #39: one torch.save file of a sharded (FSDP2) state, ``layout="file"``, against the
ways users get one file today and against our own DCP directory.

Run under torchrun (gloo, CPU), every rank one process::

    .venv/bin/torchrun --nproc-per-node 4 benchmarks/sharded_file_bench.py --dir DIR --keep DIR/full.pt > benchmarks/results/sharded-file.txt
    .venv/bin/torchrun --nproc-per-node 2 benchmarks/sharded_file_bench.py --dir DIR --load DIR/full.pt >> benchmarks/results/sharded-file.txt

The first command times the save rows and keeps one ``layout="file"`` file; the second
loads that file on another world size. The model is an FSDP2 (``fully_shard``) MLP with
Adam after one step (exp_avg and exp_avg_sq exist): ``3 * layers * width**2 * 4`` bytes of
tensors (4096 x 6: 1.21 GB).

Save rows, all of them in every round, the order rotated by one each round:

* ``ours file``: ``fp_core.save(sharded state, path, layout="file")``, every rank writing its
  rows of one torch.save file of the full state;
* ``(a) gather+torch.save``: ``get_state_dict(full_state_dict=True, cpu_offload=True)``, rank
  0 ``torch.save`` + fsync (Lightning's and the HF Trainer's full-state path);
* ``(b) dcp+dcp_to_torch_save``: ``dcp.save`` with ``FileSystemWriter``, then rank 0
  ``format_utils.dcp_to_torch_save`` + fsync;
* ``(c) dcp hf consolidated``: ``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True,
  enable_consolidation=True)`` (safetensors; its tensors only: safetensors holds no
  param_groups), the consolidated files fsynced by rank 0;
* ``(d) ours dcp``: ``fp_core.save(sharded state, dir)`` (``layout="dcp"``).

Load rows (``--load``), on the world size of the run: ``ours load_into`` (DTensor targets,
each rank reading its rows) against ``stock torch.load`` (every rank reads the whole file,
then ``set_state_dict(full_state_dict=True)``) and the same with ``mmap=True``. After every
load row a checksum of each rank's shards is compared with the first row's.

Times are rank 0's from a barrier before to a barrier after (so the slowest rank's). With
``--drop-caches`` (root) every row, save and load alike, starts after ``sync`` and
``echo 1 > /proc/sys/vm/drop_caches``. Ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fp_core.tools.bench_dcp import _build as build  # the same FSDP2 MLP + Adam as `fastpersist bench --dcp`
from fp_core.tools.bench_dcp import _local_bytes as local_bytes


def fsync_path(path: str) -> None:
    """fsync a file, or every file under a directory, and the directories holding them."""
    files = [path] if os.path.isfile(path) else \
        [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in {os.path.dirname(f) for f in files} | {os.path.dirname(path)}:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def tensors_only(state: dict) -> dict:
    """The flattened tensors of a state dict (what safetensors can hold)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, o: Any) -> None:
        if isinstance(o, torch.Tensor):
            out[prefix] = o
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", state)
    return out


def shard_checksum(m: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """A sum over this rank's parameter and Adam shards: equal after equal loads."""
    total = 0.0
    with torch.no_grad():
        for p in m.parameters():
            total += float(p.to_local().double().sum())
            for v in opt.state[p].values():
                if isinstance(v, torch.Tensor):
                    total += float((v.to_local() if hasattr(v, "to_local") else v).double().sum())
    return total


def report(title: str, rows: dict[str, list[float]], base: str, gb: float, rounds: int) -> list[str]:
    lines = [title, f"  {'row':<28} {'median s':>9} {'GB/s':>6} {'vs ' + base:>14}   per round (s)"]
    for k, v in rows.items():
        if not v:
            continue
        ratio = statistics.median(x / b for x, b in zip(v, rows[base]))
        lines.append(f"  {k:<28} {statistics.median(v):9.3f} {gb / statistics.median(v):6.2f} "
                     f"{ratio:13.2f}x   {' '.join(f'{x:.2f}' for x in v)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-rounds", type=int, default=1)
    ap.add_argument("--drop-caches", action="store_true", help="sync + drop the page cache before every row (root)")
    ap.add_argument("--keep", help="after the save rows, save one layout='file' file here (for --load)")
    ap.add_argument("--load", help="time loads of this layout='file' file instead of the save rows")
    args = ap.parse_args()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    import fp_core

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.makedirs(args.dir, exist_ok=True)
    m, opt = build(args.width, args.layers)
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    total = torch.tensor([local_bytes(state)], dtype=torch.int64)
    dist.all_reduce(total)
    gb = int(total.item()) / 1e9
    dropped = False

    def timed(fn: Callable[[], Any], cleanup: list[str]) -> float:
        nonlocal dropped
        dist.barrier()
        if rank == 0:
            for p in cleanup:
                remove(p)
            if args.drop_caches:
                dropped = drop_caches()
            else:
                os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def d(name: str) -> str:
        return os.path.join(args.dir, name)

    if args.load:
        load_rows(args, m, opt, gb, world, rank, timed, set_state_dict, StateDictOptions, get_state_dict)
        dist.destroy_process_group()
        return

    def ours() -> None:
        fp_core.save(state, d("ours.pt"), layout="file")

    # rank 0's time in the first part of the two-step rows: where their time goes
    parts: dict[str, list[float]] = {"(a) of which the gather": [], "(b) of which dcp.save": []}

    def gather() -> None:
        t0 = time.perf_counter()
        fm, fo = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        parts["(a) of which the gather"].append(time.perf_counter() - t0)
        if rank == 0:
            torch.save({"model": fm, "optim": fo}, d("gather.pt"))
            fsync_path(d("gather.pt"))

    def dcp_convert() -> None:
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(d("dcp")))
        dist.barrier()
        parts["(b) of which dcp.save"].append(time.perf_counter() - t0)
        if rank == 0:
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(d("dcp"), d("dcp.pt"))
            fsync_path(d("dcp.pt"))

    hf_note = ""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
    except ImportError as e:
        HuggingFaceStorageWriter = None  # noqa: N806
        hf_note = f"(c) skipped: this torch has no HuggingFaceStorageWriter ({e})"
    flat = tensors_only(state)
    hf_files: set[str] = set()

    def hf() -> None:
        dcp.save(flat, storage_writer=HuggingFaceStorageWriter(d("hf"), save_distributed=True,
                                                               enable_consolidation=True))
        dist.barrier()
        if rank == 0:
            fsync_path(d("hf"))
            hf_files.update(f for f in os.listdir(d("hf")) if f.endswith(".safetensors"))

    def ours_dcp() -> None:
        fp_core.save(state, d("ours-dcp"))

    rows_fn: dict[str, tuple[Callable[[], None], list[str]]] = {
        "ours file": (ours, [d("ours.pt")]),
        "(a) gather+torch.save": (gather, [d("gather.pt")]),
        "(b) dcp+dcp_to_torch_save": (dcp_convert, [d("dcp"), d("dcp.pt")]),
        "(c) dcp hf consolidated": (hf, [d("hf")]),
        "(d) ours dcp": (ours_dcp, [d("ours-dcp")]),
    }
    if HuggingFaceStorageWriter is None:
        del rows_fn["(c) dcp hf consolidated"]
    names = list(rows_fn)
    rows: dict[str, list[float]] = {k: [] for k in names}
    for rnd in range(args.warmup_rounds + args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for k in order:
            fn, paths = rows_fn[k]
            t = timed(fn, paths)
            if rnd >= args.warmup_rounds:  # the first rounds warm up and are not counted
                rows[k].append(t)
    dist.barrier()
    if rank == 0:
        ours_size = os.path.getsize(d("ours.pt"))
        for _fn, paths in rows_fn.values():
            for p in paths:
                remove(p)
    if args.keep:
        fp_core.save(state, args.keep, layout="file")
    if rank == 0:
        lines = [f"{world} ranks (torchrun, gloo, CPU), FSDP2 MLP {args.width} x {args.layers} + Adam after one step: "
                 f"{gb:.2f} GB of tensors, one-file size {ours_size / 1e9:.2f} GB; {args.rounds} rounds after "
                 f"{args.warmup_rounds} warm-up, rows alternated (order rotated each round); "
                 f"page cache {'dropped before every row' if dropped else 'not dropped (sync before every row)'}"]
        lines += report("save", rows, "ours file", gb, args.rounds)
        for k, v in parts.items():
            v = v[args.warmup_rounds:]
            lines.append(f"  {k}: median {statistics.median(v):.3f} s ({' '.join(f'{x:.2f}' for x in v)})")
        if hf_note:
            lines.append("  " + hf_note)
        else:
            lines.append(f"  (c) left these .safetensors files (rank shards and consolidated): {sorted(hf_files)}")
        med = {k: statistics.median(v) for k, v in rows.items()}

        def per_round(k: str) -> list[float]:
            return [x / o for x, o in zip(rows[k], rows["ours file"])]

        lines.append("")
        r = statistics.median(per_round("(d) ours dcp"))
        lines.append(f"  [{'PASS' if r >= 1 / 1.1 else 'FAIL'}] ours file within 10% of ours dcp: "
                     f"ours file takes {1 / r:.2f}x of ours dcp's time (target <= 1.10x)")
        for k in ("(a) gather+torch.save", "(b) dcp+dcp_to_torch_save"):
            r = statistics.median(per_round(k))
            lines.append(f"  [{'PASS' if r >= 2 else 'FAIL'}] ours file >= 2x faster than {k}: it takes {r:.2f}x "
                         "ours file's time (target >= 2.00x)")
        if "(c) dcp hf consolidated" in med:
            lines.append(f"  (no target) (c) takes {statistics.median(per_round('(c) dcp hf consolidated')):.2f}x "
                         "ours file's time")
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def load_rows(args: argparse.Namespace, m: torch.nn.Module, opt: torch.optim.Optimizer, gb: float, world: int,
              rank: int, timed: Callable, set_state_dict: Any, options: Any, get_state_dict: Any) -> None:
    import fp_core

    file_gb = os.path.getsize(args.load) / 1e9

    def scramble() -> None:
        with torch.no_grad():
            for p in m.parameters():
                p.to_local().fill_(0.0)
                for v in opt.state[p].values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        v.to_local().fill_(0.0)

    def ours() -> None:
        msd, osd = get_state_dict(m, opt)
        fp_core.load_into({"model": msd, "optim": osd}, args.load)
        set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)

    def stock(mmap: bool) -> None:
        full = torch.load(args.load, map_location="cpu", weights_only=True, mmap=mmap)
        set_state_dict(m, opt, model_state_dict=full["model"], optim_state_dict=full["optim"],
                       options=options(full_state_dict=True))

    rows_fn = {"ours load_into": ours, "stock torch.load": lambda: stock(False),
               "stock torch.load mmap": lambda: stock(True)}
    names = list(rows_fn)
    rows: dict[str, list[float]] = {k: [] for k in names}
    sums: dict[str, float] = {}
    for rnd in range(args.warmup_rounds + args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for k in order:
            scramble()
            t = timed(rows_fn[k], [])
            sums[k] = shard_checksum(m, opt)
            if rnd >= args.warmup_rounds:
                rows[k].append(t)
    agree = torch.tensor([int(all(v == sums[names[0]] for v in sums.values()) and sums[names[0]] != 0.0)])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    if rank == 0:
        lines = [f"load on {world} ranks of {args.load} ({file_gb:.2f} GB; {gb:.2f} GB of tensors), "
                 f"{args.rounds} rounds after {args.warmup_rounds} warm-up, rows alternated; page cache "
                 f"{'dropped before every row' if args.drop_caches else 'not dropped'}"]
        lines += report("load", rows, "ours load_into", gb, args.rounds)
        lines.append(f"  every rank's shards equal after every row: {bool(agree.item())}")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
