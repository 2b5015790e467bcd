"""Failed saves: unpicklable objects, bad paths, read-only and full file systems, injected I/O
errors, unknown options. Each error names the file, and the previous checkpoint stays intact."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import torch
from conftest import MiB, assert_identical, assert_no_temps

import fp_core
from fp_core import CheckpointSerializationError


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


def _io_uring_stalls_after(disk_dir: str, monkeypatch, seconds: float) -> None:
    """The stall watchdog's limit set to ``seconds``; the test skipped without io_uring."""
    monkeypatch.setenv("FASTPERSIST_URING_STALL_S", str(seconds))
    with fp_core._native.Engine(os.path.join(disk_dir, "probe.bin"), backend="io_uring") as eng:
        if eng.backend != "io_uring":
            pytest.skip(f"no io_uring here: {eng.backend_reason}")
    os.unlink(os.path.join(disk_dir, "probe.bin"))


@pytest.mark.parametrize("size", [2 * MiB, 48 * MiB])  # 48 MiB: the stall hits the early write
def test_a_write_that_never_completes_is_written_again_not_a_hang(disk_dir, fault, monkeypatch, caplog, size):
    """An io_uring write whose completion never comes (seen once in Lightning's suite): after
    FASTPERSIST_URING_STALL_S the engine gives up on its ring and the save writes the file
    again through the pwrite pool, in a new temporary file, and succeeds."""
    _io_uring_stalls_after(disk_dir, monkeypatch, 0.5)
    path = os.path.join(disk_dir, "ckpt.pt")
    _old_checkpoint(path)
    fault("lose_completion")
    new = {"big": torch.arange(size // 4, dtype=torch.float32), "tag": "new"}
    with caplog.at_level("WARNING", logger="fastpersist"):
        st = fp_core.save(new, path, backend="io_uring")
    assert "stopped answering" in caplog.text and path in caplog.text
    assert st.backend == "threadpool"
    assert_identical(new, fp_core.load(path, verify=True))
    assert_no_temps(disk_dir)
    newer = {"new": torch.arange(10)}
    fp_core.save(newer, path)  # a new engine, io_uring again
    assert_identical(newer, fp_core.load(path, verify=True))


def test_a_stalled_write_from_the_tensors_own_memory_is_written_again_in_a_new_file(disk_dir, fault, monkeypatch,
                                                                                      caplog):
    """A request given up on was writing straight from a tensor (zero-copy): should it
    complete later, it would write what the tensor holds by then, and a tail request past
    the file's end. So the save is written again in a new temporary file (the old one
    dropped, where late writes land unread), through the pwrite pool."""
    _io_uring_stalls_after(disk_dir, monkeypatch, 0.5)
    path = os.path.join(disk_dir, "ckpt.pt")
    _old_checkpoint(path)
    raw = np.empty(8 * MiB + 4096, dtype=np.uint8)  # a page-aligned tensor: written zero-copy
    big = torch.from_numpy(raw[(-raw.ctypes.data) % 4096:][:8 * MiB]).view(torch.float32)
    big.fill_(1.5)
    fault("lose_completion", after_bytes=2 * MiB)
    with caplog.at_level("INFO", logger="fastpersist"):
        st = fp_core.save({"big": big}, path, backend="io_uring")
    assert "gets a new temporary file" in caplog.text
    assert st.backend == "threadpool" and "stopped answering" in st.extra["rewritten"]
    assert_identical({"big": big}, fp_core.load(path, verify=True))
    assert_no_temps(disk_dir)


def test_an_early_write_that_stalls_before_the_layout_is_redone_leaves_its_file(disk_dir, fault, monkeypatch,
                                                                                  caplog):
    """The early write began on a layout the whole state then overrules (a large tensor, then
    thousands of small ones) and one of its requests stalled: the file is laid out anew in a
    new temporary file, not over the one a late completion may still write into."""
    _io_uring_stalls_after(disk_dir, monkeypatch, 0.3)
    path = os.path.join(disk_dir, "ckpt.pt")
    state = {"big": torch.full((10 * MiB,), 2.0)}  # 40 MiB: the early write begins with it
    state.update({f"t{i}": torch.full((1,), float(i)) for i in range(12000)})
    fault("lose_completion")
    with caplog.at_level("INFO", logger="fastpersist"):
        fp_core.save(state, path, backend="io_uring")
    assert "an early write stalled" in caplog.text
    assert_identical(state, fp_core.load(path, verify=True))
    assert_no_temps(disk_dir)


def test_engine_queue_shared_by_a_hosts_ranks():
    o = fp_core.EngineOptions()
    assert o.for_ranks_on_host(1) is o and o.for_ranks_on_host(4).queue_depth == 4
    assert o.for_ranks_on_host(64).queue_depth == 2  # never below two writes in flight
    assert fp_core.EngineOptions(share_queue=False).for_ranks_on_host(4).queue_depth == 16


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
