"""A synchronous save writes its storages while its pickle is still being made.

The plan of a state of thousands of tensors (the pickle, torch's zip records, the
checksums of the skeleton, the manifest) is CPU work that a sync save otherwise does
before its first byte goes to the disk. Here the pickler reports each storage as it finds
it (``on_storage``); once those found hold :data:`MIN_BYTES`, their records are laid out
first in the file (:class:`skeleton.StoragesFirst`: torch's reader finds records through
the central directory, so ``data.pkl`` need not come first), later ones after them as they
are found, and a thread writes the laid-out bytes in batches while the pickling goes on.
The pickle, torch's small records and the tail are written after, as in any save.

A state that is not plain (:mod:`.state_pickle` stops at the first object it does not
write: a Lightning checkpoint's ``hyper_parameters``, say) is pickled again by torch's
pickler, whose storage keys come in the same order: the storages already laid out keep
their places and the write goes on. Only if they differ (the state changed in between) is
the file laid out and written again from the start. A state below :data:`MIN_BYTES` is laid
out exactly as :func:`fp_core.plan.build` does, and nothing is written early.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from . import plan as plan_mod
from . import state_pickle
from .engine import EngineOptions
from .plan import FilePlan, StorageExtent, align_down
from .skeleton import StoragesFirst, plain_skeleton, record_bytes, torch_capture
from .state_pickle import StorageEntry
from .writer import PieceCrc, RangeStats, write_range

# Storage bytes found before the writing begins: below this a save's plan is a small share
# of its time and a thread to overlap it with costs more than it hides.
MIN_BYTES = 32 << 20
# Laid-out bytes handed to the writing thread at a time, at least (when it is idle; the
# rest waits for the next storage found, or the pickle's end).
MIN_BATCH = 8 << 20


class _Diverged(Exception):
    """torch's pickler found other storages than ours under the keys laid out."""


class EarlyWrite:
    """One sync save's plan, made while the storages it finds are written on a thread."""

    def __init__(self, engine: Any, alignment: int, options: EngineOptions) -> None:
        self._engine, self.alignment, self._options = engine, alignment, options
        self._entries: list[StorageEntry] = []  # by key: what the pickle found
        self._found_bytes = 0
        self.layout: StoragesFirst | None = None
        self._pending: list[StorageExtent] = []  # laid out, not yet wholly handed to the thread
        self._offered = 0  # bytes below this are handed to the thread
        self.end = 0  # bytes below this are written early (final once the plan is made)
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._pieces: list[PieceCrc] = []
        self.stats = RangeStats()

    @property
    def started(self) -> bool:
        return self._thread is not None

    # -- the pickler's side ------------------------------------------------------------
    def _on_storage(self, key: str, entry: StorageEntry) -> None:
        i = int(key)
        if i < len(self._entries):  # found by an earlier pickle of this state: the same one?
            storage, _, nbytes = self._entries[i]
            if entry[0]._cdata != storage._cdata or entry[2] != nbytes:
                raise _Diverged(key)
            return
        self._entries.append(entry)
        if self.layout is None:
            self._found_bytes += entry[2]
            if self._found_bytes >= MIN_BYTES:
                self._begin()
            return
        self._lay_out(key, entry)
        if self._idle.is_set() and self.layout.end - self._offered >= MIN_BATCH:
            self._offer()

    def _begin(self) -> None:
        first = {str(i): e for i, e in enumerate(self._entries)}
        self.layout = StoragesFirst(first, self.alignment, plan_mod.PLAIN_STORAGE_ALIGNMENT)
        for key, entry in first.items():
            self._lay_out(key, entry)
        self._thread = threading.Thread(target=self._run, name="fastpersist-early-write", daemon=True)
        self._thread.start()
        self._offer()

    def _lay_out(self, key: str, entry: StorageEntry) -> None:
        storage, _, nbytes = entry
        offset = self.layout.add(key, nbytes)
        if nbytes:
            self._pending.append(StorageExtent(offset, nbytes, storage, int(key)))

    def _offer(self) -> None:
        """Hand the laid-out bytes not handed yet (to a block boundary) to the thread."""
        lo, hi = self._offered, align_down(self.layout.end, self.alignment)
        if hi <= lo:
            return
        extents = [s for s in self._pending if s.offset < hi]
        self._pending = [s for s in self._pending if s.end > hi]
        batch = FilePlan(file_size=hi, alignment=self.alignment, skeleton=self.layout.take(lo, hi),
                         storages=extents, manifest=None)
        self._offered = hi
        self._idle.clear()
        self._batches.put((batch, lo, hi))

    # -- the writing thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._batches.get()
            if item is None:
                return
            if self._error is None:  # after a failure, batches are only drained
                batch, lo, hi = item
                try:
                    self._pieces.extend(write_range(self._engine, batch, lo, hi, self._options, self.stats))
                except BaseException as e:  # raised to the caller by result()
                    self._error = e
            if self._batches.empty():
                self._idle.set()

    # -- the caller's side -------------------------------------------------------------
    def plan(self, obj: Any) -> FilePlan | None:
        """The whole file's plan, its storages where they are being written; None if torch's
        pickler found other storages than ours (then :meth:`stop` and plan anew)."""
        names: dict[int, tuple[str, str]] = {}
        try:
            data, storages = state_pickle.dumps(obj, names, on_storage=self._on_storage)
            sparse = None
        except state_pickle.NotPlainState:
            try:
                sparse, storages = torch_capture(obj, self.alignment, on_storage=self._on_storage)
            except _Diverged:
                return None
            names = plan_mod.tensor_names(obj)
            data = record_bytes(sparse, "/data.pkl")
        if self.layout is None:  # too small to begin: laid out as plan.build does
            if sparse is None:
                sparse = plain_skeleton(data, storages, self.alignment, plan_mod.PLAIN_STORAGE_ALIGNMENT)
            return plan_mod.from_skeleton(sparse, storages, names, self.alignment)
        self._offer()  # the rest of the storages' bytes
        self.end = self._offered
        self._close()
        plan = plan_mod.from_skeleton(self.layout.finish(data), storages, names, self.alignment)
        early = {s.record: s.offset for s in plan.storages if s.offset < self.end}
        if any(offset != early.get(int(key)) for key, offset in self.layout.offsets if offset < self.end):
            raise RuntimeError("the storages' layout moved between the early write and the plan")
        return plan

    def _close(self) -> None:
        if self._thread is not None and not self._closed:
            self._closed = True
            self._batches.put(None)

    def result(self) -> tuple[list[PieceCrc], RangeStats]:
        """Wait for the early write; its checksums and stats (its error, raised)."""
        self.stop()
        if self._error is not None:
            raise self._error
        return self._pieces, self.stats

    def stop(self) -> None:
        """No more batches; wait for those handed over (never close the file under them)."""
        self._close()
        if self._thread is not None:
            self._thread.join()


__all__ = ["EarlyWrite", "MIN_BYTES", "MIN_BATCH"]
