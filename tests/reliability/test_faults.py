"""Fault injection across the core: write faults at every stage, read faults on load/verify."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from conftest import MiB, assert_identical, assert_no_temps

import fp_core
from fp_core import AsyncCheckpointer, AsyncCheckpointError


def _obj():
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(3 * MiB // 4 + 11, generator=g),
        "b": torch.randn(1000, generator=g),
        "c": [1, "x"],
    }


@pytest.mark.parametrize("backend", ["io_uring", "threadpool", "buffered"])
@pytest.mark.parametrize("after", [0, 4096, 1 * MiB, 3 * MiB])
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC, errno.EDQUOT])
def test_write_fault_anywhere_keeps_old_checkpoint(disk_dir, fault, backend, after, err):
    path = os.path.join(disk_dir, "ckpt.pt")
    old = {"old": torch.arange(100)}
    fp_core.save(old, path)
    fault("write", errno=err, after_bytes=after)
    with pytest.raises(OSError) as ei:
        fp_core.save(_obj(), path, backend=backend, chunk_bytes=512 * 1024)
    assert ei.value.errno == err
    assert ei.value.filename == path and path in str(ei.value)
    assert_no_temps(disk_dir)
    assert_identical(old, fp_core.load(path, verify=True))
    # one-shot: the next save succeeds
    obj = _obj()
    fp_core.save(obj, path, backend=backend)
    assert_identical(obj, fp_core.load(path, verify=True))


@pytest.mark.parametrize("after", [0, 2 * MiB])
def test_read_fault_on_load_and_verify(disk_dir, fault, after):
    path = os.path.join(disk_dir, "ckpt.pt")
    obj = _obj()
    fp_core.save(obj, path)
    for call in (
        lambda: fp_core.load(path),
        lambda: fp_core.load(path, verify=True),
        lambda: fp_core.verify(path),
    ):
        fault("read", errno=errno.EIO, after_bytes=after)
        with pytest.raises(OSError) as ei:
            call()
        assert ei.value.errno == errno.EIO
        assert path in str(ei.value)
        fault(None)
    assert_identical(obj, fp_core.load(path, verify=True))


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_async_write_fault_each_policy(disk_dir, fault, policy):
    path = os.path.join(disk_dir, "a.pt")
    old = {"old": torch.arange(10)}
    fp_core.save(old, path)
    with AsyncCheckpointer(policy=policy) as ckpt:
        fault("write", errno=errno.EIO, after_bytes=1 * MiB)
        h = ckpt.save(_obj(), path)
        with pytest.raises(AsyncCheckpointError) as ei:
            ckpt.wait()
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.EIO
        assert h.done()
        obj = _obj()
        ckpt.save(obj, path)
    assert_identical(obj, fp_core.load(path, verify=True))
    assert_no_temps(disk_dir)


def test_short_writes_async(disk_dir, fault):
    fault("short_write")
    path = os.path.join(disk_dir, "s.pt")
    obj = _obj()
    with AsyncCheckpointer(chunk_bytes=256 * 1024) as ckpt:
        h = ckpt.save(obj, path)
    assert h.result().short_writes > 0
    assert_identical(obj, fp_core.load(path, verify=True))
    assert_identical(obj, torch.load(path))


def test_unknown_fault_kind_rejected():
    from fp_core import _native

    with pytest.raises(ValueError):
        _native.inject_fault("nope")
    with pytest.raises(ValueError):
        _native.inject_fault("write", errno=0)
