"""AsyncCheckpointer.save(state, path, layout="file"): the file holds the state as of save()
while the training goes on changing the local shards in place (snapshot and overlap), the
fence waits until what overlap reads is written, a failed rank fails every rank; real gloo
processes."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import HELPERS, rank_results

import fp_core

sys.path.insert(0, HELPERS)
from sharded_file_async_worker import DELAY_S, full_state  # noqa: E402

WORKER = "sharded_file_async_worker.py"


def ranks(scenario: str, d: str, world: int) -> list[dict]:
    return rank_results(WORKER, d, scenario, world=world)


def after_steps(n: int) -> dict[str, torch.Tensor]:
    """The full state after ``n`` of the worker's in-place steps (each adds 1, rounded in
    the tensor's own dtype)."""
    out = {}
    for k, v in full_state().items():
        for _ in range(n):
            v = v + 1
        out[k] = v
    return out


def assert_holds(path: str, expected: dict[str, torch.Tensor]) -> None:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        got = load_file(path)
    else:
        got = torch.load(path, weights_only=True)
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), (path, k)
    assert fp_core.verify(path)["bytes"] == os.path.getsize(path)


@pytest.mark.parametrize("policy", ["snapshot", "overlap", "process"])
def test_file_holds_the_state_at_save_while_training_changes_it(disk_dir, policy, shm_root):
    """``process``: writer="process", the writer processes run each save among themselves."""
    results = ranks(policy, disk_dir, 2)
    assert all(r["ok"] for r in results), results
    want = ["process"] * 3 if policy == "process" else ["thread"] * 3
    assert all(r["writers"] == want for r in results), results
    for i, name in enumerate(("ck0.pt", "ck1.safetensors", "ck2.pt")):
        assert_holds(os.path.join(disk_dir, name), after_steps(i))
    if policy == "overlap":
        # rank 0's write waits for rank 1, which joins late: its fence waited for it (not
        # the first save's: its save() waits there, creating the coordination group)
        assert all(f >= DELAY_S * 0.8 for f in results[0]["fences"][1:]), results[0]
    assert not [n for n in os.listdir(disk_dir) if n.endswith(".fptmp")]


def test_failed_rank_fails_the_save_on_every_rank(disk_dir):
    results = ranks("fail", disk_dir, 2)
    for r in results:
        assert r["ok"], r
        assert "rank 1" in r["wait_error"] and "Input/output error" in r["wait_error"], r
    assert_holds(os.path.join(disk_dir, "ck.pt"), full_state(0))  # the previous file, intact
    assert_holds(os.path.join(disk_dir, "after.pt"), full_state(2))  # the next save works
    assert not [n for n in os.listdir(disk_dir) if n.endswith(".fptmp")]
