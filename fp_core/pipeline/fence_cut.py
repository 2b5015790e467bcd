"""A fence that copies only what an overlap save has not written yet.

Under ``overlap`` the writer reads live tensors, and the fence before the optimizer step
waits until it has read them all. A fence that comes while much is still unwritten (a
short step, a slow disk) would wait for the rest of the write. Instead the fence copies
the storages not written yet into host memory, from the end of the file backwards, while
the writer goes on forwards from live memory; the fence opens when the two meet and the
writer's batch in flight (which reads live memory) is done. It never waits longer than the
write would take, nor longer than a copy of the rest; the writer then writes the copies.

The file is cut into batches of whole storages (block-aligned file ranges; the tail, whose
checksums read storage bytes, is the last). Each batch is claimed once, by the writer (read
live) or by the fence (copied first, then written from the copies), never both. A storage
that spans two batches is copied whole by the fence: the writer may still read its live
bytes for the earlier batch, which is harmless, as both read the same unchanged memory
until the fence opens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..format.plan import FilePlan, StorageExtent, align_down

_NONE, _LIVE, _COPYING, _COPIED = range(4)

MAX_BATCHES = 16  # the fence waits for at most one batch of the writer's: 1/16 of the body
MIN_BATCH_BYTES = 4 << 20  # below this, a batch costs the writer more (queue drained) than it saves
MAX_BATCH_BYTES = 64 << 20


def cut_ranges(plan: FilePlan) -> list[tuple[int, int]]:
    """Block-aligned ranges covering the file: the body cut before storages into about
    ``MAX_BATCHES`` batches, then the tail."""
    body = plan.tail_start
    target = min(MAX_BATCH_BYTES, max(MIN_BATCH_BYTES, plan.storage_bytes // MAX_BATCHES))
    cuts, acc = [0], 0
    for s in sorted(plan.storages, key=lambda s: s.offset):
        cut = align_down(s.offset, plan.alignment)
        if acc >= target and cuts[-1] < cut < body:
            cuts.append(cut)
            acc = 0
        acc += s.length
    cuts.append(body)
    ranges = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    return ranges + [(body, plan.file_size)]


class FenceCut:
    """Who reads each batch of one overlap save: the writer (live) or the fence (copies)."""

    def __init__(self, plan: FilePlan) -> None:
        self.ranges = cut_ranges(plan)
        # the storages with bytes in each range (one sweep: both are sorted by offset)
        self.members: list[list[StorageExtent]] = [[] for _ in self.ranges]
        k = 0
        for st in sorted(plan.storages, key=lambda x: x.offset):
            while k < len(self.ranges) and self.ranges[k][1] <= st.offset:
                k += 1
            j = k
            while j < len(self.ranges) and self.ranges[j][0] < st.end:
                self.members[j].append(st)
                j += 1
        self._state = [_NONE] * len(self.ranges)
        self._done = [False] * len(self.ranges)
        self._cv = threading.Condition()
        self._finished = False
        self.copied_bytes = 0
        self.arena: Any = None  # host memory the fence copied into (given back after the write)
        self.arena_filled = False

    # ------------------------------------------------------------------ the writer
    def index(self, lo: int, hi: int) -> list[int]:
        """The batches inside [lo, hi), in order."""
        return [i for i, (a, b) in enumerate(self.ranges) if a >= lo and b <= hi]

    def claim(self, i: int) -> None:
        """Before the writer reads batch ``i``: its bytes come from live memory unless the
        fence has copied it (then from the copies, once the copy is complete)."""
        with self._cv:
            while self._state[i] == _COPYING:
                self._cv.wait()
            if self._state[i] == _NONE:
                self._state[i] = _LIVE

    def done(self, i: int) -> None:
        with self._cv:
            self._done[i] = True
            self._cv.notify_all()

    def finish(self) -> None:
        """The writer reads no live memory any more (written, or failed): a waiting fence
        opens. Returns once no copy of the fence's is still running (its memory may go)."""
        with self._cv:
            self._finished = True
            self._cv.notify_all()
            while _COPYING in self._state:
                self._cv.wait()

    # ------------------------------------------------------------------ the fence
    def pending(self) -> list[StorageExtent]:
        """Storages of batches nobody has claimed yet (what the fence may copy); none once
        the writer has finished."""
        with self._cv:
            if self._finished:
                return []
            out: dict[int, StorageExtent] = {}
            for i, st in enumerate(self._state):
                if st == _NONE:
                    for s in self.members[i]:
                        if s.host is None:
                            out.setdefault(id(s), s)
            return list(out.values())

    def attach(self, arena: Any) -> bool:
        """Give the fence's copies ``arena``; False once the writer has finished (then
        nobody would hand it back: the caller keeps it)."""
        with self._cv:
            if self._finished:
                return False
            self.arena = arena
            return True

    def open(self, copy: Callable[[list[StorageExtent]], bool]) -> None:
        """Copy unclaimed batches from the last one backwards (``copy`` gives each storage
        its ``host`` copy; False: no room, leave the rest to the writer) until the writer
        reaches them, then wait for the writer's live batches. On return nothing still to
        be written reads live memory."""
        with self._cv:
            while not self._finished:
                j = next((k for k in range(len(self._state) - 1, -1, -1) if self._state[k] == _NONE), None)
                if j is None:
                    break
                todo = [s for s in self.members[j] if s.host is None]
                self._state[j] = _COPYING
                ok = False
                self._cv.release()
                try:
                    ok = copy(todo)
                finally:
                    self._cv.acquire()
                    self._state[j] = _COPIED if ok else _NONE
                    if ok:
                        self.copied_bytes += sum(s.length for s in todo)
                    self._cv.notify_all()
                if not ok:
                    break
            while not self._finished and not all(st == _COPIED or d for st, d in zip(self._state, self._done)):
                self._cv.wait()


__all__ = ["FenceCut", "cut_ranges"]
