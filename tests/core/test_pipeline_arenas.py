"""AsyncCheckpointer's snapshot arenas: filled by the writer first, then reused inside save(); how
the auto policy waits for a warm arena, and keeps overlap when none can be had."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from conftest import MiB, assert_identical

import fp_core
from fp_core import AsyncCheckpointer


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


def test_each_file_of_a_checkpoint_gets_a_warm_arena_of_its_size(disk_dir, monkeypatch):
    """An HF checkpoint saves a model and its (twice as large) optimizer state back to back
    (max_in_flight above 1): the first checkpoint asks an arena warm-up for each, and from
    the second on each file snapshots into a warm arena of its size, none faulted in inside
    save() (the model taking the optimizer's arena left the optimizer a fresh one there)."""
    import fp_core.pipeline.checkpointer

    made: list[tuple[str, int]] = []
    real = fp_core.pipeline.checkpointer.Arena

    def arena(nbytes, pin, huge=False):
        made.append((threading.current_thread().name, nbytes))
        return real(nbytes, pin, huge=huge)

    monkeypatch.setattr(fp_core.pipeline.checkpointer, "Arena", arena)
    model = {"w": torch.randn(4 * MiB // 4), "b": torch.randn(6 * MiB // 4)}
    optim = {"m": torch.randn(8 * MiB // 4), "v": torch.randn(12 * MiB // 4)}
    stats = []
    with AsyncCheckpointer(max_in_flight=8) as ckpt:
        for step in range(3):
            made.clear()
            for name, state in (("model", model), ("optim", optim)):
                stats.append((step, name, ckpt.save(state, os.path.join(disk_dir, f"{name}{step}.pt"))))
            for _, _, h in stats[-2:]:
                h.result()
            _writer_idle(ckpt)  # and its arenas' warm-ups (wait() would skip those not begun)
            if step:
                assert all(thread != "MainThread" for thread, _ in made), f"arenas made inside save(): {made}"
        assert len(ckpt._arenas) == 2
    policies = {(step, name): h.result().policy for step, name, h in stats}
    assert policies == {(0, "model"): "overlap", (0, "optim"): "overlap", (1, "model"): "snapshot",
                        (1, "optim"): "snapshot", (2, "model"): "snapshot", (2, "optim"): "snapshot"}
    for step in range(3):
        assert_identical(optim, fp_core.load(os.path.join(disk_dir, f"optim{step}.pt"), verify=True))


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


@pytest.mark.parametrize("copies_rest", [True, False])
def test_auto_with_a_save_queued_behind_another(disk_dir, copies_rest):
    """With a save in flight (when_busy="queue") and no warm arena, auto writes the next
    one with overlap too: its fence copies it whole while the writer is still busy (a
    snapshot would hold the fence for a fresh arena's page faults). Without the fence's
    copy (fence_copies_rest=False) it keeps the snapshot: the overlap fence would wait
    until the write queued before it is done."""
    state = {"a": torch.randn(8 * MiB // 4)}
    with AsyncCheckpointer(when_busy="queue", fence_copies_rest=copies_rest, install_optimizer_hook=False) as ckpt:
        gate = threading.Event()
        ckpt.enqueue(gate.wait, after=[])
        first = ckpt.save(state, os.path.join(disk_dir, "1.pt"))
        second = ckpt.save(state, os.path.join(disk_dir, "2.pt"))
        if copies_rest:
            ckpt.fence()  # returns with the writer still held: both saves were copied
            assert not first.done() and not second.done()
        gate.set()
        want = ("overlap", "overlap") if copies_rest else ("overlap", "snapshot")
        assert (first.result().policy, second.result().policy) == want
        if copies_rest:
            assert second.result().extra["fence_copied_bytes"] == 8 * MiB
    for name in ("1.pt", "2.pt"):
        assert_identical(state, fp_core.load(os.path.join(disk_dir, name), verify=True))


def test_auto_stays_on_overlap_when_no_arena_can_be_had(disk_dir, monkeypatch, caplog):
    """No memory for an arena: one warning, the saves go on with overlap, no retries."""
    import fp_core.pipeline.checkpointer as pipeline

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


def test_a_copy_alone_keeps_the_checksums_an_extent_had(disk_dir):
    """stage_cpu(checksum=False), the fence's copy: the bytes are copied and each extent
    keeps the checksums it had (those taken inside save(), or none: the writer's then)."""
    from fp_core.format.plan import StorageExtent
    from fp_core.io.writer import stage_cpu

    src = torch.randn(3 * MiB // 4)
    dst = torch.zeros_like(src)
    ext = StorageExtent(src.data_ptr() % 4096, src.numel() * 4, src.untyped_storage(), 0)
    stage_cpu([ext], [dst.view(torch.uint8).view(-1)], checksum=False)
    assert torch.equal(dst, src) and ext.host_crcs is None and ext.host is not None
    stage_cpu([ext])  # checksums of the source, as save() takes them
    taken = dict(ext.host_crcs)
    src.add_(1.0)
    stage_cpu([ext], [dst.view(torch.uint8).view(-1)], checksum=False)
    assert torch.equal(dst, src) and ext.host_crcs == taken  # not the changed bytes' checksums
    with pytest.raises(ValueError):
        stage_cpu([ext], None, checksum=False)


def test_a_new_arena_for_small_copies_made_inside_save_is_on_4k_pages(disk_dir):
    """An overlap save copies its small tensors inside save(), on the training thread: a new
    arena for them is not advised onto huge pages (a fresh huge page faults in far slower,
    as the fence's arena); arenas the writer warms are."""
    small = {f"b{i}": torch.randn(64 * 1024) for i in range(48)}  # 256 KiB each: copied at save
    with AsyncCheckpointer(policy="overlap") as ckpt:
        st = ckpt.save(dict(small, big=torch.randn(4 * MiB)), os.path.join(disk_dir, "o.pt")).result()
        (arena,) = ckpt._arenas
    assert st.extra["at_save_bytes"] >= 48 * 256 * 1024
    assert arena.huge_bytes == 0
    with AsyncCheckpointer() as ckpt:  # auto: the arena warmed on the writer for the snapshots
        ckpt.save(dict(small, big=torch.randn(4 * MiB)), os.path.join(disk_dir, "a.pt")).result()
        _writer_idle(ckpt)
        warmed = max(ckpt._arenas, key=lambda a: a.buf.numel())
    from fp_core import _native
    probe = _native.advise_huge(warmed.buf.data_ptr(), warmed.buf.numel())  # 0 where THP is off
    assert warmed.huge_bytes == probe
