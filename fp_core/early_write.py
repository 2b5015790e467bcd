"""A synchronous save's storages written while its pickle is still being made.

The plan of a state of thousands of tensors (the pickle, torch's zip records, the
checksums of the skeleton, the manifest) is CPU work that a sync save otherwise does
before its first byte goes to the disk. For a plain state (:mod:`.state_pickle`), the
storages are found by a walk that costs a fraction of the pickle
(:func:`state_pickle.walk_storages`), their records are laid out first in the file
(:class:`skeleton.StoragesFirst`: torch's reader finds records through the central
directory, so ``data.pkl`` need not come first), and their bytes are written on a thread
while the caller's thread pickles; the rest of the file (the pickle, the small records, the
tail) is written after, as in any save.

If the pickle meets the state other than the walk found it (another thread changed it
meanwhile), the early bytes are not used: the save waits for them and lays the file out
and writes it again from the start, as a save without this would have.
"""

from __future__ import annotations

import threading
from typing import Any

from . import plan as plan_mod
from . import state_pickle
from .engine import EngineOptions
from .plan import FilePlan, StorageExtent, align_down
from .skeleton import StoragesFirst
from .writer import PieceCrc, RangeStats, write_range

# Below this many bytes of storages, a save's plan is a small share of its time and a
# thread to overlap it with costs more than it hides.
MIN_BYTES = 32 << 20


class EarlyWrite:
    """The storages of a plain state, laid out first and being written on a thread."""

    def __init__(self, engine: Any, layout: StoragesFirst, alignment: int, options: EngineOptions) -> None:
        self.layout = layout
        self.alignment = alignment
        self.end = align_down(layout.end, alignment)  # bytes below this are written early
        storages = layout.storages
        extents = [StorageExtent(off, storages[key][2], storages[key][0], int(key)) for key, off in layout.offsets]
        self._head = FilePlan(file_size=layout.end, alignment=alignment, skeleton=layout.head(), storages=extents,
                              manifest=None)
        self.stats = RangeStats()
        self._pieces: list[PieceCrc] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine, options), name="fastpersist-early-write",
                                        daemon=True)
        self._thread.start()

    def _run(self, engine: Any, options: EngineOptions) -> None:
        try:
            self._pieces = write_range(engine, self._head, 0, self.end, options, self.stats)
        except BaseException as e:  # raised to the caller by result()
            self._error = e

    def plan(self, obj: Any) -> FilePlan | None:
        """The whole file's plan, its storages where they are being written; None if the
        state is no longer the one the walk found (then :meth:`wait` and plan anew)."""
        names: dict[int, tuple[str, str]] = {}
        try:
            data, storages = state_pickle.dumps(obj, names, storages=self.layout.storages)
        except state_pickle.NotPlainState:
            return None
        plan = plan_mod.from_skeleton(self.layout.finish(data), storages, names, self.alignment)
        early = {s.record: s.offset for s in self._head.storages}
        if any(early.get(s.record, s.offset) != s.offset for s in plan.storages):
            raise RuntimeError("the storages' layout moved between the early write and the plan")
        return plan

    def result(self) -> tuple[list[PieceCrc], RangeStats]:
        """Wait for the early write; its checksums and stats (its error, raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._pieces, self.stats

    def wait(self) -> None:
        """Wait for the early write, its outcome dropped (the save is failing, or starts over)."""
        self._thread.join()


def start(obj: Any, engine: Any, alignment: int, options: EngineOptions) -> EarlyWrite | None:
    """Start writing ``obj``'s storages on a thread, or None where the state is not plain
    or too small for it to pay."""
    storages = state_pickle.walk_storages(obj)
    if not storages or sum(n for _, _, n in storages.values()) < MIN_BYTES:
        return None
    layout = StoragesFirst(storages, alignment, plan_mod.PLAIN_STORAGE_ALIGNMENT)
    if align_down(layout.end, alignment) < MIN_BYTES:
        return None
    return EarlyWrite(engine, layout, alignment, options)


__all__ = ["EarlyWrite", "start", "MIN_BYTES"]
