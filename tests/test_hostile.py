"""Bad input and hostile users: a shared temp directory, another local user, a remote
store's names, crafted paths. Each test fails on the defect it names and passes once fixed.

Tests that need a second user fork a child that drops to ``nobody`` (``os.setuid``), so
they run only as root (as CI does here); elsewhere they skip with that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import uuid

import pytest
import torch

import fp_core
from fp_core import remote
from fp_core.errors import CorruptCheckpointError

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second local user needs root (os.setuid)")


def as_other_user(fn, uid: int = OTHER_UID) -> int:
    """Run ``fn()`` in a forked child with uid/gid ``uid``; return its exit status (0: ok)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            fn()
            code = 0
        except BaseException as e:  # noqa: BLE001
            print(f"child failed: {type(e).__name__}: {e}", flush=True)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def shared_tmp(monkeypatch, tmp_path_factory):
    """A world-writable sticky directory standing in for /tmp (inside the real one, so other
    users can reach it), made the default temp dir, with FastPersist's staging
    configuration reset to its defaults."""
    tmp_path_factory.getbasetemp()  # pytest's own temp root is settled before we move the default
    d = tempfile.mkdtemp(prefix="fp-hostile-", dir="/tmp")
    os.chmod(d, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", d)
    monkeypatch.delenv(remote.STAGING_ENV, raising=False)
    remote.configure(None, None)
    remote._cleaned.clear()
    yield d
    remote.configure(None, None)
    remote._cleaned.clear()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def mem():
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/hostile-" + uuid.uuid4().hex[:12]
    yield fs, f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def small_state(seed: int = 0) -> dict:
    return {"w": torch.arange(4096, dtype=torch.float32) + seed, "step": seed}


def default_staging(shared_tmp: str) -> str:
    return os.path.join(shared_tmp, f"fastpersist-staging-{os.getuid()}")


# ---------------------------------------------------------------- 1. the staging directory


@as_root
def test_staging_dir_created_first_by_another_user_is_refused(shared_tmp, mem):
    staging = default_staging(shared_tmp)
    victim_home = os.path.join(shared_tmp, "home")
    os.makedirs(os.path.join(victim_home, "projects"))

    def squat():
        os.mkdir(staging, 0o777)
        os.chmod(staging, 0o777)
        os.mkdir(os.path.join(staging, "cache"), 0o777)
        os.symlink(victim_home, os.path.join(staging, "pending"))

    assert as_other_user(squat) == 0
    with pytest.raises(PermissionError, match=f"uid {OTHER_UID}") as ei:
        fp_core.save(small_state(), f"{mem[1]}/c.pt")
    assert ei.value.filename == staging
    assert os.path.isdir(os.path.join(victim_home, "projects"))  # nothing followed, nothing removed
    assert not mem[0].exists(mem[1] + "/c.pt")


@as_root
def test_staging_dir_that_is_a_symlink_is_refused(shared_tmp, mem):
    staging = default_staging(shared_tmp)
    victim_home = os.path.join(shared_tmp, "home2")
    os.makedirs(os.path.join(victim_home, "pending", "host-1-0123456789ab"))
    assert as_other_user(lambda: os.symlink(victim_home, staging)) == 0
    with pytest.raises(PermissionError, match="symbolic link"):
        fp_core.save(small_state(), f"{mem[1]}/c.pt")
    assert os.path.isdir(os.path.join(victim_home, "pending", "host-1-0123456789ab"))


def test_own_staging_dir_writable_by_others_is_refused(shared_tmp, mem):
    staging = default_staging(shared_tmp)
    os.mkdir(staging)
    os.chmod(staging, 0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        fp_core.save(small_state(), f"{mem[1]}/c.pt")


def test_own_readable_staging_dir_is_made_private(shared_tmp, mem):
    staging = default_staging(shared_tmp)
    os.mkdir(staging)
    os.chmod(staging, 0o755)
    fp_core.save(small_state(), f"{mem[1]}/c.pt")
    assert stat.S_IMODE(os.stat(staging).st_mode) == 0o700


@as_root
def test_staged_and_cached_files_are_private(shared_tmp, mem):
    url = f"{mem[1]}/c.pt"
    fp_core.save(small_state(3), url, keep_local=True)
    staging = default_staging(shared_tmp)
    modes = {}
    for root, dirs, files in os.walk(staging):
        for n in dirs:
            modes[os.path.join(root, n)] = stat.S_IMODE(os.lstat(os.path.join(root, n)).st_mode)
        for n in files:
            modes[os.path.join(root, n)] = stat.S_IMODE(os.lstat(os.path.join(root, n)).st_mode)
    modes[staging] = stat.S_IMODE(os.stat(staging).st_mode)
    cached = [p for p in modes if p.endswith("c.pt")]
    assert cached, modes
    assert all(m == (0o700 if os.path.isdir(p) else 0o600) for p, m in modes.items()), modes

    def peek():
        with open(cached[0], "rb") as f:
            f.read(1)

    assert as_other_user(peek) != 0  # another user cannot read a cached checkpoint
    got = fp_core.load(url, verify=True, keep_local=True)
    assert torch.equal(got["w"], small_state(3)["w"])


def test_staging_clean_up_never_follows_a_symlink(shared_tmp, tmp_path):
    staging = remote.staging_dir()
    victim = tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    os.symlink(victim, os.path.join(staging, "pending", "host-999999-0123456789ab"))
    remote.clean_staging(staging)
    assert (victim / "keep").is_dir()


def test_staging_slot_of_a_live_process_survives_clean_up(shared_tmp, mem):
    import fsspec

    staging = remote.staging_dir()
    slot = remote._Slot("x.pt")  # held (flock) by this process
    try:
        dead = os.path.join(staging, "pending", "otherhost-1-0123456789ab")  # nobody holds it
        os.mkdir(dead, 0o700)
        removed = remote.clean_staging(staging)
        assert removed == [dead] and os.path.isdir(slot.dir)
    finally:
        slot.close()
    assert not os.path.exists(slot.dir)
    assert fsspec  # the memory filesystem stays importable for the other tests


# ---------------------------------------------------------------- 2. names from a remote marker


@pytest.mark.parametrize("name", ["/abs/evil.txt", "../evil.txt", "a/../../evil.txt", "./x", "a//b", ""])
def test_download_dir_refuses_names_that_leave_the_target(mem, tmp_path, name):
    fs, root = mem
    url = f"{root}/checkpoint-1"
    fs.pipe_file(f"{root.removeprefix('memory://')}/checkpoint-1/ok.txt", b"ok")
    marker = json.dumps({"format": "fastpersist-dir/1", "files": {"ok.txt": 2, name: 4}}).encode()
    fs.pipe_file(f"{root.removeprefix('memory://')}/checkpoint-1/{remote.COMPLETE_MARKER}", marker)
    target = tmp_path / "dl" / "checkpoint-1"
    (tmp_path / "dl").mkdir()
    before = set(os.listdir(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="not a plain relative path") as ei:
        remote.download_dir(url, target)
    assert ei.value.path == url
    assert set(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "dl") == []


@pytest.mark.parametrize("files", [{"a.txt": -1}, {"a.txt": "4"}, {"a.txt": True}, ["a.txt"], None])
def test_download_dir_refuses_bad_sizes_and_tables(mem, tmp_path, files):
    fs, root = mem
    marker = json.dumps({"files": files}).encode()
    fs.pipe_file(f"{root.removeprefix('memory://')}/checkpoint-2/{remote.COMPLETE_MARKER}", marker)
    with pytest.raises(CorruptCheckpointError):
        remote.download_dir(f"{root}/checkpoint-2", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_hf_download_checkpoint_refuses_escaping_names(mem, tmp_path):
    hf = pytest.importorskip("fp_integrations.hf")
    fs, root = mem
    base = root.removeprefix("memory://")
    fs.pipe_file(f"{base}/checkpoint-7/model.safetensors", b"x" * 8)
    escape = os.path.relpath(tmp_path / "owned.txt", tmp_path / "dl" / "checkpoint-7")
    marker = json.dumps({"files": {"model.safetensors": 8, escape: 8}}).encode()
    fs.pipe_file(f"{base}/checkpoint-7/{remote.COMPLETE_MARKER}", marker)
    (tmp_path / "dl").mkdir()
    with pytest.raises(CorruptCheckpointError):
        hf.download_checkpoint(root, local_dir=tmp_path / "dl")
    assert not (tmp_path / "owned.txt").exists()


# ---------------------------------------------------------------- 3. '::' in a local path


def test_local_path_with_double_colon_is_local(tmp_path):
    exp = tmp_path / "exp"
    exp.write_bytes(b"precious")  # a file that a chained-URL reading would overwrite
    target = str(tmp_path / "exp::v2" / "ckpt.pt")
    with pytest.raises(FileNotFoundError) as ei:
        fp_core.save(small_state(), target)
    assert ei.value.filename == str(tmp_path / "exp::v2")
    assert exp.read_bytes() == b"precious"
    with pytest.raises(FileNotFoundError):
        fp_core.load(target)
    (tmp_path / "exp::v2").mkdir()
    fp_core.save(small_state(5), target)
    assert torch.equal(torch.load(target)["w"], small_state(5)["w"])
    assert fp_core.load(target, verify=True)["step"] == 5
    assert exp.read_bytes() == b"precious"


@pytest.mark.parametrize("path, expected", [
    ("/d/exp::v2/ckpt.pt", (False, "/d/exp::v2/ckpt.pt")),
    ("exp::v2/ckpt.pt", (False, "exp::v2/ckpt.pt")),
    ("simplecache::memory://b/x.pt", (True, "simplecache::memory://b/x.pt")),
    ("memory://b/x.pt", (True, "memory://b/x.pt")),
    ("file:///d/x.pt", (False, "/d/x.pt")),
    ("/d/s3://x.pt", (False, "/d/s3://x.pt")),
])
def test_split_is_remote_only_for_a_leading_protocol(path, expected):
    assert remote.split(path) == expected
