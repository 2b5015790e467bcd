"""The async pipeline: checkpoint writes overlap training, fenced at the optimizer step.

Parameters and optimizer state only change inside ``optimizer.step()``. So a save can
return at once and be written in the background while the next forward and backward
run; a *fence* before the next step waits until the background no longer reads live
tensor memory. Two staging policies (docs/design.md, "The async fence"):

* ``overlap`` (the paper's): nothing is copied up front; the writer reads live tensors.
  A fence that finds the write unfinished copies what is not written yet and opens when
  the copy meets the writer (``fence_copies_rest``, :mod:`fp_core.pipeline.fence_cut`); the writer
  then writes the rest from the copies.
* ``snapshot``: the background first copies every tensor into a reusable host arena
  (pinned, on a side stream, for CUDA tensors), releases the fence, then writes from the
  copy, so the disk write runs on across steps.
* ``auto``: snapshot when the checkpoint fits ``snapshot_budget_bytes``, else overlap.
  Until an arena of the checkpoint's size is warm, auto writes with overlap and warms
  one on the writer afterwards: the first fill of fresh memory faults in every page,
  an order of magnitude slower than a copy into warm pages, and under snapshot the fence
  would wait for that fill (figures: docs/performance.md, "Fresh memory").

In both, tensors of at most ``small_tensor_bytes`` (BatchNorm running statistics and
other buffers that change *during* forward) are copied on the caller's thread at save
time, so they hold exactly their values at ``save()``.

Where the CPU work of a save runs (``cpu_work_at_save``): the snapshot copy and the
checksums read every byte once. When the checkpoint's tensors live on the CPU, the
training runs on the CPU too and every core is busy: work in the background then
preempts the training's threads, and its parallel regions wait for the preempted one.
So by default that work runs inside ``save()``, spread over the training's threads
(``torch.get_num_threads()``) while the training thread waits anyway; the background is
left with the I/O. With device tensors, the host's cores are free during the step and
the work stays in the background.

Huge pages under the bytes written (``huge_pages``): O_DIRECT pins and maps the source
memory page by page for every request, and on a virtual disk the host's share of that
work slows the guest's cores while the write runs, less from 2 MiB pages than from 4 KiB
ones (benchmarks/disk_interference.py --pages; figures in docs/performance.md). So the
snapshot arena is advised onto transparent
huge pages before its first use (``huge_pages``, default on: our own memory, no copy).
With ``collapse_live_tensors``, live CPU tensors that the overlap policy writes in place
are moved onto them too, once (MADV_COLLAPSE), on a side thread after the first write that
reads them: a one-time copy, transparent to the contents. It is off by default: that copy
costs seconds of a core per GB of the caller's memory, and the gain measured in the
whole pipeline was inside the noise (docs/performance.md). Where the kernel declines,
nothing changes.

Errors in the background are never dropped: each is raised once, at the next ``save``,
``fence``, ``wait`` or ``close`` (or by ``handle.result()``), chained to the original.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .. import _native, api, paths
from ..errors import CheckpointError
from ..format.plan import StorageExtent
from ..io import memory_image
from ..io.arena import Arena, arena_need
from ..io.engine import EngineOptions
from ..io.writer import SNAPSHOT_CONGRUENCE, copy_to_host, mark_ready, snapshot_to_host, stage_cpu
from ..parallel.distributed import DEFAULT_TIMEOUT_S
from ..saving.job import SaveJob
from ..stats import SaveStats
from . import memory_guard, optim_hooks
from .fence_cut import FenceCut
from .process_writer import (
    WRITERS,
    ProcessCollectiveSave,
    ProcessDcpSave,
    ProcessSave,
    ProcessShardedFileSave,
    WriterProcess,
)
from .writers_group import WritersGroup

log = logging.getLogger("fastpersist")

POLICIES = ("auto", "overlap", "snapshot")


class _NoSharedMemory(Exception):
    """The writer process's shared-memory directory may not be used (not private)."""


class AsyncCheckpointError(CheckpointError):
    """A background checkpoint job failed; the original exception is its ``__cause__``.

    Raised by a collective ``save()`` after it queued its own save (the other ranks wait
    for it): ``handle`` is then that save's handle (else None)."""

    handle: Any = None


def _default_snapshot_budget() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 << 30
    return min(total // 4, 32 << 30)


def fence_before_update(args: Any, kwargs: Any, fence: Callable[[], None]) -> Any:
    """Body of a ``torch.optim`` step pre-hook that fences right before the update.

    ``optimizer.step(closure)`` runs forward and backward inside the step, before the
    update (Lightning's automatic optimization, LBFGS): the fence then runs after the
    closure, so the write still overlaps them. Without a closure it runs now. Returns what
    the hook returns (new ``(args, kwargs)`` or None).
    """
    def fenced(closure: Callable[[], Any]) -> Callable[[], Any]:
        def fenced_closure() -> Any:
            out = closure()
            fence()
            return out

        return fenced_closure

    if callable(kwargs.get("closure")):
        return args, dict(kwargs, closure=fenced(kwargs["closure"]))
    if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer itself
        return (args[0], fenced(args[1]), *args[2:]), kwargs
    fence()
    return None


class Handle:
    """The future of one background job (a save, or a function queued with ``enqueue``)."""

    writes_checkpoint = False  # a save, or a job queued as one (enqueue(..., save=True))

    def __init__(self, path: str | None = None, internal: bool = False) -> None:
        self.path = path
        self.internal = internal  # our own housekeeping: not a pending write for pending()
        self._done = threading.Event()
        self._staged = threading.Event()  # no live memory is read any more
        self._cut: tuple | None = None  # (FenceCut, job, live memory) of an overlap save
        self._job: Any = None  # the save job while it is pending
        self._in_writer: tuple | None = None  # (writer process, job number) of a save it writes
        self._result: Any = None
        self._error: BaseException | None = None
        self._reported = False

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint job {self.path or ''} still running after {timeout} s")
        if self._error is not None:
            self._reported = True
            if isinstance(self._error, AsyncCheckpointError):  # already says what failed
                raise self._error
            raise AsyncCheckpointError(f"background checkpoint job {self.path or ''} failed: "
                                       f"{type(self._error).__name__}: {self._error}") from self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._done.wait(timeout)
        return self._error

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._staged.set()
        self._cut = self._job = None  # the plan, job and live-memory guard of the save go with it
        self._done.set()


class SaveHandle(Handle):
    writes_checkpoint = True

    def result(self, timeout: float | None = None) -> SaveStats:
        return super().result(timeout)


class _LiveMemory:
    """The storages a background save reads in place, until it lets go of them.

    Resizing one of them waits meanwhile (:mod:`fp_core.pipeline.memory_guard`: FSDP frees
    parameter memory with ``resize_(0)``). :meth:`release` (the save no longer reads live
    memory: the fence opens) first checks that none of them moved or changed size in a way
    the guard could not see, and fails the save if one did: what was read may not be what
    the tensor held.
    """

    def __init__(self, extents: list[StorageExtent], released: threading.Event) -> None:
        self.extents = extents
        self.released = released
        storages = [s.source.untyped_storage() for s in extents]
        self.shape = [(st.data_ptr(), st.nbytes()) for st in storages]
        self.guard = memory_guard.Guard(storages, released)

    def release(self, path: str, plan: Any, check: bool = True,
                on_fail: Callable[[BaseException], None] | None = None) -> None:
        """``on_fail(error)`` runs before the memory is let go (a writer on another thread
        must see the failure before it can publish)."""
        if self.released.is_set():
            return
        try:
            if check:
                for s, (ptr, n) in zip(self.extents, self.shape):
                    st = s.source.untyped_storage()
                    if (st.data_ptr(), st.nbytes()) != (ptr, n):
                        rec = plan.manifest.records[s.record] if plan is not None and plan.manifest else None
                        what = f"tensor {rec.tensor}" if rec is not None and rec.tensor else "a tensor"
                        err = CheckpointError(
                            f"checkpoint {path} not written: the storage of {what} was freed or resized while it "
                            f"was being written from live memory (a resize the fence could not see); use "
                            f"policy='snapshot' for such tensors")
                        if on_fail is not None:
                            on_fail(err)
                        raise err
        finally:
            self.released.set()

    def close(self) -> None:
        self.released.set()
        self.guard.close()


_live: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    """Make every pending save durable before the process ends (or say loudly which failed).
    A process ending on an unhandled exception keeps its shared-memory images (with
    ``resume_from_memory``): a launcher restarting it resumes from them."""
    for ckpt in list(_live):
        try:
            ckpt._close(keep_images=_failing())
        except BaseException as e:  # noqa: BLE001 - at exit there is no caller left to raise to
            log.error("fastpersist: a pending checkpoint failed at process exit: %s", e)


def _failing() -> bool:
    """Is an unhandled exception ending the interpreter? (It sets ``sys.last_value`` as it
    prints the error, before the exit handlers run; an interactive session's errors and a
    ^C are not a failed run.)"""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return False
    last = getattr(sys, "last_value", None)
    return last is not None and not isinstance(last, (KeyboardInterrupt, SystemExit))

_drain_registered_in: int | None = None  # the pid whose multiprocessing finalizers drain


def _drain_on_every_exit() -> None:
    """Also drain where a process ends without ``atexit``: every ``multiprocessing`` child
    (fork, forkserver, spawn: ``Process._bootstrap`` runs its finalizers, then ``os._exit``),
    so Lightning Fabric's ``ddp_fork``/``ddp_notebook`` workers and a save in any ``Process``
    are not lost. Registered once per process, when it first queues work (a forked child
    starts with an empty registry). Where nothing runs at all (``os._exit`` by hand,
    SIGKILL) the unnamed temporary file vanishes with the process and the name keeps what
    it held (docs/reliability.md)."""
    global _drain_registered_in
    pid = os.getpid()
    if _drain_registered_in == pid:
        return
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _drain_at_exit, exitpriority=10)
    _drain_registered_in = pid


def _forget_parents_work() -> None:
    """In a forked child: the parent's pending saves are the parent's. The child's copies of
    its checkpointers start empty (no worker thread survives a fork, and a lock held by one
    at the fork would never be let go), never writing, committing or waiting for them."""
    for ckpt in list(_live):
        ckpt._forget_after_fork()


os.register_at_fork(after_in_child=_forget_parents_work)


def _drop_inherited_files(job: Any) -> None:
    """In a forked child: point the child's copies of the descriptors of the parent's
    temporary file at ``/dev/null``. The child would otherwise keep that file (and the
    blocks of a checkpoint it later replaces) alive for its whole life, and a clean-up would
    take it for held after the parent died. The parent keeps its file and its lock (the
    open file description is the parent's too); the numbers stay valid, so the job's own
    close later in the child closes ``/dev/null``."""
    fds = set()
    for part in (job, getattr(job, "local", None)):  # a remote save stages through a LocalSave
        temp = getattr(part, "temp", None)
        held = getattr(temp, "_held", None)
        if held is not None:
            fds.add(held)
        engine = getattr(temp, "engine", None)
        try:
            fds.add(engine.fileno())
        except (AttributeError, OSError, ValueError):
            pass
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in fds:
            if fd >= 0:
                try:
                    os.dup2(null, fd)
                except OSError:
                    pass
    finally:
        os.close(null)


class AsyncCheckpointer:
    """Background checkpoint writer with a fence before the optimizer step.

    >>> ckpt = AsyncCheckpointer()
    >>> h = ckpt.save(model.state_dict(), "step100.pt")   # returns promptly
    >>> loss.backward()                                     # write overlaps compute
    >>> optimizer.step()                                    # the installed hook fences
    >>> ckpt.close()                                        # everything durable

    Args:
        policy: "auto" | "overlap" | "snapshot" (see module doc; ``auto`` writes with
            overlap until a snapshot arena is warm, ``stats.extra["policy_reason"]`` says so).
        max_in_flight: saves not yet durable at once (default 1). A save beyond it waits
            for the oldest (``when_busy="wait"``), or with ``when_busy="queue"`` returns
            and queues behind it (at most ``max_in_flight`` more), never unbounded.
        snapshot_budget_bytes: host memory the snapshot policy may hold (default: a
            quarter of RAM, at most 32 GiB).
        small_tensor_bytes: tensors up to this size are copied at save time.
        install_optimizer_hook: install a global torch.optim step pre-hook while a save
            still reads live memory, so every optimizer.step() fences first.
        cpu_work_at_save: run the snapshot copy (``snapshot``) or the checksums
            (``overlap``) of CPU tensors inside ``save()``, on ``save_threads`` threads,
            instead of on the background writer. None (default): when every large tensor
            is on the CPU (see module doc).
        save_threads: threads for that work (default ``torch.get_num_threads()``).
        huge_pages: the snapshot arena on transparent huge pages (module doc; default
            True).
        collapse_live_tensors: also move live CPU tensors written in place by the overlap
            policy onto huge pages, once each, on a side thread after the first write that
            reads them (a one-time copy of the caller's memory; default False).
            ``huge_page_bytes`` counts what moved.
        fence_copies_rest: an ``overlap`` save's fence that finds the write unfinished
            copies what is not written yet into an arena (within
            ``snapshot_budget_bytes``) while the writer goes on, instead of waiting for
            the write (:mod:`fp_core.pipeline.fence_cut`; default True). Local CPU saves laid
            out congruent to their tensors' addresses only: collective, sharded and
            device saves, and an auto save laid out for the snapshot it expected, keep
            waiting for their writes.
        writer_nice: scheduling niceness added to the writer thread and the engine
            threads it starts (Linux: per thread, inherited). 0 (default) keeps the
            caller's: where training keeps every core busy, a niced writer starves the
            snapshot copy and the fence waits for it.
        writer: ``"thread"`` (default) writes on a thread of this process; ``"process"``
            in a writer process of its own (:mod:`fp_core.pipeline.process_writer`): snapshots go
            into shared memory, and a save whose fence has passed is committed even if this
            process is killed right after. Local single-file saves take it (with the
            snapshot policy); collective, sharded and remote saves, and a checkpoint over
            ``snapshot_budget_bytes``, stay on the thread (logged once).
        resume_from_memory: with ``writer="process"``, keep the last committed
            checkpoint's image in shared memory (``/dev/shm``, its size in RAM) after this
            process ends without closing, so that a restart on this machine loads it from
            there (``fp_core.load``/``load_into``, checked against its checksums) instead
            of from disk. Kept when this process is killed or ends on an unhandled
            exception; ``close()`` removes it.
        group, topology, timeout_s: make every save collective over this
            torch.distributed group (every rank calls ``save`` in the same order), as
            ``fp_core.save(..., group=...)``; the collective runs on the worker thread
            over a dedicated gloo group.
        **engine_options: passed to the native engine (backend, queue_depth, ...).
    """

    def __init__(self, policy: str = "auto", max_in_flight: int = 1, when_busy: str = "wait",
                 snapshot_budget_bytes: int | None = None, small_tensor_bytes: int = 1 << 20,
                 install_optimizer_hook: bool = True, cpu_work_at_save: bool | None = None,
                 save_threads: int | None = None, writer_nice: int = 0, huge_pages: bool = True,
                 collapse_live_tensors: bool = False, fence_copies_rest: bool = True,
                 group: Any = None, topology: Any = "replica",
                 timeout_s: float = DEFAULT_TIMEOUT_S, writer: str = "thread", resume_from_memory: bool = False,
                 **engine_options: Any) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        if when_busy not in ("wait", "queue"):
            raise ValueError(f"when_busy must be 'wait' or 'queue', not {when_busy!r}")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if writer not in WRITERS:
            raise ValueError(f"writer must be one of {WRITERS}, not {writer!r}")
        if resume_from_memory and writer != "process":
            raise ValueError("resume_from_memory needs writer='process' (the thread writer's snapshots die "
                             "with this process)")
        self.writer = writer
        self.resume_from_memory = resume_from_memory
        self._writer_proc: WriterProcess | None = None
        # the writers' group for collective saves (formed at the first one, or not: the
        # thread writer takes them on every rank)
        self._writers = WritersGroup(timeout_s)
        self._thread_reasons: set[str] = set()  # saves kept on the thread writer, logged once each
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.when_busy = when_busy
        self.snapshot_budget_bytes = _default_snapshot_budget() if snapshot_budget_bytes is None else snapshot_budget_bytes
        self.small_tensor_bytes = small_tensor_bytes
        self.install_optimizer_hook = install_optimizer_hook
        self.writer_nice = writer_nice
        self.cpu_work_at_save = cpu_work_at_save
        if save_threads is not None and save_threads < 1:
            raise ValueError("save_threads must be >= 1")
        self.save_threads = save_threads
        self.huge_pages = huge_pages
        self.collapse_live_tensors = collapse_live_tensors
        self.fence_copies_rest = fence_copies_rest
        self.huge_page_bytes = 0  # live tensor bytes collapsed onto huge pages so far
        self._huge_seen: set[tuple[int, int]] = set()  # (address, length) already asked for
        self._huge_pool: ThreadPoolExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 1
        self.group, self.topology, self.timeout_s = group, topology, timeout_s
        self.options, rest = EngineOptions.pick(dict(engine_options))
        if rest:
            raise TypeError(f"AsyncCheckpointer got unknown options {sorted(rest)}")
        self._cv = threading.Condition()
        self._jobs: deque[tuple[Handle, Callable[[], Any]]] = deque()
        self._saves: list[SaveHandle] = []  # saves not yet done, in order
        self._finished: list[Handle] = []  # done with an error nobody has seen yet
        self._save_jobs: list[Handle] = []  # jobs queued with enqueue(save=True), not finished
        self._arenas: list[Arena] = []
        self._warm_failed = False  # no memory for one: auto stays on overlap
        self._warming: list[tuple[int, bool]] = []  # (need, pin) of arena warm-ups queued or running
        self._last_policy = ""  # the policy of the last save: auto lays the next one out for it
        self._draining = False  # wait() is draining the queue: a warm-up not begun is skipped
        self._thread: threading.Thread | None = None
        self._hook: Any = None
        self._current: Handle | None = None  # the job the writer runs now, if any
        self._closed = False
        _live.add(self)

    # ------------------------------------------------------------------ public API
    def save(self, obj: Any, path: str | os.PathLike, *, format: str = "torch",
             metadata: dict[str, str] | None = None,
             on_commit: Callable[[str, SaveStats], None] | None = None,
             storage_options: dict | None = None, keep_local: bool = False,
             local: bool = False, extra_files: dict[str, bytes] | None = None,
             layout: str | None = None) -> SaveHandle:
        """Start saving ``obj`` to ``path``; return at once with a handle.

        With a ``group``, every save is collective unless ``local=True`` (this rank alone,
        e.g. rank 0 after :meth:`decline`).

        The object's structure is pickled now; tensor bytes are read in the background
        until the fence. ``on_commit(path, stats)`` runs after the file is durable under
        its final name (move "latest" pointers, rotate old checkpoints there).

        A remote fsspec URL is written to local staging, then uploaded on the worker;
        the handle, ``wait`` and ``on_commit(url, stats)`` cover the upload (the remote
        copy is complete). ``storage_options``/``keep_local``: see :mod:`fp_core.remote`.

        Sharded state (``DTensor`` s: FSDP2, tensor parallel) is saved into the directory
        ``path`` by every rank through ``torch.distributed.checkpoint`` (every rank calls
        ``save`` in the same order; ``extra_files`` go into it), with the same policies and
        fence: see :mod:`fp_core.parallel.dcp_save`. ``layout="file"``: ``path`` is instead one file of
        the full state (``format="torch"`` or ``"safetensors"``) that every rank writes its
        own shards into (:mod:`fp_core.parallel.sharded_file`); a snapshot writes its copies, an
        overlap save's fence waits until this rank's share is written.
        """
        t0 = time.perf_counter()
        self._check_open()
        self._admit()
        # Laid out congruent to the tensors' addresses: overlap writes them with no staging
        # copy. A snapshot writes its copies, which the arena places congruent to any layout:
        # the relayout would be time inside save() for nothing. Expected from the policy of
        # the last save (a loop saves the same state; a snapshot over its budget goes
        # overlap); guessed wrong, an overlap save stages its writes and its fence waits
        # for them (_fence_can_copy), a snapshot pays the relayout once.
        snapshot_next = self.policy != "overlap" and self._last_policy == "snapshot"
        prepared = self._prepare_in_process(obj, path, format, metadata, local, storage_options,
                                            extra_files, layout)
        if prepared is None:
            prepared = api.prepare(obj, path, self.options, format=format, metadata=metadata,
                                   group=None if local else self.group, topology=self.topology,
                                   timeout_s=self.timeout_s, congruent=not snapshot_next,
                                   storage_options=storage_options,
                                   keep_local=keep_local, extra_files=extra_files, layout=layout)
        # An earlier failure is raised before a save of this rank alone is queued; a
        # collective save (the other ranks will wait for this one in it) is queued first,
        # then it is raised (``AsyncCheckpointError.handle`` is the queued save).
        if not prepared.collective:
            try:
                self._raise_pending()
            except BaseException:
                prepared.abort()
                raise
        try:
            handle = self._enqueue(prepared, on_commit, t0)
        except BaseException as e:
            if prepared.collective and isinstance(e, Exception):
                # The other ranks are about to wait for this rank in the collective: it must
                # still run, and report the failure to them (and to us, at the next call).
                prepared.fail(e)
                return self._enqueue_job(prepared, "overlap", [], None, on_commit, None, t0)
            prepared.abort()  # nothing of it is queued: its temporary file goes
            raise
        if prepared.collective:
            try:
                self._raise_pending()
            except AsyncCheckpointError as e:
                e.handle = handle
                raise
        return handle

    def _prepare_in_process(self, obj: Any, path: Any, format: str, metadata: Any, local: bool,
                            storage_options: Any, extra_files: Any, layout: Any) -> ProcessSave | None:
        """The save as a job of the writer process, or None where it stays on the thread."""
        if self.writer != "process":
            return None
        is_remote, _ = paths.split(path)
        sharded = api.is_sharded(obj)
        kind = ("file" if sharded and layout == "file" else "dcp" if sharded else
                "collective" if self.group is not None and not local else "local")
        why = ("a remote URL" if is_remote or storage_options else
               "extra_files without sharded state" if extra_files and kind != "dcp" else
               f"a {kind} save in another format than torch's" if kind in ("collective", "dcp") and format != "torch"
               else f"layout={layout!r} without sharded state" if layout is not None and not sharded else None)
        if why is None and kind != "local":
            job = self._collective_process_job(obj, path, format, metadata, kind, extra_files)
            if job is not None:
                return job
            why = (f"a {'sharded' if sharded else 'collective'} save (not every rank has a writer process, or "
                   "the group is not the whole world)")
        elif why is None:
            try:
                job = self._process_job(obj, path, format, metadata)
            except _NoSharedMemory as e:  # shared memory we may not use: the thread writes it
                job, why = None, f"no private shared memory ({e})"
            if job is not None:
                size = job.plan.file_size
                job.overlap = ((self.policy == "overlap" or size > self.snapshot_budget_bytes)
                               and job.live_shareable(self.small_tensor_bytes))
                copied = sum(n for _, n in job.copied_ranges()) if job.overlap else size
                if (job.overlap or size <= self.snapshot_budget_bytes) and self._writer_proc.has_room(copied):
                    return job
                if size > self.snapshot_budget_bytes:
                    why = (f"a checkpoint over snapshot_budget_bytes={self.snapshot_budget_bytes} whose tensors "
                           "are not in shared memory")
                else:
                    why = (f"{self._writer_proc.dir} has {memory_image.free_bytes(self._writer_proc.dir) >> 20} MiB "
                           f"free for a {size >> 20} MiB snapshot")
                job.abort()
        if why not in self._thread_reasons:
            self._thread_reasons.add(why)
            log.warning("fastpersist: writer='process' does not take %s (%s): the thread writer writes it",
                        why, path)
        return None

    def _collective_process_job(self, obj: Any, path: Any, format: str, metadata: Any, kind: str,
                                extra_files: Any) -> ProcessCollectiveSave | None:
        """A save of every rank run by the writer processes (``kind``: ``collective``, a
        sharded state as one ``file``, or a ``dcp`` directory); every rank takes the same
        route, decided together at the first such save (:func:`join_writers`). None: the
        thread writer takes it."""
        if not self._writers_route(f"collective save of {path}"):
            return None
        keep = min(self.max_in_flight, 8)
        job: ProcessCollectiveSave
        if kind == "file":
            from ..parallel.sharded_file import ShardedFileSave

            inner = ShardedFileSave(obj, path, self.group, options=self.options, format=format, metadata=metadata,
                                    timeout_s=self.timeout_s)
            job = ProcessShardedFileSave(inner, self._writer_proc, self.options, keep_arenas=keep)
        elif kind == "dcp":
            from ..parallel.dcp_save import DcpSave

            inner = DcpSave(obj, path, self.group, options=self.options, timeout_s=self.timeout_s,
                            extra_files=extra_files)
            job = ProcessDcpSave(inner, self._writer_proc, self.options, keep_arenas=keep)
        else:
            job = ProcessCollectiveSave(obj, path, self._writer_proc, self.options, topology=self.topology,
                                        keep_arenas=keep)
        if job.plan is not None:
            size = job.held_bytes()
            if size > self.snapshot_budget_bytes:
                job.fail(CheckpointError(
                    f"{job.final}: a collective checkpoint of {size >> 20} MiB is over snapshot_budget_bytes="
                    f"{self.snapshot_budget_bytes}; writer='process' snapshots collective saves into shared memory "
                    "(raise snapshot_budget_bytes, or use writer='thread')"))
            elif not self._writer_proc.has_room(size):
                job.fail(OSError(errno.ENOSPC, f"{self._writer_proc.dir} has "
                                 f"{memory_image.free_bytes(self._writer_proc.dir) >> 20} MiB free for a "
                                 f"{size >> 20} MiB snapshot of a collective save", job.final))
        return job

    def _writers_route(self, what: str) -> bool:
        """Every rank, at each collective save or decline with ``writer="process"``: True
        where the writer processes run it, in their group (formed now at the first one, and
        again after a save at which some rank's writer was gone); False: the thread writer
        takes every rank's collective saves. Raises where this rank's writer is gone: the
        save fails on every rank (the peers' writers find theirs gone), and the next one
        forms the group again."""
        import torch.distributed as dist

        w = self._writers
        if w.route is None:
            world = dist.get_world_size()
            if self.group is not None and sorted(dist.get_process_group_ranks(self.group)) != list(range(world)):
                # decided alike on the group's ranks without asking anyone (the ranks
                # outside it never come to agree)
                w.route = False
                return False
            self._join_writers()
        elif w.must_rejoin():
            log.warning("fastpersist: a checkpoint writer process of the writers' group was gone at the last "
                        "collective save; forming the group again")
            self._join_writers()
        if not w.route:
            return False
        if not w.report(self._writer_proc):
            from ..parallel.distributed import CollectiveSaveError

            pid = w.writer.pid if w.writer is not None else None
            raise CollectiveSaveError(
                f"{what}: this rank's checkpoint writer process (pid {pid}) is gone, and with it the writers' "
                "group; this save fails on every rank, and the next collective save forms the group again")
        return True

    def _join_writers(self) -> None:
        """Every rank at the same save: the writers' group, formed with this rank's writer
        process (started now where there is none, or it is gone), or the thread writer for
        all such saves (:func:`fp_core.pipeline.writers_group.join_writers`)."""
        try:
            if self._writer_proc is None or not self._writer_proc.alive:
                self._start_writer()
        except _NoSharedMemory as e:
            log.warning("fastpersist: no writer process on this rank (%s)", e)
        self._writers.join(self._writer_proc)

    def _start_writer(self) -> None:
        if self._writer_proc is not None:
            self._writer_proc.close()
            self._writer_proc = None
        try:
            self._writer_proc = WriterProcess(self.resume_from_memory)
        except (OSError, CheckpointError) as e:  # no /dev/shm, not ours, no process
            raise _NoSharedMemory(str(e)) from e

    def _process_job(self, obj: Any, path: Any, format: str, metadata: Any) -> ProcessSave:
        """The save as a job of the writer process (started now where there is none)."""
        if self._writer_proc is not None and not self._writer_proc.alive:
            # gone between saves (killed, crashed): nothing was in its hands
            log.warning("fastpersist: the checkpoint writer process %d exited (status %s); starting another",
                        self._writer_proc.pid, self._writer_proc.proc.poll())
            self._writer_proc.close()
            self._writer_proc = None
        if self._writer_proc is None:
            self._start_writer()
        # arenas kept for the next saves: one per file of a checkpoint in flight (an HF
        # checkpoint is several files), not one per save an adapter lets queue
        return ProcessSave(obj, path, self._writer_proc, self.options, format=format, metadata=metadata,
                           keep_arenas=min(self.max_in_flight, 8))

    def _enqueue(self, prepared: SaveJob, on_commit: Callable[[str, SaveStats], None] | None,
                 t0: float) -> SaveHandle:
        """Choose the policy, do the work that belongs inside ``save()`` and queue the job."""
        storages = prepared.plan.storages if prepared.plan is not None else []
        mark_ready(storages)
        small = [s for s in storages if s.length <= self.small_tensor_bytes]
        big = [s for s in storages if s.length > self.small_tensor_bytes]
        in_process = isinstance(prepared, ProcessSave)
        if in_process:
            # The writer process reads a snapshot in shared memory, or (overlap, or over the
            # snapshot budget) live tensors that are in shared memory themselves.
            policy = "overlap" if prepared.overlap else "snapshot"
        else:
            policy = self._choose_policy(sum(s.length for s in storages))
        warm: tuple[int, bool] | None = None
        with self._cv:
            busy = bool(self._saves)  # its arena comes back when it ends
            warming = list(self._warming)  # arenas whose warm-up is queued or running
        # auto and no warm arena: this save with overlap, and an arena warmed after it,
        # sized as _take_arena will ask (every copy, small first). Also with saves in
        # flight (max_in_flight > 1): a snapshot into a fresh arena would hold the fence
        # for its page faults, while an overlap save queued behind them is copied by its
        # fence (fence_cut) as fast as memory allows, or written before the fence comes.
        if (policy == "snapshot" and self.policy == "auto" and big and not in_process
                and (not busy or self._fence_can_copy(prepared))):
            need, pin = arena_need(small + big)
            if not self._arena_ready(need, pin):
                policy = "overlap"
                prepared.stats.extra["policy_reason"] = "snapshot arena not yet warm"
                # one warm-up per size asked for: the files of one checkpoint (an HF model
                # and its optimizer) each need theirs by the next checkpoint
                if not self._warm_failed and not any(n >= need and p == pin for n, p in warming):
                    warm = (need, pin)
        if not in_process:
            self._last_policy = policy
        arena = self._cpu_work_now(prepared, policy, small, big)
        try:
            return self._enqueue_job(prepared, policy, big, arena, on_commit, warm, t0)
        except BaseException:
            if arena is not None:
                self._give_arena(arena)
            raise

    def _enqueue_job(self, prepared: SaveJob, policy: str, big: list[StorageExtent], arena: Arena | None,
                     on_commit: Callable[[str, SaveStats], None] | None, warm: tuple[int, bool] | None,
                     t0: float) -> SaveHandle:
        if isinstance(prepared, ProcessSave) and all(s.host is not None for s in big):
            # every tensor was copied inside save(): hand it over now, before save() returns
            # (the fence has nothing to wait for, and this process may die right after)
            prepared.handoff()
        handle = SaveHandle(prepared.final)
        handle._job = prepared  # a forked child lets go of its descriptors (_forget_after_fork)
        if isinstance(prepared, ProcessSave):
            handle._in_writer = (prepared.writer, prepared.seq)  # kept after the job: hand_over_dir_commit
        # What the writer will read from live memory: it must not be freed meanwhile.
        live = _LiveMemory([s for s in big if s.host is None], handle._staged)
        if not live.extents:
            # every tensor was copied inside save(): the fence has nothing to wait for (not
            # even the worker's wake-up, which would release nothing later)
            handle._staged.set()
        if policy == "overlap" and live.extents and self._fence_can_copy(prepared):
            # the fence may copy what is still unwritten instead of waiting for it
            handle._cut = (FenceCut(prepared.plan), prepared, live)
            prepared.plan.cut = handle._cut[0]

        def run() -> SaveStats:
            return self._run_save(prepared, policy, big, handle, on_commit, arena, live)

        prepared.stats.policy = policy
        with self._cv:
            self._saves.append(handle)
            self._jobs.append((handle, run))
            if warm is not None:
                self._warming.append(warm)
                self._jobs.append((Handle("warm snapshot arena", internal=True), lambda: self._warm_arena(*warm)))
            self._ensure_worker()
            self._cv.notify_all()
        if self.collapse_live_tensors and policy == "overlap":
            self._collapse_after(handle, [s for s in big if s.source.device.type == "cpu"])
        self._install_hook()
        prepared.stats.blocked_seconds = time.perf_counter() - t0
        return handle

    def decline(self) -> Handle:
        """Rank 0: answer the other ranks waiting for a collective save it writes alone.

        Queued in order with the saves, so it pairs with the peers' pending collective.
        """
        if self.group is None:
            raise RuntimeError("decline() needs an AsyncCheckpointer with a group")
        from ..parallel.distributed import decline

        if self.writer == "process" and self._writers_route("decline()"):
            # the peers wait in their writers' group: writer 0 answers there, in its job order
            writer = self._writer_proc
            assert writer is not None
            seq = writer.next_seq()
            writer.send(("decline", seq, {}))

            def declined() -> None:
                msg = writer.result(seq)
                if msg[0] == "failed":
                    from .process_writer import _wire_error

                    raise _wire_error(msg)

            return self.enqueue(declined, after=[])
        return self.enqueue(decline, self.group, self.timeout_s, after=[])

    def hand_over_dir_commit(self, staging: str, final: str, sync_files: list[str], handles: list[Handle], *,
                             together: bool = False, failed: str = "",
                             should_save: bool = True) -> Callable[[], bool] | None:
        """With ``writer="process"``: hand the writer the commit of a checkpoint directory
        (``staging`` renamed to ``final`` once its files are durable), to run after the
        saves of ``handles`` (its files, every one a save of this writer process), even if
        this process dies first; ``sync_files`` are the other files written there (synced by
        the writer). Returns a function that waits for the writer's outcome: True when the
        writer committed it, False where the caller must (see ``together``); it raises the
        writer's failure. Call it from a job of this checkpointer's worker (:meth:`enqueue`).
        None where the writer process does not hold every file: the caller commits it.

        ``together`` (every rank of the world calls this at the same checkpoint): the ranks'
        writers commit the directory together, in the writers' group, the ranks with
        ``should_save`` renaming it; ``failed`` says why this rank's part failed (the
        checkpoint then fails on every rank). None on every rank where collective saves are
        not the writer processes' (the trainers commit it); the function's False on every
        rank where some rank's files are not all its writer's."""
        wp = self._writer_proc
        jobs = [getattr(h, "_in_writer", None) for h in handles]
        holds_all = wp is not None and all(j is not None and j[0] is wp for j in jobs)
        if together:
            if not self._writers.route:
                return None  # alike on every rank: collective saves are the thread writer's
            if wp is None or wp is not self._writers.writer or not wp.alive:
                from ..parallel.distributed import CollectiveSaveError

                def gone() -> bool:  # the peers' writers find this rank's gone: they fail too
                    raise CollectiveSaveError(f"{final}: not committed: this rank's checkpoint writer process is "
                                              "gone, and with it the writers' group")
                return gone
            seq = wp.publish_dir(staging, final, sync_files, [j[1] for j in jobs if j is not None],
                                 together={"holds_all": holds_all, "failed": failed, "should_save": should_save})
        else:
            if not jobs or not holds_all or wp is None or not wp.alive:
                return None
            seq = wp.publish_dir(staging, final, sync_files, [j[1] for j in jobs])
        writer = wp

        def wait() -> bool:
            msg = writer.result(seq)
            if msg[0] == "failed":
                from .process_writer import _wire_error

                raise _wire_error(msg)
            return not msg[2].get("here", False)

        return wait

    def enqueue(self, fn: Callable[..., Any], *args: Any, after: Iterable[Handle] | None = None,
                save: bool = False) -> Handle:
        """Run ``fn(*args)`` on the background worker after earlier jobs.

        ``after`` (default: every save still pending now, and every save that failed
        without its failure raised to anyone yet) must all have succeeded, or ``fn`` is
        skipped and its handle carries the first failure. ``save``: ``fn`` writes a
        checkpoint (a save of the caller's own), and counts as a save in later jobs'
        default ``after``.
        """
        self._check_open()
        handle = Handle(getattr(fn, "__name__", "job"))
        handle.writes_checkpoint = save
        with self._cv:
            # A save that failed before this call (a write error fails one at once) is no
            # longer pending, but a job queued behind it (a rotation deleting an older
            # checkpoint) must not run as if it had succeeded.
            deps = ([*self._saves, *self._save_jobs, *(h for h in self._finished
                                                       if h.writes_checkpoint and not h._reported)]
                    if after is None else list(after))

        def run() -> Any:
            for d in deps:
                d._done.wait()
                if d._error is not None:
                    skipped = AsyncCheckpointError(f"skipped: {d.path} failed")
                    # The caller heard of that failure already (a fence raised it): this job's
                    # handle still raises it, but no later report repeats it.
                    skipped.cause_reported = d._reported
                    d._reported = True  # else reported through this job's handle instead
                    raise skipped from d._error
            return fn(*args)

        with self._cv:
            self._jobs.append((handle, run))
            if save:
                self._save_jobs.append(handle)
            self._ensure_worker()
            self._cv.notify_all()
        return handle

    def fence(self) -> None:
        """Block until no in-flight save still reads live training memory."""
        with self._cv:
            pending = list(self._saves)
        for h in pending:
            cut = h._cut  # once: the handle drops it when the save ends
            if cut is not None and not h._staged.is_set():
                self._open_cut(*cut)
            h._staged.wait()
        self._maybe_remove_hook()
        self._raise_pending()

    def _fence_can_copy(self, prepared: SaveJob) -> bool:
        """Will an overlap save of ``prepared`` get a fence that copies the rest? (A local
        save of CPU tensors: collective, sharded and device saves keep the waiting fence.)"""
        if isinstance(prepared, ProcessSave):
            return False  # the writer process reads live memory until it says it is done
        if not (self.fence_copies_rest and prepared.plan is not None and not prepared.collective
                and all(s.source.device.type == "cpu" for s in prepared.plan.storages)):
            return False
        # The checksums taken inside save() are keyed by ranges cut at the live address;
        # the writer cuts a fence copy's at its arena slot, congruent to the file offset.
        # They agree only where the address does (a layout not congruent to the tensors'
        # addresses, or a tensor torch did not align, would leave the copy checksummed at
        # the fence: a change before it stored under a matching checksum).
        return all(s.offset % SNAPSHOT_CONGRUENCE == s.addr() % SNAPSHOT_CONGRUENCE
                   for s in prepared.plan.storages if s.length > self.small_tensor_bytes)

    def _open_cut(self, cut: FenceCut, prepared: SaveJob, live: _LiveMemory) -> None:
        """The fence of an overlap save still writing: copy the storages not written yet
        (from the end backwards, into one arena, within ``snapshot_budget_bytes``) while
        the writer goes on, then let go of live memory (see :mod:`fp_core.pipeline.fence_cut`)."""
        t0 = time.perf_counter()
        # only the storages nearest the end that fit the budget: the writer reaches the others
        rest, room = [], self.snapshot_budget_bytes
        for st in sorted(cut.pending(), key=lambda x: -x.offset):
            if st.length > room:
                break
            rest.append(st)
            room -= st.length
        slots: dict[int, torch.Tensor] = {}

        def copy(todo: list[StorageExtent]) -> bool:
            if any(id(s) not in slots for s in todo):
                return False  # beyond the budget (or the arena): left to the writer
            # A copy alone: the checksums taken inside save() stay (bytes changed since are
            # then caught by verify, not stored under a checksum of the change)
            stage_cpu(todo, [slots[id(s)] for s in todo], pool=self._save_pool(), threads=self._pool_threads,
                      checksum=False)
            for s in todo:
                del slots[id(s)]
            return True

        try:
            if rest and cut.arena is None:
                # a new arena on 4 KiB pages: a huge page faults in far slower (compaction),
                # and here the training thread would wait for it
                arena = self._take_arena(rest, huge=False)
                if cut.attach(arena):
                    slots = dict(zip(map(id, rest), arena.carve(rest)))
                elif not arena.fresh:
                    self._give_arena(arena)  # the writer finished meanwhile: back to the pool
            cut.open(copy)
            cut.arena_filled = not slots  # only an arena whose every slot was copied into counts as warm
            live.release(prepared.final, prepared.plan, check=True, on_fail=prepared.fail)
        except BaseException as e:
            # The writer may still be reading live memory in its batches: wait for them
            # (copying nothing more) before letting go, whatever went wrong here.
            if isinstance(e, Exception):
                prepared.fail(e)
            cut.open(lambda todo: False)
            live.release(prepared.final, prepared.plan, check=False)
            if not isinstance(e, Exception):
                raise
        stats = prepared.stats.extra
        stats["fence_copied_bytes"] = cut.copied_bytes
        stats["fence_cut_seconds"] = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until every queued job is finished (durable), then raise any failure."""
        self._draining = True  # a snapshot arena's warm-up not yet begun is skipped
        try:
            with self._cv:
                while self._jobs or self._current is not None:
                    self._cv.wait()
        finally:
            self._draining = False
        self._maybe_remove_hook()
        self._raise_pending()

    def raise_failures(self, saves_only: bool = False) -> None:
        """Raise the failure of a background job that ended since the last report (with
        ``saves_only``, of a save; other failures wait for the next report), without
        waiting for anything: for a caller about to act as if its saves had succeeded."""
        self._raise_pending(saves_only)

    def pending(self, path: str | os.PathLike | None = None) -> bool:
        with self._cv:
            if path is None:
                # a snapshot arena's warm-up is ours, not a pending write (Lightning reads
                # this to decide whether a checkpoint removal must queue behind a save)
                return self._jobs_where(internal=False)
            p = paths.key(path)
            return any(h.path == p for h in self._saves)

    def wait_for(self, path: str | os.PathLike) -> None:
        """Block until pending saves of ``path`` are durable (raising their failure)."""
        p = paths.key(path)
        with self._cv:
            mine = [h for h in self._saves if h.path == p]
        for h in mine:
            h._done.wait()
        self._raise_pending()

    def close(self) -> None:
        """Drain pending work, stop the worker, free the arenas. Raises a pending failure."""
        self._close()

    def _close(self, keep_images: bool = False) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            self._remove_hook()
            self._arenas.clear()
            if self._writer_proc is not None:
                self._writer_proc.close(keep_images=keep_images)
                self._writer_proc = None
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
            if self._huge_pool is not None:
                self._huge_pool.shutdown()  # a collapse in progress finishes (bounded)
                self._huge_pool = None
            _live.discard(self)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:  # an exception is already in flight: drain, but do not mask it
            self.close()
        except BaseException as e:  # noqa: BLE001
            log.error("fastpersist: pending checkpoint failed while handling another error: %s", e)

    # ------------------------------------------------------------------ internals
    def _jobs_where(self, *, internal: bool) -> bool:
        """Is a job of that kind (our housekeeping, or a write / the caller's) queued or
        running? Call with ``_cv`` held."""
        return any(h.internal == internal for h, _ in self._jobs) or (
            self._current is not None and self._current.internal == internal)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("AsyncCheckpointer is closed")

    def _choose_policy(self, nbytes: int) -> str:
        if self.policy == "overlap":
            return "overlap"
        if nbytes <= self.snapshot_budget_bytes:
            return "snapshot"
        if self.policy == "snapshot":
            log.warning("fastpersist: checkpoint of %d bytes exceeds snapshot_budget_bytes=%d; "
                        "writing it with the overlap policy", nbytes, self.snapshot_budget_bytes)
        return "overlap"

    def _admit(self) -> None:
        """Wait until one more save may be in flight."""
        limit = self.max_in_flight * (2 if self.when_busy == "queue" else 1)
        with self._cv:
            while len(self._saves) >= limit:
                self._cv.wait()

    def _raise_pending(self, saves_only: bool = False) -> None:
        with self._cv:
            failed = [h for h in self._finished if not h._reported and (h.writes_checkpoint or not saves_only)]
            self._finished = [h for h in self._finished if not h._reported and h not in failed]
        if failed:
            h = failed[0]
            for other in failed[1:]:
                log.error("fastpersist: another background checkpoint failed too: %s: %s", other.path, other._error)
                other._reported = True
            h.result()  # raises, chained

    def _forget_after_fork(self) -> None:
        """See :func:`_forget_parents_work`. The parent's handles read as failed here (a
        ``result()`` in the child raises at once, never blocks), reported already: nothing
        of theirs is raised at the child's next call."""
        parents = [h for h, _ in self._jobs] + list(self._saves) + list(self._save_jobs)
        if self._current is not None:
            parents.append(self._current)
        self._cv = threading.Condition()
        self._jobs.clear()
        self._saves, self._finished, self._save_jobs = [], [], []
        self._warming, self._arenas = [], []
        self._current, self._thread, self._pool, self._huge_pool = None, None, None, None
        if self._writer_proc is not None:
            self._writer_proc.forget_after_fork()
            self._writer_proc = None
        self._draining = False
        error = CheckpointError(f"this save was started by process {os.getppid()} before it forked; the forked "
                                "child does not write it (the parent does)")
        for h in parents:
            _drop_inherited_files(getattr(h, "_job", None))
            h._job = None
            if not h.done():
                h._reported = True
                h._finish(None, error)

    def _ensure_worker(self) -> None:
        _drain_on_every_exit()
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="fastpersist-writer", daemon=True)
            self._thread.start()

    def _worker(self) -> None:
        if self.writer_nice > 0 and hasattr(os, "setpriority"):
            try:  # on Linux a tid names one thread; threads it starts inherit the value
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.writer_nice))
            except OSError:
                pass  # not permitted here: run at the caller's priority
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                handle, run = self._jobs.popleft()
                self._current = handle
            result, error = None, None
            try:
                result = run()
            except BaseException as e:  # noqa: BLE001 - handed to the caller, never dropped
                error = e
            with self._cv:
                # Record the failure before the handle reads as done, so that anyone who
                # wakes on it (wait_for, fence) also finds the error to raise.
                if isinstance(handle, SaveHandle) and handle in self._saves:
                    self._saves.remove(handle)
                if handle.writes_checkpoint and handle in self._save_jobs:
                    self._save_jobs.remove(handle)
                if error is not None and not handle._reported:
                    if getattr(error, "cause_reported", False):
                        log.warning("fastpersist: background job %s skipped: %s", handle.path, error)
                    else:
                        self._finished.append(handle)
                handle._finish(result, error)
                self._current = None
                self._cv.notify_all()

    def _cpu_work_now(self, prepared: Any, policy: str, small: list[StorageExtent],
                      big: list[StorageExtent]) -> Arena | None:
        """The work that happens inside ``save()``: copy the small tensors (buffers that
        change during forward: fixed now); with ``cpu_work_at_save``, also the snapshot
        copy or the checksums of the large CPU tensors, spread over the save pool. Returns
        the arena the snapshot copies went into."""
        at_save = self.cpu_work_at_save
        if at_save is None:
            at_save = all(s.source.device.type == "cpu" for s in big)
        if prepared.collective:
            at_save = False  # its layout may still move to rank 0's; the peers hear of errors in run()
        t0 = time.perf_counter()
        arena = None
        try:
            small_cpu = [s for s in small if s.source.device.type == "cpu"] if at_save else []
            copy_to_host([s for s in small if s.source.device.type != "cpu" or not at_save])
            cpu = [s for s in big if s.source.device.type == "cpu"] if at_save else []
            if not small_cpu and not cpu:
                return None
            pool = self._save_pool()
            # Copies (small tensors; every large one under snapshot) go into one reusable
            # arena, copied and checksummed in one pass, in parallel (a copy alone is faster,
            # but its checksums then run on the writer, beside a training that owns every
            # core, and slow its steps); device ones get their slot now and are
            # copied in the background.
            copied = small_cpu + (big if policy == "snapshot" else [])
            if copied:
                # only small tensors, copied here: a new arena for them on 4 KiB pages, as the
                # fence's (a fresh huge page faults in far slower, on the training thread)
                arena = self._take_arena(copied, huge=False if policy != "snapshot" else None, prepared=prepared)
                carved = dict(zip(map(id, copied), arena.carve(copied)))
                arena.slots = carved
                # A new arena's first fill faults in every page (slow: see the module doc):
                # that once, the large copies are left to the writer, outside save().
                now = small_cpu + (cpu if policy == "snapshot" and not arena.fresh else [])
                stage_cpu(now, [carved[id(s)] for s in now], pool=pool, threads=self._pool_threads)
                prepared.stats.extra["at_save_bytes"] = sum(s.length for s in now)
            if cpu and policy != "snapshot":
                stage_cpu(cpu, None, pool=pool, threads=self._pool_threads)
                prepared.stats.extra["at_save_bytes"] = sum(s.length for s in small_cpu + cpu)
        except BaseException:
            for s in small + big:
                s.host, s.host_crcs = None, None
            if arena is not None:
                self._give_arena(arena)
            raise
        prepared.stats.extra["at_save_seconds"] = time.perf_counter() - t0
        return arena

    def _save_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool_threads = self.save_threads or max(1, torch.get_num_threads())
            self._pool = ThreadPoolExecutor(max_workers=self._pool_threads, thread_name_prefix="fastpersist-save")
        return self._pool

    def _run_save(self, prepared: SaveJob, policy: str, big: list[StorageExtent], handle: SaveHandle,
                  on_commit: Callable[[str, SaveStats], None] | None, arena: Arena | None,
                  live: _LiveMemory) -> SaveStats:
        failed = getattr(prepared, "_local_error", None)  # a writer-process job that only carries its failure
        try:
            if policy == "snapshot" and big and not (failed is not None and failed() is not None):
                t0 = time.perf_counter()
                try:
                    # inside the try: a job that fails here must still run (and tell the
                    # writer process, or the other ranks, that it will never come)
                    if arena is None:
                        arena = self._take_arena(big, prepared=prepared)
                        arena.slots = dict(zip(map(id, big), arena.carve(big)))
                    todo = [(s, arena.slots[id(s)]) for s in big if s.host is None]
                    if todo:
                        snapshot_to_host([s for s, _ in todo], [b for _, b in todo])
                    if isinstance(prepared, ProcessSave):
                        prepared.handoff()  # before the fence opens: from here it survives this process
                    live.release(prepared.final, prepared.plan, check=not prepared.collective)
                except Exception as e:  # noqa: BLE001 - run() raises it (after telling any peers)
                    prepared.fail(e)
                prepared.stats.extra["snapshot_seconds"] = time.perf_counter() - t0
            check = not prepared.collective  # a collective run() must not raise between its exchanges
            if not big:  # every tensor was copied at save time: nothing live is read from here on
                live.release(prepared.final, prepared.plan, check=False)
            stats = prepared.run(on_body_written=lambda: live.release(prepared.final, prepared.plan, check=check))
        finally:
            cut = prepared.plan.cut if prepared.plan is not None else None
            if cut is not None:
                cut.finish()  # a fence copying meanwhile is done with the copies' memory
            live.close()
            for s in big:
                s.host, s.host_crcs = None, None
            if arena is not None:
                self._give_arena(arena)
            if cut is not None and cut.arena is not None:
                self._keep_cut_arena(cut)
        if on_commit is not None:
            on_commit(prepared.final, stats)
        return stats

    def _collapse_after(self, handle: SaveHandle, extents: list[StorageExtent]) -> None:
        """Move live tensors the overlap policy writes in place onto huge pages, once each,
        after ``handle``'s write has read them (so it never delays a save). Training may
        run meanwhile: a collapse keeps contents, and the kernel skips pages under I/O."""
        todo = []
        for s in extents:
            key = (s.source.data_ptr(), s.length)
            if key not in self._huge_seen:
                todo.append(key)
        if not todo:
            return
        if len(self._huge_seen) > 100_000:  # storages come and go: keep the set bounded
            self._huge_seen.clear()
        self._huge_seen.update(todo)

        def collapse() -> None:
            handle._staged.wait()
            for addr, n in todo:
                self.huge_page_bytes += _native.advise_huge(addr, n, collapse=True)

        if self._huge_pool is None:
            self._huge_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastpersist-hugepages")
        self._huge_pool.submit(collapse)

    def wait_huge_pages(self) -> None:
        """Block until the huge-page moves asked for so far are done (tests, benchmarks)."""
        if self._huge_pool is not None:
            self._huge_pool.submit(lambda: None).result()

    def _free_arena(self, need: int, pin: bool, warm: bool = False) -> int | None:
        """Index of the smallest free arena of at least ``need`` bytes (``warm``: every page
        touched). The smallest: the files of one checkpoint (an HF model and its optimizer)
        each have an arena of their size, and the first file taking the largest would leave
        the next a fresh one to fault in inside ``save()``. Call with ``_cv`` held."""
        fits = [(a.buf.numel(), i) for i, a in enumerate(self._arenas)
                if a.buf.numel() >= need and a.pin == pin and not (warm and a.fresh)]
        return min(fits)[1] if fits else None

    def _take_arena(self, extents: list[StorageExtent], huge: bool | None = None, prepared: Any = None) -> Any:
        """A free arena for ``extents``, else a new one (``huge``: on huge pages; default
        ``huge_pages``). A save of the writer process has its own, in shared memory."""
        if isinstance(prepared, ProcessSave):
            return prepared.take_arena()
        need, pin = arena_need(extents)
        with self._cv:
            i = self._free_arena(need, pin)
            if i is not None:
                return self._arenas.pop(i)
        return Arena(need, pin, huge=self.huge_pages if huge is None else huge)

    def _arena_ready(self, need: int, pin: bool) -> bool:
        """A warm arena (every page touched) of at least ``need`` bytes is free now."""
        with self._cv:
            return self._free_arena(need, pin, warm=True) is not None

    def _warm_arena(self, need: int, pin: bool) -> None:
        """On the writer, after the save that asked for it: allocate an arena of ``need``
        bytes and touch every page, so later snapshot copies run at memory speed. A
        failure (no memory for it) only leaves auto on overlap: logged, not raised."""
        try:
            if self._draining:
                return
            with self._cv:
                if self._free_arena(need, pin, warm=True) is not None:
                    return  # one came back warm meanwhile (a snapshot filled a fresh one)
            arena = Arena(need, pin, huge=self.huge_pages)
            # On this thread alone (a strided zero_() also ran on torch's intra-op threads:
            # no faster where fresh memory is slow to fault in, more CPU; native doc).
            # Pinned memory is resident once allocated: nothing to fault in.
            if not pin:
                _native.populate(arena.buf.data_ptr(), need)
            self._give_arena(arena)
        except Exception as e:  # noqa: BLE001 - an optimisation: the saves go on without it
            self._warm_failed = True
            log.warning("fastpersist: could not prepare a %d-byte snapshot arena (%s: %s); auto keeps the overlap "
                        "policy", need, type(e).__name__, e)
        finally:
            with self._cv:
                self._warming.remove((need, pin))

    def _keep_cut_arena(self, cut: FenceCut) -> None:
        """On the writer, after a save whose fence copied into ``cut.arena``: keep it for
        the next fence, every page faulted in (the fence met the writer part way, so part
        of it is still fresh: the next copy into it would pay those faults on the training
        thread instead)."""
        arena, cut.arena = cut.arena, None
        if arena.fresh and not cut.arena_filled:
            if arena.pin or self._draining:
                return  # draining: not worth the faults now
            try:
                _native.populate(arena.buf.data_ptr(), arena.buf.numel())
            except OSError:
                return
        self._give_arena(arena)

    def _give_arena(self, arena: Any) -> None:
        if isinstance(arena, memory_image.SharedArena):
            return  # its save gives it back to the writer process's pool
        arena.slots, arena.fresh = {}, False
        with self._cv:
            self._arenas.append(arena)
            # keep at most max_in_flight arenas, the largest ones
            self._arenas.sort(key=lambda a: -a.buf.numel())
            del self._arenas[self.max_in_flight:]

    def _install_hook(self) -> None:
        if not self.install_optimizer_hook:
            return
        with self._cv:
            if self._hook is None:
                self._hook = optim_hooks.register(self._on_optimizer_step)

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        return fence_before_update(args, kwargs, self.fence)

    def _maybe_remove_hook(self) -> None:
        with self._cv:
            busy = any(not h._staged.is_set() for h in self._saves)
        if not busy:
            self._remove_hook()

    def _remove_hook(self) -> None:
        # A fence inside the hook (a step without a closure) only switches it off: torch
        # is iterating its hook dict (optim_hooks); it leaves at the next safe point.
        with self._cv:
            hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        else:
            optim_hooks.flush()

    @property
    def hook_installed(self) -> bool:
        return self._hook is not None
