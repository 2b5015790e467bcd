"""A checkpoint directory's manifest (fp_core.loading.checkpoint_dir.DIR_MANIFEST): what it lists is
checked on verify (missing, resized, replaced), what it does not list is extra; the manifest
itself is untrusted input: a damaged or crafted one is CorruptCheckpointError, never a
traceback and never a look outside the directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

import fp_core
from fp_core import CorruptCheckpointError
from fp_core.loading.checkpoint_dir import (
    DIR_MANIFEST,
    DIR_MANIFEST_FORMAT,
    MAX_DIR_MANIFEST_BYTES,
    _manifest_crc,
    read_dir_manifest,
    write_dir_manifest,
)


def _checkpoint_dir(root: str) -> str:
    """A directory like the HF callback's: a FastPersist torch file, a safetensors file,
    JSON, a subdirectory; its manifest written last."""
    d = os.path.join(root, "checkpoint-8")
    os.makedirs(os.path.join(d, "extra_state"))
    fp_core.save({"state": {0: {"exp_avg": torch.randn(64, 8)}}, "step": 8}, os.path.join(d, "optimizer.pt"))
    fp_core.save({"w": torch.randn(32, 4)}, os.path.join(d, "model.safetensors"), format="safetensors")
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 8}, f, indent=2)
    doc = write_dir_manifest(d)
    assert doc["format"] == DIR_MANIFEST_FORMAT and doc["dirs"] == ["extra_state"]
    assert set(doc["files"]) == {"optimizer.pt", "model.safetensors", "trainer_state.json"}
    return d


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp_core.tools.cli", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=REPO))


def test_listed_entries_are_checked_and_unlisted_ones_are_extra(disk_dir):
    d = _checkpoint_dir(disk_dir)
    report = fp_core.verify(d)
    assert report["manifest"] and report["extra"] == [] and report["verified"] == 2
    with open(os.path.join(d, "README.md"), "w") as f:
        f.write("notes")
    assert fp_core.verify(d)["extra"] == ["README.md"]
    os.rename(os.path.join(d, "optimizer.pt"), os.path.join(disk_dir, "optimizer.pt"))
    with pytest.raises(CorruptCheckpointError, match="missing: optimizer.pt, listed in the directory manifest") as ei:
        fp_core.verify(d)
    assert ei.value.path == d
    os.rename(os.path.join(disk_dir, "optimizer.pt"), os.path.join(d, "optimizer.pt"))
    os.rmdir(os.path.join(d, "extra_state"))
    with pytest.raises(CorruptCheckpointError, match="missing: the directory extra_state"):
        fp_core.verify(d)
    os.makedirs(os.path.join(d, "extra_state"))
    with open(os.path.join(d, "trainer_state.json"), "w") as f:  # still JSON: only its size tells
        json.dump({"global_step": 8}, f)
    with pytest.raises(CorruptCheckpointError, match=r"bytes, \d+ listed in the directory manifest") as ei:
        fp_core.verify(d)
    assert ei.value.path == os.path.join(d, "trainer_state.json")
    os.remove(os.path.join(d, "trainer_state.json"))
    os.symlink(os.path.join(d, "optimizer.pt"), os.path.join(d, "trainer_state.json"))
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        fp_core.verify(d)


def test_a_directory_without_a_manifest_is_verified_as_before(disk_dir):
    d = _checkpoint_dir(disk_dir)
    os.remove(os.path.join(d, DIR_MANIFEST))
    os.remove(os.path.join(d, "optimizer.pt"))
    report = fp_core.verify(d)
    assert not report["manifest"] and report["extra"] == [] and report["verified"] == 1


def _crafted(files: object = None, dirs: object = None, **over: object) -> dict:
    files = {"optimizer.pt": 1} if files is None else files
    dirs = [] if dirs is None else dirs
    try:
        crc = _manifest_crc(files, dirs)  # a valid CRC: the field checks are what must refuse it
    except (TypeError, ValueError):
        crc = "00000000"
    return {"format": DIR_MANIFEST_FORMAT, "files": files, "dirs": dirs, "crc32c": crc, **over}


CRAFTED = {
    "parent name": _crafted({"../outside.pt": 5}),
    "path name": _crafted({"sub/x.pt": 5}),
    "absolute name": _crafted({"/etc/passwd": 5}),
    "dot dot": _crafted({"..": 5}),
    "dot": _crafted({".": 5}),
    "NUL in a name": _crafted({"optimizer.pt\0x": 5}),
    "empty name": _crafted({"": 5}),
    "dotfile": _crafted({".fastpersist-dir.json": 5}),
    "long name": _crafted({"x" * 300: 5}),
    "lone surrogate": _crafted({"a\ud800b": 5}),
    "negative size": _crafted({"optimizer.pt": -1}),
    "float size": _crafted({"optimizer.pt": 1.5}),
    "string size": _crafted({"optimizer.pt": "12"}),
    "bool size": _crafted({"optimizer.pt": True}),
    "huge size": _crafted({"optimizer.pt": 1 << 64}),
    "parent dir": _crafted({}, ["../.."]),
    "dir not a string": _crafted({}, [7]),
    "name twice": _crafted({"optimizer.pt": 1}, ["optimizer.pt"]),
    "files a list": _crafted(["optimizer.pt"]),
    "no crc": {"format": DIR_MANIFEST_FORMAT, "files": {}, "dirs": []},
    "wrong crc": _crafted(crc32c="deadbeef"),
    "other format": _crafted(format="fastpersist-checkpoint-dir/99"),
    "not an object": [1, 2, 3],
}


@pytest.mark.parametrize("what", sorted(CRAFTED))
def test_a_crafted_manifest_is_corrupt_not_a_traceback(disk_dir, what):
    d = _checkpoint_dir(disk_dir)
    with open(os.path.join(disk_dir, "outside.pt"), "wb") as f:  # what a '..' name would reach
        f.write(b"12345")
    with open(os.path.join(d, DIR_MANIFEST), "w") as f:
        json.dump(CRAFTED[what], f)
    with pytest.raises(CorruptCheckpointError, match="the directory manifest") as ei:
        fp_core.verify(d)
    assert ei.value.path == os.path.join(d, DIR_MANIFEST)


@pytest.mark.parametrize("what", ["not JSON", "not UTF-8", "deep nesting", "too large", "a symlink", "a directory",
                                  "a FIFO"])
def test_a_damaged_manifest_file_is_corrupt(disk_dir, what):
    d = _checkpoint_dir(disk_dir)
    p = os.path.join(d, DIR_MANIFEST)
    os.remove(p)
    if what == "not JSON":
        data = b'{"format": "fastpersist-checkpoint-dir/1", "files": {'
    elif what == "not UTF-8":
        data = b'{"format": "\xff\xfe"}'
    elif what == "deep nesting":
        data = b"[" * 100_000 + b"]" * 100_000
    if what in ("not JSON", "not UTF-8", "deep nesting"):
        with open(p, "wb") as f:
            f.write(data)
    elif what == "too large":  # sparse: its size alone is refused, nothing of it is read
        with open(p, "wb") as f:
            f.truncate(MAX_DIR_MANIFEST_BYTES + 1)
    elif what == "a symlink":  # never followed out of the directory
        target = os.path.join(disk_dir, "elsewhere.json")
        with open(target, "w") as f:
            json.dump(_crafted({}), f)
        os.symlink(target, p)
    elif what == "a directory":
        os.mkdir(p)
    else:
        os.mkfifo(p)  # opened without blocking, refused as no regular file
    with pytest.raises(CorruptCheckpointError, match="the directory manifest") as ei:
        read_dir_manifest(d)
    assert ei.value.path == p
    out = _cli("verify", d)
    assert out.returncode == 1 and DIR_MANIFEST in out.stderr, out


def test_a_damaged_size_in_the_manifest_is_named_as_the_manifest_damaged(disk_dir):
    """One digit of a listed size damaged: the manifest's own CRC-32C says it is the
    manifest that is damaged, not the file it lists."""
    d = _checkpoint_dir(disk_dir)
    p = os.path.join(d, DIR_MANIFEST)
    doc = json.loads(open(p).read())
    doc["files"]["optimizer.pt"] += 1
    with open(p, "w") as f:
        json.dump(doc, f)
    with pytest.raises(CorruptCheckpointError, match="does not match its CRC-32C") as ei:
        fp_core.verify(d)
    assert ei.value.path == p
