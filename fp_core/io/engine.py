"""Python face of the native engine: options, backend choice and its one log line."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace

from .. import _native

log = logging.getLogger("fastpersist")

BACKENDS = ("auto", "io_uring", "threadpool", "buffered")
_reported: set[tuple[str, str]] = set()


@dataclass
class EngineOptions:
    """Tuning knobs of the native writer. Defaults suit one NVMe drive and a few cores.

    Staging memory is ``(queue_depth + copy_threads) * chunk_bytes`` (72 MiB by default),
    allocated once per process and reused; it never grows with the checkpoint.

    ``share_queue``: where several ranks on one host write one collective file at once,
    each takes ``queue_depth`` divided among them (at least 2), so the host's disk sees
    about one writer's queue, not one per rank (deep queues from several processes under one
    device lose bandwidth, and each holds its staging memory).
    """

    backend: str = field(default_factory=lambda: os.environ.get("FASTPERSIST_BACKEND", "auto"))
    queue_depth: int = 16
    chunk_bytes: int = 4 << 20
    copy_threads: int = 2
    io_threads: int = 4
    share_queue: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, not {self.chunk_bytes}")
        for name in ("queue_depth", "copy_threads", "io_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @classmethod
    def pick(cls, options: dict) -> tuple[EngineOptions, dict]:
        """Split keyword options into engine options and the rest."""
        names = {f.name for f in fields(cls)}
        mine = {k: options.pop(k) for k in list(options) if k in names}
        return cls(**mine), options

    def for_ranks_on_host(self, n: int) -> EngineOptions:
        """The options for one of ``n`` ranks on a host writing at once (``share_queue``)."""
        if not self.share_queue or n <= 1:
            return self
        return replace(self, queue_depth=max(2, self.queue_depth // n))

    def staging_bytes(self) -> int:
        return (self.queue_depth + self.copy_threads) * self.chunk_bytes


def open_engine(path: str, options: EngineOptions, create: bool = True, tmpfile: bool = False,
                mode: int = 0o666) -> _native.Engine:
    """The native engine on ``path`` (with ``tmpfile``: an unnamed new file in the directory
    ``path``; see :class:`fp_core.saving.commit.TempFile`)."""
    eng = _native.Engine(
        path,
        backend=options.backend,
        create=create,
        tmpfile=tmpfile,
        mode=mode,
        queue_depth=options.queue_depth,
        chunk_bytes=options.chunk_bytes,
        copy_threads=options.copy_threads,
        io_threads=options.io_threads,
    )
    if eng.backend_reason:
        key = (eng.backend, eng.backend_reason)
        if key not in _reported:  # one line per distinct fallback, not one per save
            _reported.add(key)
            log.warning("fastpersist: using the %s backend: %s", eng.backend, eng.backend_reason)
    return eng
