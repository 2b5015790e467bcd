"""fp_core.load_into as a resume, against torch.load + load_state_dict on real files: the
next training step is the same bit for bit, the hyperparameters are the file's, and a
fresh optimizer (no state before its first step) gets its state created from the file."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_identical

import fp_core
from fp_core.errors import NotAFastPersistCheckpoint
from fp_core.loading import loader

LIVE_LR = 0.1  # set on the live optimizer after the save: a resume must not keep it


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 5, generator=g)


def _job(kind: str, seed: int):
    """A model (a channels-last conv: its optimizer state is dense but not row-major), an
    optimizer of ``kind`` and an LR scheduler, fresh."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(64, 5)).to(memory_format=torch.channels_last)
    if kind == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    elif kind == "adamw-amsgrad":
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, amsgrad=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps: range) -> None:
    for i in steps:
        x, y = _batch(i)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def _saved_job(kind: str, path: str, writer: str):
    """Trained 3 steps and saved; then trained on, its lr set by hand: live != file."""
    model, opt, sched = _job(kind, 0)
    _train(model, opt, sched, range(3))
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "epoch": 3}
    if writer == "fastpersist":
        fp_core.save(state, path)
    else:
        torch.save(state, path)
    file_lr = opt.param_groups[0]["lr"]
    _train(model, opt, sched, range(3, 5))
    for g in opt.param_groups:
        g["lr"] = LIVE_LR
    assert file_lr != LIVE_LR
    return (model, opt, sched), file_lr


def _stock_resume(kind: str, path: str):
    model, opt, sched = _job(kind, 1)
    sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    sched.load_state_dict(sd["sched"])
    return model, opt, sched


def _assert_same_next_step(a, b) -> None:
    """One more step, the same batch: parameters, optimizer and scheduler state equal."""
    for job in (a, b):
        _train(*job, range(3, 4))
    for (n, p), q in zip(a[0].named_parameters(), b[0].parameters()):
        assert torch.equal(p, q), n
        assert p.stride() == q.stride(), n
    assert_identical(b[1].state_dict(), a[1].state_dict(), "optim")
    for p, q in zip(a[0].parameters(), b[0].parameters()):  # the layout torch.load gives, too
        for k, t in a[1].state[p].items():
            u = b[1].state[q][k]
            assert (u.device, u.dtype, u.stride()) == (t.device, t.dtype, t.stride()), k
    assert b[2].state_dict() == a[2].state_dict()


def _no_whole_load(monkeypatch) -> None:
    """The resume is load_into's scatter read into the tensors, never a whole load."""
    def refuse(*a, **k):
        raise AssertionError("load_into loaded the whole file")

    monkeypatch.setattr(loader, "load", refuse)


WRITES = [("fastpersist", False), ("fastpersist", True), ("torch", False)]


@pytest.mark.parametrize("kind", ["adam", "adamw-amsgrad", "sgd"])
@pytest.mark.parametrize("writer,verify", WRITES)
def test_one_call_resume_of_a_fresh_job_steps_as_torch_load_does(disk_dir, kind, writer, verify, monkeypatch):
    path = os.path.join(disk_dir, "ckpt.pt")
    _, file_lr = _saved_job(kind, path, writer)
    stock = _stock_resume(kind, path)
    _no_whole_load(monkeypatch)
    model, opt, sched = _job(kind, 1)
    assert not opt.state  # fresh: its state is created from the file
    ptrs = [p.data_ptr() for p in model.parameters()]
    # docs/pytorch.md's resume recipe: the epoch is not in the target, it is the file's
    state = fp_core.load_into({"model": model, "optim": opt, "sched": sched}, path, verify=verify)
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # read into the model's own memory
    assert state["epoch"] == 3
    assert [g["lr"] for g in opt.param_groups] == [file_lr] * len(opt.param_groups)
    assert state["optim"]["param_groups"][0]["lr"] == file_lr
    assert sched.get_last_lr() == stock[2].get_last_lr()
    for p in model.parameters():  # created where its parameter lives; step where torch puts it
        for k, t in opt.state[p].items():
            assert t.device == p.device, k
    _assert_same_next_step(stock, (model, opt, sched))


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("writer,verify", WRITES)
def test_resume_into_state_dicts_then_load_state_dict(disk_dir, kind, writer, verify, monkeypatch):
    """The recipe with plain state dicts: the result's parts, handed to load_state_dict,
    carry the file's hyperparameters and the state a fresh optimizer lacked."""
    path = os.path.join(disk_dir, "ckpt.pt")
    _, file_lr = _saved_job(kind, path, writer)
    stock = _stock_resume(kind, path)
    _no_whole_load(monkeypatch)
    model, opt, sched = _job(kind, 1)
    target = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "epoch": 0}
    state = fp_core.load_into(target, path, verify=verify)
    assert state["optim"]["param_groups"][0]["lr"] == file_lr
    assert state["model"]["0.weight"] is target["model"]["0.weight"]
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    assert opt.param_groups[0]["lr"] == file_lr
    _assert_same_next_step(stock, (model, opt, sched))


@pytest.mark.parametrize("verify", [False, True])
def test_resume_into_a_job_with_state_fills_it_in_place(disk_dir, verify):
    """An optimizer that has state (the job itself, rolled back to its checkpoint): the
    same tensor objects, in the same memory, hold the file's values; the live lr is gone."""
    path = os.path.join(disk_dir, "ckpt.pt")
    (model, opt, sched), file_lr = _saved_job("adam", path, "fastpersist")
    stock = _stock_resume("adam", path)
    before = {(id(p), k): (t, t.data_ptr()) for p in model.parameters() for k, t in opt.state[p].items()}
    assert len(before) == 3 * len(list(model.parameters()))
    params = [(p, p.data_ptr()) for p in model.parameters()]
    assert opt.param_groups[0]["lr"] == LIVE_LR
    fp_core.load_into({"model": model, "optim": opt, "sched": sched}, path, verify=verify)
    assert [(p, p.data_ptr()) for p in model.parameters()] == params
    for p in model.parameters():
        for k, t in opt.state[p].items():
            old, ptr = before[(id(p), k)]
            assert t is old and t.data_ptr() == ptr, k
    assert opt.param_groups[0]["lr"] == file_lr
    _assert_same_next_step(stock, (model, opt, sched))


def test_state_the_file_lacks_is_dropped_as_load_state_dict_drops_it(disk_dir):
    """Saved before the first step (no optimizer state), resumed into a job that has
    stepped: the optimizer ends with the file's (empty) state, as with torch.load."""
    path = os.path.join(disk_dir, "ckpt.pt")
    model, opt, sched = _job("adam", 0)
    fp_core.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, path)
    stock = _stock_resume("adam", path)
    _train(model, opt, sched, range(2))
    assert opt.state
    state = fp_core.load_into({"model": model, "optim": opt, "sched": sched}, path)
    assert state["optim"]["state"] == {} and not opt.state
    for p, q in zip(model.parameters(), stock[0].parameters()):
        assert torch.equal(p, q)
    _assert_same_next_step(stock, (model, opt, sched))


def test_resume_keeps_refusing_what_does_not_fit(disk_dir):
    path = os.path.join(disk_dir, "ckpt.pt")
    _saved_job("adam", path, "fastpersist")
    model, opt, sched = _job("adam", 1)
    _train(model, opt, sched, range(1))
    sd = opt.state_dict()
    # existing state of another shape (the optimizer's own dict left as it is): named, nothing read
    sd["state"][0] = dict(sd["state"][0], exp_avg=torch.zeros(5))
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"optim\.state\.0\.exp_avg is \(4, 3, 3, 3\)"):
        fp_core.load_into({"model": model.state_dict(), "optim": sd, "sched": sched.state_dict(), "epoch": 0}, path)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    other = _job("adam", 1)[0]  # a model of another shape: named before anything is read or set
    other[3] = torch.nn.Linear(64, 6)
    lr = opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=r"model\.3\.weight is \(5, 64\).*\(6, 64\)"):
        fp_core.load_into({"model": other, "optim": opt, "sched": sched, "epoch": 0}, path)
    assert opt.param_groups[0]["lr"] == lr
    half = torch.optim.Adam(model[0].parameters())  # an optimizer of other parameters: before the read
    with pytest.raises(ValueError, match=r"optim\.param_groups holds \[4\] parameters in the file, \[2\]"):
        fp_core.load_into({"model": model, "optim": half, "sched": sched, "epoch": 0}, path)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    with pytest.raises(ValueError, match=r"in the file only \['3\.bias'\]"):  # a model key missing
        fp_core.load_into({"model": {k: v for k, v in model.state_dict().items() if k != "3.bias"},
                           "optim": opt, "sched": sched, "epoch": 0}, path)
    with pytest.raises(ValueError, match=r"in the target only \['scaler'\]"):  # an object the file lacks
        fp_core.load_into({"model": model, "optim": opt, "sched": sched, "epoch": 0,
                           "scaler": torch.nn.Linear(1, 1)}, path)
    with pytest.raises(ValueError, match=r"epoch is int in the file, not the state dict of the target's Linear"):
        fp_core.load_into({"model": model, "optim": opt, "sched": sched, "epoch": torch.nn.Linear(1, 1)}, path)
    with pytest.raises(NotAFastPersistCheckpoint):
        torch.save({"model": model.state_dict()}, path)
        fp_core.load_into({"model": model}, path, verify=True)


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
def test_resume_through_a_whole_load_creates_state_too(disk_dir, writer):
    """Where torch computes the storages' offsets itself (its ``calculate_storage_offsets``
    setting) load_into loads the file whole and copies: the same resume, the same step."""
    from torch.utils.serialization import config

    path = os.path.join(disk_dir, "ckpt.pt")
    _, file_lr = _saved_job("adam", path, writer)
    stock = _stock_resume("adam", path)
    model, opt, sched = _job("adam", 1)
    was = config.load.calculate_storage_offsets  # set and put back as torch's config wants (no delattr)
    config.load.calculate_storage_offsets = True
    try:
        state = fp_core.load_into({"model": model, "optim": opt, "sched": sched}, path)
    finally:
        config.load.calculate_storage_offsets = was
    assert state["epoch"] == 3 and opt.param_groups[0]["lr"] == file_lr
    _assert_same_next_step(stock, (model, opt, sched))


@pytest.mark.parametrize("fresh", [True, False])
def test_the_old_recipe_restores_the_files_optimizer_too(disk_dir, fresh):
    """``load_into(state, p); optimizer.load_state_dict(state["optim"])``, the target's own
    dicts handed on: after the read they hold the file's lr and the created state."""
    path = os.path.join(disk_dir, "ckpt.pt")
    live, file_lr = _saved_job("adam", path, "fastpersist")
    stock = _stock_resume("adam", path)
    model, opt, sched = _job("adam", 1) if fresh else live
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}
    assert state["optim"]["param_groups"][0]["lr"] == (0.05 if fresh else LIVE_LR)
    fp_core.load_into(state, path)
    assert state["optim"]["param_groups"][0]["lr"] == file_lr and "epoch" in state
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    assert opt.param_groups[0]["lr"] == file_lr
    _assert_same_next_step(stock, (model, opt, sched))
