"""Lightning's ModelParallelStrategy (FSDP2, 2 CPU processes over gloo) with FastPersistIO and
FastPersistCallback: its sharded checkpoints go through FastPersistWriter/Reader, in the
background, with ModelCheckpoint top-k, save_last and ckpt_path="last"; side by side with
stock Lightning running the same script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HELPERS, free_port, run_ranks

import fp_core
from fp_core.parallel.dcp import verify_extra_files
from fp_integrations import lightning_sharded

pytest.importorskip("lightning")


def _run(tmp_path, mode: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           os.path.join(HELPERS, "lightning_model_parallel.py"), str(tmp_path), mode]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((tmp_path / f"result-{mode}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("model_parallel")
    return _run(d, "fastpersist"), _run(d, "stock"), d


def test_sharded_checkpoints_go_through_fastpersist(runs):
    fp, stock, d = runs
    # the same checkpoints as stock's, under the same names, at the same times
    assert fp["after_first"] == stock["after_first"] == ["last.ckpt", "sstep=4.ckpt", "sstep=6.ckpt"]
    assert fp["after_resume"] == stock["after_resume"]
    # every save went through the pipeline (not blocking: inside fit), on this rank's shards
    assert [s["path"] for s in fp["stats"]] == ["sstep=2.ckpt", "last.ckpt", "sstep=4.ckpt", "last.ckpt",
                                               "sstep=6.ckpt", "last.ckpt"]
    assert all(s["policy"] in ("overlap", "snapshot") and s["bytes"] > 0 for s in fp["stats"])
    # FastPersist directories: two rank files and meta.pt, all checked; stock's are not ours
    assert all(v == "3 files" for v in fp["verified"].values()), fp["verified"]
    assert all("did not write" in v for v in stock["verified"].values()), stock["verified"]
    last = d / "ckpts-fastpersist" / "last.ckpt"
    assert sorted(os.listdir(last)) == [".fastpersist-dcp.json", ".metadata", "__0_0.distcp",
                                        "__0_0.distcp.fastpersist.json", "__1_0.distcp",
                                        "__1_0.distcp.fastpersist.json", "meta.pt"]
    meta = torch.load(last / "meta.pt", weights_only=False)  # Lightning's own metadata, as stock writes it
    assert meta["global_step"] == 10 and "state_dict" not in meta


def test_resume_is_exact_and_stock_reads_our_checkpoints(runs):
    fp, stock, _ = runs
    assert fp["restored_exact"] is True and stock["restored_exact"] is True  # weights + Adam, bit for bit
    assert fp["stock_resume_same"] is True  # stock Lightning resuming from our directory ends where we end
    # Lightning's own mid-run resume does not repeat an uninterrupted run here (stock neither)
    assert fp["resume_same_as_straight"] == stock["resume_same_as_straight"]
    assert fp["resumed_step"] == stock["resumed_step"] == 10


def test_lightnings_meta_file_is_checksummed(runs, tmp_path):
    """meta.pt (Lightning's loops, callbacks, step) is committed inside the directory with
    a checksum: the sharded load checks it before Lightning reads it (verify=True)."""
    _, _, d = runs
    import shutil

    ckpt = tmp_path / "damaged.ckpt"
    shutil.copytree(d / "ckpts-fastpersist" / "last.ckpt", ckpt)
    with open(ckpt / "meta.pt", "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(fp_core.CorruptCheckpointError, match="meta.pt"):
        verify_extra_files(ckpt)


def test_only_sharded_strategies_are_routed():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    assert lightning_sharded.sharded_state_key(ModelParallelStrategy()) == "state_dict"
    assert lightning_sharded.sharded_state_key(ModelParallelStrategy(save_distributed_checkpoint=False)) is None
    assert lightning_sharded.sharded_state_key(FSDPStrategy(state_dict_type="sharded")) == "model"
    assert lightning_sharded.sharded_state_key(FSDPStrategy(state_dict_type="full")) is None
    assert lightning_sharded.sharded_state_key(DDPStrategy()) is None


def test_fsdp1_sharded_tensor_state_is_saved_in_the_background(tmp_path):
    """What FSDPStrategy(state_dict_type="sharded") hands over (ShardedTensors; the strategy
    itself needs a GPU): saved by the plugin through dcp.async_save with FastPersistWriter,
    queued on its checkpointer; the checkpoint holds the values at save, and verifies."""
    res = run_ranks("sharded_tensor_plugin.py", tmp_path, timeout=180)
    assert res["ranks"] == [{"equal": True, "queued": True}] * 2
    assert res["verified"] == 3 and res["stats"] == 1 and res["policy"] == ["snapshot"]
