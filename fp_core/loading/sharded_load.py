"""``load_into`` a DTensor state from one file of the full state, on any number of ranks.

A file of the full state (``layout="file"``, or plain ``torch.save`` of a full state dict)
holds each tensor whole. A target DTensor placed ``Shard(0)`` and ``Replicate()`` on its
mesh's dimensions (FSDP2, HSDP, any mesh: the ranks need not be those that saved) holds
rows ``[r0, r0 + n)`` of it, where DTensor's own layout says (``r0`` from
``compute_local_shape_and_global_offset``): in a row-major saved tensor those rows are one
byte range, which is all this rank reads, straight into the local shard's memory. A target
also sharded on a later dimension (``Shard(d)``, tensor parallel) holds a block whose rows
are segments of the saved rows: each a byte range read straight into its place in the
local shard, all in one scatter read. Nothing is gathered; no rank reads another rank's
rows.

With ``verify=True`` each rank checksums only the bytes it reads, so a storage's CRC-32C
is put together from the pieces of the ranks of the DTensor's mesh: one piece per byte,
from the replica at coordinate 0 of each ``Replicate()`` dimension (the others read the
same bytes, and counting them twice would break the combine), all-gathered over the mesh
and combined (CRC-32C values combine) against the manifest's. A storage the pieces do not
tile exactly (a saved view that is not the whole storage, or is not row-major) is checked
whole by every rank instead. A rank whose read fails tells the others in the same
all-gather, so every rank raises rather than some waiting; so does a rank whose load fails
before its reads (the file does not open, its target does not fit): with DTensor targets
every rank takes part in one exchange per mesh of its target, verified or not, wherever it
failed (:func:`target_meshes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import _native
from ..errors import CorruptCheckpointError
from ..sharded import dtensor_type


@dataclass
class LoadIntoStats:
    """What one ``load_into`` read from the file (pass one as ``stats=`` to have it filled)."""

    tensor_bytes: int = 0  # read into the targets' tensors (for a DTensor: its local shard only)
    check_bytes: int = 0  # read only to be checked (``verify``: storages not read whole into a target)
    tensors: int = 0  # target tensors filled from the file (a DTensor counts once, by its local shard)
    whole_file: bool = False  # read whole by torch's loader (no offsets to read from), then copied

    @property
    def bytes_read(self) -> int:
        return self.tensor_bytes + self.check_bytes


@dataclass(frozen=True)
class LocalRows:
    """The block of the full tensor a DTensor's local shard holds, on this rank."""

    local: torch.Tensor  # the local shard (``to_local()``: its storage is the DTensor's)
    start: int  # first row in the full tensor
    shape: tuple[int, ...]  # of the local shard
    contributes: bool  # this rank's bytes are the ones counted in a combined checksum
    mesh: Any  # DeviceMesh
    offsets: tuple[int, ...] = ()  # the block's first index in every dimension (``start`` first)


def is_dtensor(x: Any) -> bool:
    kind = dtensor_type()
    return kind is not None and isinstance(x, kind)


def is_strided(dt: Any) -> bool:
    """``dt`` is placed ``_StridedShard`` on some mesh dimension (FSDP2 over tensor
    parallel): its local shard is the full tensor at interleaved indices, no block."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in dt.placements)


def local_rows(dt: Any, key: str, strided: bool = False) -> LocalRows:
    """Where ``dt``'s local shard lies in its full tensor: a block, its first index in every
    dimension and its shape (``Shard(d)`` on any dimension, on any mesh dimension, and
    ``Replicate()``); ``ValueError`` naming ``key`` and the placement for any other
    placement (``Partial``: its values are no part of the saved tensor; ``_StridedShard``
    unless ``strided``: its shard is no block, and ``offsets`` are then left at 0)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for p in dt.placements:
        ok = isinstance(p, Replicate) or (dt.ndim > 0 and (strided if isinstance(p, _StridedShard)
                                                           else isinstance(p, Shard)))
        if not ok:
            raise ValueError(f"load_into: {key or 'the tensor'} is a DTensor placed {p!r} (placements "
                             f"{tuple(dt.placements)}): only Shard(d) and Replicate() are read from one file")
    mesh = dt.device_mesh
    with torch.no_grad():  # the local shard itself, not an autograd view of it
        local = dt.to_local()
    if strided and is_strided(dt):  # its indices, not a box: fp_core.format.shard_layout.global_indices
        shape, offset = tuple(local.shape), (0,) * dt.ndim
    else:
        shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"load_into: {key or 'the tensor'}: the DTensor's local shard is {tuple(local.shape)}, "
                         f"its placements {tuple(dt.placements)} on its mesh say {tuple(shape)}")
    coord = mesh.get_coordinate()
    contributes = coord is not None and all(c == 0 for c, p in zip(coord, dt.placements) if isinstance(p, Replicate))
    return LocalRows(local, offset[0] if dt.ndim else 0, tuple(shape), contributes, mesh, tuple(offset))


def _group(mesh: Any) -> Any:
    """A process group of every rank of ``mesh``."""
    import torch.distributed as dist

    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()


Pieces = dict[int, list[tuple[int, int, int]]]  # record offset -> [(file offset, length, CRC-32C)]


def target_meshes(target: Any) -> list[Any]:
    """The meshes of the DTensors ``target`` holds (in its dicts, lists and tuples, a
    module's state dict, an optimizer's parameters and state), each once, in an order that
    depends on the meshes alone (their ranks, shape and dimension names): the same list on
    every rank of them, found before the file is opened, so a rank whose load fails before
    its reads still takes part in the exchange (:func:`exchange`) the others wait in."""
    found: dict[tuple, Any] = {}
    seen: set[int] = set()
    todo = [target]
    while todo:
        x = todo.pop()
        if id(x) in seen or isinstance(x, (str, bytes, int, float, type(None))):
            continue
        seen.add(id(x))
        if is_dtensor(x):
            found.setdefault(mesh_key(x.device_mesh), x.device_mesh)
        elif isinstance(x, torch.Tensor):
            continue
        elif isinstance(x, dict) or hasattr(x, "items") and callable(x.items):
            todo.extend(v for _, v in x.items())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None)):
            groups = getattr(x, "param_groups", None)
            if isinstance(groups, list):  # an optimizer: its parameters say where created state goes
                todo.extend(p for g in groups if isinstance(g, dict) for p in g.get("params", ()))
            todo.append(x.state_dict())
    return [found[k] for k in sorted(found)]


def mesh_key(mesh: Any) -> tuple:
    """What tells meshes apart, the same on every rank (a mesh's identity is not)."""
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()))


def exchange(path: str, meshes: list[Any], pieces: list[Pieces], error: BaseException | None) -> list[Pieces]:
    """All-gather over each mesh (in the order given, the same on every rank) this rank's
    pieces of the records of that mesh's DTensors (``pieces[i]`` for ``meshes[i]``), and
    whether its load failed; raises on every rank where any failed: this rank's own error,
    else one of the kind another rank raised (:class:`CorruptCheckpointError` naming the
    path and record, ``ValueError`` for a target the file does not fit), naming that rank.
    Returns, per mesh, the pieces of all its ranks merged."""
    import torch.distributed as dist

    out = []
    failed: list[tuple[int, Any]] = []
    for mesh, mine in zip(meshes, pieces):
        sent = {"pieces": mine, "error": None if error is None else _portable(error)}
        if mesh.size() == 1:
            got = [sent]
        else:
            got = [None] * mesh.size()
            dist.all_gather_object(got, sent, group=_group(mesh))
        merged: Pieces = {}
        for r, g in enumerate(got):
            if g["error"] is not None and not failed:
                failed.append((mesh.mesh.flatten().tolist()[r], g["error"]))
            for rec, ps in g["pieces"].items():
                merged.setdefault(rec, []).extend(ps)
        out.append(merged)
    if error is not None:
        raise error
    if failed:
        rank, e = failed[0]
        if isinstance(e, CorruptCheckpointError):
            # the file that rank read (the same as this rank's, unless the ranks were given others)
            raise CorruptCheckpointError(e.path, e.record, f"{e.detail} (found by rank {rank})", e.tensor)
        if isinstance(e, ValueError):
            raise ValueError(f"load_into: {path}: rank {rank} refused the load: {e}")
        raise RuntimeError(f"load_into: {path}: another rank's load failed, so this rank's is not complete: "
                           f"rank {rank} of the mesh: {e}")
    return out


def _portable(error: BaseException) -> Any:
    """What is sent of a rank's error: a :class:`CorruptCheckpointError` as it is (it
    pickles whole), anything else as its type's name and message (it may not pickle)."""
    if isinstance(error, CorruptCheckpointError):
        return error
    text = f"{type(error).__name__}: {error}"
    return ValueError(text) if isinstance(error, ValueError) else text


def combined_crc(start: int, size: int, pieces: list[tuple[int, int, int]]) -> int | None:
    """The CRC-32C of the record ``[start, start + size)`` from pieces that tile it (the same
    piece twice counted once: tied tensors); None where they leave a gap or overlap."""
    crc, pos = 0, start
    for off, n, c in sorted(set(pieces)):
        if off != pos:
            return None
        crc = _native.crc32c_combine(crc, c, n) if pos != start else c
        pos += n
    if pos != start + size:
        return None
    return crc


__all__ = ["LoadIntoStats", "LocalRows", "combined_crc", "exchange", "is_dtensor", "is_strided", "local_rows", "mesh_key",
           "target_meshes"]
