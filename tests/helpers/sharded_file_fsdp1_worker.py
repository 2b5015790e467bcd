"""A rank of a layout="file" test of FSDP1's ShardedTensor state: every rank writes its own
rows of one torch.save file of the full state.

Usage: python sharded_file_fsdp1_worker.py RANK WORLD PORT DIR SCENARIO (conftest.run_ranks);
each rank reports to DIR/result<RANK>.json, rank 0 to DIR/result.json as well.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rank_report import join, reported  # noqa: E402

import fp_core  # noqa: E402
from fp_core import _native  # noqa: E402


def full_state(gen: int = 0) -> dict:
    """The full state the ShardedTensor one stands for, built alike in every process:
    rows that divide by neither 2 nor 3, fewer rows than ranks (empty shards), a 1-D, a
    3-D and a zero-row tensor."""
    g = torch.Generator().manual_seed(4321 + gen)
    return {
        "model": {
            "w": torch.randn(37, 64, generator=g),
            "emb": torch.randn(101, 30, generator=g).to(torch.bfloat16),
            "tiny": torch.randn(1, 5, generator=g),
            "vec": torch.arange(7, dtype=torch.int64) * (gen + 1),
            "cube": torch.randn(5, 3, 2, generator=g),
            "none": torch.empty(0, 4),
            "big": torch.randn(1024, 1024, generator=g),  # runs of whole blocks: the native engine
            "buf": torch.arange(10.0) + gen,  # a plain tensor
        },
        "optim": {"state": {"w": {"step": torch.tensor(5.0 + gen), "exp_avg": torch.randn(37, 64, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": ["w"]}]},
        "epoch": 3 + gen,
    }


def shard(full: torch.Tensor, spec, shards: list | None = None):
    """``full`` as a ShardedTensor of ``spec`` (or of the given ShardMetadata ``shards``,
    under ``spec``), each rank taking its own shards from its copy (no communication)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    props = TensorProperties(dtype=full.dtype)
    md = ShardedTensorMetadata(shards, full.size(), props) if shards else spec.build_metadata(full.size(), props)
    for sm in md.shards_metadata:
        # ChunkShardingSpec places an empty last chunk past the end, which the ShardedTensor
        # refuses: at the end instead, as FSDP1's own chunks are
        sm.shard_offsets[0] = min(sm.shard_offsets[0], full.shape[0])
    me = dist.get_rank()
    local = [Shard(full[tuple(slice(o, o + n) for o, n in zip(sm.shard_offsets, sm.shard_sizes))].clone(), sm)
             for sm in md.shards_metadata if sm.placement.rank() == me]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, sharding_spec=spec)


def chunk_spec(world: int, order: list[int] | None = None, dim: int = 0):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in (order or range(world))])


def sharded_state(full: dict, world: int, order: list[int] | None = None) -> dict:
    spec = chunk_spec(world, order)
    model = {k: shard(v, spec) for k, v in full["model"].items() if k != "buf"}
    model["buf"] = full["model"]["buf"]
    w = full["optim"]["state"]["w"]
    return {"model": model,
            "optim": {"state": {"w": {"step": w["step"], "exp_avg": shard(w["exp_avg"], spec)}},
                      "param_groups": full["optim"]["param_groups"]},
            "epoch": full["epoch"]}


def local_shard_bytes(state: dict) -> int:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = 0
    for v in [*state["model"].values(), state["optim"]["state"]["w"]["exp_avg"]]:
        if isinstance(v, ShardedTensor):
            out += sum(s.tensor.numel() * s.tensor.element_size() for s in v.local_shards())
    return out


def differ(a, b, where: str = "") -> str | None:
    """Where ``b`` first differs from ``a`` (structure, values; every tensor a plain tensor
    of the same dtype and shape), or None."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return f"{where}: keys {list(a)} != {list(b) if isinstance(b, dict) else type(b)}"
        return next((d for k in a if (d := differ(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{where}: {type(a).__name__} of {len(a)} != {type(b).__name__}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := differ(x, y, f"{where}[{i}]"))), None)
    if isinstance(a, torch.Tensor):
        ok = type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if ok else f"{where}: {type(b).__name__} {getattr(b, 'dtype', '')} {getattr(b, 'shape', '')}"
    return None if a == b else f"{where}: {a!r} != {b!r}"


def fsdp1(d: str, rank: int, world: int, result: dict) -> None:
    """FSDP1 on CPU/gloo: its own SHARDED_STATE_DICT and sharded optimizer state written
    as one file, which must equal its FULL_STATE_DICT gather."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5),
                              torch.nn.LayerNorm(5))
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # nested units (each Linear its own); no device_id: FSDP1 asks for an accelerator
    model = FSDP(net, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                 use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(4, 13, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"state_dict": model.state_dict(), "optimizer_states": [FSDP.optim_state_dict(model, opt)],
                 "epoch": 1}
    path = os.path.join(d, "fsdp1.pt")
    st = fp_core.save(state, path, layout="file")
    result.update(rank_bytes=st.extra["rank_bytes"], data_bytes=st.extra["data_bytes"])
    result["types"] = sorted({type(v).__name__ for v in state["state_dict"].values()})
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                              FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        full = {"state_dict": model.state_dict(), "optimizer_states": [FSDP.optim_state_dict(model, opt)],
                "epoch": 1}
    dist.barrier()
    if rank == 0:
        got = torch.load(path, weights_only=True)
        result["differ_torch_load"] = differ(full, got)
        result["differ_fp_load"] = differ(full, fp_core.load(path, verify=True))
        result["keys"] = list(got["state_dict"])
        result["optim_keys"] = sorted(got["optimizer_states"][0]["state"])


def refused(d: str, world: int, result: dict) -> None:
    """Specs other than chunks of rows are refused on every rank before anything is
    created, naming the tensor; so is, at 3 ranks, a save by ranks 0 and 1 of a tensor with
    rows on rank 2. Local shards that are not what the spec's metadata gives (columns; two
    shards on rank 0, none on rank 1) fail the save on every rank, nothing written."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

    full = full_state()
    state = sharded_state(full, world)
    t, rows = torch.randn(6, 8), chunk_spec(world)
    columns = [ShardMetadata([0, 4 * r], [6, 4], f"rank:{r}/cpu") for r in range(2)]
    cases = {
        "dim1": shard(torch.randn(6, 9), chunk_spec(world, dim=1)),
        "enumerable": shard(t, EnumerableShardingSpec(columns)),
        "columns": shard(t, rows, columns),
        "two_on_rank0": shard(t, rows, [ShardMetadata([0, 0], [3, 8], "rank:0/cpu"),
                                        ShardMetadata([3, 0], [3, 8], "rank:0/cpu")]),
    }
    result["errors"] = {}
    for name, bad in cases.items():
        target = os.path.join(d, f"{name}.pt")
        try:
            fp_core.save(dict(state, model=dict(state["model"], bad=bad)), target, layout="file")
            result["errors"][name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            result["errors"][name] = f"{type(e).__name__}: {e}"
    if world == 3:
        pair = dist.new_group([0, 1])
        # rank 0 holds the store ranks 0 and 1 still meet at inside new_group: nobody goes
        # on (and exits) before every rank is out of it
        dist.barrier()
        if dist.get_rank() < 2:
            try:
                fp_core.save(state, os.path.join(d, "pair.pt"), layout="file", group=pair)
                result["errors"]["pair"] = None
            except ValueError as e:
                result["errors"]["pair"] = f"{type(e).__name__}: {e}"
    try:
        fp_core.save(state["model"], os.path.join(d, "model.safetensors"), layout="file", format="safetensors")
    except ValueError as e:
        result["safetensors"] = str(e)


def main() -> None:
    rank, world, d, scenario = join()
    result: dict = {"rank": rank}
    path = os.path.join(d, "full.pt")
    with reported(d, rank, result):
        if scenario in ("chunks", "reordered"):
            # reordered: the spec's placements run from the last rank down, so rank r's
            # rows are not torch.chunk's r-th: their place comes from the shard metadata
            order = list(reversed(range(world))) if scenario == "reordered" else None
            state = sharded_state(full_state(), world, order)
            st = fp_core.save(state, path, layout="file")
            result.update(rank_bytes=st.extra["rank_bytes"], data_bytes=st.extra["data_bytes"],
                          local_shard_bytes=local_shard_bytes(state), file_size=st.bytes)
        elif scenario == "fsdp1":
            fsdp1(d, rank, world, result)
        elif scenario == "refused":
            refused(d, world, result)
        elif scenario in ("snapshot", "overlap"):
            # in the background: the local shards change in place once the fence returns;
            # the file holds the state as of save()
            ck = fp_core.AsyncCheckpointer(policy=scenario, small_tensor_bytes=1024)
            state = sharded_state(full_state(), world)
            h = ck.save(state, path, layout="file")
            ck.fence()
            with torch.no_grad():
                for v in [*state["model"].values(), state["optim"]["state"]["w"]["exp_avg"]]:
                    for t in ([s.tensor for s in v.local_shards()] if hasattr(v, "local_shards") else [v]):
                        t.add_(1)
            h.result()
            ck.close()
        elif scenario == "fail":
            fp_core.save(sharded_state(full_state(0), world), path, layout="file")
            if rank == 1:
                _native.inject_fault("write", errno=5)
            fp_core.save(sharded_state(full_state(1), world), path, layout="file")
        else:
            raise ValueError(scenario)


if __name__ == "__main__":
    main()
