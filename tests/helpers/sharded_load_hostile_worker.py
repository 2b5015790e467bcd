"""A rank of a hostile-input ``load_into`` test on 2 gloo ranks.

Usage: python sharded_load_hostile_worker.py RANK WORLD PORT DIR SCENARIO (conftest.run_ranks);
each rank reports to DIR/result<RANK>.json, rank 0 to DIR/result.json as well.

Scenarios:

- ``family``: every file DIR/cases.json lists (``[{"file", "case", "verify"}]``; ``case``
  a key of :data:`sharded_load_hostile.CASES`, a target shaped as it declares) loaded into a
  fenced DTensor target placed ``Shard(0)``, ``Replicate()`` and HSDP (``Replicate(),
  Shard(0)`` on a 1 x 2 mesh) and tensor parallel (``Shard(1)``); per load: the outcome, whether the sentinels around the
  local shard held, whether a load that went through filled the shard with its rows as
  ``torch.load`` gives them, and its seconds.
- ``one_fails``: rank 1 alone fails before its reads (its file missing, its target of
  another shape, its file's pickle damaged) while rank 0 loads DIR/good.pt, verified and
  not; per case each rank's outcome and seconds. Then both load good.pt: the group is
  still in step.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rank_report import reported  # noqa: E402
from sharded_load_hostile import CASES, declared, fence_intact, fenced, outcome  # noqa: E402

import fp_core  # noqa: E402

GLOO_TIMEOUT_S = 60  # a rank left waiting fails after this, far above what a prompt raise takes


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def fenced_dtensor(shape: tuple[int, ...], dtype: torch.dtype, mesh: Any,
                   placements: list) -> tuple[Any, Any, tuple[slice, ...]]:
    """(DTensor of global ``shape`` whose local shard is fenced, the fence, the block of
    the full tensor its local shard holds)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    local, big = fenced(tuple(local_shape), dtype)
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                            stride=contiguous_stride(shape))
    return dt, big, tuple(slice(o, o + n) for o, n in zip(offset, local_shape))


def family(d: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    flat = init_device_mesh("cpu", (2,))
    hsdp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    layouts = {"shard": (flat, [Shard(0)]), "replicate": (flat, [Replicate()]),
               "hsdp": (hsdp, [Replicate(), Shard(0)]), "tensor parallel": (flat, [Shard(1)])}
    with open(os.path.join(d, "cases.json")) as f:
        cases = json.load(f)
    out = []
    for c in cases:
        path = os.path.join(d, c["file"])
        shape, dtype = declared(c["case"]) if c["case"] in CASES else (tuple(c["shape"]), torch.float32)
        whole = outcome(torch.load, path, weights_only=True)
        for name, (mesh, placements) in layouts.items():
            dt, big, block = fenced_dtensor(shape, dtype, mesh, placements)
            t0 = time.monotonic()
            got = outcome(fp_core.load_into, {"w": dt, "epoch": 0}, path, verify=c["verify"])
            seconds = time.monotonic() - t0
            local = dt.to_local()
            rows = local.shape[0] if local.ndim else 1
            filled = None
            if not got and not whole:
                full = torch.load(path, weights_only=True)["w"]
                filled = bool(torch.equal(local, full[block]))
            out.append({"file": c["file"], "case": c["case"], "verify": c["verify"], "layout": name,
                        "outcome": got, "fence": fence_intact(big, rows), "filled": filled, "seconds": seconds})
    return {"loads": out}


def one_fails(d: str, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2,))
    good = os.path.join(d, "good.pt")
    shape = (64, 8)

    def target(rows: int = shape[0]) -> dict:
        return {"w": fenced_dtensor((rows, *shape[1:]), torch.float32, mesh, [Shard(0)])[0], "epoch": 0}

    cases = {"missing file": lambda: (os.path.join(d, "missing.pt"), target()),
             "target of another shape": lambda: (good, target(65)),
             "damaged pickle": lambda: (os.path.join(d, "damaged_pickle.pt"), target())}
    out = {}
    for name, mine in cases.items():
        for verify in (True, False):
            path, tgt = mine() if rank == 1 else (good, target())
            t0 = time.monotonic()
            got = outcome(fp_core.load_into, tgt, path, verify=verify)
            out[f"{name}, verify={verify}"] = {"outcome": got, "seconds": time.monotonic() - t0}
    tgt = target()
    out["after"] = {"outcome": outcome(fp_core.load_into, tgt, good, verify=True)}
    return {"cases": out}


def main() -> None:
    rank, world, port, d, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    result: dict = {"rank": rank}
    with reported(d, rank, result):
        if scenario == "family":
            result.update(family(d))
        elif scenario == "one_fails":
            result.update(one_fails(d, rank))
        else:
            raise ValueError(scenario)


if __name__ == "__main__":
    main()
