"""load_into of one file of the full state on N-D meshes and tensor-parallel placements
(issue 39): a file saved by 2 ranks with layout="file" loaded on 4 ranks (HSDP on 2 x 2,
FSDP x tensor parallel, replicated tensor parallel) and on 3 (FSDP and Shard(1): uneven
rows and columns), verified; each rank reads only its own block, in place."""

from __future__ import annotations

import os
import sys

import torch
from conftest import HELPERS
from test_sharded_load import assert_loaded, ranks, write_files

sys.path.insert(0, HELPERS)
from sharded_file_worker import full_state  # noqa: E402


def test_saved_on_two_ranks_loaded_on_four_and_three(disk_dir):
    ranks("roundtrip", disk_dir, 2)  # writes full.pt with layout="file" on 2 ranks
    torch.save(full_state(), os.path.join(disk_dir, "plain.pt"))
    results = ranks("layouts", disk_dir, 4, "full.pt", "plain.pt")
    for name in ("hsdp", "fsdp_tp", "replicated_tp"):
        assert_loaded(results, f"{name}/full.pt")
        assert_loaded(results, f"{name}/plain.pt")
    hsdp = [r["loads"]["hsdp/full.pt"]["shard_bytes"] for r in results]
    assert hsdp[0] == hsdp[2] and hsdp[1] == hsdp[3] and hsdp[0] != hsdp[1]  # replicas read the same rows
    tp = [r["loads"]["fsdp_tp/full.pt"]["shard_bytes"] for r in results]
    assert len(set(tp)) > 1 and sum(tp) == sum(hsdp[:2])  # four blocks make each tensor once
    results = ranks("layouts", disk_dir, 3, "full.pt", "plain.pt")
    for name in ("fsdp", "tp"):
        assert_loaded(results, f"{name}/full.pt")
        assert_loaded(results, f"{name}/plain.pt")
    assert len({r["loads"]["tp/full.pt"]["shard_bytes"] for r in results}) > 1  # uneven columns


def test_one_file_of_one_process_on_three_ranks_tensor_parallel(disk_dir):
    write_files(disk_dir)
    results = ranks("layouts", disk_dir, 3, "fp.pt")
    assert_loaded(results, "tp/fp.pt")


def test_strided_shard_targets_read_their_interleaved_rows(disk_dir):
    """_StridedShard (FSDP2 over tensor parallel: each rank's rows interleaved with the
    others'): each rank reads the runs of its rows straight into its shard, verified from
    the ranks' pieces, on 2 and on 3 ranks (uneven)."""
    write_files(disk_dir)
    for world in (2, 3):
        results = ranks("strided_shard", disk_dir, world, "fp.pt", "plain.pt")
        for f in ("fp.pt", "plain.pt"):
            for r in results:
                got = r["loads"][f]
                assert got["differ"] == [] and got["in_place"], (world, r["rank"], f, got)
                assert got["tensor_bytes"] == got["shard_bytes"] + got["replicated_bytes"], (world, r["rank"], f)
                assert got["check_bytes"] == 0, (world, r["rank"], f, got)


_UNEVEN_STRIDED = r"""
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
import fp_core
rows, cols, dp, tp = 20, 2, 3, 3
torch.save({"w": torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)}, sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=7, world_size=dp * tp)  # mesh coordinate (2, 1)
mesh = init_device_mesh("cpu", (dp, tp))
buf = torch.full((3, cols), -1.0)
local = buf[0:1]  # FSDP2 x TP gives this rank 1 row of 20 over 3 x 3; DTensor's own split says 2
dt = DTensor.from_local(local, mesh, (_StridedShard(0, split_factor=tp), Shard(0)), run_check=False,
                        shape=(rows, cols), stride=(cols, 1))
try:
    fp_core.load_into({"w": dt}, sys.argv[1])
    error = ""
except ValueError as e:
    error = str(e)
print(json.dumps({"error": error, "buf": buf.tolist()}))
"""


def test_uneven_strided_shard_whose_rows_cannot_be_placed_is_refused_untouched(tmp_path):
    """An FSDP2 x TP local shard whose row count differs from DTensor's own split (uneven
    rows): refused before any read, and no byte is written past the shard."""
    import json
    import subprocess
    import sys as _sys

    p = subprocess.run([_sys.executable, "-c", _UNEVEN_STRIDED, str(tmp_path / "full.pt")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert "cannot be placed" in res["error"] and "(1, 2)" in res["error"], res
    assert res["buf"] == [[-1.0, -1.0]] * 3  # neither the shard nor the memory past it was written
