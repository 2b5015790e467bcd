"""A replaced or deleted checkpoint's blocks are freed in the background (fp_core.io.deferred_free):
its name goes at once, its inode is kept by an O_PATH descriptor until the thread closes it."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch
from conftest import MiB, assert_identical, assert_no_temps

import fp_core
from fp_core.io import deferred_free
from fp_core.saving import commit


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


def test_a_directory_is_pinned_without_following_links_out_of_it(disk_dir, monkeypatch):
    """A checkpoint directory is untrusted: a link in it to a file or directory elsewhere,
    or a subdirectory swapped for such a link while the walk runs, pins nothing outside."""
    outside = os.path.join(disk_dir, "outside")
    os.makedirs(os.path.join(outside, "d"))
    fp_core.save(big_state(2.0), os.path.join(outside, "secret.pt"))
    fp_core.save(big_state(3.0), os.path.join(outside, "d", "other.pt"))
    ckpt = os.path.join(disk_dir, "checkpoint-1")
    os.makedirs(os.path.join(ckpt, "a"))
    os.makedirs(os.path.join(ckpt, "z"))
    fp_core.save(big_state(1.0), os.path.join(ckpt, "a", "model.pt"))
    os.symlink(os.path.join(outside, "secret.pt"), os.path.join(ckpt, "file-link.pt"))
    os.symlink(os.path.join(outside, "d"), os.path.join(ckpt, "dir-link"))
    real = deferred_free._pin_file
    swapped: list[str] = []

    def pin_file_then_swap(p, name, dev, dir_fd=None):  # "z" becomes a link once the walk is under way
        real(p, name, dev, dir_fd=dir_fd)
        if not swapped:
            os.rmdir(os.path.join(ckpt, "z"))
            os.symlink(os.path.join(outside, "d"), os.path.join(ckpt, "z"))
            swapped.append("z")

    monkeypatch.setattr(deferred_free, "_pin_file", pin_file_then_swap)
    p = deferred_free.pin(ckpt)
    try:
        assert swapped
        pinned = {os.readlink(f"/proc/self/fd/{fd}") for fd, _, _ in p.files}
        assert pinned == {os.path.join(ckpt, "a", "model.pt")}, pinned
    finally:
        p.free_later()
        deferred_free.wait()


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


def test_a_rename_that_fails_keeps_the_old_checkpoint(disk_dir):
    """A rename that fails leaves the old file named and whole; freeing its pin costs nothing."""
    path = os.path.join(disk_dir, "x.pt")
    fp_core.save(big_state(1.0), path)
    with pytest.raises(FileNotFoundError):
        commit.publish(os.path.join(disk_dir, "no-such-temp"), path)
    deferred_free.wait()
    assert_identical(big_state(1.0), fp_core.load(path, verify=True))


def test_a_directory_replaced_by_publish_dir_frees_its_large_files_in_the_background(disk_dir):
    final = os.path.join(disk_dir, "checkpoint-5")
    os.makedirs(final)
    fp_core.save(big_state(1.0), os.path.join(final, "model.pt"))
    staging = os.path.join(disk_dir, ".staging")
    os.makedirs(staging)
    fp_core.save(big_state(2.0), os.path.join(staging, "model.pt"))
    with deferred_free.paused():
        commit.publish_dir(staging, final)
        assert sorted(os.listdir(disk_dir)) == ["checkpoint-5"]
        assert len(pinned_fds("/model.pt", suffix=True)) == 1
    deferred_free.wait()
    assert pinned_fds("/model.pt", suffix=True) == []
    assert_identical(big_state(2.0), fp_core.load(os.path.join(final, "model.pt"), verify=True))


def test_a_child_forked_while_a_pin_is_held_by_another_thread_does_not_keep_it(disk_dir):
    """A pin not yet handed to the thread (a writer publishing, a rotation deleting) while
    the main thread forks a DataLoader worker: the child closes its copy too."""
    path = os.path.join(disk_dir, "held.pt")
    fp_core.save(big_state(1.0), path)
    p = deferred_free.pin(path)
    try:
        os.unlink(path)
        assert len(pinned_fds(path)) == 1
        pid = os.fork()
        if pid == 0:
            os._exit(0 if pinned_fds(path) == [] and deferred_free.live_count() == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        p.free_later()
    deferred_free.wait()
    assert pinned_fds(path) == [] and deferred_free.live_count() == 0


def test_a_child_does_not_close_a_descriptor_number_reused_since(disk_dir, monkeypatch):
    """A pinned descriptor closed by the thread, its number reused (multiprocessing opens a
    pipe just before it forks) and still listed at the fork: the child leaves it open."""
    fp_core.save(big_state(1.0), os.path.join(disk_dir, "some.pt"))
    st = os.stat(os.path.join(disk_dir, "some.pt"))
    r, w = os.pipe()
    try:
        monkeypatch.setitem(deferred_free._live, r, (st.st_dev, st.st_ino))  # the stale listing
        pid = os.fork()
        if pid == 0:
            try:
                os.fstat(r)
                os._exit(0)
            except OSError:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child closed a pipe it took for a pin"
    finally:
        os.close(r)
        os.close(w)


def test_pins_are_bounded_in_descriptors(disk_dir, monkeypatch):
    monkeypatch.setattr(deferred_free, "MAX_LIVE", 2)
    d = os.path.join(disk_dir, "many")
    os.makedirs(d)
    for i in range(4):
        fp_core.save(big_state(float(i)), os.path.join(d, f"{i}.pt"))
    p = deferred_free.pin(d)
    assert len(p.files) == 2 and deferred_free.live_count() == 2
    p.free_later()
    deferred_free.wait()
    assert deferred_free.live_count() == 0


def test_files_on_other_filesystems_are_not_pinned(disk_dir):
    """Only local block filesystems (PINNED_FS): on NFS an open unlinked file would be
    silly-renamed into the checkpoint directory; tmpfs frees nothing slowly."""
    assert deferred_free.fs_type(os.stat(disk_dir).st_dev) in deferred_free.PINNED_FS
    if not os.path.isdir("/dev/shm") or deferred_free.fs_type(os.stat("/dev/shm").st_dev) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    path = f"/dev/shm/fastpersist-pin-test-{os.getpid()}"
    try:
        with open(path, "wb") as f:
            f.write(b"\1" * (deferred_free.MIN_BYTES + 4096))
        assert deferred_free.pin(path).files == []
    finally:
        os.unlink(path)


def test_a_save_that_finds_the_disk_full_while_frees_are_pending_waits_and_writes_again(disk_dir, fault, caplog):
    """ENOSPC (or EDQUOT) while replaced checkpoints are still being freed on the same
    filesystem: the save waits for them and writes its file again, instead of failing
    where a save that freed inline would have found the space."""
    path = os.path.join(disk_dir, "full.pt")
    other = os.path.join(disk_dir, "other.pt")
    fp_core.save(big_state(1.0), path)
    fp_core.save(big_state(1.0), other)
    done = threading.Event()
    errors: list[BaseException] = []

    def save_it() -> None:
        try:
            with caplog.at_level("WARNING", logger="fastpersist"):
                fp_core.save(big_state(3.0), path)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.set()

    with deferred_free.paused():
        fp_core.save(big_state(2.0), other)  # its old file: a free pending on this disk
        fault("write", errno=errno.ENOSPC, after_bytes=1 * MiB)
        t = threading.Thread(target=save_it)
        t.start()
        assert not done.wait(0.5), f"the save did not wait for the pending free: {errors}"
    t.join(30)
    assert done.is_set() and not errors, errors
    assert "the disk was full while" in caplog.text
    assert_identical(big_state(3.0), fp_core.load(path, verify=True))
    assert_no_temps(disk_dir)


def test_the_disk_full_with_nothing_pending_still_fails(disk_dir, fault):
    path = os.path.join(disk_dir, "full.pt")
    fp_core.save(big_state(1.0), path)
    deferred_free.wait()
    fault("write", errno=errno.ENOSPC, after_bytes=1 * MiB)
    with pytest.raises(OSError) as ei:
        fp_core.save(big_state(2.0), path)
    assert ei.value.errno == errno.ENOSPC and path in str(ei.value)
    assert_identical(big_state(1.0), fp_core.load(path, verify=True))
