"""layout="file": a DTensor state (FSDP2, HSDP) written by every rank into one torch.save
file of the full state, with real gloo processes (2, 3 and 4)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import HELPERS, rank_results

import fp_core
from fp_core.parallel.partition import split_extents

sys.path.insert(0, HELPERS)
from sharded_file_worker import full_state  # noqa: E402

WORKER = "sharded_file_worker.py"
BLOCK = 4096


def ranks(scenario: str, d: str, world: int) -> list[dict]:
    return rank_results(WORKER, d, scenario, world=world)


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
    assert {r["backend"] for r in results} <= {"io_uring", "threadpool"}, results  # O_DIRECT, as stats say


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


def assert_safetensors_file(path: str, expected: dict) -> None:
    from safetensors.torch import load_file

    got = load_file(path)
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    assert fp_core.verify(path)["checksums"]


@pytest.mark.parametrize("world", [2, 3])
def test_shard_of_later_dimensions_written_partial_refused(disk_dir, world):
    results = ranks("shard1", disk_dir, world)
    assert all(r["ok"] for r in results), results
    expected = full_state()
    m = expected["model"]
    buf = m.pop("buf")  # the worker's order: the DTensors, then the plain tensor, then "rows"
    m.update(narrow=torch.arange(12.0).reshape(6, 2, 1), buf=buf, rows=m["big"][:10].clone())
    assert_full_file(os.path.join(disk_dir, "full.pt"), expected)
    assert sum(r["rank_bytes"] for r in results) == results[0]["file_size"]  # every byte written once
    assert_safetensors_file(os.path.join(disk_dir, "model.safetensors"), expected["model"])
    # Partial (partial sums) is refused on every rank before anything is created, both formats
    for r in results:
        for key, name in (("partial", "model.partial: "), ("partial_st", "partial: ")):
            assert r[key].startswith(f"UnsupportedPlacementError: {name}a DTensor placed Partial"), r
            assert 'layout="dcp"' in r[key], r
    assert not [n for n in os.listdir(disk_dir) if n.startswith("partial")]
    assert no_temp_files(disk_dir)


def test_fsdp_by_tensor_parallel_on_a_2d_mesh(disk_dir):
    results = ranks("tp2d", disk_dir, 4)
    assert all(r["ok"] for r in results), results
    assert "_StridedShard" in results[0]["placements"]["w"] and "Shard(dim=1)" in results[0]["placements"]["big"]
    expected = full_state()
    expected["model"]["cube"] = torch.arange(7 * 5 * 3.0).reshape(7, 5, 3)
    assert_full_file(os.path.join(disk_dir, "full.pt"), expected)
    assert_safetensors_file(os.path.join(disk_dir, "model.safetensors"), expected["model"])
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


@pytest.mark.parametrize("shape", [(6,), (5, 7), (4, 3, 5), (2, 1, 3, 4), (3, 0, 2)])
def test_shard_segments_tile_the_local_shard_in_the_full_bytes(shape):
    from fp_core.format.shard_layout import shard_segments

    g = torch.Generator().manual_seed(len(shape))
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).reshape(shape)
    full_bytes = full.reshape(-1).view(torch.uint8)
    for trial in range(40):
        idx = []
        for d, n in enumerate(shape):
            kind = (trial + d) % 4  # each dimension whole, a range or any subset
            if kind == 0 or n == 0:  # whole
                idx.append(range(n))
            elif kind == 1:  # a box: one range
                a = int(torch.randint(0, n, (1,), generator=g))
                idx.append(range(a, int(torch.randint(a, n + 1, (1,), generator=g))))
            else:  # strided: any increasing subset
                idx.append(sorted(torch.randperm(n, generator=g)[:int(torch.randint(0, n + 1, (1,), generator=g))]
                                  .tolist()))
        local = full
        for d, i in enumerate(idx):
            local = local.index_select(d, torch.tensor(list(i), dtype=torch.long))
        local_bytes = local.contiguous().reshape(-1).view(torch.uint8)
        segs = shard_segments(shape, idx, full.element_size())
        assert sum(n for _, _, n in segs) == local_bytes.numel()
        at = 0
        for gl, lo, n in segs:  # in local order, each a run of the full tensor's bytes
            assert lo == at and n > 0
            assert torch.equal(full_bytes[gl:gl + n], local_bytes[lo:lo + n])
            at += n
        starts = sorted(gl for gl, _, _ in segs)
        assert all(a < b for a, b in zip(starts, starts[1:]))  # no byte of the full tensor twice
