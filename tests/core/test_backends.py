"""The write backends (io_uring, threadpool, buffered, auto): each forced, the fallbacks and their
log lines, short writes, chunking and queue depth, zero-copy writes of page-aligned memory."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest
import torch
from _util import roundtrip
from conftest import MiB, assert_no_temps

import fp_core


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
    from fp_core.io.writer import split_congruent
    parts = split_congruent(offset, addr, length, 4096)
    pos = offset
    for off, ad, n in parts:
        assert off == pos and ad - addr == off - offset and n > 0
        pos += n
    assert pos == offset + length
    aligned = [p for p in parts if p[0] % 4096 == 0 and p[1] % 4096 == 0 and p[2] % 4096 == 0]
    assert len(aligned) == (1 if (addr - offset) % 4096 == 0 and length - (-offset % 4096) >= 4096 else 0)
