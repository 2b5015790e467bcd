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
out exactly as :func:`fp_core.format.plan.build` does, and nothing is written early.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from ..format import plan as plan_mod
from ..format import state_pickle
from ..format.plan import FilePlan, StorageExtent, align_down
from ..format.skeleton import StoragesFirst, plain_skeleton, record_bytes, storage_alignment, torch_capture
from ..format.state_pickle import StorageEntry
from ..io.engine import EngineOptions
from ..io.thread_wait import wait_until_out
from ..io.writer import PieceCrc, RangeStats, mark_ready, prepare_rows, write_range

log = logging.getLogger("fastpersist")

# Storage bytes found before the writing begins: below this a save's plan is a small share
# of its time and a thread to overlap it with costs more than it hides.
MIN_BYTES = 32 << 20
# Laid-out bytes handed to the writing thread at a time, at least (when it is idle; the
# rest waits for the next storage found, or the pickle's end).
MIN_BATCH = 8 << 20
# How long the pickling waits for the writing thread to take its first batch (see _begin).
HANDOVER_S = 0.05


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
        self._taken = threading.Event()  # the thread has taken a batch (its first, for _begin)
        self._out = threading.Event()  # the writing thread is out of the file for good
        self._thread: threading.Thread | None = None
        self._closed = False
        self._cancelled = False  # the save is failing: batches not begun are skipped
        self._plain = True  # our pickler runs (False: torch's, after ours stopped)
        self._packing: int | None = None  # the packed alignment the layout may use (see _begin)
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
        # the packed alignment applies to states our pickler takes, as in plan.build; the
        # layout follows the rule it began with to the end
        self._packing = plan_mod.PLAIN_STORAGE_ALIGNMENT if self._plain else None
        self.layout = StoragesFirst(first, self.alignment, self._packing)
        for key, entry in first.items():
            self._lay_out(key, entry)
        thread = threading.Thread(target=self._run, name="fastpersist-early-write", daemon=True)
        thread.start()
        self._thread = thread  # only once started: stop() joins it
        self._offer()
        # Let go of the GIL until the thread has its first batch: woken while this thread
        # pickles, it can wait many switch intervals for the GIL with the disk idle.
        # Bounded: a thread that never takes it costs the pickling no more.
        if self._offered:  # else nothing was queued (less than a block laid out)
            self._taken.wait(HANDOVER_S)

    def _lay_out(self, key: str, entry: StorageEntry) -> None:
        storage, _, nbytes = entry
        offset = self.layout.add(key, nbytes)
        if nbytes:
            extent = StorageExtent(offset, nbytes, storage, int(key))
            if storage.device.type != "cpu":
                # Copied to the host on the writing thread, whose current stream is not the
                # caller's: it must wait for the work queued on the caller's stream by now.
                mark_ready([extent])
            self._pending.append(extent)

    def _offer(self, ahead: bool = False) -> None:
        """Hand the laid-out bytes not handed yet (to a block boundary) to the thread;
        ``ahead``: build their rows here if the thread is still writing (see _queue)."""
        lo, hi = self._offered, align_down(self.layout.end, self.alignment)
        if hi <= lo:
            return
        extents = [s for s in self._pending if s.offset < hi]
        self._pending = [s for s in self._pending if s.end > hi]
        batch = FilePlan(file_size=hi, alignment=self.alignment, skeleton=self.layout.take(lo, hi),
                         storages=extents, manifest=None)
        self._queue(batch, lo, hi, ahead)

    def _queue(self, batch: FilePlan, lo: int, hi: int, ahead: bool) -> None:
        # The caller builds a batch's rows only once the pickle is made (what is left on its
        # side is the plan's books) and while the thread is still writing: then the disk
        # goes on to this batch without waiting for thousands of rows. While the pickle is
        # made, or with the thread idle, the thread builds them, beside the pickler.
        rows = prepare_rows(self._engine, batch, lo, hi) if ahead and not self._idle.is_set() else None
        # The final plan's extents are new ones: a device storage among them (the last
        # block of the last one found) is staged on the thread, whose current stream is not
        # the caller's; as in _lay_out, its copy waits for the caller's stream of now.
        unmarked = [s for s in batch.storages_in(lo, hi) if not s.on_cpu and s.ready is None]
        if unmarked:
            mark_ready(unmarked)
        self._idle.clear()
        self._batches.put((batch, lo, hi, rows))
        self._offered = hi

    # -- the writing thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._drain()
        finally:
            self._out.set()

    def _drain(self) -> None:
        while True:
            item = self._batches.get()
            self._taken.set()
            if item is None:
                return
            if self._error is None and not self._cancelled:  # else batches are only drained
                batch, lo, hi, rows = item
                try:
                    self._pieces.extend(write_range(self._engine, batch, lo, hi, self._options, self.stats,
                                                    prepared=rows))
                except BaseException as e:  # raised to the caller by result()
                    self._error = e
            if self._batches.empty():
                self._idle.set()
                if not self._batches.empty():  # queued just before the flag went up
                    self._idle.clear()

    # -- the caller's side -------------------------------------------------------------
    def plan(self, obj: Any) -> FilePlan | None:
        """The whole file's plan, its storages where they are being written; None if torch's
        pickler found other storages than ours (then :meth:`stop` and plan anew)."""
        names: dict[int, tuple[str, str]] = {}
        try:
            data, storages = state_pickle.dumps(obj, names, on_storage=self._on_storage)
            sparse = None
        except state_pickle.NotPlainState:
            self._plain = False
            try:
                sparse, storages = torch_capture(obj, self.alignment, on_storage=self._on_storage)
            except _Diverged:
                return None
            if len(storages) != len(self._entries):  # fewer than ours found: the state changed
                return None
            names = plan_mod.tensor_names(obj)
            data = record_bytes(sparse, "/data.pkl")
        if self.layout is None:  # too small to begin: laid out as plan.build does
            if sparse is None:
                sparse = plain_skeleton(data, storages, self.alignment, plan_mod.PLAIN_STORAGE_ALIGNMENT)
            return plan_mod.from_skeleton(sparse, storages, names, self.alignment)
        if storage_alignment(storages, self.alignment, self._packing) != self.layout.alignment:
            # decided on the storages found first, the rest would have decided otherwise (a
            # large tensor, then thousands of small ones): lay the file out as build() would
            return None
        self._offer(ahead=True)  # the rest of the storages' bytes
        self.end = self._offered
        plan = plan_mod.from_skeleton(self.layout.finish(data), storages, names, self.alignment)
        records = plan.manifest.records
        early = {s.record: s.offset for s in plan.storages if s.offset < self.end}
        if any(offset != early.get(int(key)) or not records[int(key)].name.endswith(f"/data/{key}")
               for key, offset in self.layout.offsets if offset < self.end):
            log.error("fastpersist: the storages' layout moved between the early write and the plan; "
                      "writing the checkpoint anew")
            return None
        # The rest of the body (the pickle, torch's small records) goes on the same thread
        # right after the storages, its rows built here: not in a separate call once the
        # storages are written, which would leave the disk waiting for its setup.
        # From here until result() has waited for the thread, nothing may change the final
        # plan's skeleton (finish_tail writes into it after that): the thread may be
        # reading it.
        if plan.tail_start > self.end:
            self._queue(plan, self.end, plan.tail_start, ahead=True)
            self.end = plan.tail_start
        self._close()
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

    def stop(self, cancel: bool = False) -> None:
        """No more batches (``cancel``: none not begun either); wait for the thread to be
        out of the file, which must not be closed under its writes. An interrupt (Ctrl-C)
        while waiting cancels what is not begun and is raised once the thread is out."""
        if cancel:
            self._cancelled = True
        self._close()
        thread = self._thread
        if thread is None:
            return
        wait_until_out(self._out, on_interrupt=self._cancel)  # not join(): see thread_wait

    def _cancel(self) -> None:
        self._cancelled = True


__all__ = ["EarlyWrite", "MIN_BYTES", "MIN_BATCH"]
