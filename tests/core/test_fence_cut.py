"""The overlap fence that copies only what is still unwritten (fp_core.pipeline.fence_cut): the
protocol between writer and fence, and the pipeline's checkpoints with it (real files)."""

from __future__ import annotations

import copy
import os
import threading
import time

import numpy as np
import pytest
import torch
from conftest import MiB, assert_identical, assert_no_temps

import fp_core
from fp_core import AsyncCheckpointer, _native
from fp_core.pipeline.fence_cut import FenceCut, cut_ranges


def _state(n: int = 24, mib: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(mib * MiB // 4, generator=g) for i in range(n)}


def _plan(disk_dir, obj):
    job = fp_core.prepare(obj, os.path.join(disk_dir, "p.pt"))
    return job


def test_ranges_cover_the_file_in_order_with_the_tail_last(disk_dir):
    job = _plan(disk_dir, _state())
    try:
        plan = job.plan
        ranges = cut_ranges(plan)
        assert ranges[0][0] == 0 and ranges[-1] == (plan.tail_start, plan.file_size)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(lo % plan.alignment == 0 for lo, _ in ranges)
        assert 2 <= len(ranges) <= 18
    finally:
        job.abort()


@pytest.mark.parametrize("writer_delay", [0.0, 0.002, 0.02])
def test_writer_and_fence_never_claim_the_same_batch(disk_dir, writer_delay):
    """A writer thread walks the batches forwards while the fence copies from the back: each
    batch is read by one side, and when the fence returns nothing unwritten reads live memory."""
    job = _plan(disk_dir, _state())
    try:
        cut = FenceCut(job.plan)
        n = len(cut.ranges)
        live, copied, finished_live = [], [], set()
        lock = threading.Lock()
        start = threading.Event()

        def writer():
            start.wait()
            for i in range(n):
                cut.claim(i)
                with lock:
                    from_copies = all(s.host is not None for s in cut.members[i])
                    if not from_copies or not cut.members[i]:
                        live.append(i)
                time.sleep(writer_delay)
                with lock:
                    finished_live.add(i)
                cut.done(i)
            cut.finish()

        def copy_fn(todo):
            for s in todo:
                s.host = s.source.clone()
            with lock:
                copied.append([s.offset for s in todo])
            return True

        t = threading.Thread(target=writer)
        t.start()
        start.set()
        cut.open(copy_fn)
        with lock:
            live_at_open = list(live)
            done_at_open = set(finished_live)
        # every batch the writer read live was finished before the fence opened
        assert set(live_at_open) <= done_at_open
        t.join()
        # the fence copied from the back: copied batches are a suffix of the ones with storages
        if copied:
            firsts = [min(offs) for offs in copied if offs]
            assert firsts == sorted(firsts, reverse=True)
    finally:
        for s in job.plan.storages:
            s.host = None
        job.abort()


def test_finish_opens_a_waiting_fence(disk_dir):
    """A writer that fails (finish without writing) never leaves the fence waiting."""
    job = _plan(disk_dir, _state())
    try:
        cut = FenceCut(job.plan)
        cut.claim(0)  # the writer holds the first batch live...
        threading.Timer(0.1, cut.finish).start()  # ...then fails
        t0 = time.perf_counter()
        cut.open(lambda todo: False)  # no room to copy: wait for the writer
        assert time.perf_counter() - t0 < 5
    finally:
        job.abort()


def _blocked(ckpt: AsyncCheckpointer) -> threading.Event:
    """Hold the writer: the next save stays queued until the event is set."""
    gate = threading.Event()
    ckpt.enqueue(gate.wait)
    return gate


@pytest.mark.parametrize("budget", [None, 20 * MiB])
def test_fence_copies_what_is_unwritten_and_the_file_holds_the_state_at_save(disk_dir, budget):
    state = _state()
    expected = copy.deepcopy(state)
    path = os.path.join(disk_dir, "cut.pt")
    opts = {} if budget is None else {"snapshot_budget_bytes": budget}
    with AsyncCheckpointer(policy="overlap", install_optimizer_hook=False, **opts) as ckpt:
        gate = _blocked(ckpt)
        h = ckpt.save(state, path)
        if budget is not None:
            threading.Timer(0.3, gate.set).start()  # the rest is the writer's: the fence waits for it
        t0 = time.perf_counter()
        ckpt.fence()
        fenced = time.perf_counter() - t0
        for t in state.values():
            t.fill_(-1.0)  # the optimizer step after the fence
        gate.set()
        st = h.result()
    total = sum(t.numel() * 4 for t in expected.values())
    if budget is None:
        assert st.extra["fence_copied_bytes"] == total  # nothing was written: all of it copied
    else:
        assert 0 < st.extra["fence_copied_bytes"] <= budget and fenced >= 0.25
        # the host memory it kept is the budget's, not the checkpoint's
        assert all(a.buf.numel() <= budget + MiB for a in ckpt._arenas)
    fp_core.verify(path)
    assert_identical(expected, fp_core.load(path, verify=True))
    assert_no_temps(disk_dir)


def test_fence_cut_off_waits_for_the_write(disk_dir):
    state = _state(n=4)
    path = os.path.join(disk_dir, "nocut.pt")
    with AsyncCheckpointer(policy="overlap", install_optimizer_hook=False, fence_copies_rest=False) as ckpt:
        gate = _blocked(ckpt)
        h = ckpt.save(state, path)
        threading.Timer(0.2, gate.set).start()
        ckpt.fence()
        assert h._staged.is_set()
        st = h.result()
    assert "fence_copied_bytes" not in st.extra


def test_a_write_failing_after_the_cut_fails_the_save_and_leaves_nothing(disk_dir):
    state = _state()
    path = os.path.join(disk_dir, "fail.pt")
    ckpt = AsyncCheckpointer(policy="overlap", install_optimizer_hook=False)
    try:
        gate = _blocked(ckpt)
        h = ckpt.save(state, path)
        ckpt.fence()  # copies everything
        _native.inject_fault("write", errno=5, after_bytes=8 * MiB)
        gate.set()
        with pytest.raises(fp_core.AsyncCheckpointError, match="Input/output error") as e:
            h.result()
        assert isinstance(e.value.__cause__, OSError)
    finally:
        _native.inject_fault(None)
        try:
            ckpt.close()
        except Exception:  # noqa: BLE001 - the failure above, raised again at close
            pass
    assert not os.path.exists(path)
    assert_no_temps(disk_dir)


def test_a_failure_recorded_while_the_write_runs_is_raised_before_publishing(disk_dir):
    """The fence runs on another thread than the writer: a failure it records (a storage
    resized under it) must stop the publish even though the write was already under way."""
    path = os.path.join(disk_dir, "late.pt")
    job = fp_core.prepare(_state(n=4), path)
    with pytest.raises(RuntimeError, match="boom"):
        job.run(on_body_written=lambda: job.fail(RuntimeError("boom")))
    assert not os.path.exists(path)
    assert_no_temps(disk_dir)


def test_only_a_layout_congruent_to_the_addresses_gets_a_fence_that_copies(disk_dir):
    """The checksums taken inside save() are keyed by ranges cut at the tensors' addresses,
    and the writer cuts a fence copy's at its arena slot (congruent to the file offset):
    a plan laid out otherwise (an auto save expecting a snapshot) must keep the waiting
    fence, or a copy of bytes changed before the fence would be checksummed anew."""
    # At page + 64, as torch usually places a large tensor; not left to the allocator,
    # which now and then hands out a page-aligned block (congruent to any layout).
    n = (5 * MiB + 7) * 4
    raw = np.empty(n + 8192, dtype=np.uint8)
    at = (-raw.ctypes.data) % 4096 + 64
    state = {"b": torch.from_numpy(raw[at:at + n]).view(torch.float32).fill_(3.0)}
    assert state["b"].untyped_storage().data_ptr() % 4096 == 64
    with AsyncCheckpointer(install_optimizer_hook=False) as ckpt:
        for congruent, can_copy in ((True, True), (False, False)):
            job = fp_core.prepare(state, os.path.join(disk_dir, f"c{congruent}.pt"), congruent=congruent)
            try:
                (st,) = job.plan.storages
                assert (st.offset % 4096 == st.addr() % 4096) is congruent
                assert ckpt._fence_can_copy(job) is can_copy
            finally:
                job.abort()
    assert_no_temps(disk_dir)
