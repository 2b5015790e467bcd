"""Loading into tensors that already exist: a resume fills the model's and the optimizer's
own tensors, reading each one's bytes from the file straight into its memory; the state a
fresh optimizer does not have yet is created from the file and read in the same way, and
every value that is no tensor is the file's (:func:`load_into`).

The file's structure comes from its pickle, each tensor described by its storage's
offset in the file and its view of it: read by :mod:`fp_core.format.plain_unpickle` where the
pickle is plain (a :class:`~fp_core.format.plain_unpickle.SavedTensor` per tensor, no tensor
built; the offsets from the manifest where its checksums hold, so that the reads start
without waiting for thousands of small cold header reads (with ``verify=True`` the
headers are checked against it beside the reads), else from the local headers, all read
in one scatter read), else by torch's
unpickler with every storage on the meta device (``map_location="meta"``). Each saved
tensor is matched with the target's tensor at the same place (same keys, shape and
dtype), and one native scatter read fills them all: pieces near each other in the file
read together, up to 2 MiB per request, many in flight, O_DIRECT straight in where the
target is aligned like the file. No fresh memory is touched: the target's pages are
already there. A target that cannot be filled in place (on a device, not contiguous, a
view of part of a saved storage) is filled from a host copy of its record. A DTensor target
(``Shard(d)``, ``_StridedShard``, ``Replicate()``, any mesh) is filled in its local shard
from its rows, block or interleaved rows of the saved full tensor only
(:mod:`fp_core.loading.sharded_load`). A safetensors file is read the same way, its header
describing each tensor (:mod:`fp_core.loading.sharded_load_safetensors`).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from ..format import plain_unpickle
from ..format.plain_unpickle import SavedTensor
from ..gc_pause import gc_paused
from ..io import read_depth
from ..io.thread_wait import Beside
from . import file_image, loader, safetensors_file, sharded_load_safetensors
from .integrity import (
    CheckpointFile,
    ManifestView,
    check_crc,
    check_records_against_directory,
    check_records_against_zip,
    check_storages,
    check_zip_structure,
    damage_named,
    read_manifest,
    read_small_records,
)
from .loader import FastReader
from .sharded_load import (
    LoadIntoStats,
    LocalRows,
    combined_crc,
    exchange,
    is_dtensor,
    is_strided,
    local_rows,
    mesh_key,
    target_meshes,
)


@dataclass(slots=True)
class _Fill:
    key: str
    target: torch.Tensor
    offset: int  # of the tensor's bytes in the file
    nbytes: int  # that its view spans (from its first element to its last)
    record: tuple[int, int]  # (offset, size) of the storage record holding them
    source: Any  # SavedTensor (storage offset, strides) for a copy; a loaded tensor where read whole
    shard: LocalRows | None = None  # the target is a DTensor's local shard: only its rows are read
    counts: bool = True  # a target tensor of its own (not a later segment of a DTensor's block)


class _MetaSlices:
    """The ``overall_storage`` torch's unpickler slices storages from: a meta storage per
    slice, tagged with its offset in the file (torch takes it from the record's zip
    header), so the structure is read without a byte of tensor data."""

    def __getitem__(self, key: slice) -> torch.UntypedStorage:
        st = torch.UntypedStorage(key.stop - key.start, device="meta")
        st._fp_offset = key.start
        return st


def _meta_offset(t: torch.Tensor) -> int | None:
    return getattr(t.untyped_storage(), "_fp_offset", None)


def _keep_on_meta(storage: Any, location: str) -> Any:
    return storage


def _described(t: torch.Tensor) -> SavedTensor | torch.Tensor:
    """A meta tensor of torch's unpickler as a :class:`SavedTensor`; a loaded one as it is."""
    off = _meta_offset(t)
    if off is None:
        return t
    return SavedTensor(off, t.untyped_storage().nbytes(), t.dtype, t.storage_offset(), tuple(t.shape), t.stride())


class _Absent:
    """The target has nothing at this place: what the file holds there is created."""


_ABSENT: Any = _Absent()
_CPU = torch.device("cpu")


def _is_stateful(x: Any) -> bool:
    """An object whose state is ``state_dict()`` and is restored by ``load_state_dict``: a
    module, an optimizer, an LR scheduler, a grad scaler (DCP's ``Stateful``)."""
    return (not isinstance(x, (torch.Tensor, Mapping, list, tuple, str, bytes, int, float))
            and callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None)))


_LEAVES = (type(None), bool, int, float, str, bytes)


def _has_tensor(x: Any) -> bool:
    """Whether ``x`` holds a tensor (or an object whose state is restored from the file)."""
    if isinstance(x, (torch.Tensor, SavedTensor)):
        return True
    if type(x) not in _LEAVES and _is_stateful(x):
        return True
    if isinstance(x, Mapping):
        return any(_has_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_tensor(v) for v in x)
    return False


def _is_optimizer_state(x: Any) -> bool:
    """Shaped like ``torch.optim.Optimizer.state_dict()``: per-parameter ``state`` and
    ``param_groups`` naming the parameters by index."""
    return (isinstance(x, Mapping) and isinstance(x.get("state"), Mapping)
            and isinstance(x.get("param_groups"), (list, tuple))
            and all(isinstance(g, Mapping) and "params" in g for g in x["param_groups"]))


class _Matcher:
    """Matches the saved structure with the target: each saved tensor with the target's
    tensor at the same place (same keys, shape and dtype), the fills to make; each object
    with ``state_dict()``/``load_state_dict()`` in the target by its state dict, to be
    handed its filled state after the read (:meth:`restore`)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.fills: list[_Fill] = []
        self.stateful: list[tuple[Any, Any]] = []  # (object, its filled state dict)
        self.params: dict[int, dict[Any, torch.Tensor]] = {}  # id(optimizer's state dict) -> index -> param
        # (mesh, record offset, record size, whether its ranks' rows tile the record) of each
        # DTensor target, also where this rank's shard is empty: its checksum is the mesh's
        self.sharded: list[tuple[Any, int, int, bool]] = []
        self.stats = LoadIntoStats()
        # the meshes of the target's DTensors (target_meshes): every rank of them exchanges
        # once per load, whether its load failed or not; ``exchanged`` once it has
        self.meshes: list[Any] = []
        self.exchanged = False

    def run(self, saved: Any) -> Any:
        """The saved structure with each tensor replaced by the target's (or a created one)."""
        self.fills, self.stateful, self.params, self.sharded = [], [], {}, []
        return self.match(saved, self.target)

    def restore(self) -> None:
        """Hand each object its filled state (its tensors, filled or created on its own
        devices, are kept by its ``load_state_dict``: only the other values are set)."""
        for obj, sd in self.stateful:
            obj.load_state_dict(sd)

    def _state_of(self, saved: Any, obj: Any, key: str) -> Any:
        """An object of the target matched by its ``state_dict()``; an optimizer's
        parameters noted by index (where the state created for each goes)."""
        sd = obj.state_dict()
        groups = getattr(obj, "param_groups", None)
        if _is_optimizer_state(sd) and isinstance(groups, list):
            ids = [i for g in sd["param_groups"] for i in g["params"]]
            params = [p for g in groups for p in g.get("params", ())]
            if len(ids) == len(params):
                self.params[id(sd)] = dict(zip(ids, params))
        if not isinstance(saved, Mapping):
            what = "a tensor" if isinstance(saved, (SavedTensor, torch.Tensor)) else type(saved).__name__
            raise ValueError(f"load_into: {key or 'the object'} is {what} in the file, "
                             f"not the state dict of the target's {type(obj).__name__}")
        out = self.match(saved, sd, key)
        self.stateful.append((obj, out))
        return out

    def match(self, saved: Any, target: Any, key: str = "", device: torch.device | None = None,
              created: bool = False) -> Any:
        """The saved structure with each tensor replaced by the target's. ``created``:
        inside an optimizer's per-parameter state, where what the target lacks is created
        from the file (placed on ``device``) and what the file lacks is dropped, as
        ``Optimizer.load_state_dict`` replaces the state whole; elsewhere the keys must
        agree wherever tensors are."""
        if isinstance(saved, (SavedTensor, torch.Tensor)):
            if target is _ABSENT:
                target = _allocate(saved, device or _CPU)
            elif not isinstance(target, torch.Tensor):
                if _is_stateful(target):
                    return self._state_of(saved, target, key)
                raise ValueError(f"load_into: {key or 'the object'} is a tensor in the file but "
                                 f"{type(target).__name__} in the target")
            if saved.shape != target.shape or saved.dtype != target.dtype:
                raise ValueError(f"load_into: {key or 'the tensor'} is {tuple(saved.shape)} {saved.dtype} in the file, "
                                 f"{tuple(target.shape)} {target.dtype} in the target")
            if isinstance(saved, torch.Tensor):
                saved = _described(saved)
            if is_dtensor(target):
                return self._dtensor(saved, target, key)
            if isinstance(saved, torch.Tensor):  # read whole (no offsets): copied from the loaded tensor
                self.fills.append(_Fill(key, target, -1, 0, (-1, 0), saved))
                return target
            numel, last = _span(saved.shape, saved.stride)
            if numel == 0:
                return target  # nothing to read (an empty view may point anywhere, even past its storage)
            es = saved.element_size
            # the bytes the view spans: numel * es where it is dense, less for an expanded one (stride 0)
            self.fills.append(_Fill(key, target, saved.offset + saved.storage_offset * es, (last + 1) * es,
                                    (saved.offset, saved.storage_nbytes), saved))
            return target
        if isinstance(saved, Mapping):
            if target is _ABSENT:
                out = {k: self.match(v, _ABSENT, _at(key, k), device, True) for k, v in saved.items()}
            elif not isinstance(target, Mapping):
                if _is_stateful(target):
                    return self._state_of(saved, target, key)
                raise ValueError(f"load_into: {key or 'the object'} is a mapping in the file but "
                                 f"{type(target).__name__} in the target")
            elif _is_optimizer_state(saved) and _is_optimizer_state(target):
                out = self._optimizer(saved, target, key)
            elif created:
                out = {k: self.match(v, target.get(k, _ABSENT), _at(key, k), device, True) for k, v in saved.items()}
            elif len(saved) != len(target) or not all(k in target for k in saved):
                if not _has_tensor(saved) and not _has_tensor(target):
                    return saved  # no tensor on either side: the file's, as it is
                missing = [k for k in saved if k not in target and _has_tensor(saved[k])]
                unexpected = [k for k in target if k not in saved]
                if missing or unexpected:
                    raise ValueError(f"load_into: keys of {key or 'the object'} differ: in the file only "
                                     f"{missing[:5]}, in the target only {unexpected[:5]}")
                out = {k: self.match(v, target.get(k, _ABSENT), _at(key, k)) for k, v in saved.items()}
            else:
                out = {k: self.match(v, target[k], f"{key}.{k}" if key else str(k)) for k, v in saved.items()}
            if type(saved) is dict:
                return out
            try:
                return type(saved)(out)  # an OrderedDict stays one
            except TypeError:
                return out
        if target is not _ABSENT and type(target) not in _LEAVES and _is_stateful(target):
            return self._state_of(saved, target, key)  # refused: not a state dict in the file
        if isinstance(saved, (list, tuple)) and not hasattr(saved, "_fields"):
            if target is not _ABSENT and (not isinstance(target, (list, tuple)) or len(target) != len(saved)):
                if created or (not _has_tensor(saved) and not _has_tensor(target)):
                    target = _ABSENT  # the file's, its tensors created
                else:
                    raise ValueError(f"load_into: {key or 'the object'} is a sequence of {len(saved)} in the file, "
                                     f"not so in the target")
            targets = [_ABSENT] * len(saved) if target is _ABSENT else target
            items = [self.match(v, t, f"{key}[{i}]", device, created or target is _ABSENT)
                     for i, (v, t) in enumerate(zip(saved, targets))]
            return type(saved)(items)
        return saved  # numbers, strings, ...: the file's

    def _dtensor(self, saved: SavedTensor | torch.Tensor, target: torch.Tensor, key: str) -> torch.Tensor:
        """A DTensor target (its global shape and dtype already matched): only the block
        of its local shard is read, into the local shard: its rows, one byte range, where
        only dimension 0 is sharded; else the segments of the saved rows the block holds."""
        if is_strided(target):
            return self._strided(saved, target, key)
        rows = local_rows(target, key)
        if isinstance(saved, torch.Tensor):  # loaded whole (no offsets): its block copied
            src = saved[tuple(slice(o, o + n) for o, n in zip(rows.offsets, rows.shape))] if saved.ndim else saved
            self.fills.append(_Fill(key, rows.local, -1, 0, (-1, 0), src, rows))
            return target
        es = saved.element_size
        # the ranks' blocks tile the storage's bytes only where the saved tensor is the
        # whole storage, row-major: else each rank checks the storage whole (verify)
        tiles = saved.is_contiguous() and saved.storage_offset == 0 and saved.numel() * es == saved.storage_nbytes
        self.sharded.append((rows.mesh, saved.offset, saved.storage_nbytes, tiles))
        first = saved.storage_offset + sum(o * st for o, st in zip(rows.offsets, saved.stride))
        part = SavedTensor(saved.offset, saved.storage_nbytes, saved.dtype, first, rows.shape, saved.stride)
        numel, last = _span(part.shape, part.stride)
        if numel == 0:
            return target  # an empty shard: nothing to read
        record = (saved.offset, saved.storage_nbytes)
        segments = _segments(part, tuple(saved.shape), rows) if not part.is_contiguous() and saved.is_contiguous() else None
        if segments is None:  # one byte range: the rows, or the span a block lies in (copied out of it)
            self.fills.append(_Fill(key, rows.local, saved.offset + first * es, (last + 1) * es, record, part, rows))
            return target
        for i, (elem, into, seg) in enumerate(segments):
            self.fills.append(_Fill(key, into, saved.offset + elem * es, seg.numel() * es, record, seg, rows,
                                    counts=i == 0))
        return target

    def _strided(self, saved: SavedTensor | torch.Tensor, target: torch.Tensor, key: str) -> torch.Tensor:
        """A DTensor placed ``_StridedShard`` (FSDP2 over tensor parallel): its local shard
        is the full tensor at the indices DTensor's own split gives each dimension, read as
        the runs of consecutive indices they make, each straight into its place."""
        from ..format.shard_layout import global_indices, shard_segments

        rows = local_rows(target, key, strided=True)
        idx = global_indices(target)
        expected = tuple(len(ix) for ix in idx)
        if tuple(rows.local.shape) != expected:
            # FSDP2 x TP lays uneven rows out unlike DTensor's own split: the runs computed
            # from the latter would fill the wrong rows, and run past the shard's memory
            raise ValueError(f"load_into: {key or 'the tensor'} is a DTensor placed {tuple(target.placements)} "
                             f"whose local shard has shape {tuple(rows.local.shape)}, but DTensor's split of its "
                             f"global shape {tuple(target.shape)} gives this rank {expected}: its rows cannot be "
                             "placed; load it from a layout=\"dcp\" checkpoint")
        if isinstance(saved, torch.Tensor):  # loaded whole: its indices copied
            src = saved
            for d, ix in enumerate(idx):
                src = src.index_select(d, torch.as_tensor(list(ix), dtype=torch.long))
            self.fills.append(_Fill(key, rows.local, -1, 0, (-1, 0), src, rows))
            return target
        local = rows.local
        if not (saved.is_contiguous() and local.device.type == "cpu" and local.is_contiguous()):
            raise ValueError(f"load_into: {key or 'the tensor'} is a DTensor placed {tuple(target.placements)}: "
                             "its interleaved rows are read only from a row-major saved tensor into a row-major "
                             "local shard in host memory")
        es = saved.element_size
        tiles = saved.storage_offset == 0 and saved.numel() * es == saved.storage_nbytes
        self.sharded.append((rows.mesh, saved.offset, saved.storage_nbytes, tiles))
        record = (saved.offset, saved.storage_nbytes)
        flat = local.reshape(-1).view(torch.uint8)  # the local shard's bytes, where each run goes
        start = saved.storage_offset * es
        for i, (g, at, n) in enumerate(shard_segments(tuple(saved.shape), idx, es)):
            into = flat[at:at + n]
            if into.numel() != n:  # never read past the local shard (the shape check above holds it)
                raise ValueError(f"load_into: {key or 'the tensor'}: a run of {n} bytes at {at} does not fit its "
                                 f"local shard of {flat.numel()} bytes")
            seg = SavedTensor(saved.offset, saved.storage_nbytes, torch.uint8, start + g, (n,), (1,))
            self.fills.append(_Fill(key, into, saved.offset + start + g, n, record, seg, rows, counts=i == 0))
        return target

    def _optimizer(self, saved: Mapping, target: Mapping, key: str) -> dict:
        """An optimizer's state dict: ``param_groups`` and every other value from the file;
        each parameter's state filled where the target has it, created where it does not
        (a fresh optimizer has none before its first step) on the device of its parameter
        where that is known (the optimizer itself was given, or the target holds other
        state of that parameter), else in host memory; ``step`` stays in host memory unless
        its group is capturable or fused, as ``Optimizer.load_state_dict`` places it."""
        sizes = [len(g["params"]) for g in saved["param_groups"]]
        if sizes != [len(g["params"]) for g in target["param_groups"]]:
            # Optimizer.load_state_dict would refuse it after the read: refused before it
            raise ValueError(f"load_into: {_at(key, 'param_groups')} holds {sizes} parameters in the file, "
                             f"{[len(g['params']) for g in target['param_groups']]} in the target")
        # the file's parameter indices to the target's, by position, as load_state_dict maps them
        ids = dict(zip((i for g in saved["param_groups"] for i in g["params"]),
                       (i for g in target["param_groups"] for i in g["params"])))
        params = self.params.get(id(target), {})
        groups = {i: g for g in saved["param_groups"] for i in g["params"]}
        out = {k: self.match(v, target.get(k, _ABSENT), _at(key, k), None, k not in target)
               for k, v in saved.items() if k != "state"}
        state = {}
        have = target["state"]
        prefix = _at(key, "state")
        for pid, v in saved["state"].items():
            mine = have.get(ids.get(pid, pid), _ABSENT)
            param = params.get(ids.get(pid, pid))
            device = None if param is None else param.device
            if device is None and isinstance(mine, Mapping) and isinstance(v, Mapping) and not v.keys() <= mine.keys():
                # another state tensor of the parameter in the target says where it lives
                device = next((t.device for k, t in mine.items() if k != "step" and isinstance(t, torch.Tensor)),
                              None)
            at = f"{prefix}.{pid}"
            if isinstance(v, Mapping):
                g = groups.get(pid, {})
                step_device = device if g.get("capturable", False) or g.get("fused", False) else _CPU
                if not isinstance(mine, Mapping):
                    mine = {}
                state[pid] = {k: self.match(x, _created_like(param, k, x) if k not in mine else mine[k], f"{at}.{k}",
                                            step_device if k == "step" else device, True)
                              for k, x in v.items()}
            else:
                state[pid] = self.match(v, mine, at, device, True)
        out["state"] = state
        return {k: out[k] for k in saved}  # the file's order of keys


def _created_like(param: torch.Tensor | None, k: Any, saved: Any) -> Any:
    """The target of a state tensor a fresh optimizer lacks: for a DTensor parameter
    (FSDP2), a DTensor sharded like it where the saved tensor has its global shape, so only
    this rank's rows are read and the state is what the optimizer's step expects; else
    absent (created whole from the file)."""
    if param is None or k == "step" or not is_dtensor(param) or tuple(saved.shape) != tuple(param.shape):
        return _ABSENT
    from torch.distributed.tensor import DTensor

    like = param.to_local()
    local = torch.empty(like.shape, dtype=saved.dtype, device=like.device)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


_MAX_SEGMENTS = 1 << 16  # beyond, a block is read as the one span it lies in and copied out


def _segments(part: SavedTensor, full: tuple[int, ...], rows: LocalRows) -> list[tuple[int, torch.Tensor, SavedTensor]] | None:
    """A block of a row-major saved tensor (``part``: its view) as the byte ranges it is
    made of: for every index of the dimensions before the last one the block does not span
    whole, (first element in the storage, the local shard's view it fills, that segment as a
    saved tensor). None where the local shard cannot take them in place (not in host
    memory, not row-major) or they are too many (the span is read once instead)."""
    local = rows.local
    if local.device.type != "cpu" or not local.is_contiguous():
        return None
    shape, stride = part.shape, part.stride
    # the last dimension the block does not span whole (``full``: the saved tensor's shape):
    # from it on, each segment is row-major
    j = max(i for i in range(len(shape)) if i == 0 or shape[i] != full[i])
    outer = shape[:j]
    if math.prod(outer) > _MAX_SEGMENTS:
        return None
    inner, inner_stride = tuple(shape[j:]), tuple(stride[j:])
    out = []
    for idx in itertools.product(*(range(n) for n in outer)):
        elem = part.storage_offset + sum(i * st for i, st in zip(idx, stride))
        seg = SavedTensor(part.offset, part.storage_nbytes, part.dtype, elem, inner, inner_stride)
        out.append((elem, local[idx], seg))
    return out


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, int]:
    """(how many elements a view has, its last element's distance from its first)."""
    last, numel = 0, 1
    for n, st in zip(shape, stride):
        last += (n - 1) * st
        numel *= n
    return numel, last


def _at(key: str, k: Any) -> str:
    return f"{key}.{k}" if key else str(k)


def _allocate(saved: Any, device: torch.device) -> torch.Tensor:
    """A tensor for a saved one the target lacks, from torch's allocator as the model's
    own are: its shape, dtype and (where dense, as an optimizer's ``zeros_like`` state is)
    strides, so the file's bytes are read straight in."""
    shape, stride = tuple(saved.shape), tuple(saved.stride() if isinstance(saved, torch.Tensor) else saved.stride)
    if plain_unpickle.is_dense(shape, stride):
        return torch.empty_strided(shape, stride, dtype=saved.dtype, device=device)
    return torch.empty(shape, dtype=saved.dtype, device=device)


def _in_archive(by_name: dict[str, Any], archive: str) -> dict[str, Any]:
    """The items named ``<archive>/<name>``, by ``<name>`` (torch reads the folder of the
    zip's first entry)."""
    return {name: v for k, v in by_name.items() for a, _, name in [k.partition("/")] if a == archive}


def _under_archive(cf: CheckpointFile, entries: list[Any], offsets: list[int]) -> dict[str, int]:
    """Record name under the archive (``data/<key>``) -> data offset, for the archive torch
    reads: the folder of the zip's first entry (its zip reader's rule)."""
    archive = cf.zip_directory()[0][0].filename.partition("/")[0]
    return {name: off for i, off in zip(entries, offsets)
            for a, _, name in [i.filename.partition("/")] if a == archive}


def load_into(target: Any, path: str | os.PathLike, *, verify: bool | str = False,
              weights_only: bool | None = True, stats: LoadIntoStats | None = None) -> Any:
    """Resume from the checkpoint at ``path`` into ``target``, reading every tensor's bytes
    straight into memory that is already there; returns the saved object.

    ``target`` is shaped like the saved object: nested dicts, lists and tuples holding
    tensors, and objects with ``state_dict()``/``load_state_dict()`` (a module, an
    optimizer, an LR scheduler, a grad scaler) in the place of their state dicts::

        state = load_into({"model": model, "optim": optimizer, "sched": scheduler}, path)
        epoch = state["epoch"]

    - Each saved tensor is read into the target's tensor at the same place (same keys,
      shape and dtype: ``ValueError`` naming the first that differs, before a byte is
      read); a module's tensors are its parameters and buffers, filled where they are.
    - Every other value (an optimizer's ``param_groups`` and step counts, a scheduler's
      state, the epoch, any number, string or list) is the file's, as ``torch.load``
      gives it, also where the target lacks the key or holds something else there.
    - An optimizer's per-parameter state that the target lacks (a fresh optimizer has
      none before its first step) is created from the file and read in with the rest: on
      its parameter's device where that is known (the optimizer itself was given, or the
      target holds other state of that parameter), else in host memory; ``step`` in host
      memory unless its group is capturable or fused (``Optimizer.load_state_dict``'s
      placement). State the file lacks is dropped, as ``load_state_dict`` drops it.
    - Each object given is then handed its part of the result through its own
      ``load_state_dict`` (which keeps the tensors filled here: nothing is copied again),
      so the optimizer's hyperparameters are the file's, not the live ones.

    Returns the saved object with the target's (or the created) tensors in it, and at the
    place of each object given, its filled state dict. A target of plain state dicts
    (``{"model": model.state_dict(), "optim": optimizer.state_dict()}``) is filled the
    same way, and after the read its own dicts and lists are made to hold what the result
    holds (the file's non-tensor values, the created state; keys the file lacks removed),
    but nothing is handed to the objects: ``optimizer.load_state_dict(state["optim"])``.

    With ``verify=True`` every record read is checked against the manifest
    (:class:`CorruptCheckpointError` naming it; the targets then hold unchecked bytes,
    also where only the zip's headers are damaged: they are checked while the tensors are
    read into the targets, and no ``load_state_dict`` is called). Without it, a load that
    fails on a damaged file raises :class:`CorruptCheckpointError` naming the damage where
    the structure shows it.

    DTensors (placed ``Shard(d)`` and ``Replicate()``, on any mesh: as many ranks as saved,
    fewer or more, FSDP2 or HSDP) are filled from a file of the full state (``layout="file"``
    or ``torch.save`` of a full state dict), called by every rank of their meshes: each
    rank reads only its local shard's rows (or, sharded on a later dimension, the segments
    of the saved rows its block holds), straight into it (:mod:`fp_core.loading.sharded_load`);
    other placements (``_StridedShard``) are refused naming the tensor, before a byte is
    read. Every rank of their meshes takes part in one exchange per load, so a rank whose
    load fails (before or during its reads) makes every other raise too. With ``verify``
    each rank checks what it reads, and each storage's checksum is put together from the
    ranks' pieces over the mesh (a collective: every rank of the mesh must call it).

    ``verify="auto"`` checks a file that carries FastPersist's checksums and loads one
    without them (written by another tool) unchecked, where ``verify=True`` refuses it
    (:class:`NotAFastPersistCheckpoint`).

    A safetensors file (a ``model.safetensors``, FastPersist's or ``save_file``'s) fills
    the targets in the same way, its tensors named by their keys: each read straight in,
    a DTensor's local shard only its own rows or block; checked against the CRC-32C
    FastPersist writes into its header (:mod:`fp_core.loading.sharded_load_safetensors`).

    ``stats``: a :class:`~fp_core.loading.sharded_load.LoadIntoStats` to be filled with the bytes read.
    """
    if verify not in (True, False, "auto"):
        raise ValueError(f"verify must be True, False or 'auto', not {verify!r}")
    m = _Matcher(target)
    if stats is not None:
        m.stats = stats
    m.meshes = target_meshes(target)
    try:
        result = _load_into(m, path, verify, weights_only)
    except Exception as e:
        if m.meshes and not m.exchanged:  # the other ranks of the meshes wait for this one's word
            m.exchanged = True
            exchange(os.fspath(path), m.meshes, [{} for _ in m.meshes], e)
        raise
    if m.meshes and not m.exchanged:  # read whole and copied: no reads to report, but the others wait
        m.exchanged = True
        exchange(os.fspath(path), m.meshes, [{} for _ in m.meshes], None)
    _write_back(target, result)
    m.restore()
    return result


def _write_back(target: Any, result: Any) -> None:
    """After the read, the target's own dicts and lists hold what the result holds: the
    file's values that are no tensors (an optimizer state dict's ``param_groups``, so its
    lr), the state created for a fresh optimizer; keys the file lacks are removed. So
    ``load_into(state, path); optimizer.load_state_dict(state["optim"])`` restores the
    file's optimizer, not the live hyperparameters. Tensors filled in place are the same
    objects and stay; immutable containers (tuples) are replaced in their parent."""
    if _mutable_map(target) and _map(result):
        if not result.keys() >= target.keys():
            for k in [k for k in target if k not in result]:
                del target[k]
        get = target.get
        for k in [k for k, r in result.items() if get(k, _ABSENT) is not r]:  # most are the same tensors
            t, r = get(k, _ABSENT), result[k]
            if (_mutable_map(t) and _map(r)) or (type(t) is list and type(r) is list):
                _write_back(t, r)
            elif not _is_stateful(t):  # an object keeps its place: it was handed its state
                target[k] = r
    elif type(target) is list and isinstance(result, (list, tuple)):
        if len(target) != len(result):
            target[:] = result
            return
        for i, (t, r) in enumerate(zip(target, result)):
            if t is r:
                continue
            if (_mutable_map(t) and _map(r)) or (type(t) is list and type(r) is list):
                _write_back(t, r)
            elif not _is_stateful(t):
                target[i] = r


def _map(x: Any) -> bool:
    return type(x) is dict or isinstance(x, Mapping)  # the ABC's check only for other types: it is slow


def _mutable_map(x: Any) -> bool:
    return type(x) is dict or isinstance(x, MutableMapping)


def _load_into(target: _Matcher, path: str | os.PathLike, verify: bool | str, weights_only: bool | None) -> Any:
    """:func:`load_into` once its target is unwrapped: the fill, no ``load_state_dict``."""
    if not file_image.applies(None):
        # no offsets from torch's headers here: load it whole (checked there) and copy
        return _load_and_copy(target, path, verify, weights_only)
    with CheckpointFile(path) as cf:
        if safetensors_file.looks_like(cf):  # a model.safetensors: its header says where each tensor lies
            saved, records, sizes = sharded_load_safetensors.structure(cf, verify)
            result = target.run(saved)
            _read_fills(cf, records, target.fills, sizes, target)
            return result
        if verify == "auto":  # checked where the file has a manifest, as loader.load does
            try:
                read_manifest(cf, check_tail=False, check_records=False)
            except NotAFastPersistCheckpoint:
                verify = False
        if not verify:
            with damage_named(cf):  # a load that fails on a damaged file says so
                return _fill(cf, None, target, path, weights_only, _unchecked_layout(cf))
        with gc_paused():  # see gc_pause: the zip directory's entries, the manifest's records
            view = read_manifest(cf, check_records=False)  # its tail's CRC held
            check_records_against_directory(cf, view)  # the storages' offsets are the manifest's
        try:
            small = read_small_records(cf, view)  # the pickle, checked before it is unpickled
        except CorruptCheckpointError:
            check_zip_structure(cf, view)  # a damaged structure is named first, as everywhere
            raise
        # The zip's local headers (each against its record's offset in the manifest) and the
        # rest of its structure are checked beside the reads, their scattered small reads in
        # the time the reads wait for the disk, not before them; a damaged structure is
        # still the error raised.
        def check_structure(stop: threading.Event) -> None:
            check_records_against_zip(cf, view)
            check_zip_structure(cf, view, stop)

        structure = Beside(check_structure, "fastpersist-verify-structure")
        try:
            result = _fill(cf, view, target, path, weights_only, (view, small), structure.start)
        except BaseException as e:
            interrupted = not isinstance(e, Exception)
            damaged = structure.error(stop=interrupted)
            if isinstance(damaged, CorruptCheckpointError) and not interrupted:
                raise damaged from e
            raise
        structure.result()
        return result


Layout = tuple[ManifestView, dict[str, bytes]]  # a manifest, and its records other than storages


def _unchecked_layout(cf: CheckpointFile) -> Layout | None:
    """For a load without ``verify``: the manifest and the pickle, where the tail's CRC and
    the pickle's hold and the records fit the zip's directory; None for anything else (a
    file of another tool, damage: the load then reads the zip's own headers, as torch)."""
    try:
        with gc_paused():
            view = read_manifest(cf, check_records=False)
            check_records_against_directory(cf, view)
        return view, read_small_records(cf, view)
    except (CorruptCheckpointError, NotAFastPersistCheckpoint):
        return None


def _fill(cf: CheckpointFile, view: ManifestView | None, target: _Matcher, path: str | os.PathLike,
          weights_only: bool | None, layout: Layout | None = None,
          before_reads: Callable[[], None] = lambda: None) -> Any:
    """load_into's work once the file is open. ``view``: the manifest, checked, that every
    record read is checked against (``verify``). ``layout``: where the storages lie and the
    pickle, from a manifest whose checksums held: then the reads start without reading
    thousands of local headers first, each a small cold read (a verified load checks
    them beside its reads); without one, from the zip's headers."""
    verify = view is not None
    wo = file_image.resolve_weights_only(weights_only)
    # See gc_pause: a full collection among the objects built here (the zip directory's
    # entries, the structure, the fills) costs more than building them; the read after
    # builds none.
    with gc_paused():
        saved = NotImplemented
        entries = cf.zip_directory()[0]
        first = entries[0].filename if entries else ""
        if layout is not None and "/" in first:  # else torch's reader refuses the file: let it say so
            archive = first.partition("/")[0]
            storages = [r for r in layout[0].manifest.records if r.kind == "storage"]
            saved = plain_unpickle.structure(plain_unpickle.RecordBytes(_in_archive(layout[1], archive)),
                                             _in_archive({r.name: r.offset for r in storages}, archive))
            if saved is not NotImplemented:
                result = target.run(saved)
                fills = target.fills
                sizes = {r.offset: r.size for r in storages}
    if saved is not NotImplemented:
        before_reads()
        _read_fills(cf, view, fills, sizes, target)
        return result
    with gc_paused():
        # every storage's data offset, its local header read in one scatter read
        entries = file_image.storage_entries(cf)
        offsets = cf.data_offsets(entries)
        if view is not None:  # verified: the headers torch's reader follows, before it unpickles
            check_records_against_zip(cf, view)
        sizes = {off: info.file_size for info, off in zip(entries, offsets)}
        with FastReader(cf, prefetch=False) as f, torch.serialization._open_zipfile_reader(f) as zf:
            swapped = zf.has_record("byteorder") and \
                zf.get_record("byteorder").decode(errors="replace") != sys.byteorder
            if not swapped:
                saved = plain_unpickle.structure(zf, _under_archive(cf, entries, offsets))
                if saved is NotImplemented:  # torch's unpickler; the headers it reads are cached ahead
                    f.prefetch_small_reads()
                    saved = _meta_structure(zf, wo, cf.path)
                result = target.run(saved)
                fills = target.fills
    if swapped:
        return _load_and_copy(target, path, verify, weights_only)  # torch.load swaps its bytes
    before_reads()
    _read_fills(cf, view, fills, sizes, target)
    return result


def _meta_structure(zf: Any, weights_only: bool, path: str) -> Any:
    """The file's structure from torch's unpickler, every storage on the meta device. A
    tensor the pickle declares that torch cannot build (a negative size, a size whose
    product overflows, strides that do not fit) is the file's damage, not a bug here:
    :class:`CorruptCheckpointError` naming the path, torch's error chained."""
    try:
        return file_image.unpickle(zf, _keep_on_meta, weights_only, _MetaSlices(), path)
    except (RuntimeError, ValueError, OverflowError, IndexError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(path, "data.pkl", f"a tensor it declares does not build: "
                                     f"{type(e).__name__}: {e}") from e


def _load_and_copy(target: _Matcher, path: str | os.PathLike, verify: bool, weights_only: bool | None) -> Any:
    """``load_into`` through a whole load and a copy into each target (checked there)."""
    saved = loader.load(path, map_location="cpu", weights_only=weights_only, verify=verify)
    result = target.run(saved)
    with torch.no_grad():
        for f in target.fills:
            f.target.copy_(f.source)
    st = target.stats
    st.tensors += len(target.fills)
    st.tensor_bytes += sum(f.target.nbytes for f in target.fills)
    st.whole_file = True
    return result


def _read_fills(cf: CheckpointFile, view: ManifestView | None, fills: list[_Fill], sizes: dict[int, int],
                matcher: _Matcher) -> None:
    """``sizes``: data offset -> size of every storage record, from the zip's own headers."""
    records = {r.offset: r for r in view.manifest.records if r.kind == "storage"} if view is not None else {}
    # DTensor targets: every rank of their meshes exchanges once (a failed read is raised
    # on all); verified, the storages whose checksums their meshes' ranks put together
    meshes: list[Any] = list(matcher.meshes)
    keys = [mesh_key(m) for m in meshes]
    combined: dict[int, int] = {}  # record offset -> index of its mesh
    for mesh, off, _, tiles in matcher.sharded:
        k = mesh_key(mesh)
        if k not in keys:  # a mesh the target's walk did not find (the same on every rank)
            meshes.append(mesh)
            keys.append(k)
        if view is not None and tiles and off in records:
            combined.setdefault(off, keys.index(k))
    pieces: list[dict[int, list[tuple[int, int, int]]]] = [{} for _ in meshes]

    def piece(f: _Fill, crc: int) -> None:
        i = combined.get(f.record[0])
        if i is not None and f.shard is not None and f.shard.contributes:
            pieces[i].setdefault(f.record[0], []).append((f.offset, f.nbytes, crc))

    stats = matcher.stats
    checked: set[int] = set()
    error: Exception | None = None
    try:
        seen: set[tuple[int, int, int]] = set()
        direct, copied = [], []
        for f in fills:
            start, size = f.record
            if sizes.get(start) != size or not start <= f.offset <= f.offset + f.nbytes <= start + size:
                raise CorruptCheckpointError(cf.path, "data.pkl", f"tensor {f.key}: the pickle asks for {size} storage "
                                             f"bytes at byte {start}, where no storage record of that size lies")
            t = f.target
            src = f.source
            # the span's bytes are the tensor's memory as it is: both row-major, or one dense
            # layout of the same strides (a created tensor of a channels-last parameter's state)
            if t.device.type == "cpu" and ((t.is_contiguous() and src.is_contiguous())
                                           or (t.stride() == src.stride and src.is_dense())):
                k = (t.data_ptr(), f.offset, f.nbytes)
                if k not in seen:  # tied weights: one tensor under two keys
                    seen.add(k)
                    direct.append(f)
            else:
                copied.append(f)
        with cf.native_reader() as reader:
            crcs = read_depth.scatter(reader, [(f.offset, f.target.data_ptr(), f.nbytes) for f in direct],
                                      view is not None)
            stats.tensors += sum(f.counts for f in direct)
            stats.tensor_bytes += sum(f.nbytes for f in direct)
            for f, crc in zip(direct, crcs):
                piece(f, crc)
                if (f.offset, f.nbytes) == f.record and f.record[0] in records:
                    check_crc(cf.path, records[f.record[0]], crc)
                    checked.add(f.record[0])
            for f in copied:
                if f.shard is not None:  # only the shard's span, not the whole storage
                    off, size, first = f.offset, f.nbytes, 0
                else:
                    (off, size), first = f.record, f.source.storage_offset
                host = torch.empty(size, dtype=torch.uint8)
                crc = reader.read_into(off, host.data_ptr(), size, checksum=view is not None,
                                       threads=read_depth.THREADS, chunk_bytes=read_depth.CHUNK)
                stats.tensors += f.counts
                stats.tensor_bytes += size
                piece(f, crc)
                if (off, size) == f.record and off in records:
                    check_crc(cf.path, records[off], crc)
                    checked.add(off)
                src = torch.empty(0, dtype=f.source.dtype).set_(host.untyped_storage(), first,
                                                                  f.source.shape, f.source.stride)
                with torch.no_grad():
                    f.target.copy_(src)
    except Exception as e:
        if not meshes:
            raise
        error = e  # the other ranks of the meshes are told in the exchange, so that all raise
    if meshes:
        matcher.exchanged = True
        merged = exchange(cf.path, meshes, pieces, error)
        for off, i in combined.items():
            if off in checked:
                continue
            r = records[off]
            crc = combined_crc(off, r.size, merged[i].get(off, []))
            if crc is not None:  # else the ranks' rows leave a gap: checked whole below
                check_crc(cf.path, r, crc)
                checked.add(off)
    if view is not None:  # records only partly read into targets are checked whole here
        rest = [r for off, r in records.items() if off not in checked]
        if rest:
            stats.check_bytes += sum(r.size for r in rest)
            check_storages(cf, view, rest)


__all__ = ["load_into"]
