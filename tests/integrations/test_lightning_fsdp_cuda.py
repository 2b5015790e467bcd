"""Lightning's FSDPStrategy on a GPU with ``FastPersistIO`` alone (run by
benchmarks/gpu_check.sh; skipped without CUDA: FSDPStrategy refuses the CPU). The plugin
routes ``state_dict_type="sharded"`` without FastPersistCallback; ``"full"`` writes one
.ckpt from the FSDP1 flat-param shards on the GPU (no gather) that plain ``torch.load``
reads (CPU tensors, as stock's) and the stock load resumes from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HELPERS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(tmp_path, scenario: str) -> dict:
    p = subprocess.run([sys.executable, os.path.join(HELPERS, "lightning_fsdp_gpu.py"), str(tmp_path), scenario],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((tmp_path / "result.json").read_text())


def test_fsdp_sharded_with_the_plugin_alone(tmp_path):
    res = _run(tmp_path, "alone-sharded")
    assert res["routed"] is True
    assert "last.ckpt" in res["listing"] and len(res["listing"]) == 3  # step 2, step 4, last
    assert "meta.pt" in res["files"] and ".fastpersist-dcp.json" in res["files"]
    assert all(n >= 2 for n in res["verified"].values()), res["verified"]  # rank file + meta.pt
    assert res["stats"] == 3
    assert res["restored_equal"] is True


def test_fsdp_full_with_the_plugin_alone(tmp_path):
    res = _run(tmp_path, "alone-full")
    assert res["routed"] is True and res["why"] is None  # from the flat-param shards, no gather
    assert res["devices"] == ["cpu"]  # as stock's offload_to_cpu writes them
    assert "last.ckpt" in res["listing"] and len(res["listing"]) == 3
    assert res["verified"] == {n: 1 for n in res["listing"]}  # FastPersist files, checksummed
    assert {"state_dict", "optimizer_states", "loops", "callbacks"} <= set(res["full_keys"])
    assert res["full_equal"] is True
    assert res["stats"] == 3
    assert res["restored_equal"] is True
