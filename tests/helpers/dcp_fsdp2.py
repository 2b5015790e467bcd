"""A rank of the sharded-checkpoint test: FSDP2 (fully_shard) on the CPU over gloo, saved
with FastPersistWriter, loaded back through FastPersistReader and stock DCP.

Usage: python dcp_fsdp2.py RANK WORLD PORT DIR   (rank 0 writes DIR/result.json)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fp_core.parallel.dcp import FastPersistReader, FastPersistWriter  # noqa: E402


def model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    return m, opt


def full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    msd, _ = get_state_dict(m, opt)
    return {k: v.full_tensor() for k, v in msd.items()}


def main() -> None:
    rank, world, port, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m, opt = model(0)
    msd, osd = get_state_dict(m, opt)
    ckpt = os.path.join(d, "ckpt")
    dcp.save({"model": msd, "optim": osd}, storage_writer=FastPersistWriter(ckpt))
    saved = full(m, opt)
    ok = {}
    for name, reader in (("fastpersist", FastPersistReader(ckpt, verify=True)), ("stock", None)):
        m2, opt2 = model(1)  # other weights, the same sharding
        msd2, osd2 = get_state_dict(m2, opt2)
        state = {"model": msd2, "optim": osd2}
        if reader is None:
            dcp.load(state, checkpoint_id=ckpt)
        else:
            dcp.load(state, storage_reader=reader)
        set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = full(m2, opt2)
        ok[name] = all(torch.equal(got[k], saved[k]) for k in saved)
    if rank == 0:
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump({"loaded_equal": ok, "files": sorted(os.listdir(ckpt))}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
