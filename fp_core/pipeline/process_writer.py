"""The writer in a process of its own: a checkpoint whose snapshot was taken outlives its trainer.

``AsyncCheckpointer(writer="process")`` starts one writer process per training process
(one per rank: each rank's checkpoints and arenas are its own, and a rank that dies takes
no other rank's writes with it). It is started once, at the first save, and stays.

A save is prepared on the trainer as every save is (the object pickled, the file laid
out), then snapshotted into a shared-memory arena (:class:`fp_core.io.memory_image.SharedArena`,
each copy at its offset in the file). Before the fence opens, the trainer hands the
writer the layout and the arena's name (:meth:`ProcessSave.handoff`): from then on the
checkpoint no longer depends on the trainer. The writer writes the file with the native
engine, checksums, commits, and reports back; the trainer's background thread only waits
for that report, so the writer shares no GIL with training.

The writer learns that its trainer is gone from its socket and a pidfd, not by polling
(:mod:`fp_core.pipeline.writer_main`): it then writes what it was handed, in order, and exits. It
runs in a session of its own, so a launcher that kills its workers' process group
(torchrun after a failure) does not kill it mid-commit; its standard streams are not the
trainer's, so nothing waiting for the trainer's output waits for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

from .. import errors
from ..errors import CheckpointError, CheckpointSerializationError
from ..format.plan import FilePlan, build
from ..format.safetensors_plan import build_safetensors
from ..io import memory_image
from ..io.engine import EngineOptions
from ..io.writer import copy_to_host
from ..saving import commit
from ..stats import SaveStats

log = logging.getLogger("fastpersist")

ALIGNMENT = 4096  # the layout's block size (the engine's O_DIRECT alignment divides it)
WRITERS = ("thread", "process")


class WriterProcessError(CheckpointError):
    """The writer process is gone (killed, crashed), or could not be started."""


class WriterProcess:
    """The trainer's end of one writer process: start, hand jobs over, collect results."""

    def __init__(self, resume_from_memory: bool = False) -> None:
        self.resume_from_memory = resume_from_memory
        self.dir = memory_image.directory()
        memory_image.clean_stale(self.dir)
        if os.getpid() == 1:
            log.warning("fastpersist: this trainer is PID 1 of its PID namespace: when it dies the kernel kills "
                        "every process in it, the checkpoint writer too; run it under an init (docker run --init, "
                        "tini) for a save past its fence to survive the trainer")
        self.lock = memory_image.OwnerLock(self.dir)
        # this run's start by the shared memory file system's clock (the lock's rename): the
        # images a clean-up may take as superseded were committed before it, by an earlier run
        self.since_ns = os.stat(self.lock.path).st_ctime_ns
        self._seq = itertools.count()
        self._send_lock = threading.Lock()
        self._results: dict[int, tuple] = {}
        self._free: list[memory_image.SharedArena] = []  # arenas not in use, the last image first
        self._pool_lock = threading.Lock()  # the trainer's thread takes, the worker gives back
        self._retired: list[memory_image.SharedArena] = []  # handed over, then abandoned: the writer may read them
        self._all: weakref.WeakSet = weakref.WeakSet()
        self._names = itertools.count()
        self._pid = os.getpid()
        self._stderr = tempfile.TemporaryFile()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")  # it copies nothing with torch ops: no thread pool
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fp_core.pipeline.writer_main", str(theirs.fileno()), str(os.getpid()),
                 "1" if resume_from_memory else "0", self.lock.path],
                pass_fds=[theirs.fileno(), self.lock.fd], start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self._stderr, env=env, cwd=os.getcwd())
        except OSError as e:
            ours.close()
            self.lock.release()
            raise WriterProcessError(f"cannot start the checkpoint writer process: {e}") from e
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        # the same socket, for the descriptors of live shared-memory tensors (SCM_RIGHTS)
        self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self._released: set[int] = set()
        # jobs run in the writers' group, and the last of them that failed: a failure there
        # may leave the group's collectives out of step (writers_group forms it again)
        self._group_jobs: set[int] = set()
        self.group_failed_at = -1
        self.pid = self.proc.pid
        self._gone: str | None = None
        self.commits = 0  # saves committed by this writer
        self.dirs: set[str] = set()  # the directories they went to

    # ------------------------------------------------------------------ jobs
    def next_seq(self) -> int:
        return next(self._seq)

    def send(self, msg: tuple, fds: list[int] | None = None) -> None:
        """``fds`` go right behind the message (its spec says how many)."""
        if self._gone is not None:
            raise WriterProcessError(self._gone)
        from multiprocessing.reduction import ForkingPickler

        data = bytes(ForkingPickler.dumps(msg))  # a message that cannot be pickled fails here, whole
        if msg[0] in ("collective", "decline") or (msg[0] == "publish" and msg[2].get("together")):
            self._group_jobs.add(msg[1])
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
                if fds:
                    socket.send_fds(self._sock, [b"F"], fds)
        except OSError as e:
            self._cut_short()
            self._died(f"sending to it failed: {e}")
            raise WriterProcessError(self._gone) from e
        except BaseException:
            # ^C (or any exception) between the writes of one message: the rest of the stream
            # would be read as garbage. It ends here: the writer writes the jobs it holds
            # whole and exits; the next save starts another.
            self._cut_short()
            self._gone = (f"the checkpoint writer process (pid {self.pid}) was let go: sending it a job was "
                          "interrupted; the jobs it had whole are still written")
            raise

    def _cut_short(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def publish_dir(self, staging: str, final: str, sync: list[str], after: list[int],
                    together: dict | None = None) -> int:
        """Hand over the commit of the directory ``staging`` as ``final``, to run once the
        jobs ``after`` (its files) have committed; returns its sequence number.
        ``together``: every rank's writer commits it (``holds_all``, ``failed``,
        ``should_save`` of this rank; ``writer_main._publish_together``)."""
        seq = self.next_seq()
        # marked like a file's job: a restart listing the checkpoints waits for it, and does
        # not take its staging directory for a crashed run's
        mark = os.path.join(self.dir, f"{self.lock.key}-publish-{seq}{memory_image.JOB_SUFFIX}")
        try:
            memory_image.mark_job("", final, mark=mark)
        except BaseException:
            self.skip(seq)
            raise
        try:
            self.send(("publish", seq, {"staging": os.path.abspath(staging), "final": os.path.abspath(final),
                                        "sync": [os.path.abspath(p) for p in sync], "after": list(after),
                                        "mark": mark, **({"together": True, **together} if together else {})}))
        except BaseException:
            memory_image.unmark_job(mark=mark)
            self.skip(seq)  # or the writer would wait for it before every later job
            raise
        return seq

    def skip(self, seq: int) -> None:
        """Job ``seq`` will never come (it failed before its hand-over): the writer goes on."""
        with contextlib.suppress(WriterProcessError):
            self.send(("skip", seq))

    def result(self, seq: int, on_released: Any = None) -> tuple:
        """Wait for job ``seq``'s report (called by one thread: the pipeline's worker);
        ``on_released()`` runs when the writer no longer reads this process's memory."""
        while seq not in self._results:
            if on_released is not None and seq in self._released:
                self._released.discard(seq)
                on_released, release = None, on_released
                release()
                continue
            if self._gone is not None:
                raise WriterProcessError(self._gone)
            try:
                msg = self.conn.recv()
            except (EOFError, OSError) as e:
                self._died(f"it exited before reporting ({type(e).__name__})")
                raise WriterProcessError(self._gone) from e
            if msg[0] in ("done", "failed"):
                self._results[msg[1]] = msg
                if msg[1] in self._group_jobs:
                    self._group_jobs.discard(msg[1])
                    if msg[0] == "failed":
                        self.group_failed_at = max(self.group_failed_at, msg[1])
            elif msg[0] == "released":
                self._released.add(msg[1])
        self._released.discard(seq)
        return self._results.pop(seq)

    def _died(self, why: str) -> None:
        status = self.proc.poll()
        if status is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                status = self.proc.wait(timeout=5)
        err = ""
        with contextlib.suppress(OSError):
            self._stderr.seek(0)
            err = self._stderr.read()[-2000:].decode(errors="replace").strip()
        said = f"; it said: {err}" if err else ""
        self._gone = (f"the checkpoint writer process (pid {self.pid}) is gone: {why}, exit status {status}{said}")

    @property
    def alive(self) -> bool:
        return self._gone is None and self.proc.poll() is None

    # ------------------------------------------------------------------ arenas
    def take_arena(self, nbytes: int, pin: bool, allocate: bool = True) -> memory_image.SharedArena:
        """An arena of exactly ``nbytes`` (the file's size: it becomes its image): a free one
        of that size (its image, if any, forgotten first), else a new one. ``allocate``: its
        pages taken now (a snapshot's; an overlap save copies only its small tensors)."""
        with self._pool_lock:
            for i, a in enumerate(self._free):
                if a.nbytes == nbytes and a.pin == pin:
                    del self._free[i]
                    a.forget_image()
                    if allocate:
                        try:
                            a.allocate()
                        except BaseException:
                            a.destroy()
                            raise
                    return a
        name = f"{self.lock.key}-{next(self._names)}{memory_image.IMAGE_SUFFIX}"
        try:
            a = memory_image.SharedArena(os.path.join(self.dir, name), nbytes, pin, allocate=allocate)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM) or not self._free:
                raise
            # free arenas of other sizes (an image kept for a restart among them) make room
            with self._pool_lock:
                old, self._free = self._free, []
            for f in old:
                f.destroy()
            a = memory_image.SharedArena(os.path.join(self.dir, name), nbytes, pin, allocate=allocate)
        self._all.add(a)
        return a

    def give_arena(self, arena: memory_image.SharedArena, keep: int) -> None:
        """Back to the pool, first in line (it holds the newest image); at most ``keep``."""
        arena.slots, arena.fresh = {}, False  # its pages are in: later copies run at memory speed
        with self._pool_lock:
            self._free.insert(0, arena)
            old, self._free[keep:] = self._free[keep:], []
        for a in old:
            a.destroy()

    def has_room(self, nbytes: int) -> bool:
        """Is there a free arena of that size, or room in shared memory for one (the free
        arenas of other sizes counted: they go to make room)?"""
        with self._pool_lock:
            if any(a.nbytes == nbytes and a.allocated for a in self._free):
                return True
            reclaimable = sum(a.nbytes for a in self._free if a.allocated)
        return memory_image.free_bytes(self.dir) + reclaimable >= nbytes

    def retire(self, arena: memory_image.SharedArena) -> None:
        """An arena a job was handed over with, the job then abandoned here: the writer may
        still read it, so it is not reused; removed at close."""
        arena.forget_image()
        self._retired.append(arena)

    # ------------------------------------------------------------------ lifetime
    def close(self, timeout: float = 60.0, keep_images: bool = False) -> None:
        """Stop the writer (after the jobs it holds) and remove every arena of ours; with
        ``keep_images``, but for the committed images kept for a restart (the process is
        ending on an error: a launcher may restart it)."""
        with contextlib.suppress(WriterProcessError):
            self.send(("close",))
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.error("fastpersist: the checkpoint writer process %d did not stop in %.0f s; killing it",
                      self.pid, timeout)
            self.proc.kill()
            self.proc.wait()
        self._gone = self._gone or "closed"
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(OSError):
            self._sock.close()
        for a in [*self._free, *self._retired, *self._all]:
            if keep_images and self.resume_from_memory and os.path.exists(memory_image.index_path(a.path)):
                a.unmap()
            else:
                a.destroy()
        if not keep_images:
            # a clean end: the images a killed run left that this run resumed from, or that
            # are in the directories it saved into, are not needed by anyone any more
            memory_image.drop_loaded()
            for d in self.dirs:
                memory_image.clean_stale(self.dir, superseded_dir=d, committed_before_ns=self.since_ns)
        self._free.clear()
        self._retired.clear()
        self.lock.release()
        with contextlib.suppress(OSError):
            self._stderr.close()

    def forget_after_fork(self) -> None:
        """In a forked child: the socket and the arenas are the parent's."""
        with contextlib.suppress(OSError):
            os.close(self.conn.fileno())  # not conn.close(): nothing of the parent's is sent or shut
        with contextlib.suppress(OSError):
            os.close(self._sock.detach())
        self.conn._handle = None  # closed above; the Connection must not close that number again
        self.lock.forget_after_fork()
        self._gone = "this is a forked child of the process that started the writer"
        self._free.clear()
        self._all = weakref.WeakSet()


def _wire_error(msg: tuple) -> BaseException:
    """The writer's report of a failure, as the exception it raised there."""
    info = msg[2]
    kind, text = info.get("type", "Error"), info.get("message", "")
    err: BaseException
    if info.get("errno") is not None:
        err = OSError(info["errno"], info.get("strerror") or text, info.get("filename"))
    elif kind == "CollectiveSaveError":
        from ..parallel.distributed import CollectiveSaveError

        err = CollectiveSaveError(text)
    elif isinstance(getattr(errors, kind, None), type) and issubclass(getattr(errors, kind), CheckpointError):
        err = getattr(errors, kind)(text)
    else:
        err = CheckpointError(f"{kind}: {text}")
    if info.get("traceback"):
        err.add_note("in the checkpoint writer process:\n" + info["traceback"])
    return err


class ProcessSave:
    """A local save written by the writer process (a SaveJob; see :mod:`fp_core.saving.job`)."""

    collective = False
    kind = "job"  # the message the writer gets

    def _more_spec(self) -> dict:
        return {}

    def __init__(self, obj: Any, path: str | os.PathLike, writer: WriterProcess, options: EngineOptions,
                 format: str = "torch", metadata: dict[str, str] | None = None, keep_arenas: int = 1) -> None:
        t0 = time.perf_counter()
        self._setup(path, writer, options, keep_arenas, t0)
        self.target = commit.check_target(os.fspath(path))
        try:
            self.plan: FilePlan | None = (build(obj, ALIGNMENT) if format == "torch"
                                          else build_safetensors(obj, ALIGNMENT, metadata))
        except (OSError, MemoryError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise CheckpointSerializationError(
                f"cannot serialise the checkpoint for {self.final}: {type(e).__name__}: {e}") from e
        self.stats.serialize_seconds = self.plan.serialize_seconds = time.perf_counter() - t0
        self.seq = writer.next_seq()

    def _setup(self, path: str | os.PathLike, writer: WriterProcess, options: EngineOptions, keep_arenas: int,
               t0: float) -> None:
        self.writer, self.options, self.keep_arenas = writer, options, keep_arenas
        self.final = os.path.abspath(os.fspath(path))
        self.stats = SaveStats(path=self.final)
        self.arena: memory_image.SharedArena | None = None
        self.handed = False
        self.overlap = False  # set by the pipeline: large tensors read from their shared memory
        self.small = 0  # tensors of at most this many bytes are copied, never read live
        self.reads_live = False
        self._failed: BaseException | None = None
        self._t0 = t0

    def copied_ranges(self) -> list[tuple[int, int]]:
        """The file ranges an overlap save copies into its arena (every tensor not read live)."""
        return [(s.offset, s.length) for s in self.plan.storages if not self._live(s)]

    def _live(self, s: Any) -> bool:
        return (s.length > self.small and s.source_on_cpu and s.source.untyped_storage().is_shared())

    def live_shareable(self, small: int) -> bool:
        """Can the writer read every tensor over ``small`` bytes from live memory? (CPU
        tensors in shared memory, ``share_memory_()``: it maps their descriptors; torch's
        ``file_descriptor`` sharing strategy only.)"""
        import torch.multiprocessing

        self.small = small
        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            return False
        for s in self.plan.storages:
            if s.length <= small:
                continue
            if not s.source_on_cpu:
                return False
            st = s.source.untyped_storage()
            if not st.is_shared() or not hasattr(st, "_share_fd_cpu_"):
                return False
        return True

    def take_arena(self) -> memory_image.SharedArena:
        if self.arena is None:
            pin = any(s.source.device.type == "cuda" for s in self.plan.storages)
            self.arena = self.writer.take_arena(self.plan.file_size, pin, allocate=not self.overlap)
            if self.overlap:
                try:
                    self.arena.allocate_ranges(self.copied_ranges())
                except BaseException:
                    arena, self.arena = self.arena, None
                    self.writer.give_arena(arena, self.keep_arenas)
                    raise
        return self.arena

    def handoff(self) -> None:
        """Every tensor's bytes into the arena (those not snapshotted there: small tensors
        copied at save time), then the job to the writer. From here it commits even if this
        process dies."""
        if self.handed:
            return
        arena = self.take_arena()
        live: dict[int, tuple[int, int, int]] = {}  # extent index -> (descriptor, start, mapping size)
        fds: list[int] = []
        if self.overlap:
            for i, s in enumerate(self.plan.storages):
                if s.host is None and s.source_on_cpu and s.source.untyped_storage().is_shared():
                    st = s.source.untyped_storage()
                    fd, size = st._share_fd_cpu_()[:2]
                    if fd not in fds:
                        fds.append(fd)
                    live[i] = (fds.index(fd), s.source.data_ptr() - st.data_ptr(), size)
        todo = [s for i, s in enumerate(self.plan.storages)
                if i not in live and (s.host is None or not arena.holds(s.host, s.offset))]
        if todo:
            slots = arena.carve(todo)
            device = [(s, b) for s, b in zip(todo, slots) if s.host is None and s.source.device.type != "cpu"]
            for s, b in zip(todo, slots):
                if s.host is not None or s.source.device.type == "cpu":
                    b.copy_(s.data)
                    s.host, s.host_crcs = b, None
            if device:
                copy_to_host([s for s, _ in device], into=[b for _, b in device])
        spec = {
            "final": self.final, "path": self.final, "image": arena.path, "size": self.plan.file_size,
            "options": dataclasses.asdict(self.options),
            "plan": _plan_for_wire(self.plan), "live": live, "nfds": len(fds), **self._more_spec(),
        }
        memory_image.mark_job(arena.path, self.final)
        try:
            self.writer.send((self.kind, self.seq, spec), fds)
        except BaseException:
            memory_image.unmark_job(arena.path)
            raise
        self.handed = True
        self.reads_live = bool(live)

    def run(self, on_body_written: Any = None) -> SaveStats:
        try:
            if self._failed is not None:
                raise self._failed
            self.handoff()
            if on_body_written is not None and not self.reads_live:
                on_body_written()  # nothing of the trainer's memory is read from here on
                on_body_written = None
            msg = self.writer.result(self.seq, on_released=on_body_written)
        except BaseException:
            self.abort()
            raise
        arena, self.arena = self.arena, None
        self.writer.give_arena(arena, self.keep_arenas)
        if msg[0] == "failed":
            raise _wire_error(msg)
        self.writer.commits += 1
        self.writer.dirs.add(os.path.dirname(self.final))
        if self.writer.commits > 2:
            # images of gone runs whose file has changed or gone since (a checkpoint rotated
            # away): nobody can load them any more
            memory_image.clean_stale(self.writer.dir)
        else:
            # Images a killed run left for its restart, now older than what this run commits:
            # at the first commit those of this file, at the second those of its directory
            # (by then every rank of the restart has resumed: a rank slower to start than
            # this one's first save still finds its image).
            memory_image.clean_stale(self.writer.dir, committed_before_ns=self.writer.since_ns, **(
                {"superseded_final": self.final} if self.writer.commits == 1
                else {"superseded_dir": os.path.dirname(self.final)}))
        return self._stats_of(msg)

    def _stats_of(self, msg: tuple) -> SaveStats:
        """The writer's report of a committed job, with what this side measured."""
        stats = SaveStats(**{k: v for k, v in msg[2].items() if k != "gbps"})
        stats.path = self.final
        stats.serialize_seconds = self.stats.serialize_seconds
        stats.policy, stats.blocked_seconds = self.stats.policy, self.stats.blocked_seconds
        stats.extra = {**self.stats.extra, **stats.extra, "writer": "process"}
        stats.seconds = time.perf_counter() - self._t0
        self.stats = stats
        return stats

    def fail(self, error: BaseException) -> None:
        self._failed = error

    def abort(self) -> None:
        handed = self.handed
        if not handed:
            self.handed = True  # one skip
            self.writer.skip(self.seq)
        if self.arena is not None:
            arena, self.arena = self.arena, None
            if handed:  # the writer may be reading it now
                self.writer.retire(arena)
            else:
                arena.forget_image()
                self.writer.give_arena(arena, self.keep_arenas)


class ProcessCollectiveSave(ProcessSave):
    """A collective save (``group=``) run by the writer processes among themselves.

    The trainer lays out and snapshots its copy of the state as any process save does; its
    writer then runs the whole protocol of :class:`fp_core.parallel.distributed.CollectiveSave`
    with the other ranks' writers, over their own gloo group (:func:`join_writers`). So a
    trainer killed after its fence does not fail the save: its writer still writes its
    share and takes part in the commit. A local failure (no layout, no snapshot) is still
    handed over, as a job that carries it, so that every writer fails the save together
    instead of waiting for this one.
    """

    collective = True
    kind = "collective"

    def __init__(self, obj: Any, path: str | os.PathLike, writer: WriterProcess, options: EngineOptions, *,
                 topology: Any = "replica", keep_arenas: int = 1) -> None:
        from ..saving.local import MIN_ALIGNMENT

        t0 = time.perf_counter()
        self._setup(path, writer, options, keep_arenas, t0)
        self.topology = topology
        self.plan = None
        self.plan_error: BaseException | None = None
        try:
            self.plan = build(obj, MIN_ALIGNMENT)
            self.stats.serialize_seconds = self.plan.serialize_seconds = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - handed over, so every rank fails together
            self.plan_error = e
        self.seq = writer.next_seq()

    def _more_spec(self) -> dict:
        return {"topology": self.topology}

    def held_bytes(self) -> int:
        """The bytes of this rank's snapshot."""
        return self.plan.file_size if self.plan is not None else 0

    def _local_error(self) -> BaseException | None:
        return self._failed or self.plan_error

    def handoff(self) -> None:
        if self.handed:
            return
        if self._local_error() is None:
            try:
                super().handoff()
                return
            except WriterProcessError:
                raise
            except Exception as e:  # noqa: BLE001 - the peers hear of it below
                self._failed = e
        self._hand_over_failure()

    def _failure_spec(self) -> dict:
        """What the writer needs to take part in the save's protocol with nothing to write."""
        return {}

    def _hand_over_failure(self) -> None:
        e = self._local_error()
        spec = {"final": self.final, "path": self.final, "plan": None, "topology": self.topology,
                "options": dataclasses.asdict(self.options), "live": {}, "nfds": 0,
                "error": f"{type(e).__name__}: {e}", "serialize": e is self.plan_error, **self._failure_spec()}
        self.handed = True
        self.writer.send((self.kind, self.seq, spec))

    def run(self, on_body_written: Any = None) -> SaveStats:
        try:
            self.handoff()
            if on_body_written is not None:
                on_body_written()  # a snapshot: nothing of this process's memory is read
            msg = self.writer.result(self.seq)
        except BaseException:
            self.abort()
            raise
        if self.arena is not None:
            arena, self.arena = self.arena, None
            self.writer.give_arena(arena, self.keep_arenas)
        local = self._local_error()
        if local is not None:  # this rank's own failure, as it was raised here
            if local is self.plan_error:
                raise CheckpointSerializationError(
                    f"cannot serialise the checkpoint for {self.final}: {type(local).__name__}: {local}") from local
            raise local
        if msg[0] == "failed":
            raise _wire_error(msg)
        self.writer.commits += 1
        return self._stats_of(msg)

    def abort(self) -> None:
        if not self.handed:  # the peers' writers are waiting for this one: tell them
            if self._local_error() is None:
                self._failed = CheckpointError(f"the collective save of {self.final} was abandoned on this rank")
            with contextlib.suppress(WriterProcessError):
                self._hand_over_failure()
        super().abort()


class ProcessShardedFileSave(ProcessCollectiveSave):
    """A sharded save as one file (``layout="file"``, :class:`fp_core.parallel.sharded_file.ShardedFileSave`)
    run by the writer processes: laid out on the trainer (which needs the DTensors' meshes
    and placements), this rank's pieces snapshotted into a sparse arena at their offsets in
    the file (only what this rank holds takes memory), and the save's protocol run by the
    writers among themselves."""

    def __init__(self, inner: Any, writer: WriterProcess, options: EngineOptions, keep_arenas: int = 1) -> None:
        self._setup(inner.final, writer, options, keep_arenas, inner.t0)
        self.inner, self.topology = inner, "replica"
        self.plan, self.plan_error = inner.plan, inner.plan_error
        self.stats = inner.stats
        self.seq = writer.next_seq()

    def held_bytes(self) -> int:
        return sum(s.length for s in self.plan.storages) if self.plan is not None else 0

    def take_arena(self) -> memory_image.SharedArena:
        if self.arena is None:
            assert self.plan is not None
            pin = any(s.source.device.type == "cuda" for s in self.plan.storages)
            self.arena = self.writer.take_arena(self.plan.file_size, pin, allocate=False)
            try:
                self.arena.allocate_ranges([(s.offset, s.length) for s in self.plan.storages])
            except BaseException:
                arena, self.arena = self.arena, None
                self.writer.give_arena(arena, self.keep_arenas)
                raise
        return self.arena

    def _more_spec(self) -> dict:
        return {"topology": "replica", "sharded": self.inner.wire()}


class ProcessDcpSave(ProcessCollectiveSave):
    """A sharded save into a DCP directory (:class:`fp_core.parallel.dcp_save.DcpSave`) run by the
    writer processes: this rank's local shards snapshotted into its arena, the state's
    structure and each DTensor's mesh, placements and global shape handed over, and
    ``torch.distributed.checkpoint.save`` run by the writers among themselves (over meshes
    of their own with the same ranks)."""

    def __init__(self, inner: Any, writer: WriterProcess, options: EngineOptions, keep_arenas: int = 1) -> None:
        self._setup(inner.final, writer, options, keep_arenas, time.perf_counter())
        self.inner, self.topology = inner, "replica"
        self.plan, self.plan_error = inner.plan, None
        self.stats = inner.stats
        self.seq = writer.next_seq()

    def _more_spec(self) -> dict:
        return {"topology": "replica", "dcp": self.inner.wire()}

    def _failure_spec(self) -> dict:
        return {"dcp": {"state": {}, "extra_files": {}}}


def _plan_for_wire(plan: FilePlan) -> FilePlan:
    """The plan without tensors: each extent's bytes are in the arena at its offset."""
    wire = dataclasses.replace(plan, storages=[], cut=None)
    wire.storages = [(s.offset, s.length, s.record, s.record_start, s.host_crcs) for s in plan.storages]
    return wire


__all__ = ["WriterProcess", "ProcessSave", "ProcessCollectiveSave", "ProcessShardedFileSave", "ProcessDcpSave", "WriterProcessError", "WRITERS"]
