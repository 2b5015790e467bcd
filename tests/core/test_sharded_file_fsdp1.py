"""layout="file" with FSDP1's ShardedTensor state: every rank writes its own rows of one
torch.save file of the full state, with real gloo processes (2 and 3)."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import HELPERS, rank_results

sys.path.insert(0, HELPERS)
from sharded_file_fsdp1_worker import full_state  # noqa: E402
from test_sharded_file import assert_full_file, no_temp_files  # noqa: E402

WORKER = "sharded_file_fsdp1_worker.py"
BLOCK = 4096


def ranks(scenario: str, d: str, world: int) -> list[dict]:
    return rank_results(WORKER, d, scenario, world=world)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", ["chunks", "reordered"])
def test_chunk_sharded_tensors_saved_as_one_full_file(disk_dir, world, scenario):
    results = ranks(scenario, disk_dir, world)
    assert all(r["ok"] for r in results), results
    assert_full_file(os.path.join(disk_dir, "full.pt"), full_state())
    # Each rank wrote its own rows and a share of the plain tensors, no gather: together
    # exactly the storages' bytes, every rank at least its own rows.
    assert all(r["data_bytes"] >= r["local_shard_bytes"] for r in results)
    full = full_state()
    storage_bytes = sum(t.numel() * t.element_size() for t in full["model"].values())
    storage_bytes += sum(t.numel() * t.element_size() for t in full["optim"]["state"]["w"].values())
    assert sum(r["data_bytes"] for r in results) == storage_bytes
    assert no_temp_files(disk_dir)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp1_sharded_state_file_equals_its_full_state_dict(disk_dir, world):
    results = ranks("fsdp1", disk_dir, world)
    assert all(r["ok"] for r in results), results
    r0 = results[0]
    assert r0["types"] == ["ShardedTensor"]  # FSDP1's own sharded state, not a full one
    assert r0["differ_torch_load"] is None and r0["differ_fp_load"] is None, r0
    assert r0["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
    assert r0["optim_keys"] == sorted(r0["keys"])
    assert no_temp_files(disk_dir)


@pytest.mark.parametrize("world", [2, 3])
def test_other_specs_refused_on_every_rank_creating_nothing(disk_dir, world):
    results = ranks("refused", disk_dir, world)
    assert all(r["ok"] for r in results), results
    for r in results:
        errors = r["errors"]
        assert "is sharded by ChunkShardingSpec(dim=1" in errors["dim1"], errors
        assert "is sharded by EnumerableShardingSpec" in errors["enumerable"], errors
        for name in ("columns", "two_on_rank0"):
            assert errors[name].startswith("CheckpointSerializationError: ") and "model.bad: the local shards" in \
                errors[name] and "are not the metadata's one shard" in errors[name], errors
        if world == 3 and r["rank"] < 2:
            assert "a shard on rank 2, outside the save's group (ranks [0, 1])" in errors["pair"], errors
        for name, tensor in (("dim1", "model.bad"), ("enumerable", "model.bad"), ("pair", "model.w")):
            if name in errors:
                assert errors[name].startswith(f"UnsupportedPlacementError: {tensor}: a ShardedTensor of shape ")
                assert 'layout="dcp"' in errors[name]
        assert "written as format='torch'" in r["safetensors"]
    assert sorted(os.listdir(disk_dir)) == sorted([f"result{r}.json" for r in range(world)] + ["result.json"])


@pytest.mark.parametrize("policy", ["snapshot", "overlap"])
def test_async_save_writes_the_state_as_of_save(disk_dir, policy):
    results = ranks(policy, disk_dir, 2)
    assert all(r["ok"] for r in results), results
    assert_full_file(os.path.join(disk_dir, "full.pt"), full_state())
    assert no_temp_files(disk_dir)


def test_failing_rank_fails_every_rank_and_keeps_previous_file(disk_dir):
    results = ranks("fail", disk_dir, 2)
    for r in results:
        assert not r["ok"] and "rank 1" in r["error"] and "Input/output error" in r["error"], r
    assert_full_file(os.path.join(disk_dir, "full.pt"), full_state(0))
    assert no_temp_files(disk_dir)
