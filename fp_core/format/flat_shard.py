"""A rank's contiguous element range of a tensor's flattened row-major form (``FlatShard``),
and the check that the ranks' ranges tile each tensor exactly once.

FSDP1 keeps each original parameter as a contiguous element range of its flattened form in
every rank's ``flat_param`` shard (and Adam's ``exp_avg`` / ``exp_avg_sq`` the same way).
A contiguous element range of a row-major tensor is one byte run of the full tensor's
bytes, so each rank can write its range straight into a file of the full state
(``fp_core.save(..., layout="file")``, :mod:`fp_core.parallel.sharded_file`) with no
gather. A FlatShard says where its range lies; the ranks' ranges are only known together,
so the writers exchange them (metadata) and refuse a state whose ranges leave a gap or
overlap (:func:`tiling_problem`) before any byte is written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch


class FlatShard:
    """This rank's elements ``[start, start + local.numel())`` of the full tensor of shape
    ``global_shape`` (dtype ``local.dtype``), in that tensor's flattened row-major order.
    ``local`` may have any shape (its elements are taken in its own row-major order) and
    may be empty; it stays the caller's tensor (not copied)."""

    __slots__ = ("local", "global_shape", "start")

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], start: int) -> None:
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"FlatShard takes a tensor, not {type(local).__name__}")
        shape = torch.Size(int(n) for n in global_shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"FlatShard: global shape {tuple(shape)} has a negative size")
        total = math.prod(shape)
        start = int(start)
        if start < 0 or start + local.numel() > total:
            raise ValueError(f"FlatShard: elements [{start}, {start + local.numel()}) are outside the "
                             f"{total} elements of shape {tuple(shape)}")
        self.local = local
        self.global_shape = shape
        self.start = start

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def shape(self) -> torch.Size:
        """The full tensor's shape."""
        return self.global_shape

    def numel(self) -> int:
        """The full tensor's element count."""
        return math.prod(self.global_shape)

    @property
    def stop(self) -> int:
        """One past this rank's last element."""
        return self.start + self.local.numel()

    def __repr__(self) -> str:
        return (f"FlatShard(elements [{self.start}, {self.stop}) of {tuple(self.global_shape)} "
                f"{self.dtype})")


def tiling_problem(numel: int, ranges: Iterable[tuple[int, int, int]]) -> str | None:
    """Why the ranks' element ranges ``(rank, start, count)`` (empty ones included) do not
    cover ``[0, numel)`` exactly once, or None when they do."""
    spans = sorted((start, start + count, rank) for rank, start, count in ranges if count)
    at, last = 0, None
    for lo, hi, rank in spans:
        if lo < at:
            return (f"rank {rank}'s elements [{lo}, {hi}) overlap rank {last[2]}'s [{last[0]}, {last[1]})"
                    if last is not None else f"rank {rank}'s elements [{lo}, {hi}) start before 0")
        if lo > at:
            return f"no rank holds elements [{at}, {lo})"
        at, last = hi, (lo, hi, rank)
    if at != numel:
        return f"no rank holds elements [{at}, {numel})"
    return None


__all__ = ["FlatShard", "tiling_problem"]
