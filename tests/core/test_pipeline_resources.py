"""AsyncCheckpointer's resources: many async saves leak no file descriptors, threads or memory;
checkpointers stop their threads; the writer runs at a lower priority."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from conftest import MiB, assert_identical, assert_no_temps, fd_count, rss_bytes, thread_count

import fp_core
from fp_core import AsyncCheckpointer


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
