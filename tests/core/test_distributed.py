"""Collective saves with real gloo process groups (2 and 4 processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch
from conftest import HELPERS, REPO, free_port

import fp_core
from fp_core.parallel.partition import select_writers, split_range

WORKER = os.path.join(HELPERS, "dist_worker.py")
sys.path.insert(0, HELPERS)
from dist_worker import state  # noqa: E402


@pytest.fixture
def ddir():
    """A directory on the real disk (O_DIRECT works there; /tmp may be tmpfs)."""
    base = os.path.join(REPO, ".test-tmp")
    d = os.path.join(base, f"dist-{uuid.uuid4().hex[:8]}")
    os.makedirs(d)
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


def run_ranks(scenario: str, world: int, d: str, timeout: float = 120) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, scenario, str(r), str(world), port, d])
             for r in range(world)]
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1, deadline - time.monotonic()))
    out = []
    for r in range(world):
        f = os.path.join(d, f"result{r}.json")
        out.append(json.load(open(f)) if os.path.exists(f) else {"rank": r, "ok": None, "exit": procs[r].returncode})
    return out


def assert_equal_state(a, b):
    for k in ("w", "b", "emb"):
        assert torch.equal(a["model"][k], b["model"][k])
    assert torch.equal(a["optim"]["exp_avg"], b["optim"]["exp_avg"])
    assert a["meta"] == b["meta"] and a["optim"]["step"] == b["optim"]["step"]


def test_split_range_near_equal_and_aligned():
    for n, w in [(10 * 4096 + 17, 3), (4096, 4), (1 << 20, 4), (5 * 4096, 5)]:
        ranges = split_range(0, n, w, 4096)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        for (lo, hi), (lo2, _) in zip(ranges, ranges[1:]):
            assert hi == lo2 and lo % 4096 == 0
        assert all(abs((hi - lo) - n / w) <= 4096 for lo, hi in ranges)


def test_select_writers_topologies():
    hosts = ["a", "a", "b", "b"]
    assert select_writers("replica", 4, hosts) == [0, 1, 2, 3]
    assert select_writers("node", 4, hosts) == [0, 2]
    assert select_writers(2, 4, hosts) == [0, 1, 2, 3]
    assert select_writers(1, 4, hosts) == [0, 2]
    assert select_writers([3, 1], 4, hosts) == [1, 3]
    with pytest.raises(ValueError):
        select_writers([5], 4, hosts)
    with pytest.raises(ValueError):
        select_writers("socket", 4, hosts)


@pytest.mark.parametrize("world", [2, 4])
def test_replica_save_splits_bytes_and_matches_single_writer(ddir, world):
    results = run_ranks("replica", world, ddir)
    assert all(r["ok"] for r in results), results
    path = os.path.join(ddir, "ckpt.pt")
    size = os.path.getsize(path)
    assert all(r["writers"] == world for r in results)
    # the ranks on this host share one writer's queue (EngineOptions.share_queue): known from
    # the first save's host names on (rank 0 opens its engine before them, at full depth)
    assert [r["depths"] for r in results] == [[16, 16 // world]] + [[16 // world] * 2] * (world - 1), results
    # each rank wrote within one block of N/W of the body (rank 0 also wrote the tail)
    tail = size - results[0]["tail_start"]
    for r in results:
        body = r["rank_bytes"] - (tail if r["rank"] == 0 else 0)
        assert abs(body - results[0]["tail_start"] / world) <= 4096, (r, size)
    loaded = torch.load(path, weights_only=True)
    assert_equal_state(loaded, state())
    fp_core.verify(path)
    single = os.path.join(ddir, "single.pt")
    fp_core.save(state(), single)
    assert open(path, "rb").read() == open(single, "rb").read()


def test_node_topology_one_writer_per_host(ddir):
    results = run_ranks('topology:"node"', 2, ddir)  # both ranks on this host
    assert all(r["ok"] for r in results), results
    assert results[0]["ranks"] == [0]
    assert_equal_state(torch.load(os.path.join(ddir, "ckpt.pt"), weights_only=True), state())


def test_explicit_rank_list(ddir):
    results = run_ranks("topology:[1]", 2, ddir)
    assert all(r["ok"] for r in results), results
    assert results[0]["ranks"] == [1]
    fp_core.verify(os.path.join(ddir, "ckpt.pt"))


@pytest.mark.parametrize("scenario", ["mismatch", "layout_mismatch"])
def test_mismatch_falls_back_to_rank0(ddir, scenario):
    results = run_ranks(scenario, 2, ddir)
    assert all(r["ok"] for r in results), results
    assert results[0]["ranks"] == [0] and results[1]["ranks"] == [0]
    assert_equal_state(torch.load(os.path.join(ddir, "ckpt.pt"), weights_only=True), state(seed=0))


def test_sharded_per_rank_files(ddir):
    results = run_ranks("sharded", 2, ddir)
    assert all(r["ok"] for r in results), results
    for r in range(2):
        assert torch.equal(torch.load(os.path.join(ddir, f"shard{r}.pt"))["shard"], torch.full((1000,), float(r)))


def test_sharded_save_over_existing_files_frees_the_previous_ones_in_the_background(ddir):
    results = run_ranks("sharded_replace", 2, ddir)
    assert all(r["ok"] for r in results), results
    for r in results:
        assert r["pinned"] == 1 and r["pending"] >= 16 << 20, r  # the previous shard, aside and unlinked
        assert r["pending_after"] == 0 and r["live_after"] == 0, r
    for r in range(2):
        assert torch.equal(torch.load(os.path.join(ddir, f"shard{r}.pt"))["shard"], torch.full((4 << 20,), 2.0))
    assert _no_temp_files(ddir) == []


def _no_temp_files(d):
    return [n for n in os.listdir(d) if n.endswith(".fptmp")]


def test_sharded_failure_commits_nothing(ddir):
    results = run_ranks("sharded_fail", 2, ddir)
    assert not any(r["ok"] for r in results), results
    assert not os.path.exists(os.path.join(ddir, "shard0.pt"))
    assert not os.path.exists(os.path.join(ddir, "shard1.pt"))
    assert _no_temp_files(ddir) == []


@pytest.mark.parametrize("where", ["rename", "dirsync"])
def test_sharded_publish_failure_on_one_rank_keeps_every_previous_file(ddir, where):
    """save_sharded is all or nothing at publish too: a rank whose rename (or the directory
    fsync after it) fails makes every rank keep its previous file."""
    results = run_ranks(f"sharded_publish_fail:{where}", 2, ddir)
    err = results[1]["error"] if results[1]["ok"] is False else ""
    assert "injected" in err or ("[Errno 5]" in err and "shard1.pt" in err), results
    assert results[0]["ok"] is False and "rank 1" in results[0]["error"], results
    for r in range(2):
        got = torch.load(os.path.join(ddir, f"shard{r}.pt"))
        assert got["gen"] == 1 and torch.equal(got["shard"], torch.full((1000,), float(r)))
        fp_core.verify(os.path.join(ddir, f"shard{r}.pt"))
    assert _no_temp_files(ddir) == []


def test_failing_rank_makes_every_rank_raise(ddir):
    results = run_ranks("fail", 2, ddir)
    assert results[0]["ok"] is False and "rank 1" in results[0]["error"]
    assert results[1]["ok"] is False
    assert not os.path.exists(os.path.join(ddir, "ckpt.pt"))
    assert _no_temp_files(ddir) == []


def test_killed_rank_does_not_hang_or_commit(ddir):
    t0 = time.monotonic()
    results = run_ranks("kill", 2, ddir, timeout=90)
    assert time.monotonic() - t0 < 90
    assert results[1].get("ok") is None  # killed, no report
    assert results[0]["ok"] is False, results[0]
    assert not os.path.exists(os.path.join(ddir, "ckpt.pt"))
    assert _no_temp_files(ddir) == []


def test_async_collective_saves_are_consistent(ddir):
    results = run_ranks("async", 2, ddir)
    assert all(r["ok"] for r in results), results
    assert sorted(n for n in os.listdir(ddir) if n.endswith(".pt")) == ["step0.pt", "step1.pt", "step2.pt"]


def test_small_per_rank_differences_still_write_in_parallel(ddir):
    """Under DDP, BatchNorm statistics and logged values differ per rank; the file is rank 0's."""
    results = run_ranks("small_differs", 2, ddir)
    assert all(r["ok"] for r in results), results
    assert results[0]["writers"] == 2 and results[0]["differing"] == 1, results
    got = torch.load(os.path.join(ddir, "ckpt.pt"), weights_only=True)
    assert torch.equal(got["model"]["bn.running_mean"], torch.zeros(64))  # rank 0's values
    assert got["meta"]["loss"] == 0.5
    assert_equal_state(got, {**state(), "meta": {"epoch": 3, "name": "run", "loss": 0.5}})
    fp_core.verify(os.path.join(ddir, "ckpt.pt"))
