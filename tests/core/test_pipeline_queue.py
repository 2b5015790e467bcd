"""AsyncCheckpointer's queue: the bound on saves in flight (when_busy wait / queue), enqueue()d jobs,
close() and the context manager draining, on_commit, wait_for() and pending()."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
from _util import big_obj

import fp_core
from fp_core import AsyncCheckpointer, AsyncCheckpointError

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


@pytest.mark.parametrize("failed_before_queued", [False, True])
def test_enqueue_skipped_when_the_save_failed(disk_dir, fault, failed_before_queued):
    old = os.path.join(disk_dir, "old.pt")
    fp_core.save({"x": 1}, old)
    ran = []
    ckpt = AsyncCheckpointer(backend="buffered")
    try:
        fault("write", errno=errno.EIO)
        saved = ckpt.save(big_obj(8), os.path.join(disk_dir, "new.pt"))
        if failed_before_queued:  # the save has ended, no longer pending, its failure raised to nobody
            assert isinstance(saved.exception(timeout=60), OSError)
            assert not ckpt.pending()
        h = ckpt.enqueue(lambda: ran.append(1) or os.remove(old))
        with pytest.raises(AsyncCheckpointError, match="skipped") as ei:
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


def test_a_failure_already_raised_is_not_raised_again_by_the_job_skipped_behind_it(disk_dir, fault, caplog):
    """A save fails, a fence raises it; a job queued behind the save (while it was pending)
    runs later and is skipped: its handle says so, but wait() does not raise the same
    failure a second time (it logs the skip)."""
    old = os.path.join(disk_dir, "old.pt")
    fp_core.save({"x": 1}, old)
    gate = threading.Event()
    ckpt = AsyncCheckpointer(backend="buffered")
    try:
        fault("write", errno=errno.EIO)
        saved = ckpt.save(big_obj(8), os.path.join(disk_dir, "new.pt"))
        ckpt.enqueue(gate.wait, 60, after=[])  # unrelated work between the save and the removal
        removal = ckpt.enqueue(os.remove, old)  # queued behind the pending save
        assert isinstance(saved.exception(timeout=60), OSError)
        with pytest.raises(AsyncCheckpointError, match="EIO|Input/output"):
            ckpt.fence()  # the failure, raised once
        gate.set()
        with caplog.at_level(logging.WARNING, logger="fastpersist"):
            ckpt.wait()  # not raised again
        assert any("skipped" in r.getMessage() for r in caplog.records)
        with pytest.raises(AsyncCheckpointError, match="skipped"):  # its own handle still says so
            removal.result(timeout=60)
    finally:
        gate.set()
        ckpt.close()
    assert os.path.exists(old)


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


@pytest.mark.parametrize("failed_before_queued", [False, True])
def test_a_job_queued_as_a_save_is_waited_for_like_one(tmp_path, failed_before_queued):
    # Lightning's FSDP1 saves are jobs (enqueue(save=True)): a removal queued with the default
    # `after` waits for one still running, and is skipped when it failed, reported or not yet.
    old = tmp_path / "old.pt"
    old.write_bytes(b"x")
    release = threading.Event()

    def save() -> None:
        release.wait(60)
        raise OSError(errno.ENOSPC, "No space left on device")

    ckpt = AsyncCheckpointer()
    try:
        job = ckpt.enqueue(save, save=True)
        if failed_before_queued:
            release.set()
            assert isinstance(job.exception(timeout=60), OSError)
            assert not ckpt.pending()
        removal = ckpt.enqueue(os.remove, str(old))
        release.set()
        with pytest.raises(AsyncCheckpointError, match="skipped") as ei:
            removal.result(timeout=60)
        assert isinstance(ei.value.__cause__, OSError)
        assert old.exists()
        ckpt.wait()  # reported through the removal's handle
    finally:
        ckpt.close()


def test_raise_failures_of_saves_only_leaves_other_failures_for_the_next_report(tmp_path):
    ckpt = AsyncCheckpointer()
    try:
        def upload() -> None:
            raise ConnectionError("store unreachable")

        job = ckpt.enqueue(upload)
        assert isinstance(job.exception(timeout=60), ConnectionError)
        ckpt.raise_failures(saves_only=True)  # not a save: nothing raised, nothing dropped
        with pytest.raises(AsyncCheckpointError, match="store unreachable"):
            ckpt.raise_failures()
        ckpt.raise_failures()  # reported once
    finally:
        ckpt.close()
