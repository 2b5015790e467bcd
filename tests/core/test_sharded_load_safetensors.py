"""load_into from a safetensors file (issue 39): FastPersist's (CRC-32C of each tensor in
its header) and one written by safetensors.torch.save_file (none), into plain targets on
one process and into DTensor targets on 3 ranks (Shard(0), Shard(1)): each rank reads only
its own rows or block, straight into its local shard; verify=True checks our CRCs (put
together from the ranks' pieces), verify="auto" loads a file without them unchecked and
verify=True refuses it."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import HELPERS, flip_byte, rank_results, run_ranks
from safetensors.torch import save_file

import fp_core
from fp_core.errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from fp_core.loading.sharded_load import LoadIntoStats

sys.path.insert(0, HELPERS)
from sharded_load_hostile import fence_intact, fenced  # noqa: E402
from sharded_load_worker import flat_model  # noqa: E402


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(37, 64, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "step": torch.tensor(3.0), "empty": torch.zeros(0, 4), "ids": torch.arange(7, dtype=torch.int8)}


def _write(d, writer: str, state: dict) -> str:
    path = os.path.join(d, f"{writer}.safetensors")
    if writer == "ours":
        fp_core.save(state, path, format="safetensors")
    else:
        save_file(state, path)
    return path


@pytest.mark.parametrize("writer", ["ours", "save_file"])
def test_plain_targets_filled_in_place(tmp_path, writer):
    state = _state()
    path = _write(str(tmp_path), writer, state)
    for verify in ([False, "auto", True] if writer == "ours" else [False, "auto"]):
        fences = {k: fenced(tuple(v.shape), v.dtype) for k, v in state.items()}
        target = {k: t for k, (t, _) in fences.items()}
        ptrs = {k: t.data_ptr() for k, t in target.items()}
        stats = LoadIntoStats()
        fp_core.load_into(target, path, verify=verify, stats=stats)
        assert all(torch.equal(target[k], state[k]) and target[k].data_ptr() == ptrs[k] for k in state)
        assert all(fence_intact(big, max(state[k].shape[:1] or (1,))) for k, (_, big) in fences.items())
        assert stats.tensor_bytes == sum(v.nbytes for v in state.values()) and stats.check_bytes == 0
    if writer == "save_file":
        with pytest.raises(NotAFastPersistCheckpoint, match="verify='auto'"):
            fp_core.load_into({k: torch.zeros_like(v) for k, v in state.items()}, path, verify=True)


def test_damage_and_mismatch(tmp_path):
    state = _state()
    path = _write(str(tmp_path), "ours", state)
    w = next(r for r in fp_core.inspect(path) if r["name"] == "w")
    flip_byte(path, w["offset"] + 100)
    for verify in (True, "auto"):
        with pytest.raises(CorruptCheckpointError) as e:
            fp_core.load_into({k: torch.zeros_like(v) for k, v in state.items()}, path, verify=verify)
        assert path in str(e.value) and "w" == e.value.tensor
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["w"] = torch.zeros(37, 65)
    with pytest.raises(ValueError, match=r"w is \(37, 64\) torch.float32 in the file, \(37, 65\)"):
        fp_core.load_into(target, path)
    # a header whose shape lies about its bytes: refused before any read
    raw = open(path, "rb").read()
    lie = raw.replace(b'"shape":[37,64]', b'"shape":[38,64]', 1)
    assert lie != raw
    bad = os.path.join(str(tmp_path), "lie.safetensors")
    open(bad, "wb").write(lie)
    t, big = fenced((38, 64), torch.float32)
    target = dict({k: torch.zeros_like(v) for k, v in state.items()}, w=t)
    with pytest.raises(CorruptCheckpointError, match="lie.safetensors"):
        fp_core.load_into(target, bad)
    assert fence_intact(big, 38)


def test_dtensor_targets_on_three_ranks(disk_dir):
    full = flat_model()
    fp_core.save(full, os.path.join(disk_dir, "ours.safetensors"), format="safetensors")
    save_file(full, os.path.join(disk_dir, "plain.safetensors"))
    bad = os.path.join(disk_dir, "bad.safetensors")
    fp_core.save(full, bad, format="safetensors")
    big = next(r for r in fp_core.inspect(bad) if r["name"] == "big")
    flip_byte(bad, big["offset"] + 700 * 1024 * 4 + 1000 * 4)  # row 700, column 1000: one rank's bytes
    results = rank_results("sharded_load_worker.py", disk_dir, "safetensors", "ours.safetensors",
                           "plain.safetensors", "bad.safetensors", world=3, timeout=300)
    assert all(r["ok"] for r in results), results
    for r in results:
        for name in ("fsdp", "tp"):
            for f in ("ours.safetensors", "plain.safetensors"):
                got = r["loads"][f"{name}/{f}"]
                assert got["differ"] == [] and got["in_place"], (r["rank"], name, f, got)
                # each rank read its own rows or block, and checked ours from the ranks' pieces
                assert got["tensor_bytes"] == got["local_bytes"] and got["check_bytes"] == 0, (r["rank"], name, f)
            assert r["loads"][f"{name}/ours.safetensors"]["refused"] == ""
            assert r["loads"][f"{name}/plain.safetensors"]["refused"].startswith("NotAFastPersistCheckpoint")
            damaged = r["loads"][f"{name}/bad.safetensors"]["outcome"]
            assert damaged.startswith("CorruptCheckpointError") and "big" in damaged, (r["rank"], name, damaged)
    assert len({r["loads"]["tp/ours.safetensors"]["tensor_bytes"] for r in results}) > 1  # uneven blocks


def test_written_by_two_ranks_loaded_on_three(disk_dir):
    """A model.safetensors written with layout="file" from tensor-parallel shards on 2
    ranks (FastPersist's CRCs in its header), loaded on 3 ranks as FSDP and as tensor
    parallel, verified: each rank its own rows or block, checked from the ranks' pieces."""
    run_ranks("sharded_load_worker.py", disk_dir, "save_safetensors", "ours_ranks.safetensors", world=2,
              timeout=240)
    full = flat_model()
    loaded = fp_core.load(os.path.join(disk_dir, "ours_ranks.safetensors"), verify=True)
    assert all(torch.equal(loaded[k], v) for k, v in full.items())
    for r, res in enumerate(rank_results("sharded_load_worker.py", disk_dir, "safetensors",
                                         "ours_ranks.safetensors", world=3, timeout=300)):
        assert res["ok"], res
        for name in ("fsdp", "tp"):
            got = res["loads"][f"{name}/ours_ranks.safetensors"]
            assert got["differ"] == [] and got["in_place"] and got["refused"] == "", (r, name, got)
            assert got["tensor_bytes"] == got["local_bytes"] and got["check_bytes"] == 0, (r, name, got)
