"""Where a rank's local shard of a DTensor lies in the full tensor's row-major bytes: the
global indices it holds along each dimension, and the byte runs they make. A save as one
file (:mod:`fp_core.parallel.sharded_file`) writes each run at its place in the file; a
load into DTensor targets (:mod:`fp_core.loading.load_in_place`) reads each run from there."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def global_indices(dt: Any) -> list[Sequence[int]]:
    """For each dimension of ``dt``, the global indices of this rank's local shard along
    it, in the local shard's order (its local shard is the full tensor at their product)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = dt.device_mesh, tuple(dt.placements)
    if not any(isinstance(p, _StridedShard) for p in placements):  # a box: one range per dimension
        shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
        return [range(o, o + n) for o, n in zip(offset, shape)]
    out: list[Sequence[int]] = []
    for d, size in enumerate(dt.shape):
        if not any(isinstance(p, (Shard, _StridedShard)) and p.dim == d for p in placements):
            out.append(range(size))
            continue
        # The placements that shard dimension d, applied by DTensor itself to its indices
        # (each rank chunks its own copy: src_data_rank=None sends nothing).
        on_d = [(_StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0))
                if isinstance(p, (Shard, _StridedShard)) and p.dim == d else Replicate() for p in placements]
        out.append(distribute_tensor(torch.arange(size), mesh, on_d, src_data_rank=None).to_local().tolist())
    return out


def _runs(idx: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive indices: (first global index, first local index, length)."""
    if isinstance(idx, range):
        return [(idx.start, 0, len(idx))] if len(idx) else []
    out: list[list[int]] = []
    for i, g in enumerate(idx):
        if out and out[-1][0] + out[-1][2] == g:
            out[-1][2] += 1
        else:
            out.append([g, i, 1])
    return [(g, i, n) for g, i, n in out]


def shard_segments(shape: Sequence[int], idx: list[Sequence[int]], itemsize: int) -> list[tuple[int, int, int]]:
    """The byte runs of a local shard (the full tensor of ``shape`` at the product of the
    per-dimension indices ``idx``, row-major) in the full tensor's row-major bytes:
    ``(full offset, local offset, length)``, in local order. ``Shard(0)`` is one run; a
    shard of a later dimension is one run per index of the dimensions before it."""
    if not all(len(i) for i in idx):
        return []
    n = len(shape)
    k = n - 1  # the last dimension the shard does not hold whole: runs are along it
    while k >= 0 and len(idx[k]) == shape[k]:
        k -= 1
    inner = math.prod(shape[k + 1:]) * itemsize
    if k < 0:
        return [(0, 0, inner)]
    strides = [math.prod(shape[j + 1:]) * itemsize for j in range(n)]
    runs = [(g * inner, i * inner, m * inner) for g, i, m in _runs(idx[k])]
    row = len(idx[k]) * inner  # the local bytes of one index of the dimensions before k
    # the full offset of each index of the dimensions before k, in local (row-major) order
    bases = np.zeros(1, dtype=np.int64)
    for g_idx, st in zip(idx[:k], strides):
        bases = (bases[:, None] + np.asarray(g_idx, dtype=np.int64)[None, :] * st).reshape(-1)
    local = np.arange(len(bases), dtype=np.int64) * row
    full_at = np.stack([bases + g for g, _, _ in runs], axis=1).reshape(-1)
    local_at = np.stack([local + i for _, i, _ in runs], axis=1).reshape(-1)
    lengths = np.tile(np.array([m for _, _, m in runs], dtype=np.int64), len(bases))
    return list(zip(full_at.tolist(), local_at.tolist(), lengths.tolist()))
