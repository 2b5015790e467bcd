"""The async pipeline fp_core.AsyncCheckpointer: the checkpoint holds the state at save() time
whatever training does next, under each policy (overlap, snapshot, auto and its budget), with the
CPU work at save() or in the background, shared by save_threads."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch
from _util import make_state, train_step
from conftest import MiB, assert_identical, assert_no_temps

import fp_core
from fp_core import AsyncCheckpointer
from fp_core.errors import CorruptCheckpointError


@pytest.mark.parametrize("at_save", [None, False], ids=["cpu-work-at-save", "cpu-work-in-background"])
@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_checkpoint_equals_state_at_save_time(disk_dir, policy, at_save, baseline_hooks):
    model, opt = make_state(vocab=100_000)  # 100 MB embedding, x3 with Adam's moments
    path = os.path.join(disk_dir, f"{policy}.pt")
    with AsyncCheckpointer(policy=policy, backend="buffered", cpu_work_at_save=at_save) as ckpt:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 1}
        expected = copy.deepcopy(state)
        h = ckpt.save(state, path)
        assert ckpt.hook_installed
        # Immediately: forward (mutates BN running stats in place), backward, in-place
        # buffer edits, then the optimizer step (mutates params and Adam moments in place).
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 100_000, (16,), generator=g)
        loss = model(ids).square().mean()
        loss.backward()
        with torch.no_grad():
            model.bn.running_mean.add_(100.0)
            model.bn.running_var.mul_(3.0)
            model.bn.num_batches_tracked.add_(5)
        running_at_step = not h.done()
        opt.step()  # fences first (hook) under overlap; snapshot has copied already
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # after the step: the fence has released, writes must not see this
        ckpt.wait()
        assert h.done()
        assert not ckpt.hook_installed
    assert running_at_step, "the checkpoint finished before step(): make it bigger or the disk slower"
    st = h.result()
    assert st.policy == policy
    # CPU tensors: the copy / checksums ran inside save() unless sent to the background
    assert ("at_save_seconds" in st.extra) == (at_save is None)
    if policy == "snapshot":  # the page-aligned arena copies are written without staging
        big = sum(t.numel() * t.element_size() for t in state["model"].values() if t.numel() * t.element_size() > MiB)
        assert st.extra["zero_copy_bytes"] >= big - 2 * MiB
    fp_core.verify(path)
    assert_identical(expected, torch.load(path, weights_only=True))
    assert_identical(expected, fp_core.load(path, verify=True))
    assert_no_temps(disk_dir)


def test_auto_policy_and_budget(disk_dir):
    model, opt = make_state()
    state = {"model": model.state_dict()}
    with AsyncCheckpointer(policy="auto", snapshot_budget_bytes=1) as ckpt:
        h = ckpt.save(state, os.path.join(disk_dir, "a.pt"))
        assert h.result().policy == "overlap"
    with AsyncCheckpointer(policy="auto") as ckpt:
        h = ckpt.save(state, os.path.join(disk_dir, "b.pt"))
        assert h.result().policy == "snapshot"
    with AsyncCheckpointer(policy="snapshot", snapshot_budget_bytes=1) as ckpt:
        h = ckpt.save(state, os.path.join(disk_dir, "c.pt"))
        assert h.result().policy == "overlap"  # over budget: falls back (with a warning)
    for n in "abc":
        assert_identical(state, fp_core.load(os.path.join(disk_dir, f"{n}.pt"), verify=True))


def test_overlap_writes_live_tensors_without_staging_and_keeps_save_time_values(disk_dir):
    """The async layout puts each CPU tensor at a file offset congruent to its address, so
    the overlap policy sends it to O_DIRECT from its own memory; the fence still holds the
    optimizer step until those writes are done."""
    model, opt = make_state(vocab=60_000)
    train_step(model, opt, 0)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = copy.deepcopy(state)
    path = os.path.join(disk_dir, "zc.pt")
    with AsyncCheckpointer(policy="overlap", backend="io_uring") as ckpt:
        h = ckpt.save(state, path)
        train_step(model, opt, 1)  # its optimizer.step() fences first
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3.0)
        st = h.result()
    big = [t for t in list(state["model"].values()) if t.numel() * t.element_size() > MiB]
    big_bytes = sum(t.numel() * t.element_size() for t in big)
    assert big_bytes > 50 * MiB
    assert st.extra["zero_copy_bytes"] >= 3 * big_bytes - 3 * len(big) * 8192  # params + 2 Adam moments
    offsets = {r["tensor"]: r["offset"] for r in fp_core.inspect(path) if r["kind"] == "storage"}
    for name, t in state["model"].items():  # each storage sits where its memory sits, modulo a page
        if t.numel() * t.element_size() > MiB:
            assert offsets[f"model.{name}"] % 4096 == t.untyped_storage().data_ptr() % 4096, name
    fp_core.verify(path)
    assert_identical(expected, torch.load(path, weights_only=True))
    assert_identical(expected, torch.load(path, weights_only=True, mmap=True))
    assert_identical(expected, fp_core.load(path, verify=True))


def test_checksums_taken_at_save_catch_a_tensor_changed_before_the_fence(disk_dir):
    """Overlap checksums CPU tensors inside save(): a tensor changed in place before the
    fence (breaking the overlap contract) is either written before the change or caught
    by verify, never stored changed under a matching checksum."""
    big = torch.full((64 * MiB,), 1.0)  # 256 MiB: the write is still running when we change it
    path = os.path.join(disk_dir, "changed.pt")
    with AsyncCheckpointer(policy="overlap", install_optimizer_hook=False) as ckpt:
        h = ckpt.save({"big": big}, path)
        big.fill_(2.0)  # no fence first
        running = not h.done()
        h.result()
    assert running, "the save finished before the change: make the tensor bigger"
    try:
        fp_core.verify(path)
    except CorruptCheckpointError as e:
        assert e.tensor == "big"
        return
    assert torch.equal(torch.load(path)["big"], torch.full((64 * MiB,), 1.0))


@pytest.mark.parametrize("threads", [1, 3])
def test_save_threads_share_the_cpu_work(disk_dir, threads):
    state = {f"t{i}": torch.randn(3 * MiB // 4 + i) for i in range(6)}
    expected = copy.deepcopy(state)
    for policy in ("overlap", "snapshot"):
        path = os.path.join(disk_dir, f"{policy}-{threads}.pt")
        with AsyncCheckpointer(policy=policy, save_threads=threads) as ckpt:
            st = ckpt.save(state, path).result()
            assert ckpt._pool_threads == threads
        assert st.extra["at_save_seconds"] > 0
        fp_core.verify(path)
        assert_identical(expected, fp_core.load(path, verify=True))
    with pytest.raises(ValueError, match="save_threads"):
        AsyncCheckpointer(save_threads=0)


def test_a_tensor_changed_before_a_fence_that_copies_it_is_caught_too(disk_dir):
    """A fence that copies the unwritten rest keeps the checksums taken inside save(): a
    tensor changed before that fence (against the overlap contract) is caught by verify,
    never stored changed under a checksum of the changed bytes."""
    state = {"a": torch.full((3 * MiB,), 1.0), "b": torch.full((3 * MiB,), 3.0)}
    path = os.path.join(disk_dir, "changed-fenced.pt")
    with AsyncCheckpointer(policy="overlap", install_optimizer_hook=False) as ckpt:
        gate = threading.Event()
        ckpt.enqueue(gate.wait)  # the writer is held: nothing is written before the fence
        h = ckpt.save(state, path)
        state["b"].fill_(2.0)  # no fence first
        ckpt.fence()  # copies all of it, the changed bytes among them
        gate.set()
        st = h.result()
    assert st.extra["fence_copied_bytes"] == 24 * MiB
    with pytest.raises(CorruptCheckpointError) as e:
        fp_core.verify(path)
    assert e.value.tensor == "b"


def test_a_snapshot_copied_inside_save_needs_no_writer_at_the_fence(disk_dir):
    """With a warm arena the snapshot is taken inside save(): the fence returns at once,
    even while the writer is held on other work (it has nothing live left to read), and
    the file holds the state as of save()."""
    state = {"a": torch.full((3 * MiB,), 1.0), "b": torch.arange(2 * MiB, dtype=torch.float32)}
    expected = {k: v.clone() for k, v in state.items()}
    path = os.path.join(disk_dir, "snap.pt")
    with AsyncCheckpointer(policy="snapshot", install_optimizer_hook=False) as ckpt:
        ckpt.save(state, path).result()  # the first fills its arena on the writer
        ckpt.wait()  # and the arena comes back warm
        gate = threading.Event()
        ckpt.enqueue(gate.wait)  # the writer is held
        try:
            h = ckpt.save(state, path)
            done = threading.Event()
            threading.Thread(target=lambda: (ckpt.fence(), done.set()), daemon=True).start()
            assert done.wait(5), "the fence waited for the held writer"
            for t in state.values():
                t.fill_(-1.0)  # the optimizer step after the fence
        finally:
            gate.set()
        assert h.result().extra["at_save_bytes"] == 20 * MiB  # copied inside save()
    assert_identical(expected, fp_core.load(path, verify=True))


def test_an_auto_save_laid_out_for_a_snapshot_that_goes_overlap_still_catches_a_change(disk_dir):
    """After a snapshot, auto lays the next save out for a snapshot (not congruent to the
    tensors' addresses). One that goes overlap instead (here: over the snapshot budget)
    has its fence wait for the write rather than copy under checksums keyed at other
    ranges: a tensor changed before that fence is still caught by verify."""
    path = os.path.join(disk_dir, "mispredicted.pt")
    with AsyncCheckpointer(install_optimizer_hook=False, snapshot_budget_bytes=16 * MiB) as ckpt:
        small = {"a": torch.full((3 * MiB // 4,), 1.0)}
        policies = []
        for _ in range(2):
            policies.append(ckpt.save(small, path).result().policy)
            ckpt.enqueue(lambda: None, after=[]).result()  # the writer has warmed the arena
        assert policies == ["overlap", "snapshot"]  # an overlap first, then into the warm arena
        big = {"b": torch.full((5 * MiB + 7,), 3.0)}  # over the budget, an odd length
        gate = threading.Event()
        ckpt.enqueue(gate.wait)  # the writer is held
        try:
            h = ckpt.save(big, path)
            big["b"].fill_(2.0)  # no fence first
            threading.Timer(0.3, gate.set).start()
            ckpt.fence()
        finally:
            gate.set()
        assert h.result().policy == "overlap"
    with pytest.raises(CorruptCheckpointError) as e:
        fp_core.verify(path)
    assert e.value.tensor == "b"
