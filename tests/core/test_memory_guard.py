"""Memory freed or resized under an overlap write (FSDP's resize_(0)): the guard makes it wait and
is on only while a write reads live memory; a resize it cannot see fails the save."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from fp_core import AsyncCheckpointer

FREE_UNDER_WRITE = r"""
import sys, threading, torch, fp_core
path, backend, at_save = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
t = torch.arange(32 << 20, dtype=torch.float32)  # 128 MiB: its own mapping, unmapped when freed
expected = t[-4096:].clone()
with fp_core.AsyncCheckpointer(policy="overlap", backend=backend, cpu_work_at_save=at_save,
                               install_optimizer_hook=False) as ckpt:
    h = ckpt.save({"p": t}, path)
    t.untyped_storage().resize_(0)  # how FSDP frees a parameter: must wait for the writer
    assert h._staged.is_set(), "resize_ returned while the write still read the storage"
got = torch.load(path)["p"]
assert got.numel() == 32 << 20 and torch.equal(got[-4096:], expected)
fp_core.verify(path)
print("OK")
"""


@pytest.mark.parametrize("backend", ["io_uring", "threadpool"])
@pytest.mark.parametrize("at_save", [True, False])
def test_storage_freed_under_an_overlap_write_waits_and_never_crashes(disk_dir, backend, at_save):
    """FSDP frees parameter storage with resize_(0) during forward/backward: under the overlap
    policy that used to crash the process (SIGSEGV on io_uring, EFAULT on the thread pool)."""
    import subprocess
    import sys

    path = os.path.join(disk_dir, "freed.pt")
    r = subprocess.run([sys.executable, "-c", FREE_UNDER_WRITE, path, backend, "1" if at_save else "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "OK", (r.returncode, r.stdout, r.stderr[-2000:])


def test_resize_guard_is_on_only_while_a_write_reads_live_memory(disk_dir):
    from fp_core.pipeline.checkpointer import memory_guard

    t = torch.ones(4 << 20)
    assert "resize_" not in torch.UntypedStorage.__dict__
    with AsyncCheckpointer(policy="overlap", install_optimizer_hook=False) as ckpt:
        h = ckpt.save({"t": t}, os.path.join(disk_dir, "g.pt"))
        h.result()
        ckpt.fence()
    assert not memory_guard.active()
    assert "resize_" not in torch.UntypedStorage.__dict__ and "resize_" not in torch.Tensor.__dict__
    other = torch.ones(10)
    other.resize_(20)  # unguarded tensors resize as ever
    assert other.shape == (20,)


def test_a_resize_the_guard_cannot_see_fails_the_save_instead_of_storing_it(disk_dir):
    """A storage reallocated in C++ (an op resizing its out= tensor) bypasses the Python guard:
    the save that read it must fail, not publish what it read."""
    from fp_core.errors import CheckpointError
    from fp_core.format.plan import build
    from fp_core.pipeline.checkpointer import _LiveMemory

    t = torch.ones(2 << 20)
    plan = build({"t": t})
    live = _LiveMemory(plan.storages, threading.Event())
    torch.ops.aten.resize_(t, [8 << 20])  # reallocates in C++: new address and size
    with pytest.raises(CheckpointError, match="freed or resized"):
        live.release(os.path.join(disk_dir, "x.pt"), plan)
    assert live.released.is_set()
    live.close()
