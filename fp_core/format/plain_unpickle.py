"""torch's unpickler for plain checkpoints, without its per-tensor cost.

A loader here needs torch.load's result, or (``load_into``) only the structure with each
tensor's place in the file. torch's unpickler gives both, but for a state of thousands of
tensors it is much of a load's CPU time: its weights-only unpickler is a Python loop over
every opcode, and each rebuilt tensor asks whether a fake tensor mode is active. Here
Python's C unpickler reads the same pickle, and only a short list of globals resolves:
``collections.OrderedDict``, ``_codecs.encode`` (bytes), ``torch._utils._rebuild_tensor_v2``
(answered by a function doing what torch's does outside tracing) and torch's legacy
storage classes (resolved, as torch's unpicklers do, to a ``StorageType`` that carries the
dtype of each persistent id and cannot be called). A pickle naming anything else, or a
tensor with hooks or extra metadata, is not plain: :func:`unpickle` returns
``NotImplemented`` and the caller uses torch's own unpickler, which gives the file its
usual answer (its refusals included). The names are a subset of torch's weights-only
allowlist: no code runs here that ``weights_only=True`` would not run. The opcodes are
Python's, a few more pure-data forms than torch's weights-only unpickler reads; only
protocol 2 pickles (what torch.save writes) are taken, which leaves the protocol-0 spellings
of lists, dicts, numbers and strings among them: data, never code.

:func:`structure` reads the same pickles for ``load_into``, which needs only where each
tensor's bytes lie: a :class:`SavedTensor` per tensor (its storage's offset in the file,
dtype, view), no tensor built, each view checked to lie in its storage.
"""

from __future__ import annotations

import codecs
import collections
import io
import math
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# torch.save tags each storage with its legacy class (``torch.FloatStorage``...); torch's
# unpicklers resolve those names to a ``StorageType`` that only carries the dtype (not the
# class: a pickle may not construct storages), and so does this one.
_StorageType = getattr(torch.serialization, "StorageType", None)
_STORAGE_NAMES = frozenset((
    "BFloat16Storage", "BoolStorage", "ByteStorage", "CharStorage", "ComplexDoubleStorage", "ComplexFloatStorage",
    "DoubleStorage", "FloatStorage", "HalfStorage", "IntStorage", "LongStorage", "ShortStorage",
))


class NotPlain(Exception):
    """The pickle needs torch's own unpickler."""


StorageAt = Callable[[str, int, str], torch.UntypedStorage]


class _PlainUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storage_at: StorageAt) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._storage_at = storage_at
        self._storages: dict[str, torch.storage.TypedStorage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "_codecs" and name == "encode":  # how protocol 2 pickles bytes
            return codecs.encode
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_NAMES and _StorageType is not None:
            return _StorageType(name)
        raise NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        dtype, key, location, numel = _storage_id(pid)
        st = self._storages.get(key)
        if st is None:  # tensors of one storage share it, as torch's do
            untyped = self._storage_at(key, numel * torch._utils._element_size(dtype), location)
            st = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
            self._storages[key] = st
        return st


def _storage_id(pid: Any) -> tuple[torch.dtype, str, str, int]:
    """``(dtype, key, location, numel)`` of torch.save's persistent id of a storage."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise NotPlain("persistent id")
    _, storage_type, key, location, numel = pid
    if (_StorageType is None or not isinstance(storage_type, _StorageType) or type(key) is not str
            or type(location) is not str or type(numel) is not int or numel < 0):
        raise NotPlain("persistent id")
    return storage_type.dtype, key, location, numel


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                    backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` outside tracing, for tensors without hooks or metadata."""
    if not isinstance(storage, torch.storage.TypedStorage) or backward_hooks or metadata:
        raise NotPlain("tensor")
    t = torch.empty((0,), dtype=storage.dtype, device=storage._untyped_storage.device)
    t.set_(storage._untyped_storage, storage_offset, size, stride)
    t.requires_grad = requires_grad
    t._backward_hooks = backward_hooks  # as torch's: the (empty) OrderedDict of the file
    return t


@dataclass(frozen=True)
class SavedTensor:
    """A tensor of the file, not read: where its storage's bytes lie in the file and how
    the tensor views them (what ``load_into`` needs of each, without building a tensor)."""

    offset: int  # of its storage's bytes in the file
    storage_nbytes: int
    dtype: torch.dtype
    storage_offset: int  # in elements, as torch's
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def element_size(self) -> int:
        return itemsize(self.dtype)

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """As torch's: strides of a dense row-major layout, sizes of 1 aside; empty is contiguous."""
        if 0 in self.shape:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def is_dense(self) -> bool:
        """Its elements fill a span of its storage without gaps or overlap, in any order
        of dimensions (a permuted layout, such as channels-last, is dense): a tensor of the
        same strides holds the span's bytes as they are."""
        return is_dense(self.shape, self.stride)


def is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view of ``shape`` and ``stride`` covers its span exactly once (torch's
    non-overlapping-and-dense); an empty view is."""
    if 0 in shape:
        return True
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class _SavedStorage:
    offset: int
    nbytes: int
    dtype: torch.dtype


_ITEMSIZE: dict[torch.dtype, int] = {}


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (torch's own answer, kept: it builds a finfo or iinfo
    each time, and a structure asks once per tensor)."""
    n = _ITEMSIZE.get(dtype)
    if n is None:
        n = _ITEMSIZE[dtype] = torch._utils._element_size(dtype)
    return n


def _saved_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                  backward_hooks: Any, metadata: Any = None) -> SavedTensor:
    """``_rebuild_tensor_v2`` for :func:`structure`: the view, checked to lie in its storage
    as torch's ``set_`` checks it; anything else is not plain (torch's unpickler answers)."""
    if (type(storage) is not _SavedStorage or backward_hooks or metadata or type(requires_grad) is not bool
            or type(storage_offset) is not int or storage_offset < 0 or type(size) is not tuple
            or type(stride) is not tuple or len(size) != len(stride)):
        raise NotPlain("tensor")
    last, numel = storage_offset, 1  # the view's last element, and how many it has
    for n, st in zip(size, stride):
        if type(n) is not int or type(st) is not int or n < 0 or st < 0:
            raise NotPlain("tensor")
        last += (n - 1) * st
        numel *= n
    if numel and (last + 1) * itemsize(storage.dtype) > storage.nbytes:
        raise NotPlain("tensor outside its storage")
    return SavedTensor(storage.offset, storage.nbytes, storage.dtype, storage_offset, size, stride)


class _StructureUnpickler(_PlainUnpickler):
    """The pickle's object with a :class:`SavedTensor` for each tensor."""

    def __init__(self, data: bytes, offsets: Mapping[str, int]) -> None:
        super().__init__(data, lambda *a: None)
        self._offsets = offsets
        self._saved: dict[str, _SavedStorage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _saved_tensor
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        dtype, key, _, numel = _storage_id(pid)
        st = self._saved.get(key)
        if st is None:
            offset = self._offsets.get(f"data/{key}")
            if offset is None:
                raise NotPlain(f"no record data/{key}")
            st = self._saved[key] = _SavedStorage(offset, numel * itemsize(dtype), dtype)
        elif st.dtype != dtype:  # torch's unpickler refuses one storage under two dtypes too
            raise NotPlain("a storage under two dtypes")
        return st


class RecordBytes:
    """Records already read (name under the archive -> bytes), in the two calls of torch's
    zip reader that :func:`structure` and :func:`unpickle` make."""

    def __init__(self, records: Mapping[str, bytes]) -> None:
        self._records = records

    def has_record(self, name: str) -> bool:
        return name in self._records

    def get_record(self, name: str) -> bytes:
        return self._records[name]


def structure(zf: Any, offsets: Mapping[str, int]) -> Any:
    """The object pickled in ``zf`` with a :class:`SavedTensor` in place of each tensor
    (``offsets``: record name under the archive, ``data/<key>``, to its data's offset in
    the file); ``NotImplemented`` where the pickle is not plain (see the module) or the
    file is not little-endian."""
    return _unpickle_with(zf, lambda data: _StructureUnpickler(data, offsets))


def unpickle(zf: Any, storage_at: StorageAt) -> Any:
    """The object pickled in ``zf`` (torch's zip reader of a checkpoint), each storage from
    ``storage_at(key, nbytes, location)`` (which raises :class:`NotPlain` for one it cannot
    give); ``NotImplemented`` where the pickle is not plain (see the module) or the file is
    not little-endian."""
    return _unpickle_with(zf, lambda data: _PlainUnpickler(data, storage_at))


def _unpickle_with(zf: Any, unpickler: Callable[[bytes], pickle.Unpickler]) -> Any:
    try:
        if zf.has_record("byteorder") and zf.get_record("byteorder") != b"little":
            return NotImplemented
        data = zf.get_record("data.pkl")
        if not data.startswith(b"\x80\x02"):  # torch.save's protocol; any other is torch's to read
            return NotImplemented
        return unpickler(data).load()
    except Exception:  # noqa: BLE001 - anything the fast path cannot read is torch's to answer
        return NotImplemented
