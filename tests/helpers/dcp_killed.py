"""A rank of the killed-sharded-save test: FSDP2 state saved to DIR/a, then saved to DIR/b
over and over until the test kills every rank (SIGKILL) in the middle of one.

Usage: python dcp_killed.py RANK WORLD PORT DIR
Rank 0 writes DIR/a.json (the full state it saved to DIR/a) and touches DIR/saving-b when
the saves of b begin.
"""

from __future__ import annotations

import os
import sys

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
    m = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 2048))
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 1024)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    fp_core.save({"model": msd, "optim": osd}, os.path.join(d, "a"))
    full = {k: v.full_tensor() for k, v in msd.items()}
    if rank == 0:
        torch.save(full, os.path.join(d, "a-expected.pt"))
        open(os.path.join(d, "saving-b"), "w").close()
    while True:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        fp_core.save({"model": msd, "optim": osd}, os.path.join(d, "b"))


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
