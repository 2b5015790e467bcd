"""Synchronous save: capture, plan, write natively, commit atomically."""

from __future__ import annotations

import os
import time
from typing import Any

from . import commit
from .engine import EngineOptions, open_engine
from .errors import CheckpointSerializationError
from .plan import FilePlan, build
from .stats import SaveStats
from .writer import write_single

MIN_ALIGNMENT = 4096


def plan_object(obj: Any, alignment: int, path: str) -> FilePlan:
    """Build the plan, turning pickling failures into one clear error naming the path."""
    t0 = time.perf_counter()
    try:
        plan = build(obj, alignment)
    except Exception as e:  # pickle raises PicklingError, TypeError, AttributeError...
        raise CheckpointSerializationError(f"cannot serialise the checkpoint for {path}: {type(e).__name__}: {e}") from e
    plan.serialize_seconds = time.perf_counter() - t0
    return plan


def rename_os_error(e: OSError, final: str, tmp: str) -> OSError:
    """An OSError from writing the temp file, re-stated against the checkpoint's own path."""
    if e.errno is None:
        return e
    err = OSError(e.errno, f"{e.strerror} (writing checkpoint {final} via temporary file {os.path.basename(tmp)})", final)
    return err


def save(obj: Any, path: str | os.PathLike, **options: Any) -> SaveStats:
    """Write ``obj`` to ``path`` as a standard torch.save zip, fast, atomically and durably.

    Returns once the file is durable (data fdatasync'ed, renamed, directory fsync'ed).
    ``torch.load(path)`` returns an object equal to ``obj``. On any error nothing is left
    under ``path`` that was not there before, and no temporary file remains.

    Options: ``backend`` ("auto" | "io_uring" | "threadpool" | "buffered"),
    ``queue_depth``, ``chunk_bytes``, ``copy_threads``, ``io_threads``.
    """
    t0 = time.perf_counter()
    opts, rest = EngineOptions.pick(dict(options))
    if rest:
        raise TypeError(f"fp_core.save got unknown options {sorted(rest)}")
    final = commit.check_target(os.fspath(path))
    commit.clean(os.path.dirname(final))  # orphans of crashed saves into this directory
    tmp = commit.temp_path(final)
    stats = SaveStats(path=final)
    try:
        engine = open_engine(tmp, opts, create=True)
    except OSError as e:
        raise rename_os_error(e, final, tmp) from e
    try:
        with engine:
            plan = plan_object(obj, max(MIN_ALIGNMENT, engine.alignment), final)
            rs = write_single(engine, plan, opts)
            t_sync = time.perf_counter()
            engine.sync()
        commit.publish(tmp, final)
        stats.sync_seconds = time.perf_counter() - t_sync
    except BaseException as e:
        commit.discard(tmp)
        if isinstance(e, OSError) and getattr(e, "filename", None) == tmp:
            raise rename_os_error(e, final, tmp) from e
        raise
    stats.bytes = plan.file_size
    stats.backend, stats.backend_reason, stats.alignment = engine.backend, engine.backend_reason, plan.alignment
    stats.serialize_seconds = plan.serialize_seconds
    stats.copy_seconds, stats.write_seconds = rs.copy_seconds, rs.seconds
    stats.device_copy_seconds = rs.device_copy_seconds
    stats.requests, stats.short_writes = rs.requests, rs.short_writes
    stats.seconds = time.perf_counter() - t0
    return stats
