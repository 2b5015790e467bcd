"""AsyncCheckpointer's optimizer hook: installed only while a save is in flight, fences before
optimizer.step() (after a closure runs), and leaves torch's hook dict alone."""

from __future__ import annotations

import os

import torch
from _util import big_obj, make_state, train_step
from torch.optim.optimizer import _global_optimizer_pre_hooks

import fp_core
from fp_core import AsyncCheckpointer


def test_hook_installed_only_while_a_save_is_in_flight(disk_dir, baseline_hooks):
    model, opt = make_state()
    with AsyncCheckpointer(policy="overlap", backend="buffered") as ckpt:
        assert not ckpt.hook_installed
        ckpt.save(big_obj(32), os.path.join(disk_dir, "a.pt"))
        assert ckpt.hook_installed
        assert len(_global_optimizer_pre_hooks) == baseline_hooks + 1
        ckpt.wait()
        assert not ckpt.hook_installed
        assert len(_global_optimizer_pre_hooks) == baseline_hooks
        ckpt.save(big_obj(32), os.path.join(disk_dir, "b.pt"))
        assert ckpt.hook_installed
        ckpt.fence()
        assert not ckpt.hook_installed
        ckpt.wait()
        # A step with the hook installed fences, then the hook goes.
        ckpt.save(big_obj(32), os.path.join(disk_dir, "c.pt"))
        assert ckpt.hook_installed
        train_step(model, opt, 3)
        assert not ckpt.hook_installed
    with AsyncCheckpointer(install_optimizer_hook=False) as ckpt:
        ckpt.save(big_obj(8), os.path.join(disk_dir, "d.pt"))
        assert not ckpt.hook_installed
        assert len(_global_optimizer_pre_hooks) == baseline_hooks


def test_fence_inside_the_hook_leaves_torchs_hook_dict_alone(disk_dir, baseline_hooks):
    """A step without a closure fences inside the hook; removing the hook there would
    change the dict torch is iterating and fail the step of any hook registered after it."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    model, opt = make_state()
    after = []
    with AsyncCheckpointer(policy="overlap") as ckpt:
        ckpt.save(big_obj(8), os.path.join(disk_dir, "a.pt"))
        later = register_optimizer_step_pre_hook(lambda o, a, k: after.append(1))  # after ours
        try:
            train_step(model, opt, 1)  # fences inside our hook, then torch calls `later`
            assert after == [1] and not ckpt.hook_installed
            assert len(_global_optimizer_pre_hooks) == baseline_hooks + 2  # switched off, not yet out
            train_step(model, opt, 2)  # the switched-off hook does nothing
            assert after == [1, 1]
            ckpt.save(big_obj(8), os.path.join(disk_dir, "b.pt"))  # a safe point: the old one leaves
            assert len(_global_optimizer_pre_hooks) == baseline_hooks + 2  # later + the new one
        finally:
            later.remove()
    assert len(_global_optimizer_pre_hooks) == baseline_hooks


def test_optimizer_hook_fences_after_a_step_closure(disk_dir):
    """optimizer.step(closure): the fence waits until forward/backward inside the closure ran."""
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order: list[str] = []
    with fp_core.AsyncCheckpointer(policy="overlap") as ckpt:
        real_fence = ckpt.fence

        def fence() -> None:
            order.append("fence")
            real_fence()

        ckpt.fence = fence
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save(model.state_dict(), os.path.join(disk_dir, "c.pt"))

        def closure():
            order.append("closure")
            opt.zero_grad()
            loss = model(torch.ones(2, 256)).sum()
            loss.backward()
            return loss

        opt.step(closure)
        assert order[:2] == ["closure", "fence"]
    got = torch.load(os.path.join(disk_dir, "c.pt"))
    assert all(torch.equal(got[k], expected[k]) for k in expected)
