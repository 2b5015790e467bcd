"""CUDA sources: staged through pinned host memory on a side stream. Skipped without a GPU."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import fp_core

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cdir():
    d = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".test-tmp", f"cuda-{uuid.uuid4().hex[:8]}")
    os.makedirs(d)
    yield d
    for n in os.listdir(d):
        os.unlink(os.path.join(d, n))
    os.rmdir(d)


def _state():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 1024, device="cuda", generator=g)
    return {"w": w, "view": w[3:7], "h": torch.randn(333, device="cuda", generator=g).half(),
            "cpu": torch.arange(10), "bf": torch.ones(5, device="cuda", dtype=torch.bfloat16)}


def test_cuda_round_trip_keeps_device_and_aliasing(cdir):
    s = _state()
    path = os.path.join(cdir, "c.pt")
    fp_core.save(s, path)
    got = torch.load(path)
    assert got["w"].device.type == "cuda"
    for k in s:
        assert torch.equal(got[k].cpu(), s[k].cpu())
    assert got["view"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
    fp_core.verify(path)
    cpu = fp_core.load(path, map_location="cpu")
    assert torch.equal(cpu["w"], s["w"].cpu())


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_cuda_async_consistent_after_step(cdir, policy):
    model = torch.nn.Linear(2048, 2048).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 2048, device="cuda")).sum().backward()
    opt.step()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    path = os.path.join(cdir, f"{policy}.pt")
    with fp_core.AsyncCheckpointer(policy=policy) as ckpt:
        ckpt.save(model.state_dict(), path)
        model(torch.randn(8, 2048, device="cuda")).sum().backward()
        opt.step()  # fenced by the installed hook
    got = torch.load(path, map_location="cpu")
    assert all(torch.equal(got[k], expected[k]) for k in expected)
