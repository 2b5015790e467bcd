"""Hostile checkpoints for ``load_into`` and the targets that catch a stray write.

A *lying* file holds one storage record of 64 x 8 float32 (2048 bytes) under ``w`` and a
pickle that declares something else about it: a larger or smaller shape, other strides,
a storage offset, another dtype, more or fewer elements than the record holds, sizes that
are negative or overflow. It is written by FastPersist (a valid manifest: every checksum
holds, so only the declared structure lies) or by ``torch.save``; ``directory_lies``
edits a file's zip central directory so that it states another size for the record.

A *fenced* target is a tensor (or a DTensor's local shard) that is a view into a larger
tensor whose bytes around it are a sentinel: after a load, :func:`fence_intact` says
whether anything was written outside the target.
"""

from __future__ import annotations

import collections
import contextlib
import struct
import zipfile
from collections.abc import Iterator
from typing import Any

import torch
from torch.storage import TypedStorage

ROWS, COLS = 64, 8  # what the storage record holds, as float32
PAD = 3  # rows of sentinel before and after each fenced target
SENTINEL = -7777.0

_LIES: dict[int, int] = {}  # id(TypedStorage) -> the element count its pickle declares


@contextlib.contextmanager
def _lying_sizes() -> Iterator[None]:
    """While saving: a storage in ``_LIES`` declares that many elements in its persistent
    id (torch's pickler asks ``_size()``), whatever its record holds."""
    orig = TypedStorage._size
    TypedStorage._size = lambda self: _LIES.get(id(self)) or orig(self)  # type: ignore[method-assign]
    try:
        yield
    finally:
        TypedStorage._size = orig  # type: ignore[method-assign]
        _LIES.clear()


class _Declared:
    """Pickles as ``_rebuild_tensor_v2(storage, offset, size, stride)``: any view, true or not."""

    def __init__(self, storage: TypedStorage, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (storage, offset, size, stride)

    def __reduce_ex__(self, proto: int) -> tuple:
        return torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict())


def record() -> torch.Tensor:
    """The bytes the record holds: 64 x 8 float32, each element distinct."""
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 0.5


# name -> (declared dtype, declared element count of the storage or None for the true one,
#          storage offset, shape, stride, what a load must do: "corrupt" or "loads")
CASES: dict[str, tuple[str, int | None, int, tuple, tuple, str]] = {
    "larger shape": ("float32", None, 0, (80, 8), (8, 1), "corrupt"),
    "smaller shape (a view of part of the storage)": ("float32", None, 0, (48, 8), (8, 1), "loads"),
    "wider rows": ("float32", None, 0, (64, 9), (9, 1), "corrupt"),
    "strides past the record": ("float32", None, 0, (64, 8), (16, 1), "corrupt"),
    "storage offset past the record": ("float32", None, 600, (64, 8), (8, 1), "corrupt"),
    "storage offset pushes rows past": ("float32", None, 256, (64, 8), (8, 1), "corrupt"),
    "storage offset inside (a view)": ("float32", None, 256, (32, 8), (8, 1), "loads"),
    "more elements than the record holds": ("float32", 1024, 0, (128, 8), (8, 1), "corrupt"),
    "fewer elements than the record holds": ("float32", 256, 0, (32, 8), (8, 1), "corrupt"),
    "a wider dtype than the record holds": ("float64", 512, 0, (64, 8), (8, 1), "corrupt"),
    "a wider dtype, its shape in the record": ("float64", None, 0, (32, 8), (8, 1), "loads"),
    "negative size": ("float32", None, 0, (-1, 8), (8, 1), "corrupt"),
    "overflowing size": ("float32", None, 0, (2**62, 2**3), (8, 1), "corrupt"),
    "negative stride": ("float32", None, 504, (64, 8), (-8, 1), "corrupt"),
    "negative storage offset": ("float32", None, -8, (64, 8), (8, 1), "corrupt"),
}


def write_lying(path: str, case: str, writer: str) -> None:
    """The file of ``case`` (see :data:`CASES`), by ``writer``: "fastpersist" or "torch"."""
    import fp_core

    dtype, numel, offset, shape, stride, _ = CASES[case]
    untyped = record().untyped_storage()
    storage = TypedStorage(wrap_storage=untyped, dtype=getattr(torch, dtype), _internal=True)
    with _lying_sizes():
        if numel is not None:
            _LIES[id(storage)] = numel
        state = {"w": _Declared(storage, offset, shape, stride), "epoch": 3}
        if writer == "fastpersist":
            fp_core.save(state, path)
        else:
            torch.save(state, path)


def declared(case: str) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a target of ``case`` has (a target that matches the lie), where
    the shape is one a tensor can have; else 64 x 8 float32."""
    dtype, _, _, shape, _, _ = CASES[case]
    if any(n < 0 for n in shape) or any(n > 2**20 for n in shape):
        return (ROWS, COLS), torch.float32
    return tuple(shape), getattr(torch, dtype)


def directory_lies(src: str, dst: str, delta: int) -> None:
    """A copy of ``src`` whose zip central directory states the size of the first storage
    record ``delta`` bytes larger (or smaller) than it is, both of its size fields."""
    raw = bytearray(open(src, "rb").read())
    with zipfile.ZipFile(src) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith(".json"))
    cd = raw.index(b"PK\x01\x02")  # the central directory's first entry
    name = info.filename.encode()
    at = raw.index(name, cd) - 46  # the entry's fixed part precedes its name
    assert raw[at:at + 4] == b"PK\x01\x02"
    csize, usize = struct.unpack_from("<II", raw, at + 20)
    if csize != 0xFFFFFFFF:
        struct.pack_into("<II", raw, at + 20, csize + delta, usize + delta)
    else:  # zip64: the sizes are in the extra field
        n, e = struct.unpack_from("<HH", raw, at + 28)
        extra = at + 46 + n
        pos = extra
        while pos < extra + e:
            tag, size = struct.unpack_from("<HH", raw, pos)
            if tag == 1:
                u, c = struct.unpack_from("<QQ", raw, pos + 4)
                struct.pack_into("<QQ", raw, pos + 4, u + delta, c + delta)
                break
            pos += 4 + size
    open(dst, "wb").write(bytes(raw))


def fenced(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, the tensor it is a view into): ``PAD`` rows of sentinel before and after."""
    rows = shape[0] if shape else 1
    inner = tuple(shape[1:])
    big = torch.full((rows + 2 * PAD, *inner), _sentinel(dtype), dtype=dtype)
    view = big[PAD:PAD + rows]
    return (view if shape else view.reshape(())), big


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return True
    return SENTINEL if dtype.is_floating_point or dtype.is_complex else 77  # 77 fits every integer dtype


def fence_intact(big: torch.Tensor, rows: int) -> bool:
    """Whether the sentinel rows around a fenced target of ``rows`` rows hold the sentinel."""
    s = _sentinel(big.dtype)
    return bool((big[:PAD] == s).all()) and bool((big[PAD + rows:] == s).all())


def outcome(fn: Any, *args: Any, **kwargs: Any) -> str:
    """"" where ``fn(*args, **kwargs)`` returned, else the error's type and message."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return ""
