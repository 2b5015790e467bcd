"""A rank of the FSDP1-state test: ShardedTensor state (what FSDPStrategy(state_dict_type=
"sharded") hands over) saved by FastPersistIO.save_sharded in the background, on CPU.

Usage: python sharded_tensor_plugin.py RANK WORLD PORT DIR   (rank 0 writes DIR/result.json)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fp_core  # noqa: E402
from fp_core.parallel.dcp import FastPersistReader  # noqa: E402
from fp_integrations.lightning import FastPersistIO  # noqa: E402


def main() -> None:
    rank, world, port, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.zeros(spec, 64, 32)
    st.local_shards()[0].tensor.copy_(torch.arange(32 * 32, dtype=torch.float32).view(32, 32) + 1000 * rank)
    expected = st.local_shards()[0].tensor.clone()
    plugin = FastPersistIO()
    p = torch.nn.Parameter(torch.zeros(1))
    torch.optim.SGD([p], lr=0.1).step()  # an optimizer step: training runs, saves are asynchronous
    path = os.path.join(d, "ckpt")
    plugin.save_sharded({"model": {"w": st}}, path, {"meta.pt": b"lightning meta"} if rank == 0 else {})
    queued = bool(plugin._pending.get(path))
    st.local_shards()[0].tensor.add_(1.0)  # after save_sharded returned: not in the checkpoint
    plugin.wait_for_path(path)
    plugin.teardown()
    st2 = sharded_tensor.zeros(spec, 64, 32)
    dcp.load({"model": {"w": st2}}, storage_reader=FastPersistReader(path, verify=True))
    equal = torch.equal(st2.local_shards()[0].tensor, expected)
    flags = [None] * world
    dist.all_gather_object(flags, {"equal": equal, "queued": queued})
    if rank == 0:
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump({"ranks": flags, "verified": fp_core.verify(path)["files"], "stats": len(plugin.stats),
                       "policy": [s.policy for s in plugin.stats]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
