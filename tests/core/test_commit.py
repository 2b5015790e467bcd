"""The commit: atomic overwrite, a process killed mid-save, temporary files (unnamed, or named where
O_TMPFILE is refused) and fp_core.clean of the ones a dead writer left."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import HELPERS, REPO, assert_identical

import fp_core


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
    generation, and nothing else is left in the directory but, when the kill lands between
    the link and the rename, one whole file under a temporary name that clean removes (the
    file being written is unnamed until just before it is renamed into place)."""
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
        left = sorted(os.listdir(disk_dir))
        if left != ["crash.pt"]:
            # Killed between the link and the rename (a few microseconds; rare, but a loaded
            # machine can deschedule the writer there): a whole file under a dotted temporary
            # name, which nobody holds any more, so the next clean (the next save's) removes it.
            (orphan,) = [n for n in left if n != "crash.pt"]
            assert fp_core.saving.commit._TEMP_RE.match(orphan), left
            _check_generation(os.path.join(disk_dir, orphan))
            assert fp_core.clean(disk_dir) == [os.path.join(disk_dir, orphan)]
            assert sorted(os.listdir(disk_dir)) == ["crash.pt"]
    print(f"kills that landed mid-save: {mid_save} of 10")
    assert mid_save > 0, "no kill landed mid-save: the test did not test anything"
    assert fp_core.clean(disk_dir) == []


_KILLED_AFTER_LINK = """
import os, signal, sys, torch
sys.path.insert(0, {repo!r})
import fp_core
path = sys.argv[1]
fp_core.save({{"gen": 1, "data": torch.full((1000,), 1.0), "tail": [1] * 3}}, path)
# The second save dies right after its file got its temporary name, before the rename.
fp_core._native.inject_fault("kill_before_rename")
fp_core.save({{"gen": 2, "data": torch.full((1000,), 2.0), "tail": [2] * 3}}, path)
"""


def test_kill_between_link_and_rename_leaves_a_whole_file_the_next_save_removes(disk_dir):
    path = os.path.join(disk_dir, "crash.pt")
    repo = REPO
    r = subprocess.run([sys.executable, "-c", _KILLED_AFTER_LINK.format(repo=repo), path], capture_output=True,
                       text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert _check_generation(path) == 1  # the previous checkpoint, untouched
    (orphan,) = [n for n in os.listdir(disk_dir) if n != "crash.pt"]
    assert fp_core.saving.commit._TEMP_RE.match(orphan)
    assert _check_generation(os.path.join(disk_dir, orphan)) == 2  # whole, never under the checkpoint's name
    # A new process's first save into the directory removes it (off its thread).
    r = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {repo!r}); import fp_core, torch; "
                        f"fp_core.save({{'x': torch.ones(3)}}, {os.path.join(disk_dir, 'other.pt')!r}); "
                        f"fp_core.saving.commit.wait_for_clean({disk_dir!r})"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(disk_dir)) == ["crash.pt", "other.pt"]


def test_a_failed_rename_names_the_checkpoint_and_keeps_the_previous_one(disk_dir):
    import errno

    path = os.path.join(disk_dir, "r.pt")
    fp_core.save({"gen": 1, "data": torch.full((1000,), 1.0), "tail": [1] * 3}, path)
    fp_core._native.inject_fault("rename", errno=errno.EXDEV)
    try:
        with pytest.raises(OSError) as e:
            fp_core.save({"gen": 2, "data": torch.full((1000,), 2.0), "tail": [2] * 3}, path)
    finally:
        fp_core._native.inject_fault(None)
    assert e.value.errno == errno.EXDEV and e.value.filename == path
    assert _check_generation(path) == 1
    assert os.listdir(disk_dir) == ["r.pt"]  # neither the temporary name nor the unnamed file
    fp_core.save({"gen": 3, "data": torch.full((1000,), 3.0), "tail": [3] * 3}, path)
    assert _check_generation(path) == 3


def test_a_new_name_is_linked_straight_to_the_file(disk_dir):
    """An unnamed file given a name that is free never shows under a temporary name."""
    if not fp_core.saving.commit.tmpfile_supported(disk_dir):
        pytest.skip("no O_TMPFILE on this filesystem")
    d = os.path.join(disk_dir, "d")
    os.mkdir(d)
    seen = []
    real = fp_core._native.link_replace

    def spy(fd, tmp, final):
        seen.append(real(fd, tmp, final))
        return seen[-1]

    fp_core.saving.commit._native.link_replace = spy
    try:
        fp_core.save({"x": torch.ones(3)}, os.path.join(d, "a.pt"))
        fp_core.save({"x": torch.ones(4)}, os.path.join(d, "a.pt"))
    finally:
        fp_core.saving.commit._native.link_replace = real
    assert seen == [True, False]
    assert os.listdir(d) == ["a.pt"] and torch.load(os.path.join(d, "a.pt"))["x"].shape == (4,)


def _fake_orphan(directory: str, final_name: str, host: str | None = None) -> str:
    p = os.path.join(directory, f".{final_name}.{host or fp_core.saving.commit._HOST}-4242-deadbeef.fptmp")
    with open(p, "wb") as f:
        f.write(b"partial" * 100)
    return p


def test_clean_removes_only_unheld_temps_named_as_ours(disk_dir):
    orphan = _fake_orphan(disk_dir, "a.pt")  # nobody holds it: its writer died
    live = _fake_orphan(disk_dir, "b.pt")
    fd = os.open(live, os.O_RDONLY)
    held = fp_core.saving.commit.hold(fd)  # a writer still at work (whatever its pid)
    os.close(fd)
    other_host = _fake_orphan(disk_dir, "c.pt", host="otherhost")  # not ours to judge
    lookalikes = [".notes.fptmp", ".a.pt.fptmp", ".a.pt.host-1-xyz.fptmp", ".a.pt.host-1-deadbeef.fptmp.bak"]
    for n in lookalikes:
        open(os.path.join(disk_dir, n), "w").close()
    os.mkdir(os.path.join(disk_dir, ".d.pt.host-1-deadbeef.fptmp"))  # a directory, not a temp file
    os.symlink(orphan, os.path.join(disk_dir, f".e.pt.{fp_core.saving.commit._HOST}-1-deadbeef.fptmp"))
    try:
        assert fp_core.clean(disk_dir) == [orphan]
        assert os.path.exists(live) and os.path.exists(other_host)
        assert all(os.path.exists(os.path.join(disk_dir, n)) for n in lookalikes)
        orphan2 = _fake_orphan(disk_dir, "a.pt")
        fp_core.save({"x": torch.ones(3)}, os.path.join(disk_dir, "a.pt"))
        fp_core.saving.commit.wait_for_clean(disk_dir)  # the first save into a directory cleans it, off-thread
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
    from fp_core.saving import commit

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


def test_clean_never_removes_a_checkpoint_renamed_over_a_stale_placeholder(disk_dir):
    """The clean-up judges a placeholder stale (its writer died), then a save renames a finished
    checkpoint over that name before the clean-up removes it: the checkpoint must survive."""
    from fp_core.saving import commit

    path = os.path.join(disk_dir, "x.ckpt")
    fd = commit.claim(path)
    assert fd is not None
    commit.settle(fd)  # its writer is gone: a stale placeholder
    ((p, ino),) = commit._candidates(disk_dir)
    assert p == path
    fp_core.save({"w": torch.ones(8)}, path)  # the next save of that name commits meanwhile
    assert not commit._remove_unheld(p, ino)
    assert torch.equal(torch.load(path)["w"], torch.ones(8))
    assert fp_core.clean(disk_dir) == []
