"""The HF Trainer with FSDP2 (SHARDED_STATE_DICT) and FastPersistCallback, 2 CPU processes:
checkpoints in accelerate's layout written through FastPersistWriter, resumed exactly by the
callback and by the stock Trainer.

accelerate turns FSDP on only for GPU-like distributed types (on CPU it silently trains with
DDP), so the helper forces its state to MULTI_GPU after TrainingArguments made it; FSDP2
itself runs on the CPU over gloo. benchmarks/gpu_check.sh runs HF on a real GPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import HELPERS

pytest.importorskip("accelerate")


def test_fsdp2_sharded_checkpoints_through_fastpersist_resume_exactly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
                        os.path.join(HELPERS, "hf_fsdp2.py"), str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    # accelerate's stock layout for SHARDED_STATE_DICT (no config or safetensors, as stock)
    assert res["files"] == ["optimizer_0", "pytorch_model_fsdp_0", "rng_state_0.pth", "rng_state_1.pth",
                            "scheduler.pt", "trainer_state.json"]
    assert res["model_files"] == [".fastpersist-dcp.json", ".metadata", "__0_0.distcp",
                                  "__0_0.distcp.fastpersist.json", "__1_0.distcp", "__1_0.distcp.fastpersist.json"]
    assert res["checkpoints"] == ["checkpoint-2", "checkpoint-4"] and res["saves"] == [[2, True], [4, True]]
    assert res["verified"] == {"pytorch_model_fsdp_0": 2, "optimizer_0": 2}
    # resuming from checkpoint-2 repeats steps 3 and 4 bit for bit: through the callback
    # (which verifies every item first) and through the stock Trainer (stock reader)
    assert len(res["losses_a"]) == 4
    assert res["losses_b"] == res["losses_a"] and res["losses_c"] == res["losses_a"]
