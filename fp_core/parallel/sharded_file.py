"""One ``torch.save`` file written by every rank of a sharded state at once (``layout="file"``).

A state holding DTensors (FSDP2's ``Shard(0)``, HSDP's ``Replicate()`` x ``Shard(0)``) is
saved as the file ``torch.save`` would write for its *full* state dict (what
``get_state_dict(..., options=StateDictOptions(full_state_dict=True))`` returns): every
DTensor a plain tensor of its global shape, under the same keys. No rank gathers anything:

- The layout comes from metadata alone. Each DTensor is replaced by a plain CPU tensor of
  its global shape and dtype over a read-only anonymous mapping (address space, no
  memory), and that state's skeleton is captured as every save's is (``skeleton.py``,
  ``plan.py``), identical on every rank, which the ranks check by hash.
- A ``Shard(0)`` local shard of a row-major tensor is one contiguous byte range of the full
  tensor's storage: its owner writes it there, from its own memory. Bytes held by several
  ranks (a tensor replicated over a mesh dimension, plain tensors, step counters) are split
  among their holders, byte-balanced (:func:`partition.split_extents`); a replicated tensor
  whose sampled bytes differ between its holders is written by the first of them.
- Each byte of the file has one writer. A block whose bytes all have the same writer is
  written with the native engine (O_DIRECT); the few blocks where two writers meet (a
  shard's first and last rows, a record's end before the next header) are written with
  plain ``pwrite`` through the page cache, each writer only its own bytes.
- The commit is the collective one (:class:`distributed.CollectiveSave`, whose steps this
  class defines): rank 0 makes the temp file, every rank writes and syncs, the per-piece
  CRC-32Cs fold into each storage's checksum on rank 0, which writes the tail and publishes;
  any rank's failure fails the save on every rank.

``format="safetensors"``: a flat ``{name: DTensor or tensor}`` dict (a model's state dict
under FSDP2's ``fully_shard``) is written the same way as one safetensors file of the full
tensors (:mod:`fp_core.format.safetensors_plan`'s layout, the caller's ``metadata`` in its header).
The header holds every tensor's CRC-32C, known only once the ranks' pieces combine: the
tensors start on a block after it, rank 0 writes it last, whole, with its checksums, then
the commit. A tensor under two names (tied weights) is refused on every rank before anything
is created; ``save_pretrained`` drops such duplicates itself, and so must the caller.

Other placements: a ``Shard(d)`` of a later dimension (tensor parallel) or a
``_StridedShard`` (FSDP2 over tensor parallel), on any mesh, is a product of index sets of
the full tensor, so its local shard is many runs of the full tensor's bytes
(:func:`shard_segments`: one per index of the dimensions before the last one it does not
hold whole). Each run is a piece like a ``Shard(0)`` shard's, with its own CRC-32C; blocks
where two ranks' runs meet go through the page cache as above, whole blocks stay O_DIRECT.
``Partial`` is refused on every rank before anything is created, naming the tensor, its
placement and ``layout="dcp"``: its values are partial sums, and writing them would need a
reduction.

FSDP1's ``ShardedTensor`` (``SHARDED_STATE_DICT``, its sharded optimizer state) is written
the same way, ``format="torch"``: a ``ChunkShardingSpec`` on dimension 0 gives each rank at
most one local shard of whole rows, one byte run of the full tensor, whose place comes from
the tensor's shard metadata (global on every rank, so every rank accepts or refuses alike).
Another spec, several shards on one rank, shards that are not whole rows or do not tile the
rows once are refused on every rank before anything is created, naming the tensor and
``layout="dcp"``.

A :class:`~fp_core.format.flat_shard.FlatShard` (a contiguous element range of a tensor's
flattened row-major form: how FSDP1's ``flat_param`` holds each original parameter and its
Adam state) is one byte run of the full tensor, written like a ``Shard(0)`` shard by the
rank that holds it. Its place is known only to its rank, so the ranks exchange their
ranges with the layout (metadata, in the collective's agreement step) and refuse on every
rank, naming the tensor, ranges that leave a gap or overlap: no byte is written, and rank
0's temp file goes. ``format="safetensors"`` does not take them.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import hashlib
import math
import mmap
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..format.flat_shard import FlatShard, tiling_problem
from ..format.plan import FilePlan, StorageExtent, align_down, align_up, from_skeleton, leaves, tensor_names
from ..format.safetensors_plan import _DTYPES, SafetensorsPlan, build_safetensors
from ..format.shard_layout import global_indices, shard_segments
from ..format.skeleton import capture
from ..io.engine import EngineOptions
from ..io.writer import PieceCrc, RangeStats, combine_piece_crcs, finish_tail, write_range
from ..saving.local import MIN_ALIGNMENT
from ..sharded import dtensor_type, map_containers, sharded_tensor_type
from . import fsdp1_flat  # re-exported: FSDP1's full state as FlatShards, for the integrations
from .distributed import DEFAULT_TIMEOUT_S, CollectiveSave, CollectiveSaveError, _sample_crc
from .partition import split_extents

# A block-aligned run of at least this many bytes that one rank alone writes goes through
# the native engine (O_DIRECT); a shorter one through the page cache (see _write_share).
DIRECT_RUN_BYTES = 1 << 20


class UnsupportedPlacementError(ValueError):
    """A DTensor whose placement cannot be written into one file by its owners."""


@dataclass
class _Held:
    """Bytes of one storage record this rank holds: ``[start, start + length)`` of the
    record, at ``offset`` in the file, from ``source`` (a flat uint8 tensor of exactly
    them); ``holders`` are the coordination-group ranks holding the same bytes, in order,
    this rank being ``holders[index]``."""

    record: int
    start: int
    offset: int
    length: int
    source: torch.Tensor
    holders: tuple[int, ...]
    index: int
    # This piece's extent in the job's plan: the async pipeline may give it a snapshot
    # copy (``host``), which is then what is written, not the live ``source``.
    extent: StorageExtent | None = None

    @property
    def data(self) -> torch.Tensor:
        """The bytes to write: the extent's snapshot copy when there is one, else the source."""
        return self.extent.data if self.extent is not None else self.source


def _walk_dtensors(obj: Any, kind: type) -> list[tuple[str, Any]]:
    """(path, DTensor) of every DTensor in ``obj``'s dicts, lists and tuples."""
    return leaves(obj, lambda o: isinstance(o, kind))


def _sharded_kinds() -> tuple[type, ...]:
    """The sharded tensor types a state may hold now (DTensor, ShardedTensor, FlatShard)."""
    return tuple(t for t in (dtensor_type(), sharded_tensor_type()) if t is not None) + (FlatShard,)


def _global_meta(t: Any) -> tuple[torch.Size, torch.dtype, bool]:
    """The global shape, dtype and requires_grad of a DTensor or ShardedTensor. A
    ShardedTensor's come from its metadata: its ``__torch_function__`` refuses most
    tensor methods."""
    if isinstance(t, FlatShard):
        return t.global_shape, t.dtype, False
    kind = sharded_tensor_type()
    if kind is not None and isinstance(t, kind):
        md = t.metadata()
        return torch.Size(md.size), md.tensor_properties.dtype, bool(md.tensor_properties.requires_grad)
    return t.shape, t.dtype, t.requires_grad


def _sharded_tensor_problem(st: Any, members: set[int]) -> str | None:
    """Why a ShardedTensor's shards are not one shard of whole rows per rank tiling its
    rows once, owned by ``members`` (None: they are)."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    md = st.metadata()
    size = tuple(md.size)
    spec = st.sharding_spec()
    if not isinstance(spec, ChunkShardingSpec) or not size or spec.dim not in (0, -len(size)):
        return f"is sharded by {spec!r}"
    owners: set[int] = set()
    rows: list[tuple[int, int]] = []
    for sm in md.shards_metadata:
        r = sm.placement.rank()
        if r in owners:
            return f"has several shards on rank {r}"
        owners.add(r)
        if any(sm.shard_offsets[1:]) or tuple(sm.shard_sizes[1:]) != size[1:]:
            return f"has a shard that is not whole rows (offsets {list(sm.shard_offsets)}, sizes {list(sm.shard_sizes)})"
        if sm.shard_sizes[0]:
            if r not in members:
                return f"has a shard on rank {r}, outside the save's group (ranks {sorted(members)})"
            rows.append((sm.shard_offsets[0], sm.shard_sizes[0]))
    at = 0
    for first, n in sorted(rows):
        if first != at:
            return f"has shards whose rows do not tile [0, {size[0]}) once (a shard at row {first} after row {at})"
        at = first + n
    if at != size[0]:
        return f"has shards covering rows [0, {at}) of {size[0]}"
    return None


def check_sharded_tensors(obj: Any, group: Any = None) -> None:
    """Refuse a state any of whose ShardedTensors cannot be written as whole rows by their
    owners (see the module's docstring), naming the first such tensor. Every non-empty
    shard must be owned by a rank of ``group`` (the save's; None: every rank)."""
    kind = sharded_tensor_type()
    found = leaves(obj, lambda o: isinstance(o, kind)) if kind is not None else []
    if not found or not dist.is_initialized():  # no ShardedTensor, or the save refuses itself
        return
    members = set(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    for path, st in found:
        why = _sharded_tensor_problem(st, members)
        if why is not None:
            raise UnsupportedPlacementError(
                f"{path}: a ShardedTensor of shape {tuple(st.metadata().size)} {why}: layout=\"file\" takes a "
                "ChunkShardingSpec on dimension 0, one shard of whole rows per rank; save this state with "
                "layout=\"dcp\"")


def check_placements(obj: Any) -> None:
    """Refuse a state any of whose DTensors is placed other than ``Shard(d)``,
    ``_StridedShard`` or ``Replicate()`` on each mesh dimension (``Partial``: its values
    are partial sums, a write would need a reduction), naming the first such tensor."""
    kind = dtensor_type()
    if kind is None:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for path, dt in _walk_dtensors(obj, kind):
        for p in dt.placements:
            ok = isinstance(p, Replicate) or (isinstance(p, (Shard, _StridedShard)) and 0 <= p.dim < dt.ndim)
            if not ok:
                raise UnsupportedPlacementError(
                    f"{path}: a DTensor placed {p!r} (placements {tuple(dt.placements)}) cannot be written into one "
                    "file by its ranks: layout=\"file\" takes Shard(d), _StridedShard and Replicate(); save this "
                    "state with layout=\"dcp\"")


def check_safetensors_state(obj: Any) -> None:
    """Refuse, before anything is created, a state that cannot be one safetensors file: not
    a flat ``{str: tensor or DTensor}`` dict, a dtype safetensors cannot store, or one
    tensor under two names (tied weights: ``save_pretrained`` drops the duplicate itself)."""
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in obj.items()):
        raise TypeError("format=\"safetensors\" takes a flat dict of {str: tensor or DTensor}")
    kind = dtensor_type()
    seen: dict[Any, str] = {}
    for name, v in obj.items():
        if v.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {v.dtype}, which safetensors cannot store")
        # A module's state_dict() detaches each parameter: tied ones are two DTensor objects
        # over one local storage, found by that storage on every rank alike, an empty local
        # shard included (a plain tensor by its memory, as the single-process writer does).
        if kind is not None and isinstance(v, kind):
            local = v.to_local()
            key: Any = ("dtensor", local.untyped_storage()._cdata, local.storage_offset(), tuple(local.shape))
        elif v.numel() and v.is_contiguous():
            key = (v.device, v.data_ptr())
        else:
            continue
        if key in seen:
            raise ValueError(f"tensors {seen[key]!r} and {name!r} are one tensor (tied weights?); safetensors "
                             "stores each tensor once: drop the duplicate, as save_pretrained does")
        seen[key] = name


class _TailNames:
    """What the collective commit asks of a safetensors file's tail plan: its size and, by
    record number, the tensors' names (a torch file's manifest gives both)."""

    def __init__(self, file_size: int, names: list[str]) -> None:
        self.file_size = file_size
        self.manifest = self
        self.records = [_Name(n) for n in names]


@dataclass
class _Name:
    name: str


class Placeholders:
    """Plain CPU tensors of given shapes and dtypes that hold no memory: views of one
    read-only anonymous mapping (address space only; nothing ever reads it), each on a
    storage of its own, as the full tensors would be."""

    def __init__(self, sizes: list[int]) -> None:
        self.offsets, total = [], 0
        for n in sizes:
            self.offsets.append(total)
            total += align_up(n, 64) if n else 0
        self.map = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
        self.view = memoryview(self.map)

    def tensor(self, i: int, shape: torch.Size, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # read-only on purpose: its bytes are never read
            warnings.simplefilter("ignore")
            raw = torch.frombuffer(self.view[self.offsets[i]:self.offsets[i] + nbytes], dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)


class ShardedFileSave(CollectiveSave):
    """The save of a DTensor state as one ``torch.save`` file, by every rank of ``group``
    (a SaveJob; see the module's docstring)."""

    def __init__(self, obj: Any, path: str | os.PathLike, group: Any = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, options: EngineOptions | None = None,
                 format: str = "torch", metadata: dict[str, str] | None = None) -> None:
        if format not in ("torch", "safetensors"):
            raise ValueError(f"layout=\"file\" writes format 'torch' or 'safetensors', not {format!r}")
        # every rank refuses the same state: nothing is created
        if format == "safetensors":
            kind = sharded_tensor_type()
            if kind is not None and leaves(obj, lambda o: isinstance(o, kind)):
                raise ValueError(f"{os.fspath(path)}: ShardedTensor (FSDP1) state with layout=\"file\" is written "
                                 "as format='torch'")
            if leaves(obj, lambda o: isinstance(o, FlatShard)):
                raise ValueError(f"{os.fspath(path)}: FlatShard state with layout=\"file\" is written as "
                                 "format='torch'")
            check_safetensors_state(obj)
        check_placements(obj)
        check_sharded_tensors(obj, group)
        self.format, self.metadata = format, metadata
        self.full: FilePlan | None = None
        self._names: list[str] = []  # record number -> name (a torch record's, a safetensors tensor's)
        self.held: list[_Held] = []
        # record number -> (path, element size) of each FlatShard's storage: its ranks' ranges
        # are checked together before anything is written (_agree)
        self._flat: dict[int, tuple[str, int]] = {}
        self.layout_hash = ""
        self._runs: list[tuple[int, int]] = []  # block-aligned ranges this rank alone writes
        self._partial: list[tuple[int, int]] = []  # its bytes in blocks it shares with others
        self._fd: int | None = None
        self._buffered_bytes = 0
        super().__init__(obj, path, group, topology="replica", timeout_s=timeout_s,
                         options=options or EngineOptions())

    # -- planning (the caller's thread) ----------------------------------------------

    def _build(self, obj: Any) -> FilePlan:
        if self.format == "safetensors":
            full, owner = self._full_safetensors(obj)
        else:
            full, owner = self._full_torch(obj)
        self.full = full
        cg_ranks = dist.get_process_group_ranks(self.cg)
        everyone = tuple(range(len(cg_ranks)))
        me = dist.get_rank(self.cg)
        for s in full.storages:
            hit = owner(s)
            if hit is None:  # a plain tensor: every rank holds it (replicated)
                self.held.append(_Held(s.record, 0, s.offset, s.length, s.source, everyone, me))
                continue
            path, dt = hit
            if isinstance(dt, FlatShard):
                self._flat[s.record] = (path, dt.dtype.itemsize)
            segments, source, holders, index = self._local_bytes(path, dt, cg_ranks)
            for start, at, n in segments:
                self.held.append(_Held(s.record, start, s.offset + start, n, source[at:at + n], holders, index))
        h = hashlib.sha256(f"{self.format} {full.file_size} {full.manifest_header_offset}".encode())
        for off, data in full.skeleton.segments():
            h.update(f"{off}:{len(data)}:".encode())
            h.update(data)
        for s in full.storages:
            h.update(f"{self._names[s.record]} {s.offset} {s.length};".encode())
        self.layout_hash = h.hexdigest()
        return self._plan_of_held()

    def _plan_of_held(self) -> FilePlan:
        """The job's plan: the full file's layout, with this rank's pieces as its storages."""
        full = self.full
        assert full is not None
        extents = []
        for x in self.held:
            x.extent = StorageExtent(x.offset, x.length, x.source, x.record, record_start=x.start)
            extents.append(x.extent)
        return FilePlan(file_size=full.file_size, alignment=full.alignment, skeleton=full.skeleton,
                        storages=sorted(extents, key=lambda e: e.offset), manifest=full.manifest,
                        manifest_header_offset=full.manifest_header_offset, manifest_offset=full.manifest_offset,
                        manifest_size=full.manifest_size, manifest_central_entry=full.manifest_central_entry)

    # -- run by another process (the writer process, fp_core.pipeline.process_writer) ----------

    def wire(self) -> dict:
        """What a writer process needs to run this save once every piece's bytes are in its
        arena, each at its offset in the file: the full file's layout without tensors, and
        this rank's pieces (which rank holds which bytes)."""
        assert self.full is not None
        empty = torch.empty(0, dtype=torch.uint8)
        full = dataclasses.replace(self.full, cut=None, storages=[
            StorageExtent(s.offset, s.length, empty, s.record, record_start=s.record_start)
            for s in self.full.storages])
        return {"format": self.format, "metadata": self.metadata, "full": full, "names": self._names,
                "layout_hash": self.layout_hash, "flat": self._flat,
                "held": [(x.record, x.start, x.offset, x.length, x.holders, x.index) for x in self.held]}

    @classmethod
    def from_wire(cls, wire: dict, arena: torch.Tensor, path: str | os.PathLike, *, cg: Any,
                  options: EngineOptions) -> ShardedFileSave:
        """The save of :meth:`wire`, each piece read from ``arena`` (a flat uint8 view of
        the file's size) at its offset, coordinated over ``cg`` (the writers' group)."""
        self = cls.from_plan(None, path, plan_error=None, cg=cg, topology="replica", options=options)
        self.format, self.metadata = wire["format"], wire["metadata"]
        self.full, self._names, self.layout_hash = wire["full"], wire["names"], wire["layout_hash"]
        self._flat = wire["flat"]
        self.held = [_Held(rec, start, off, n, arena[off:off + n], tuple(holders), index)
                     for rec, start, off, n, holders, index in wire["held"]]
        self._runs, self._partial, self._fd, self._buffered_bytes = [], [], None, 0
        self.plan = self._plan_of_held()
        return self

    def _full_torch(self, obj: Any) -> tuple[FilePlan, Callable[[StorageExtent], Any]]:
        """The plan of the full state's ``torch.save`` file, and which DTensor (its path)
        each of its storages stands for (None: a plain tensor)."""
        kind = _sharded_kinds()
        found = _walk_dtensors(obj, kind) if kind else []
        unique: dict[int, tuple[str, Any]] = {}
        for path, dt in found:
            unique.setdefault(id(dt), (path, dt))
        dtensors = list(unique.values())
        metas = [_global_meta(dt) for _, dt in dtensors]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype, _ in metas]
        holes = Placeholders(sizes)
        stand_in: dict[int, torch.Tensor] = {}
        for i, ((_, dt), (shape, dtype, grad), n) in enumerate(zip(dtensors, metas, sizes)):
            t = holes.tensor(i, shape, dtype, n)
            if grad:
                t.requires_grad_(True)
            stand_in[id(dt)] = t

        def replace(o: Any) -> Any:
            if kind and isinstance(o, kind):
                return stand_in[id(o)]
            if isinstance(o, (dict, list, tuple)):
                return map_containers(o, replace)
            return o

        full_state = replace(obj)
        names: dict[int, tuple[str, str]] = {}
        # Storages always on blocks (no plain 64-byte packing): shares then meet in few blocks.
        sparse, storages_by_key = capture(full_state, MIN_ALIGNMENT, names=names, plain_alignment=None)
        if not names:
            names = tensor_names(full_state)
        full = from_skeleton(sparse, storages_by_key, names, MIN_ALIGNMENT)
        self._names = [r.name for r in full.manifest.records]
        by_storage = {stand_in[id(dt)].untyped_storage()._cdata: (path, dt) for path, dt in dtensors}

        def owner(s: StorageExtent) -> Any:
            storage = s._source  # the storage itself: plan.from_skeleton gives it undressed
            return by_storage.get(storage._cdata) if isinstance(storage, torch.UntypedStorage) else None

        return full, owner

    def _full_safetensors(self, obj: dict[str, Any]) -> tuple[SafetensorsPlan, Callable[[StorageExtent], Any]]:
        """The plan of the full state's safetensors file (its header's checksums zero until
        the tail), and which DTensor each tensor stands for (None: a plain tensor)."""
        kind = dtensor_type()
        items = list(obj.items())
        is_dt = [kind is not None and isinstance(v, kind) for _, v in items]
        sizes = [v.numel() * v.element_size() if d else 0 for (_, v), d in zip(items, is_dt)]
        holes = Placeholders(sizes)
        flat = {name: holes.tensor(i, v.shape, v.dtype, n) if d else v
                for i, ((name, v), d, n) in enumerate(zip(items, is_dt, sizes))}
        full = build_safetensors(flat, MIN_ALIGNMENT, self.metadata)
        self._names = [name for name, _ in items]  # build_safetensors numbers tensors in dict order

        def owner(s: StorageExtent) -> Any:
            return items[s.record] if is_dt[s.record] else None

        return full, owner

    def _local_bytes(self, path: str, dt: Any, cg_ranks: list[int]
                     ) -> tuple[list[tuple[int, int, int]], torch.Tensor, tuple[int, ...], int]:
        """Where this rank's local shard of ``dt`` lies in the full tensor's storage (its
        byte runs: full offset, local offset, length), its bytes, and the
        coordination-group ranks that hold the same shard."""
        if isinstance(dt, FlatShard):
            return self._flat_shard_bytes(path, dt)
        st_kind = sharded_tensor_type()
        if st_kind is not None and isinstance(dt, st_kind):
            return self._sharded_tensor_bytes(path, dt)
        from torch.distributed.tensor import Replicate

        mesh = dt.device_mesh
        ranks = mesh.mesh
        if sorted(ranks.flatten().tolist()) != sorted(cg_ranks):
            raise CollectiveSaveError(f"{path}: the DTensor's mesh (ranks {sorted(ranks.flatten().tolist())}) is not "
                                      f"the save's group (ranks {sorted(cg_ranks)}); save with layout=\"dcp\"")
        coord = mesh.get_coordinate()
        idx = global_indices(dt)
        local = dt.to_local()
        if tuple(local.shape) != tuple(len(i) for i in idx):
            raise CollectiveSaveError(f"{path}: the local shard has shape {tuple(local.shape)}, its placements "
                                      f"{tuple(dt.placements)} give {tuple(len(i) for i in idx)}")
        if not local.is_contiguous():  # FSDP2's shards are; another state's may not be
            local = local.contiguous()
        source = local.reshape(-1).view(torch.uint8) if local.numel() else torch.empty(0, dtype=torch.uint8)
        segments = shard_segments(tuple(dt.shape), idx, dt.element_size()) if local.numel() else []
        pick = tuple(slice(None) if isinstance(p, Replicate) else c for p, c in zip(dt.placements, coord))
        holders = [dist.get_group_rank(self.cg, g) for g in ranks[pick].flatten().tolist()]
        return segments, source, tuple(holders), holders.index(dist.get_rank(self.cg))

    def _sharded_tensor_bytes(self, path: str, st: Any
                              ) -> tuple[list[tuple[int, int, int]], torch.Tensor, tuple[int, ...], int]:
        """:meth:`_local_bytes` of a ShardedTensor that :func:`check_sharded_tensors` took:
        this rank's one shard of whole rows is one run, at its first row, held by it alone."""
        me = dist.get_rank(self.cg)
        empty = torch.empty(0, dtype=torch.uint8)
        md = st.metadata()
        size, dtype = tuple(md.size), md.tensor_properties.dtype
        mine = [sm for sm in md.shards_metadata if sm.placement.rank() == dist.get_rank() and sm.shard_sizes[0]]
        shards = [s.tensor for s in st.local_shards() if s.tensor.numel()]
        row = math.prod(size[1:]) * dtype.itemsize
        if not mine or not row:
            if shards:
                raise CollectiveSaveError(f"{path}: this rank holds a local shard that the ShardedTensor's metadata "
                                          "gives no rows")
            return [], empty, (me,), 0
        sm = mine[0]
        if len(shards) != 1 or tuple(shards[0].shape) != tuple(sm.shard_sizes) or shards[0].dtype != dtype:
            got = [(tuple(t.shape), t.dtype) for t in shards]
            raise CollectiveSaveError(f"{path}: the local shards {got} are not the metadata's one shard of "
                                      f"shape {tuple(sm.shard_sizes)}, {dtype}")
        local = shards[0] if shards[0].is_contiguous() else shards[0].contiguous()
        source = local.reshape(-1).view(torch.uint8)
        return [(sm.shard_offsets[0] * row, 0, sm.shard_sizes[0] * row)], source, (me,), 0

    def _flat_shard_bytes(self, path: str, fs: FlatShard
                          ) -> tuple[list[tuple[int, int, int]], torch.Tensor, tuple[int, ...], int]:
        """:meth:`_local_bytes` of a FlatShard: its elements are one run of the full tensor's
        bytes, at its first element, held by this rank alone (the ranks' ranges are checked
        to tile the tensor in :meth:`_agree`)."""
        me = dist.get_rank(self.cg)
        local = fs.local
        if not local.numel():
            return [], torch.empty(0, dtype=torch.uint8), (me,), 0
        if not local.is_contiguous():
            local = local.contiguous()
        size = fs.dtype.itemsize
        return [(fs.start * size, 0, local.numel() * size)], local.reshape(-1).view(torch.uint8), (me,), 0

    # -- the collective save's steps --------------------------------------------------

    def _table(self) -> Any:
        samples = {(self._names[x.record], x.start): _sample_crc(x.extent) for x in self.held if len(x.holders) > 1}
        # this rank's FlatShard ranges, in elements: only together do they say whether they tile
        flat = [(x.record, x.start // self._flat[x.record][1], x.length // self._flat[x.record][1])
                for x in self.held if x.record in self._flat]
        return self.layout_hash, samples, flat, sorted(self._flat)

    def _check_tiling(self, statuses: list[Any]) -> None:
        """Refuse, on every rank alike (each has every rank's ranges), FlatShards whose ranks'
        ranges do not cover their tensor exactly once, naming the first such tensor."""
        for r, st in enumerate(statuses):
            if st[2][3] != statuses[0][2][3]:
                names = sorted({self._names[i] for i in set(st[2][3]) ^ set(statuses[0][2][3])})
                raise CollectiveSaveError(
                    f"sharded save of {self.final}: rank {r} holds FlatShards of other tensors than rank 0 (storage "
                    f"records {names}): every rank must save the same state, with the same tensors as FlatShards")
        by_record: dict[int, list[tuple[int, int, int]]] = {r: [] for r in self._flat}
        for r, st in enumerate(statuses):
            for record, start, count in st[2][2]:
                by_record[record].append((r, start, count))
        storages = {s.record: s for s in self.full.storages}
        for record, (path, size) in sorted(self._flat.items()):
            numel = storages[record].length // size
            why = tiling_problem(numel, by_record[record])
            if why is not None:
                raise UnsupportedPlacementError(
                    f"sharded save of {self.final}: {path}: the ranks' FlatShards of this tensor of {numel} "
                    f"elements do not cover it exactly once: {why}; nothing was written")

    def _agree(self, statuses: list[Any], rank: int, world: int) -> list[int]:
        for r, st in enumerate(statuses):
            if st[2][0] != statuses[0][2][0]:
                raise CollectiveSaveError(
                    f"sharded save of {self.final}: rank {r} lays the file out unlike rank 0 (its keys, global "
                    "shapes, dtypes, placements or non-tensor values differ); every rank must save the same state")
        self._check_tiling(statuses)
        # The plan's storages are rebuilt as this rank's share; each piece's bytes come from
        # its extent's snapshot copy when the pipeline took one (the state as of save()).
        owned: list[StorageExtent] = []
        shared: dict[tuple[int, ...], list[_Held]] = {}
        for x in self.held:
            key = (self._names[x.record], x.start)
            if len(x.holders) == 1:
                owned.append(StorageExtent(x.offset, x.length, x.data, x.record, record_start=x.start))
            elif len({statuses[h][2][1].get(key) for h in x.holders}) > 1:
                if x.index == 0:  # holders disagree: the first one's bytes, whole
                    owned.append(StorageExtent(x.offset, x.length, x.data, x.record, record_start=x.start))
                    self.stats.extra["differing_storages"] = self.stats.extra.get("differing_storages", 0) + 1
            else:
                shared.setdefault(x.holders, []).append(x)
        for holders, xs in shared.items():
            xs.sort(key=lambda x: x.offset)
            me = xs[0].index
            mine = split_extents([(x.offset, x.length) for x in xs], len(holders), MIN_ALIGNMENT)[me]
            starts = [x.offset for x in xs]
            for off, n in mine:
                x = xs[bisect.bisect_right(starts, off) - 1]
                rel = off - x.offset
                owned.append(StorageExtent(off, n, x.data[rel:rel + n], x.record, record_start=x.start + rel))
        owned.sort(key=lambda e: e.offset)
        self.plan.storages = owned
        self._runs, self._partial = self._blocks(owned, rank)
        self.stats.extra["data_bytes"] = sum(e.length for e in owned)
        return list(range(world))

    def _blocks(self, owned: list[StorageExtent], rank: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This rank's bytes of the body (before the tail) as block-aligned ranges it alone
        writes, and the pieces of blocks it shares with another writer.

        The skeleton's bytes are written by the writer of the tensor byte just before them
        in their block (a record's end and the next record's header); bytes with no tensor
        byte before them in their block (whole blocks of headers, the pickle) by rank 0.
        """
        full = self.full
        end, b = full.manifest_header_offset, MIN_ALIGNMENT
        data_ends = [s.offset + s.length for s in full.storages]
        mine_ends = {s.offset + s.length for s in owned}
        pieces = [(s.offset, s.offset + s.length) for s in owned]
        for off, data in full.skeleton.segments():
            lo, hi = off, min(off + len(data), end)
            while lo < hi:
                stop = min(hi, align_down(lo, b) + b)
                after_data = lo % b and bisect.bisect_left(data_ends, lo) < len(data_ends) and \
                    data_ends[bisect.bisect_left(data_ends, lo)] == lo
                if (lo in mine_ends) if after_data else rank == 0:
                    pieces.append((lo, stop))
                lo = stop
        pieces.sort()
        runs: list[list[int]] = []
        for lo, hi in pieces:
            if runs and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        whole, partial = [], []
        for lo, hi in runs:
            a, z = align_up(lo, b), align_down(hi, b)
            if a < z:
                whole.append((a, z))
                if lo < a:
                    partial.append((lo, a))
                if z < hi:
                    partial.append((z, hi))
            else:
                partial.append((lo, hi))
        return whole, partial

    def _write_share(self, engine: Callable[[], Any], tmp: str, writers: list[int], rank: int,
                     rs: RangeStats) -> list[tuple[str, int, int, int]]:
        plan = self.plan
        pieces: list[PieceCrc] = []
        # An O_DIRECT write waits for the device once per call: a short run (a strided
        # shard's row, thousands of them) costs that wait each, while through the page
        # cache it is a memory copy, and the one fdatasync at the end writes them together.
        direct = [(lo, hi) for lo, hi in self._runs if hi - lo >= DIRECT_RUN_BYTES]
        buffered: list[list[int]] = []
        for lo, hi in sorted(self._partial + [(lo, hi) for lo, hi in self._runs if hi - lo < DIRECT_RUN_BYTES]):
            if buffered and buffered[-1][1] == lo:
                buffered[-1][1] = hi
            else:
                buffered.append([lo, hi])
        for lo, hi in direct:
            pieces += write_range(engine(), plan, lo, hi, self.opts, rs)
        if buffered:
            pieces += self._write_partial(self._buffered(tmp), tmp, [(lo, hi) for lo, hi in buffered])
        names = self._names
        return [(names[pc.record], pc.start, pc.length, pc.crc) for pc in pieces]

    def _write_partial(self, fd: int, tmp: str, ranges: list[tuple[int, int]]) -> list[PieceCrc]:
        """Write this rank's bytes of the blocks it shares and its short runs (``ranges``,
        sorted) through the page cache. A strided shard has one such range per run (tens of thousands): a range
        inside one CPU storage is checksummed and written straight from its memory, with
        no copy and no search; any other (skeleton bytes, a device storage) by :meth:`_pwrite`."""
        from .. import _native

        storages, out, i = self.plan.storages, [], 0
        for lo, hi in ranges:
            while i < len(storages) and storages[i].offset + storages[i].length <= lo:
                i += 1
            s = storages[i] if i < len(storages) else None
            if s is None or not (s.offset <= lo and hi <= s.offset + s.length and s.on_cpu):
                out += self._pwrite(fd, tmp, lo, hi)
                continue
            first, n = lo - s.offset, hi - lo
            addr = s.addr() + first
            out.append(PieceCrc(s.record, s.record_start + first, n, _native.crc32c_addr(addr, n)))
            view, pos = memoryview((ctypes.c_char * n).from_address(addr)).cast("B"), 0
            while pos < n:
                try:
                    pos += os.pwrite(fd, view[pos:], lo + pos)
                except OSError as e:
                    raise OSError(e.errno, e.strerror, tmp) from e
            self._buffered_bytes += n
        return out

    def _buffered(self, tmp: str) -> int:
        if self._fd is None:
            self._fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
        return self._fd

    def _pwrite(self, fd: int, tmp: str, lo: int, hi: int) -> list[PieceCrc]:
        """Write this rank's bytes of [lo, hi) (skeleton and tensor bytes, in a block another
        writer shares) through the page cache; the CRCs of its tensor pieces."""
        from .. import _native

        buf = bytearray(self.plan.skeleton.pread(lo, hi - lo))
        out = []
        for s in self.plan.storages_in(lo, hi):
            a, z = max(lo, s.offset), min(hi, s.offset + s.length)
            data = s.source[a - s.offset:z - s.offset].cpu().numpy().tobytes()
            buf[a - lo:z - lo] = data
            out.append(PieceCrc(s.record, s.record_start + a - s.offset, z - a, _native.crc32c(data)))
        view, pos = memoryview(buf), 0
        while pos < len(buf):
            try:
                pos += os.pwrite(fd, view[pos:], lo + pos)
            except OSError as e:
                raise OSError(e.errno, e.strerror, tmp) from e
        self._buffered_bytes += len(buf)
        return out

    def _sync_share(self, engine: Any) -> None:
        super()._sync_share(engine)
        if self._fd is not None:
            os.fdatasync(self._fd)
            os.close(self._fd)
            self._fd = None

    def _tail_plan(self) -> Any:
        assert self.full is not None
        if self.format == "safetensors":
            return _TailNames(self.full.file_size, self._names)
        return self.full

    def _write_tail(self, engine: Any, tmp: str, pieces: list[PieceCrc], rs: RangeStats,
                    on_body_written: Any) -> None:
        full = self.full
        if isinstance(full, SafetensorsPlan):
            # The header, at the file's start, on blocks of its own (the data starts on a
            # block): its checksums are known now, and it is written once, whole.
            lo, hi = full.finish_header(pieces)  # raises unless the ranks' pieces tile every tensor
            fd = self._buffered(tmp)
            self._pwrite(fd, tmp, lo, hi)
            os.ftruncate(fd, full.file_size)  # every share is written: this only sets a size none reached
            self._sync_share(None)
            if on_body_written is not None:
                on_body_written()
            return
        combine_piece_crcs(full, pieces)  # raises unless the ranks' pieces tile every storage
        finish_tail(full)
        lo = full.manifest_header_offset
        self._pwrite(self._buffered(tmp), tmp, lo, full.file_size)
        self._sync_share(None)
        if on_body_written is not None:
            on_body_written()

    def run(self, on_body_written: Any = None) -> Any:
        try:
            stats = super().run(on_body_written)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        stats.extra["rank_bytes"] = stats.extra.get("rank_bytes", 0) + self._buffered_bytes
        stats.extra["layout"] = "file"
        return stats


__all__ = ["FlatShard", "Placeholders", "fsdp1_flat", "ShardedFileSave", "UnsupportedPlacementError", "check_placements", "check_sharded_tensors",
           "check_safetensors_state", "global_indices", "shard_segments"]
