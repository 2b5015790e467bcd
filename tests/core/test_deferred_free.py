"""A replaced or deleted checkpoint's blocks are freed in the background (fp_core.deferred_free):
its name goes at once, its inode is kept by an O_PATH descriptor until the thread closes it."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import MiB, assert_identical

import fp_core
from fp_core import commit, deferred_free


def pinned_fds(path: str, suffix: bool = False) -> list[int]:
    """This process's descriptors on ``path`` (a path's end: ``suffix``) after its name
    went (``/proc`` says "(deleted)")."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, or one closed meanwhile
        if target.endswith(f"{path} (deleted)") if suffix else target == f"{path} (deleted)":
            out.append(int(name))
    return out


def big_state(fill: float) -> dict:
    return {"w": torch.full((4 * MiB,), fill)}  # 16 MiB: above deferred_free.MIN_BYTES


def test_a_save_over_a_checkpoint_frees_the_old_one_in_the_background(disk_dir):
    path = os.path.join(disk_dir, "last.pt")
    fp_core.save(big_state(1.0), path)
    old_ino = os.stat(path).st_ino
    with deferred_free.paused():
        fp_core.save(big_state(2.0), path)
        assert_identical(big_state(2.0), fp_core.load(path, verify=True))  # the new one is there now
        held = pinned_fds(path)
        assert len(held) == 1 and os.fstat(held[0]).st_ino == old_ino
        assert deferred_free.pending_bytes(os.stat(disk_dir).st_dev) >= 16 * MiB
    deferred_free.wait()
    assert pinned_fds(path) == [] and deferred_free.pending_bytes() == 0
    assert_identical(big_state(2.0), fp_core.load(path, verify=True))


def test_what_is_not_pinned(disk_dir):
    """Small files, files with another hard link (their blocks stay), symlinks and missing
    paths are not pinned: removing them costs what it did."""
    small = os.path.join(disk_dir, "small.pt")
    fp_core.save({"w": torch.ones(1024)}, small)
    big = os.path.join(disk_dir, "big.pt")
    fp_core.save(big_state(1.0), big)
    link = os.path.join(disk_dir, "link.pt")
    os.symlink(big, link)
    assert deferred_free.pin(small).files == []
    assert deferred_free.pin(link).files == []
    assert deferred_free.pin(os.path.join(disk_dir, "missing.pt")).files == []
    p = deferred_free.pin(big)
    assert len(p.files) == 1 and p.nbytes >= 16 * MiB
    p.free_later()  # still named: closing frees nothing
    deferred_free.wait()
    os.link(big, os.path.join(disk_dir, "hard.pt"))
    assert deferred_free.pin(big).files == []
    assert_identical(big_state(1.0), fp_core.load(big, verify=True))


def test_a_rotated_checkpoint_directory_frees_its_large_files_in_the_background(disk_dir):
    d = os.path.join(disk_dir, "checkpoint-10")
    os.makedirs(os.path.join(d, "sub"))
    fp_core.save(big_state(1.0), os.path.join(d, "sub", "model.pt"))
    fp_core.save({"x": torch.ones(3)}, os.path.join(d, "small.pt"))
    with deferred_free.paused():
        commit.retire_dirs([d])
        assert os.listdir(disk_dir) == []  # gone from the namespace at once, nothing aside
        assert len(pinned_fds("/sub/model.pt", suffix=True)) == 1
    deferred_free.wait()
    assert pinned_fds("/sub/model.pt", suffix=True) == [] and deferred_free.pending_bytes() == 0


def test_lightning_remove_checkpoint_frees_in_the_background(disk_dir):
    from fp_integrations.lightning import FastPersistIO

    io = FastPersistIO()
    path = os.path.join(disk_dir, "epoch=1.ckpt")
    fp_core.save(big_state(1.0), path)
    with deferred_free.paused():
        io.remove_checkpoint(path)
        io.teardown()  # its worker has run the removal
        assert not os.path.exists(path) and len(pinned_fds(path)) == 1
    deferred_free.wait()
    assert pinned_fds(path) == []


def test_pending_releases_are_bounded(disk_dir):
    """Beyond MAX_PENDING queued releases the caller frees the old file itself."""
    path = os.path.join(disk_dir, "r.pt")
    fp_core.save(big_state(0.0), path)
    with deferred_free.paused():
        for i in range(deferred_free.MAX_PENDING + 3):
            fp_core.save(big_state(float(i + 1)), path)
        assert len(pinned_fds(path)) == deferred_free.MAX_PENDING
    deferred_free.wait()
    assert pinned_fds(path) == []
    assert_identical(big_state(float(deferred_free.MAX_PENDING + 3)), fp_core.load(path, verify=True))


def test_a_forked_child_does_not_keep_the_parents_replaced_files(disk_dir):
    path = os.path.join(disk_dir, "f.pt")
    fp_core.save(big_state(1.0), path)
    with deferred_free.paused():
        fp_core.save(big_state(2.0), path)
        assert len(pinned_fds(path)) == 1
        pid = os.fork()
        if pid == 0:  # the child: its copy of the descriptor closed by the fork hook
            os._exit(0 if pinned_fds(path) == [] and deferred_free.pending_bytes() == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert len(pinned_fds(path)) == 1  # the parent's is still queued
    deferred_free.wait()


def test_must_wait():
    assert not deferred_free.must_wait(0, [])
    assert deferred_free.must_wait(1 << 30, [1 << 30])
    assert not deferred_free.must_wait(4 << 30, [1 << 30, 2 << 30])
    assert deferred_free.must_wait((2 << 30) + (100 << 20), [1 << 30, 2 << 30])


def test_a_save_waits_for_pending_frees_when_the_disk_is_short(disk_dir, monkeypatch):
    """With less free space than the file being freed (statvfs made to say so: this test
    cannot fill the disk), the next save waits for the release before taking space."""
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(big_state(1.0), path)
    real = os.statvfs(disk_dir)
    done = threading.Event()
    errors: list[BaseException] = []

    def second_save() -> None:
        try:
            fp_core.save(big_state(3.0), path)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.set()

    with deferred_free.paused():
        fp_core.save(big_state(2.0), path)
        short = os.statvfs_result((real.f_bsize, real.f_frsize, real.f_blocks, 0, 0, real.f_files,
                                   real.f_ffree, real.f_favail, real.f_flag, real.f_namemax))
        monkeypatch.setattr(deferred_free.os, "statvfs", lambda p: short)
        t = threading.Thread(target=second_save)
        t.start()
        assert not done.wait(0.5), "the save went ahead with the disk short and a free pending"
    t.join(30)
    assert done.is_set() and not errors
    assert_identical(big_state(3.0), fp_core.load(path, verify=True))
    monkeypatch.undo()
    with deferred_free.paused():  # with room, no wait
        fp_core.save(big_state(4.0), path)
        fp_core.save(big_state(5.0), path)
    deferred_free.wait()
    assert_identical(big_state(5.0), fp_core.load(path, verify=True))


@pytest.mark.parametrize("target", ["file", "dir"])
def test_pin_then_rename_failure_keeps_the_old_checkpoint(disk_dir, target):
    """A rename that fails leaves the old file named and whole; freeing its pin costs nothing."""
    path = os.path.join(disk_dir, "x.pt")
    fp_core.save(big_state(1.0), path)
    with pytest.raises(OSError):
        if target == "file":
            commit.publish(os.path.join(disk_dir, "no-such-temp"), path)
        else:
            commit.publish_dir(os.path.join(disk_dir, "no-such-staging"), os.path.join(disk_dir, "d"))
    deferred_free.wait()
    assert_identical(big_state(1.0), fp_core.load(path, verify=True))
