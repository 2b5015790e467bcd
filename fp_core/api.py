"""Save = prepare (caller's thread) + write (any thread) + commit.

``prepare`` validates the path, opens the native engine on a temporary file in the
target directory and builds the FilePlan (pickling happens here, so the object's
*structure* is fixed at call time). ``PreparedSave.write`` copies, writes, syncs and
publishes. The synchronous ``save`` runs both; the async pipeline runs the second half in
the background.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from . import commit
from .engine import EngineOptions, open_engine
from .errors import CheckpointSerializationError
from .plan import FilePlan, build
from .safetensors_plan import build_safetensors
from .stats import SaveStats
from .writer import write_single

MIN_ALIGNMENT = 4096
FORMATS = ("torch", "safetensors")


def rename_os_error(e: OSError, final: str) -> OSError:
    """An OSError from writing the temporary file, re-stated against the checkpoint's own path."""
    if e.errno is None:
        return e
    return OSError(e.errno, f"{e.strerror} (writing checkpoint {final})", final)


class PreparedSave:
    """A checkpoint whose layout is fixed and whose temporary file is open."""

    def __init__(self, obj: Any, path: str | os.PathLike, options: EngineOptions, format: str = "torch",
                 metadata: dict[str, str] | None = None, congruent: bool = False,
                 mode: int | None = None) -> None:
        """``congruent``: lay CPU tensors out in the file congruent to their addresses, so
        they can be written without staging (see :func:`fp_core.plan.build`). ``mode``:
        the file's permission bits (default: 0666 less the umask, as ``torch.save``)."""
        t0 = time.perf_counter()
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
        self.options = options
        self.final = commit.check_target(os.fspath(path))
        commit.clean_in_background(os.path.dirname(self.final))  # leftovers of crashed saves, once
        self.stats = SaveStats(path=self.final)
        file_mode = 0o666 if mode is None else mode
        try:
            self.temp = commit.TempFile(self.final, lambda p, tmpfile: open_engine(
                p, options, create=True, tmpfile=tmpfile, mode=file_mode))
        except OSError as e:
            raise rename_os_error(e, self.final) from e
        self.engine = self.temp.engine
        try:
            alignment = max(MIN_ALIGNMENT, self.engine.alignment)
            try:
                if format == "torch":
                    self.plan: FilePlan = build(obj, alignment, congruent=congruent)
                else:
                    self.plan = build_safetensors(obj, alignment, metadata)
            except (OSError, MemoryError, KeyboardInterrupt):
                raise
            except Exception as e:  # pickle raises PicklingError, TypeError, AttributeError...
                raise CheckpointSerializationError(
                    f"cannot serialise the checkpoint for {self.final}: {type(e).__name__}: {e}") from e
        except BaseException:
            self.abort()
            raise
        self.stats.serialize_seconds = self.plan.serialize_seconds = time.perf_counter() - t0
        self._t0 = t0

    def write(self, on_body_written: Callable[[], None] | None = None, publish: bool = True) -> SaveStats:
        """Write, sync and (unless ``publish=False``) publish.

        On failure the temp file is removed and nothing is published.
        """
        try:
            with self.engine:
                rs = write_single(self.engine, self.plan, self.options, on_body_written)
                t_sync = time.perf_counter()
                self.engine.sync()
            if publish:
                self.publish()
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and getattr(e, "filename", None) in (self.temp.engine_path, self.temp.name):
                raise rename_os_error(e, self.final) from e
            raise
        st = self.stats
        st.sync_seconds = time.perf_counter() - t_sync
        st.bytes = self.plan.file_size
        st.backend, st.backend_reason, st.alignment = self.engine.backend, self.engine.backend_reason, self.plan.alignment
        st.copy_seconds, st.write_seconds = rs.copy_seconds, rs.seconds
        st.device_copy_seconds = rs.device_copy_seconds
        st.requests, st.short_writes = rs.requests, rs.short_writes
        st.extra["zero_copy_bytes"] = rs.zero_copy_bytes
        st.seconds = time.perf_counter() - self._t0
        return st

    def publish(self) -> None:
        self.temp.publish()

    def abort(self) -> None:
        self.temp.abort()


def save(obj: Any, path: str | os.PathLike, *, format: str = "torch", metadata: dict[str, str] | None = None,
         group: Any = None, topology: Any = "replica", sharded: bool = False, **options: Any) -> SaveStats:
    """Write ``obj`` to ``path`` fast, atomically and durably; return the save's stats.

    ``format="torch"`` (default) writes a standard torch.save zip: ``torch.load(path)``
    returns an object equal to ``obj``, and a CRC-32C manifest inside it lets ``verify``
    check every byte. ``format="safetensors"`` writes a flat ``{name: tensor}`` dict as a
    safetensors file (``metadata`` goes in its header), as ``from_pretrained`` expects.

    Returns once the file is durable (data fdatasync'ed, renamed, directory fsync'ed). On
    any error nothing new is left under ``path`` and no temporary file remains.

    Engine options: ``backend`` ("auto" | "io_uring" | "threadpool" | "buffered"),
    ``queue_depth``, ``chunk_bytes``, ``copy_threads``, ``io_threads``.

    Collective saves (every rank of ``group``, a torch.distributed process group, calls
    this): ranks holding the same state write one file together, each a near-equal byte
    range (``topology``: "replica" = every rank, "node" = one per host, an int k = k per
    host, or a list of ranks); ``sharded=True`` when each rank holds different state and
    writes its own ``path``, all-or-nothing. See :mod:`fp_core.distributed`.

    Remote fsspec URLs (``s3://``, ``memory://``...) are staged locally, committed and
    uploaded before this returns (options ``storage_options=``, ``keep_local=``); see
    :mod:`fp_core.remote`. ``file://`` URLs are local paths.
    """
    from . import remote

    is_remote, path = remote.split(path)
    if is_remote:
        return remote.save(obj, path, format=format, metadata=metadata, group=group, sharded=sharded, **options)
    if group is not None or sharded:
        from . import distributed

        if format != "torch":
            raise ValueError("collective saves write the torch format")
        if sharded:
            return distributed.save_sharded(obj, path, group, **options)
        return distributed.save_collective(obj, path, group, topology=topology, **options)
    opts, rest = EngineOptions.pick(dict(options))
    if rest:
        raise TypeError(f"fp_core.save got unknown options {sorted(rest)}")
    return PreparedSave(obj, path, opts, format, metadata).write()
