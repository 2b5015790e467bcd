"""Tests of the FastPersist core: save / load / verify / inspect / clean (issue: core foundation)."""

from __future__ import annotations

import collections
import errno
import gc
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zipfile

import numpy as np
import pytest
import torch
from conftest import (
    HELPERS,
    GiB,
    MiB,
    assert_identical,
    assert_no_temps,
    fd_count,
    rss_bytes,
    tensor_bytes,
    thread_count,
)

import fp_core
from fp_core import CheckpointSerializationError, CorruptCheckpointError, NotAFastPersistCheckpoint

Point = collections.namedtuple("Point", "x y")


class Custom:
    """An arbitrary picklable object (module-level so pickle can find it)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __eq__(self, other):
        return type(other) is Custom and self.a == other.a and self.b == other.b


def load_both(path: str, weights_only: bool = False):
    """The checkpoint read by torch.load and by fp_core.load (plain and verifying)."""
    return (
        torch.load(path, weights_only=weights_only),
        fp_core.load(path, weights_only=weights_only),
        fp_core.load(path, weights_only=weights_only, verify=True),
    )


def roundtrip(obj, path: str, weights_only: bool = False, **opts):
    stats = fp_core.save(obj, path, **opts)
    assert os.path.getsize(path) == stats.bytes
    fp_core.verify(path)
    for got in load_both(path, weights_only=weights_only):
        assert_identical(obj, got)
    assert_no_temps(os.path.dirname(path))
    return stats


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


# ====================================================================== round trips


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


# ====================================================================== backends


@pytest.mark.parametrize("backend", ["io_uring", "threadpool", "buffered"])
def test_each_backend_forced_on_disk(disk_dir, backend):
    g = torch.Generator().manual_seed(2)
    obj = {"a": torch.randn(3 * MiB // 4 + 5, generator=g), "b": torch.randn(100, generator=g), "c": [1, "x"]}
    st = roundtrip(
        obj, os.path.join(disk_dir, f"{backend}.pt"), backend=backend, chunk_bytes=1 * MiB, queue_depth=4
    )
    assert st.backend == backend
    assert st.backend_reason == ""


def test_auto_backend_on_dev_shm(shm_dir, record_property):
    obj = {"a": torch.randn(1 * MiB + 3), "b": [torch.arange(3)]}
    st = roundtrip(obj, os.path.join(shm_dir, "auto.pt"), backend="auto")
    assert st.backend in ("io_uring", "threadpool", "buffered")
    record_property("shm_backend", f"{st.backend} ({st.backend_reason or 'first choice'})")
    print(f"auto backend on /dev/shm: {st.backend} {st.backend_reason!r}")


def test_odirect_refused_falls_back_to_buffered_and_logs(disk_dir, fault, caplog, fresh_fallback_log):
    fault("o_direct")
    obj = {"a": torch.randn(300_000), "b": 1}
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        st = roundtrip(obj, os.path.join(disk_dir, "od.pt"), backend="auto")
    assert st.backend == "buffered"
    assert "O_DIRECT" in st.backend_reason
    lines = [r.getMessage() for r in caplog.records if "buffered" in r.getMessage()]
    assert lines and "O_DIRECT" in lines[0], caplog.text


def test_odirect_refused_with_forced_direct_backend_is_an_error(disk_dir, fault):
    fault("o_direct")
    path = os.path.join(disk_dir, "od_forced.pt")
    with pytest.raises(OSError) as ei:
        fp_core.save({"a": torch.randn(10)}, path, backend="io_uring")
    assert ei.value.errno == errno.EINVAL
    assert path in str(ei.value)
    assert not os.path.exists(path)
    assert_no_temps(disk_dir)


def test_io_uring_setup_failure_falls_back_to_threadpool(disk_dir, fault, caplog, fresh_fallback_log):
    fault("io_uring_setup", errno=errno.ENOSYS)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        st = roundtrip({"a": torch.randn(500_000)}, os.path.join(disk_dir, "ring.pt"), backend="auto")
    assert st.backend == "threadpool"
    assert "io_uring" in st.backend_reason
    assert any("threadpool" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("backend", ["io_uring", "threadpool", "buffered"])
def test_short_writes_still_byte_exact(disk_dir, fault, backend):
    fault("short_write")
    g = torch.Generator().manual_seed(3)
    obj = {"a": torch.randn(2 * MiB // 4 + 7, generator=g), "b": torch.arange(1000), "c": "x"}
    st = roundtrip(obj, os.path.join(disk_dir, "short.pt"), backend=backend, chunk_bytes=256 * 1024)
    assert st.short_writes > 0


def test_small_chunks_and_deep_queue(disk_dir):
    g = torch.Generator().manual_seed(4)
    obj = [torch.randn(n, generator=g) for n in (1, 1023, 1024, 1025, 65537, 300_001)]
    roundtrip(
        obj,
        os.path.join(disk_dir, "chunks.pt"),
        chunk_bytes=4096,
        queue_depth=64,
        copy_threads=3,
        io_threads=3,
    )


def test_page_aligned_tensors_are_written_without_staging(disk_dir):
    """Storages whose memory is aligned like their file offset skip the staging copy."""
    page = 4096
    raw = np.empty(8 * MiB + 3 * page, dtype=np.uint8)
    aligned = raw[-raw.ctypes.data % page:]
    a = torch.from_numpy(aligned[: 4 * MiB + 100]).view(torch.uint8)
    a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
    # b sits 64 bytes past a page on purpose: torch's own allocator usually gives page + 64
    # but may hand back a page-aligned block (CI once did), which would be written directly.
    b = torch.from_numpy(aligned[4 * MiB + page + 64: 4 * MiB + page + 64 + 4 * 300_001]).view(torch.float32)
    b.copy_(torch.randn(300_001, generator=torch.Generator().manual_seed(6)))
    assert b.data_ptr() % page == 64
    stats = roundtrip({"a": a, "b": b}, os.path.join(disk_dir, "aligned.pt"))
    assert 4 * MiB <= stats.extra["zero_copy_bytes"] <= 4 * MiB + 100


@pytest.mark.parametrize("offset,addr,length", [
    (8192, 4096 * 7, 3 * 4096 + 10),  # congruent, aligned start: middle + tail
    (8192 + 64, 4096 * 7 + 64, 5 * 4096),  # congruent, head + middle + tail
    (8192, 4096 * 7 + 64, 5 * 4096),  # not congruent: one extent
    (8192 + 64, 4096 * 7 + 64, 4096),  # too short for a whole block
])
def test_split_congruent_tiles_the_extent(offset, addr, length):
    from fp_core.writer import split_congruent
    parts = split_congruent(offset, addr, length, 4096)
    pos = offset
    for off, ad, n in parts:
        assert off == pos and ad - addr == off - offset and n > 0
        pos += n
    assert pos == offset + length
    aligned = [p for p in parts if p[0] % 4096 == 0 and p[1] % 4096 == 0 and p[2] % 4096 == 0]
    assert len(aligned) == (1 if (addr - offset) % 4096 == 0 and length - (-offset % 4096) >= 4096 else 0)


# ====================================================================== error cases


def _old_checkpoint(path: str) -> dict:
    old = {"old": torch.arange(1000, dtype=torch.float32), "tag": "old"}
    fp_core.save(old, path)
    return old


def _assert_old_intact(path: str, old: dict) -> None:
    assert_no_temps(os.path.dirname(path))
    fp_core.verify(path)
    assert_identical(old, torch.load(path))
    assert_identical(old, fp_core.load(path, verify=True))


@pytest.mark.parametrize("bad", ["lambda", "lock", "local_class"])
def test_unpicklable_object_is_a_serialization_error(disk_dir, bad):
    path = os.path.join(disk_dir, "ckpt.pt")
    old = _old_checkpoint(path)

    class Local:
        pass

    member = {"lambda": lambda x: x, "lock": threading.Lock(), "local_class": Local()}[bad]
    with pytest.raises(CheckpointSerializationError) as ei:
        fp_core.save({"w": torch.randn(10), "bad": member}, path)
    assert path in str(ei.value)
    assert isinstance(ei.value, TypeError)
    _assert_old_intact(path, old)


def test_missing_directory(disk_dir):
    missing = os.path.join(disk_dir, "no", "such")
    path = os.path.join(missing, "ckpt.pt")
    with pytest.raises(FileNotFoundError) as ei:
        fp_core.save({"a": torch.randn(3)}, path)
    assert ei.value.errno == errno.ENOENT
    assert missing in str(ei.value)
    assert not os.path.exists(os.path.join(disk_dir, "no"))
    assert_no_temps(disk_dir)


def test_path_is_a_directory(disk_dir):
    path = os.path.join(disk_dir, "ckpt.pt")
    os.makedirs(path)
    open(os.path.join(path, "inside"), "w").close()
    with pytest.raises(IsADirectoryError) as ei:
        fp_core.save({"a": torch.randn(3)}, path)
    assert ei.value.errno == errno.EISDIR
    assert path in str(ei.value)
    assert os.listdir(path) == ["inside"]
    assert_no_temps(disk_dir)


def test_parent_is_a_file(disk_dir):
    parent = os.path.join(disk_dir, "file")
    open(parent, "w").close()
    path = os.path.join(parent, "ckpt.pt")
    with pytest.raises(NotADirectoryError) as ei:
        fp_core.save({"a": torch.randn(3)}, path)
    assert parent in str(ei.value)


def test_read_only_directory(ro_bind):
    src, ro = ro_bind()
    old = {"old": torch.arange(100), "tag": "old"}
    fp_core.save(old, os.path.join(src, "ckpt.pt"))
    path = os.path.join(ro, "ckpt.pt")
    with pytest.raises(OSError) as ei:
        fp_core.save({"new": torch.randn(100)}, path)
    assert ei.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    assert ro in str(ei.value)
    _assert_old_intact(path, old)


def _full_disk_case(directory: str, path: str, old: dict, exc_info) -> None:
    e = exc_info.value
    assert e.errno == errno.ENOSPC, e
    assert path in str(e)
    _assert_old_intact(path, old)


@pytest.mark.parametrize("backend", ["auto", "buffered"])
def test_full_disk_small_tmpfs(mount_tmpfs, backend):
    d = mount_tmpfs("8m")
    path = os.path.join(d, "ckpt.pt")
    old = _old_checkpoint(path)
    with pytest.raises(OSError) as ei:
        fp_core.save({"big": torch.ones(20 * MiB // 4)}, path, backend=backend)
    _full_disk_case(d, path, old, ei)
    # Space is back: the next save works.
    fp_core.save({"fits": torch.ones(1000)}, path, backend=backend)
    fp_core.verify(path)


def test_full_disk_injected(disk_dir, fault):
    path = os.path.join(disk_dir, "ckpt.pt")
    old = _old_checkpoint(path)
    fault("write", errno=errno.ENOSPC, after_bytes=1 * MiB)
    with pytest.raises(OSError) as ei:
        fp_core.save({"big": torch.ones(4 * MiB)}, path)
    _full_disk_case(disk_dir, path, old, ei)


@pytest.mark.parametrize("backend", ["io_uring", "threadpool", "buffered"])
@pytest.mark.parametrize("after", [0, 3 * MiB])
def test_injected_eio(disk_dir, fault, backend, after):
    path = os.path.join(disk_dir, "ckpt.pt")
    old = _old_checkpoint(path)
    fault("write", errno=errno.EIO, after_bytes=after)
    with pytest.raises(OSError) as ei:
        fp_core.save({"big": torch.ones(2 * MiB)}, path, backend=backend, chunk_bytes=1 * MiB)
    assert ei.value.errno == errno.EIO
    assert path in str(ei.value)
    assert ei.value.filename == path
    _assert_old_intact(path, old)


def test_unknown_options_and_format(disk_dir):
    path = os.path.join(disk_dir, "x.pt")
    with pytest.raises(TypeError):
        fp_core.save({}, path, no_such_option=1)
    with pytest.raises(ValueError):
        fp_core.save({}, path, backend="nope")
    with pytest.raises(ValueError):
        fp_core.save({}, path, format="pickle")
    with pytest.raises(ValueError):
        fp_core.save({}, path, chunk_bytes=1000)
    assert os.listdir(disk_dir) == []


# ====================================================================== integrity


def _model_ckpt(path: str) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    obj = {
        "model": {
            "layer": {"weight": torch.randn(256, 256, generator=g), "bias": torch.randn(256, generator=g)}
        },
        "step": 7,
    }
    fp_core.save(obj, path)
    return fp_core.inspect(path)


def _rec(records, tensor):
    return next(r for r in records if r.get("tensor") == tensor)


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _expect_corrupt(
    path: str, record: str | None = None, tensor: str | None = None, also_load: bool = True
) -> list[CorruptCheckpointError]:
    errs = []
    with pytest.raises(CorruptCheckpointError) as ei:
        fp_core.verify(path)
    errs.append(ei.value)
    if also_load:
        with pytest.raises(CorruptCheckpointError) as ei:
            fp_core.load(path, verify=True)
        errs.append(ei.value)
    for e in errs:
        assert e.path == path and path in str(e)
        if record is not None:
            assert e.record == record, str(e)
            assert record in str(e)
        if tensor is not None:
            assert e.tensor == tensor, str(e)
            assert tensor in str(e)
    return errs


def test_clean_checkpoint_verifies(disk_dir):
    path = os.path.join(disk_dir, "ok.pt")
    recs = _model_ckpt(path)
    rep = fp_core.verify(path)
    assert rep["records"] == len(recs)
    assert rep["bytes"] == os.path.getsize(path)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_tensor_data(disk_dir, where):
    path = os.path.join(disk_dir, "c.pt")
    w = _rec(_model_ckpt(path), "model.layer.weight")
    off = {"first": 0, "middle": w["size"] // 2 + 3, "last": w["size"] - 1}[where]
    _flip(path, w["offset"] + off)
    _expect_corrupt(path, record=w["name"], tensor="model.layer.weight")
    # Without verification the (damaged) data still loads: corruption is silent there.
    torch.load(path)


def test_zeroed_block_in_tensor_data(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    b = _rec(_model_ckpt(path), "model.layer.bias")
    w = _rec(fp_core.inspect(path), "model.layer.weight")
    _patch(path, w["offset"] + 4096 * 3, b"\0" * 4096)
    _expect_corrupt(path, record=w["name"], tensor="model.layer.weight")
    assert b["tensor"] == "model.layer.bias"


@pytest.mark.parametrize("keep", [0.5, "minus1", "minus100", "header_only"])
def test_truncated_file(disk_dir, keep):
    path = os.path.join(disk_dir, "c.pt")
    _model_ckpt(path)
    size = os.path.getsize(path)
    new = {0.5: size // 2, "minus1": size - 1, "minus100": size - 100, "header_only": 100}[keep]
    os.truncate(path, new)
    _expect_corrupt(path)


def test_extended_file(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    _model_ckpt(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    _expect_corrupt(path, also_load=False)


def test_flipped_byte_in_pickle(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    recs = _model_ckpt(path)
    pkl = next(r for r in recs if r["name"].endswith("/data.pkl"))
    _flip(path, pkl["offset"] + pkl["size"] // 2)
    errs = _expect_corrupt(path, record=pkl["name"])
    assert all(e.tensor is None for e in errs)


def test_flipped_byte_in_local_header(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    w = _rec(_model_ckpt(path), "model.layer.weight")
    _flip(path, w["offset"] - 20)  # padding in the record's extra field, before its data
    _expect_corrupt(path, record="<zip structure>")


def _tail_layout(path: str):
    with zipfile.ZipFile(path) as z:
        m = next(i for i in z.infolist() if i.filename.endswith(".fastpersist/manifest.json"))
        return m, z.start_dir


def test_flipped_byte_in_manifest(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    _model_ckpt(path)
    m, _ = _tail_layout(path)
    with open(path, "rb") as f:
        f.seek(m.header_offset)
        head = f.read(30)
    n, e = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    data_off = m.header_offset + 30 + n + e
    with open(path, "rb") as f:
        f.seek(data_off)
        text = f.read(m.file_size)
    pos = text.index(b'"crc32c":"') + len(b'"crc32c":"')  # a hex digit of a checksum
    _patch(path, data_off + pos, b"0" if text[pos : pos + 1] != b"0" else b"1")
    _expect_corrupt(path, record="<manifest and central directory>")


@pytest.mark.parametrize("field", ["mtime", "ext_attr", "eocd_comment_digit"])
def test_flipped_byte_in_central_directory(disk_dir, field):
    path = os.path.join(disk_dir, "c.pt")
    _model_ckpt(path)
    _, start_dir = _tail_layout(path)
    size = os.path.getsize(path)
    off = {"mtime": start_dir + 12, "ext_attr": start_dir + 38, "eocd_comment_digit": size - 3}[field]
    _flip(path, off)
    _expect_corrupt(path, record="<manifest and central directory>")


def test_verify_of_foreign_file(disk_dir):
    path = os.path.join(disk_dir, "torch.pt")
    obj = {"a": torch.randn(10), "b": [1, 2]}
    torch.save(obj, path)
    with pytest.raises(NotAFastPersistCheckpoint):
        fp_core.verify(path)
    assert_identical(obj, fp_core.load(path))  # loads without verification
    recs = fp_core.inspect(path)
    assert any(r["name"].endswith("data.pkl") for r in recs)
    junk = os.path.join(disk_dir, "junk.pt")
    with open(junk, "wb") as f:
        f.write(os.urandom(5000))
    with pytest.raises((CorruptCheckpointError, NotAFastPersistCheckpoint)):
        fp_core.verify(junk)


def test_inspect_lists_records(disk_dir):
    path = os.path.join(disk_dir, "i.pt")
    obj = {
        "model": {"w": torch.randn(10, 20), "h": torch.zeros(7, dtype=torch.float16)},
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.ones(3, dtype=torch.bool),
        "meta": "x",
    }
    fp_core.save(obj, path)
    recs = fp_core.inspect(path)
    by_tensor = {r["tensor"]: r for r in recs if r["kind"] == "storage"}
    assert by_tensor["model.w"]["dtype"] == "float32" and by_tensor["model.w"]["size"] == 800
    assert by_tensor["model.h"]["dtype"] == "float16" and by_tensor["model.h"]["size"] == 14
    assert by_tensor["ids"]["dtype"] == "int64" and by_tensor["ids"]["size"] == 40
    assert by_tensor["mask"]["dtype"] == "bool" and by_tensor["mask"]["size"] == 3
    names = [r["name"] for r in recs]
    assert any(n.endswith("/data.pkl") for n in names)
    # (zip CRC-32 fields are 0, as torch writes them with compute_crc32 off: compare raw bytes)
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for r in recs:
            info = z.getinfo(r["name"])
            assert info.file_size == r["size"]
            f.seek(info.header_offset)
            head = f.read(30)
            n, e = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
            assert info.header_offset + 30 + n + e == r["offset"], r
    for r in recs:
        if r["kind"] == "storage" and r["size"]:
            assert r["offset"] % 4096 == 0, r  # storages are block aligned


# ====================================================================== safetensors


def test_safetensors_roundtrip_and_metadata(disk_dir):
    from safetensors import safe_open
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(6)
    tensors = {
        "embed.weight": torch.randn(100, 64, generator=g),
        "layer.0.bias": torch.randn(64, generator=g).half(),
        "layer.0.scale": torch.randn(64, generator=g).to(torch.bfloat16),
        "ids": torch.arange(33, dtype=torch.int64),
        "mask": torch.ones(5, dtype=torch.bool),
        "transposed": torch.randn(16, 8, generator=g).t(),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 3),
        "u8": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
    }
    path = os.path.join(disk_dir, "model.safetensors")
    meta = {"format": "pt", "epoch": "3"}
    st = fp_core.save(tensors, path, format="safetensors", metadata=meta)
    assert st.bytes == os.path.getsize(path)
    got = load_file(path)
    assert list(got) == list(tensors) or set(got) == set(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert tensor_bytes(got[k]) == tensor_bytes(v), k
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == meta
    assert_no_temps(disk_dir)


def test_safetensors_rejects_non_flat_and_shared(disk_dir):
    path = os.path.join(disk_dir, "m.safetensors")
    with pytest.raises(TypeError):
        fp_core.save({"a": {"b": torch.ones(1)}}, path, format="safetensors")
    t = torch.ones(4)
    with pytest.raises((ValueError, TypeError)):
        fp_core.save({"a": t, "b": t}, path, format="safetensors")
    assert not os.path.exists(path)
    assert_no_temps(disk_dir)


# ====================================================================== atomic overwrite


def test_overwrite_replaces(disk_dir):
    path = os.path.join(disk_dir, "ckpt.pt")
    a = {"v": torch.full((1000,), 1.0), "tag": "a"}
    b = {"v": torch.full((3000,), 2.0), "tag": "b", "extra": [1]}
    fp_core.save(a, path)
    ino_a = os.stat(path).st_ino
    fp_core.save(b, path)
    assert os.stat(path).st_ino != ino_a  # a new file was renamed over it
    assert_identical(b, fp_core.load(path, verify=True))
    assert_identical(b, torch.load(path))
    assert sorted(os.listdir(disk_dir)) == ["ckpt.pt"]
    # A smaller file over a bigger one leaves no stale tail.
    fp_core.save(a, path)
    assert_identical(a, torch.load(path))
    fp_core.verify(path)


def _check_generation(path: str) -> int:
    fp_core.verify(path)
    for got in (torch.load(path), fp_core.load(path, verify=True)):
        g = got["gen"]
        assert got["tail"] == [g] * 3
        d = got["data"]
        assert torch.equal(d, torch.full_like(d, float(g)))
    return g


def _unnamed_file_open(pid: int, directory: str) -> bool:
    """Does process ``pid`` hold an unnamed (O_TMPFILE) file of ``directory`` open, i.e. is it
    in the middle of a save there? /proc shows such a file as '<dir>/#<inode> (deleted)'."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        links = [os.readlink(os.path.join(fd_dir, n)) for n in os.listdir(fd_dir)]
    except OSError:
        return False
    return any(t.startswith(os.path.join(directory, "#")) and t.endswith("(deleted)") for t in links)


def test_crash_mid_save_leaves_a_loadable_checkpoint_and_nothing_else(disk_dir):
    """SIGKILL a process that saves in a loop: the file under the name is always one whole
    generation, and nothing else is ever left in the directory (the file being written is
    unnamed until the instant it is renamed into place)."""
    rng = random.Random(1234)
    path = os.path.join(disk_dir, "crash.pt")
    mid_save = 0
    for i in range(10):
        p = subprocess.Popen(
            [sys.executable, os.path.join(HELPERS, "save_loop.py"), path, "24"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            first = p.stdout.readline()  # one durable save (or the child's crash)
            assert first.strip(), p.stderr.read()
            # Mostly random instants; every other kill lands just after a save started.
            delay = rng.uniform(0.0, 0.3) if i % 2 else rng.uniform(0.002, 0.03)
            if i % 2 == 0:
                p.stdout.readline()
            time.sleep(delay)
            mid_save += _unnamed_file_open(p.pid, disk_dir)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
            p.stdout.close()
            p.stderr.close()
        assert os.path.exists(path)
        assert _check_generation(path) >= 1
        assert sorted(os.listdir(disk_dir)) == ["crash.pt"]
    print(f"kills that landed mid-save: {mid_save} of 10")
    assert mid_save > 0, "no kill landed mid-save: the test did not test anything"
    assert fp_core.clean(disk_dir) == []


def _fake_orphan(directory: str, final_name: str, host: str | None = None) -> str:
    p = os.path.join(directory, f".{final_name}.{host or fp_core.commit._HOST}-4242-deadbeef.fptmp")
    with open(p, "wb") as f:
        f.write(b"partial" * 100)
    return p


def test_clean_removes_only_unheld_temps_named_as_ours(disk_dir):
    orphan = _fake_orphan(disk_dir, "a.pt")  # nobody holds it: its writer died
    live = _fake_orphan(disk_dir, "b.pt")
    fd = os.open(live, os.O_RDONLY)
    held = fp_core.commit.hold(fd)  # a writer still at work (whatever its pid)
    os.close(fd)
    other_host = _fake_orphan(disk_dir, "c.pt", host="otherhost")  # not ours to judge
    lookalikes = [".notes.fptmp", ".a.pt.fptmp", ".a.pt.host-1-xyz.fptmp", ".a.pt.host-1-deadbeef.fptmp.bak"]
    for n in lookalikes:
        open(os.path.join(disk_dir, n), "w").close()
    os.mkdir(os.path.join(disk_dir, ".d.pt.host-1-deadbeef.fptmp"))  # a directory, not a temp file
    os.symlink(orphan, os.path.join(disk_dir, f".e.pt.{fp_core.commit._HOST}-1-deadbeef.fptmp"))
    try:
        assert fp_core.clean(disk_dir) == [orphan]
        assert os.path.exists(live) and os.path.exists(other_host)
        assert all(os.path.exists(os.path.join(disk_dir, n)) for n in lookalikes)
        orphan2 = _fake_orphan(disk_dir, "a.pt")
        fp_core.save({"x": torch.ones(3)}, os.path.join(disk_dir, "a.pt"))
        fp_core.commit.wait_for_clean(disk_dir)  # the first save into a directory cleans it, off-thread
        assert not os.path.exists(orphan2), "the next save into the directory removes orphans"
        assert os.path.exists(live) and os.path.exists(other_host)
    finally:
        os.close(held)
    assert fp_core.clean(disk_dir) == [live]  # its writer let go


def test_clean_counts_only_what_it_removed(disk_dir):
    orphan = _fake_orphan(disk_dir, "a.pt")
    r = subprocess.run(["chattr", "+i", orphan], capture_output=True, text=True)  # unlink fails, even for root
    if r.returncode != 0:
        pytest.skip(f"cannot make a file immutable here: {r.stderr.strip()}")
    try:
        assert fp_core.clean(disk_dir) == []
        assert os.path.exists(orphan)
    finally:
        subprocess.run(["chattr", "-i", orphan], check=True)
    assert fp_core.clean(disk_dir) == [orphan]


def test_clean_recursive(disk_dir):
    sub = os.path.join(disk_dir, "sub", "deeper")
    os.makedirs(sub)
    o1 = _fake_orphan(disk_dir, "x.pt")
    o2 = _fake_orphan(sub, "y.pt")
    assert fp_core.clean(disk_dir) == [o1]
    assert os.path.exists(o2)
    assert fp_core.clean(disk_dir, recursive=True) == [o2]


def test_save_in_progress_never_shows_in_the_directory(disk_dir):
    """Lightning's test_none_monitor_not_alternating lists the directory mid-save: the file
    being written is unnamed until the commit links and renames it into place."""
    path = os.path.join(disk_dir, "big.pt")
    listings = []
    with fp_core.AsyncCheckpointer(policy="overlap") as ckpt:
        for _ in range(3):
            h = ckpt.save({"w": torch.randn(16 << 20)}, path)
            while not h._staged.is_set():  # the body is still being written: no commit yet
                listings.append(set(os.listdir(disk_dir)))
            h.result()
    assert len(listings) > 3
    assert all(seen <= {"big.pt"} for seen in listings), [s for s in listings if s - {"big.pt"}][:3]


def test_named_temp_files_where_o_tmpfile_is_refused(disk_dir, monkeypatch):
    """Where the filesystem refuses O_TMPFILE the save falls back to a named temporary file,
    held (flock) while written, and still leaves nothing behind."""
    from fp_core import commit

    monkeypatch.setitem(commit._TMPFILE_OK, os.stat(disk_dir).st_dev, False)
    path = os.path.join(disk_dir, "named.pt")
    seen: list[str] = []
    orig = commit.publish

    def spy(tmp: str, final: str) -> None:
        seen.append(tmp)
        assert commit._held(tmp), "the named temp file is held while its writer lives"
        orig(tmp, final)

    monkeypatch.setattr(commit, "publish", spy)
    fp_core.save({"w": torch.arange(1000)}, path)
    assert len(seen) == 1 and commit._TEMP_RE.match(os.path.basename(seen[0]))
    assert sorted(os.listdir(disk_dir)) == ["named.pt"]
    assert torch.equal(torch.load(path)["w"], torch.arange(1000))


# ====================================================================== resources


def test_200_saves_do_not_leak(disk_dir):
    obj = {"w": torch.randn(256 * 1024), "b": torch.randn(100), "m": {"k": [1, 2]}}
    path = os.path.join(disk_dir, "leak.pt")
    for _ in range(5):  # warm up: staging pool, engine threads, allocator
        fp_core.save(obj, path)
    gc.collect()
    fds, threads, rss = fd_count(), thread_count(), rss_bytes()
    for i in range(200):
        fp_core.save(obj, path, backend=("io_uring", "threadpool", "buffered", "auto")[i % 4])
    gc.collect()
    assert fd_count() == fds
    assert thread_count() == threads
    grown = rss_bytes() - rss
    assert grown < 64 * MiB, f"RSS grew by {grown / MiB:.1f} MiB over 200 saves"
    assert_no_temps(disk_dir)
    fp_core.verify(path)


def test_200_failed_saves_do_not_leak(disk_dir, fault):
    path = os.path.join(disk_dir, "leak.pt")
    obj = {"w": torch.randn(64 * 1024)}
    fp_core.save(obj, path)
    gc.collect()
    fds, threads = fd_count(), thread_count()
    for _ in range(100):
        fault("write", errno=errno.EIO)
        with pytest.raises(OSError):
            fp_core.save(obj, path)
    for _ in range(100):
        with pytest.raises(CheckpointSerializationError):
            fp_core.save({"w": obj["w"], "bad": lambda: 0}, path)
    gc.collect()
    assert fd_count() == fds
    assert thread_count() == threads
    assert_no_temps(disk_dir)
    assert_identical(obj, fp_core.load(path, verify=True))
