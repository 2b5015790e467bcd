"""The process writer through the adapters: Lightning's FastPersistIO and the HF callback
pass ``writer="process"`` (and ``resume_from_memory``) on to the core."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch

HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
sys.path.insert(0, HELPERS)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp_core  # noqa: E402


def test_lightning_killed_after_a_fence_resumes_last_from_memory(tmp_path, shm_root):
    script = os.path.join(HELPERS, "lightning_process_writer.py")
    r = subprocess.run([sys.executable, script, str(tmp_path), "kill"], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    from process_writer_victim import wait_gone

    assert wait_gone(int(open(tmp_path / "writer.pid").read()), 60)  # the orphaned writer commits, exits
    r = subprocess.run([sys.executable, script, str(tmp_path), "resume"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "resume.json") as f:
        res = json.load(f)
    assert res == {"global_step": 4, "same": True, "from_memory": True}, res
    fp_core.verify(str(tmp_path / "last.ckpt"))


def test_hf_callback_with_the_process_writer_writes_stock_files(tmp_path, shm_root):
    from safetensors.torch import load_file
    from test_hf import CKPT_FILES, listing, make_trainer, optim_equal, state_equal

    stock, _ = make_trainer(tmp_path / "stock", fp=False)
    stock.train()
    t, cb = make_trainer(tmp_path / "fp", fp=True, cb_kwargs={"writer": "process"})
    t.train()
    assert cb.active and all(r.ok for r in cb.records)
    assert listing(tmp_path / "fp") == listing(tmp_path / "stock")
    assert set(listing(tmp_path / "fp")["checkpoint-6"]) == CKPT_FILES
    for c in listing(tmp_path / "fp"):
        a, b = tmp_path / "stock" / c, tmp_path / "fp" / c
        state_equal(load_file(a / "model.safetensors"), load_file(b / "model.safetensors"))
        optim_equal(torch.load(a / "optimizer.pt", weights_only=True),
                    torch.load(b / "optimizer.pt", weights_only=True))
        fp_core.verify(str(b / "model.safetensors"))
    assert os.listdir(os.path.join(shm_root, f"fastpersist-{os.geteuid()}")) == []  # closed with the run
