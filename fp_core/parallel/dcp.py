"""Sharded checkpoints through torch.distributed.checkpoint (DCP), on the native engine.

``dcp.save(state, storage_writer=FastPersistWriter(d))`` (and ``dcp.async_save``) and
``dcp.load(state, storage_reader=FastPersistReader(d))``: DCP's planner decides which rank
writes which shard (FSDP2 / DTensor / tensor parallel state included); FastPersist replaces
only the storage.

The directory is the one DCP's own ``FileSystemWriter`` makes, so stock
``dcp.load(state, checkpoint_id=d)`` reads it: each rank writes ``__<rank>_0.distcp``, every
tensor item a ``torch.save`` blob at the offset ``.metadata`` records, every byte item as
is. What FastPersist adds:

* **Native writes.** A rank's file is one plan for the engine: each blob's storage is
  placed so that its bytes are 4 KiB-aligned in the file, congruent to their address for
  CPU tensors (written straight from the tensor, no staging copy), and the whole file goes
  out through O_DIRECT with many writes in flight.
* **A checksum per item.** Next to its file each rank writes
  ``__<rank>_0.distcp.fastpersist.json``: every item's FQN, offset, length and CRC-32C
  (computed while the bytes were staged). ``fp_core.verify(d)`` checks every rank's file
  and names the file and the FQN of a damaged item; stock DCP ignores the extra files.
* **Atomic and durable.** Everything is written into a staging directory next to the final
  one (``.<name>.fastpersist-staging``, a name nobody lists); every rank's file and
  manifest are fdatasync'ed before DCP's ``finish`` runs, where the coordinator writes
  ``.metadata``, syncs, and renames the staging directory over the final name
  (``commit.publish_dir``). A save that fails or is killed leaves the previous checkpoint
  as it was and nothing half-written under the final name.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import _native
from ..errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from ..format import ziptail
from ..format.plan import FilePlan, StorageExtent, align_up, byte_view
from ..format.skeleton import SparseFile, capture
from ..io import read_depth
from ..io.engine import EngineOptions

# record_ready / device_work_after, public here: for a state whose device tensors the
# caller's thread copied and a worker writes with DCP later (Lightning's FSDP1 path).
from ..io.writer import RangeStats, device_work_after, record_ready, write_range
from ..loading.integrity import CheckpointFile
from ..saving import commit
from ..saving.local import rename_os_error

METADATA = ".metadata"
DATA_SUFFIX = ".distcp"
MANIFEST_SUFFIX = ".fastpersist.json"
DIR_MANIFEST = ".fastpersist-dcp.json"  # the rank files of the checkpoint, written last by the coordinator
STAGING_SUFFIX = ".fastpersist-staging"
FORMAT = "fastpersist-dcp/1"
_ALIGN = 4096  # where each blob's storage bytes start in the file (O_DIRECT blocks)
_BLOB_ALIGNMENT = 64  # torch.save's own record alignment inside a blob (compact headers)


def staging_path(final: str) -> str:
    """The staging directory of a checkpoint directory (the same name on every rank)."""
    d, base = os.path.split(os.path.abspath(final))
    return os.path.join(d, f".{base}{STAGING_SUFFIX}")


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Is ``path`` a DCP checkpoint directory FastPersist wrote?"""
    p = os.fspath(path)
    return os.path.isfile(os.path.join(p, DIR_MANIFEST)) and os.path.isfile(os.path.join(p, METADATA))


def _is_dcp_dir(d: str) -> bool:
    """DCP's (stock or ours: a directory manifest without .metadata is a damaged one of
    ours), or a directory of other files."""
    return os.path.lexists(os.path.join(d, METADATA)) or os.path.lexists(os.path.join(d, DIR_MANIFEST))


def check_extra_files(extra_files: dict[str, bytes]) -> dict[str, bytes]:
    """The extra files of a checkpoint directory, their names checked (plain names, none of
    DCP's or FastPersist's own)."""
    out = {}
    for name, data in extra_files.items():
        if (not isinstance(name, str) or not name or "/" in name or "\0" in name or name.startswith(".")
                or name in (METADATA, DIR_MANIFEST) or name.endswith((DATA_SUFFIX, MANIFEST_SUFFIX))):
            raise ValueError(f"extra file name {name!r}: a plain file name other than DCP's and FastPersist's own")
        out[name] = bytes(data)
    return out



# ---------------------------------------------------------------- writing


@dataclasses.dataclass
class _Item:
    write_item: WriteItem
    offset: int  # of the item's bytes in the rank's file
    length: int
    record: int  # its index (the plan's record number for its storage)
    crc: int = 0
    # A tensor item's storage bytes: where in the file, how many, their CRC-32C, and the
    # tensor they hold (a reader fills a matching tensor straight from the file).
    data_offset: int = 0
    data_length: int = 0
    data_crc: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def record_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"fqn": self.write_item.index.fqn, "offset": self.offset, "length": self.length,
                               "crc32c": f"{self.crc:08x}"}
        if self.write_item.type == WriteItemType.BYTE_IO:
            return {**doc, "kind": "bytes"}
        return {**doc, "kind": "tensor", "data": [self.data_offset, self.data_length],
                "data_crc32c": f"{self.data_crc:08x}", "dtype": self.dtype, "shape": list(self.shape)}


def _tensor_blob(tensor: torch.Tensor) -> tuple[SparseFile, int, torch.Tensor]:
    """``torch.save(tensor)`` as a skeleton with a hole where the storage's bytes go: the
    skeleton, where the hole starts in it, and the bytes (a flat uint8 view)."""
    sparse, storages = capture(tensor, _BLOB_ALIGNMENT)
    (key, (storage, _, nbytes)), = storages.items()
    directory = ziptail.read_directory(sparse)
    entry = next(e for e in directory.entries if e.name.endswith(f"/data/{key}"))
    return sparse, ziptail.local_data_offset(sparse, entry.header_offset), byte_view(storage)


def _owns_its_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.nbytes and t.storage_offset() == 0 and t.is_contiguous()


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor whose storage is exactly its bytes. A contiguous CPU view
    (FSDP2's shards are views into a padded buffer) keeps its memory: its bytes are wrapped
    as a storage of their own (through numpy), not copied; anything else is copied."""
    if (t.device.type == "cpu" and t.is_contiguous() and t.numel() and not t.is_quantized
            and not t.is_conj() and not t.is_neg()):
        raw = t.reshape(-1).view(torch.uint8).numpy()  # shares t's memory, exactly its bytes
        return torch.from_numpy(raw).view(t.dtype).view(t.shape)
    return t.contiguous().clone()


class _RankFile:
    """One rank's data file laid out as a single FilePlan for the engine."""

    def __init__(self, items: list[tuple[WriteItem, Any]]) -> None:
        self.skeleton = SparseFile()
        self.storages: list[StorageExtent] = []
        self.items: list[_Item] = []
        self._keep: list[Any] = []
        pos = 0
        for i, (wi, data) in enumerate(items):
            if wi.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                self.skeleton.pwrite(pos, raw)
                self.items.append(_Item(wi, pos, len(raw), i))
                pos += len(raw)
                continue
            t = data.detach()
            if not _owns_its_storage(t):  # torch.save would write the whole storage of a view
                t = _own_storage(t)
            sparse, hole, src = _tensor_blob(t)
            self._keep.append(t)
            # The storage's bytes start on a block, congruent to their address for CPU memory
            # (the engine then writes them from the tensor itself).
            residue = src.data_ptr() % _ALIGN if src.device.type == "cpu" and src.data_ptr() % 64 == 0 else 0
            data_at = align_up(pos + hole, _ALIGN) + residue
            if data_at - _ALIGN >= pos + hole:
                data_at -= _ALIGN
            base = data_at - hole
            for off, seg in sparse.segments():
                self.skeleton.pwrite(base + off, seg)
            if src.numel():
                self.storages.append(StorageExtent(base + hole, src.numel(), src, i))
            self.items.append(_Item(wi, base, sparse.size, i, data_offset=base + hole, data_length=src.numel(),
                                    dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)))
            pos = base + sparse.size
        self.size = pos
        self.skeleton.seek(pos)

    def plan(self, alignment: int) -> FilePlan:
        return FilePlan(file_size=self.size, alignment=alignment, skeleton=self.skeleton,
                        storages=sorted(self.storages, key=lambda s: s.offset), manifest=None)

    def item_crcs(self, piece_crcs: list[Any]) -> None:
        """Each item's CRC-32C over its bytes: the skeleton's, and the storage pieces the
        engine checksummed while staging, folded in file order."""
        parts: dict[int, list[tuple[int, int, int]]] = {}  # record -> (file offset, length, crc)
        ext = {s.record: s for s in self.storages}
        for pc in piece_crcs:
            parts.setdefault(pc.record, []).append((ext[pc.record].offset + pc.start, pc.length, pc.crc))
        for it in self.items:
            data = 0
            for _, n, c in sorted(parts.get(it.record, [])):
                data = _native.crc32c_combine(data, c, n)
            it.data_crc = data
            spans = list(parts.get(it.record, []))
            for off, seg in self.skeleton.segments_in(it.offset, it.length):
                spans.append((it.offset + off, len(seg), _native.crc32c(seg)))
            crc, pos = 0, it.offset
            for off, n, c in sorted(spans):
                if off > pos:  # a hole in the skeleton (zeros)
                    crc = _native.crc32c_combine(crc, _native.crc32c(bytes(off - pos)), off - pos)
                crc = _native.crc32c_combine(crc, c, n)
                pos = off + n
            end = it.offset + it.length
            if pos < end:
                crc = _native.crc32c_combine(crc, _native.crc32c(bytes(end - pos)), end - pos)
            it.crc = crc


class FastPersistWriter(StorageWriter):
    """A DCP ``StorageWriter`` on the native engine (see the module doc).

    ``path``: the checkpoint directory. ``options``: engine options (``backend``,
    ``queue_depth``, ``chunk_bytes``, ``copy_threads``, ``io_threads``).
    ``extra_files``: ``{name: bytes}`` the coordinator writes into the directory before it
    is committed, checksummed in the directory manifest. ``on_written``: called on each
    rank once its file is written (no tensor memory is read after it). ``fail_with``: an
    error this rank raises in planning, so that every rank fails the save together.
    """

    def __init__(self, path: str | os.PathLike, *, extra_files: dict[str, bytes] | None = None,
                 on_written: Callable[[], None] | None = None, fail_with: BaseException | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.options, rest = EngineOptions.pick(dict(options))
        if rest:
            raise TypeError(f"FastPersistWriter got unknown options {sorted(rest)}")
        self.extra_files = check_extra_files(extra_files or {})
        self.on_written = on_written
        self.fail_with = fail_with
        self.path = os.path.abspath(os.fspath(path))
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self.stats: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        from ..paths import is_remote

        return not is_remote(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") if kwargs.get("rank") is not None else 0
        if is_coordinator:
            # Before any rank writes (they start after the plans are gathered, a collective):
            # a staging directory left by a killed save goes, and a fresh one is made.
            if os.path.lexists(self.path) and not os.path.isdir(self.path):
                raise NotADirectoryError(20, "a DCP checkpoint is a directory; a file is in the way", self.path)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            commit.recover_dir(self.path)  # a save killed mid-commit left the previous one aside
            shutil.rmtree(staging_path(self.path), ignore_errors=True)
            os.mkdir(staging_path(self.path))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.fail_with is not None:
            raise self.fail_with
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t0 = time.perf_counter()
        name = f"{plan.storage_data.prefix}0{DATA_SUFFIX}"
        staging = staging_path(self.path)
        items = [(wi, planner.resolve_data(wi)) for wi in plan.items]
        rank_file = _RankFile(items)
        final = os.path.join(staging, name)
        from ..io.engine import open_engine

        temp = commit.TempFile(final, lambda p, tmpfile: open_engine(p, self.options, create=True, tmpfile=tmpfile))
        try:
            engine = temp.engine
            fplan = rank_file.plan(max(_ALIGN, engine.alignment))
            rs = RangeStats()
            with engine:
                pieces = write_range(engine, fplan, 0, fplan.file_size, self.options, rs)
                engine.truncate(fplan.file_size)
                t_sync = time.perf_counter()
                engine.sync()
            rank_file.item_crcs(pieces)
            temp.publish()
            sync_seconds = time.perf_counter() - t_sync
        except BaseException as e:
            temp.abort()
            if isinstance(e, OSError) and getattr(e, "filename", None) in (temp.engine_path, temp.name):
                raise rename_os_error(e, final) from e
            raise
        manifest = {
            "format": FORMAT, "file": name, "size": rank_file.size,
            "items": [it.record_doc() for it in rank_file.items],
        }
        t_json = time.perf_counter()
        _write_json(os.path.join(staging, name + MANIFEST_SUFFIX), manifest)  # fdatasync'ed too
        sync_seconds += time.perf_counter() - t_json
        # What this rank's write did, for SaveStats: the engine's requests and the time in
        # fdatasync and the temporary file's commit (the rank file and its manifest).
        self.stats = {"bytes": rank_file.size, "seconds": time.perf_counter() - t0,
                      "zero_copy_bytes": rs.zero_copy_bytes, "file": name, "backend": engine.backend,
                      "backend_reason": engine.backend_reason, "alignment": fplan.alignment,
                      "write_seconds": rs.seconds, "copy_seconds": rs.copy_seconds,
                      "device_copy_seconds": rs.device_copy_seconds, "sync_seconds": sync_seconds,
                      "requests": rs.requests, "short_writes": rs.short_writes}
        results = [WriteResult(index=it.write_item.index, size_in_bytes=it.length,
                               storage_data=_StorageInfo(name, it.offset, it.length)) for it in rank_file.items]
        del items, rank_file  # no tensor is read any more
        if self.on_written is not None:
            self.on_written()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: ``.metadata`` last, then the whole directory into place, durably."""
        t0 = time.perf_counter()
        staging = staging_path(self.path)
        storage_md: dict[MetadataIndex, Any] = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        buf = io.BytesIO()
        pickle.dump(metadata, buf)
        commit.write_durably(os.path.join(staging, METADATA), buf.getvalue())
        # Which rank files make the checkpoint, and a checksum of each manifest and of
        # .metadata: a missing or swapped file is found, not just a damaged one.
        files = sorted({info.relative_path for info in storage_md.values()})
        for name, data in self.extra_files.items():
            commit.write_durably(os.path.join(staging, name), data)
        doc = {"format": FORMAT, "metadata_crc32c": f"{_native.crc32c(buf.getvalue()):08x}", "files": {
            name: f"{_native.crc32c(_read_small(os.path.join(staging, name + MANIFEST_SUFFIX))):08x}"
            for name in files}, "extra_files": {name: f"{_native.crc32c(data):08x}"
                                                for name, data in sorted(self.extra_files.items())}}
        _write_json(os.path.join(staging, DIR_MANIFEST), doc)
        commit.publish_dir(staging, self.path)
        # written and synced file by file, then the directory renamed and synced: all of it
        # is the commit's sync time
        self.stats["finish_seconds"] = time.perf_counter() - t0


def _read_regular(path: str, limit: int) -> bytes:
    """A regular file's first ``limit`` bytes, never through a symlink or from a FIFO."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(21, "not a regular file", path)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _read_small(path: str, limit: int = 64 << 20) -> bytes:
    """The first ``limit`` bytes of ``path`` (-1: all of it)."""
    with open(path, "rb") as f:
        return f.read(limit)


def _write_json(path: str, doc: dict) -> None:
    commit.write_durably(path, json.dumps(doc, separators=(",", ":")).encode())


# ---------------------------------------------------------------- reading


class FastPersistReader(StorageReader):
    """A DCP ``StorageReader`` that reads each rank's file with the native reader; with
    ``verify=True`` every item is checked against its CRC-32C first. Reads directories
    written by stock DCP too: they carry no checksums, so ``verify=True`` loads them
    unchecked with a warning naming the directory (never calls them corrupt)."""

    def __init__(self, path: str | os.PathLike, verify: bool = False) -> None:
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.verify = verify
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.load_id = uuid.uuid4().hex
        self._stock: bool | None = None  # written by stock DCP (no directory manifest)? found once

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.load_id = uuid.uuid4().hex
        self._stock = None

    def _checks(self) -> bool:
        """Whether items are checked: ``verify``, on a directory FastPersist wrote. A stock
        DCP directory has nothing to check against: it is read, and the caller warned once."""
        if not self.verify:
            return False
        if self._stock is None:
            self._stock = not os.path.lexists(os.path.join(self.path, DIR_MANIFEST))
            if self._stock:
                warnings.warn(f"{self.path} was written by stock torch.distributed.checkpoint (it has no "
                              f"{DIR_MANIFEST}): it carries no checksums, so it is loaded unchecked", stacklevel=3)
        return not self._stock

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        from ..paths import is_remote

        return not is_remote(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(self.path, METADATA)
        raw = _read_small(path, -1)  # whole, as pickle.load read it: DCP's format sets no size cap
        if self._checks():  # its offsets decide what every read fetches: checked before it is believed
            _check_metadata(self.path, raw)
        try:
            md = pickle.loads(raw)  # DCP's own format (stock FileSystemReader does the same)
        except Exception:
            _check_metadata(self.path, raw)  # a damaged .metadata is named as such
            raise
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        verify = self._checks()
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            path = os.path.join(self.path, rel)
            # A FastPersist rank file's manifest says where each tensor's bytes are: a
            # request for a whole tensor is read straight into its target (one copy at
            # most, no torch.load of the blob). Stock files, and other requests, take the
            # general path.
            items = {} if not (verify or os.path.exists(path + MANIFEST_SUFFIX)) else {
                (it["offset"], it["length"]): it for it in _read_manifest(path)["items"]}
            crcs = {k: (it["fqn"], it["crc32c"]) for k, it in items.items()} if verify else {}
            # DCP's own planners hand out the state's tensors and commit nothing: their targets
            # are read together, after the rest. Another planner's are read and committed
            # one by one, in order (its resolve_tensor may reuse one buffer).
            together = _plain_planner(planner)
            with CheckpointFile(path, checkpoint=False) as cf, cf.native_reader() as reader:
                direct: list[tuple[Any, torch.Tensor, dict]] = []
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    if info.offset + info.length > cf.size:
                        raise CorruptCheckpointError(path, req.storage_index.fqn, f"item of {info.length} bytes at "
                                                     f"{info.offset} runs past the end of the {cf.size}-byte file")
                    it = items.get((info.offset, info.length))
                    target = None if req.type == LoadItemType.BYTE_IO else _direct_target(req, planner, it)
                    if target is not None and together:
                        direct.append((req, target, it))
                        continue
                    if target is not None:
                        _read_direct(reader, path, [(req, target, it)], verify)
                        planner.commit_tensor(req, target)
                        continue
                    buf = np.empty(info.length, dtype=np.uint8)
                    crc = reader.read_into(info.offset, buf.ctypes.data, info.length, checksum=verify,
                                           threads=read_depth.THREADS, chunk_bytes=read_depth.CHUNK)
                    if verify:
                        _check_item(path, req.storage_index.fqn, info.offset, info.length, crc, crcs)
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(buf.tobytes()))
                        continue
                    tensor = torch.load(io.BytesIO(memoryview(buf)), map_location="cpu", weights_only=True)
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise CorruptCheckpointError(path, req.storage_index.fqn,
                                                     f"holds {tuple(tensor.size())}, expected {tuple(target.size())}")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
                # targets sharing memory (tied weights) are filled one after another, in
                # order, as before: the last one read wins, not a mix of the two
                first, rest = _apart(direct)
                _read_direct(reader, path, first, verify)
                for one in rest:
                    _read_direct(reader, path, [one], verify)
            for req, target, _ in direct:
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _plain_planner(planner: LoadPlanner) -> bool:
    """Whether ``planner`` resolves and commits tensors as DCP's default planner does."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    t = type(planner)
    return (isinstance(planner, DefaultLoadPlanner) and t.resolve_tensor is DefaultLoadPlanner.resolve_tensor
            and t.commit_tensor is DefaultLoadPlanner.commit_tensor)


def _apart(batch: list[tuple[Any, torch.Tensor, dict]]) -> tuple[list, list]:
    """``batch`` split into targets whose memory no other shares, with the first of each
    group that does (one scatter read fills them at once), and the others, in order."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, i) for i, (_, t, _) in enumerate(batch) if t.nbytes)
    later: set[int] = set()
    group: list[int] = []
    end = -1
    for lo, hi, i in spans + [(1 << 64, 1 << 64, -1)]:
        if lo >= end:  # a new group: the one before keeps its first (in request order)
            later.update(sorted(group)[1:])
            group, end = [], hi
        group.append(i)
        end = max(end, hi)
    return ([b for i, b in enumerate(batch) if i not in later],
            [b for i, b in enumerate(batch) if i in later])


def _direct_target(req: Any, planner: LoadPlanner, it: dict | None) -> torch.Tensor | None:
    """The target a whole saved tensor's bytes can be read straight into; None when this
    request cannot be (no record of the bytes, a slice, another dtype or shape, a target
    that is not contiguous CPU memory)."""
    if it is None or "data" not in it:
        return None
    target = planner.resolve_tensor(req).detach()
    shape = tuple(it["shape"])
    if (target.device.type != "cpu" or not target.is_contiguous() or target.dtype != it["dtype"]
            or tuple(target.shape) != shape or tuple(req.lengths) != shape or any(req.storage_offsets)):
        return None
    return target


def _read_direct(reader: Any, path: str, batch: list[tuple[Any, torch.Tensor, dict]], verify: bool) -> None:
    """Read every tensor of ``batch`` ((request, target, manifest item), in file order)
    straight into its target, in one scatter read (:func:`read_depth.scatter`): a rank file
    of thousands of small tensors costs a few requests of ~2 MiB, not a device round trip
    each. ``verify``: each whole item is checked, the blob's own bytes around the tensor's
    (a few hundred: torch.save's header and directory) read for its checksum."""
    spans: list[tuple[int, int, int]] = []
    keep: list[np.ndarray] = []  # the head and tail buffers, alive until the read returns
    for _, target, it in batch:
        off, n = it["data"]
        if verify:
            head = np.empty(off - it["offset"], dtype=np.uint8)
            tail = np.empty(it["offset"] + it["length"] - off - n, dtype=np.uint8)
            keep += [head, tail]
            spans += [(it["offset"], head.ctypes.data, head.size), (off, target.data_ptr(), n),
                      (off + n, tail.ctypes.data, tail.size)]
        else:
            spans.append((off, target.data_ptr(), n))
    crcs = read_depth.scatter(reader, spans, verify)
    if not verify:
        return
    for k, (req, _, it) in enumerate(batch):
        head_crc, data_crc, tail_crc = crcs[3 * k: 3 * k + 3]
        crc = _native.crc32c_combine(_native.crc32c_combine(head_crc, data_crc, spans[3 * k + 1][2]), tail_crc,
                                     spans[3 * k + 2][2])
        if crc != it["crc32c"]:
            fqn = req.storage_index.fqn
            raise CorruptCheckpointError(path, fqn, f"CRC-32C {crc:08x}, expected {it['crc32c']:08x}", tensor=fqn)


def _check_item(path: str, fqn: str, offset: int, length: int, crc: int, crcs: dict) -> None:
    want = crcs.get((offset, length))
    if want is None:
        raise CorruptCheckpointError(path, fqn, f"no checksum recorded for the item at {offset} ({length} bytes)",
                                     tensor=fqn)
    if crc != want[1]:
        raise CorruptCheckpointError(path, fqn, f"CRC-32C {crc:08x}, expected {want[1]:08x}", tensor=fqn)


def _read_manifest(data_file: str) -> dict:
    """A rank file's manifest, every field checked (it is untrusted input)."""
    mpath = data_file + MANIFEST_SUFFIX
    try:
        with open(mpath, "rb") as f:
            raw = f.read(64 << 20)
        doc = json.loads(raw)
    except FileNotFoundError:
        raise CorruptCheckpointError(data_file, MANIFEST_SUFFIX, "its FastPersist manifest is missing") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(data_file, MANIFEST_SUFFIX, f"manifest does not parse: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("items"), list):
        raise CorruptCheckpointError(data_file, MANIFEST_SUFFIX, "not a FastPersist DCP manifest")
    size = doc.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise CorruptCheckpointError(data_file, MANIFEST_SUFFIX, f"size {size!r}")
    end, items = 0, []
    for it in doc["items"]:
        ok = isinstance(it, dict) and isinstance(it.get("fqn"), str) and all(
            isinstance(it.get(k), int) and not isinstance(it.get(k), bool) and it[k] >= 0 for k in ("offset", "length"))
        crc = it.get("crc32c") if ok else None
        if not ok or not isinstance(crc, str) or len(crc) != 8 or any(c not in "0123456789abcdef" for c in crc):
            raise CorruptCheckpointError(data_file, MANIFEST_SUFFIX, f"item {str(it)[:80]} is malformed")
        if it["offset"] < end or it["offset"] + it["length"] > size:
            raise CorruptCheckpointError(data_file, MANIFEST_SUFFIX, f"item {it['fqn']} at {it['offset']} overlaps "
                                         "the one before it or runs past the file")
        end = it["offset"] + it["length"]
        items.append({**it, "crc32c": int(crc, 16), **_data_fields(data_file, it)})
    return {**doc, "items": items}


def _extra_files(d: str) -> dict[str, int]:
    """``{extra file: CRC-32C}`` of a FastPersist DCP directory (Lightning's ``meta.pt``)."""
    path = os.path.join(d, DIR_MANIFEST)
    try:
        extra = json.loads(_read_small(path)).get("extra_files", {})
        table = {name: int(crc, 16) for name, crc in extra.items()}
    except (ValueError, UnicodeDecodeError, RecursionError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(path, DIR_MANIFEST, f"extra_files does not parse: {type(e).__name__}: {e}") \
            from None
    try:
        check_extra_files({name: b"" for name in table})
    except ValueError as e:
        raise CorruptCheckpointError(path, DIR_MANIFEST, str(e)) from None
    return table


# torch's dtypes by the names the manifest uses: a name from a file is looked up here, never
# with getattr on the torch module (which imports submodules by name).
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _uints(v: Any, n: int | None) -> bool:
    return isinstance(v, list) and (n is None or len(v) == n) and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in v)


def _data_fields(data_file: str, it: dict) -> dict:
    """A tensor item's storage bytes as the manifest records them, checked: ``data`` (offset,
    length) inside the item, its CRC, dtype and shape; {} when the item has none."""
    if "data" not in it:
        return {}
    data, crc, dtype, shape = it.get("data"), it.get("data_crc32c"), it.get("dtype"), it.get("shape")
    ok = (_uints(data, 2) and _uints(shape, None) and len(shape) <= 64 and isinstance(dtype, str)
          and dtype in _DTYPES and isinstance(crc, str) and len(crc) == 8
          and all(c in "0123456789abcdef" for c in crc))
    if ok:
        itemsize = _DTYPES[dtype].itemsize
        ok = (it["offset"] <= data[0] and data[0] + data[1] <= it["offset"] + it["length"]
              and data[1] == math.prod(shape) * itemsize)
    if not ok:
        raise CorruptCheckpointError(data_file, MANIFEST_SUFFIX, f"item {str(it.get('fqn'))[:80]}: its data fields "
                                     "are malformed")
    return {"data": tuple(data), "data_crc32c": int(crc, 16), "dtype": _DTYPES[dtype], "shape": tuple(shape)}


def _dir_manifest(d: str) -> dict[str, int]:
    """``{rank file: CRC-32C of its manifest}`` of a FastPersist DCP directory, with
    ``.metadata`` checked against its CRC; raises for a directory FastPersist did not write
    (:class:`NotAFastPersistCheckpoint`) or a damaged one."""
    table, meta_crc = _read_dir_manifest(d)
    try:
        meta = _read_small(os.path.join(d, METADATA), -1)  # whole: a cap would call a large one damaged
    except FileNotFoundError:
        raise CorruptCheckpointError(d, METADATA, "the checkpoint directory has no .metadata") from None
    if _native.crc32c(meta) != meta_crc:
        raise CorruptCheckpointError(os.path.join(d, METADATA), METADATA, "CRC-32C does not match")
    return table


def _read_dir_manifest(d: str) -> tuple[dict[str, int], int]:
    """``({rank file: CRC-32C of its manifest}, CRC-32C of .metadata)`` from a FastPersist
    DCP directory's manifest, checked to parse (:class:`NotAFastPersistCheckpoint` where
    there is none)."""
    path = os.path.join(d, DIR_MANIFEST)
    try:
        raw = _read_small(path)
    except FileNotFoundError:
        if os.path.isfile(os.path.join(d, METADATA)):
            raise NotAFastPersistCheckpoint(f"{d} is a torch.distributed.checkpoint directory FastPersist did "
                                            f"not write (no {DIR_MANIFEST})") from None
        raise NotAFastPersistCheckpoint(f"{d} is a directory, not a checkpoint") from None
    try:
        doc = json.loads(raw)
        files = doc["files"]
        meta_crc = int(doc["metadata_crc32c"], 16)
        table = {name: int(crc, 16) for name, crc in files.items()}
    except (ValueError, UnicodeDecodeError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(path, DIR_MANIFEST, f"does not parse: {type(e).__name__}: {e}") from None
    if doc.get("format") != FORMAT or not all(
            isinstance(n, str) and n.endswith(DATA_SUFFIX) and "/" not in n and not n.startswith(".") for n in table):
        raise CorruptCheckpointError(path, DIR_MANIFEST, "not a FastPersist DCP directory manifest")
    return table, meta_crc


def _check_metadata(d: str, raw: bytes) -> None:
    """``raw`` (the bytes of ``d``'s .metadata) against the CRC-32C its FastPersist directory
    manifest recorded; nothing to check for a directory stock DCP wrote."""
    try:
        _, want = _read_dir_manifest(d)
    except NotAFastPersistCheckpoint:
        return
    if _native.crc32c(raw) != want:
        raise CorruptCheckpointError(os.path.join(d, METADATA), METADATA, "CRC-32C does not match")


def verify_dir(path: str | os.PathLike) -> dict:
    """Check every rank file of a FastPersist DCP directory, and every item in it, against
    the checksums recorded at save time; raise :class:`CorruptCheckpointError` naming the
    rank file and the FQN of a damaged item (or the file that is missing). A directory
    that is not DCP's (no ``.metadata``: the HF Trainer's ``checkpoint-N``) is verified
    file by file (:func:`fp_core.loading.checkpoint_dir.verify_dir`)."""
    t0 = time.perf_counter()
    d = os.fspath(path)
    if not _is_dcp_dir(d):
        from ..loading import checkpoint_dir

        return checkpoint_dir.verify_dir(d, verify_dir)
    table = _dir_manifest(d)
    nbytes = nitems = 0
    for name, manifest_crc in sorted(table.items()):
        path = os.path.join(d, name)
        try:
            if _native.crc32c(_read_small(path + MANIFEST_SUFFIX)) != manifest_crc:
                raise CorruptCheckpointError(path, MANIFEST_SUFFIX, "its manifest's CRC-32C does not match")
        except FileNotFoundError:
            raise CorruptCheckpointError(path, MANIFEST_SUFFIX, "the rank file's manifest is missing") from None
        doc = _read_manifest(path)
        try:
            cf = CheckpointFile(path, checkpoint=False)
        except FileNotFoundError:
            raise CorruptCheckpointError(path, "<file>", "the rank file is missing") from None
        with cf:
            if cf.size != doc["size"]:
                raise CorruptCheckpointError(path, "<file>", f"file is {cf.size} bytes, manifest says {doc['size']}")
            items = doc["items"]  # in file order (_read_manifest checks it)
            for it, crc in zip(items, cf.crcs_of_ranges([(it["offset"], it["length"]) for it in items], "items")):
                if crc != it["crc32c"]:
                    raise CorruptCheckpointError(path, it["fqn"], f"CRC-32C {crc:08x}, expected "
                                                 f"{it['crc32c']:08x}", tensor=it["fqn"])
        nbytes += doc["size"]
        nitems += len(doc["items"])
    extra = verify_extra_files(d)
    nbytes += sum(extra.values())
    nitems += len(extra)
    return {"path": d, "files": len(table) + len(extra), "records": nitems, "bytes": nbytes, "seconds": time.perf_counter() - t0}


def verify_extra_files(path: str | os.PathLike) -> dict[str, int]:
    """Check the extra files of a FastPersist DCP directory (Lightning's ``meta.pt``) against
    their checksums; return ``{name: size}``."""
    d = os.fspath(path)
    sizes = {}
    for name, want in sorted(_extra_files(d).items()):
        p = os.path.join(d, name)
        try:
            data = _read_regular(p, 1 << 30)
        except FileNotFoundError:
            raise CorruptCheckpointError(p, name, "a file of the checkpoint is missing") from None
        except OSError as e:  # a symlink (ELOOP), a FIFO or a directory where a file belongs
            raise CorruptCheckpointError(p, name, f"not a regular file: {e.strerror or e}") from None
        if _native.crc32c(data) != want:
            raise CorruptCheckpointError(p, name, f"CRC-32C {_native.crc32c(data):08x}, expected {want:08x}")
        sizes[name] = len(data)
    return sizes


def inspect_dir(path: str | os.PathLike) -> list[dict]:
    """Every item of every rank file: file, FQN, kind, offset, size, checksum (a directory
    that is not DCP's: every checkpoint file's records, :func:`fp_core.loading.checkpoint_dir.inspect_dir`)."""
    d = os.fspath(path)
    if not _is_dcp_dir(d):
        from ..loading import checkpoint_dir

        return checkpoint_dir.inspect_dir(d, inspect_dir)
    rows = []
    for name in sorted(_dir_manifest(d)):
        for it in _read_manifest(os.path.join(d, name))["items"]:
            rows.append({"name": f"{name}:{it['fqn']}", "tensor": it["fqn"], "kind": it.get("kind"),
                         "offset": it["offset"], "size": it["length"], "crc32c": f"{it['crc32c']:08x}"})
    return rows


__all__ = ["FastPersistWriter", "FastPersistReader", "verify_dir", "verify_extra_files", "inspect_dir", "is_checkpoint_dir", "staging_path",
           "record_ready", "device_work_after"]
