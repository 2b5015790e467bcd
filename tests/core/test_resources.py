"""Resources of synchronous saves: many saves, and many failed saves, leak no file descriptors,
threads or memory."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch
from conftest import MiB, assert_identical, assert_no_temps, fd_count, rss_bytes, thread_count

import fp_core
from fp_core import CheckpointSerializationError


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
