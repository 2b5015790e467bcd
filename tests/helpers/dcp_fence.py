"""A rank of the small-state fence test: FSDP2 state whose tensors are all small (copied at
save time) must not hold the fence while DCP waits for a late rank.

Usage: python dcp_fence.py RANK WORLD PORT DIR   (rank 0 writes DIR/result.json)
Rank 1 starts its save 3 s after rank 0; rank 0 times its save() + fence().
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fp_core  # noqa: E402


def main() -> None:
    rank, world, port, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 32)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    ckpt = fp_core.AsyncCheckpointer(policy="overlap")
    # the first save creates the checkpoint's gloo group (a collective of its own): not timed
    ckpt.save({"model": msd, "optim": osd}, os.path.join(d, "first")).result()
    dist.barrier()
    if rank == 1:
        time.sleep(3.0)
    t0 = time.perf_counter()
    h = ckpt.save({"model": msd, "optim": osd}, os.path.join(d, "ckpt"))
    ckpt.fence()
    held = time.perf_counter() - t0
    h.result()
    ckpt.close()
    if rank == 0:
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump({"held_s": held, "verified": fp_core.verify(os.path.join(d, "ckpt"))["files"]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
