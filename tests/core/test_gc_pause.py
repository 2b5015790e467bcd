"""gc_paused: the collector is off while a save serialises and a load unpickles, and exactly as the user left it afterwards."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

import fp_core
from fp_core.gc_pause import gc_paused


class _Probe:
    """Records whether the collector ran automatically while it was being pickled."""

    seen: list[bool] = []

    def __reduce__(self):
        _Probe.seen.append(gc.isenabled())
        return (_Probe, ())


@pytest.fixture
def restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_nested_pauses_resume_once_and_errors_resume_too(restore_gc):
    gc.enable()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_user_disabled_stays_disabled(restore_gc):
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_on_threads_resume_after_the_last(restore_gc):
    gc.enable()
    inside, release = threading.Barrier(3), threading.Event()

    def hold():
        with gc_paused():
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert not gc.isenabled()
    release.set()
    for t in threads:
        t.join()
    assert gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_save_pickles_with_the_collector_paused_and_restores_it(disk_dir, restore_gc, enabled):
    (gc.enable if enabled else gc.disable)()
    _Probe.seen.clear()
    path = os.path.join(disk_dir, "probe.pt")
    fp_core.save({"w": torch.ones(3), "probe": _Probe()}, path)
    assert _Probe.seen == [False]
    assert gc.isenabled() is enabled
    assert isinstance(torch.load(path, weights_only=False)["probe"], _Probe)


def test_a_save_keeps_no_storage_alive_for_the_collector(disk_dir, restore_gc):
    """The pickler's memo references every storage it reduced; were the pickler part of a
    reference cycle, the checkpoint's memory would stay held after the save until a
    collection happened to run."""
    from torch.multiprocessing.reductions import StorageWeakRef

    gc.disable()
    state = {"w": torch.randn(1000), "b": torch.randn(10)}
    refs = [StorageWeakRef(t.untyped_storage()) for t in state.values()]
    fp_core.save(state, os.path.join(disk_dir, "freed.pt"))
    del state
    assert all(r.expired() for r in refs)


@pytest.mark.parametrize("paused_up_to", [None, 1 << 20])
def test_a_save_written_early_on_a_thread_runs_whole_within_the_pause(disk_dir, restore_gc, monkeypatch, paused_up_to):
    """A save large enough to be written while it is pickled (the early write's thread
    allocates its books during the write): no collection runs anywhere in the process
    while that thread writes, up to GC_PAUSED_SAVE_BYTES; above that, only the
    serialisation is paused."""
    import fp_core.api
    from fp_core.saving import early_write

    if paused_up_to is not None:
        monkeypatch.setattr(fp_core.api, "GC_PAUSED_SAVE_BYTES", paused_up_to)
    # 288 MiB: above the bound this pause had before it covered the write (256 MiB)
    state = {f"w{i}": torch.zeros(early_write.MIN_BYTES // 4) for i in range(9)}
    state.update({f"b{i}": torch.randn(16) for i in range(500)})
    collections: list[str] = []

    def seen(phase, info):  # a collection while the early write's thread is writing
        if phase == "start" and any(t.name == "fastpersist-early-write" for t in threading.enumerate()):
            collections.append(threading.current_thread().name)

    old = gc.get_threshold()
    gc.enable()
    gc.set_threshold(50, 1, 1)  # a collection every few allocations wherever the collector runs
    gc.callbacks.append(seen)
    try:
        st = fp_core.save(state, os.path.join(disk_dir, "big.pt"))
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*old)
    assert gc.isenabled()
    assert st.bytes > 2 * early_write.MIN_BYTES
    if paused_up_to is None:
        assert collections == [], f"collections ran during the save: {collections[:5]}"
    else:
        assert collections, "above the bound the write runs with the collector on (the test would be blind)"
    fp_core.verify(os.path.join(disk_dir, "big.pt"))


class _LoadProbe:
    """Records whether the collector ran automatically while it was being unpickled."""

    seen: list[bool] = []

    def __init__(self) -> None:
        _LoadProbe.seen.append(gc.isenabled())

    def __reduce__(self):
        return (_LoadProbe, ())


@pytest.mark.parametrize("how", ["load", "load mmap", "load_into"])
@pytest.mark.parametrize("enabled", [True, False])
def test_loads_unpickle_with_the_collector_paused_and_restore_it(disk_dir, restore_gc, enabled, how):
    """A load builds a large state's objects (the zip directory's entries, the unpickled
    structure); a full collection among them cost load_into more than building them."""
    path = os.path.join(disk_dir, "probe.pt")
    fp_core.save({"w": torch.ones(3), "probe": _LoadProbe()}, path)
    (gc.enable if enabled else gc.disable)()
    _LoadProbe.seen.clear()
    if how == "load_into":
        out = fp_core.load_into({"w": torch.empty(3), "probe": None}, path, weights_only=False)
    else:
        out = fp_core.load(path, weights_only=False, mmap=how == "load mmap")
    assert isinstance(out["probe"], _LoadProbe) and torch.equal(out["w"], torch.ones(3))
    assert _LoadProbe.seen == [False]
    assert gc.isenabled() is enabled


def test_a_child_forked_during_a_pause_on_another_thread_collects_again(restore_gc):
    """A DataLoader worker forked while a load on another thread holds the pause: the child
    has no such thread, so its collector is back as the user left it, and later pauses in
    it pause and resume."""
    from fp_core import gc_pause

    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def hold():
        with gc_paused():
            inside.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    inside.wait()
    assert not gc.isenabled()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ok = gc.isenabled() and gc_pause._depth == 0
        with gc_paused():
            ok = ok and not gc.isenabled()
        ok = ok and gc.isenabled()
        os._exit(0 if ok else 1)
    release.set()
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
