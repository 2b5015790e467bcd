"""The HF Trainer with FSDP2 (SHARDED_STATE_DICT) and FastPersistCallback, 2 CPU processes:
checkpoints in accelerate's layout written through FastPersistWriter, resumed exactly by the
callback and by the stock Trainer.

accelerate turns FSDP on only for GPU-like distributed types (on CPU it silently trains with
DDP), so the helper forces its state to MULTI_GPU after TrainingArguments made it; FSDP2
itself runs on the CPU over gloo. benchmarks/gpu_check.sh runs HF on a real GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import HELPERS, free_port

pytest.importorskip("accelerate")


def test_fsdp2_sharded_checkpoints_through_fastpersist_resume_exactly(tmp_path):
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
                        os.path.join(HELPERS, "hf_fsdp2.py"), str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    # accelerate's stock layout for SHARDED_STATE_DICT (no config or safetensors, as stock),
    # and FastPersist's list of the directory's files
    assert res["files"] == [".fastpersist-dir.json", "optimizer_0", "pytorch_model_fsdp_0", "rng_state_0.pth",
                            "rng_state_1.pth", "scheduler.pt", "trainer_state.json"]
    assert res["model_files"] == [".fastpersist-dcp.json", ".metadata", "__0_0.distcp",
                                  "__0_0.distcp.fastpersist.json", "__1_0.distcp", "__1_0.distcp.fastpersist.json"]
    assert res["checkpoints"] == ["checkpoint-2", "checkpoint-4"] and res["saves"] == [[2, True], [4, True]]
    assert res["verified"] == {"pytorch_model_fsdp_0": 2, "optimizer_0": 2}
    # resuming from checkpoint-2 repeats steps 3 and 4 bit for bit: through the callback
    # (which verifies every item first) and through the stock Trainer (stock reader)
    assert len(res["losses_a"]) == 4
    assert res["losses_b"] == res["losses_a"] and res["losses_c"] == res["losses_a"]


def test_resume_refuses_a_damaged_shard(tmp_path):
    """verify_checkpoint_dir (the callback's resume check) verifies the DCP directories."""
    import torch
    import torch.distributed.checkpoint as dcp

    import fp_core
    from fp_core.parallel.dcp import FastPersistWriter
    from fp_integrations.hf import FSDP_MODEL_DIR, verify_checkpoint_dir

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    dcp.save({"model": {"w": torch.randn(256, 256)}}, storage_writer=FastPersistWriter(ckpt / FSDP_MODEL_DIR))
    assert verify_checkpoint_dir(str(ckpt)) == 1
    item = next(r for r in fp_core.inspect(ckpt / FSDP_MODEL_DIR) if r["tensor"] == "model.w")
    with open(ckpt / FSDP_MODEL_DIR / "__0_0.distcp", "r+b") as f:
        f.seek(item["offset"] + item["size"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(fp_core.CorruptCheckpointError, match="model.w.*refusing to resume"):
        verify_checkpoint_dir(str(ckpt))


@pytest.mark.parametrize("version,sd_type,peft,reason", [
    (1, "StateDictType.SHARDED_STATE_DICT", False, "FSDP1"),
    (2, "StateDictType.FULL_STATE_DICT", False, None),  # test_hf_fsdp_full.py
    (2, "StateDictType.LOCAL_STATE_DICT", False, "LOCAL_STATE_DICT"),
    (2, "StateDictType.SHARDED_STATE_DICT", True, "PEFT"),
    (2, "StateDictType.SHARDED_STATE_DICT", False, None)])
def test_what_fsdp_setups_keep_the_stock_save(version, sd_type, peft, reason):
    from types import SimpleNamespace

    from fp_integrations.hf_fsdp import _fsdp_fallback_reason

    model = SimpleNamespace(peft_config={}) if peft else SimpleNamespace()
    plugin = SimpleNamespace(fsdp_version=version, state_dict_type=sd_type)
    trainer = SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), model=model)
    got = _fsdp_fallback_reason(trainer)
    assert (got is None) if reason is None else (reason in got), got


@pytest.mark.parametrize("sd_type,overrides,reason", [
    ("StateDictType.FULL_STATE_DICT", False, None),
    ("StateDictType.FULL_STATE_DICT", True, "overrides save_model"),
    ("StateDictType.SHARDED_STATE_DICT", True, None)])  # save_model is not ours there
def test_a_trainer_overriding_save_model_keeps_the_stock_full_state_dict_save(sd_type, overrides, reason):
    """Under FULL_STATE_DICT the callback writes save_model's files itself: a subclass's own
    save_model would be skipped, so such a trainer keeps the stock save."""
    from types import SimpleNamespace

    from transformers import Trainer

    from fp_integrations.hf_fsdp import _fsdp_fallback_reason

    cls = type("MyTrainer", (Trainer,), {"save_model": lambda self, *a, **k: None} if overrides else {})
    trainer = cls.__new__(cls)  # no __init__: only its class and plugin are looked at
    plugin = SimpleNamespace(fsdp_version=2, state_dict_type=sd_type)
    trainer.accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    trainer.model = SimpleNamespace()
    got = _fsdp_fallback_reason(trainer)
    assert (got is None) if reason is None else (reason in got), got
