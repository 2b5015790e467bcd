"""The process writer with device tensors (GPU check: benchmarks/gpu_check.sh): snapshots into
a shared-memory arena pinned with cudaHostRegister, a trainer killed after the fence, and a
resume from memory onto the device."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import HELPERS

import fp_core
from fp_core import AsyncCheckpointer
from fp_core.io import memory_image

sys.path.insert(0, HELPERS)
from process_writer_victim import wait_gone  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]




def test_device_state_round_trip_consistent_and_pinned(disk_dir, shm_root):
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 2048, device="cuda")).sum().backward()
    opt.step()
    path = os.path.join(disk_dir, "ck.pt")
    with AsyncCheckpointer(writer="process", resume_from_memory=True) as ck:
        want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        h = ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        ck.fence()
        arena = ck._writer_proc._all and next(iter(ck._writer_proc._all))
        assert arena.pin and arena.buf.is_pinned()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # after the fence: the checkpoint must not see it
        stats = h.result()
        assert stats.extra["writer"] == "process"
        got = torch.load(path, weights_only=True)
        assert all(torch.equal(got["model"][k].cpu(), want[k]) for k in want)
        assert got["model"]["0.weight"].device.type == "cuda"
        back = fp_core.load(path, map_location="cuda")  # its own live image: read as a copy
        assert torch.equal(back["model"]["0.weight"].cpu(), want["0.weight"])


def test_device_trainer_killed_after_the_fence_commits(disk_dir, shm_root):
    code = ("import os, signal, sys, torch\n"
            f"sys.path.insert(0, {os.path.dirname(HELPERS)!r})\n"
            "import fp_core\n"
            "w = torch.full((64 << 20,), 2.0, device='cuda')\n"
            "ck = fp_core.AsyncCheckpointer(writer='process', resume_from_memory=True)\n"
            f"ck.save({{'w': w}}, {os.path.join(disk_dir, 'ck.pt')!r})\n"
            "ck.fence(); w.fill_(9.0); torch.cuda.synchronize()\n"
            f"open({os.path.join(disk_dir, 'writer.pid')!r}, 'w').write(str(ck._writer_proc.pid))\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert wait_gone(int(open(os.path.join(disk_dir, "writer.pid")).read()), 120)
    path = os.path.join(disk_dir, "ck.pt")
    fp_core.verify(path)
    assert memory_image.find(path) is not None
    hits = memory_image.hits
    got = fp_core.load(path, map_location="cuda")
    assert memory_image.hits == hits + 1 and got["w"].device.type == "cuda" and bool((got["w"] == 2.0).all())
