"""Collective saves: one checkpoint written by many data-parallel ranks at once.

Every rank of the group calls ``fp_core.save(obj, path, group=...)`` with the same object (data-parallel
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
import errno
import logging
import os
import shutil
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from .. import _native
from ..errors import CheckpointError, CheckpointSerializationError
from ..format.plan import FilePlan, StorageExtent, build
from ..format.skeleton import SparseFile
from ..io import deferred_free
from ..io.engine import EngineOptions, open_engine
from ..io.writer import PieceCrc, RangeStats, device_work_after_save, write_range, write_tail
from ..saving import commit
from ..saving.local import MIN_ALIGNMENT, LocalSave, rename_os_error
from ..stats import SaveStats
from .partition import select_writers, split_range

log = logging.getLogger("fastpersist")

DEFAULT_TIMEOUT_S = 300.0
_coord_groups: dict[tuple[int, ...], Any] = {}


class CollectiveSaveError(CheckpointError):
    """Another rank failed (or died) during a collective save; nothing was committed."""


def coordination_group(group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A dedicated gloo group over ``group``'s ranks, created once and cached.

    Always a new group, even when ``group`` is gloo already: checkpoint collectives run on a
    background thread, and on the training's own group they would interleave with its
    gradient all-reduces. Creating one is itself a collective over the default group, so
    the first collective save (or a call of this function) must run on every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("a collective save needs torch.distributed to be initialised")
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    if ranks not in _coord_groups:
        _coord_groups[ranks] = dist.new_group(list(ranks), backend="gloo",
                                              timeout=datetime.timedelta(seconds=timeout_s))
    return _coord_groups[ranks]


_SAMPLES, _WINDOW = 9, 64


def sample_spans(n: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` windows the replica check reads of an ``n``-byte storage:
    all of it when small, else ``_SAMPLES`` windows spread evenly from its first byte to
    its last (both ends included: a difference in the last bytes is seen too)."""
    if n <= _SAMPLES * _WINDOW:
        return [(0, n)] if n else []
    return [(i * (n - _WINDOW) // (_SAMPLES - 1), _WINDOW) for i in range(_SAMPLES)]


def _sample_crc(s: StorageExtent) -> int:
    """CRC of a few 64-byte windows spread over a storage: a cheap replica check.

    Hashing every byte would cost a full read of the checkpoint before writing it; the
    samples catch replicas that drifted apart (different seeds, a rank that skipped a
    step) at the cost of a few cache lines per tensor. Device storages are sampled on the
    device (one gather, one small copy to the host), the same windows as on the CPU.
    """
    data, spans = s.data, sample_spans(s.length)
    if data.device.type != "cpu":
        return _native.crc32c(_gather(data, spans).numpy().tobytes())
    crc, base = 0, data.data_ptr()
    for off, n in spans:
        crc = _native.crc32c_addr(base + off, n, crc)
    return crc


def _gather(data: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The bytes of ``spans`` of a flat uint8 tensor, in order, on the host."""
    if not spans:
        return torch.empty(0, dtype=torch.uint8)
    idx = torch.cat([torch.arange(off, off + n, device=data.device) for off, n in spans])
    return data[idx].cpu()


# Storages whose sampled contents differ between ranks (BatchNorm statistics under DDP,
# per-rank counters) are sent from rank 0 to the writers, up to this many bytes in all and
# a tenth of the checkpoint; beyond that rank 0 writes the whole file alone.
MAX_DIFFERING_BYTES = 64 << 20


def _storage_table(plan: FilePlan) -> dict[str, tuple[int, str | None, int]]:
    """record name -> (bytes, dtype, sampled CRC) for every non-empty storage."""
    return {plan.manifest.records[s.record].name: (s.length, plan.manifest.records[s.record].dtype, _sample_crc(s))
            for s in plan.storages}


def _share_plan(tables: list[dict]) -> tuple[str | None, set[str]]:
    """Can the ranks write rank 0's file together? (reason if not, storages that differ)."""
    ref = tables[0]
    shape = {k: v[:2] for k, v in ref.items()}
    for r, t in enumerate(tables[1:], 1):
        if {k: v[:2] for k, v in t.items()} != shape:
            return f"rank {r} holds storages of other sizes or dtypes than rank 0", set()
    differing = {k for k, v in ref.items() if any(t[k][2] != v[2] for t in tables[1:])}
    nbytes = sum(ref[k][0] for k in differing)
    limit = min(MAX_DIFFERING_BYTES, sum(v[0] for v in ref.values()) // 10)
    if differing and nbytes > limit:
        return (f"{len(differing)} storages ({nbytes / 2**20:.1f} MiB) differ between ranks, more than "
                f"{limit / 2**20:.1f} MiB"), differing
    return None, differing


def _adopt_rank0_layout(plan: FilePlan, layout: dict) -> None:
    """Make this rank's plan write rank 0's file: its skeleton, offsets and differing bytes."""
    plan.skeleton = _skeleton_from(layout["segments"], layout["file_size"])
    plan.file_size = layout["file_size"]
    plan.manifest_header_offset = layout["manifest_header_offset"]
    names = {plan.manifest.records[s.record].name: s for s in plan.storages}
    for name, offset in layout["offsets"].items():
        names[name].offset = offset
        if name in layout["differing"]:
            names[name].host = torch.frombuffer(bytearray(layout["differing"][name]), dtype=torch.uint8)
    plan.storages.sort(key=lambda s: s.offset)


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


# coordination group -> its ranks on this host, from a collective save's host names
# (``EngineOptions.share_queue``)
_ranks_on_host: dict[Any, int] = {}


def forget_groups() -> None:
    """A writer process leaves its group: what was learnt of it goes with it."""
    _ranks_on_host.clear()


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
    """One collective save (a SaveJob): planned on the caller's thread, run (anywhere) by
    ``run``.

    Planning first pickles the object, so its structure and small tensors are fixed at
    call time; the async pipeline runs ``run`` on its worker. A planning error is not
    raised here: every rank must still enter the collective, learn of it and fail together.
    """

    collective = True

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
            self.plan = self._build(obj)
        except Exception as e:  # noqa: BLE001 - reported collectively in run()
            self.plan_error = e
        self.stats.serialize_seconds = time.perf_counter() - self.t0

    @classmethod
    def from_plan(cls, plan: FilePlan | None, path: str | os.PathLike, *, plan_error: BaseException | None,
                  cg: Any, topology: Any, options: EngineOptions) -> CollectiveSave:
        """A save laid out elsewhere (the writer process: ``plan``'s storages in its
        shared-memory arena, or ``plan_error``, the trainer's failure to make one), run over
        the coordination group ``cg`` (the writers' own)."""
        self = cls.__new__(cls)
        self.t0 = time.perf_counter()
        self.opts, self.topology, self.cg = options, topology, cg
        self.final = os.path.abspath(os.fspath(path))
        self.stats = SaveStats(path=self.final)
        self.plan, self.plan_error = plan, plan_error
        return self

    def fail(self, error: BaseException) -> None:
        """Carry a local failure into ``run``, which reports it to every rank."""
        self.plan, self.plan_error = None, error

    def abort(self) -> None:
        """Nothing to undo before ``run``: the temp file is created inside it."""

    def run(self, on_body_written: Any = None) -> SaveStats:
        # samples, gathers and copies of device storages on the background writer: after
        # the caller's stream at save(), not behind the training's next kernels
        with device_work_after_save(self.plan.storages if self.plan is not None else []):
            return self._run(on_body_written)

    def _run(self, on_body_written: Any) -> SaveStats:
        cg, final, plan = self.cg, self.final, self.plan
        rank, world = dist.get_rank(cg), dist.get_world_size(cg)
        stats = self.stats
        # the engines' queues shared among this host's ranks; known from the first save's
        # host names on (queue depth is this rank's own: no rank needs to agree with it)
        opts = self.opts = self.opts.for_ranks_on_host(_ranks_on_host.get(cg, 1))

        # 1. rank 0 validates the target and creates the temp file; everyone learns the outcome.
        engine = None
        temp: commit.TempFile | None = None  # rank 0's: named, the other ranks open it by name
        first_error: BaseException | None = None
        header: tuple[bool, str, str] = (True, "", "")
        if rank == 0:
            try:
                target = commit.check_target(final)  # a symlink: the file it names
                commit.clean_in_background(os.path.dirname(target))
                temp = commit.TempFile(target, lambda p, _: open_engine(p, opts, create=True), named=True)
                engine, tmp = temp.engine, temp.name
                if plan is not None:
                    commit.check_room(target, self._tail_plan().file_size, temp.fileno())
                if MIN_ALIGNMENT % engine.alignment:
                    raise CheckpointError(f"{final}: the filesystem needs {engine.alignment}-byte alignment; "
                                          f"collective saves support up to {MIN_ALIGNMENT}")
                header = (True, "", tmp)
            except Exception as e:  # noqa: BLE001 - broadcast, then raised on every rank
                header = (False, f"{type(e).__name__}: {e}", "")
                first_error = e
                if temp is not None:
                    temp.abort()
                    temp, engine = None, None
        try:
            ok, err, tmp = _broadcast(header, cg)
        except BaseException:
            if temp is not None:  # a dead peer: rank 0's temp file goes, not held to the end
                temp.abort()
            raise
        if ok and tmp == _DECLINED:
            # rank 0 writes this checkpoint alone (see decline()): nothing to do here.
            stats.writers = 0
            stats.extra["declined"] = True
            if on_body_written is not None:
                on_body_written()
            return stats
        if not ok:
            if first_error is not None:
                raise first_error
            raise CollectiveSaveError(f"collective save of {final} failed on rank 0: {err}")

        try:
            # 2. agree on what to write (_agree), choose the writers.
            if plan is not None:
                status = (True, "", self._table(), socket.gethostname())
            else:
                status = (False, f"{type(self.plan_error).__name__}: {self.plan_error}", {}, socket.gethostname())
            statuses = _all_gather(status, cg)
            if cg not in _ranks_on_host:
                if len(_ranks_on_host) > 64:  # groups of earlier writers' groups
                    _ranks_on_host.clear()
                _ranks_on_host[cg] = sum(1 for s in statuses if s[3] == status[3])
                opts = self.opts = self.opts.for_ranks_on_host(_ranks_on_host[cg])  # the engine not yet opened
            if _failures(statuses):
                if self.plan_error is not None:
                    raise CheckpointSerializationError(
                        f"cannot serialise the checkpoint for {final}: {status[1]}") from self.plan_error
                raise CollectiveSaveError(f"collective save of {final} failed: {'; '.join(_failures(statuses))}")
            assert plan is not None
            writers = self._agree(statuses, rank, world)

            # 3. each writer writes its share of the body into the shared temp file.
            rs = RangeStats()
            status2: tuple[bool, str, list] = (True, "", [])

            def shared_engine() -> Any:
                nonlocal engine
                if engine is None:
                    engine = open_engine(tmp, opts, create=False)
                return engine

            try:
                status2 = (True, "", self._write_share(shared_engine, tmp, writers, rank, rs))
            except Exception as e:  # noqa: BLE001
                status2 = (False, f"{type(e).__name__}: {e}", [])
            if rank != 0 and on_body_written is not None:
                on_body_written()  # rank 0 still reads the tail's storage bytes below
            if rank != 0 and status2[0]:
                try:
                    self._sync_share(engine)
                except OSError as e:
                    status2 = (False, f"{type(e).__name__}: {e}", [])
            statuses2 = _all_gather(status2, cg)
            if _failures(statuses2):
                raise CollectiveSaveError(f"collective save of {final} failed: {'; '.join(_failures(statuses2))}")
            stats.extra["queue_depth"] = engine.queue_depth if engine is not None else opts.queue_depth

            # 4. rank 0 writes the tail and commits; everyone learns the outcome.
            outcome = (True, "")
            if rank == 0:
                try:
                    index = {r.name: i for i, r in enumerate(self._tail_plan().manifest.records)}
                    all_pieces = [PieceCrc(index[name], start, length, crc)
                                  for st in statuses2 for name, start, length, crc in st[2]]
                    self._write_tail(engine, tmp, all_pieces, rs, on_body_written)
                    engine.sync()
                    engine.close()
                    temp.publish()
                except Exception as e:  # noqa: BLE001
                    outcome = (False, f"{type(e).__name__}: {e}")
            outcome = _broadcast(outcome, cg)
            if not outcome[0]:
                raise CollectiveSaveError(f"collective save of {final} failed on rank 0 at commit: {outcome[1]}")
        except BaseException as e:
            if engine is not None:
                engine.close()
            if temp is not None:
                temp.abort()
                if isinstance(e, OSError) and getattr(e, "filename", None) == tmp:
                    raise rename_os_error(e, final) from e
            raise
        finally:
            if engine is not None:
                stats.backend, stats.backend_reason = engine.backend, engine.backend_reason
                engine.close()

        stats.bytes = plan.file_size
        stats.writers = len(writers)
        stats.alignment = plan.alignment
        stats.write_seconds, stats.copy_seconds = rs.seconds, rs.copy_seconds
        stats.requests, stats.short_writes = rs.requests, rs.short_writes
        stats.extra.update(rank_bytes=rs.bytes, writer_ranks=writers, tail_start=plan.tail_start,
                           zero_copy_bytes=rs.zero_copy_bytes)
        stats.seconds = time.perf_counter() - self.t0
        return stats

    # -- the steps a kind of collective save defines (run() is the protocol around them) --

    def _build(self, obj: Any) -> FilePlan:
        """This rank's plan of ``obj`` (on the caller's thread)."""
        return build(obj, MIN_ALIGNMENT)

    def _table(self) -> Any:
        """What this rank tells the others about its plan (all-gathered before writing)."""
        assert self.plan is not None
        return _storage_table(self.plan)

    def _agree(self, statuses: list[Any], rank: int, world: int) -> list[int]:
        """From every rank's :meth:`_table` (``statuses[r][2]``) and host
        (``statuses[r][3]``): the ranks that write. Rank 0's file is the one written: the
        others adopt its skeleton (pickle included) and offsets, write their own copies of
        the storages that match rank 0's (sampled), and rank 0's bytes for the few that
        differ (sent along with the skeleton)."""
        plan, cg = self.plan, self.cg
        assert plan is not None
        writers = select_writers(self.topology, world, [s[3] for s in statuses])
        reason, differing = _share_plan([s[2] for s in statuses])
        if reason is not None:
            if rank == 0:
                log.warning("fastpersist: %s for %s; rank 0 writes the whole file alone. Use sharded=True "
                            "when each rank holds its own state.", reason, self.final)
            return [0]
        if world > 1:
            layout = None
            if rank == 0:
                by_name = {plan.manifest.records[s.record].name: s for s in plan.storages}
                layout = {
                    "segments": plan.skeleton.segments(), "file_size": plan.file_size,
                    "manifest_header_offset": plan.manifest_header_offset,
                    "offsets": {n: st.offset for n, st in by_name.items()},
                    "differing": {n: by_name[n].data.cpu().numpy().tobytes() for n in differing},
                }
            layout = _broadcast(layout, cg)
            if rank != 0:
                _adopt_rank0_layout(plan, layout)
            self.stats.extra["differing_storages"] = len(differing)
        return writers

    def _write_share(self, engine: Any, tmp: str, writers: list[int], rank: int,
                     rs: RangeStats) -> list[tuple[str, int, int, int]]:
        """Write this rank's share of the body into the temp file ``tmp`` (``engine()``
        opens it once); return the CRC-32C of every storage piece written as
        ``(record name, start in the storage, length, crc)``."""
        plan = self.plan
        assert plan is not None
        if rank not in writers:
            return []
        lo, hi = split_range(0, plan.tail_start, len(writers), plan.alignment)[writers.index(rank)]
        if hi <= lo:
            return []
        return [(plan.manifest.records[pc.record].name, pc.start, pc.length, pc.crc)
                for pc in write_range(engine(), plan, lo, hi, self.opts, rs)]

    def _sync_share(self, engine: Any) -> None:
        """Make this rank's share durable (every rank but 0, which syncs at the commit)."""
        if engine is not None:
            engine.sync()

    def _tail_plan(self) -> FilePlan:
        """The plan whose manifest the pieces' CRCs fold into."""
        assert self.plan is not None
        return self.plan

    def _write_tail(self, engine: Any, tmp: str, pieces: list[PieceCrc], rs: RangeStats,
                    on_body_written: Any) -> None:
        """Rank 0, once every share is durable: the manifest and the tail."""
        assert self.plan is not None
        write_tail(engine, self.plan, pieces, self.opts, rs, on_body_written)


_DECLINED = "<declined by rank 0>"


def decline(group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Rank 0's half of a collective save it will *not* make collective.

    The other ranks may already be waiting in :meth:`CollectiveSave.run` for a checkpoint
    that rank 0 decides to write alone (a remote URL, say): this answers them, and they
    return without writing or raising.
    """
    cg = coordination_group(group, timeout_s)
    if dist.get_rank(cg) != 0:
        raise RuntimeError("only rank 0 declines a collective save")
    _broadcast((True, "", _DECLINED), cg)


def save_sharded(obj: Any, path: str | os.PathLike, group: Any = None, *, options: EngineOptions | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> SaveStats:
    """Each rank writes its own ``path`` (different per rank) in parallel; all-or-nothing.

    Files are renamed into place only after every rank's file is durable; if any rank
    fails, every rank discards its temporary file and raises.
    """
    cg = coordination_group(group, timeout_s)
    prepared = None
    own_error: BaseException | None = None
    status: tuple[bool, str] = (True, "")
    try:
        prepared = LocalSave(obj, path, options or EngineOptions())
        stats = prepared.run(publish=False)
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
    # Every file is durable under its temporary name. Publish, keeping each rank's previous
    # file aside until every rank has published: a rank whose rename or directory fsync
    # fails makes every rank put its previous file back (or remove the new one).
    final = prepared.target  # the file a symlink names: what is kept aside and put back
    new_inode = os.fstat(prepared.temp.fileno()).st_ino
    previous, held, aside = None, None, None
    status, own_error = (True, ""), None
    try:
        if os.path.lexists(final):
            previous = commit.temp_path(final)
            held = _keep_aside(final, previous)  # held: no clean-up takes it for an orphan
        prepared.publish()
    except Exception as e:  # noqa: BLE001 - agreed on below
        status, own_error = (False, f"{type(e).__name__}: {e}"), e
        prepared.abort()
    try:
        try:
            statuses = _all_gather(status, cg)
        except BaseException:
            _restore(final, previous, new_inode)
            raise
        failed = _failures(statuses)
        if failed:
            _restore(final, previous, new_inode)
            if own_error is not None:
                raise own_error
            raise CollectiveSaveError(f"sharded save of {os.fspath(path)} not committed (previous files kept): "
                                      f"{'; '.join(failed)}")
        if previous is not None and os.path.lexists(previous):
            aside = deferred_free.pin(previous)  # its blocks freed in the background
            commit.discard(previous)
    finally:
        commit.settle(held)
        if aside is not None:
            aside.free_later()
    return stats


def _keep_aside(final: str, previous: str) -> int:
    """Keep the file under ``final`` reachable as ``previous`` while a sharded save
    publishes (a hard link; a copy where the filesystem has no links); return a held
    descriptor of it (commit.hold)."""
    try:
        os.link(final, previous)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV):
            raise
        shutil.copyfile(final, previous)
        commit.fsync_file(previous)
    fd = os.open(previous, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return commit.hold(fd)
    finally:
        os.close(fd)


def _restore(final: str, previous: str | None, new_inode: int) -> None:
    """Undo this rank's publish: the previous file back under ``final``, or no file where
    there was none (only if what is there is ours)."""
    try:
        if previous is not None:
            if os.path.lexists(final) and os.path.samefile(previous, final):
                os.unlink(previous)  # never replaced: rename() of two links to one file does nothing
            else:
                os.replace(previous, final)
        else:
            try:
                if os.stat(final).st_ino == new_inode:
                    os.unlink(final)
            except FileNotFoundError:
                pass
        commit.fsync_dir(os.path.dirname(final))
    except OSError as e:
        log.error("fastpersist: could not restore %s after a failed sharded save: %s", final, e)


def agree(ok: bool, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Did every rank of ``group`` succeed? Every rank calls it at the same point (on the
    coordination group, so it never interleaves with training collectives)."""
    cg = coordination_group(group, timeout_s)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    _collective(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cg), "all_reduce")
    return bool(flag.item())


def barrier(group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until every rank of ``group`` gets here (on the coordination group)."""
    cg = coordination_group(group, timeout_s)
    _collective(lambda: dist.barrier(group=cg), "barrier")
