"""load_into a DTensor state (FSDP2, HSDP) from one file of the full state on any number of
ranks, with real gloo processes (1 to 4): each rank reads only its own rows."""

from __future__ import annotations

import os
import shutil
import sys

import torch
from conftest import HELPERS, rank_results

import fp_core

sys.path.insert(0, HELPERS)
from sharded_file_worker import full_state  # noqa: E402
from sharded_load_worker import strided_full, trained  # noqa: E402

WORKER = "sharded_load_worker.py"


def ranks(scenario: str, d: str, world: int, *files: str) -> list[dict]:
    out = rank_results(WORKER, d, scenario, *files, world=world)
    assert all(r["ok"] for r in out), out
    return out


def assert_loaded(results: list[dict], name: str, whole_file: bool = False) -> None:
    """Every rank's shards equal the full tensors' rows, read in place; the file's other
    values; and the rank read its own rows and the replicated tensors, nothing more."""
    for r in results:
        got = r["loads"][name]
        assert got["differ"] == [], (r["rank"], name, got)
        assert got["in_place"] and got["same_objects"], (r["rank"], name)
        assert got["epoch"] == 3 and got["target_epoch"] == 3 and got["lr"] == 0.1, (r["rank"], name, got)
        assert got["whole_file"] is whole_file
        assert got["tensor_bytes"] == got["shard_bytes"] + got["replicated_bytes"], (r["rank"], name, got)
        assert got["check_bytes"] == 0, (r["rank"], name, got)
    # the shards' bytes add up to each sharded tensor once per replica group, no rank more
    assert len({r["loads"][name]["replicated_bytes"] for r in results}) == 1


def write_files(d: str) -> None:
    fp_core.save(full_state(), os.path.join(d, "fp.pt"))
    torch.save(full_state(), os.path.join(d, "plain.pt"))


def test_same_ranks_then_more_ranks(disk_dir):
    """Saved by 2 ranks with layout="file", loaded back on the same 2 (verified), then on 3
    (uneven shards, an empty one) from that file and from a plain torch.save file."""
    results = ranks("roundtrip", disk_dir, 2)
    assert_loaded(results, "full.pt")
    assert sum(r["loads"]["full.pt"]["shard_bytes"] for r in results) == \
        sum(t.numel() * t.element_size() for k, t in full_state()["model"].items()
            if k not in ("scale", "temp", "buf")) + full_state()["optim"]["state"]["w"]["exp_avg"].nbytes
    torch.save(full_state(), os.path.join(disk_dir, "plain.pt"))
    fp_core.save({"w": strided_full()}, os.path.join(disk_dir, "strided.pt"))
    results = ranks("fsdp", disk_dir, 3, "full.pt", "plain.pt", "strided.pt")
    assert_loaded(results, "full.pt")
    assert_loaded(results, "plain.pt")
    # a saved view whose rows are no byte ranges: copied out, its storage checked whole
    assert all(r["strided"] == {"equal": True, "check_bytes": 37 * 64 * 4} for r in results), results
    assert len({r["loads"]["full.pt"]["shard_bytes"] for r in results}) > 1  # uneven


def test_one_rank_mesh(disk_dir):
    """Fewer ranks: a 1-rank mesh reads every row."""
    write_files(disk_dir)
    results = ranks("fsdp", disk_dir, 1, "fp.pt", "plain.pt")
    assert_loaded(results, "fp.pt")
    assert_loaded(results, "plain.pt")


def test_hsdp_four_ranks(disk_dir):
    """HSDP on 2 x 2 (Replicate x Shard(0)): replicas read the same rows, each half."""
    write_files(disk_dir)
    results = ranks("hsdp", disk_dir, 4, "fp.pt", "plain.pt")
    assert_loaded(results, "fp.pt")
    assert_loaded(results, "plain.pt")
    by_rank = [r["loads"]["fp.pt"]["shard_bytes"] for r in results]
    assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3] and by_rank[0] != by_rank[1]


def test_refused_before_reading_and_damage_found_by_every_rank(disk_dir):
    write_files(disk_dir)
    os.replace(os.path.join(disk_dir, "fp.pt"), os.path.join(disk_dir, "full.pt"))
    bad = os.path.join(disk_dir, "bad.pt")
    shutil.copy(os.path.join(disk_dir, "full.pt"), bad)
    big = next(r for r in fp_core.inspect(bad) if r.get("tensor") == "model.big")
    with open(bad, "r+b") as f:  # a byte in row 700 of 1024: only rank 1 reads it
        f.seek(big["offset"] + 700 * 1024 * 4 + 9)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    results = ranks("refuse", disk_dir, 2, "bad.pt")
    for r in results:
        assert r["shape"].startswith("ValueError") and "model.w" in r["shape"] and "(38, 64)" in r["shape"], r
        assert r["shape_bytes_read"] == 0
        refusal = r["partial"]
        assert refusal.startswith("ValueError") and "model.w" in refusal and "Partial" in refusal, r
        assert r["partial_bytes_read"] == 0
        assert r["unverified"] == ""
    # the damaged byte is in rank 1's rows; rank 0 learns it from the combined checksum
    assert "CorruptCheckpointError" in results[0]["damaged"] and "model.big" in results[0]["damaged"], results
    assert "CorruptCheckpointError" in results[1]["damaged"] and "model.big" in results[1]["damaged"], results


def test_fsdp2_module_and_fresh_optimizer(disk_dir):
    """An FSDP2 model and a fresh Adam on 3 ranks resume from a full state saved by one
    process: parameters filled in their shards, Adam's state created sharded like them."""
    model, opt = trained()
    fp_core.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(disk_dir, "module.pt"))
    results = ranks("module", disk_dir, 3, "module.pt")
    for r in results:
        got = r["module"]
        assert got["differ"] == [] and got["lr"] == 0.01, got
        # parameters and the two Adam moments: each rank its own rows; the steps whole
        assert got["tensor_bytes"] == 3 * got["param_bytes"] + 4 * 4, got
        assert got["check_bytes"] == 0, got
