"""fp_core.save(..., format="safetensors"): a round trip read by safetensors itself, metadata, and
the objects the format cannot hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, assert_no_temps, flip_byte, tensor_bytes

import fp_core


def test_safetensors_roundtrip_and_metadata(disk_dir):
    from safetensors import safe_open
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(6)
    tensors = {
        "embed.weight": torch.randn(100, 64, generator=g),
        "layer.0.bias": torch.randn(64, generator=g).half(),
        "layer.0.scale": torch.randn(64, generator=g).to(torch.bfloat16),
        "ids": torch.arange(33, dtype=torch.int64),
        "mask": torch.ones(5, dtype=torch.bool),
        "transposed": torch.randn(16, 8, generator=g).t(),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 3),
        "u8": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
    }
    path = os.path.join(disk_dir, "model.safetensors")
    meta = {"format": "pt", "epoch": "3"}
    st = fp_core.save(tensors, path, format="safetensors", metadata=meta)
    assert st.bytes == os.path.getsize(path)
    got = load_file(path)
    assert list(got) == list(tensors) or set(got) == set(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert tensor_bytes(got[k]) == tensor_bytes(v), k
    with safe_open(path, framework="pt") as f:  # the caller's metadata, and FastPersist's checksums
        assert {k: v for k, v in f.metadata().items() if not k.startswith("fastpersist.")} == meta
    assert_no_temps(disk_dir)


def test_safetensors_rejects_non_flat_and_shared(disk_dir):
    path = os.path.join(disk_dir, "m.safetensors")
    with pytest.raises(TypeError):
        fp_core.save({"a": {"b": torch.ones(1)}}, path, format="safetensors")
    t = torch.ones(4)
    with pytest.raises((ValueError, TypeError)):
        fp_core.save({"a": t, "b": t}, path, format="safetensors")
    assert not os.path.exists(path)
    assert_no_temps(disk_dir)


def _tensors() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"embed.weight": torch.randn(300, 64, generator=g), "norm": torch.randn(7, generator=g).half(),
            "empty": torch.empty(0), "ids": torch.arange(1000, dtype=torch.int64),
            "big": torch.randn(1 << 20, generator=g)}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp_core.tools.cli", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=REPO))


def test_our_safetensors_carry_checksums_that_verify_and_load(disk_dir):
    """verify, inspect, load(verify="auto"|True) and `fastpersist verify` take FastPersist's own
    safetensors files: each tensor is checked against the CRC-32C in the header's metadata."""
    from safetensors.torch import load_file

    path = os.path.join(disk_dir, "model.safetensors")
    tensors = _tensors()
    fp_core.save(tensors, path, format="safetensors")
    report = fp_core.verify(path)
    assert report["kind"] == "safetensors" and report["checksums"] and report["records"] == len(tensors)
    rows = {r["tensor"]: r for r in fp_core.inspect(path)}
    assert set(rows) == set(tensors) and rows["norm"]["dtype"] == "F16" and rows["embed.weight"]["shape"] == [300, 64]
    assert all(len(r["crc32c"]) == 8 for r in rows.values())
    for verify in (False, "auto", True):
        got = fp_core.load(path, verify=verify)
        assert set(got) == set(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    stock = load_file(path)
    assert all(torch.equal(stock[k], v) for k, v in tensors.items())
    out = _cli("verify", path)
    assert out.returncode == 0 and "safetensors, 5 tensors" in out.stdout and "verified" in out.stdout, out


@pytest.mark.parametrize("where", ["tensor", "header", "dtype", "padding", "size"])
def test_damage_to_our_safetensors_is_named(disk_dir, where):
    path = os.path.join(disk_dir, "model.safetensors")
    fp_core.save(_tensors(), path, format="safetensors")
    big = next(r for r in fp_core.inspect(path) if r["tensor"] == "big")
    if where == "tensor":
        flip_byte(path, big["offset"] + big["size"] // 3)
    elif where == "header":  # a digit of a shape: still valid JSON, another tensor
        data = open(path, "rb").read()
        at = data.index(b'"shape":[300,64]') + len(b'"shape":[')
        flip_byte(path, at + 1, 0x01)  # 300 -> 310: still JSON, the sizes no longer match
    elif where == "dtype":  # I64 -> U64: the structure still fits, only the header's CRC tells
        data = open(path, "rb").read()
        flip_byte(path, data.index(b'"I64"') + 1, ord("I") ^ ord("U"))
        with pytest.raises(fp_core.CorruptCheckpointError, match="safetensors header"):
            fp_core.load(path)  # the header's own CRC is checked on every load (it is a few KiB)
    elif where == "padding":
        data = open(path, "rb").read()
        flip_byte(path, data.index(b"} ") + 5, 0x01)  # a space of the header's padding
    else:
        with open(path, "ab") as f:
            f.write(b"\0" * 16)
    with pytest.raises(fp_core.CorruptCheckpointError) as ei:
        fp_core.verify(path)
    assert ei.value.path == path
    if where == "tensor":
        assert ei.value.tensor == "big"
    with pytest.raises(fp_core.CorruptCheckpointError):
        fp_core.load(path, verify="auto")
    out = _cli("verify", path)
    assert out.returncode == 1 and "FAIL" in out.stderr, out


def test_a_safetensors_file_of_another_tool_is_structure_checked(disk_dir):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = os.path.join(disk_dir, "stock.safetensors")
    tensors = _tensors()
    save_file(tensors, path, metadata={"format": "pt"})
    report = fp_core.verify(path)
    assert report["kind"] == "safetensors" and not report["checksums"]
    out = _cli("verify", path)
    assert out.returncode == 0 and "no checksums, structure checked" in out.stdout, out
    got = fp_core.load(path, verify="auto")
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    with pytest.raises(fp_core.NotAFastPersistCheckpoint, match="without FastPersist checksums"):
        fp_core.load(path, verify=True)
    # FastPersist's metadata copied into a file another tool wrote: not taken for its checksums
    ours = os.path.join(disk_dir, "ours.safetensors")
    fp_core.save(tensors, ours, format="safetensors")
    with safe_open(ours, "pt") as f:
        meta = f.metadata()
    save_file(tensors, path, metadata=meta)
    report = fp_core.verify(path)
    assert not report["checksums"] and "metadata copied" in report["note"]
    with open(path, "r+b") as f:  # its structure is still checked
        f.truncate(os.path.getsize(path) - 1)
    with pytest.raises(fp_core.CorruptCheckpointError, match="truncated or extended"):
        fp_core.verify(path)


def test_an_async_safetensors_save_carries_checksums(disk_dir):
    path = os.path.join(disk_dir, "model.safetensors")
    tensors = _tensors()
    ck = fp_core.AsyncCheckpointer()
    try:
        ck.save(tensors, path, format="safetensors", metadata={"epoch": "2"}).result()
    finally:
        ck.close()
    assert fp_core.verify(path)["checksums"]
    got = fp_core.load(path, verify=True)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_json_and_foreign_files(disk_dir):
    good, bad = os.path.join(disk_dir, "trainer_state.json"), os.path.join(disk_dir, "config.json")
    with open(good, "w") as f:
        json.dump({"global_step": 8}, f)
    with open(bad, "w") as f:
        f.write('{"global_step": 8')
    assert fp_core.verify(good)["kind"] == "json"
    out = _cli("verify", good)
    assert out.returncode == 0 and "JSON" in out.stdout, out
    with pytest.raises(fp_core.CorruptCheckpointError, match="does not parse"):
        fp_core.verify(bad)
    with pytest.raises(fp_core.NotAFastPersistCheckpoint, match="JSON file, not a torch checkpoint"):
        fp_core.load(good)
    stock, noise = os.path.join(disk_dir, "stock.pt"), os.path.join(disk_dir, "noise.bin")
    torch.save({"w": torch.ones(3)}, stock)
    with open(noise, "wb") as f:
        f.write(bytes(range(256)) * 8)
    for p in (stock, noise):
        with pytest.raises(fp_core.NotAFastPersistCheckpoint):
            fp_core.verify(p)
        out = _cli("verify", p)
        assert out.returncode == 3 and "not a FastPersist checkpoint" in out.stderr, out
    out = _cli("verify", stock, good, bad)  # damage outranks "not ours"
    assert out.returncode == 1, out


@pytest.mark.parametrize("where", ["header_crc32c key", "file_size digit", "crc32c key", "file_size key",
                                   "header_crc32c digit"])
def test_damage_to_our_checksum_keys_is_not_taken_for_copied_metadata(disk_dir, where):
    """One damaged byte in FastPersist's own keys (a key's name, a digit of the file size or
    of the header CRC) is damage: the header's layout is still FastPersist's, so the keys
    are not mistaken for metadata another tool copied (which would leave the file unchecked)."""
    path = os.path.join(disk_dir, "model.safetensors")
    fp_core.save(_tensors(), path, format="safetensors")
    data = open(path, "rb").read()
    if where.endswith(" key"):  # a letter of the name: header_crc32c -> Header_crc32c and the like
        at = data.index(b'"fastpersist.' + where[:-4].encode() + b'"') + len(b'"fastpersist.')
        flip_byte(path, at, 0x20)
    else:  # a digit of the value: still a digit
        key = where[:-6].encode()
        at = data.index(b'"fastpersist.' + key + b'":"') + len(b'"fastpersist.' + key + b'":"')
        flip_byte(path, at + 1, 0x01)
    with pytest.raises(fp_core.CorruptCheckpointError, match="safetensors header") as ei:
        fp_core.verify(path)
    assert ei.value.path == path
    for verify in ("auto", False):  # the header is checked on every load
        with pytest.raises(fp_core.CorruptCheckpointError):
            fp_core.load(path, verify=verify)
    out = _cli("verify", path)
    assert out.returncode == 1 and "FAIL" in out.stderr and "no checksums" not in out.stdout, out


def test_fastpersist_metadata_passed_back_to_a_save_is_replaced(disk_dir):
    """Metadata read from a FastPersist file (safetensors returns it in no fixed order) and
    given to another FastPersist save: the new file carries its own checksums, all checked."""
    from safetensors import safe_open

    first, second = os.path.join(disk_dir, "a.safetensors"), os.path.join(disk_dir, "b.safetensors")
    tensors = _tensors()
    fp_core.save(tensors, first, format="safetensors", metadata={"epoch": "1"})
    with safe_open(first, "pt") as f:
        meta = f.metadata()
    tensors["norm"] = tensors["norm"] + 1
    fp_core.save(tensors, second, format="safetensors", metadata=meta)
    with safe_open(second, "pt") as f:
        got = f.metadata()
    assert got["epoch"] == "1" and got["fastpersist.crc32c"] != meta["fastpersist.crc32c"]
    report = fp_core.verify(second)
    assert report["checksums"] and "note" not in report
