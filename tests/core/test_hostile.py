"""Bad input and hostile users: a shared temp directory, another local user, a remote
store's names, crafted paths. Each test fails on the defect it names and passes once fixed.

Tests that need a second user fork a child that drops to ``nobody`` (``os.setuid``), so
they run only as root (as CI does here); elsewhere they skip with that reason.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import struct
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


# ---------------------------------------------------------------- 5, 6. crafted and damaged files


def _manifest_entry(path: str):
    import zipfile

    with zipfile.ZipFile(path) as z:
        return next(i for i in z.infolist() if i.filename.endswith(".fastpersist/manifest.json"))


def _restamp_tail(path: str) -> None:
    """Re-stamp the tail CRC-32C in the zip comment, as anyone editing a file can."""
    from fp_core import _native

    info = _manifest_entry(path)
    data = open(path, "rb").read()
    crc = _native.crc32c(data[info.header_offset: len(data) - 8])
    with open(path, "r+b") as f:
        f.seek(len(data) - 8)
        f.write(f"{crc:08x}".encode())


def _rewrite_manifest(path: str, edit) -> None:
    """Replace the manifest JSON by ``edit(doc)`` (bytes or a JSON document) in place,
    padded to the reserved length, and re-stamp the tail checksum."""
    import struct

    info = _manifest_entry(path)
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        head = f.read(30)
        n, e = struct.unpack_from("<HH", head, 26)
        off = info.header_offset + 30 + n + e
        f.seek(off)
        doc = json.loads(f.read(info.file_size))
        new = edit(doc)
        raw = new if isinstance(new, bytes) else json.dumps(new, separators=(",", ":")).encode()
        assert len(raw) <= info.file_size, (len(raw), info.file_size)
        f.seek(off)
        f.write(raw + b" " * (info.file_size - len(raw)))
    _restamp_tail(path)


def _many_tensors(n: int = 40) -> dict:
    g = torch.Generator().manual_seed(1)
    return {f"layer{i}.weight": torch.randn(64 + i, generator=g) for i in range(n)}


def _first_storage(doc):
    return next(r for r in doc["records"] if r["kind"] == "storage")


def _set(rec, **kw):
    rec.update(kw)


def _unnamed(doc):
    """Drop the tensor names, to make room in the reserved space for wider numbers."""
    for r in doc["records"]:
        r.pop("tensor", None)
    return doc


CRAFTED = {
    "not json": lambda doc: b"\x00\xff{not json",
    "a list": lambda doc: [1, 2, 3],
    "no records": lambda doc: {k: v for k, v in doc.items() if k != "records"},
    "records not a list": lambda doc: dict(doc, records={"a": 1}),
    "size -1 with crc 0": lambda doc: (_set(_first_storage(doc), size=-1, crc32c="00000000"), doc)[1],
    "offset a string": lambda doc: (_set(_first_storage(doc), offset=str(_first_storage(doc)["offset"])), doc)[1],
    "offset 2**70": lambda doc: (_set(_first_storage(doc), offset=2**70), _unnamed(doc))[1],
    "size past the end": lambda doc: (_set(_first_storage(doc), size=10**12), doc)[1],
    "crc not hex": lambda doc: (_set(_first_storage(doc), crc32c="zzzzzzzz"), doc)[1],
    "record a string": lambda doc: dict(doc, records=["x"] + doc["records"][1:]),
    "unknown kind": lambda doc: (_set(_first_storage(doc), kind="weird"), doc)[1],
    "file_size a float": lambda doc: dict(doc, file_size=float(doc["file_size"])),
    "alignment 3": lambda doc: dict(doc, alignment=3),
    "unknown record name": lambda doc: (_set(_first_storage(doc), name="archive/data/9999"), doc)[1],
    "every record one tensor": lambda doc: dict(
        doc, records=[dict(_first_storage(doc), tensor=None)] * len(doc["records"])),
    "records out of order": lambda doc: dict(doc, records=list(reversed(doc["records"]))),
    "deep nesting": lambda doc: b"[" * 1500 + b"]" * 1500,
}


def _lightning_io():
    lightning = pytest.importorskip("fp_integrations.lightning")
    return lightning.FastPersistIO()


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_manifest_is_a_corrupt_checkpoint_everywhere(tmp_path, case):
    from fp_core.tools import cli

    path = str(tmp_path / "crafted.pt")
    fp_core.save(_many_tensors(), path)
    good = str(tmp_path / "good.pt")
    fp_core.save(_many_tensors(), good)
    try:
        _rewrite_manifest(path, CRAFTED[case])
    except AssertionError:
        pytest.skip("the crafted manifest does not fit the reserved space")
    with pytest.raises(CorruptCheckpointError) as ei:
        fp_core.verify(path)
    assert ei.value.path == path
    with pytest.raises(CorruptCheckpointError):
        fp_core.load(path, verify=True)
    with pytest.raises(CorruptCheckpointError):
        _lightning_io().load_checkpoint(path)
    assert cli.main(["verify", path, good]) == 1  # reports the bad file and still checks the next


def test_cli_verify_reports_and_continues(tmp_path, capsys):
    from fp_core.tools import cli

    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    good = str(tmp_path / "good.pt")
    fp_core.save(small_state(), good)
    assert cli.main(["verify", str(bad), str(tmp_path / "missing.pt"), good]) != 0
    out = capsys.readouterr()
    assert f"OK   {good}" in out.out and str(bad) in out.err and "missing.pt" in out.err


def test_huge_manifest_entry_size_is_corrupt_not_memory_error(tmp_path):
    import struct

    path = str(tmp_path / "c.pt")
    fp_core.save(small_state(), path)
    info = _manifest_entry(path)
    data = bytearray(open(path, "rb").read())
    name = info.filename.encode()
    cd = data.index(b"PK\x01\x02" + bytes(data[data.index(b"PK\x01\x02") + 4:][:0]), 0)
    while not data[cd + 46: cd + 46 + len(name)] == name:  # the manifest's central directory entry
        cd = data.index(b"PK\x01\x02", cd + 4)
    struct.pack_into("<II", data, cd + 20, 2**32 - 2, 2**32 - 2)  # compressed and uncompressed size
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        fp_core.verify(path)


def test_bit_flip_in_the_manifest_name_does_not_switch_verification_off(tmp_path):
    path = str(tmp_path / "c.pt")
    fp_core.save(small_state(2), path)
    data = bytearray(open(path, "rb").read())
    cd = data.rindex(b".fastpersist/manifest.json")  # the central directory's copy of the name
    data[cd + len(".fastpersist/manifes")] ^= 0x01  # manifest.json -> manifesu.json
    w = data.index(b"\x00" * 0) + data.find(torch.arange(4096, dtype=torch.float32).add(2).numpy().tobytes()[:64])
    data[w + 16] ^= 0x40  # and a damaged tensor, which a switched-off check would return
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="no manifest"):
        fp_core.verify(path)
    with pytest.raises(CorruptCheckpointError):
        _lightning_io().load_checkpoint(path)
    with pytest.raises(CorruptCheckpointError):
        fp_core.load(path, verify="auto")
    hf = pytest.importorskip("fp_integrations.hf")
    ckdir = tmp_path / "checkpoint-3"
    ckdir.mkdir()
    os.replace(path, ckdir / "optimizer.pt")
    with pytest.raises(CorruptCheckpointError):
        hf.verify_checkpoint_dir(str(ckdir))


@pytest.mark.parametrize("header", [b"\x00\x00\x00\x00\x00\x01\x00\x00", b"\x10\x00\x00\x00\x00\x00\x00\x00"])
def test_hf_safetensors_header_is_checked_without_trusting_it(tmp_path, header):
    hf = pytest.importorskip("fp_integrations.hf")
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    (d / "model.safetensors").write_bytes(header + b"{not json}" + b"\x00" * 64)
    with pytest.raises(CorruptCheckpointError) as ei:
        hf.verify_checkpoint_dir(str(d))
    assert ei.value.path == str(d / "model.safetensors")


# ---------------------------------------------------------------- 4. one descriptor per check


REPLACER = r"""
import os, shutil, sys, time
src_a, src_b, target, stop = sys.argv[1:5]
i = 0
while not os.path.exists(stop):
    tmp = f"{target}.tmp{i % 2}"
    shutil.copyfile(src_a if i % 2 else src_b, tmp)
    os.replace(tmp, target)
    i += 1
print(i)
"""


def test_check_reads_one_file_while_its_name_is_replaced(tmp_path):
    """Another process keeps replacing last.ckpt atomically with one of two different whole
    checkpoints: every verify / verified load must see one whole file, never call it corrupt."""
    import subprocess
    import sys

    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    fp_core.save({"state": _many_tensors(60), "epoch": 1}, a)
    fp_core.save({"state": {k: v[:10] for k, v in _many_tensors(90).items()}, "epoch": 2}, b)
    target, stop = str(tmp_path / "last.ckpt"), str(tmp_path / "stop")
    shutil.copyfile(a, target)
    proc = subprocess.Popen([sys.executable, "-c", REPLACER, a, b, target, stop], stdout=subprocess.PIPE, text=True)
    io = _lightning_io()
    corrupt, epochs = 0, set()
    try:
        for _ in range(80):
            for fn in (fp_core.verify, lambda p: fp_core.load(p, verify=True), io.load_checkpoint):
                try:
                    out = fn(target)
                except CorruptCheckpointError:
                    corrupt += 1
                else:
                    if isinstance(out, dict) and "epoch" in out:
                        epochs.add(out["epoch"])
    finally:
        open(stop, "w").close()
        replaced = int(proc.communicate(timeout=60)[0])
    assert replaced > 50, "the replacing process did not keep up"
    assert corrupt == 0
    assert epochs == {1, 2}


def test_a_zip_directory_pointing_before_the_file_is_corrupt(tmp_path):
    """An end-of-directory record whose directory offset is too large makes zipfile report
    negative header offsets: a CorruptCheckpointError, not a bare OSError(EINVAL)."""
    import struct

    path = str(tmp_path / "c.pt")
    fp_core.save(small_state(), path)
    data = bytearray(open(path, "rb").read())
    eocd = data.rindex(b"PK\x05\x06")
    (cd_off,) = struct.unpack_from("<I", data, eocd + 16)
    if cd_off == 0xFFFFFFFF:
        pytest.skip("zip64 directory offset")
    struct.pack_into("<I", data, eocd + 16, cd_off + 10**6)
    open(path, "wb").write(bytes(data))
    for fn in (fp_core.verify, lambda p: fp_core.load(p, verify=True), fp_core.inspect):
        with pytest.raises(CorruptCheckpointError):
            fn(path)


def test_a_legacy_torch_file_loads_with_verify_auto(tmp_path):
    path = str(tmp_path / "legacy.pt")
    torch.save({"w": torch.arange(5)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(fp_core.load(path, verify="auto")["w"], torch.arange(5))
    with pytest.raises(fp_core.NotAFastPersistCheckpoint):
        fp_core.verify(path)
    io = _lightning_io()
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(5))


# ------------------------------------------------- 7. unchecked loads of damaged files


def _state_and_target():
    g = torch.Generator().manual_seed(2)
    state = {"model": {f"l{i}.w": torch.randn(48, 17, generator=g) for i in range(10)},
             "opt": {"step": 3, "lr": [0.1, 0.2], "m": torch.arange(100.0)}}
    target = {"model": {f"l{i}.w": torch.empty(48, 17) for i in range(10)},
              "opt": {"step": 0, "lr": [0, 0], "m": torch.empty(100)}}
    return state, target


UNCHECKED_LOADS = {
    "load": lambda p, target: fp_core.load(p, weights_only=True),
    "load mmap": lambda p, target: fp_core.load(p, weights_only=True, mmap=True),
    "load_into": lambda p, target: fp_core.load_into(target, p),
}


def _pickle_at(raw: bytes) -> int:
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    n, e = struct.unpack_from("<HH", raw, info.header_offset + 26)
    return info.header_offset + 30 + n + e


def _renamed_in_the_directory(raw: bytes) -> bytes:
    """The zip directory's name of the first storage record changed (data/0 -> dbta/0)."""
    cd = raw.index(b"PK\x01\x02")
    i = raw.index(b"/data/0", cd)
    return raw[:i + 2] + b"b" + raw[i + 3:]


DAMAGES = {
    "truncated": lambda raw: raw[:len(raw) * 2 // 3],
    "pickle's first byte": lambda raw: (lambda i: raw[:i] + b"\x11" + raw[i + 1:])(_pickle_at(raw)),
    "directory's name of a record": _renamed_in_the_directory,
}


@pytest.mark.parametrize("writer", ["fastpersist", "torch.save"])
@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("how", sorted(UNCHECKED_LOADS))
def test_an_unchecked_load_of_a_damaged_file_names_the_damage(tmp_path, writer, damage, how):
    """Without verify, a load that fails on a damaged file raises CorruptCheckpointError
    naming the path (torch's own error chained where there was one), not torch's
    RuntimeError, a pickle error or a seek before the file's start."""
    state, target = _state_and_target()
    good = str(tmp_path / "good.pt")
    (fp_core.save if writer == "fastpersist" else torch.save)(state, good)
    raw = open(good, "rb").read()
    bad = str(tmp_path / "bad.pt")
    open(bad, "wb").write(DAMAGES[damage](raw))
    with pytest.raises(CorruptCheckpointError) as ei:
        UNCHECKED_LOADS[how](bad, target)
    assert ei.value.path == bad
    out = UNCHECKED_LOADS[how](good, target)  # the undamaged file still loads
    assert torch.equal(out["model"]["l3.w"], state["model"]["l3.w"])


@pytest.mark.parametrize("writer", ["fastpersist", "torch.save"])
def test_randomly_damaged_files_load_or_raise_corrupt_checkpoint(tmp_path, writer):
    """Bit flips, truncations and overwritten bytes anywhere: every unchecked load either
    loads (damage inside tensor bytes is only found by verify) or raises
    CorruptCheckpointError naming the path; no other exception."""
    import random

    state, target = _state_and_target()
    good = str(tmp_path / "good.pt")
    (fp_core.save if writer == "fastpersist" else torch.save)(state, good)
    raw = open(good, "rb").read()
    rng = random.Random(11)
    bad = str(tmp_path / "bad.pt")
    failed = 0
    for _ in range(60):
        b = bytearray(raw)
        kind = rng.randrange(4)
        if kind == 0:
            b = b[:rng.randrange(len(b))]
        elif kind == 1:  # the zip's structure and the pickle are at the two ends of the file
            for _ in range(rng.randint(1, 3)):
                i = rng.choice([rng.randrange(min(len(b), 8192)), len(b) - 1 - rng.randrange(min(len(b), 65536))])
                b[i] ^= 1 << rng.randrange(8)
        elif kind == 2:
            i = rng.randrange(len(b))
            b[i:i + 8] = bytes(rng.randrange(256) for _ in range(8))
        else:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        open(bad, "wb").write(bytes(b))
        for how, load in UNCHECKED_LOADS.items():
            try:
                load(bad, target)
            except CorruptCheckpointError as e:
                assert e.path == bad, how
                failed += 1
    assert failed > 30  # the damage did reach the loaders


class _NotAllowed:
    pass


def test_a_failed_load_of_a_whole_file_keeps_its_own_error(tmp_path):
    """What no damage explains stays the load's own error: a class weights_only refuses,
    a target shaped otherwise, a device that is not there."""
    path = str(tmp_path / "c.pt")
    fp_core.save({"w": torch.ones(3), "obj": _NotAllowed()}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        fp_core.load(path, weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        fp_core.load_into({"w": torch.empty(3), "obj": None}, path)
    state, _ = _state_and_target()
    fp_core.save(state, path)
    wrong = {"model": {f"l{i}.w": torch.empty(48, 17) for i in range(10)},
             "opt": {"step": 0, "lr": [0, 0], "m": torch.empty(99)}}
    with pytest.raises(ValueError, match="opt.m"):
        fp_core.load_into(wrong, path)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            fp_core.load(path, map_location="cuda")


def test_a_damaged_file_is_still_the_runtime_error_torch_load_raises(tmp_path):
    """Code written around torch.load (``except RuntimeError``: fall back to an older
    checkpoint) catches FastPersist's error for the same damaged file."""
    path = str(tmp_path / "c.pt")
    torch.save(small_state(), path)
    raw = open(path, "rb").read()
    open(path, "wb").write(_renamed_in_the_directory(raw))
    with pytest.raises(RuntimeError, match="PytorchStreamReader"):
        torch.load(path)
    with pytest.raises(RuntimeError) as ei:
        fp_core.load(path)
    assert isinstance(ei.value, CorruptCheckpointError)


def test_a_damaged_remote_checkpoint_is_named_by_its_url(mem, tmp_path):
    """A remote checkpoint is checked and loaded on a staged copy, which is gone by the time
    the error is read: the CorruptCheckpointError names the URL the caller gave (the staged
    copy's error chained), and so do "not a FastPersist checkpoint" and torch's
    weights-only refusal."""
    fs, root = mem
    state, target = _state_and_target()
    local = str(tmp_path / "c.pt")
    fp_core.save(state, local)
    raw = bytearray(open(local, "rb").read())
    rec = next(r for r in fp_core.inspect(local) if r.get("tensor") == "model.l3.w")
    raw[rec["offset"] + 10] ^= 0x04
    url = f"{root}/damaged.pt"
    with fs.open(url.removeprefix("memory://"), "wb") as f:
        f.write(bytes(raw))
    truncated = f"{root}/truncated.pt"
    with fs.open(truncated.removeprefix("memory://"), "wb") as f:
        f.write(bytes(raw[:len(raw) // 3]))
    for what, call in [("verify", lambda u: fp_core.verify(u)),
                       ("load verify", lambda u: fp_core.load(u, verify=True)),
                       ("load_into verify", lambda u: fp_core.load_into(target, u, verify=True))]:
        with pytest.raises(CorruptCheckpointError) as ei:
            call(url)
        assert ei.value.path == url and ei.value.tensor == "model.l3.w", what
        assert isinstance(ei.value.__cause__, CorruptCheckpointError), what
    for what, call in [("load", lambda u: fp_core.load(u)), ("load_into", lambda u: fp_core.load_into(target, u))]:
        with pytest.raises(CorruptCheckpointError) as ei:
            call(truncated)
        assert ei.value.path == truncated, what
    # the other errors that name the file name the URL too
    stock = f"{root}/stock.pt"
    torch.save(state, local)
    with fs.open(stock.removeprefix("memory://"), "wb") as f:
        f.write(open(local, "rb").read())
    with pytest.raises(fp_core.NotAFastPersistCheckpoint, match=f"^{stock} has no FastPersist manifest"):
        fp_core.verify(stock)
    refused = f"{root}/refused.pt"
    fp_core.save({"obj": _NotAllowed()}, local)
    with fs.open(refused.removeprefix("memory://"), "wb") as f:
        f.write(open(local, "rb").read())
    with pytest.raises(pickle.UnpicklingError, match=f"Weights only load failed for {refused}:"):
        fp_core.load(refused, weights_only=True)


def test_a_failed_load_of_a_file_without_zip_crcs_keeps_its_own_error(tmp_path):
    """torch can write its zip without CRC-32s (``compute_crc32 = False``: all 0): a load
    of such a file that fails for a reason of its own is not called damaged."""
    from torch.utils.serialization import config

    path = str(tmp_path / "nocrc.pt")
    was = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save({"w": torch.ones(3), "obj": _NotAllowed()}, path)
    finally:
        config.save.compute_crc32 = was
    assert isinstance(torch.load(path, weights_only=False)["obj"], _NotAllowed)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        fp_core.load(path, weights_only=True)
    with pytest.raises(ValueError, match="in the target"):
        fp_core.load_into({"w": torch.empty(4), "obj": None}, path, weights_only=False)


@pytest.mark.parametrize("content", [b"version https://git-lfs.github.com/spec/v1\n", b"\x93NUMPY\x01\x00"])
def test_a_file_that_is_no_checkpoint_keeps_torchs_error(tmp_path, content):
    """A git-lfs pointer, another format: not a zip at all, so not a damaged checkpoint
    either; the load raises what torch.load raises for it. (An empty file is what a save
    that never completed leaves: a CorruptCheckpointError naming it, test_integrity.)"""
    path = str(tmp_path / "x.pt")
    open(path, "wb").write(content)
    with pytest.raises(Exception) as want:
        torch.load(path, weights_only=False)
    with pytest.raises(Exception) as got:
        fp_core.load(path, weights_only=False)
    assert type(got.value) is type(want.value) and not isinstance(got.value, CorruptCheckpointError)
