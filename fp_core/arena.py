"""The snapshot arena: a reusable host buffer that the snapshot policy copies checkpoints into.

Each copy sits in the arena at the same place modulo a page as its storage sits in the
file, so memory and file offsets agree modulo the O_DIRECT alignment and the engine writes
every copy straight from the arena, with no second (staging) copy. An arena is kept across
saves; its first fill faults every page in, which is why ``auto`` warms one first.
"""

from __future__ import annotations

import mmap

import torch

from . import _native
from .plan import StorageExtent
from .writer import SNAPSHOT_CONGRUENCE

ARENA_ALIGN = SNAPSHOT_CONGRUENCE  # the unit stage_cpu checksums the copies' ranges in
HUGE_PAGE = 2 << 20


def arena_layout(extents: list[StorageExtent]) -> tuple[list[int], int]:
    """Arena position of each extent's copy (congruent to its file offset), and the size."""
    positions, pos = [], 0
    for s in extents:
        pos += (s.offset - pos) % ARENA_ALIGN
        positions.append(pos)
        pos += s.length
    return positions, pos


def arena_need(extents: list[StorageExtent]) -> tuple[int, bool]:
    """The arena size ``extents`` need in any file layout (their bytes and at most an
    alignment gap before each: the same state laid out congruent to its addresses, or
    not, for an auto save that expects to snapshot, fits the same arena) and whether it
    must be pinned (a CUDA tensor among them)."""
    return (sum(s.length for s in extents) + (ARENA_ALIGN - 1) * len(extents),
            any(s.source.device.type == "cuda" for s in extents))


class Arena:
    """A reusable host buffer that snapshot copies are carved from (kept across saves)."""

    def __init__(self, nbytes: int, pin: bool, huge: bool = False) -> None:
        huge = huge and not pin  # pinned memory is the CUDA driver's to lay out
        self._map: mmap.mmap | None = None
        if huge:
            # A mapping of its own: malloc may hand back heap pages already touched (as
            # 4 KiB pages), and the advice only shapes pages faulted in after it.
            self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            raw = torch.frombuffer(self._map, dtype=torch.uint8)
            align = HUGE_PAGE
        else:
            raw = torch.empty(nbytes + ARENA_ALIGN, dtype=torch.uint8, pin_memory=pin)
            align = ARENA_ALIGN
        skip = -raw.data_ptr() % align
        self.buf = raw[skip: skip + nbytes]
        self.pin = pin
        # Advised before any page is touched, so the first fill faults in huge pages.
        self.huge_bytes = _native.advise_huge(self.buf.data_ptr(), nbytes) if huge else 0
        self.slots: dict[int, torch.Tensor] = {}  # id(extent) -> its copy's place, for one save
        self.fresh = True  # no page touched yet: the first copy into it faults every page in

    def carve(self, extents: list[StorageExtent]) -> list[torch.Tensor]:
        positions, _ = arena_layout(extents)
        return [self.buf[p: p + s.length] for p, s in zip(positions, extents)]
