"""Collective saves: one checkpoint written by many data-parallel ranks at once.

Every rank of the group calls :func:`save_collective` with the same object (data-parallel
replicas hold identical state). Coordination runs on a dedicated gloo group, so it never
waits behind training collectives on NCCL:

1. rank 0 creates the temporary file and tells everyone its name and the alignment;
2. each rank lays out the file (pickling locally) and the ranks compare layouts (a hash
   of every storage's offset, length and dtype, and of the pickle); on a mismatch rank 0
   writes everything alone, with a warning that says why;
3. the writers (chosen by ``topology``) each write a near-equal, block-aligned byte range
   of the body into the one shared file, fdatasync, and report per-piece checksums;
4. rank 0 folds the checksums into the manifest, writes the tail, syncs, renames and
   fsyncs the directory, and tells everyone the outcome.

Any rank's failure (an exception, or a dead rank, seen as a collective error within the
group's timeout) makes every rank raise, and nothing is committed.

Ranks holding *different* state (model shards) use ``sharded=True``: each writes its own
file in parallel; they are published only if every rank succeeded.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import socket
import time
from typing import Any

import torch.distributed as dist

from . import _native, commit
from .api import MIN_ALIGNMENT, PreparedSave, rename_os_error
from .engine import EngineOptions, open_engine
from .errors import CheckpointError, CheckpointSerializationError
from .partition import select_writers, split_range
from .plan import FilePlan, StorageExtent, build
from .skeleton import SparseFile
from .stats import SaveStats
from .writer import RangeStats, write_range, write_tail

log = logging.getLogger("fastpersist")

DEFAULT_TIMEOUT_S = 300.0
_coord_groups: dict[tuple[int, ...], Any] = {}


class CollectiveSaveError(CheckpointError):
    """Another rank failed (or died) during a collective save; nothing was committed."""


def coordination_group(group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A gloo group over ``group``'s ranks, created once and cached.

    If ``group`` is already a gloo group it is used as is. Creating one is itself a
    collective over the default group: the first collective save must run on every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("a collective save needs torch.distributed to be initialised")
    if group is not None and dist.get_backend(group) == "gloo":
        return group
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    if ranks not in _coord_groups:
        _coord_groups[ranks] = dist.new_group(list(ranks), backend="gloo",
                                              timeout=datetime.timedelta(seconds=timeout_s))
    return _coord_groups[ranks]


_SAMPLES, _WINDOW = 8, 64


def _sample_crc(s: StorageExtent) -> int:
    """CRC of a few 64-byte windows spread over a storage: a cheap replica check.

    Hashing every byte would cost a full read of the checkpoint before writing it; the
    samples catch replicas that drifted apart (different seeds, a rank that skipped a
    step) at the cost of a few cache lines per tensor.
    """
    n = s.length
    if s.source.device.type != "cpu":
        return _native.crc32c(s.source[: min(n, _WINDOW)].cpu().numpy().tobytes())
    crc, base = 0, s.source.data_ptr()
    for i in range(_SAMPLES):
        off = min(n - 1, i * n // _SAMPLES)
        crc = _native.crc32c_addr(base + off, min(_WINDOW, n - off), crc)
    return crc


def _layout_digest(plan: FilePlan) -> str:
    """What every writer must agree on: layout, pickled structure and sampled contents.

    torch's ``.data/serialization_id`` record differs per process by design, so it is
    excluded; rank 0's copy is the one written.
    """
    h = hashlib.sha256()
    h.update(str(plan.file_size).encode())
    for r in plan.manifest.records:
        if r.name.endswith("/.data/serialization_id"):
            continue
        h.update(f"{r.name}:{r.offset}:{r.size}:{r.dtype}:{r.kind}:{r.crc32c if r.kind == 'record' else ''};".encode())
    for s in plan.storages:
        h.update(f"{s.offset}:{_sample_crc(s):08x};".encode())
    return h.hexdigest()


def _skeleton_from(segments: list[tuple[int, bytes]], size: int) -> SparseFile:
    sk = SparseFile()
    for off, data in segments:
        sk.pwrite(off, data)
    sk.seek(size)
    return sk


def _collective(fn: Any, what: str) -> Any:
    try:
        return fn()
    except RuntimeError as e:  # gloo: connection reset by a dead peer, timeout...
        raise CollectiveSaveError(f"a peer rank died or timed out during a collective save ({what}): {e}") from e


def _all_gather(obj: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    _collective(lambda: dist.all_gather_object(out, obj, group=group), "all_gather")
    return out


def _broadcast(obj: Any, group: Any) -> Any:
    box = [obj]
    _collective(lambda: dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group),
                "broadcast")
    return box[0]


def _failures(statuses: list[Any]) -> list[str]:
    return [f"rank {r}: {s[1]}" for r, s in enumerate(statuses) if not s[0]]


class CollectiveSave:
    """One collective save: planned on the caller's thread, run (anywhere) by ``run``.

    Planning first pickles the object, so its structure and small tensors are fixed at
    call time; the async pipeline runs ``run`` on its worker. A planning error is not
    raised here: every rank must still enter the collective, learn of it and fail together.
    """

    def __init__(self, obj: Any, path: str | os.PathLike, group: Any = None, *, topology: Any = "replica",
                 timeout_s: float = DEFAULT_TIMEOUT_S, options: EngineOptions | None = None) -> None:
        self.t0 = time.perf_counter()
        self.opts = options or EngineOptions()
        self.topology = topology
        self.cg = coordination_group(group, timeout_s)
        self.final = os.path.abspath(os.fspath(path))
        self.stats = SaveStats(path=self.final)
        self.plan: FilePlan | None = None
        self.plan_error: BaseException | None = None
        try:
            self.plan = build(obj, MIN_ALIGNMENT)
        except Exception as e:  # noqa: BLE001 - reported collectively in run()
            self.plan_error = e
        self.stats.serialize_seconds = time.perf_counter() - self.t0

    def fail(self, error: BaseException) -> None:
        """Carry a local failure into ``run``, which reports it to every rank."""
        self.plan, self.plan_error = None, error

    def abort(self) -> None:
        """Nothing to undo before ``run``: the temp file is created inside it."""

    def run(self, on_body_written: Any = None) -> SaveStats:
        cg, final, opts, plan = self.cg, self.final, self.opts, self.plan
        rank, world = dist.get_rank(cg), dist.get_world_size(cg)
        stats = self.stats

        # 1. rank 0 validates the target and creates the temp file; everyone learns the outcome.
        engine = None
        first_error: BaseException | None = None
        header: tuple[bool, str, str] = (True, "", "")
        if rank == 0:
            try:
                commit.check_target(final)
                commit.clean(os.path.dirname(final))
                tmp = commit.temp_path(final)
                engine = open_engine(tmp, opts, create=True)
                if MIN_ALIGNMENT % engine.alignment:
                    engine.close()
                    commit.discard(tmp)
                    raise CheckpointError(f"{final}: the filesystem needs {engine.alignment}-byte alignment; "
                                          f"collective saves support up to {MIN_ALIGNMENT}")
                header = (True, "", tmp)
            except Exception as e:  # noqa: BLE001 - broadcast, then raised on every rank
                header = (False, f"{type(e).__name__}: {e}", "")
                first_error = e
        ok, err, tmp = _broadcast(header, cg)
        if not ok:
            if first_error is not None:
                raise first_error
            raise CollectiveSaveError(f"collective save of {final} failed on rank 0: {err}")

        try:
            # 2. agree on the layout, choose the writers.
            if plan is not None:
                status = (True, "", _layout_digest(plan), socket.gethostname())
            else:
                status = (False, f"{type(self.plan_error).__name__}: {self.plan_error}", "", socket.gethostname())
            statuses = _all_gather(status, cg)
            if _failures(statuses):
                if self.plan_error is not None:
                    raise CheckpointSerializationError(
                        f"cannot serialise the checkpoint for {final}: {status[1]}") from self.plan_error
                raise CollectiveSaveError(f"collective save of {final} failed: {'; '.join(_failures(statuses))}")
            assert plan is not None
            digests = {s[2] for s in statuses}
            writers = select_writers(self.topology, world, [s[3] for s in statuses])
            if len(digests) > 1:
                if rank == 0:
                    log.warning("fastpersist: ranks hold different checkpoint contents for %s (%d distinct layouts "
                                "or sampled values); rank 0 writes the whole file alone. Use sharded=True when "
                                "each rank holds its own state.", final, len(digests))
                writers = [0]
            else:
                # Everyone writes rank 0's skeleton bytes, so the file is exactly rank 0's layout.
                segs = _broadcast(plan.skeleton.segments() if rank == 0 else None, cg)
                if rank != 0:
                    plan.skeleton = _skeleton_from(segs, plan.file_size)

            # 3. each writer writes its share of the body into the shared temp file.
            ranges = split_range(0, plan.tail_start, len(writers), plan.alignment)
            rs = RangeStats()
            pieces: list = []
            status2: tuple[bool, str, list] = (True, "", [])
            try:
                if rank in writers:
                    lo, hi = ranges[writers.index(rank)]
                    if engine is None:
                        engine = open_engine(tmp, opts, create=False)
                    if hi > lo:
                        pieces = write_range(engine, plan, lo, hi, opts, rs)
                status2 = (True, "", pieces)
            except Exception as e:  # noqa: BLE001
                status2 = (False, f"{type(e).__name__}: {e}", [])
            if rank != 0 and on_body_written is not None:
                on_body_written()  # rank 0 still reads the tail's storage bytes below
            if engine is not None and rank != 0 and status2[0]:
                try:
                    engine.sync()
                except OSError as e:
                    status2 = (False, f"{type(e).__name__}: {e}", [])
            statuses2 = _all_gather(status2, cg)
            if _failures(statuses2):
                raise CollectiveSaveError(f"collective save of {final} failed: {'; '.join(_failures(statuses2))}")

            # 4. rank 0 writes the tail and commits; everyone learns the outcome.
            outcome = (True, "")
            if rank == 0:
                try:
                    all_pieces = [p for s in statuses2 for p in s[2]]
                    write_tail(engine, plan, all_pieces, opts, rs, on_body_written)
                    engine.sync()
                    engine.close()
                    commit.publish(tmp, final)
                except Exception as e:  # noqa: BLE001
                    outcome = (False, f"{type(e).__name__}: {e}")
            outcome = _broadcast(outcome, cg)
            if not outcome[0]:
                raise CollectiveSaveError(f"collective save of {final} failed on rank 0 at commit: {outcome[1]}")
        except BaseException as e:
            if engine is not None:
                engine.close()
            if rank == 0:
                commit.discard(tmp)
                if isinstance(e, OSError) and getattr(e, "filename", None) == tmp:
                    raise rename_os_error(e, final, tmp) from e
            raise
        finally:
            if engine is not None:
                engine.close()

        stats.bytes = plan.file_size
        stats.writers = len(writers)
        stats.alignment = plan.alignment
        stats.write_seconds, stats.copy_seconds = rs.seconds, rs.copy_seconds
        stats.requests, stats.short_writes = rs.requests, rs.short_writes
        stats.extra.update(rank_bytes=rs.bytes, writer_ranks=writers, tail_start=plan.tail_start)
        stats.seconds = time.perf_counter() - self.t0
        return stats


def save_collective(obj: Any, path: str | os.PathLike, group: Any = None, *, topology: Any = "replica",
                    timeout_s: float = DEFAULT_TIMEOUT_S, **options: Any) -> SaveStats:
    """Write one checkpoint from every rank of ``group`` (see module doc)."""
    opts, rest = EngineOptions.pick(dict(options))
    if rest:
        raise TypeError(f"save_collective got unknown options {sorted(rest)}")
    return CollectiveSave(obj, path, group, topology=topology, timeout_s=timeout_s, options=opts).run()


def save_sharded(obj: Any, path: str | os.PathLike, group: Any = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, **options: Any) -> SaveStats:
    """Each rank writes its own ``path`` (different per rank) in parallel; all-or-nothing.

    Files are renamed into place only after every rank's file is durable; if any rank
    fails, every rank discards its temporary file and raises.
    """
    opts, rest = EngineOptions.pick(dict(options))
    if rest:
        raise TypeError(f"save_sharded got unknown options {sorted(rest)}")
    cg = coordination_group(group, timeout_s)
    prepared = None
    own_error: BaseException | None = None
    status: tuple[bool, str] = (True, "")
    try:
        prepared = PreparedSave(obj, path, opts)
        stats = prepared.write(publish=False)
    except Exception as e:  # noqa: BLE001
        status = (False, f"{type(e).__name__}: {e}")
        own_error: BaseException | None = e
    try:
        statuses = _all_gather(status, cg)
    except BaseException:
        if prepared is not None:
            prepared.abort()
        raise
    failed = _failures(statuses)
    if failed:
        if prepared is not None:
            prepared.abort()
        if not status[0] and own_error is not None:
            raise own_error
        raise CollectiveSaveError(f"sharded save of {os.fspath(path)} not committed: {'; '.join(failed)}")
    prepared.publish()
    _all_gather((True, ""), cg)  # every rank's file is in place before anyone returns
    return stats
