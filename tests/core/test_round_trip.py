"""Round trips through fp_core.save / load (and torch.load): nested containers and arbitrary
objects, shared storage and views, non-contiguous, zero-dim and empty tensors, every dtype, numpy
arrays, a tensor over 4 GiB (zip64)."""

from __future__ import annotations

import collections
import gc
import os
import zipfile

import numpy as np
import pytest
import torch
from _util import load_both, roundtrip
from conftest import GiB, assert_identical

import fp_core

Point = collections.namedtuple("Point", "x y")


class Custom:
    """An arbitrary picklable object (module-level so pickle can find it)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __eq__(self, other):
        return type(other) is Custom and self.a == other.a and self.b == other.b


def rand_tensor(shape, dtype, gen=None) -> torch.Tensor:
    """Random bit patterns of any dtype (bool: 0/1 only)."""
    n = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


ALL_DTYPES = [
    getattr(torch, n)
    for n in [
        "float16",
        "float32",
        "float64",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "bool",
        "complex32",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    ]
    if hasattr(torch, n)
]


def test_nested_containers_and_arbitrary_objects(disk_dir):
    g = torch.Generator().manual_seed(0)
    obj = {
        "model": {
            "layer": {"weight": torch.randn(64, 32, generator=g), "bias": torch.randn(32, generator=g)}
        },
        "list": [1, 2.5, "three", None, b"bytes", [torch.arange(7), (torch.ones(3, dtype=torch.int16),)]],
        "tuple": (True, {"deep": torch.zeros(2, 2, dtype=torch.float64)}),
        "point": Point(torch.tensor([1.0, 2.0]), Point(3, "y")),
        "custom": Custom([1, 2], {"k": (3, 4)}),
        "set": {1, 2, 3},
        "frozen": frozenset({"a"}),
        "ordered": collections.OrderedDict([("b", 1), ("a", torch.tensor(5))]),
        "complex": 1 + 2j,
        "big_int": 2**100,
        "slice": slice(1, 10, 2),
        "requires_grad": torch.randn(4, requires_grad=True, generator=g),
        "param": torch.nn.Parameter(torch.randn(3, 3, generator=g)),
        "empty_dict": {},
        "empty_list": [],
    }
    roundtrip(obj, os.path.join(disk_dir, "nested.pt"))


def test_weights_only_load_of_plain_state(disk_dir):
    obj = {"w": torch.randn(10, 10), "meta": {"epoch": 3, "names": ["a", "b"]}, "t": (1, 2)}
    roundtrip(obj, os.path.join(disk_dir, "wo.pt"), weights_only=True)


def test_shared_storage_and_views_are_stored_once_and_alias_on_load(disk_dir):
    base = torch.arange(1000, dtype=torch.float32)
    obj = {
        "base": base,
        "view": base[100:200],
        "strided": base[::3],
        "reshaped": base.view(10, 100),
        "again": base,  # same tensor object twice
        "other": torch.arange(5, dtype=torch.int64),
    }
    path = os.path.join(disk_dir, "shared.pt")
    roundtrip(obj, path)
    storages = [r for r in fp_core.inspect(path) if r["kind"] == "storage"]
    assert len(storages) == 2, storages  # base's storage once, 'other' once
    assert sorted(r["size"] for r in storages) == [5 * 8, 1000 * 4]
    for got in load_both(path):
        b = got["base"]
        ptr = b.untyped_storage().data_ptr()
        for k in ("view", "strided", "reshaped", "again"):
            assert got[k].untyped_storage().data_ptr() == ptr, k
        assert got["view"].data_ptr() == b.data_ptr() + 100 * 4
        assert got["again"] is b or got["again"].data_ptr() == b.data_ptr()
        b[150] = -1.0  # aliasing is live: a write through one name shows through the others
        assert got["view"][50].item() == -1.0
        assert got["reshaped"][1, 50].item() == -1.0
        assert got["strided"][50].item() == -1.0


def test_non_contiguous_tensors(disk_dir):
    g = torch.Generator().manual_seed(1)
    m = torch.randn(33, 17, generator=g)
    obj = {
        "t": m.t(),
        "slice": m[:, 3:9],
        "step": m[::2, ::5],
        "expanded": torch.randn(1, 5, generator=g).expand(4, 5),
        "permuted": torch.randn(2, 3, 4, 5, generator=g).permute(3, 1, 0, 2),
        "channels_last": torch.randn(2, 3, 8, 8, generator=g).to(memory_format=torch.channels_last),
        "neg_offset_view": m[5:, 7:][::3],
    }
    for v in obj.values():
        assert not v.is_contiguous()
    roundtrip(obj, os.path.join(disk_dir, "noncontig.pt"))


def test_zero_dim_and_zero_size_tensors(disk_dir):
    obj = {
        "scalar": torch.tensor(3.25),
        "scalar_int": torch.tensor(7, dtype=torch.int64),
        "scalar_bool": torch.tensor(True),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 5, dtype=torch.float16),
        "empty_3d": torch.zeros(3, 0, 2, dtype=torch.int32),
        "empty_view": torch.arange(10.0)[5:5],
        "only_empty": [torch.empty(0, dtype=torch.uint8)],
    }
    roundtrip(obj, os.path.join(disk_dir, "zero.pt"))
    # A checkpoint made only of empty tensors, and one with no tensors at all.
    roundtrip({"e": torch.empty(0)}, os.path.join(disk_dir, "all_empty.pt"))
    roundtrip({"x": 1, "y": [2, 3]}, os.path.join(disk_dir, "no_tensors.pt"))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype(disk_dir, dtype):
    g = torch.Generator().manual_seed(hash(str(dtype)) % 1000)
    obj = {
        "odd": rand_tensor((37,), dtype, g),  # byte length not a multiple of anything
        "block": rand_tensor((4096 + 3,), dtype, g),
        "scalar": rand_tensor((), dtype, g),
        "nc": rand_tensor((6, 10), dtype, g).t(),
    }
    roundtrip(obj, os.path.join(disk_dir, "dtype.pt"))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_inspect_reports_each_dtype(disk_dir, dtype):
    path = os.path.join(disk_dir, "dtype.pt")
    fp_core.save({"t": torch.zeros(5, dtype=dtype)}, path)
    dtypes = [r["dtype"] for r in fp_core.inspect(path) if r["kind"] == "storage"]
    assert dtypes == [str(dtype).removeprefix("torch.")]


def test_numpy_arrays_inside_the_object(disk_dir):
    rng = np.random.default_rng(0)
    obj = {
        "f32": rng.standard_normal((5, 7)).astype(np.float32),
        "i64": np.arange(100, dtype=np.int64),
        "bool": rng.integers(0, 2, 17).astype(bool),
        "fortran": np.asfortranarray(rng.standard_normal((4, 3))),
        "rec": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
        "scalar": np.float64(2.5),
        "tensor": torch.randn(8),
    }
    path = os.path.join(disk_dir, "np.pt")
    fp_core.save(obj, path)
    fp_core.verify(path)
    for got in load_both(path, weights_only=False):
        assert_identical(obj, got)


def _crc(t: torch.Tensor) -> int:
    from fp_core import _native

    assert t.is_contiguous() and t.dtype == torch.uint8
    return _native.crc32c_addr(t.data_ptr(), t.numel())


@pytest.mark.slow
def test_tensor_over_4gib_is_zip64_correct(disk_dir):
    n = int(4.5 * GiB)
    big = torch.empty(n, dtype=torch.uint8)  # untouched pages read as zeros: cheap
    marks = {0: 11, 1: 22, (4 << 30) - 1: 33, 4 << 30: 44, (4 << 30) + 1: 55, n // 2: 66, n - 1: 77}
    for pos, v in marks.items():
        big[pos] = v
    want_crc = _crc(big)
    small = torch.arange(10, dtype=torch.int32)
    path = os.path.join(disk_dir, "big.pt")
    st = fp_core.save({"big": big, "small": small, "after": "tail"}, path)
    assert st.bytes == os.path.getsize(path) > n
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    assert [i.file_size for i in infos].count(n) == 1, "the 4.5 GiB record's size needs zip64"
    assert any(i.header_offset > (4 << 30) for i in infos), "records after it need zip64 offsets"
    recs = fp_core.inspect(path)
    assert any(r["size"] == n and r["tensor"] == "big" for r in recs)

    # torch.load (mmap: reads only the pages we touch) finds the data at the zip64 offsets.
    got = torch.load(path, mmap=True)
    assert got["after"] == "tail"
    assert_identical(small, got["small"])
    assert got["big"].shape == big.shape
    for pos, v in marks.items():
        assert got["big"][pos].item() == v, pos
    del got
    # fp_core.load with verification: every byte checked against the manifest, then compared.
    got = fp_core.load(path, verify=True)
    assert got["after"] == "tail"
    assert_identical(small, got["small"])
    for pos, v in marks.items():
        assert got["big"][pos].item() == v, pos
    assert _crc(got["big"]) == want_crc
    del got
    gc.collect()
