"""The save job: what every way of writing a checkpoint looks like to whoever runs it.

A local file (:class:`fp_core.saving.local.LocalSave`), a URL through the remote tier
(:class:`fp_core.remote.RemoteSave`) and a file written by many ranks
(:class:`fp_core.parallel.distributed.CollectiveSave`) are prepared on the caller's thread
(:func:`fp_core.api.prepare`: the object is pickled, so its structure is fixed then) and
run anywhere: synchronously by ``fp_core.save``, on the background writer by
``AsyncCheckpointer``, which needs nothing else from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..format.plan import FilePlan
from ..stats import SaveStats


class SaveJob(Protocol):
    final: str  # the name it is committed under: an absolute local path, or the URL
    plan: FilePlan | None  # its layout (None when planning failed on this rank of a collective save)
    stats: SaveStats
    # Written by several ranks together: its layout may still change to rank 0's, and
    # run() exchanges messages with the other ranks (callbacks must not raise inside it).
    collective: bool

    def run(self, on_body_written: Callable[[], None] | None = None) -> SaveStats:
        """Write, sync and commit; return the stats. ``on_body_written`` is called once no
        tensor memory will be read again. On failure nothing is committed and it raises."""
        ...

    def fail(self, error: BaseException) -> None:
        """A failure before :meth:`run` (a snapshot copy): ``run`` then raises it, after
        telling the other ranks of a collective save, and commits nothing."""
        ...

    def abort(self) -> None:
        """Give up before :meth:`run`: nothing is committed, nothing left behind."""
        ...
