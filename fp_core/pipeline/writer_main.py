"""The writer process's main loop (``python -m fp_core.pipeline.writer_main SOCKET_FD TRAINER_PID RESUME LOCK``).

It receives jobs from its trainer (:mod:`fp_core.pipeline.process_writer`) on a receiving thread,
so a hand-over never waits for a write in progress, and runs them in the order they were
prepared (a job that failed before its hand-over arrives as a ``skip``). Each job is a
layout and the shared-memory arena holding its bytes: written with the native engine,
checksummed, committed, then the arena's remaining bytes (headers, pickle, manifest)
filled in so it is an image of the file, recorded for resume when asked.

The trainer is gone when its socket reaches end-of-file or its pidfd becomes readable
(watched together, no polling). Everything handed over is then written, in order, and the
process exits: it never outlives its last commit.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import select
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

GONE = ("gone",)
SEQUENCED = ("job", "skip", "join", "collective", "decline", "publish")  # run in the order the trainer numbered them


def _hold(held: dict, arenas: set, msg: tuple) -> None:
    spec = msg[2] if len(msg) > 2 else None
    held[msg[1]] = (msg[0], spec)
    if spec and spec.get("image"):
        arenas.add(spec["image"])


def _recv(conn: Connection, sock: socket.socket) -> Any:
    """One message; a job's descriptors of live tensors come right behind it."""
    msg = conn.recv()
    if msg[0] in ("job", "collective") and msg[2].get("nfds"):
        _, fds, _, _ = socket.recv_fds(sock, 1, msg[2]["nfds"])
        if len(fds) != msg[2]["nfds"]:
            for fd in fds:
                os.close(fd)
            raise EOFError("the trainer went away while sending a job's descriptors")
        msg[2]["fds"] = fds
    return msg


def _receive(conn: Connection, trainer_pid: int, inbox: queue.SimpleQueue) -> None:
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        pidfd = os.pidfd_open(trainer_pid)
    except (ProcessLookupError, OSError):
        pidfd = None
    if pidfd is not None and os.getppid() != trainer_pid:  # it died before this started: pid reused?
        os.close(pidfd)
        pidfd = None
    watch = [conn.fileno()] + ([pidfd] if pidfd is not None else [])
    try:
        while True:
            ready, _, _ = select.select(watch, [], [])
            if conn.fileno() in ready:
                try:
                    inbox.put(_recv(conn, sock))
                except (EOFError, OSError):
                    break
                continue
            # the trainer exited: what it sent before is in the socket; take all of it
            try:
                while conn.poll(0):
                    inbox.put(_recv(conn, sock))
            except (EOFError, OSError):
                pass
            break
    finally:
        inbox.put(GONE)


def _readonly_view(m: mmap.mmap) -> Any:
    """A uint8 tensor over a read-only mapping (the writer only reads it)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns of a non-writable buffer
        return torch.frombuffer(m, dtype=torch.uint8)


def _image_rest(plan: Any, view: Any) -> None:
    """Make the arena the file's image: zeros where the file has none of its bytes from the
    arena, then the skeleton's bytes (zip headers, pickle, finished manifest)."""
    import torch

    pos = 0
    for off, n, *_ in sorted((s.offset, s.length) for s in plan.storages):
        if off > pos:
            view[pos:off].zero_()
        pos = max(pos, off + n)
    if pos < view.numel():
        view[pos:].zero_()
    sk = plan.skeleton
    for start, seg in zip(sk._starts, sk._segs):
        end = min(start + len(seg), view.numel())
        if end > start:
            view[start:end].copy_(torch.frombuffer(memoryview(seg)[: end - start], dtype=torch.uint8))


def _run(spec: dict, resume: bool, released: Any) -> dict:
    from fp_core.format.plan import StorageExtent
    from fp_core.io import memory_image
    from fp_core.io.engine import EngineOptions
    from fp_core.saving.local import LocalSave

    m, view = memory_image.map_image(spec["image"], spec["size"])
    maps: list[mmap.mmap] = []
    plan = spec["plan"]
    mapped: dict[int, Any] = {}
    sources: list[Any] = []
    try:
        fds = spec.get("fds", [])
        for k, _start, size in spec["live"].values():
            # a live tensor in the trainer's shared memory: read from its descriptor
            if k not in mapped:
                m_live = mmap.mmap(fds[k], size, mmap.MAP_SHARED, mmap.PROT_READ)
                maps.append(m_live)
                mapped[k] = _readonly_view(m_live)
        for i, (off, n, *_) in enumerate(plan.storages):
            if i in spec["live"]:
                k, start, _ = spec["live"][i]
                sources.append(mapped[k][start: start + n])
            else:
                sources.append(view[off: off + n])
        plan.storages = [StorageExtent(off, n, src, rec, host_crcs=crcs, record_start=rs)
                         for (off, n, rec, rs, crcs), src in zip(plan.storages, sources)]
        job = LocalSave.from_plan(plan, spec["path"], EngineOptions(**spec["options"]))
        stats = job.run(on_body_written=released if spec["live"] else None)
        if spec["live"]:  # the arena holds only part of the file: no image of it
            return stats.as_dict()
        _image_rest(plan, view)
        if resume:
            try:
                memory_image.record(spec["image"], spec["final"], job.target)
            except OSError as e:  # the file is committed; only the resume from memory is lost
                stats.extra["memory_image_error"] = str(e)
        return stats.as_dict()
    finally:
        del view
        plan.storages = []
        mapped.clear()
        sources.clear()
        for mm in [m, *maps]:
            try:
                mm.close()
            except BufferError:  # a view still alive: unmapped when it goes
                pass
        for fd in spec.get("fds", []):
            os.close(fd)


def _join(spec: dict) -> tuple:
    """Form the writers' gloo group (one writer per rank) at the trainers' store; once
    formed it needs no store. A writer already in a group leaves it first: the trainers
    form the group again when a peer's writer was gone (``fp_core.pipeline.writers_group``)."""
    import datetime

    import torch.distributed as dist

    store = None
    try:
        if dist.is_initialized():
            from fp_core.parallel import dcp_save, distributed

            dcp_save.forget_writer_meshes()  # their groups are the old group's
            distributed.forget_groups()
            dist.destroy_process_group()
        kind, host, port = spec["store"]
        timeout = datetime.timedelta(seconds=spec["timeout"])
        # the trainers' own store, as a client: the trainers wait there until every writer
        # has joined (the "joined" keys), so it lives while the group forms
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
        dist.init_process_group("gloo", store=dist.PrefixStore(spec["prefix"], store), rank=spec["rank"],
                                world_size=spec["world"], timeout=timeout)
        store.set(f"{spec['joined']}/{spec['rank']}", "1")
    except Exception as e:  # noqa: BLE001 - every collective job of this writer fails with it
        why = f"{type(e).__name__}: {e}"
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(f"{spec['joined']}/{spec['rank']}", "0 " + why)
        return ("failed", why)
    return ("ok", store)


def _in_group(group: Any) -> None:
    from fp_core.parallel.distributed import CollectiveSaveError

    if group is None:
        raise CollectiveSaveError("this rank's checkpoint writer process was never joined to the writers' group")
    if group[0] != "ok":
        raise CollectiveSaveError(f"this rank's checkpoint writer process could not join the writers' group: "
                                  f"{group[1]}")


def _run_collective(spec: dict, group: Any) -> dict:
    """This rank's part of a collective save, run with the other ranks' writers: the
    protocol of :class:`fp_core.parallel.distributed.CollectiveSave`, on the snapshot in the arena."""
    import torch.distributed as dist

    from fp_core.errors import CheckpointError, CheckpointSerializationError
    from fp_core.format.plan import StorageExtent
    from fp_core.io import memory_image
    from fp_core.io.engine import EngineOptions
    from fp_core.parallel.distributed import CollectiveSave

    _in_group(group)
    plan, m, view = spec["plan"], None, None
    if plan is not None:
        m, view = memory_image.map_image(spec["image"], spec["size"])
        plan.storages = [StorageExtent(off, n, view[off: off + n], rec, host_crcs=crcs, record_start=rs)
                         for off, n, rec, rs, crcs in plan.storages]
    error = spec.get("error")
    plan_error = (None if error is None else
                  CheckpointSerializationError(error) if spec.get("serialize") else CheckpointError(error))
    options = EngineOptions(**spec["options"])
    if spec.get("dcp") is not None:  # a sharded checkpoint directory: DCP's protocol, not ours
        import torch

        from fp_core.parallel.dcp_save import DcpSave

        if plan is not None:
            plan.storages = []
        job: Any = DcpSave.from_wire(spec["dcp"], view if view is not None else torch.empty(0, dtype=torch.uint8),
                                     spec["final"], cg=dist.group.WORLD, options=options)
        job.error = job.error or plan_error
    elif plan is not None and spec.get("sharded"):
        from fp_core.parallel.sharded_file import ShardedFileSave

        plan.storages = []
        job = ShardedFileSave.from_wire(spec["sharded"], view, spec["final"], cg=dist.group.WORLD,
                                             options=options)
    else:
        job = CollectiveSave.from_plan(plan, spec["final"], plan_error=plan_error, cg=dist.group.WORLD,
                                       topology=spec["topology"], options=options)
    try:
        return job.run(None).as_dict()
    finally:
        if plan is not None:
            plan.storages = []
        del view
        if m is not None:
            try:
                m.close()
            except BufferError:  # a view still alive: unmapped when it goes
                pass


def _decline(group: Any) -> dict:
    """Writer 0: answer the other writers, waiting in a collective save that trainer 0
    writes alone (:func:`fp_core.parallel.distributed.decline`)."""
    import torch.distributed as dist

    from fp_core.parallel.distributed import _DECLINED, _broadcast

    _in_group(group)
    _broadcast((True, "", _DECLINED), dist.group.WORLD)
    return {}


def _publish(spec: dict, outcomes: dict[int, bool], group: Any) -> dict:
    """Commit a checkpoint directory whose files were this writer's jobs ``spec["after"]``
    (the HF Trainer's ``checkpoint-N``): once every one of them committed, the other files
    the trainer wrote there synced, the directory's manifest written, and the directory
    renamed into place (:func:`fp_core.saving.commit.publish_dir`). Here, not on the trainer: a
    trainer killed after its fence still gets its checkpoint. ``spec["together"]``: every
    rank's writer has such a job (a checkpoint of every rank's files), see :func:`_publish_together`."""
    from fp_core.errors import CheckpointError
    from fp_core.loading import checkpoint_dir
    from fp_core.saving import commit

    if spec.get("together"):
        return _publish_together(spec, outcomes, group)
    staging, final = spec["staging"], spec["final"]
    missing = [s for s in spec["after"] if not outcomes.get(s)]
    if missing:
        raise CheckpointError(f"{final}: not committed: {len(missing)} of its files were not written")
    for p in spec["sync"]:
        commit.fsync_file(p)
    checkpoint_dir.write_dir_manifest(staging)
    commit.publish_dir(staging, final)
    return {}


def _publish_together(spec: dict, outcomes: dict[int, bool], group: Any) -> dict:
    """A directory every rank wrote files into (the HF Trainer under DDP or FSDP): each
    writer syncs its rank's files once its jobs are done, the writers agree in their group
    that every rank's are durable, the ranks that save (``should_save``) write the manifest
    and rename the directory, and every writer learns the outcome. ``{"here": True}``: some
    rank's files are not all its writer's jobs (a save the thread writer took), so the
    trainers commit the directory themselves, on every rank alike."""
    import shutil

    import torch
    import torch.distributed as dist

    from fp_core.errors import CheckpointError
    from fp_core.loading import checkpoint_dir
    from fp_core.saving import commit

    _in_group(group)
    staging, final = spec["staging"], spec["final"]
    why = spec.get("failed") or ""
    if not why and spec["holds_all"]:
        missing = [s for s in spec["after"] if not outcomes.get(s)]
        if missing:
            why = f"{len(missing)} of this rank's files were not written"
        else:
            try:
                for p in spec["sync"]:
                    commit.fsync_file(p)
            except OSError as e:
                why = f"{type(e).__name__}: {e}"
    flags = torch.tensor([0 if why else 1, 1 if spec["holds_all"] else 0], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if not flags[1]:
        return {"here": True}
    done: BaseException | None = None
    if spec["should_save"]:
        try:
            if flags[0]:
                checkpoint_dir.write_dir_manifest(staging)
                commit.publish_dir(staging, final)
            else:
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - every writer learns it below
            done = e
            shutil.rmtree(staging, ignore_errors=True)
    committed = torch.tensor([0 if done is not None else 1], dtype=torch.int32)
    dist.all_reduce(committed, op=dist.ReduceOp.MIN)  # no rank moves on before the directory is there
    if why:
        raise CheckpointError(f"{final}: not committed: {why}")
    if not flags[0]:
        raise CheckpointError(f"{final}: not committed: another rank's files failed")
    if done is not None:
        raise done
    if not committed[0]:
        raise CheckpointError(f"{final}: not committed: its commit failed on another rank")
    return {}


def _failure(e: BaseException) -> dict:
    info: dict[str, Any] = {"type": type(e).__name__, "message": str(e),
                            "traceback": "".join(traceback.format_exception(e))[-4000:]}
    if isinstance(e, OSError) and e.errno is not None:
        info.update(errno=e.errno, strerror=e.strerror, filename=e.filename)
    return info


def _leave(arenas: set[str], resume: bool, lock: str | None) -> None:
    """The trainer is gone and every job it handed over is done: remove its arenas, but for
    committed images kept for a restart (``resume``), and its owner lock's file."""
    from fp_core.io import memory_image

    if lock:
        for p in (lock, lock[: -len(memory_image.LOCK_SUFFIX)] + memory_image.TRAINER_SUFFIX):
            try:
                os.unlink(p)
            except OSError:
                pass
    for image in arenas:
        if resume and os.path.exists(memory_image.index_path(image)):
            continue
        try:
            os.unlink(image)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    sock_fd, trainer_pid, resume = int(argv[0]), int(argv[1]), argv[2] == "1"
    lock = argv[3] if len(argv) > 3 else None  # the owner lock's file (its descriptor is inherited, held)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the trainer's to handle
    conn = Connection(sock_fd)
    inbox: queue.SimpleQueue = queue.SimpleQueue()  # its put() may run in a signal handler

    # SIGTERM reaches every process of a job at once (a scheduler's cancel, preemption), while
    # the trainer may still be handing over its last save: the writer goes when its trainer
    # does (end of file, pidfd) or says so (close), having written everything handed over.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fault = os.environ.get("FASTPERSIST_WRITER_TEST_FAULT")  # "kind:errno": the tests' native fault
    if fault:
        from fp_core import _native

        kind, _, err = fault.partition(":")
        _native.inject_fault(kind, errno=int(err) if err else None)
    threading.Thread(target=_receive, args=(conn, trainer_pid, inbox), daemon=True).start()
    import torch  # noqa: F401 - loaded while the first job is still being prepared

    from fp_core.io import memory_image

    held: dict[int, Any] = {}
    group: Any = None  # the writers' group for collective saves: ("ok", store) or ("failed", why)
    outcomes: dict[int, bool] = {}  # job -> committed, for the directory commits that follow them
    arenas: set[str] = set()  # every arena a job named: removed when the trainer is gone
    next_seq = 0
    trainer_here = True
    closing = False
    while True:
        while next_seq in held or (closing and held):
            if next_seq not in held:  # a job that never came (its trainer died first)
                next_seq = min(held)
            kind, spec = held.pop(next_seq)
            seq, next_seq = next_seq, next_seq + 1
            if kind == "skip":
                continue
            if kind == "join":
                group = _join(spec)  # no report: a failure is that of every later collective job
                continue
            def released(seq: int = seq) -> None:
                if trainer_here:  # noqa: B023 - read now: the trainer may be gone since
                    try:
                        conn.send(("released", seq))
                    except OSError:
                        pass

            try:
                if kind == "collective":
                    report = ("done", seq, _run_collective(spec, group))
                elif kind == "decline":
                    report = ("done", seq, _decline(group))
                elif kind == "publish":
                    report = ("done", seq, _publish(spec, outcomes, group))
                else:
                    report = ("done", seq, _run(spec, resume, released))
            except BaseException as e:  # noqa: BLE001 - reported to the trainer, never dropped
                report = ("failed", seq, _failure(e))
            outcomes[seq] = report[0] == "done"
            if len(outcomes) > 4096:  # a publish job names the jobs just before it
                del outcomes[min(outcomes)]
            if spec and (spec.get("image") or spec.get("mark")):
                # a restart's load no longer waits for it
                memory_image.unmark_job(spec.get("image"), mark=spec.get("mark"))
            if trainer_here:
                try:
                    conn.send(report)
                except OSError:
                    trainer_here = False
        if closing:
            if not trainer_here:
                _leave(arenas, resume, lock)
            if group is not None and group[0] == "ok":
                import torch.distributed as dist

                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - exiting anyway
                    pass
            return 0
        msg = inbox.get()
        if msg == GONE:
            trainer_here, closing = False, True
        elif msg[0] == "close":
            closing = True
        elif msg[0] in SEQUENCED:
            _hold(held, arenas, msg)
        if closing:
            # a job sent just before the trainer closed or died is already in the inbox
            while True:
                try:
                    more = inbox.get(block=False)
                except queue.Empty:
                    break
                if more[0] in SEQUENCED:
                    _hold(held, arenas, more)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
