"""A rank of the sharded async test: FSDP2 (fully_shard) on the CPU over gloo, its state saved
by fp_core.AsyncCheckpointer (or fp_core.save) while training steps on.

Usage: python dcp_async.py RANK WORLD PORT DIR POLICY
POLICY: overlap | snapshot | sync | process (writer="process": the writer processes run DCP), or a failure: fail (rank 1's write fails on the third
save), rebuildfail (rank 1 cannot rebuild its state for the third save), pendingfail (rank
0 has an earlier job's failure pending when the second save starts)

Each save is started, then three more training steps run at once (the optimizer hook fences
before each step). The checkpoint must hold the state at save time: rank 0 writes
DIR/result.json with what it found.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fp_core  # noqa: E402
from fp_core.parallel.dcp import FastPersistReader  # noqa: E402


def model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                            torch.nn.ReLU(), torch.nn.Linear(512, 8))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def step(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    m(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
    opt.step()


def full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(m, opt)
    out = {f"model.{k}": v.full_tensor().clone() for k, v in msd.items()}
    for k, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.{k}.{name}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def main() -> None:
    rank, world, port, d, policy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m, opt = model(0)
    step(m, opt, 0)
    result: dict = {"saves": []}
    ckpt = None if policy == "sync" else fp_core.AsyncCheckpointer(
        policy=policy if policy in ("overlap", "snapshot") else "snapshot" if policy == "process" else "overlap",
        writer="process" if policy == "process" else "thread")
    for i in range(3):
        path = os.path.join(d, f"step{i}")
        msd, osd = get_state_dict(m, opt)
        expected = full(m, opt)
        meta = f"meta of save {i}".encode()
        if policy == "fail" and i == 2 and rank == 1:
            fp_core._native.inject_fault("write", errno=5, after_bytes=0)  # rank 1's write fails
        if policy == "rebuildfail" and i == 2 and rank == 1:
            import fp_core.parallel.dcp_save as dcp_save

            def broken(obj):
                raise RuntimeError("injected: this rank cannot rebuild its state")
            dcp_save._rebuild = broken
        if policy == "pendingfail" and i == 1 and rank == 0:
            ckpt.enqueue(lambda: 1 / 0).exception()  # an earlier job of rank 0 alone failed
        t_save = time.monotonic()
        if ckpt is None:
            fp_core.save({"model": msd, "optim": osd}, path, extra_files={"meta.txt": meta})
        else:
            try:
                h = ckpt.save({"model": msd, "optim": osd}, path, extra_files={"meta.txt": meta})
            except fp_core.AsyncCheckpointError as e:  # the earlier failure, raised after this save is queued
                result["raised_after_queueing"] = f"{e.__cause__!r}" if e.handle is not None else "no handle"
                h = e.handle
        try:
            # Training goes on while the checkpoint is written. Not after the save that fails:
            # each rank raises its failure at its next fence, and that may be a different step
            # on each (the ranks' collectives would no longer pair).
            for k in range(0 if policy in ("fail", "rebuildfail") and i == 2 else 3):
                step(m, opt, 10 * i + k + 1)
            if ckpt is not None:
                result.setdefault("writers", []).append(h.result().extra.get("writer", "thread"))
        except Exception as e:  # noqa: BLE001 - reported to the test
            result["saves"].append({"error": f"{type(e).__name__}: {e}", "listing": sorted(os.listdir(d)),
                                    "seconds": time.monotonic() - t_save})
            continue
        m2, opt2 = model(1)
        step(m2, opt2, 99)
        msd2, osd2 = get_state_dict(m2, opt2)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, storage_reader=FastPersistReader(path, verify=True))
        set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = full(m2, opt2)
        with open(os.path.join(path, "meta.txt"), "rb") as f:
            meta_ok = f.read() == meta
        result["saves"].append({"equal": sorted(expected) == sorted(got) and all(
            torch.equal(expected[k], got[k]) for k in expected), "meta": meta_ok,
            "changed_since": any(not torch.equal(expected[k], v) for k, v in full(m, opt).items())})
    if ckpt is not None:
        ckpt.close()
    if rank == 0:
        result["verify"] = {n: fp_core.verify(os.path.join(d, n))["files"] for n in sorted(os.listdir(d))
                            if n.startswith("step")}
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
