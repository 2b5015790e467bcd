"""fp_core.save(..., format="safetensors"): a round trip read by safetensors itself, metadata, and
the objects the format cannot hold."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_no_temps, tensor_bytes

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
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == meta
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
