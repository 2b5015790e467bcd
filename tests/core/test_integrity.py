"""Integrity: fp_core.verify and load(verify=True) catch damage anywhere in the file (tensor data,
pickle, local headers, manifest, central directory, truncation, extension) and name where it is;
foreign files; fp_core.inspect's records."""

from __future__ import annotations

import os
import zipfile

import pytest
import torch
from conftest import assert_identical
from conftest import flip_byte as _flip

import fp_core
from fp_core import CorruptCheckpointError, NotAFastPersistCheckpoint


def _model_ckpt(path: str) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    obj = {
        "model": {
            "layer": {"weight": torch.randn(256, 256, generator=g), "bias": torch.randn(256, generator=g)}
        },
        "step": 7,
    }
    fp_core.save(obj, path)
    return fp_core.inspect(path)


def _rec(records, tensor):
    return next(r for r in records if r.get("tensor") == tensor)


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _expect_corrupt(
    path: str, record: str | None = None, tensor: str | None = None, also_load: bool = True
) -> list[CorruptCheckpointError]:
    errs = []
    with pytest.raises(CorruptCheckpointError) as ei:
        fp_core.verify(path)
    errs.append(ei.value)
    if also_load:
        with pytest.raises(CorruptCheckpointError) as ei:
            fp_core.load(path, verify=True)
        errs.append(ei.value)
    for e in errs:
        assert e.path == path and path in str(e)
        if record is not None:
            assert e.record == record, str(e)
            assert record in str(e)
        if tensor is not None:
            assert e.tensor == tensor, str(e)
            assert tensor in str(e)
    return errs


def test_clean_checkpoint_verifies(disk_dir):
    path = os.path.join(disk_dir, "ok.pt")
    recs = _model_ckpt(path)
    rep = fp_core.verify(path)
    assert rep["records"] == len(recs)
    assert rep["bytes"] == os.path.getsize(path)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_tensor_data(disk_dir, where):
    path = os.path.join(disk_dir, "c.pt")
    w = _rec(_model_ckpt(path), "model.layer.weight")
    off = {"first": 0, "middle": w["size"] // 2 + 3, "last": w["size"] - 1}[where]
    _flip(path, w["offset"] + off)
    _expect_corrupt(path, record=w["name"], tensor="model.layer.weight")
    # Without verification the (damaged) data still loads: corruption is silent there.
    torch.load(path)


def test_zeroed_block_in_tensor_data(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    b = _rec(_model_ckpt(path), "model.layer.bias")
    w = _rec(fp_core.inspect(path), "model.layer.weight")
    _patch(path, w["offset"] + 4096 * 3, b"\0" * 4096)
    _expect_corrupt(path, record=w["name"], tensor="model.layer.weight")
    assert b["tensor"] == "model.layer.bias"


@pytest.mark.parametrize("keep", [0.5, "minus1", "minus100", "header_only"])
def test_truncated_file(disk_dir, keep):
    path = os.path.join(disk_dir, "c.pt")
    _model_ckpt(path)
    size = os.path.getsize(path)
    new = {0.5: size // 2, "minus1": size - 1, "minus100": size - 100, "header_only": 100}[keep]
    os.truncate(path, new)
    _expect_corrupt(path)


def test_extended_file(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    _model_ckpt(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    _expect_corrupt(path, also_load=False)


def test_flipped_byte_in_pickle(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    recs = _model_ckpt(path)
    pkl = next(r for r in recs if r["name"].endswith("/data.pkl"))
    _flip(path, pkl["offset"] + pkl["size"] // 2)
    errs = _expect_corrupt(path, record=pkl["name"])
    assert all(e.tensor is None for e in errs)


def test_flipped_byte_in_local_header(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    w = _rec(_model_ckpt(path), "model.layer.weight")
    _flip(path, w["offset"] - 20)  # padding in the record's extra field, before its data
    _expect_corrupt(path, record="<zip structure>")


def _tail_layout(path: str):
    with zipfile.ZipFile(path) as z:
        m = next(i for i in z.infolist() if i.filename.endswith(".fastpersist/manifest.json"))
        return m, z.start_dir


def test_flipped_byte_in_manifest(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    _model_ckpt(path)
    m, _ = _tail_layout(path)
    with open(path, "rb") as f:
        f.seek(m.header_offset)
        head = f.read(30)
    n, e = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    data_off = m.header_offset + 30 + n + e
    with open(path, "rb") as f:
        f.seek(data_off)
        text = f.read(m.file_size)
    pos = text.index(b'"crc32c":"') + len(b'"crc32c":"')  # a hex digit of a checksum
    _patch(path, data_off + pos, b"0" if text[pos : pos + 1] != b"0" else b"1")
    _expect_corrupt(path, record="<manifest and central directory>")


@pytest.mark.parametrize("field", ["mtime", "ext_attr", "eocd_comment_digit"])
def test_flipped_byte_in_central_directory(disk_dir, field):
    path = os.path.join(disk_dir, "c.pt")
    _model_ckpt(path)
    _, start_dir = _tail_layout(path)
    size = os.path.getsize(path)
    off = {"mtime": start_dir + 12, "ext_attr": start_dir + 38, "eocd_comment_digit": size - 3}[field]
    _flip(path, off)
    _expect_corrupt(path, record="<manifest and central directory>")


def test_verify_of_foreign_file(disk_dir):
    path = os.path.join(disk_dir, "torch.pt")
    obj = {"a": torch.randn(10), "b": [1, 2]}
    torch.save(obj, path)
    with pytest.raises(NotAFastPersistCheckpoint):
        fp_core.verify(path)
    assert_identical(obj, fp_core.load(path))  # loads without verification
    recs = fp_core.inspect(path)
    assert any(r["name"].endswith("data.pkl") for r in recs)
    junk = os.path.join(disk_dir, "junk.pt")
    with open(junk, "wb") as f:
        f.write(os.urandom(5000))
    with pytest.raises((CorruptCheckpointError, NotAFastPersistCheckpoint)):
        fp_core.verify(junk)


def test_inspect_lists_records(disk_dir):
    path = os.path.join(disk_dir, "i.pt")
    obj = {
        "model": {"w": torch.randn(10, 20), "h": torch.zeros(7, dtype=torch.float16)},
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.ones(3, dtype=torch.bool),
        "meta": "x",
    }
    fp_core.save(obj, path)
    recs = fp_core.inspect(path)
    by_tensor = {r["tensor"]: r for r in recs if r["kind"] == "storage"}
    assert by_tensor["model.w"]["dtype"] == "float32" and by_tensor["model.w"]["size"] == 800
    assert by_tensor["model.h"]["dtype"] == "float16" and by_tensor["model.h"]["size"] == 14
    assert by_tensor["ids"]["dtype"] == "int64" and by_tensor["ids"]["size"] == 40
    assert by_tensor["mask"]["dtype"] == "bool" and by_tensor["mask"]["size"] == 3
    names = [r["name"] for r in recs]
    assert any(n.endswith("/data.pkl") for n in names)
    # (zip CRC-32 fields are 0, as torch writes them with compute_crc32 off: compare raw bytes)
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for r in recs:
            info = z.getinfo(r["name"])
            assert info.file_size == r["size"]
            f.seek(info.header_offset)
            head = f.read(30)
            n, e = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
            assert info.header_offset + 30 + n + e == r["offset"], r
    for r in recs:
        if r["kind"] == "storage" and r["size"]:
            assert r["offset"] % 64 == 0, r  # a plain state's storages sit on torch's own alignment


def test_batched_header_and_gap_reads_match_one_by_one(tmp_path, monkeypatch):
    """The local headers read together (data_offsets) and the structure's gaps read by
    scatter reads (crc_of_ranges, here cut into many small batches) give exactly what
    reading each one alone gives."""
    import numpy as np

    from fp_core import _native
    from fp_core.format.plan import structure_ranges
    from fp_core.loading import integrity

    path = str(tmp_path / "m.pt")
    fp_core.save({f"t{i}": torch.full((100 + 37 * i,), float(i)) for i in range(60)}, path)
    data = open(path, "rb").read()
    monkeypatch.setattr(integrity, "_CHUNK", 4096)  # pieces of at most a block,
    monkeypatch.setattr(integrity, "_SCATTER_BATCH", 4096)  # a block's worth per scatter read
    with integrity.CheckpointFile(path) as cf:
        entries = cf.zip_directory()[0]
        one_by_one = [integrity.CheckpointFile.data_offset(cf, i) for i in entries]
        with integrity.CheckpointFile(path) as fresh:
            assert fresh.data_offsets(entries) == one_by_one
        view = integrity.read_manifest(cf)
        ranges = structure_ranges([(r.offset, r.offset + r.size) for r in view.manifest.records],
                                  view.header_offset)
        assert len(ranges) > 60 and sum(n for _, n in ranges) > 4096  # several batches
        expected = _native.crc32c(np.frombuffer(b"".join(data[o:o + n] for o, n in ranges), dtype=np.uint8))
        assert cf.crc_of_ranges(ranges) == expected
        assert expected == view.manifest.structure_crc32c
        with pytest.raises(CorruptCheckpointError, match="file ends"):
            cf.crc_of_ranges(ranges + [(len(data) - 10, 20)])  # past the end: named, not an EOFError
        cf.image = memoryview(data)
        assert cf.crc_of_ranges(ranges) == expected and cf.data_offsets(entries) == one_by_one
        with pytest.raises(CorruptCheckpointError, match="file ends"):
            cf.crc_of_ranges(ranges + [(len(data) - 10, 20)])
        cf.image = None


def _placeholder_of_a_killed_save(path: str) -> None:
    """The placeholder a pending save leaves when its process ends without running anything
    (os._exit): made by a real child process that claims the name and exits."""
    import subprocess
    import sys

    code = ("import os, sys; from fp_core.saving import commit; fd = commit.claim(sys.argv[1]); "
            "os._exit(0 if fd is not None else 3)")
    rc = subprocess.run([sys.executable, "-c", code, path]).returncode
    if rc == 3:
        pytest.skip("this file system has no user extended attributes: no placeholders")
    assert rc == 0


def test_the_placeholder_of_a_killed_save_is_named_as_such(disk_dir):
    path = os.path.join(disk_dir, "last.ckpt")
    _placeholder_of_a_killed_save(path)
    for call in (fp_core.load, lambda p: fp_core.load(p, verify="auto"), fp_core.verify, fp_core.inspect,
                 lambda p: fp_core.load_into({"w": torch.zeros(2)}, p)):
        with pytest.raises(CorruptCheckpointError, match="placeholder of a save that never completed") as ei:
            call(path)
        assert ei.value.path == path


def test_an_old_empty_placeholder_and_an_empty_file_are_corrupt_not_eof(disk_dir):
    from fp_core.saving import commit

    old = os.path.join(disk_dir, "old.ckpt")  # the placeholder format before it carried a marker
    open(old, "wb").close()
    try:
        os.setxattr(old, commit.PLACEHOLDER_XATTR, b"somehost-1234-0")
    except OSError:
        pytest.skip("no user extended attributes here")
    with pytest.raises(CorruptCheckpointError, match="placeholder of a save that never completed"):
        fp_core.load(old)
    empty = os.path.join(disk_dir, "empty.pt")
    open(empty, "wb").close()
    for call in (fp_core.load, lambda p: fp_core.load(p, verify=True), fp_core.verify,
                 lambda p: fp_core.load_into({"w": torch.zeros(2)}, p)):
        with pytest.raises(CorruptCheckpointError, match="empty file, 0 bytes") as ei:
            call(empty)
        assert ei.value.path == empty
