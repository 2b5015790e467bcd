"""A rank of the layout="file" async test: AsyncCheckpointer.save(state, path, layout="file")
while the training goes on modifying the local shards in place.

Usage: python sharded_file_async_worker.py RANK WORLD PORT DIR SCENARIO (conftest.run_ranks);
SCENARIO: snapshot | overlap | process (consistency and the fence; process: writer="process") | fail
(rank 1's write fails).
Each rank reports to DIR/result<RANK>.json, rank 0 to DIR/result.json as well.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rank_report import join, reported  # noqa: E402

import fp_core  # noqa: E402
from fp_core import _native  # noqa: E402

DELAY_S = 1.5  # rank 1 joins each save this late: rank 0's write waits for it


def full_state(gen: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + gen)
    return {
        "w": torch.randn(1031, 256, generator=g),  # Shard(0), uneven
        "col": torch.randn(200, 96, generator=g).to(torch.bfloat16),  # Shard(1): many runs per shard
        "big": torch.randn(2048, 512, generator=g),  # Shard(0), 4 MiB: large enough for the live path
        "scale": torch.randn(3000, generator=g),  # Replicate()
        "pos": torch.arange(64, dtype=torch.int64) + gen,  # a plain tensor
    }


def sharded(mesh, full: dict[str, torch.Tensor]) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    place = {"w": [Shard(0)], "col": [Shard(1)], "big": [Shard(0)], "scale": [Replicate()]}
    return {k: distribute_tensor(v, mesh, place[k]) if k in place else v.clone() for k, v in full.items()}


def train_in_place(state: dict) -> None:
    """What an optimizer step does: every local shard (and plain tensor) changed in place."""
    with torch.no_grad():
        for v in state.values():
            t = v.to_local() if hasattr(v, "to_local") else v
            t.add_(1)


def main() -> None:
    rank, world, d, scenario = join()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    result: dict = {"rank": rank}
    with reported(d, rank, result):
        if scenario in ("snapshot", "overlap", "process"):
            # process: the writer processes run each save among themselves, from shared memory
            ck = fp_core.AsyncCheckpointer(policy="snapshot" if scenario == "process" else scenario,
                                           small_tensor_bytes=1024,
                                           writer="process" if scenario == "process" else "thread")
            writers = []
            state = sharded(mesh, full_state())
            fences = []
            for i, fmt in enumerate(("torch", "safetensors", "torch")):
                if rank == 1:
                    time.sleep(DELAY_S)
                name = f"ck{i}." + ("pt" if fmt == "torch" else "safetensors")
                h = ck.save(state, os.path.join(d, name), layout="file", format=fmt)
                t0 = time.monotonic()
                ck.fence()  # the optimizer step's fence
                fences.append(time.monotonic() - t0)
                train_in_place(state)  # the state moves on at once, the write may not be done
                writers.append(h.result().extra.get("writer", "thread"))
            ck.close()
            result.update(fences=fences, policies=[scenario], writers=writers)
        elif scenario == "fail":
            ck = fp_core.AsyncCheckpointer(policy="overlap")
            path = os.path.join(d, "ck.pt")
            ck.save(sharded(mesh, full_state(0)), path, layout="file").result()
            if rank == 1:
                _native.inject_fault("write", errno=5)
            ck.save(sharded(mesh, full_state(1)), path, layout="file")
            try:
                ck.fence()
                ck.wait()
            except Exception as e:  # noqa: BLE001 - reported to the test
                result["wait_error"] = f"{type(e).__name__}: {e} <- {e.__cause__!r}"
            ck.save(sharded(mesh, full_state(2)), os.path.join(d, "after.pt"), layout="file").result()
            ck.close()
        else:
            raise ValueError(scenario)


if __name__ == "__main__":
    main()
