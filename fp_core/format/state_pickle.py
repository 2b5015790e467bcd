"""torch.save's pickle of a state dict, written without running a pickler per object.

torch.save pickles through a ``Pickler`` subclass whose Python ``persistent_id`` the C
pickler calls for *every* object it meets (about twenty per tensor: the tensor, its size
and stride tuples, their ints, the storage, ...) and whose tensors reduce through
``Tensor.__reduce_ex__``: most of a save's fixed cost for a checkpoint of thousands of
small tensors, and more than torch.save's own time to write them on a fast disk.

State dicts are made of a few kinds of object: dicts, ``OrderedDict``s, lists, tuples,
strings, numbers, ``None`` and plain CPU tensors. For those, :func:`dumps` emits the
opcodes protocol 2 of CPython's C pickler would emit for torch's pickler, memo numbering
included, so the bytes are torch's byte for byte (the tests compare the two on every kind
of object handled here). Any other object raises :class:`NotPlainState` and the caller
runs torch's own pickler instead: an unusual state is slower, never different.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

_BATCHSIZE = 1000  # pickle's batch size for APPENDS / SETITEMS
_PROTO2 = b"\x80\x02"
_STOP = b"."
_MARK, _TUPLE, _REDUCE, _BUILD = b"(", b"t", b"R", b"b"
_EMPTY_TUPLE, _EMPTY_DICT, _EMPTY_LIST = b")", b"}", b"]"
_SETITEM, _SETITEMS, _APPEND, _APPENDS = b"s", b"u", b"a", b"e"
_NONE, _TRUE, _FALSE = b"N", b"\x88", b"\x89"
_BINPERSID = b"Q"
_TUPLE_N = (b"", b"\x85", b"\x86", b"\x87")  # TUPLE1..3
_INT1, _INT2, _INT4, _FLOAT = struct.Struct("<cB").pack, struct.Struct("<cH").pack, struct.Struct("<ci").pack, \
    struct.Struct(">cd").pack
_STR_HEAD = struct.Struct("<cI").pack
_PUT1, _PUT4 = struct.Struct("<cB").pack, struct.Struct("<cI").pack
_PUTS = [_PUT1(b"q", i) for i in range(256)]  # BINPUT i
_GETS = [_PUT1(b"h", i) for i in range(256)]  # BINGET i
_SMALL_INTS = [_INT1(b"K", i) for i in range(256)]  # BININT1 i

# The objects torch's persistent_id and Tensor.__reduce_ex__ put into every tensor's
# pickle. The two strings are interned identifiers, so these literals are the very objects
# torch's code holds: the memo (keyed by object identity) treats them as torch's pickler does.
_STORAGE_TAG = "storage"
_CPU_TAG = "cpu"
_STORAGE_TAG_STR = _STR_HEAD(b"X", 7) + b"storage"
_CPU_TAG_STR = _STR_HEAD(b"X", 3) + b"cpu"
_REBUILD_V2 = torch._utils._rebuild_tensor_v2
_GLOBAL_REBUILD_V2 = b"ctorch._utils\n_rebuild_tensor_v2\n"
_GLOBAL_ORDERED_DICT = b"ccollections\nOrderedDict\n"
_UNTYPED_DTYPES = frozenset(torch.storage._new_dtypes())  # torch pickles these through _rebuild_tensor_v3
StorageEntry = tuple[torch.UntypedStorage, torch.dtype, int]  # storage, dtype, nbytes
_STORAGE_CLASSES: dict[torch.dtype, tuple[Any, bytes, int]] = {}  # dtype -> (class, GLOBAL opcode, itemsize)


_KEY, _INDEX = 0, 1  # kinds of step in a path


class NotPlainState(Exception):
    """The object holds something :func:`dumps` does not write; use torch's pickler."""


def plain_cpu_tensor(t: Any) -> bool:
    """Exactly ``torch.Tensor``, dense, strided, on the CPU, a legacy dtype, no Python
    attributes, hooks, conjugate or negative bit: the tensors whose reduction is a plain
    ``_rebuild_tensor_v2`` call."""
    return (type(t) is torch.Tensor and t.is_cpu and t.layout is torch.strided and not t.is_quantized
            and not t.is_nested and t.dtype not in _UNTYPED_DTYPES and not t._backward_hooks
            and not t.__dict__ and not t.is_conj() and not t.is_neg())


def _storage_class(dtype: torch.dtype) -> tuple[Any, bytes, int]:
    entry = _STORAGE_CLASSES.get(dtype)
    if entry is None:
        name = torch.storage._dtype_to_storage_type_map().get(dtype)
        if name is None:  # no legacy storage class: torch's own reduction decides
            raise NotPlainState(f"a tensor of {dtype}")
        entry = _STORAGE_CLASSES[dtype] = (getattr(torch, name), f"ctorch\n{name}\n".encode(), dtype.itemsize)
    return entry


class _Writer:
    __slots__ = ("out", "memo", "n", "storages", "keys", "dtypes", "ints_cache", "trail", "names", "on_storage")

    def __init__(self, on_storage: Callable[[str, StorageEntry], None] | None = None) -> None:
        self.on_storage = on_storage
        self.out = bytearray(_PROTO2)
        self.memo: dict[int, int] = {}  # id(object) -> memo index, as the C pickler's memo
        self.n = 0  # the next memo index
        self.storages: dict[str, StorageEntry] = {}  # record key -> storage, in torch's order
        self.keys: dict[int, str] = {}  # storage _cdata -> record key (torch's id_map; keeps the keys, memoised by id, alive)
        self.dtypes: dict[int, torch.dtype] = {}  # data_ptr -> dtype (torch's storage_dtypes)
        self.ints_cache: dict[tuple, bytes] = {}
        self.trail: list[tuple[int, Any]] = []  # (kind, dict key or index) down to the object being saved
        self.names: dict[int, tuple[str, str]] = {}  # storage _cdata -> (path of its first tensor, dtype)

    def path(self) -> str:
        """The object being saved as a path, the way plan.tensor_names writes it."""
        path = ""
        for kind, k in self.trail:
            path = f"{path}[{k}]" if kind is _INDEX else (f"{path}.{k}" if path else str(k))
        return path or "<root>"

    # -- the memo --------------------------------------------------------------------
    def put(self) -> None:
        n = self.n
        self.out += _PUTS[n] if n < 256 else _PUT4(b"r", n)
        self.n = n + 1

    def remember(self, obj: Any) -> None:
        self.memo[id(obj)] = self.n
        self.put()

    def recall(self, obj: Any) -> bool:
        i = self.memo.get(id(obj))
        if i is None:
            return False
        self.out += _GETS[i] if i < 256 else _PUT4(b"j", i)
        return True

    # -- objects ---------------------------------------------------------------------
    def save(self, obj: Any) -> None:
        t = type(obj)
        out = self.out
        if obj is None:
            out += _NONE
        elif t is bool:
            out += _TRUE if obj else _FALSE
        elif t is int:
            self.int_(obj)
        elif t is float:
            out += _FLOAT(b"G", obj)
        elif self.recall(obj):
            pass
        elif t is str:
            data = obj.encode("utf-8", "surrogatepass")
            out += _STR_HEAD(b"X", len(data))
            out += data
            self.remember(obj)
        elif t is torch.Tensor:
            self.tensor(obj)
        elif t is dict:
            out += _EMPTY_DICT
            self.remember(obj)
            self.dict_items_exact(obj)
        elif t is OrderedDict:
            self.ordered_dict(obj)
        elif t is list:
            out += _EMPTY_LIST
            self.remember(obj)
            self.list_items(obj)
        elif t is tuple:
            self.tuple_(obj)
        else:
            raise NotPlainState(f"{t.__module__}.{t.__qualname__}")

    def int_(self, v: int) -> None:
        self.out += self.int_bytes(v)

    @staticmethod
    def int_bytes(v: int) -> bytes:
        if 0 <= v <= 0xFF:
            return _SMALL_INTS[v]
        if 0 <= v <= 0xFFFF:
            return _INT2(b"M", v)
        if -0x80000000 <= v <= 0x7FFFFFFF:
            return _INT4(b"J", v)
        # LONG1 / LONG4, as pickle.encode_long
        nbytes = (v.bit_length() >> 3) + 1
        data = v.to_bytes(nbytes, "little", signed=True)
        if v < 0 and nbytes > 1 and data[-1] == 0xFF and data[-2] & 0x80:
            data = data[:-1]
        return ((b"\x8a" + bytes([len(data)])) if len(data) < 256 else struct.pack("<cI", b"\x8b", len(data))) + data

    def tuple_(self, obj: tuple) -> None:
        n = len(obj)
        if n == 0:
            self.out += _EMPTY_TUPLE  # never memoised
            return
        if n > 3:
            self.out += _MARK
        trail = self.trail
        for i, item in enumerate(obj):
            trail.append((_INDEX, i))
            self.save(item)
            trail.pop()
        self.out += _TUPLE_N[n] if n <= 3 else _TUPLE
        self.remember(obj)

    def list_items(self, obj: list) -> None:
        n = len(obj)
        trail = self.trail
        if n == 1:
            trail.append((_INDEX, 0))
            self.save(obj[0])
            trail.pop()
            self.out += _APPEND
            return
        for lo in range(0, n, _BATCHSIZE):
            self.out += _MARK
            for i, item in enumerate(obj[lo:lo + _BATCHSIZE], lo):
                trail.append((_INDEX, i))
                self.save(item)
                trail.pop()
            self.out += _APPENDS
        if len(obj) != n:
            raise NotPlainState("a list changed size while it was pickled")

    def item(self, k: Any, v: Any) -> None:
        self.save(k)
        trail = self.trail
        trail.append((_KEY, k))
        self.save(v)
        trail.pop()

    def dict_items_exact(self, obj: dict) -> None:
        # The C pickler's exact-dict loop: one item as SETITEM; otherwise batches of
        # 1000, and an empty batch after a last full one.
        n = len(obj)
        if n == 0:
            return
        if n == 1:
            for k, v in obj.items():
                self.item(k, v)
            self.out += _SETITEM
            return
        items = list(obj.items())
        lo = 0
        while True:
            batch = items[lo:lo + _BATCHSIZE]
            self.out += _MARK
            for k, v in batch:
                self.item(k, v)
            self.out += _SETITEMS
            lo += _BATCHSIZE
            if len(batch) != _BATCHSIZE:
                break
        if len(obj) != n:
            raise NotPlainState("a dict changed size while it was pickled")

    def ordered_dict(self, obj: OrderedDict) -> None:
        # OrderedDict.__reduce__: (OrderedDict, (), __dict__ or None, None, iter(items)).
        self.out += self.ref(OrderedDict, _GLOBAL_ORDERED_DICT) + _EMPTY_TUPLE + _REDUCE
        self.remember(obj)
        # The generic (iterator) loop: a batch of one item is a SETITEM, and no empty batch.
        items = list(obj.items())
        for lo in range(0, len(items), _BATCHSIZE):
            batch = items[lo:lo + _BATCHSIZE]
            if len(batch) == 1:
                self.item(*batch[0])
                self.out += _SETITEM
                continue
            self.out += _MARK
            for k, v in batch:
                self.item(k, v)
            self.out += _SETITEMS
        state = obj.__dict__
        if state:
            self.save(state)
            self.out += _BUILD

    def ints(self, values: tuple) -> bytes:
        """The opcodes of a fresh tuple of ints (a size or a stride) up to its TUPLE
        opcode; the caller memoises it (never recalled). Cached: a model's tensors share
        a few shapes."""
        enc = self.ints_cache.get(values)
        if enc is None:
            n = len(values)
            body = b"".join([self.int_bytes(v) for v in values])
            enc = self.ints_cache[values] = body + _TUPLE_N[n] if n <= 3 else _MARK + body + _TUPLE
        return enc

    def ref(self, obj: Any, first: bytes) -> bytes:
        """The opcodes that push ``obj``: a memo get, or ``first`` and a memo put."""
        i = self.memo.get(id(obj))
        if i is not None:
            return _GETS[i] if i < 256 else _PUT4(b"j", i)
        i = self.memo[id(obj)] = self.n
        self.n = i + 1
        return first + (_PUTS[i] if i < 256 else _PUT4(b"r", i))

    def tensor(self, t: torch.Tensor) -> None:
        # What save() of the tuple fast_tensor_reduce returns would emit, one opcode
        # string per part, the memo counted here rather than per call.
        if not plain_cpu_tensor(t):
            raise NotPlainState("a tensor that is not a plain dense CPU tensor")
        dtype = t.dtype
        cls, cls_global, itemsize = _STORAGE_CLASSES.get(dtype) or _storage_class(dtype)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and self.dtypes.setdefault(ptr, dtype) != dtype:
            raise NotPlainState("two tensors view the same data as different dtypes")  # torch raises
        cdata = storage._cdata
        key = self.keys.get(cdata)
        nbytes = storage.nbytes()
        if key is None:
            key = self.keys[cdata] = str(len(self.keys))  # torch's id_map numbering
            entry = self.storages[key] = (storage, dtype, nbytes)
            if self.on_storage is not None:
                self.on_storage(key, entry)
            self.names[cdata] = (self.path(), str(dtype).removeprefix("torch."))
            key_data = key.encode()
            key_first = _STR_HEAD(b"X", len(key_data)) + key_data
        else:
            key_first = b""  # memoised with its storage's first tensor
        ref = self.ref
        # ("storage", storage class, key, location, numel) and the persistent id opcode
        head = (ref(_REBUILD_V2, _GLOBAL_REBUILD_V2) + _MARK + _MARK + ref(_STORAGE_TAG, _STORAGE_TAG_STR)
                + ref(cls, cls_global) + ref(key, key_first) + ref(_CPU_TAG, _CPU_TAG_STR))
        numel = nbytes // itemsize
        offset = t.storage_offset()
        size, stride = t.size(), t.stride()
        n = self.n
        out = self.out
        out += head
        out += _SMALL_INTS[numel] if numel < 256 else self.int_bytes(numel)
        out += _TUPLE + (_PUTS[n] if n < 256 else _PUT4(b"r", n)) + _BINPERSID
        out += _SMALL_INTS[offset] if offset < 256 else self.int_bytes(offset)
        n += 1
        if size:
            out += self.ints(size) + (_PUTS[n] if n < 256 else _PUT4(b"r", n))
            n += 1
        else:
            out += _EMPTY_TUPLE
        if stride:
            out += self.ints(stride) + (_PUTS[n] if n < 256 else _PUT4(b"r", n))
            n += 1
        else:
            out += _EMPTY_TUPLE
        out += _TRUE if t.requires_grad else _FALSE
        self.n = n
        # A fresh, empty OrderedDict for the backward hooks; the arguments' tuple; REDUCE.
        out += ref(OrderedDict, _GLOBAL_ORDERED_DICT) + _EMPTY_TUPLE + _REDUCE
        n = self.n
        out += (_PUTS[n] if n < 256 else _PUT4(b"r", n)) + _TUPLE
        n += 1
        out += (_PUTS[n] if n < 256 else _PUT4(b"r", n)) + _REDUCE
        self.n = n + 1
        self.remember(t)


def dumps(obj: Any, names: dict[int, tuple[str, str]] | None = None,
          on_storage: Callable[[str, StorageEntry], None] | None = None) -> tuple[bytes, dict[str, StorageEntry]]:
    """``obj``'s pickle as torch.save writes it into ``data.pkl``, and its storages by
    record key in torch's order; :class:`NotPlainState` for anything else.

    ``names``: filled with storage ``_cdata`` -> (path of the first tensor on it, dtype),
    as ``plan.tensor_names`` finds them, for the manifest. ``on_storage(key, entry)`` is
    called for each storage as the pickle finds it, in key order (a sync save lays them out
    and writes them while the rest is pickled: :mod:`fp_core.saving.early_write`)."""
    w = _Writer(on_storage)
    try:
        w.save(obj)
    except RecursionError:
        raise NotPlainState("nested too deeply") from None
    w.out += _STOP
    if names is not None:
        names.update(w.names)
    return bytes(w.out), w.storages
