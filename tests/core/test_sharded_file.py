"""layout="file": a DTensor state (FSDP2, HSDP) written by every rank into one torch.save
file of the full state, with real gloo processes (2, 3 and 4)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import HELPERS, run_ranks

import fp_core
from fp_core.partition import split_extents

sys.path.insert(0, HELPERS)
from sharded_file_worker import full_state  # noqa: E402

WORKER = "sharded_file_worker.py"
BLOCK = 4096


def ranks(scenario: str, d: str, world: int) -> list[dict]:
    run_ranks(WORKER, d, scenario, world=world, timeout=240)
    out = []
    for r in range(world):
        with open(os.path.join(d, f"result{r}.json")) as f:
            out.append(json.load(f))
    return out


def assert_same(expected, got, where: str = "") -> None:
    """Equal structure, and every tensor a plain torch.Tensor equal to the expected one."""
    if isinstance(expected, dict):
        assert list(got.keys()) == list(expected.keys()), where
        for k in expected:
            assert_same(expected[k], got[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert type(got) is torch.Tensor, where
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got, expected), where
    else:
        assert got == expected, where


def assert_full_file(path: str, expected: dict) -> None:
    assert_same(expected, torch.load(path, weights_only=True))
    assert fp_core.verify(path)["bytes"] == os.path.getsize(path)
    assert_same(expected, fp_core.load(path, verify=True))


def no_temp_files(d: str) -> bool:
    return not [n for n in os.listdir(d) if n.endswith(".fptmp")]


def test_split_extents_near_equal_and_aligned():
    extents = [(0, 10_000), (12_288, 100), (16_384, 50_000), (69_632, 3)]
    total = sum(n for _, n in extents)
    for parts in (1, 2, 3, 5):
        shares = split_extents(extents, parts, BLOCK)
        flat = [e for share in shares for e in share]
        assert sum(n for _, n in flat) == total  # every byte in exactly one share, in order
        assert all(a + n <= b for (a, n), (b, _) in zip(flat, flat[1:]))
        for share in shares:
            assert abs(sum(n for _, n in share) - total / parts) <= 2 * BLOCK
        cuts = [share[0][0] for share in shares[1:] if share]
        assert all(c % BLOCK == 0 or c in {o for o, _ in extents} for c in cuts)
    assert split_extents([], 3, BLOCK) == [[], [], []]


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_state_saved_as_one_full_file(disk_dir, world):
    results = ranks("fsdp", disk_dir, world)
    assert all(r["ok"] for r in results), results
    assert_full_file(os.path.join(disk_dir, "full.pt"), full_state())
    # Each rank wrote its own shards and its share of the replicated bytes, no more.
    replicated = results[0]["replicated_bytes"]
    shares = [r["data_bytes"] - r["local_shard_bytes"] for r in results]
    assert all(s >= 0 for s in shares) and sum(shares) == replicated
    assert all(abs(s - replicated / world) <= 2 * BLOCK for s in shares)
    storage_bytes = sum(r["local_shard_bytes"] for r in results) + replicated
    assert sum(r["data_bytes"] for r in results) == storage_bytes
    assert sum(r["rank_bytes"] for r in results) == results[0]["file_size"]  # every byte written once
    assert results[0]["default_is_dir"]  # no layout: a DCP directory, as before
    assert no_temp_files(disk_dir)


def test_hsdp_state_four_ranks(disk_dir):
    results = ranks("hsdp", disk_dir, 4)
    assert all(r["ok"] for r in results), results
    assert_full_file(os.path.join(disk_dir, "full.pt"), full_state())
    # (Replicate, Shard(0)) on a 2 x 2 mesh: each shard is split between its two holders.
    replicated = results[0]["replicated_bytes"]
    for r in results:
        expected = r["local_shard_bytes"] / 2 + replicated / 4
        assert abs(r["data_bytes"] - expected) <= 4 * BLOCK, r
    assert sum(r["data_bytes"] for r in results) == sum(r["local_shard_bytes"] for r in results) / 2 + replicated
    assert sum(r["rank_bytes"] for r in results) == results[0]["file_size"]


def test_other_placements_refused_on_every_rank_before_any_file(disk_dir):
    results = ranks("shard1", disk_dir, 2)
    for r in results:
        assert not r["ok"]
        assert "UnsupportedPlacementError" in r["error"] and "model.col" in r["error"]
        assert "Shard(dim=1)" in r["error"] and 'layout="dcp"' in r["error"]
        assert "x.partial" in r["partial"] and "Partial" in r["partial"] and 'layout="dcp"' in r["partial"]
        assert "x.strided" in r["strided"] and "_StridedShard" in r["strided"]
    assert not os.path.exists(os.path.join(disk_dir, "full.pt"))
    assert no_temp_files(disk_dir)


def test_failing_rank_fails_every_rank_and_keeps_previous_file(disk_dir):
    results = ranks("fail", disk_dir, 2)
    for r in results:
        assert not r["ok"] and "rank 1" in r["error"] and "Input/output error" in r["error"], r
    assert_full_file(os.path.join(disk_dir, "full.pt"), full_state(0))
    assert no_temp_files(disk_dir)


def test_replicas_that_differ_and_states_that_differ(disk_dir):
    results = ranks("mismatch", disk_dir, 2)
    assert all(r["ok"] for r in results), results
    # a plain tensor that differs between its holders is written whole from the first one
    expected = full_state()
    assert results[0]["differing"] == 1
    assert_full_file(os.path.join(disk_dir, "full.pt"), expected)
    # a state whose pickle differs between ranks is refused on every rank, nothing written
    for r in results:
        assert "rank 1 lays the file out unlike rank 0" in r["mismatch_error"]
    assert not os.path.exists(os.path.join(disk_dir, "other.pt"))
    assert no_temp_files(disk_dir)
