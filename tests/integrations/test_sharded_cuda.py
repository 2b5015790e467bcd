"""Sharded checkpoints on a GPU (run by benchmarks/gpu_check.sh; skipped without CUDA):
Lightning's FSDPStrategy(state_dict_type="sharded") refuses the CPU, so its path through
FastPersist (FSDP1 ShardedTensor state -> dcp.save with FastPersistWriter) is checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HELPERS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_lightning_fsdp_sharded_checkpoints_through_fastpersist(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(HELPERS, "lightning_fsdp_gpu.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert "last.ckpt" in res["listing"] and len(res["listing"]) == 3  # step 2, step 4, last
    assert "meta.pt" in res["files"] and ".fastpersist-dcp.json" in res["files"]
    assert all(n >= 2 for n in res["verified"].values()), res["verified"]  # rank file + meta.pt
    assert res["stats"] == 3
    assert res["restored_equal"] is True
