"""A save to a local file: prepared (validated, temporary file open, plan built) on the
caller's thread, then run (written, synced, committed) on any thread. The synchronous
``fp_core.save`` runs both; the async pipeline runs the second half in the background.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointSerializationError
from ..format.plan import FilePlan, build
from ..format.safetensors_plan import build_safetensors
from ..gc_pause import gc_paused
from ..io import deferred_free
from ..io.engine import EngineOptions, open_engine
from ..io.writer import write_single
from ..stats import SaveStats
from . import commit
from . import early_write as early_writes

log = logging.getLogger("fastpersist")

MIN_ALIGNMENT = 4096
FORMATS = ("torch", "safetensors")


def rename_os_error(e: OSError, final: str) -> OSError:
    """An OSError from writing the temporary file, re-stated against the checkpoint's own path."""
    if e.errno is None:
        return e
    return OSError(e.errno, f"{e.strerror} (writing checkpoint {final})", final)


class LocalSave:
    """A save to a local file: its layout fixed and its temporary file open (a SaveJob)."""

    collective = False

    def __init__(self, obj: Any, path: str | os.PathLike, options: EngineOptions, format: str = "torch",
                 metadata: dict[str, str] | None = None, congruent: bool = False,
                 mode: int | None = None, early_write: bool = False) -> None:
        """``congruent``: lay CPU tensors out in the file congruent to their addresses, so
        they can be written without staging (see :func:`fp_core.format.plan.build`). ``mode``:
        the file's permission bits (default: 0666 less the umask, as ``torch.save``).
        ``early_write``: start writing a large state's storages while its pickle is made
        (:mod:`fp_core.saving.early_write`; for a save run at once: its layout is not congruent,
        and its temporary file is written from the first storages on)."""
        t0 = time.perf_counter()
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
        self.options = options
        # final: the name the caller gave (what pending saves and on_commit are known by);
        # target: the file written, every symlink resolved (commit.check_target)
        self.final = os.path.abspath(os.fspath(path))
        self.target = commit.check_target(os.fspath(path))
        commit.clean_in_background(os.path.dirname(self.target))  # leftovers of crashed saves, once
        self.stats = SaveStats(path=self.final)
        self._mode = 0o666 if mode is None else mode
        try:
            self._open_temp()
        except OSError as e:
            raise rename_os_error(e, self.final) from e
        self._early: early_writes.EarlyWrite | None = None
        try:
            alignment = max(MIN_ALIGNMENT, self.engine.alignment)
            try:
                if format == "torch" and early_write and not congruent:
                    self._early = early_writes.EarlyWrite(self.engine, alignment, options)
                    with gc_paused():
                        plan = self._early.plan(obj)
                    if plan is None or not self._early.started:
                        # nothing written early (small), or what was is written anew
                        self._early.stop(cancel=True)
                        self._early = None
                        if self.engine.ring_stalled:  # an early batch's requests may still land
                            self._fresh_temp_file("an early write stalled")
                    self.plan: FilePlan = plan if plan is not None else build(obj, alignment)
                elif format == "torch":
                    self.plan = build(obj, alignment, congruent=congruent)
                else:
                    self.plan = build_safetensors(obj, alignment, metadata)
                commit.check_room(self.target, self.plan.file_size, self.temp.fileno())
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
        self._failed: BaseException | None = None

    @classmethod
    def from_plan(cls, plan: FilePlan, path: str | os.PathLike, options: EngineOptions,
                  mode: int | None = None) -> LocalSave:
        """A save of a layout made elsewhere (the trainer, for the writer process): its
        temporary file opened here. The layout's alignment must suit this file's engine."""
        self = cls.__new__(cls)
        self._t0 = time.perf_counter()
        self.options = options
        self.final = os.path.abspath(os.fspath(path))
        self.target = commit.check_target(os.fspath(path))
        commit.clean_in_background(os.path.dirname(self.target))
        self.stats = SaveStats(path=self.final)
        self._mode = 0o666 if mode is None else mode
        self._early, self._failed, self.plan = None, None, plan
        try:
            self._open_temp()
        except OSError as e:
            raise rename_os_error(e, self.final) from e
        try:
            if plan.alignment % max(MIN_ALIGNMENT, self.engine.alignment):
                raise OSError(errno.EINVAL, f"the file system needs {self.engine.alignment}-byte alignment, the "
                              f"layout has {plan.alignment}", self.final)
            commit.check_room(self.target, plan.file_size, self.temp.fileno())
        except BaseException:
            self.abort()
            raise
        return self

    def run(self, on_body_written: Callable[[], None] | None = None, publish: bool = True) -> SaveStats:
        """Write, sync and (unless ``publish=False``) publish.

        On failure the temp file is removed and nothing is published.
        """
        if self._failed is not None:
            self.abort()
            raise self._failed
        try:
            try:
                rs = self._write(on_body_written)
                t_sync = time.perf_counter()
                self.engine.sync()
            finally:
                if self._early is not None:  # interrupted before it was waited for: never close
                    self._early.stop(cancel=True)  # the file under its writes
                    self._early = None
                self.engine.close()  # the current one (a rewrite may have opened another)
            if self._failed is not None:  # failed meanwhile (by the fence, on another thread)
                raise self._failed
            if publish:
                self.publish()
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise commit.no_room(self.target, self.plan.file_size) from e
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

    def _write(self, on_body_written: Callable[[], None] | None) -> Any:
        """write_single, once more where a first attempt failed for a cause that has passed
        and the bytes it read are still the ones to save (see :meth:`_rewrite_reason`)."""
        released = False

        def body_written() -> None:
            nonlocal released
            released = True
            if on_body_written is not None:
                on_body_written()

        try:
            rs = write_single(self.engine, self.plan, self.options, body_written, early=self._early)
        except OSError as e:
            self._early = None  # its thread is out of the file (write_single waited for it)
            why = None if released else self._rewrite_reason(e)
            if why is None:
                raise
            log.warning("fastpersist: %s; writing %s again", why, self.final)
            self.stats.extra["rewritten"] = why
            if self.engine.ring_stalled:
                self._fresh_temp_file(why)
            return write_single(self.engine, self.plan, self.options, body_written)
        self._early = None
        return rs

    def _open_temp(self) -> None:
        options, mode = self.options, self._mode
        self.temp = commit.TempFile(self.target, lambda p, tmpfile: open_engine(
            p, options, create=True, tmpfile=tmpfile, mode=mode))
        self.engine = self.temp.engine

    def _fresh_temp_file(self, why: str) -> None:
        """Drop the temporary file for a new one written through the pwrite pool: io_uring
        requests given up on may still complete, and would write into (and past the end of)
        the file they were for; in the dropped file nobody reads them."""
        log.info("fastpersist: %s; %s gets a new temporary file", why, self.final)
        self.temp.abort()
        self.options = dataclasses.replace(self.options, backend="threadpool")
        self._open_temp()

    def _rewrite_reason(self, e: OSError) -> str | None:
        """Why a failed write may be retried, whole (its cause gone: a full disk first waits
        here for the frees pending on it; a stalled ring leaves its file for a new one), or
        None. Only a save whose sources have not been let go (before ``on_body_written``)
        and that has no fence cut (whose batches are claimed once) is written again."""
        if self.plan.cut is not None:
            return None
        if e.errno == errno.ETIMEDOUT and self.engine.ring_stalled:
            return "io_uring stopped answering (FASTPERSIST_URING_STALL_S); the pwrite pool writes the file"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                dev = os.fstat(self.temp.fileno()).st_dev
            except (OSError, ValueError):
                return None
            pending = deferred_free.pending_bytes(dev)
            if pending:
                deferred_free.wait(dev)
                return (f"the disk was full while {pending >> 20} MiB of replaced checkpoints were still "
                        "being freed (now freed)")
        return None

    def publish(self) -> None:
        self.temp.publish()

    def fail(self, error: BaseException) -> None:
        self._failed = error

    def abort(self) -> None:
        try:
            if self._early is not None:  # never close the file under its writes
                self._early.stop(cancel=True)
        finally:
            self._early = None
            self.temp.abort()
