"""Tests of the async pipeline fp_core.AsyncCheckpointer (issue: async pipeline)."""

from __future__ import annotations

import copy
import errno
import gc
import os
import shutil
import threading
import time

import pytest
import torch
from conftest import MiB, assert_identical, assert_no_temps, fd_count, rss_bytes, thread_count
from torch.optim.optimizer import _global_optimizer_pre_hooks

import fp_core
from fp_core import AsyncCheckpointer, AsyncCheckpointError
from fp_core.errors import CorruptCheckpointError


class Net(torch.nn.Module):
    """Embedding (the bulk of the bytes, cheap to run) + Linear + BatchNorm."""

    def __init__(self, width: int = 256, vocab: int = 1000) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.fc = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.head = torch.nn.Linear(width, 8)

    def forward(self, ids):
        return self.head(torch.relu(self.bn(self.fc(self.emb(ids)))))


def train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.emb.num_embeddings, (16,), generator=g)
    y = torch.randint(0, 8, (16,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(ids), y)
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()


def make_state(vocab: int = 1000):
    """Embedding + Linear + BatchNorm with Adam, one step taken."""
    torch.manual_seed(0)
    model = Net(256, vocab)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, opt, 0)
    return model, opt


def big_obj(mib: int = 64, value: float = 1.0) -> dict:
    return {"big": torch.full((mib * MiB // 4,), value), "meta": {"v": value}}


def _settled_hooks() -> int:
    """torch's global pre-hook count once hooks freed or switched off earlier are out
    (their removal waits for a safe point: fp_core.optim_hooks)."""
    gc.collect()
    fp_core.optim_hooks.flush()
    return len(_global_optimizer_pre_hooks)


@pytest.fixture
def baseline_hooks():
    n = _settled_hooks()
    yield n
    assert _settled_hooks() == n, "an optimizer hook was left installed"


# ====================================================================== consistency


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


def test_writer_thread_runs_at_lower_priority(disk_dir):
    """The writer (and the engine threads it starts) yields the CPUs to training."""
    seen = []

    def on_commit(path, stats):  # runs on the writer thread
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with AsyncCheckpointer(writer_nice=5) as ckpt:
        ckpt.save({"x": torch.ones(10)}, os.path.join(disk_dir, "n.pt"), on_commit=on_commit)
    with AsyncCheckpointer(writer_nice=0) as ckpt:
        ckpt.save({"x": torch.ones(10)}, os.path.join(disk_dir, "n0.pt"), on_commit=on_commit)
    assert seen == [min(19, base + 5), base]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # caller untouched


# ====================================================================== optimizer hook


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


# ====================================================================== error surfacing


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


def _fail_one_save(ckpt, disk_dir, fault, name="bad.pt"):
    path = os.path.join(disk_dir, name)
    fault("write", errno=errno.EIO)
    h = ckpt.save(big_obj(8), path)
    h._done.wait(30)  # wait without reporting
    assert h.done()
    return path, h


def _assert_async_error(e: AsyncCheckpointError, path: str) -> None:
    cause = e.__cause__
    assert isinstance(cause, OSError), repr(cause)
    assert cause.errno == errno.EIO
    assert path in str(cause)
    assert path in str(e)


@pytest.mark.parametrize("surface", ["save", "fence", "wait", "close", "wait_for"])
def test_background_error_raised_once_at_the_next_call(disk_dir, fault, surface):
    ckpt = AsyncCheckpointer(backend="buffered")
    try:
        path, h = _fail_one_save(ckpt, disk_dir, fault)
        time.sleep(0.05)
        with pytest.raises(AsyncCheckpointError) as ei:
            if surface == "save":
                ckpt.save(big_obj(1), os.path.join(disk_dir, "next.pt"))
            elif surface == "fence":
                ckpt.fence()
            elif surface == "wait":
                ckpt.wait()
            elif surface == "wait_for":
                ckpt.wait_for(path)
            else:
                ckpt.close()
        _assert_async_error(ei.value, path)
        assert not os.path.exists(path)
        assert_no_temps(disk_dir)
        # Exactly once: later calls are clean.
        if surface != "close":
            ckpt.fence()
            ckpt.wait()
            h2 = ckpt.save(big_obj(1), os.path.join(disk_dir, "after.pt"))
            ckpt.wait()
            assert h2.result().bytes > 0
    finally:
        ckpt.close()


def test_fence_right_after_failure_raises(disk_dir, fault):
    """Once handle.done() is True the failure must be visible to fence() (no race)."""
    misses = 0
    for i in range(30):
        ckpt = AsyncCheckpointer(backend="buffered")
        raised = 0
        try:
            _fail_one_save(ckpt, disk_dir, fault, name=f"bad{i}.pt")
            try:
                ckpt.fence()
                misses += 1
            except AsyncCheckpointError:
                raised += 1
        finally:
            try:
                ckpt.close()
            except AsyncCheckpointError:
                raised += 1
        assert raised == 1, "the failure must be raised exactly once"
    assert misses == 0, f"{misses}/30 fences right after a failed save finished did not raise"


def test_handle_result_raises_and_counts_as_reported(disk_dir, fault):
    with AsyncCheckpointer(backend="buffered") as ckpt:
        path, h = _fail_one_save(ckpt, disk_dir, fault)
        with pytest.raises(AsyncCheckpointError) as ei:
            h.result()
        _assert_async_error(ei.value, path)
        assert isinstance(h.exception(), OSError)
        with pytest.raises(AsyncCheckpointError):
            h.result()  # the handle keeps saying so
        ckpt.fence()  # ...but the checkpointer does not raise it a second time
        ckpt.wait()
    assert not os.path.exists(path)
    assert_no_temps(disk_dir)


def test_directory_removed_under_a_save(disk_dir):
    d = os.path.join(disk_dir, "sub")
    os.makedirs(d)
    path = os.path.join(d, "x.pt")
    ckpt = AsyncCheckpointer(backend="buffered")
    try:
        h = ckpt.save(big_obj(64), path)
        shutil.rmtree(d)
        with pytest.raises(AsyncCheckpointError) as ei:
            ckpt.wait()
        assert isinstance(ei.value.__cause__, OSError)
        assert ei.value.__cause__.errno == errno.ENOENT
        assert h.done()
        assert not os.path.exists(path)
    finally:
        ckpt.close()


def test_serialization_error_raised_by_save_itself(disk_dir):
    with AsyncCheckpointer() as ckpt:
        with pytest.raises(fp_core.CheckpointSerializationError):
            ckpt.save({"bad": lambda: 0}, os.path.join(disk_dir, "x.pt"))
        assert not ckpt.pending()
        assert_no_temps(disk_dir)
        with pytest.raises(FileNotFoundError):
            ckpt.save({}, os.path.join(disk_dir, "missing", "x.pt"))


# ====================================================================== bounded in-flight


def test_max_in_flight_one_waits_for_the_previous_commit(disk_dir):
    events: list[tuple[str, str, float]] = []
    lock = threading.Lock()

    def on_commit(path, stats):
        with lock:
            events.append(("commit", os.path.basename(path), time.perf_counter()))

    with AsyncCheckpointer(max_in_flight=1, when_busy="wait", backend="buffered") as ckpt:
        for i in range(3):
            ckpt.save(big_obj(48, i), os.path.join(disk_dir, f"{i}.pt"), on_commit=on_commit)
            with lock:
                events.append(("returned", f"{i}.pt", time.perf_counter()))
    order = [(k, n) for k, n, _ in events]
    # save i+1 returns only after save i committed
    for i in range(2):
        assert order.index(("commit", f"{i}.pt")) < order.index(("returned", f"{i + 1}.pt")), order
    assert [n for k, n in order if k == "commit"] == ["0.pt", "1.pt", "2.pt"]


def test_when_busy_queue_returns_at_once_but_stays_bounded(disk_dir):
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def on_commit(path, stats):
        with lock:
            events.append(("commit", os.path.basename(path)))

    with AsyncCheckpointer(max_in_flight=1, when_busy="queue", backend="buffered") as ckpt:
        for i in range(4):
            ckpt.save(big_obj(48, i), os.path.join(disk_dir, f"{i}.pt"), on_commit=on_commit)
            with lock:
                events.append(("returned", f"{i}.pt"))
            assert len(ckpt._saves) <= 2
    order = events
    assert order.index(("returned", "1.pt")) < order.index(("commit", "0.pt")), order  # queued
    assert order.index(("commit", "0.pt")) < order.index(("returned", "2.pt")), order  # bounded
    assert [n for k, n in order if k == "commit"] == ["0.pt", "1.pt", "2.pt", "3.pt"]
    for i in range(4):
        got = fp_core.load(os.path.join(disk_dir, f"{i}.pt"), verify=True)
        assert got["meta"]["v"] == i and got["big"][0].item() == i


# ====================================================================== enqueue


def test_enqueue_runs_after_the_save_commits(disk_dir):
    old = os.path.join(disk_dir, "old.pt")
    new = os.path.join(disk_dir, "new.pt")
    fp_core.save({"x": 1}, old)
    seen = {}

    def rotate(p):
        seen["new_exists"] = os.path.exists(new)
        seen["new_ok"] = fp_core.verify(new)["bytes"] > 0
        os.remove(p)
        return "removed"

    with AsyncCheckpointer(backend="buffered") as ckpt:
        ckpt.save(big_obj(64), new)
        h = ckpt.enqueue(rotate, old)
        assert h.result(timeout=60) == "removed"
    assert seen == {"new_exists": True, "new_ok": True}
    assert not os.path.exists(old)


def test_enqueue_skipped_when_the_save_failed(disk_dir, fault):
    old = os.path.join(disk_dir, "old.pt")
    fp_core.save({"x": 1}, old)
    ran = []
    ckpt = AsyncCheckpointer(backend="buffered")
    try:
        fault("write", errno=errno.EIO)
        ckpt.save(big_obj(8), os.path.join(disk_dir, "new.pt"))
        h = ckpt.enqueue(lambda: ran.append(1) or os.remove(old))
        with pytest.raises(AsyncCheckpointError) as ei:
            h.result(timeout=60)
        chain, e = [], ei.value
        while e is not None:
            chain.append(e)
            e = e.__cause__
        assert any(isinstance(c, OSError) and c.errno == errno.EIO for c in chain), chain
        errors = 0
        for call in (ckpt.fence, ckpt.wait, ckpt.close):
            try:
                call()
            except AsyncCheckpointError:
                errors += 1
        assert errors <= 1
    finally:
        ckpt.close()
    assert ran == []
    assert os.path.exists(old)
    fp_core.verify(old)


def test_enqueue_after_explicit_handles(disk_dir):
    order = []
    with AsyncCheckpointer(max_in_flight=2, backend="buffered") as ckpt:
        h1 = ckpt.save(big_obj(32), os.path.join(disk_dir, "a.pt"), on_commit=lambda p, s: order.append("a"))
        j = ckpt.enqueue(order.append, "job", after=[h1])
        j.result(timeout=60)
    assert order == ["a", "job"]


# ====================================================================== close / context / on_commit


def test_close_drains_and_refuses_more(disk_dir):
    ckpt = AsyncCheckpointer(backend="buffered")
    paths = [os.path.join(disk_dir, f"{i}.pt") for i in range(2)]
    handles = [ckpt.save(big_obj(32, i), p) for i, p in enumerate(paths)]
    ckpt.close()
    assert all(h.done() for h in handles)
    assert not ckpt.pending()
    for i, p in enumerate(paths):
        assert fp_core.load(p, verify=True)["meta"]["v"] == i
    with pytest.raises(RuntimeError):
        ckpt.save({}, os.path.join(disk_dir, "late.pt"))
    ckpt.close()  # idempotent
    assert ckpt._thread is None


def test_context_manager_drains_and_does_not_mask_an_error(disk_dir):
    path = os.path.join(disk_dir, "cm.pt")
    with AsyncCheckpointer(backend="buffered") as ckpt:
        ckpt.save(big_obj(32), path)
        assert ckpt.pending() and ckpt.pending(path)
    assert not ckpt.pending(path)
    fp_core.verify(path)
    with pytest.raises(KeyError):
        with AsyncCheckpointer(backend="buffered") as ckpt:
            ckpt.save(big_obj(32, 2.0), path)
            raise KeyError("user error")
    assert fp_core.load(path)["meta"]["v"] == 2.0


def test_on_commit_sees_the_final_file(disk_dir):
    path = os.path.join(disk_dir, "c.pt")
    seen = {}

    def on_commit(p, stats):
        seen["path"] = p
        seen["exists"] = os.path.exists(p)
        seen["size"] = os.path.getsize(p) == stats.bytes
        seen["verify"] = fp_core.verify(p)["bytes"]
        seen["temps"] = [n for n in os.listdir(disk_dir) if n.endswith(".fptmp")]

    with AsyncCheckpointer(backend="buffered") as ckpt:
        ckpt.save(big_obj(16), path, on_commit=on_commit)
    assert seen["path"] == path
    assert seen["exists"] and seen["size"] and seen["verify"] > 0
    assert seen["temps"] == []


def test_on_commit_error_is_surfaced(disk_dir):
    def boom(p, s):
        raise ValueError("callback failed")

    ckpt = AsyncCheckpointer()
    ckpt.save({"x": torch.ones(3)}, os.path.join(disk_dir, "x.pt"), on_commit=boom)
    with pytest.raises(AsyncCheckpointError) as ei:
        ckpt.close()
    assert isinstance(ei.value.__cause__, ValueError)


def test_wait_for_and_pending(disk_dir):
    a, b = os.path.join(disk_dir, "a.pt"), os.path.join(disk_dir, "b.pt")
    with AsyncCheckpointer(max_in_flight=2, backend="buffered") as ckpt:
        ckpt.save(big_obj(32), a)
        ckpt.save(big_obj(8), b)
        ckpt.wait_for(a)
        assert not ckpt.pending(a)
        assert os.path.exists(a)
        ckpt.wait()
        assert not ckpt.pending()


# ====================================================================== resources


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_200_async_saves_do_not_grow(disk_dir, policy):
    obj = {"w": torch.randn(512 * 1024), "b": torch.randn(1000), "m": [1, 2]}
    path = os.path.join(disk_dir, "r.pt")
    with AsyncCheckpointer(policy=policy, max_in_flight=2, when_busy="queue") as ckpt:
        for _ in range(10):
            ckpt.save(obj, path)
        ckpt.wait()
        gc.collect()
        fds, threads, rss = fd_count(), thread_count(), rss_bytes()
        for i in range(200):
            h = ckpt.save(obj, path)
            if i % 50 == 0:
                ckpt.fence()
        ckpt.wait()
        assert h.result().bytes > 0
        gc.collect()
        assert fd_count() == fds
        assert thread_count() == threads
        grown = rss_bytes() - rss
        assert grown < 64 * MiB, f"RSS grew {grown / MiB:.1f} MiB over 200 async saves"
        assert len(ckpt._arenas) <= 2
    gc.collect()
    assert_no_temps(disk_dir)
    assert_identical(obj, fp_core.load(path, verify=True))


def test_checkpointers_are_independent_and_threads_stop(disk_dir):
    t0 = thread_count()
    cks = [AsyncCheckpointer() for _ in range(5)]
    for i, c in enumerate(cks):
        c.save({"x": torch.ones(10) * i}, os.path.join(disk_dir, f"{i}.pt"))
    for c in cks:
        c.close()
    gc.collect()
    assert thread_count() <= t0


def test_wait_for_raises_as_soon_as_the_handle_is_done(disk_dir, fault, monkeypatch):
    """The worker is preempted right after finishing a failed save's handle (emulated with a
    sleep): wait_for(path) must still raise, not return as if the save were durable."""
    call = "wait_for"
    orig = fp_core.Handle._finish

    def slow_finish(self, result=None, error=None):
        orig(self, result, error)
        time.sleep(0.2)

    monkeypatch.setattr(fp_core.Handle, "_finish", slow_finish)
    ckpt = AsyncCheckpointer(backend="buffered")
    raised = []
    try:
        path, h = _fail_one_save(ckpt, disk_dir, fault)
        try:
            ckpt.wait_for(path)
        except AsyncCheckpointError:
            raised.append(call)
    finally:
        try:
            ckpt.close()
        except AsyncCheckpointError:
            raised.append("close")
    assert raised == [call], f"the failed save of {path} was reported by {raised}"


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


def test_a_new_snapshot_arena_is_filled_by_the_writer_then_reused_inside_save(disk_dir):
    """The first snapshot faults its arena's pages in on the background writer, not
    inside save(); later saves reuse the arena and copy inside save()."""
    state = {"a": torch.randn(8 * MiB // 4), "b": torch.randn(4 * MiB // 4), "small": torch.arange(10)}
    big_bytes = 12 * MiB
    with AsyncCheckpointer(policy="snapshot") as ckpt:
        first = ckpt.save(state, os.path.join(disk_dir, "1.pt")).result()
        arena = ckpt._arenas[0]
        second = ckpt.save(state, os.path.join(disk_dir, "2.pt")).result()
        assert ckpt._arenas[0] is arena  # reused, not reallocated
    assert first.extra["at_save_bytes"] < big_bytes <= second.extra["at_save_bytes"]
    assert first.extra["snapshot_seconds"] > 0
    for name in ("1.pt", "2.pt"):
        fp_core.verify(os.path.join(disk_dir, name))
        assert_identical(state, fp_core.load(os.path.join(disk_dir, name), verify=True))


def _writer_idle(ckpt: AsyncCheckpointer) -> None:
    """Return once the writer has run every job queued so far (it runs them in order)."""
    ckpt.enqueue(lambda: None, after=[]).result()


def test_auto_writes_with_overlap_until_a_snapshot_arena_is_warm(disk_dir):
    """auto's first save does not wait for a fresh arena's pages: it writes with overlap
    and the writer warms an arena after it; the next save snapshots into warm pages."""
    from fp_core.tools.procinfo import resident_bytes
    state = {"a": torch.randn(8 * MiB // 4), "b": torch.randn(4 * MiB // 4), "small": torch.arange(10)}
    with AsyncCheckpointer() as ckpt:
        first = ckpt.save(state, os.path.join(disk_dir, "1.pt")).result()
        assert first.policy == "overlap" and first.extra["policy_reason"] == "snapshot arena not yet warm"
        assert not ckpt.pending()  # the warm-up (queued, running or done) is no pending write
        _writer_idle(ckpt)
        (arena,) = ckpt._arenas
        assert resident_bytes(arena.buf.data_ptr(), arena.buf.numel()) >= 0.95 * arena.buf.numel()  # pages in (prorated)
        second = ckpt.save(state, os.path.join(disk_dir, "2.pt")).result()
        third = ckpt.save(state, os.path.join(disk_dir, "3.pt")).result()
        bigger = dict(state, c=torch.randn(16 * MiB // 4))  # outgrows the arena: overlap again
        fourth = ckpt.save(bigger, os.path.join(disk_dir, "4.pt")).result()
        _writer_idle(ckpt)
        fifth = ckpt.save(bigger, os.path.join(disk_dir, "5.pt")).result()
    for st in (second, third, fifth):
        assert st.policy == "snapshot" and "policy_reason" not in st.extra
        assert st.extra["at_save_bytes"] >= 12 * MiB  # the copy ran inside save(), into warm pages
    assert fourth.policy == "overlap"
    for name, obj in (("1.pt", state), ("2.pt", state), ("3.pt", state), ("4.pt", bigger), ("5.pt", bigger)):
        assert_identical(obj, fp_core.load(os.path.join(disk_dir, name), verify=True))


def test_wait_skips_an_arena_warm_up_not_yet_begun(disk_dir):
    """A warm-up still queued when wait() drains is dropped (durability does not need
    it); the next save asks for it again."""
    state = {"a": torch.randn(8 * MiB // 4)}
    with AsyncCheckpointer() as ckpt:
        gate = threading.Event()
        ckpt.enqueue(gate.wait, after=[])  # holds the writer: the save and its warm-up queue behind
        first = ckpt.save(state, os.path.join(disk_dir, "1.pt"))
        waiter = threading.Thread(target=ckpt.wait)
        waiter.start()
        while not ckpt._draining:
            time.sleep(0.001)
        gate.set()
        waiter.join(30)
        assert not waiter.is_alive() and first.result().policy == "overlap"
        second = ckpt.save(state, os.path.join(disk_dir, "2.pt")).result()
        assert second.policy == "overlap"  # no warm arena: the warm-up was skipped
        _writer_idle(ckpt)
        assert ckpt.save(state, os.path.join(disk_dir, "3.pt")).result().policy == "snapshot"


def test_auto_snapshots_a_save_queued_behind_another(disk_dir):
    """With a save in flight (when_busy="queue"), auto keeps the snapshot for the next
    one: under overlap its fence would wait until the write queued before it is done."""
    state = {"a": torch.randn(8 * MiB // 4)}
    with AsyncCheckpointer(when_busy="queue") as ckpt:
        gate = threading.Event()
        ckpt.enqueue(gate.wait, after=[])
        first = ckpt.save(state, os.path.join(disk_dir, "1.pt"))
        second = ckpt.save(state, os.path.join(disk_dir, "2.pt"))
        gate.set()
        assert first.result().policy == "overlap" and second.result().policy == "snapshot"
    for name in ("1.pt", "2.pt"):
        assert_identical(state, fp_core.load(os.path.join(disk_dir, name), verify=True))


def test_auto_stays_on_overlap_when_no_arena_can_be_had(disk_dir, monkeypatch, caplog):
    """No memory for an arena: one warning, the saves go on with overlap, no retries."""
    import fp_core.pipeline as pipeline

    tries = []

    class NoMemory:
        def __init__(self, nbytes, pin, huge=False):
            tries.append(nbytes)
            raise MemoryError(f"cannot allocate {nbytes} bytes")

    monkeypatch.setattr(pipeline, "Arena", NoMemory)
    state = {"a": torch.randn(8 * MiB // 4)}
    with caplog.at_level("WARNING", logger="fastpersist"), AsyncCheckpointer() as ckpt:
        for i in range(3):
            assert ckpt.save(state, os.path.join(disk_dir, f"{i}.pt")).result().policy == "overlap"
            _writer_idle(ckpt)
    assert len(tries) == 1
    assert [r.getMessage() for r in caplog.records if "snapshot arena" in r.getMessage()] == [
        f"fastpersist: could not prepare a {tries[0]}-byte snapshot arena (MemoryError: cannot allocate "
        f"{tries[0]} bytes); auto keeps the overlap policy"]
    for i in range(3):
        assert_identical(state, fp_core.load(os.path.join(disk_dir, f"{i}.pt"), verify=True))


# ====================================================================== huge pages


def _needs_thp() -> None:
    from fp_core.tools.procinfo import thp_mode
    if thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {thp_mode()!r} on this machine")


def _isolated(nbytes: int, keep: list) -> torch.Tensor:
    """A uint8 tensor on a private mapping of its own, starting off a 2 MiB boundary, so
    its advised interior is one mapping whose AnonHugePages in smaps are exactly its own
    (heap memory shares mappings with earlier tests' huge pages)."""
    import mmap
    mm = mmap.mmap(-1, nbytes + 8 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    keep.append(mm)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = -whole.data_ptr() % (2 * MiB) + 2 * MiB + 4096
    return whole[start:start + nbytes]


def _interior(t: torch.Tensor) -> int:
    a, n = t.data_ptr(), t.numel() * t.element_size()
    return max(0, (a + n) // (2 * MiB) * 2 * MiB - -(-a // (2 * MiB)) * 2 * MiB)


def test_advise_huge_collapses_memory_in_use_and_keeps_its_bytes():
    from fp_core import _native
    from fp_core.tools.procinfo import huge_page_bytes
    _needs_thp()
    keep: list = []
    t = _isolated(16 * MiB + 12345, keep)
    t.random_()
    before = t.clone()
    inner = _interior(t)
    assert _native.advise_huge(t.data_ptr(), 100) == 0  # no whole 2 MiB page inside
    covered = _native.advise_huge(t.data_ptr(), t.numel(), collapse=True)
    if covered == 0:
        pytest.skip("the kernel declined MADV_COLLAPSE (Linux < 6.1?)")
    assert covered == inner >= 14 * MiB
    assert huge_page_bytes(t.data_ptr(), t.numel()) >= 0.9 * inner
    assert torch.equal(t, before)


@pytest.mark.parametrize("huge", [True, False], ids=["collapse", "default"])
def test_overlap_moves_live_tensors_onto_huge_pages_once_when_asked(disk_dir, huge):
    from fp_core.tools.procinfo import huge_page_bytes
    _needs_thp()
    keep: list = []
    model = torch.nn.Linear(2048, 2048)  # a 16 MiB weight, written in place under overlap
    with torch.no_grad():
        model.weight.data = _isolated(16 * MiB, keep).view(torch.float32).view(2048, 2048).copy_(model.weight)
    w = model.weight
    path = os.path.join(disk_dir, "live.pt")
    with AsyncCheckpointer(policy="overlap", collapse_live_tensors=huge) as ckpt:
        expected = copy.deepcopy(model.state_dict())
        ckpt.save(model.state_dict(), path).result()
        ckpt.wait_huge_pages()
        moved = ckpt.huge_page_bytes
        ckpt.save(model.state_dict(), path).result()  # the same storages: not asked again
        ckpt.wait_huge_pages()
        assert ckpt.huge_page_bytes == moved
    assert_identical(expected, torch.load(path, weights_only=True))
    assert_identical(expected, model.state_dict())  # contents untouched by the move
    inner = _interior(w)
    if huge:
        if moved == 0:
            pytest.skip("the kernel declined MADV_COLLAPSE (Linux < 6.1?)")
        assert moved >= inner
        assert huge_page_bytes(w.data_ptr(), w.numel() * 4) >= 0.9 * inner
    else:
        # nothing asked (the pages may still be huge: reused heap memory keeps its backing)
        assert moved == 0


@pytest.mark.parametrize("huge", [True, False])
def test_snapshot_arena_is_on_huge_pages(disk_dir, huge):
    from fp_core.tools.procinfo import huge_page_bytes
    _needs_thp()
    obj = big_obj(32)
    path = os.path.join(disk_dir, "snap.pt")
    with AsyncCheckpointer(policy="snapshot", huge_pages=huge) as ckpt:
        for _ in range(2):  # the first fill (background) and a reuse (inside save())
            ckpt.save(obj, path).result()
        arena = ckpt._arenas[0]
        if huge:
            assert arena.buf.data_ptr() % (2 * MiB) == 0
            assert arena.huge_bytes >= 30 * MiB
            assert huge_page_bytes(arena.buf.data_ptr(), arena.buf.numel()) >= 0.9 * arena.huge_bytes
        else:
            assert arena.huge_bytes == 0  # not advised (THP "always" may still back it)
        assert ckpt.huge_page_bytes == 0  # the live tensor was copied, not moved
    assert_identical(obj, torch.load(path, weights_only=True))


# ---------------------------------------------------------------- memory freed under a write

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
    from fp_core import memory_guard

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
    from fp_core.pipeline import _LiveMemory
    from fp_core.plan import build

    t = torch.ones(2 << 20)
    plan = build({"t": t})
    live = _LiveMemory(plan.storages, threading.Event())
    torch.ops.aten.resize_(t, [8 << 20])  # reallocates in C++: new address and size
    with pytest.raises(CheckpointError, match="freed or resized"):
        live.release(os.path.join(disk_dir, "x.pt"), plan)
    assert live.released.is_set()
    live.close()
