"""FlatShard state with layout="file": every rank writes its own element ranges of one
torch.save file of the full state. FSDP1's full state (FULL_STATE_DICT and its full
optimizer state) built on every rank from its flat-param shards, with no gather, on 2 real
gloo processes: one launch runs every check (tests/helpers/fsdp1_full_worker.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import HELPERS, rank_results

sys.path.insert(0, HELPERS)

import fp_core  # noqa: E402
from fp_core.format.flat_shard import FlatShard, tiling_problem  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    results = rank_results("fsdp1_full_worker.py", tmp_path_factory.mktemp("fsdp1_full"), "all", world=2)
    assert all(r["ok"] for r in results), [(r.get("error"), r.get("tb")) for r in results]
    return results


# use_orig_params True, False; Adagrad makes its state (a step of 0) up front, on ranks that
# hold none of a parameter too: the step comes from the ranks that hold it, as FSDP's gather
@pytest.mark.parametrize("tag", ["uop1", "uop0", "uop1_Adagrad"])
def test_fsdp1_flat_state_file_equals_its_full_state_dict_gather(ranks, tag):
    for r in ranks:
        # torch.load of the file equals FULL_STATE_DICT + FSDP.optim_state_dict (full) of the
        # same model: keys in the same order, dtypes, shapes, values bit for bit
        assert r[f"{tag}_differ"] is None, r[f"{tag}_differ"]
        assert r[f"{tag}_verified"]
        assert r[f"{tag}_metadata"]  # the modules' versions, as stock's state dict carries them
        assert r[f"{tag}_keys"] == ["counts", "0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias",
                                    "4.weight", "4.bias"]  # the non-persistent buffer is not saved
        # every parameter from the flat shards, the buffer as rank 0's copy (FSDP does not sync
        # buffers: the ranks' differ, and stock writes rank 0's); a module whose == builds an
        # object (torchmetrics) is no FSDP unit
        assert r[f"{tag}_flat"] == 9
    # each rank wrote its own ranges (rank 0 also the 32 KiB buffer) and a share of the
    # replicated bytes: together the file's tensor bytes (full state + the step counters)
    total = sum(r[f"{tag}_data_bytes"] for r in ranks)
    assert ranks[0][f"{tag}_full_bytes"] <= total < ranks[0][f"{tag}_full_bytes"] + 1024
    assert ranks[0][f"{tag}_data_bytes"] > 4096 * 8 and 0.2 * (total - 4096 * 8) < ranks[1][f"{tag}_data_bytes"]


@pytest.mark.parametrize("tag", ["uop1", "uop0", "uop1_Adagrad"])
def test_the_save_carries_no_tensor_between_ranks(ranks, tag):
    for r in ranks:
        calls = r[f"{tag}_collectives"]
        # the builder's exchange of state keys and step values, and the save's own
        # agreement (temp name, layout hash and ranges, piece checksums, outcome): objects only
        assert {name for name, _, _ in calls} <= {"all_gather_object", "broadcast_object_list"}, calls
        assert not any(tensor for _, tensor, _ in calls), calls
        assert sum(size for _, _, size in calls) < 16 << 10, calls  # metadata, not the state's bytes


def test_uneven_and_empty_ranges_make_the_full_file(ranks):
    for r in ranks:
        assert r["flat_differ"] is None, r["flat_differ"]
        assert r["flat_verified"]
    # split mid-row, all on one rank, across a block on neither rank's boundary: each rank
    # wrote its own elements (the 2.4 MB tensor about half each), together every byte once
    assert all(r["flat_data_bytes"] > 1_200_000 for r in ranks)


@pytest.mark.parametrize("kind, why", [
    ("gap", "no rank holds elements [96, 100)"),
    ("overlap", "rank 1's elements [90, 185) overlap rank 0's [0, 96)"),
])
def test_a_tiling_gap_or_overlap_is_refused_on_every_rank(ranks, kind, why):
    for r in ranks:
        err = r["tiling_errors"][kind]
        assert err is not None and err.startswith("UnsupportedPlacementError: "), err
        assert "model.w: the ranks' FlatShards of this tensor of 185 elements do not cover it exactly once" in err
        assert why in err and "nothing was written" in err
        # the previous file under the name is intact, and no temp file is left
        assert r["unchanged"] and r["listing_same"]


def test_flat_shards_of_other_tensors_on_another_rank_are_refused_on_every_rank(ranks):
    for r in ranks:
        err = r["tiling_errors"]["mixed"]
        assert err is not None and err.startswith("CollectiveSaveError: "), err
        assert "rank 1 holds FlatShards of other tensors than rank 0" in err
        assert "every rank must save the same state" in err


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_save_writes_the_ranges_as_of_save(ranks, writer):
    assert all(r[f"async_{writer}_differ"] is None for r in ranks), [r[f"async_{writer}_differ"] for r in ranks]


def test_bad_flat_shards_and_formats_are_refused(ranks):
    for r in ranks:
        assert r["outside"] == "FlatShard: elements [0, 5) are outside the 4 elements of shape (2, 2)"
        assert r["safetensors"].endswith("FlatShard state with layout=\"file\" is written as format='torch'")


def test_where_the_flat_route_does_not_apply_it_says_why(ranks):
    assert ranks[0]["unsupported"] == {
        "supported": None,
        "fp32": None,  # mixed precision in the originals' dtypes (Lightning's "32-true") saves the same
        "bf16": "mixed precision of the parameters (the full state's dtypes are not the shards')",
        "buffers": "mixed precision of the buffers (torch.bfloat16: the full state holds their original dtypes)",
        "offload": "CPU offload of the parameters",
        "no_shard": "sharding strategy NO_SHARD (every rank holds every parameter)",
        "tied": "parameters shared between modules",
        "extra": "module Extra has extra state",
        "own_state": "module OwnState makes its own state dict (state_dict, _save_to_state_dict or hooks)",
        "hooked": "module Linear makes its own state dict (state_dict, _save_to_state_dict or hooks)",
        "foreign": "Adam holds parameters FSDP does not manage",
        "not_fsdp": "the model is not wrapped in FSDP1's FullyShardedDataParallel",
    }


@pytest.mark.parametrize("numel, ranges, why", [
    (10, [(0, 0, 4), (1, 4, 6)], None),
    (10, [(1, 4, 6), (0, 0, 4), (2, 7, 0)], None),  # any order, empty ranges anywhere
    (0, [(0, 0, 0), (1, 0, 0)], None),
    (10, [(0, 0, 4), (1, 5, 5)], "no rank holds elements [4, 5)"),
    (10, [(0, 0, 4), (1, 4, 5)], "no rank holds elements [9, 10)"),
    (10, [(0, 1, 9)], "no rank holds elements [0, 1)"),
    (10, [(0, 0, 6), (1, 4, 6)], "rank 1's elements [4, 10) overlap rank 0's [0, 6)"),
    (10, [(0, 0, 10), (1, 0, 10)], "rank 1's elements [0, 10) overlap rank 0's [0, 10)"),  # replicas
    (10, [], "no rank holds elements [0, 10)"),
])
def test_tiling_problem(numel, ranges, why):
    assert tiling_problem(numel, ranges) == why


def test_flat_shard_checks_its_range():
    t = torch.arange(6.0)
    fs = FlatShard(t[2:5], (2, 3), 2)
    assert (fs.start, fs.stop, fs.shape, fs.dtype, fs.numel()) == (2, 5, torch.Size([2, 3]), torch.float32, 6)
    assert FlatShard(t[:0], (2, 3), 6).stop == 6  # an empty range at the end
    with pytest.raises(ValueError, match=r"elements \[-1, 2\) are outside"):
        FlatShard(t[:3], (2, 3), -1)
    with pytest.raises(ValueError, match="negative size"):
        FlatShard(t[:0], (2, -3), 0)
    with pytest.raises(TypeError, match="takes a tensor"):
        FlatShard([1.0], (1,), 0)


def test_is_sharded_knows_flat_shard_and_dcp_refuses_it(tmp_path):
    from fp_core.sharded import has_flat_shard, is_sharded

    state = {"w": FlatShard(torch.zeros(2), (4,), 0)}
    assert is_sharded(state) and has_flat_shard(state) and not has_flat_shard({"w": torch.zeros(2)})
    for layout in (None, "dcp"):  # only one file of the full state can hold element ranges
        with pytest.raises(ValueError, match='FlatShards.*layout="file"'):
            fp_core.save(state, tmp_path / "x", layout=layout)
    assert os.listdir(tmp_path) == []
