"""What a save does to the user's files, with ``torch.save`` as the reference (issue 38):
device nodes and FIFOs are never replaced, symlinks are written through, a replaced file
keeps its mode, owner and ACL, a file the caller could not write is refused, a trailing
slash is refused, a full disk says what an atomic replace needs, and a pending save is not
lost when a process ends the way multiprocessing children end."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import struct
import subprocess
import sys

import pytest
import torch
from conftest import HELPERS, REPO

import fp_core
from fp_core.saving import commit

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="mknod, chown and setuid need root")


def sd(value: float = 1.0, n: int = 4096) -> dict:
    return {"w": torch.full((n,), value), "step": int(value)}


def _sync(obj, path):
    return fp_core.save(obj, path)


def _async(obj, path):
    with fp_core.AsyncCheckpointer() as ckpt:
        return ckpt.save(obj, path).result()


def _safetensors(obj, path):
    return fp_core.save({"w": obj["w"]}, path, format="safetensors")


WRITERS = {"sync": _sync, "async": _async, "safetensors": _safetensors}


def _load_w(path: str) -> torch.Tensor:
    if path.endswith(".safetensors") or open(path, "rb").read(8)[:2] != b"PK":
        from safetensors.torch import load_file

        return load_file(path)["w"]
    return torch.load(path)["w"]


def _leftovers(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("."))


# ---------------------------------------------------------------- device files, FIFOs, sockets


def _make_node(d: str, kind: str) -> str:
    p = os.path.join(d, kind)
    if kind == "char":
        os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is
    elif kind == "block":
        os.mknod(p, 0o660 | stat.S_IFBLK, os.makedev(7, 250))
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(p)
        s.close()
    elif kind == "dir":
        os.mkdir(p)
    return p


@needs_root
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("kind", ["char", "block", "fifo", "socket", "dir"])
def test_a_device_fifo_socket_or_directory_is_never_replaced(disk_dir, kind, writer):
    p = _make_node(disk_dir, kind)
    before = os.lstat(p)
    with pytest.raises(OSError) as ei:
        WRITERS[writer](sd(), p)
    assert ei.value.filename == p and ("directory" in str(ei.value) if kind == "dir" else "not a regular file"
                                       in str(ei.value))
    after = os.lstat(p)
    assert (stat.S_IFMT(after.st_mode), after.st_ino, after.st_rdev) == (stat.S_IFMT(before.st_mode),
                                                                         before.st_ino, before.st_rdev)
    assert _leftovers(disk_dir) == []


@needs_root
def test_a_symlink_to_a_device_is_refused_and_left_as_it_is(disk_dir):
    node = _make_node(disk_dir, "char")
    link = os.path.join(disk_dir, "last.ckpt")
    os.symlink(node, link)
    with pytest.raises(OSError, match="character device"):
        fp_core.save(sd(), link)
    assert os.readlink(link) == node and stat.S_ISCHR(os.lstat(node).st_mode)


# ---------------------------------------------------------------- symlinks


def _link_cases(d: str) -> dict[str, tuple[str, str]]:
    """name -> (link the caller names, file it resolves to)."""
    os.makedirs(os.path.join(d, "runs", "7"))
    target = os.path.join(d, "runs", "7", "step-900.ckpt")
    cases = {}
    rel = os.path.join(d, "last-rel.ckpt")
    os.symlink(os.path.join("runs", "7", "step-900.ckpt"), rel)
    cases["relative"] = (rel, target)
    ab = os.path.join(d, "last-abs.ckpt")
    os.symlink(target, ab)
    cases["absolute"] = (ab, target)
    mid = os.path.join(d, "runs", "latest")
    os.symlink("7/step-900.ckpt", mid)
    chain = os.path.join(d, "last-chain.ckpt")
    os.symlink(os.path.join("runs", "latest"), chain)
    cases["chain"] = (chain, target)
    return cases


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("how", ["relative", "absolute", "chain"])
def test_a_symlink_is_written_through_and_stays_a_link(disk_dir, how, writer):
    link, target = _link_cases(disk_dir)[how]
    WRITERS[writer](sd(1.0), target)
    os.chmod(target, 0o640)
    WRITERS[writer](sd(2.0), link)
    assert os.path.islink(link) and os.path.realpath(link) == target
    assert torch.equal(_load_w(target), sd(2.0)["w"])
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert _leftovers(disk_dir) == [] and _leftovers(os.path.dirname(target)) == []


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_dangling_symlink_gets_its_target_created(disk_dir, writer):
    link = os.path.join(disk_dir, "last.ckpt")
    os.symlink("made-by-save.ckpt", link)
    WRITERS[writer](sd(3.0), link)
    target = os.path.join(disk_dir, "made-by-save.ckpt")
    assert os.path.islink(link) and torch.equal(_load_w(target), sd(3.0)["w"])


def test_a_symlink_loop_is_refused(disk_dir):
    a, b = os.path.join(disk_dir, "a"), os.path.join(disk_dir, "b")
    os.symlink(b, a)
    os.symlink(a, b)
    with pytest.raises(OSError) as ei:
        fp_core.save(sd(), a)
    assert ei.value.errno == errno.ELOOP and os.path.islink(a) and os.path.islink(b)


@needs_root
def test_the_temporary_file_is_made_beside_the_file_the_link_names(disk_dir, mount_tmpfs):
    """The link lives on another filesystem than its target: a temporary file made beside
    the link could not be renamed onto the target (EXDEV)."""
    other = mount_tmpfs("1m", "links")
    target = os.path.join(disk_dir, "step-5.ckpt")
    fp_core.save(sd(1.0), target)
    link = os.path.join(other, "last.ckpt")
    os.symlink(target, link)
    for writer in (_sync, _async):
        writer(sd(5.0, 1 << 20), link)  # 4 MiB: would not even fit on the 1 MiB tmpfs
        assert os.path.islink(link) and torch.equal(torch.load(target)["w"], sd(5.0, 1 << 20)["w"])


def _dir_behind_link(d: str, name: str) -> tuple[str, str]:
    """``d/runs/name/old`` and the link ``d/checkpoint-last -> runs/name``: (runs, link)."""
    runs = os.path.join(d, "runs")
    os.makedirs(os.path.join(runs, name))
    with open(os.path.join(runs, name, "old"), "w") as f:
        f.write("old")
    link = os.path.join(d, "checkpoint-last")
    os.symlink(os.path.join("runs", name), link)
    return runs, link


def test_a_checkpoint_directory_named_through_a_symlink_is_replaced_where_it_points(disk_dir):
    runs, link = _dir_behind_link(disk_dir, "checkpoint-8")
    staging = os.path.join(disk_dir, ".staging")
    os.makedirs(staging)
    with open(os.path.join(staging, "new"), "w") as f:
        f.write("new")
    commit.publish_dir(staging, link)
    assert os.path.islink(link) and sorted(os.listdir(link)) == ["new"]
    assert sorted(os.listdir(runs)) == ["checkpoint-8"]


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o2770])
def test_a_replaced_checkpoint_directory_keeps_its_mode_and_owner(disk_dir, mode):
    final = os.path.join(disk_dir, "checkpoint-8")
    os.makedirs(final)
    os.chmod(final, mode)
    if ROOT:
        os.chown(final, 1234, 4321)
    staging = os.path.join(disk_dir, ".staging")
    os.makedirs(staging)
    commit.publish_dir(staging, final)
    st = os.stat(final)
    assert stat.S_IMODE(st.st_mode) == mode and not os.path.exists(staging)
    if ROOT:
        assert (st.st_uid, st.st_gid) == (1234, 4321)


def test_a_checkpoint_directory_never_replaces_a_file(disk_dir):
    victim = os.path.join(disk_dir, "checkpoint-3")
    with open(victim, "w") as f:
        f.write("user data")
    staging = os.path.join(disk_dir, ".staging")
    os.makedirs(staging)
    with pytest.raises(NotADirectoryError, match="not a directory"):
        commit.publish_dir(staging, victim)
    assert open(victim).read() == "user data"


def test_collective_sharded_and_dcp_saves_follow_links_and_refuse_fifos(disk_dir):
    r = subprocess.run([sys.executable, os.path.join(HELPERS, "user_files_dist.py"), disk_dir],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("collective", "sharded", "async"):
        assert out[f"{name}_link"] == "ok" and out[f"{name}_is_link"] and out[f"{name}_target_equal"], out
    assert out["collective_mode"] == out["sharded_mode"] == "0o600"
    for key in ("collective_fifo", "sharded_fifo"):
        assert "not a regular file" in out[key], out
    assert out["fifo_kept"] and out["fifo_kept_sharded"] and out["fifo_kept_dcp"]
    assert "not written" in out["dcp_over_fifo"] and "not written" in out["dcp_over_file"] and out["file_kept"]
    assert out["dcp_link"] == "ok" and out["dcp_is_link"] and out["dcp_verified"] == "ok" and out["dcp_target_equal"]


# ---------------------------------------------------------------- modes, owners, ACLs


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444, 0o604])
def test_a_replaced_file_keeps_its_mode(disk_dir, writer, mode):
    p = os.path.join(disk_dir, "ckpt.safetensors" if writer == "safetensors" else "ckpt.pt")
    WRITERS[writer](sd(1.0), p)
    os.chmod(p, mode)
    if mode & 0o200 or ROOT:
        WRITERS[writer](sd(2.0), p)
        assert stat.S_IMODE(os.stat(p).st_mode) == mode
        assert torch.equal(_load_w(p), sd(2.0)["w"])
    else:  # a read-only file of our own: torch.save's open() fails with EACCES, and so do we
        with pytest.raises(PermissionError):
            WRITERS[writer](sd(2.0), p)
        assert torch.equal(_load_w(p), sd(1.0)["w"])


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_new_file_gets_0666_less_the_umask(disk_dir, writer):
    old = os.umask(0o027)
    try:
        p = os.path.join(disk_dir, "new.pt")
        WRITERS[writer](sd(), p)
        with open(os.path.join(disk_dir, "by-open"), "wb"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(p).st_mode) == stat.S_IMODE(os.stat(os.path.join(disk_dir, "by-open")).st_mode) \
        == 0o640


@needs_root
def test_a_replaced_file_keeps_its_owner_and_group(disk_dir):
    p = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(sd(1.0), p)
    os.chown(p, 1234, 4321)
    os.chmod(p, 0o640)
    for writer in (_sync, _async):
        writer(sd(2.0), p)
        st = os.stat(p)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 4321, 0o640)


def _acl(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, p, i) for t, p, i in entries)


_ANY = 0xFFFFFFFF
# user::rw- user:1234:r-- group::--- mask::r-- other::---
ACL_0640 = _acl((0x01, 6, _ANY), (0x02, 4, 1234), (0x04, 0, _ANY), (0x10, 4, _ANY), (0x20, 0, _ANY))


def _set_acl(path: str, acl: bytes, name: str = commit.ACL_XATTR) -> None:
    try:
        os.setxattr(path, name, acl)
    except OSError as e:
        pytest.skip(f"no POSIX ACLs on this filesystem: {e}")


def test_a_replaced_file_keeps_its_acl(disk_dir):
    p = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(sd(1.0), p)
    _set_acl(p, ACL_0640)
    before = (os.getxattr(p, commit.ACL_XATTR), stat.S_IMODE(os.stat(p).st_mode))
    for writer in (_sync, _async):
        writer(sd(2.0), p)
        assert (os.getxattr(p, commit.ACL_XATTR), stat.S_IMODE(os.stat(p).st_mode)) == before


def test_a_directorys_default_acl_is_not_added_to_a_replaced_file_that_had_none(disk_dir):
    """The temporary file inherits the directory's default ACL (as a new file does); the
    file it replaces had none, so the new one has none either: no named user gains access."""
    p = os.path.join(disk_dir, "ckpt.pt")
    fp_core.save(sd(1.0), p)
    os.chmod(p, 0o600)
    _set_acl(disk_dir, _acl((0x01, 7, _ANY), (0x02, 7, 1234), (0x04, 5, _ANY), (0x10, 7, _ANY), (0x20, 5, _ANY)),
             "system.posix_acl_default")
    fp_core.save(sd(2.0), p)
    with pytest.raises(OSError):
        os.getxattr(p, commit.ACL_XATTR)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


def _as_user(uid: int, fn, timeout: float = 120) -> str:
    """Run ``fn`` in a forked child that has become ``uid``; return what it reported. Build
    large tensors before: torch's thread pool, used by the parent, does not survive a fork."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            msg = fn()
        except BaseException as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode()[:60000])
        os._exit(0)
    os.close(w)
    import select

    with os.fdopen(r, "rb") as f:
        if not select.select([f], [], [], timeout)[0]:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return f"hung for {timeout} s"
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except OSError as e:
        return f"{type(e).__name__} errno={e.errno}: {e}"
    except Exception as e:  # noqa: BLE001 - torch.save's RuntimeError
        return f"{type(e).__name__}: {e}"


@pytest.fixture
def shared_dir():
    """A world-writable directory without the sticky bit that another user can reach."""
    import shutil
    import tempfile

    base = os.path.join(REPO, ".test-tmp")
    os.makedirs(base, exist_ok=True)
    os.chmod(base, 0o755)
    d = tempfile.mkdtemp(dir=base)
    os.chmod(d, 0o777)
    if _as_user(65534, lambda: str(os.access(d, os.W_OK | os.X_OK))) != "True":
        shutil.rmtree(d)
        pytest.skip(f"another user cannot reach {d}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@needs_root
def test_a_file_the_caller_could_not_open_for_writing_is_not_replaced(shared_dir):
    """Another user's 0444 file in a world-writable directory without the sticky bit: the
    directory lets the caller rename over it, but torch.save fails with EACCES, so must we."""
    d = shared_dir
    p = os.path.join(d, "ckpt.pt")
    fp_core.save(sd(1.0), p)
    os.chmod(p, 0o444)
    ref = _as_user(65534, lambda: _outcome(lambda: torch.save(sd(2.0), p)))
    assert "Permission denied" in ref, ref  # torch.save: a RuntimeError holding strerror(EACCES)
    for name in ("sync", "async", "safetensors"):
        got = _as_user(65534, lambda name=name: _outcome(lambda: WRITERS[name](sd(2.0), p)))
        assert got.startswith("PermissionError errno=13") and p in got, (name, got)
    assert torch.equal(torch.load(p)["w"], sd(1.0)["w"]) and os.stat(p).st_uid == 0
    assert _leftovers(d) == []


@needs_root
def test_a_group_that_cannot_be_kept_never_widens_access(shared_dir):
    """root:root 0672 (others may write): another user replaces it. The new file is theirs,
    in their group; members of that group were 'others' before (-w-) and must not gain
    the old group's rwx."""
    d = shared_dir
    p = os.path.join(d, "ckpt.pt")
    fp_core.save(sd(1.0), p)
    os.chmod(p, 0o672)
    got = _as_user(65534, lambda: _outcome(lambda: fp_core.save(sd(2.0), p)))
    assert got == "ok", got
    st = os.stat(p)
    mode = stat.S_IMODE(st.st_mode)
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert (mode >> 3) & 0o7 & ~(mode & 0o7) == 0, oct(mode)  # group bits within the others' bits
    assert mode & 0o7 == 0o2


# ---------------------------------------------------------------- trailing slash, full disk


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("exists", [False, True])
def test_a_trailing_slash_is_refused(disk_dir, writer, exists):
    p = os.path.join(disk_dir, "name")
    if exists:
        WRITERS[writer](sd(1.0), p)
    with pytest.raises(IsADirectoryError):
        WRITERS[writer](sd(2.0), p + "/")
    if exists:
        assert torch.equal(_load_w(p), sd(1.0)["w"])
    else:
        assert not os.path.lexists(p)
    with pytest.raises((OSError, RuntimeError), match="name/"):  # the reference refuses too
        torch.save(sd(2.0), p + "/")
    for tail in ("/.", "/.."):  # names of directories too, never of the file before them
        with pytest.raises(IsADirectoryError):
            WRITERS[writer](sd(2.0), p + tail)
    assert sorted(os.listdir(disk_dir)) == (["name"] if exists else [])


@needs_root
@pytest.mark.parametrize("writer", ["sync", "async"])
def test_replacing_on_a_disk_without_room_for_both_files_says_so(mount_tmpfs, writer):
    d = mount_tmpfs("8m")
    p = os.path.join(d, "ckpt.pt")
    big = sd(1.0, 5 << 18)  # 5 MiB
    fp_core.save(big, p)
    with pytest.raises(OSError) as ei:
        WRITERS[writer](sd(2.0, 5 << 18), p)
    e = ei.value
    assert e.errno == errno.ENOSPC and e.filename == p
    assert "an atomic replace needs" in str(e) and "beside the existing checkpoint" in str(e) and "are free" in str(e)
    assert torch.equal(torch.load(p)["w"], big["w"]) and sorted(os.listdir(d)) == ["ckpt.pt"]
    torch.save(sd(2.0, 5 << 18), p)  # the reference truncates first: it fits


# ---------------------------------------------------------------- process exit


def _exit_scenario(scenario: str, d: str) -> dict:
    r = subprocess.run([sys.executable, os.path.join(HELPERS, "exit_paths.py"), scenario, d],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


@pytest.mark.parametrize("scenario,gen", [("fork", 3), ("forkserver", 3), ("spawn", 3), ("plugin-fork", 4),
                                          ("plugin-forkserver", 4)])
def test_a_save_pending_when_a_multiprocessing_child_returns_is_committed(disk_dir, scenario, gen):
    out = _exit_scenario(scenario, disk_dir)
    assert out["exitcode"] == 0
    p = os.path.join(disk_dir, "ckpt.pt")
    loaded = torch.load(p)
    assert loaded["gen"] == gen and torch.equal(loaded["w"], torch.full((4 << 20,), float(gen)))
    fp_core.verify(p)


def test_a_forked_child_neither_writes_nor_waits_for_its_parents_save(disk_dir):
    out = _exit_scenario("inherit", disk_dir)
    assert out["child_status"] == 0
    assert torch.load(os.path.join(disk_dir, "ckpt.pt"))["gen"] == 6
    assert torch.load(os.path.join(disk_dir, "child.pt"))["gen"] == 7


def test_after_os_exit_no_empty_file_is_left_and_clean_says_what_was_lost(disk_dir, caplog):
    _exit_scenario("os-exit", disk_dir)
    p = os.path.join(disk_dir, "ckpt.pt")
    if not os.path.exists(p):
        return  # the save won the race with os._exit: nothing was lost
    if os.path.getsize(p) > 1024:
        fp_core.verify(p)
        return
    assert os.path.getsize(p) > 0 and commit.is_placeholder(p)
    with pytest.raises(fp_core.CorruptCheckpointError, match="never completed"):
        fp_core.load(p)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert commit.clean(disk_dir) == [p]
    assert any("never completed" in r.getMessage() and p in r.getMessage() for r in caplog.records)


def test_the_next_save_over_a_lost_placeholder_says_what_was_lost(disk_dir, caplog):
    _exit_scenario("os-exit", disk_dir)
    p = os.path.join(disk_dir, "ckpt.pt")
    if not commit.is_placeholder(p):
        pytest.skip("the save won the race with os._exit: nothing was lost")
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        fp_core.save(sd(9.0), p)
    assert any("never completed" in r.getMessage() and p in r.getMessage() for r in caplog.records)
    assert torch.load(p)["step"] == 9


def test_a_save_through_a_link_is_pending_and_committed_under_the_name_it_was_given(disk_dir):
    target = os.path.join(disk_dir, "step-1.ckpt")
    link = os.path.join(disk_dir, "last.ckpt")
    os.symlink("step-1.ckpt", link)
    committed = []
    with fp_core.AsyncCheckpointer() as ckpt:
        h = ckpt.save(sd(1.0, 4 << 20), link, on_commit=lambda p, st: committed.append((p, st.path)))
        assert ckpt.pending(link) or h.done()
        ckpt.wait_for(link)
        assert h.done() and not ckpt.pending(link)
    assert committed == [(link, link)] and os.path.islink(link)
    assert torch.equal(torch.load(target)["w"], sd(1.0, 4 << 20)["w"])


@pytest.fixture
def protected_symlinks():
    """fs.protected_symlinks on (the default of most distributions), restored afterwards."""
    knob = "/proc/sys/fs/protected_symlinks"
    try:
        old = open(knob).read().strip()
        with open(knob, "w") as f:
            f.write("1")
    except OSError as e:
        pytest.skip(f"cannot set {knob}: {e}")
    try:
        yield
    finally:
        with open(knob, "w") as f:
            f.write(old)


@needs_root
def test_a_link_planted_by_another_user_in_a_sticky_directory_is_not_followed(shared_dir, disk_dir,
                                                                               protected_symlinks):
    """/tmp-style attack: another user plants ckpt.pt -> the victim's file in a sticky
    world-writable directory. The kernel refuses to follow it for open() (torch.save gets
    EACCES); we resolve links ourselves, so we must refuse too."""
    os.chmod(shared_dir, 0o1777)
    victim = os.path.join(disk_dir, "precious.pt")
    fp_core.save(sd(1.0), victim)
    link = os.path.join(shared_dir, "ckpt.pt")
    os.symlink(victim, link)
    os.lchown(link, 65534, 65534)
    with pytest.raises((PermissionError, RuntimeError)):  # the reference
        torch.save(sd(2.0), link)
    for writer in (_sync, _async):
        with pytest.raises(PermissionError, match="protected_symlinks"):
            writer(sd(2.0), link)
    assert torch.equal(torch.load(victim)["w"], sd(1.0)["w"]) and os.path.islink(link)
    own = os.path.join(shared_dir, "mine.pt")  # a link of our own there is followed as before
    os.symlink(victim, own)
    fp_core.save(sd(3.0), own)
    assert torch.equal(torch.load(victim)["w"], sd(3.0)["w"])


def test_a_crash_between_the_renames_behind_a_link_is_undone_where_the_link_points(disk_dir):
    """publish_dir set the directory the link names aside and died before the second
    rename: recover_dir of the link's name puts it back (it looks beside the target)."""
    runs, link = _dir_behind_link(disk_dir, "ck")
    os.rename(os.path.join(runs, "ck"), os.path.join(runs, commit.REPLACED_PREFIX + "ck"))  # the first rename
    commit.recover_dir(link)
    assert os.listdir(link) == ["old"] and os.listdir(runs) == ["ck"]


@needs_root
def test_an_acl_is_not_copied_onto_a_group_it_was_not_written_for(shared_dir):
    """root's 0640 file, ACL user:65534:rw group::r-- mask::rw other::---, replaced by user
    65534: the new file is in 65534's group, which must not inherit the old group's entry."""
    p = os.path.join(shared_dir, "ckpt.pt")
    fp_core.save(sd(1.0), p)
    os.chmod(p, 0o640)
    _set_acl(p, _acl((0x01, 6, _ANY), (0x02, 6, 65534), (0x04, 4, _ANY), (0x10, 6, _ANY), (0x20, 0, _ANY)))
    got = _as_user(65534, lambda: _outcome(lambda: fp_core.save(sd(2.0), p)))
    assert got == "ok", got
    st = os.stat(p)
    assert st.st_gid == 65534 and stat.S_IMODE(st.st_mode) & 0o077 == 0, oct(st.st_mode)
    with pytest.raises(OSError):
        os.getxattr(p, commit.ACL_XATTR)


@needs_root
def test_another_users_file_in_a_sticky_directory_is_refused_before_writing(shared_dir):
    """Only a file's owner may rename over it in a sticky directory: refused at once with
    EACCES, not after the whole checkpoint was written."""
    os.chmod(shared_dir, 0o1777)
    p = os.path.join(shared_dir, "ckpt.pt")
    fp_core.save(sd(1.0), p)
    os.chmod(p, 0o666)
    big = sd(2.0, 4 << 20)
    got = _as_user(65534, lambda: _outcome(lambda: fp_core.save(big, p)))
    assert got.startswith("PermissionError errno=13") and "sticky" in got, got
    assert torch.equal(torch.load(p)["w"], sd(1.0)["w"]) and _leftovers(shared_dir) == []


@needs_root
def test_a_planted_link_reached_through_dotdot_is_not_followed(shared_dir, disk_dir, protected_symlinks):
    """X/L/../ck.pt with L -> sticky/sub: the kernel resolves '..' after following L, so
    ck.pt is the planted link in the sticky directory, and is refused."""
    os.chmod(shared_dir, 0o1777)
    os.makedirs(os.path.join(shared_dir, "sub"))
    victim = os.path.join(disk_dir, "precious.pt")
    fp_core.save(sd(1.0), victim)
    planted = os.path.join(shared_dir, "ck.pt")
    os.symlink(victim, planted)
    os.lchown(planted, 65534, 65534)
    x = os.path.join(disk_dir, "X")
    os.makedirs(x)
    os.symlink(os.path.join(shared_dir, "sub"), os.path.join(x, "L"))
    via = os.path.join(x, "L", "..", "ck.pt")
    with pytest.raises((PermissionError, RuntimeError)):  # the reference
        torch.save(sd(2.0), via)
    with pytest.raises(PermissionError, match="protected_symlinks"):
        fp_core.save(sd(2.0), via)
    assert torch.equal(torch.load(victim)["w"], sd(1.0)["w"])


def test_a_hard_linked_file_is_replaced_under_its_name_alone_with_a_warning(disk_dir, caplog):
    h1, h2 = os.path.join(disk_dir, "h1.pt"), os.path.join(disk_dir, "h2.pt")
    fp_core.save(sd(1.0), h1)
    os.link(h1, h2)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        fp_core.save(sd(2.0), h1)
    assert any("hard links" in r.getMessage() and h1 in r.getMessage() for r in caplog.records)
    assert torch.load(h1)["step"] == 2 and torch.load(h2)["step"] == 1


def test_children_forked_while_the_parent_writes_save_on_their_own(disk_dir):
    """A child forked while one of the engine's threads held its staging pool would wait on
    that lock forever (about one child in a hundred did): the child's pool starts anew."""
    out = _exit_scenario("fork-during-write", disk_dir)
    assert out["children"] and all(c == 0 for c in out["children"]), out
    assert torch.load(os.path.join(disk_dir, "ckpt.pt"), mmap=True)["w"].shape == (128 << 20,)
