"""The snapshot arena: a reusable host buffer that the snapshot policy copies checkpoints into.

Each copy sits in the arena at the same place modulo a page as its storage sits in the
file, so memory and file offsets agree modulo the O_DIRECT alignment and the engine writes
every copy straight from the arena, with no second (staging) copy. An arena is kept across
saves; its first fill faults every page in, which is why ``auto`` warms one first.
"""

from __future__ import annotations

import logging
import mmap

import torch

from .. import _native
from ..format.plan import StorageExtent
from .pinned_host import pinned_buffer
from .writer import SNAPSHOT_CONGRUENCE

ARENA_ALIGN = SNAPSHOT_CONGRUENCE  # the unit stage_cpu checksums the copies' ranges in
HUGE_PAGE = 2 << 20

log = logging.getLogger("fastpersist")


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


def _pinned(nbytes: int, huge: bool) -> tuple[torch.Tensor, int]:
    """Page-locked memory for an arena of device tensors' copies: of the size asked for
    (:mod:`fp_core.io.pinned_host`), else, where the driver will not register it, torch's
    pinned allocator (which rounds up to a power of two)."""
    try:
        return pinned_buffer(nbytes, ARENA_ALIGN, huge=huge)
    except OSError as e:
        log.warning("fastpersist: %s; the snapshot arena takes torch's pinned memory instead "
                    "(rounded up to a power of two)", e)
    raw = torch.empty(nbytes + ARENA_ALIGN, dtype=torch.uint8, pin_memory=True)
    return raw[-raw.data_ptr() % ARENA_ALIGN:][:nbytes], 0


class Arena:
    """A reusable host buffer that snapshot copies are carved from (kept across saves)."""

    def __init__(self, nbytes: int, pin: bool, huge: bool = False) -> None:
        self.pin = pin
        self.huge_bytes = 0
        if pin:
            self.buf, self.huge_bytes = _pinned(nbytes, huge)
        elif huge:
            # A mapping of its own: malloc may hand back heap pages already touched (as
            # 4 KiB pages), and the advice only shapes pages faulted in after it.
            m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            raw = torch.frombuffer(m, dtype=torch.uint8)  # its storage holds the mapping
            self.buf = raw[-raw.data_ptr() % HUGE_PAGE:][:nbytes]
            # Advised before any page is touched, so the first fill faults in huge pages.
            self.huge_bytes = _native.advise_huge(self.buf.data_ptr(), nbytes)
        else:
            raw = torch.empty(nbytes + ARENA_ALIGN, dtype=torch.uint8)
            self.buf = raw[-raw.data_ptr() % ARENA_ALIGN:][:nbytes]
        self.slots: dict[int, torch.Tensor] = {}  # id(extent) -> its copy's place, for one save
        self.fresh = True  # no page touched yet: the first copy into it faults every page in

    def carve(self, extents: list[StorageExtent]) -> list[torch.Tensor]:
        positions, _ = arena_layout(extents)
        return [self.buf[p: p + s.length] for p, s in zip(positions, extents)]
