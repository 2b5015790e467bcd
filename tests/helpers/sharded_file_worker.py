"""A rank of a layout="file" test: every rank of a DTensor state writes one torch.save file.

Usage: python sharded_file_worker.py RANK WORLD PORT DIR SCENARIO (conftest.run_ranks);
each rank reports to DIR/result<RANK>.json, rank 0 to DIR/result.json as well.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rank_report import join, reported  # noqa: E402

import fp_core  # noqa: E402
import fp_core.parallel.distributed  # noqa: E402
from fp_core import _native  # noqa: E402


def full_state(gen: int = 0) -> dict:
    """The full state the sharded one stands for (what a full state dict returns), built
    the same way in every process: shapes chosen for uneven and empty shards."""
    g = torch.Generator().manual_seed(1234 + gen)
    return {
        "model": {
            "w": torch.randn(37, 64, generator=g),  # rows divide by neither 2, 3 nor 4
            "emb": torch.randn(1001, 300, generator=g).to(torch.bfloat16),
            "big": torch.randn(1024, 1024, generator=g),
            "tiny": torch.randn(1, 5, generator=g),  # fewer rows than ranks: empty shards
            "scale": torch.randn(7, generator=g),  # Replicate()
            "temp": torch.tensor(0.5 + gen),  # 0-dim, Replicate()
            "buf": torch.arange(100, dtype=torch.int64) * (gen + 1),  # a plain tensor
        },
        "optim": {"state": {"w": {"step": torch.tensor(5.0 + gen), "exp_avg": torch.randn(37, 64, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": ["w"]}]},
        "epoch": 3 + gen,
    }


REPLICATED = ("scale", "temp")


def sharded_state(mesh, full: dict, shard_placements: list, strided: bool = False) -> dict:
    from torch.distributed.tensor import Replicate, distribute_tensor

    rep = [Replicate()] * mesh.ndim
    m = full["model"]
    model = {k: distribute_tensor(v, mesh, rep if k in REPLICATED else shard_placements)
             for k, v in m.items() if k != "buf"}
    model["buf"] = m["buf"]
    exp_avg = distribute_tensor(full["optim"]["state"]["w"]["exp_avg"], mesh, shard_placements)
    return {"model": model,
            "optim": {"state": {"w": {"step": full["optim"]["state"]["w"]["step"], "exp_avg": exp_avg}},
                      "param_groups": full["optim"]["param_groups"]},
            "epoch": full["epoch"]}


def local_bytes(state: dict) -> tuple[int, int]:
    """(bytes of this rank's local shards of sharded DTensors, bytes of replicated tensors)."""
    from torch.distributed.tensor import DTensor, Shard

    shards = replicated = 0
    for v in [*state["model"].values(), state["optim"]["state"]["w"]["exp_avg"],
              state["optim"]["state"]["w"]["step"]]:
        if isinstance(v, DTensor) and any(isinstance(p, Shard) for p in v.placements):
            shards += v.to_local().numel() * v.element_size()
        else:
            t = v.to_local() if isinstance(v, DTensor) else v
            replicated += t.numel() * t.element_size()
    return shards, replicated


def main() -> None:
    rank, world, d, scenario = join()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    result: dict = {"rank": rank}
    path = os.path.join(d, "full.pt")
    with reported(d, rank, result):
        if scenario in ("fsdp", "hsdp"):
            if scenario == "fsdp":
                mesh = init_device_mesh("cpu", (world,))
                placements = [Shard(0)]
            else:
                mesh = init_device_mesh("cpu", (2, world // 2))
                placements = [Replicate(), Shard(0)]
            state = sharded_state(mesh, full_state(), placements)
            st = fp_core.save(state, path, layout="file")
            shards, replicated = local_bytes(state)
            result.update(backend=st.backend, rank_bytes=st.extra["rank_bytes"], data_bytes=st.extra["data_bytes"],
                          local_shard_bytes=shards, replicated_bytes=replicated, file_size=st.bytes,
                          differing=st.extra.get("differing_storages", 0))
            if scenario == "fsdp":  # no layout: a DCP directory, as before
                fp_core.save(state, os.path.join(d, "default"))
                result["default_is_dir"] = os.path.isfile(os.path.join(d, "default", ".metadata"))
        elif scenario == "shard1":  # tensor parallel's Shard(1) (and Shard(2)): written; Partial: refused
            mesh = init_device_mesh("cpu", (world,))
            full = full_state()
            full["model"]["narrow"] = torch.arange(12.0).reshape(6, 2, 1)  # Shard(2): empty shards
            state = sharded_state(mesh, full, [Shard(1)])
            state["model"]["narrow"] = distribute_tensor(full["model"]["narrow"], mesh, [Shard(2)])
            state["model"]["rows"] = distribute_tensor(full["model"]["big"][:10].clone(), mesh, [Shard(0)])
            st = fp_core.save(state, path, layout="file")
            result.update(rank_bytes=st.extra["rank_bytes"], file_size=st.bytes)
            fp_core.save(dict(state["model"]), os.path.join(d, "model.safetensors"), layout="file", format="safetensors")
            from torch.distributed.tensor import DTensor, Partial

            bad = dict(state, model=dict(state["model"], partial=DTensor.from_local(torch.ones(4, 6), mesh,
                                                                                    [Partial()], run_check=False)))
            try:
                fp_core.save(bad, os.path.join(d, "partial.pt"), layout="file")
            except ValueError as e:
                result["partial"] = f"{type(e).__name__}: {e}"
            try:
                fp_core.save(bad["model"], os.path.join(d, "partial.safetensors"), layout="file",
                             format="safetensors")
            except ValueError as e:
                result["partial_st"] = f"{type(e).__name__}: {e}"
        elif scenario == "tp2d":  # FSDP x TP on a 2 x 2 mesh: Shard(0) x Shard(1), _StridedShard x Shard(0)
            from torch.distributed.tensor.placement_types import _StridedShard

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            full = full_state()
            m = full["model"]
            rowwise, colwise = [Shard(0), Shard(1)], [_StridedShard(0, split_factor=world // 2), Shard(0)]
            state = sharded_state(mesh, full, rowwise)
            # every rank holds the full tensor: each takes its shard (uneven strided shards
            # cannot be scattered from one rank)
            for k in ("w", "emb", "tiny"):
                state["model"][k] = distribute_tensor(m[k], mesh, colwise, src_data_rank=None)
            state["model"]["cube"] = distribute_tensor(torch.arange(7 * 5 * 3.0).reshape(7, 5, 3), mesh,
                                                       [_StridedShard(1, split_factor=world // 2), Shard(1)],
                                                       src_data_rank=None)
            result["placements"] = {k: repr(tuple(v.placements)) for k, v in state["model"].items()
                                    if hasattr(v, "placements")}
            fp_core.save(state, path, layout="file")
            fp_core.save(dict(state["model"]), os.path.join(d, "model.safetensors"), layout="file", format="safetensors")
        elif scenario == "fail":
            mesh = init_device_mesh("cpu", (world,))
            fp_core.save(sharded_state(mesh, full_state(0), [Shard(0)]), path, layout="file")
            if rank == 1:
                _native.inject_fault("write", errno=5)
            fp_core.save(sharded_state(mesh, full_state(1), [Shard(0)]), path, layout="file")
        elif scenario == "mismatch":
            mesh = init_device_mesh("cpu", (world,))
            state = sharded_state(mesh, full_state(), [Shard(0)])
            state["model"]["buf"] = state["model"]["buf"] + rank  # replicas drifted: rank 0's is written
            st = fp_core.save(state, path, layout="file")
            result["differing"] = st.extra.get("differing_storages", 0)
            state["epoch"] = rank  # the pickles differ: no file can be agreed on
            try:
                fp_core.save(state, os.path.join(d, "other.pt"), layout="file")
            except fp_core.parallel.distributed.CollectiveSaveError as e:
                result["mismatch_error"] = str(e)
        elif scenario == "timing":
            mesh = init_device_mesh("cpu", (world,))
            g = torch.Generator().manual_seed(0)
            full = {f"layer{i}": torch.randn(4096, 1024, generator=g) for i in range(16)}  # 256 MiB
            state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
            times: dict = {"file": [], "dcp": []}
            for _ in range(3):
                for layout in ("file", "dcp"):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fp_core.save(state, os.path.join(d, f"t-{layout}"), layout=layout)
                    dist.barrier()
                    times[layout].append(time.perf_counter() - t0)
            result.update(times=times)
        elif scenario == "timing_placement":  # the same state as Shard(0) and as Shard(1), alternated
            mesh = init_device_mesh("cpu", (world,))
            g = torch.Generator().manual_seed(0)
            cols = int(os.environ.get("FP_TIMING_COLS", "1024"))  # wider rows: Shard(1) runs of whole blocks
            full = {f"layer{i}": torch.randn(4 << 20 >> cols.bit_length() - 1, cols, generator=g)
                    for i in range(16)}  # 256 MiB
            states = {f"shard{d}": {k: distribute_tensor(v, mesh, [Shard(d)]) for k, v in full.items()}
                      for d in (0, 1)}
            times: dict = {k: [] for k in states}
            for _ in range(int(os.environ.get("FP_TIMING_ROUNDS", "5"))):
                for name, state in states.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    fp_core.save(state, os.path.join(d, f"t-{name}.pt"), layout="file")
                    dist.barrier()
                    times[name].append(time.perf_counter() - t0)
            result.update(times=times)
        else:
            raise ValueError(scenario)


if __name__ == "__main__":
    main()
