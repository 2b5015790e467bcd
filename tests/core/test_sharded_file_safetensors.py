"""layout="file", format="safetensors": a flat DTensor state (a model's state dict under
FSDP2) written by every rank into one safetensors file of the full tensors, read back by
safetensors, transformers and fp_core.verify; real gloo processes (2 and 3)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import HELPERS, rank_results

import fp_core

sys.path.insert(0, HELPERS)
from sharded_file_st_worker import META, flat_state, tiny_llama  # noqa: E402

WORKER = "sharded_file_st_worker.py"


def ranks(scenario: str, d: str, world: int) -> list[dict]:
    return rank_results(WORKER, d, scenario, world=world)


def assert_file(path: str, expected: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    got = load_file(path)
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert {k: meta[k] for k in metadata} == metadata
    report = fp_core.verify(path)
    assert report["checksums"] and report["records"] == len(expected) and report["bytes"] == os.path.getsize(path)
    loaded = fp_core.load(path, verify=True)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def no_temp_files(d: str) -> bool:
    return not [n for n in os.listdir(d) if n.endswith(".fptmp")]


@pytest.mark.parametrize("world", [2, 3])
def test_flat_dtensor_state_as_one_safetensors_file(disk_dir, world):
    results = ranks("flat", disk_dir, world)
    assert all(r["ok"] for r in results), results
    path = os.path.join(disk_dir, "model.safetensors")
    assert_file(path, flat_state(), META)
    assert sum(r["rank_bytes"] for r in results) == os.path.getsize(path)  # every byte written once
    assert all(r["data_bytes"] > 0 for r in results)  # each rank wrote its own rows
    assert no_temp_files(disk_dir)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_llama_state_dict_loads_with_from_pretrained(disk_dir, world):
    from transformers import LlamaForCausalLM

    results = ranks("hf", disk_dir, world)
    assert all(r["ok"] for r in results), results
    expected = tiny_llama().state_dict()
    path = os.path.join(disk_dir, "model.safetensors")
    assert_file(path, expected, {"format": "pt"})
    model = LlamaForCausalLM.from_pretrained(disk_dir)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_tied_weights_refused_then_saved_without_the_duplicate(disk_dir):
    from transformers import LlamaForCausalLM

    results = ranks("hf_tied", disk_dir, 2)
    assert all(r["ok"] for r in results), results
    for r in results:
        assert "lm_head.weight" in r["tied_error"] and "model.embed_tokens.weight" in r["tied_error"], r
        assert not r["created"]
    expected = tiny_llama(tied=True).state_dict()
    model = LlamaForCausalLM.from_pretrained(disk_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_failing_rank_keeps_previous_file(disk_dir):
    results = ranks("fail", disk_dir, 2)
    for r in results:
        assert not r["ok"] and "rank 1" in r["error"] and "Input/output error" in r["error"], r
    assert_file(os.path.join(disk_dir, "model.safetensors"), flat_state(0), META)
    assert no_temp_files(disk_dir)


def test_states_safetensors_cannot_hold_refused_on_every_rank(disk_dir):
    results = ranks("refuse", disk_dir, 2)
    for r in results:
        assert r["ok"], r
        assert r["nested"].startswith("TypeError") and "flat dict" in r["nested"]
        assert "'c'" in r["dtype"] and "complex128" in r["dtype"]
        assert not r["created"]
    assert no_temp_files(disk_dir)
