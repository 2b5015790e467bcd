"""A sharded state dict as a save job: every rank writes its shards through DCP.

A state dict whose tensors include ``DTensor`` s (FSDP2 ``fully_shard``, tensor parallel)
is not one object that one file can hold: each rank owns different pieces of it. So
``fp_core.save(state, d)`` and ``AsyncCheckpointer.save(state, d)`` route it here
(:func:`fp_core.api.prepare`), and the job runs ``torch.distributed.checkpoint.save`` with
:class:`fp_core.parallel.dcp.FastPersistWriter` on a gloo group of its own (the async pipeline runs
it on its worker thread, where it must never interleave with the training's collectives).
Every rank of the group calls ``save`` for the same directory, in the same order.

To the pipeline the job looks like any other: its plan lists every tensor's local bytes as
a storage extent, so the ``snapshot`` policy copies them into its arena (the job then saves
tensors over those copies, DTensors rebuilt over their local copy) and the ``overlap``
policy writes the live tensors, the fence waiting until this rank's file holds them.
What is not a tensor is fixed when the job is made (containers are copied).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..format.plan import FilePlan, StorageExtent, align_up
from ..format.skeleton import SparseFile
from ..io.engine import EngineOptions
from ..io.writer import device_work_after_save
from ..sharded import dtensor_type, has_flat_shard, map_containers, sharded_tensor_type
from ..stats import SaveStats
from .dcp import FastPersistWriter, check_extra_files, staging_path
from .distributed import DEFAULT_TIMEOUT_S, coordination_group

_ALIGN = 4096


class _Leaf:
    """A tensor of the state: where its bytes are, and how to rebuild it over a copy."""

    def __init__(self, tensor: torch.Tensor, dtensor: Any = None) -> None:
        self.tensor = tensor  # the plain (local) tensor whose bytes are saved
        self.dtensor = dtensor  # the DTensor it is the local part of, if any
        self.extent: StorageExtent | None = None

    def rebuild(self) -> Any:
        t = self.tensor
        if self.extent is not None and self.extent.host is not None:
            t = self.extent.host[: t.nbytes].view(t.dtype).view(t.shape)
        if self.dtensor is None:
            return t
        # The constructor, not DTensor.from_local: that moves a local tensor that is not on
        # the mesh's device onto it (a host copy, or CPU-offloaded state on a CUDA mesh,
        # would be copied to the GPU, from this thread, onto its current device).
        return type(self.dtensor)(t, self.dtensor._spec, requires_grad=False)


def _capture(obj: Any, leaves: list[_Leaf]) -> Any:
    """A copy of ``obj``'s containers with every tensor replaced by a :class:`_Leaf`."""
    DTensor = dtensor_type()
    if DTensor is not None and isinstance(obj, DTensor):
        local = obj.to_local().detach()
        leaf = _Leaf(local if local.is_contiguous() else local.contiguous(), obj)
        leaves.append(leaf)
        return leaf
    ShardedTensor = sharded_tensor_type()
    if ShardedTensor is not None and isinstance(obj, ShardedTensor):
        raise CheckpointError("a ShardedTensor (FSDP1's SHARDED_STATE_DICT) cannot be saved by fp_core.save or "
                              "AsyncCheckpointer: use FSDP2 (DTensor state), or dcp.save(state, "
                              "storage_writer=fp_core.parallel.dcp.FastPersistWriter(path))")
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        leaf = _Leaf(t if t.is_contiguous() else t.contiguous())
        leaves.append(leaf)
        return leaf
    return map_containers(obj, lambda v: _capture(v, leaves))


class _WireLeaf:
    """A :class:`_Leaf` as a writer process gets it: where its bytes are in the arena, and
    how to make the DTensor again (its mesh's ranks and names, placements, global meta)."""

    def __init__(self, leaf: _Leaf) -> None:
        t = leaf.tensor
        self.offset = leaf.extent.offset if leaf.extent is not None else -1
        self.nbytes, self.shape, self.dtype = t.nbytes, tuple(t.shape), t.dtype
        self.dt: tuple | None = None
        if leaf.dtensor is not None:
            spec = leaf.dtensor._spec
            mesh = spec.mesh
            root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
            # the root mesh (the same on every rank) and the names of this mesh's dimensions in
            # it: every writer makes the same groups, in the same order (new_group pairs them)
            sub = None if root is mesh else mesh.mesh_dim_names
            self.dt = ((root.mesh.tolist(), root.mesh_dim_names, sub), tuple(spec.placements), spec.tensor_meta,
                       getattr(spec, "shard_order", None))

    def tensor(self, arena: torch.Tensor) -> Any:
        if self.nbytes:
            t = arena[self.offset: self.offset + self.nbytes].view(self.dtype).view(self.shape)
        else:
            t = torch.empty(self.shape, dtype=self.dtype)
        if self.dt is None:
            return t
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        (ranks, names, sub), placements, meta, order = self.dt
        key = (repr(ranks), names)
        if key not in _WRITER_MESHES:  # once per writer: its groups live as long as the writers' group
            _WRITER_MESHES[key] = DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=names)
        mesh = _WRITER_MESHES[key]
        if sub is not None:
            if not names:
                raise CheckpointError("a DTensor on part of a device mesh whose dimensions have no names cannot be "
                                      "saved by the writer process: name the mesh's dimensions, or use writer='thread'")
            mesh = mesh[sub]
        kw = {"shard_order": order} if order is not None else {}
        return DTensor(t, DTensorSpec(mesh, placements, tensor_meta=meta, **kw), requires_grad=False)


# In a writer process: the root meshes of the DTensors it has saved, over the writers' group
# (their ranks are the trainers'), made once each.
_WRITER_MESHES: dict[tuple, Any] = {}


def forget_writer_meshes() -> None:
    """The writer process leaves its group: the meshes made over it go with it."""
    _WRITER_MESHES.clear()


def _rebuild(obj: Any) -> Any:
    if isinstance(obj, _Leaf):
        return obj.rebuild()
    return map_containers(obj, _rebuild)


class DcpSave:
    """A sharded checkpoint directory written by every rank of ``group`` through DCP
    (a :class:`fp_core.saving.job.SaveJob`; see the module doc).

    ``extra_files``: ``{name: bytes}`` the coordinator writes into the directory before it
    is committed (Lightning's ``meta.pt``), checksummed in the directory manifest.
    """

    collective = True

    def __init__(self, obj: Any, path: str | os.PathLike, group: Any = None, *,
                 options: EngineOptions | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 extra_files: dict[str, bytes] | None = None) -> None:
        t0 = time.perf_counter()
        self.final = os.path.abspath(os.fspath(path))
        if has_flat_shard(obj):  # on every rank alike, before any collective
            raise ValueError(f"{self.final}: a state holding FlatShards (element ranges of FSDP1's flat parameters) "
                             "is saved as one file of the full state: layout=\"file\"")
        self.options = options or EngineOptions()
        self.extra_files = check_extra_files(extra_files or {})
        self.cg = coordination_group(group, timeout_s)
        self.stats = SaveStats(path=self.final)
        self.error: BaseException | None = None
        leaves: list[_Leaf] = []
        self.state = _capture(obj, leaves)
        extents, offset = [], 0
        for i, leaf in enumerate(leaves):
            t = leaf.tensor
            if t.nbytes == 0:
                continue
            flat = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
            leaf.extent = StorageExtent(offset, t.nbytes, flat, i)
            extents.append(leaf.extent)
            offset = align_up(offset + t.nbytes, _ALIGN)
        # Not a file layout: the pipeline reads only the extents (what to snapshot, what is live).
        self.plan: FilePlan | None = FilePlan(file_size=offset, alignment=_ALIGN, skeleton=SparseFile(),
                                              storages=extents, manifest=None)
        self.stats.serialize_seconds = time.perf_counter() - t0

    def wire(self) -> dict:
        """What a writer process needs to run this save once every tensor's bytes are in its
        arena at their extent's offset: the state without tensors, and the extra files."""
        def to_wire(o: Any) -> Any:
            return _WireLeaf(o) if isinstance(o, _Leaf) else map_containers(o, to_wire)

        return {"state": to_wire(self.state), "extra_files": self.extra_files}

    @classmethod
    def from_wire(cls, wire: dict, arena: torch.Tensor, path: str | os.PathLike, *, cg: Any,
                  options: EngineOptions) -> DcpSave:
        """The save of :meth:`wire` over ``cg`` (the writers' group), its tensors views of
        ``arena`` (DTensors over meshes of the writers' ranks)."""
        self = cls.__new__(cls)
        self.final = os.path.abspath(os.fspath(path))
        self.options, self.extra_files, self.cg = options, wire["extra_files"], cg
        self.stats = SaveStats(path=self.final)
        self.error, self.plan = None, None
        def build(o: Any) -> Any:
            return o.tensor(arena) if isinstance(o, _WireLeaf) else map_containers(o, build)

        try:
            self.state = build(wire["state"])
        except Exception as e:  # noqa: BLE001 - this writer still joins DCP's planning, and fails it there
            self.state, self.error = {}, e
        return self

    def fail(self, error: BaseException) -> None:
        """Carried into :meth:`run`: this rank fails DCP's planning, so every rank fails."""
        self.error = error

    def abort(self) -> None:
        """Nothing is on disk before :meth:`run`."""

    def run(self, on_body_written: Callable[[], None] | None = None) -> SaveStats:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        t0 = time.perf_counter()
        try:
            state = _rebuild(self.state)
        except Exception as e:  # noqa: BLE001 - this rank still joins, and fails the save in planning
            state, self.error = {}, self.error or e
        writer = FastPersistWriter(self.final, extra_files=self.extra_files, on_written=on_body_written,
                                   fail_with=self.error, **dataclasses.asdict(self.options))
        try:
            # the writer's copies of device shards: after the caller's stream at save(), not
            # behind the training's next kernels on this thread's default stream
            with device_work_after_save(self.plan.storages if self.plan is not None else []):
                dcp.save(state, storage_writer=writer, process_group=self.cg)
        except CheckpointException as e:
            if dist.get_rank(self.cg) == 0:  # every rank is past its writes: DCP's last exchange failed
                shutil.rmtree(staging_path(self.final), ignore_errors=True)
            raise CheckpointError(f"sharded checkpoint {self.final} not written: {_summary(e)}") from e
        except Exception as e:  # a collective that broke (a dead rank): gloo's own error
            raise CheckpointError(f"sharded checkpoint {self.final} not written: {type(e).__name__}: {e}") from e
        finally:
            if on_body_written is not None:
                on_body_written()
            self.state = None  # the tensors (or their copies) are not needed any more
        st = self.stats
        ws = writer.stats
        st.bytes = int(ws.get("bytes", 0))
        st.write_seconds = float(ws.get("write_seconds", ws.get("seconds", 0.0)))
        st.copy_seconds = float(ws.get("copy_seconds", 0.0))
        st.device_copy_seconds = float(ws.get("device_copy_seconds", 0.0))
        # this rank's fdatasyncs and commit of its file, and the coordinator's of the directory
        st.sync_seconds = float(ws.get("sync_seconds", 0.0)) + float(ws.get("finish_seconds", 0.0))
        st.alignment = int(ws.get("alignment", 0))
        st.requests = int(ws.get("requests", 0))
        st.short_writes = int(ws.get("short_writes", 0))
        st.backend_reason = str(ws.get("backend_reason", ""))
        st.seconds = st.serialize_seconds + time.perf_counter() - t0
        st.writers = dist.get_world_size(self.cg)
        st.backend = str(writer.stats.get("backend", ""))
        st.extra["zero_copy_bytes"] = int(writer.stats.get("zero_copy_bytes", 0))
        st.extra["rank_file"] = writer.stats.get("file", "")
        return st


def _summary(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(e)
    parts = []
    for rank, err in sorted(failures.items()):
        cause = err[0] if isinstance(err, tuple) else err
        parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
    return "; ".join(parts)


__all__ = ["DcpSave"]
