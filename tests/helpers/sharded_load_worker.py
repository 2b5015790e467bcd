"""A rank of a sharded load test: ``load_into`` a DTensor state from one file of the full state.

Usage: python sharded_load_worker.py RANK WORLD PORT DIR SCENARIO [FILE...] (conftest.run_ranks);
each rank reports to DIR/result<RANK>.json, rank 0 to DIR/result.json as well.

Scenarios: ``roundtrip`` (FSDP: save with layout="file", then load it back), ``fsdp`` and
``hsdp`` (load each FILE of DIR: ``*.pt`` written by FastPersist with verify=True, ``plain*``
written by torch.save without; ``strided.pt``: a transposed tensor), ``layouts`` (load each FILE on each mesh and
placements of :func:`layouts`: HSDP, tensor parallel), ``safetensors`` (the same, from
safetensors files: :func:`safetensors_loads`), ``save_safetensors`` (FILE written with
layout="file", format="safetensors" from Shard(1) shards), ``refuse`` (a global shape that differs, a Partial() target,
and the damaged file FILE with verify=True), ``module`` (an FSDP2 model and a fresh Adam
resumed from FILE, saved by the test process from ``trained()``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rank_report import reported  # noqa: E402
from sharded_file_worker import REPLICATED, full_state, local_bytes, sharded_state  # noqa: E402

import fp_core  # noqa: E402
from fp_core.loading.sharded_load import LoadIntoStats  # noqa: E402


def zeroed(full: dict) -> dict:
    """A target shaped like ``full`` whose every value differs from the file's."""
    return {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()},
           "optim": {"state": {"w": {k: torch.zeros_like(v) for k, v in full["optim"]["state"]["w"].items()}},
                     "param_groups": [{"lr": 0.5, "params": ["w"]}]},
           "epoch": 0}


def tensors(state: dict) -> list[tuple[str, Any]]:
    return [*((f"model.{k}", v) for k, v in state["model"].items()),
            *((f"optim.state.w.{k}", v) for k, v in state["optim"]["state"]["w"].items())]


def local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def load_and_check(mesh: Any, placements: list, path: str, verify: bool, build: Any = sharded_state) -> dict:
    """load_into a fresh target on ``mesh`` (its state made by ``build``); what came in, what was read."""
    expected = build(mesh, full_state(), placements)
    target = build(mesh, zeroed(full_state()), placements)
    ptrs = {k: local(v).data_ptr() for k, v in tensors(target)}
    stats = LoadIntoStats()
    result = fp_core.load_into(target, path, verify=verify, stats=stats)
    shards, replicated = local_bytes(expected)
    differ = [k for (k, e), (_, g) in zip(tensors(expected), tensors(target)) if not torch.equal(local(e), local(g))]
    return {"differ": differ,
            "in_place": all(local(v).data_ptr() == ptrs[k] for k, v in tensors(target)),
            "same_objects": result["model"]["w"] is target["model"]["w"],
            "epoch": result["epoch"], "target_epoch": target["epoch"],
            "lr": target["optim"]["param_groups"][0]["lr"],
            "tensor_bytes": stats.tensor_bytes, "check_bytes": stats.check_bytes, "whole_file": stats.whole_file,
            "shard_bytes": shards, "replicated_bytes": replicated}


def make_model(seed: int) -> torch.nn.Module:
    """The model of the ``module`` scenario: rows that divide by neither 2 nor 3."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))


def trained(seed: int = 7) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its Adam after one step: the full state the test process saves."""
    model = make_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(4, 16)).sum().backward()
    opt.step()
    return model, opt


def module_resume(path: str) -> dict:
    """An FSDP2 model and a fresh Adam filled from the full state: each parameter's and
    each created Adam state's local shard equals its rows in the file; a step runs."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    full_model, full_opt = trained()
    model = make_model(seed=99)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    stats = LoadIntoStats()
    state = fp_core.load_into({"model": model, "optim": opt}, path, verify=True, stats=stats)
    differ = []
    full_state_of = dict(zip(full_model.parameters(), full_opt.state.values()))
    for (name, p), full_p in zip(model.named_parameters(), full_model.parameters()):
        rows = p.to_local().shape[0]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if not torch.equal(p.to_local(), full_p.detach()[off[0]:off[0] + rows]):
            differ.append(name)
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            if not isinstance(st[k], DTensor) or \
                    not torch.equal(st[k].to_local(), full_state_of[full_p][k][off[0]:off[0] + rows]):
                differ.append(f"{name}.{k}")
        if float(st["step"]) != 1.0:
            differ.append(f"{name}.step")
    model(torch.ones(4, 16)).sum().backward()
    opt.step()  # the created state is what the sharded step expects
    local = sum(p.to_local().nbytes for p in model.parameters())
    return {"differ": differ, "lr": opt.param_groups[0]["lr"], "tensor_bytes": stats.tensor_bytes,
            "check_bytes": stats.check_bytes, "param_bytes": local, "state_keys": sorted(state)}


def strided_full() -> torch.Tensor:
    """A tensor saved as a view that is not row-major (a transpose): its rows are no byte ranges."""
    return torch.arange(37 * 64, dtype=torch.float32).reshape(64, 37).t()


def strided_check(mesh: Any, placements: list, path: str) -> dict:
    """Each rank's rows of a transposed tensor, copied out of the span they lie in; with
    verify its storage is checked whole, the ranks' rows not tiling it."""
    from torch.distributed.tensor import distribute_tensor

    target = {"w": distribute_tensor(torch.zeros(37, 64), mesh, placements)}
    expected = distribute_tensor(strided_full().contiguous(), mesh, placements).to_local()
    stats = LoadIntoStats()
    fp_core.load_into(target, path, verify=True, stats=stats)
    return {"equal": torch.equal(target["w"].to_local(), expected), "check_bytes": stats.check_bytes}


def layouts(world: int) -> dict[str, tuple[Any, list]]:
    """The meshes and placements of the ``layouts`` scenario: on 4 ranks a 2 x 2 mesh, HSDP
    (Replicate x Shard(0)), FSDP x tensor parallel (Shard(0) x Shard(1)) and replicated
    tensor parallel (Replicate x Shard(1)); on any other number, FSDP and tensor parallel
    (Shard(1)) on one dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        return {"hsdp": (mesh, [Replicate(), Shard(0)]), "fsdp_tp": (mesh, [Shard(0), Shard(1)]),
                "replicated_tp": (mesh, [Replicate(), Shard(1)])}
    mesh = init_device_mesh("cpu", (world,))
    return {"fsdp": (mesh, [Shard(0)]), "tp": (mesh, [Shard(1)])}


def flat_model() -> dict[str, torch.Tensor]:
    """The model's tensors of :func:`full_state`, flat: what a ``model.safetensors`` holds."""
    return dict(full_state()["model"])


def safetensors_loads(d: str, world: int, files: list[str]) -> dict:
    """Each FILE (a safetensors of :func:`flat_model`: ``ours*`` written by FastPersist,
    loaded with verify=True; ``plain*`` by ``save_file``, loaded with verify="auto") on each
    mesh and placements of :func:`layouts`: what came in, what was read. ``bad*``: loaded
    with verify=True, its outcome only."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    full = flat_model()
    out: dict = {}
    for name, (mesh, placements) in layouts(world).items():
        rep = [Replicate()] * mesh.ndim
        at = {k: rep if k in REPLICATED else placements for k in full}

        for f in files:
            path = os.path.join(d, f)
            target = {k: v if k == "buf" else distribute_tensor(torch.zeros_like(v), mesh, at[k])
                      for k, v in full.items()}
            if f.startswith("bad"):
                out[f"{name}/{f}"] = {"outcome": refused(fp_core.load_into, target, path, verify=True)}
                continue
            expected = {k: v if k == "buf" else distribute_tensor(v, mesh, at[k]) for k, v in full.items()}
            ptrs = {k: local(v).data_ptr() for k, v in target.items()}
            stats = LoadIntoStats()
            fp_core.load_into(target, path, verify=True if f.startswith("ours") else "auto", stats=stats)
            out[f"{name}/{f}"] = {
                "differ": [k for k in full if not torch.equal(local(expected[k]), local(target[k]))],
                "in_place": all(local(v).data_ptr() == ptrs[k] for k, v in target.items()),
                "tensor_bytes": stats.tensor_bytes, "check_bytes": stats.check_bytes,
                "local_bytes": sum(local(v).nbytes for v in target.values()),
                "refused": refused(fp_core.load_into, target, path, verify=True)}
    return out


def strided_shard_loads(path: str) -> dict:
    """The full state's sharded tensors placed ``_StridedShard(0, split_factor=2)`` on all
    ranks (rows interleaved, as FSDP2 over tensor parallel shards them), loaded from
    ``path`` verified (unverified for ``plain*``): what came in, what was read."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    def each_splits_its_own(mesh: Any, full: dict, shard: list) -> dict:
        # every rank holds the full state: each takes its shard of its own copy (DTensor's
        # scatter pads uneven strided chunks to one shape and refuses them)
        rep = [Replicate()]
        m = full["model"]
        model = {k: distribute_tensor(v, mesh, rep if k in REPLICATED else shard, src_data_rank=None)
                 for k, v in m.items() if k != "buf"}
        model["buf"] = m["buf"]
        exp_avg = distribute_tensor(full["optim"]["state"]["w"]["exp_avg"], mesh, shard, src_data_rank=None)
        return {"model": model,
                "optim": {"state": {"w": {"step": full["optim"]["state"]["w"]["step"], "exp_avg": exp_avg}},
                          "param_groups": full["optim"]["param_groups"]},
                "epoch": full["epoch"]}

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placements = [_StridedShard(0, split_factor=2)]
    out = load_and_check(mesh, placements, path, not os.path.basename(path).startswith("plain"), each_splits_its_own)
    out["placements"] = repr(tuple(placements))
    return out


def refused(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return ""


def main() -> None:
    rank, world, port, d, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    files = sys.argv[6:]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    result: dict = {"rank": rank}
    with reported(d, rank, result):
        if scenario == "hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2))
            placements = [Replicate(), Shard(0)]
        else:
            mesh = init_device_mesh("cpu", (world,))
            placements = [Shard(0)]
        if scenario == "roundtrip":
            path = os.path.join(d, "full.pt")
            fp_core.save(sharded_state(mesh, full_state(), placements), path, layout="file")
            result["loads"] = {"full.pt": load_and_check(mesh, placements, path, True)}
        elif scenario in ("fsdp", "hsdp"):
            result["loads"] = {f: load_and_check(mesh, placements, os.path.join(d, f), not f.startswith("plain"))
                               for f in files if not f.startswith("strided")}
            if "strided.pt" in files:
                result["strided"] = strided_check(mesh, placements, os.path.join(d, "strided.pt"))
        elif scenario == "layouts":
            result["loads"] = {f"{name}/{f}": load_and_check(m, pl, os.path.join(d, f), not f.startswith("plain"))
                               for name, (m, pl) in layouts(world).items() for f in files}
        elif scenario == "save_safetensors":  # FILE written with layout="file" from tensor-parallel shards
            mesh, tp = layouts(world)["tp"]
            rep = [Replicate()]
            flat = {k: v if k == "buf" else distribute_tensor(v, mesh, rep if k in REPLICATED else tp)
                    for k, v in flat_model().items()}
            fp_core.save(flat, os.path.join(d, files[0]), layout="file", format="safetensors")
        elif scenario == "safetensors":
            result["loads"] = safetensors_loads(d, world, files)
        elif scenario == "strided_shard":
            result["loads"] = {f: strided_shard_loads(os.path.join(d, f)) for f in files}
        elif scenario == "module":
            result["module"] = module_resume(os.path.join(d, files[0]))
        elif scenario == "refuse":
            path = os.path.join(d, "full.pt")
            wrong = sharded_state(mesh, zeroed(full_state()), placements)
            wrong["model"]["w"] = distribute_tensor(torch.zeros(38, 64), mesh, placements)
            stats = LoadIntoStats()
            result["shape"] = refused(lambda: fp_core.load_into(wrong, path, stats=stats))
            result["shape_bytes_read"] = stats.bytes_read
            from torch.distributed.tensor import DTensor, Partial

            partial = sharded_state(mesh, zeroed(full_state()), placements)
            # partial sums: no part of the saved tensor
            partial["model"]["w"] = DTensor.from_local(torch.zeros(37, 64), mesh, [Partial()], run_check=False,
                                                       shape=torch.Size((37, 64)), stride=(64, 1))
            stats = LoadIntoStats()
            result["partial"] = refused(lambda: fp_core.load_into(partial, path, stats=stats))
            result["partial_bytes_read"] = stats.bytes_read
            bad = os.path.join(d, files[0])
            result["damaged"] = refused(lambda: fp_core.load_into(
                sharded_state(mesh, zeroed(full_state()), placements), bad, verify=True))
            target = sharded_state(mesh, zeroed(full_state()), placements)
            result["unverified"] = refused(lambda: fp_core.load_into(target, bad))
        else:
            raise ValueError(scenario)


if __name__ == "__main__":
    main()
