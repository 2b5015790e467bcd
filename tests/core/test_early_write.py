"""A sync save writes a plain state's storages while it pickles (fp_core.saving.early_write): the
file is a standard torch file with the storages' records first, read the same by every
reader, and a state that changes meanwhile, a failing pickle or a failing write lose nothing."""

from __future__ import annotations

import collections
import errno
import os
import threading
import types

import pytest
import torch
from conftest import assert_identical

import fp_core
from fp_core import load_into
from fp_core.format import plan as plan_mod
from fp_core.saving import early_write

MiB = 1 << 20


@pytest.fixture
def early_from_1mib(monkeypatch):
    """Early writes for states from 1 MiB (the default threshold keeps them for large ones)."""
    monkeypatch.setattr(early_write, "MIN_BYTES", 1 * MiB)


def _state() -> dict:
    torch.manual_seed(0)
    model = collections.OrderedDict((f"layer{i}.{k}", torch.randn(n)) for i in range(200)
                                    for k, n in (("weight", 3000), ("bias", 7)))
    model._metadata = {"": {"version": 1}}
    shared = torch.randn(1000)
    return {"model": model, "big": torch.randn(5 * MiB // 4 + 3),  # ends off a block: split by the early range
            "tied": [shared, shared[10:20]], "ints": torch.arange(333, dtype=torch.int64), "step": 7,
            "empty": torch.empty(0), "name": "run"}


def _names(path: str) -> list[str]:
    return torch._C.PyTorchFileReader(path).get_all_records()


def _first_record(path: str) -> str:
    import zipfile

    with zipfile.ZipFile(path) as z:
        return z.infolist()[0].filename


def test_storages_first_file_reads_the_same_every_way(disk_dir, early_from_1mib):
    state = _state()
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    assert _first_record(path).endswith("/data/0")  # the storages were laid out (and written) first
    stock = os.path.join(disk_dir, "stock.pt")
    torch.save(state, stock)
    ours, theirs = torch._C.PyTorchFileReader(path), torch._C.PyTorchFileReader(stock)
    assert ours.get_record("data.pkl") == theirs.get_record("data.pkl")  # torch's pickle, byte for byte
    assert sorted(_names(path)) == sorted(_names(stock) + [".fastpersist/manifest.json"])
    for got in (torch.load(path), torch.load(path, weights_only=True), torch.load(path, mmap=True),
                fp_core.load(path, verify=True), fp_core.load(path, mmap=True, verify=True)):
        assert_identical(state, got)
        assert got["model"]._metadata == state["model"]._metadata
    fp_core.verify(path)
    target = _state()
    for t in target["model"].values():
        t.zero_()
    target["big"].zero_()
    load_into(target, path, verify=True)
    assert_identical(state["model"], target["model"])
    assert torch.equal(state["big"], target["big"])


def _layout(path: str) -> tuple[int, list[tuple[str, int]]]:
    import zipfile

    with zipfile.ZipFile(path) as z:
        return os.path.getsize(path), [(i.filename, i.header_offset) for i in z.infolist()]


def test_small_states_are_laid_out_as_without_it(disk_dir):
    state = {f"t{i}": torch.randn(100 + i) for i in range(300)}  # far below early_write.MIN_BYTES
    path, plain = os.path.join(disk_dir, "s.pt"), os.path.join(disk_dir, "plain.pt")
    fp_core.save(state, path)
    fp_core.prepare(state, plain).run()  # no early write
    assert _layout(path) == _layout(plain)
    assert _first_record(path).endswith("/data.pkl")


def test_a_large_tensor_then_thousands_of_small_ones_is_laid_out_as_without_it(disk_dir):
    """The storage alignment is decided on the storages found first; where the whole state
    decides otherwise (packed, for thousands of small tensors), the file is laid out anew."""
    torch.manual_seed(3)
    state = {"big": torch.randn(early_write.MIN_BYTES // 4 + 1000)}
    state.update({f"small{i}": torch.randn(100) for i in range(20_000)})
    path, plain = os.path.join(disk_dir, "s.pt"), os.path.join(disk_dir, "plain.pt")
    fp_core.save(state, path)
    fp_core.prepare(state, plain).run()
    assert _layout(path) == _layout(plain)
    assert_identical(state, fp_core.load(path, verify=True))


def _record_batches(monkeypatch) -> list[tuple[int, int]]:
    """The (lo, hi) of every batch the early write writes, in order (each still written)."""
    written: list = []
    real = early_write.write_range
    monkeypatch.setattr(early_write, "write_range", lambda eng, plan, lo, hi, *a, **k: written.append((lo, hi))
                        or real(eng, plan, lo, hi, *a, **k))
    return written


class _Hparams(dict):
    """A dict subclass, as Lightning's AttributeDict: not a plain state."""


def _with_hparams(state: dict) -> dict:
    return dict(state, hyper_parameters=_Hparams(lr=0.1, layers=3), param=torch.nn.Parameter(torch.ones(5)))


def test_a_state_plain_only_at_first_keeps_its_early_storages(disk_dir, early_from_1mib, monkeypatch):
    """Our pickle stops at the first object it does not write, after the writing began;
    torch's pickler finds the same storages first, and the file keeps the early layout."""
    written = _record_batches(monkeypatch)
    state = _with_hparams(_state())
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    assert written and written[0][0] == 0  # written early, from the start of the file
    assert _first_record(path).endswith("/data/0")
    stock = os.path.join(disk_dir, "stock.pt")
    torch.save(state, stock)
    assert torch._C.PyTorchFileReader(path).get_record("data.pkl") == \
        torch._C.PyTorchFileReader(stock).get_record("data.pkl")
    for got in (torch.load(path, weights_only=False), fp_core.load(path, verify=True, weights_only=False)):
        assert_identical(state, got)
        assert type(got["hyper_parameters"]) is _Hparams
    fp_core.verify(path)


def test_the_writing_goes_on_in_batches_as_storages_are_found(disk_dir, early_from_1mib, monkeypatch):
    monkeypatch.setattr(early_write, "MIN_BATCH", 64 << 10)
    written = _record_batches(monkeypatch)
    torch.manual_seed(2)
    state = {f"t{i}": torch.randn(50_000 + i) for i in range(400)}  # 80 MB, found one by one
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    assert len(written) >= 2, written
    assert all(a[1] == b[0] for a, b in zip(written, written[1:]))  # contiguous, in file order
    assert all(lo % 4096 == 0 and hi % 4096 == 0 for lo, hi in written)
    assert_identical(state, fp_core.load(path, verify=True))
    fp_core.verify(path)


def test_the_first_batch_is_written_before_the_pickling_goes_on(disk_dir, early_from_1mib, monkeypatch):
    """The pickling thread lets go of the GIL until the writing thread has its first batch:
    the disk starts on it before the next storage is pickled (the thread waited tens of
    milliseconds for the GIL behind the pickling before)."""
    found_at_write: list[int] = []
    found_at_begin: list[int] = []
    real_begin, real_write = early_write.EarlyWrite._begin, early_write.write_range

    def begin(self):
        found_at_begin.append(len(self._entries))
        state["ew"] = self
        real_begin(self)

    def write(*a, **k):
        found_at_write.append(len(state["ew"]._entries))
        return real_write(*a, **k)

    monkeypatch.setattr(early_write.EarlyWrite, "_begin", begin)
    monkeypatch.setattr(early_write, "write_range", write)
    monkeypatch.setattr(early_write, "HANDOVER_S", 30.0)  # the handover itself, not a loaded machine's timing
    torch.manual_seed(4)
    tensors = {"big": torch.randn(1 << 19)}  # 2 MiB: the early write begins with it
    tensors.update({f"t{i}": torch.randn(16_384 + i) for i in range(600)})  # 40 MB more to pickle
    state: dict = {}
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(tensors, path)
    assert found_at_begin == [1]
    assert found_at_write[0] == 1, found_at_write[:3]  # written before the next storage was found
    assert_identical(tensors, fp_core.load(path, verify=True))


def test_a_thread_that_never_takes_its_first_batch_costs_the_save_only_the_handover(disk_dir, early_from_1mib,
                                                                                     monkeypatch):
    """The handover is bounded: a writing thread that does not take its batch (stuck,
    say) delays the pickling by HANDOVER_S, and the save still completes."""
    import time

    gate = threading.Event()
    real_drain = early_write.EarlyWrite._drain

    def late_drain(self):
        gate.wait(5)
        real_drain(self)

    monkeypatch.setattr(early_write.EarlyWrite, "_drain", late_drain)
    monkeypatch.setattr(early_write, "HANDOVER_S", 0.3)
    waited: list[float] = []
    real_begin = early_write.EarlyWrite._begin

    def begin(self):
        t0 = time.perf_counter()
        real_begin(self)
        waited.append(time.perf_counter() - t0)
        gate.set()

    monkeypatch.setattr(early_write.EarlyWrite, "_begin", begin)
    torch.manual_seed(5)
    state = {"big": torch.randn(1 << 19), "more": torch.randn(1000)}
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    assert 0.25 <= waited[0] < 3
    assert_identical(state, fp_core.load(path, verify=True))


def test_the_whole_body_is_written_early_its_last_rows_built_while_the_thread_writes(
        disk_dir, early_from_1mib, monkeypatch):
    """Once the pickle is made, the storages' rest and then the pickle with torch's small
    records go to the writing thread, their rows built by the caller while the thread is
    still busy (the disk goes from batch to batch), and the save writes only the tail
    after them."""
    import time

    from fp_core.io import writer

    calls: list[tuple[int, int, bool, str]] = []  # (lo, hi, rows prepared, thread)
    real = early_write.write_range

    def slow(eng, plan, lo, hi, *a, prepared=None, **k):
        calls.append((lo, hi, prepared is not None, threading.current_thread().name))
        time.sleep(0.2)  # a slow disk: the thread is still writing when the pickle is made
        return real(eng, plan, lo, hi, *a, prepared=prepared, **k)

    monkeypatch.setattr(early_write, "write_range", slow)
    built_by: list[str] = []
    real_prepare = early_write.prepare_rows

    def prepare(*a):
        built_by.append(threading.current_thread().name)
        return real_prepare(*a)

    monkeypatch.setattr(early_write, "prepare_rows", prepare)
    tails: list[tuple[int, int]] = []
    real_range = writer.write_range
    monkeypatch.setattr(writer, "write_range", lambda eng, plan, lo, hi, *a, **k: tails.append((lo, hi))
                        or real_range(eng, plan, lo, hi, *a, **k))
    state = _state()
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    assert len(calls) >= 3, calls
    assert all(a[1] == b[0] for a, b in zip(calls, calls[1:])) and calls[0][0] == 0
    assert calls[-1][2] and calls[-2][2], calls  # the last two came with their rows
    assert built_by and set(built_by) == {"MainThread"}
    assert {name for *_, name in calls} == {"fastpersist-early-write"}
    body_end = calls[-1][1]
    assert tails and all(lo >= body_end for lo, _ in tails), (tails, body_end)  # only the tail after
    assert_identical(state, fp_core.load(path, verify=True))
    fp_core.verify(path)


def test_every_device_storage_the_thread_stages_was_ordered_after_the_callers_stream(
        disk_dir, early_from_1mib, monkeypatch):
    """A storage on a device is copied to the host on the writing thread; it must first have
    been marked (on the caller's thread) to wait for the caller's stream, also where the
    plan's final extents stage it (the last block of the last storage found). Here record 1
    reads as device memory; staging copies the CPU memory behind it."""
    from fp_core.io import writer

    monkeypatch.setattr(plan_mod.StorageExtent, "source_on_cpu", property(lambda s: s.record != 1))
    marked: set[int] = set()
    real_mark = early_write.mark_ready

    def mark(extents):
        assert threading.current_thread() is threading.main_thread()
        marked.update(id(s) for s in extents)
        return real_mark(extents)

    monkeypatch.setattr(early_write, "mark_ready", mark)
    staged: list[tuple[int, str, bool]] = []  # (record, thread, marked before)
    real_stage = writer._stage_device_storages

    def stage(storages, stats):
        for s in storages:
            if not s.on_cpu:
                staged.append((s.record, threading.current_thread().name, id(s) in marked))
        return real_stage(storages, stats)

    monkeypatch.setattr(writer, "_stage_device_storages", stage)
    torch.manual_seed(5)
    state = {"big": torch.randn(2 * MiB // 4), "odd": torch.randn(1_000_003)}  # odd ends off a block
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    early = [(r, ok) for r, name, ok in staged if name == "fastpersist-early-write"]
    assert len(early) >= 2 and {r for r, _ in early} == {1}, staged  # its body, then its last block
    assert all(ok for _, ok in early), staged
    assert_identical(state, fp_core.load(path, verify=True))


def test_no_rows_built_ahead_from_a_device_storages_staging_copy(disk_dir, early_from_1mib, monkeypatch):
    """A device storage whose end the previous batch cuts is staged for that batch; its
    copy is let go when that batch is written. Rows built ahead for the next batch while
    it was being written would point into the copy let go (a crash, or a silently wrong
    file where the memory was reused). Record 0 reads as device memory; the disk is slow
    for the first batch and the pickle's end comes while it is written."""
    import time

    from fp_core.io import writer

    monkeypatch.setattr(plan_mod.StorageExtent, "source_on_cpu", property(lambda s: s.record != 0))
    first: list[int] = []
    real_rows = writer._write_rows

    def slow_rows(eng, rows, lo, hi, stats):
        if threading.current_thread().name == "fastpersist-early-write" and not first:
            first.append(1)
            time.sleep(0.5)
        return real_rows(eng, rows, lo, hi, stats)

    monkeypatch.setattr(writer, "_write_rows", slow_rows)
    let_go: list[torch.Tensor] = []  # kept alive, and overwritten as another user of the memory would
    real_release = writer._release

    def release(staged):
        for s in staged:
            if s.host is not None:
                s.host.fill_(0xAB)
                let_go.append(s.host)
        return real_release(staged)

    monkeypatch.setattr(writer, "_release", release)
    real_offer = early_write.EarlyWrite._offer

    def offer(self, ahead=False):
        if ahead:
            time.sleep(0.2)  # the rest of a real state's pickle takes a while
        return real_offer(self, ahead)

    monkeypatch.setattr(early_write.EarlyWrite, "_offer", offer)
    torch.manual_seed(1)
    state = {"big": torch.randn(MiB // 4 + 1001), "x": torch.randn(10), "y": torch.randn(10)}
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    assert let_go  # the staging copies were let go (and overwritten)
    assert_identical(state, fp_core.load(path, verify=True))


def test_rows_prepared_ahead_write_the_same_bytes(disk_dir):
    from fp_core.io import engine as engine_mod
    from fp_core.io import writer

    state = _state()
    plan = plan_mod.build(state, 4096)
    files = []
    for ahead in (False, True):
        path = os.path.join(disk_dir, f"ahead{ahead}.bin")
        eng = engine_mod.open_engine(path, engine_mod.EngineOptions(), create=True)
        try:
            cut = plan.tail_start // 2 // 4096 * 4096
            pieces = []
            for lo, hi in ((0, cut), (cut, plan.tail_start)):
                rows = writer.prepare_rows(eng, plan, lo, hi) if ahead else None
                assert (rows is not None) == ahead
                pieces += writer.write_range(eng, plan, lo, hi, engine_mod.EngineOptions(), writer.RangeStats(),
                                             prepared=rows)
            with pytest.raises(ValueError, match="prepared for"):
                writer.write_range(eng, plan, 0, cut, engine_mod.EngineOptions(), writer.RangeStats(),
                                   prepared=writer.prepare_rows(eng, plan, 0, 4096))
            eng.sync()
        finally:
            eng.close()
        with open(path, "rb") as f:
            files.append((f.read(plan.tail_start), sorted((p.record, p.start, p.length, p.crc) for p in pieces)))
    assert files[0] == files[1]
    plan.cut = object()  # an overlap save's cut claims its batches as they are written
    assert writer.prepare_rows(None, plan, 0, 4096) is None


def test_a_state_changed_between_the_two_pickles_is_written_anew(disk_dir, early_from_1mib, monkeypatch):
    """torch's pickler meets other storages under the keys laid out (another thread changed
    the state after our pickle stopped): the save waits for the early bytes and writes the
    state as torch's pickler found it, in torch's order."""
    state = _with_hparams(_state())
    real_capture = early_write.torch_capture

    def change_then_capture(obj, *args, **kwargs):
        obj["model"] = collections.OrderedDict((k, v + 1) for k, v in obj["model"].items())
        return real_capture(obj, *args, **kwargs)

    monkeypatch.setattr(early_write, "torch_capture", change_then_capture)
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    assert _first_record(path).endswith("/data.pkl")  # planned anew, torch's order
    assert not _early_threads()
    got = fp_core.load(path, verify=True, weights_only=False)
    assert_identical(state["model"], got["model"])  # the state as it was when the save ended
    assert torch.equal(got["big"], state["big"])
    fp_core.verify(path)


def _early_threads() -> list[threading.Thread]:
    """Early-write threads still running a moment after the save returned (a thread ends
    just after it signals that it is out of the file)."""
    threads = [t for t in threading.enumerate() if t.name == "fastpersist-early-write"]
    for t in threads:
        t.join(5)
    return [t for t in threads if t.is_alive()]


def test_a_failing_pickle_waits_for_the_early_write_and_keeps_the_old_file(disk_dir, early_from_1mib, monkeypatch):
    path = os.path.join(disk_dir, "s.pt")
    old = {"old": torch.arange(100)}
    fp_core.save(old, path)

    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(plan_mod, "from_skeleton", broken)
    with pytest.raises(fp_core.CheckpointSerializationError, match="boom") as ei:
        fp_core.save(_state(), path)
    assert path in str(ei.value)
    assert not _early_threads()
    assert sorted(os.listdir(disk_dir)) == ["s.pt"]
    assert_identical(old, fp_core.load(path, verify=True))


@pytest.mark.parametrize("after", [0, 2 * MiB])
def test_a_failing_early_write_is_the_saves_error(disk_dir, early_from_1mib, fault, after):
    path = os.path.join(disk_dir, "s.pt")
    old = {"old": torch.arange(100)}
    fp_core.save(old, path)
    fault("write", errno=errno.EIO, after_bytes=after)
    with pytest.raises(OSError) as ei:
        fp_core.save(_state(), path, chunk_bytes=1 * MiB)
    assert ei.value.errno == errno.EIO and ei.value.filename == path
    assert not _early_threads()
    assert sorted(os.listdir(disk_dir)) == ["s.pt"]
    assert_identical(old, fp_core.load(path, verify=True))


def test_a_state_that_shrank_between_the_two_pickles_is_written_anew(disk_dir, early_from_1mib, monkeypatch):
    state = _with_hparams(_state())
    real_capture = early_write.torch_capture

    def shrink_then_capture(obj, *args, **kwargs):
        del obj["ints"], obj["tied"]  # storages ours found, written early, now gone
        return real_capture(obj, *args, **kwargs)

    monkeypatch.setattr(early_write, "torch_capture", shrink_then_capture)
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    assert _first_record(path).endswith("/data.pkl")
    assert_identical(state, fp_core.load(path, verify=True, weights_only=False))


def _slow_early_writes(disk_dir: str, monkeypatch, seconds: float) -> tuple[str, dict]:
    """A checkpoint to keep intact, under a named temp file (a leak shows), and early
    batches that take ``seconds`` each: time for an interrupt to land meanwhile."""
    import time

    monkeypatch.setattr(fp_core.saving.commit, "tmpfile_supported", lambda d: False)
    path = os.path.join(disk_dir, "s.pt")
    old = {"old": torch.arange(100)}
    fp_core.save(old, path)
    real = early_write.write_range

    def slow_disk(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(early_write, "write_range", slow_disk)
    return path, old


def test_ctrl_c_while_the_early_write_runs_loses_nothing(disk_dir, early_from_1mib, monkeypatch, ctrl_c):
    """SIGINT lands while the save waits for its early write (most of a large save): the
    interrupt is what the caller gets, once the thread is out of the file; no temporary
    file stays and the previous checkpoint is intact."""
    import time

    path, old = _slow_early_writes(disk_dir, monkeypatch, 0.4)
    batches: list[tuple[float, float]] = []  # when each early batch began and ended, from the save's start
    slow = early_write.write_range

    def timed(*a, **k):
        began = time.perf_counter() - t0
        try:
            return slow(*a, **k)
        finally:
            batches.append((began, time.perf_counter() - t0))

    monkeypatch.setattr(early_write, "write_range", timed)
    state = _state()
    # To the main thread: a signal the kernel hands to another thread would not wake the
    # main one out of its wait (it would be raised only once the wait returns).
    timer = threading.Timer(0.2, ctrl_c)
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            fp_core.save(state, path)
    except pytest.fail.Exception as e:  # say what the save did instead
        raise AssertionError(f"no interrupt: the save returned after {time.perf_counter() - t0:.3f} s, "
                             f"early batches (began, ended) at {batches}") from e
    finally:
        timer.cancel()
    raised = time.perf_counter() - t0
    # raised once the thread was out of the file: every batch it began had ended (on 3.11 an
    # interrupted join() took the running thread for stopped, and the save raised under it)
    assert batches and all(end <= raised for _, end in batches), (raised, batches)
    assert not _early_threads()
    assert sorted(os.listdir(disk_dir)) == ["s.pt"]
    assert_identical(old, fp_core.load(path, verify=True))


def test_ctrl_c_before_the_save_waits_for_its_early_write_still_waits_for_it(disk_dir, early_from_1mib,
                                                                             monkeypatch):
    """The interrupt lands after the plan, before the save reaches the early write's join
    (as if in EarlyWrite._close): the thread is still writing; the file must not be closed
    under it, and nothing of the save stays."""

    path, old = _slow_early_writes(disk_dir, monkeypatch, 0.3)
    real_result = early_write.EarlyWrite.result

    def interrupted(self):
        self._close()
        raise KeyboardInterrupt  # before stop() waits for the thread

    monkeypatch.setattr(early_write.EarlyWrite, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fp_core.save(_state(), path)
    monkeypatch.setattr(early_write.EarlyWrite, "result", real_result)
    assert not _early_threads()
    assert sorted(os.listdir(disk_dir)) == ["s.pt"]
    assert_identical(old, fp_core.load(path, verify=True))


def test_a_thread_that_cannot_start_fails_the_save_cleanly(disk_dir, early_from_1mib, monkeypatch):
    class Unstartable(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    # early_write's own view of the threading module (the commit's cleaner still starts threads)
    monkeypatch.setattr(early_write, "threading", types.SimpleNamespace(Thread=Unstartable, Event=threading.Event))
    monkeypatch.setattr(fp_core.saving.commit, "tmpfile_supported", lambda d: False)
    path = os.path.join(disk_dir, "s.pt")
    old = {"old": torch.arange(100)}
    fp_core.save(old, path)
    with pytest.raises(fp_core.CheckpointSerializationError, match="can't start new thread"):
        fp_core.save(_state(), path)
    assert sorted(os.listdir(disk_dir)) == ["s.pt"]
    assert_identical(old, fp_core.load(path, verify=True))

