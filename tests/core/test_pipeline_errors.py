"""AsyncCheckpointer's errors: a background failure is raised exactly once, at the next call (or by
its handle); errors raised by save() itself; a failing on_commit callback."""

from __future__ import annotations

import errno
import os
import shutil
import time

import pytest
import torch
from _util import big_obj
from conftest import assert_no_temps

import fp_core
from fp_core import AsyncCheckpointer, AsyncCheckpointError


def _fail_one_save(ckpt, disk_dir, fault, name="bad.pt"):
    path = os.path.join(disk_dir, name)
    fault("write", errno=errno.EIO)
    h = ckpt.save(big_obj(8), path)
    h._done.wait(30)  # wait without reporting
    assert h.done()
    return path, h


def _assert_async_error(e: AsyncCheckpointError, path: str) -> None:
    cause = e.__cause__
    assert isinstance(cause, OSError), repr(cause)
    assert cause.errno == errno.EIO
    assert path in str(cause)
    assert path in str(e)


@pytest.mark.parametrize("surface", ["save", "fence", "wait", "close", "wait_for"])
def test_background_error_raised_once_at_the_next_call(disk_dir, fault, surface):
    ckpt = AsyncCheckpointer(backend="buffered")
    try:
        path, h = _fail_one_save(ckpt, disk_dir, fault)
        time.sleep(0.05)
        with pytest.raises(AsyncCheckpointError) as ei:
            if surface == "save":
                ckpt.save(big_obj(1), os.path.join(disk_dir, "next.pt"))
            elif surface == "fence":
                ckpt.fence()
            elif surface == "wait":
                ckpt.wait()
            elif surface == "wait_for":
                ckpt.wait_for(path)
            else:
                ckpt.close()
        _assert_async_error(ei.value, path)
        assert not os.path.exists(path)
        assert_no_temps(disk_dir)
        # Exactly once: later calls are clean.
        if surface != "close":
            ckpt.fence()
            ckpt.wait()
            h2 = ckpt.save(big_obj(1), os.path.join(disk_dir, "after.pt"))
            ckpt.wait()
            assert h2.result().bytes > 0
    finally:
        ckpt.close()


def test_fence_right_after_failure_raises(disk_dir, fault):
    """Once handle.done() is True the failure must be visible to fence() (no race)."""
    misses = 0
    for i in range(30):
        ckpt = AsyncCheckpointer(backend="buffered")
        raised = 0
        try:
            _fail_one_save(ckpt, disk_dir, fault, name=f"bad{i}.pt")
            try:
                ckpt.fence()
                misses += 1
            except AsyncCheckpointError:
                raised += 1
        finally:
            try:
                ckpt.close()
            except AsyncCheckpointError:
                raised += 1
        assert raised == 1, "the failure must be raised exactly once"
    assert misses == 0, f"{misses}/30 fences right after a failed save finished did not raise"


def test_handle_result_raises_and_counts_as_reported(disk_dir, fault):
    with AsyncCheckpointer(backend="buffered") as ckpt:
        path, h = _fail_one_save(ckpt, disk_dir, fault)
        with pytest.raises(AsyncCheckpointError) as ei:
            h.result()
        _assert_async_error(ei.value, path)
        assert isinstance(h.exception(), OSError)
        with pytest.raises(AsyncCheckpointError):
            h.result()  # the handle keeps saying so
        ckpt.fence()  # ...but the checkpointer does not raise it a second time
        ckpt.wait()
    assert not os.path.exists(path)
    assert_no_temps(disk_dir)


def test_directory_removed_under_a_save(disk_dir):
    d = os.path.join(disk_dir, "sub")
    os.makedirs(d)
    path = os.path.join(d, "x.pt")
    ckpt = AsyncCheckpointer(backend="buffered")
    try:
        h = ckpt.save(big_obj(64), path)
        shutil.rmtree(d)
        with pytest.raises(AsyncCheckpointError) as ei:
            ckpt.wait()
        assert isinstance(ei.value.__cause__, OSError)
        assert ei.value.__cause__.errno == errno.ENOENT
        assert h.done()
        assert not os.path.exists(path)
    finally:
        ckpt.close()


def test_serialization_error_raised_by_save_itself(disk_dir):
    with AsyncCheckpointer() as ckpt:
        with pytest.raises(fp_core.CheckpointSerializationError):
            ckpt.save({"bad": lambda: 0}, os.path.join(disk_dir, "x.pt"))
        assert not ckpt.pending()
        assert_no_temps(disk_dir)
        with pytest.raises(FileNotFoundError):
            ckpt.save({}, os.path.join(disk_dir, "missing", "x.pt"))


def test_on_commit_error_is_surfaced(disk_dir):
    def boom(p, s):
        raise ValueError("callback failed")

    ckpt = AsyncCheckpointer()
    ckpt.save({"x": torch.ones(3)}, os.path.join(disk_dir, "x.pt"), on_commit=boom)
    with pytest.raises(AsyncCheckpointError) as ei:
        ckpt.close()
    assert isinstance(ei.value.__cause__, ValueError)


def test_wait_for_raises_as_soon_as_the_handle_is_done(disk_dir, fault, monkeypatch):
    """The worker is preempted right after finishing a failed save's handle (emulated with a
    sleep): wait_for(path) must still raise, not return as if the save were durable."""
    call = "wait_for"
    orig = fp_core.Handle._finish

    def slow_finish(self, result=None, error=None):
        orig(self, result, error)
        time.sleep(0.2)

    monkeypatch.setattr(fp_core.Handle, "_finish", slow_finish)
    ckpt = AsyncCheckpointer(backend="buffered")
    raised = []
    try:
        path, h = _fail_one_save(ckpt, disk_dir, fault)
        try:
            ckpt.wait_for(path)
        except AsyncCheckpointError:
            raised.append(call)
    finally:
        try:
            ckpt.close()
        except AsyncCheckpointError:
            raised.append("close")
    assert raised == [call], f"the failed save of {path} was reported by {raised}"
