"""The CUDA paths' logic, checked on the CPU (no device needed; tests/core/test_cuda.py runs them on one).

* the dtype and view matrix that tests/core/test_cuda.py round-trips on the GPU, here on the CPU
  (so the list itself is known to be valid before a device is lent);
* stream ordering in ``writer.copy_to_host``: with torch.cuda replaced by fakes that log,
  a device copy is issued on a side stream, non-blocking, into pinned memory, after the
  side stream waited for the caller's stream, and synchronised before the function
  returns (what lets the fence release);
* budget accounting: ``writer._batches`` cuts device storages into batches of at most
  ``DEVICE_BATCH_BYTES`` (or one larger storage), and ``write_single`` holds one batch's
  staging copies at a time, every one staged before the fence's callback;
* the async pipeline with *emulated* device storages (a ``meta`` source the writer cannot
  read; staging reads the live CPU memory behind it): under ``overlap`` and ``snapshot`` the
  checkpoint equals the state at ``save()`` though the "device" tensors change right after
  the fence, small ones are staged inside ``save()``, large ones before the fence releases;
* the replica check's sampling (``distributed._sample_crc``) on CPU storages.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time

import pytest
import torch
from conftest import assert_identical, assert_no_temps

import fp_core
import fp_core.io.arena
import fp_core.io.pinned_host
import fp_core.io.writer
import fp_core.pipeline.checkpointer
import fp_core.saving.local
from fp_core.format.plan import StorageExtent, build, byte_view
from fp_core.io.engine import EngineOptions, open_engine

# ====================================================================== the dtype matrix

DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
               "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
               "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")


def all_dtypes() -> list[torch.dtype]:
    """Every byte-sized-or-larger dtype this torch has (float8 and float4 where present)."""
    return [getattr(torch, n) for n in DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)]


def dtype_state(device: str | torch.device, seed: int = 0) -> dict:
    """Random bytes in every dtype, each as a base tensor and views of it that torch.save
    keeps as views of one storage: rows (an offset), strided columns, a transpose, an
    expansion (stride 0), a 0-d element and the flat tail; plus a view saved without its
    base, a tensor above ``small_tensor_bytes`` (written from live memory by the async
    pipeline) with a view, and an empty tensor."""
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict = {}
    for dt in all_dtypes():
        item = torch.empty((), dtype=dt).element_size()
        raw = torch.randint(0, 256, (48 * 40 * item,), dtype=torch.uint8, device=device, generator=g)
        if dt == torch.bool:
            raw = raw & 1  # a bool byte is 0 or 1
        base = raw.view(dt).view(48, 40)
        out[str(dt).removeprefix("torch.")] = {
            "base": base, "rows": base[3:9], "cols": base[:, 5:17:3], "t": base.t(), "expand": base[0].expand(4, 40),
            "scalar": base[2, 7], "tail": base.view(-1)[-13:]}
    out["alone"] = torch.randn(64, 33, device=device, generator=g).t()[2:, ::2]  # its base is not saved
    out["big"] = torch.randn(3 << 18, device=device, generator=g)  # 3 MiB
    out["big_view"] = out["big"][1000:5000]
    out["empty"] = torch.empty(0, 5, device=device)
    return out


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as uint8 on the CPU (any dtype, any view)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu()


def assert_same_tensors(want, got, where: str = "state", device: str | None = None) -> None:
    """Byte-exact equality of every storage, and the same dtype, shape, strides and offset
    (views stay views); ``device``: the device type ``got`` must be on."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, tuple(got.shape), got.stride(), got.storage_offset()) == \
            (want.dtype, tuple(want.shape), want.stride(), want.storage_offset()), f"{where}: metadata differs"
        if device is not None:
            assert got.device.type == device, f"{where}: on {got.device}, not {device}"
        assert torch.equal(storage_bytes(got), storage_bytes(want)), f"{where}: bytes differ"
        return
    assert isinstance(got, dict) and list(got) == list(want), where
    for k in want:
        assert_same_tensors(want[k], got[k], f"{where}.{k}", device)


def assert_views_share_storage(got: dict) -> None:
    for name, group in got.items():
        if isinstance(group, dict):
            ptr = group["base"].untyped_storage().data_ptr()
            assert all(v.untyped_storage().data_ptr() == ptr for v in group.values()), f"{name}: views came apart"
    assert got["big_view"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()


@pytest.mark.parametrize("how", ["save", "overlap", "snapshot"])
def test_dtype_matrix_round_trips_byte_exact_on_cpu(disk_dir, how):
    state = dtype_state("cpu")
    assert len(state) >= 17  # bool, 4 ints, 4 uints, 4 floats, 3 complex at the least
    path = os.path.join(disk_dir, f"{how}.pt")
    if how == "save":
        fp_core.save(state, path)
    else:
        with fp_core.AsyncCheckpointer(policy=how) as ckpt:
            ckpt.save(state, path)
    fp_core.verify(path)
    for got in (torch.load(path, weights_only=True), fp_core.load(path, weights_only=True, verify=True)):
        assert_same_tensors(state, got, device="cpu")
        assert_views_share_storage(got)
    assert_no_temps(disk_dir)


# ====================================================================== stream ordering (fake CUDA)


class _Streams(threading.local):
    """The fake current stream, per thread as torch's is: a new thread starts on the default."""

    def __init__(self) -> None:
        self.stack = [_FakeStream(name="default")]


class _FakeCudaTensor(torch.Tensor):
    """CPU memory that says it is on cuda:0; logs every copy out of it with the stream it was
    issued on (torch.cuda.* are replaced by the fakes below)."""

    log: list = []
    streams: _Streams
    devices: list = []  # the device guards entered (torch.cuda.device)
    guarded: list = []  # per copy, the device guard it was issued under

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "copy_":
            cls.log.append(("copy", cls.streams.stack[-1].name, bool(kwargs.get("non_blocking", False))))
            cls.guarded.append(cls.devices[-1] if cls.devices else None)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class _FakeStream:
    count = 0

    def __init__(self, device=None, name: str | None = None, **kw) -> None:
        _FakeStream.count += 1
        self.name = name or f"side{_FakeStream.count}"

    def wait_stream(self, other) -> None:
        _FakeCudaTensor.log.append(("wait", self.name, other.name))

    def wait_event(self, event) -> None:
        _FakeCudaTensor.log.append(("wait", self.name, event.stream_name))

    def synchronize(self) -> None:
        _FakeCudaTensor.log.append(("sync", self.name))

    def record_event(self, event=None):
        event = event or _FakeEvent()
        event.record(self)
        return event


class _FakeEvent:
    def __init__(self, *a, **kw) -> None:
        self.stream_name = None

    def record(self, stream=None) -> None:
        self.stream_name = (stream or _FakeCudaTensor.streams.stack[-1]).name

    def wait(self, stream=None) -> None:
        _FakeCudaTensor.log.append(("wait", (stream or _FakeCudaTensor.streams.stack[-1]).name, self.stream_name))

    def synchronize(self) -> None:
        _FakeCudaTensor.log.append(("sync", self.stream_name))

    def query(self) -> bool:
        return True


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream API replaced by loggers (current stream per thread; this one on
    "caller"); pinned allocations recorded (and made in ordinary memory), the driver's
    registration of a pinned arena (fp_core.io.pinned_host) a no-op. Yields (log, pinned
    allocation sizes)."""
    _FakeCudaTensor.log = []
    _FakeCudaTensor.devices, _FakeCudaTensor.guarded = [], []
    _FakeCudaTensor.streams = _Streams()
    _FakeCudaTensor.streams.stack.append(_FakeStream(name="caller"))
    pinned: list[int] = []

    @contextlib.contextmanager
    def stream(s):
        _FakeCudaTensor.streams.stack.append(s)
        try:
            yield s
        finally:
            _FakeCudaTensor.streams.stack.pop()

    @contextlib.contextmanager
    def device(d):
        _FakeCudaTensor.log.append(("device", str(d)))
        _FakeCudaTensor.devices.append(str(d))
        try:
            yield
        finally:
            _FakeCudaTensor.devices.pop()

    real_empty = torch.empty

    def empty(*size, **kw):
        if kw.pop("pin_memory", False):
            pinned.append(int(torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size).numel()))
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeCudaTensor.streams.stack[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(fp_core.io.pinned_host, "_register", lambda addr, nbytes: None)
    monkeypatch.setattr(fp_core.io.pinned_host, "_unregister", lambda addr: None)
    yield _FakeCudaTensor.log, pinned


def _fake_device_extent(n: int, value: int) -> tuple[StorageExtent, torch.Tensor]:
    src = torch.full((n,), value, dtype=torch.uint8)
    return StorageExtent(0, n, src.as_subclass(_FakeCudaTensor), 0), src


def _check_ordering(log: list, caller: str = "caller") -> None:
    copies = [i for i, e in enumerate(log) if e[0] == "copy"]
    assert copies, log
    for i in copies:
        _, stream, non_blocking = log[i]
        assert stream not in (caller, "default"), f"device copy issued on the caller's stream: {log}"
        assert non_blocking, f"device copy is blocking: {log}"
        waited = [j for j, e in enumerate(log[:i]) if e[0] == "wait" and e[1] == stream and e[2] == caller]
        assert waited, f"copy on {stream} not ordered after the caller's stream ({caller}): {log}"
    for stream in {log[i][1] for i in copies}:
        last = max(i for i in copies if log[i][1] == stream)
        assert any(e == ("sync", stream) for e in log[last + 1:]), f"{stream} not synchronised before return: {log}"


def test_copy_to_host_orders_device_copies_on_a_side_stream(fake_cuda):
    log, pinned = fake_cuda
    exts = [_fake_device_extent(n, v) for n, v in ((4096, 1), (5000, 2), (1, 3))]
    cpu = StorageExtent(0, 64, torch.full((64,), 9, dtype=torch.uint8), 1)
    fp_core.io.writer.copy_to_host([e for e, _ in exts] + [cpu])
    _check_ordering(log)
    assert sorted(pinned) == sorted([4096, 5000, 1]), "device copies must land in pinned memory (async D2H)"
    for e, src in exts:
        assert e.host is not None and type(e.host) is torch.Tensor and torch.equal(e.host, src)
    assert torch.equal(cpu.host, cpu.source)
    assert sum(1 for x in log if x[0] == "copy") == 3  # the CPU extent is a plain copy, outside any stream
    # one side stream for the device, not one per storage (torch's pool has 32 of them)
    assert len({x[1] for x in log if x[0] == "copy"}) == 1
    # every device copy issued under its device's guard: a writer thread whose current device
    # is another must not set that one back (a CUDA context on it) when the stream context ends
    assert _FakeCudaTensor.guarded == ["cuda:0", "cuda:0", "cuda:0"]


def test_copy_to_host_synchronises_its_copies_when_one_fails(fake_cuda, monkeypatch):
    """A pinned allocation that fails part-way: the copies already issued are waited for
    before the error leaves (their buffers are about to be dropped or reused)."""
    log, pinned = fake_cuda
    exts = [_fake_device_extent(n, v) for n, v in ((4096, 1), (5000, 2))]
    real_empty = torch.empty
    calls = []

    def failing_empty(*size, **kw):
        calls.append(size)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.raises(RuntimeError, match="out of memory"):
        fp_core.io.writer.copy_to_host([e for e, _ in exts])
    copy_at = next(i for i, e in enumerate(log) if e[0] == "copy")
    assert ("sync", log[copy_at][1]) in log[copy_at + 1:], log


def test_device_work_on_another_thread_waits_for_the_point_recorded_on_the_callers_stream(fake_cuda):
    """Lightning's FSDP1 path: the caller clones the state on its own current stream, the
    checkpointer's worker copies the clones to the host later. The worker's copies must be
    ordered after the clones (through the event recorded at save), and what it queued is
    synchronised before its block ends (the clones are freed after)."""
    log, _ = fake_cuda
    ext, src = _fake_device_extent(4096, 5)
    with torch.cuda.stream(_FakeStream(name="caller_side")):
        ready = fp_core.io.writer.record_ready([torch.device("cuda", 0), torch.device("cpu"), torch.device("cuda", 0)])
    assert list(ready) == [torch.device("cuda", 0)]  # one event per CUDA device, none for the CPU

    def worker() -> None:
        with fp_core.io.writer.device_work_after(ready):
            fp_core.io.writer.copy_to_host([ext])

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    waits = {(e[1], e[2]) for e in log if e[0] == "wait"}
    copy_stream = next(e[1] for e in log if e[0] == "copy")

    def after(stream: str, target: str, seen: frozenset = frozenset()) -> bool:
        return any(b == target or (b not in seen and after(b, target, seen | {b})) for a, b in waits if a == stream)

    assert after(copy_stream, "caller_side"), f"the worker's copy is not ordered after the caller's clones: {log}"
    assert not after(copy_stream, "default"), f"the worker's copy waits on its default stream: {log}"
    outer = next(a for a, b in waits if b == "caller_side")
    assert log.index(("sync", outer)) > max(i for i, e in enumerate(log) if e[0] == "copy"), log
    assert torch.equal(ext.host, src)
    assert fp_core.io.writer.record_ready([torch.device("cpu")]) == {}


def test_copy_to_host_into_an_arena_allocates_nothing(fake_cuda):
    log, pinned = fake_cuda
    exts = [_fake_device_extent(n, v) for n, v in ((4096, 4), (777, 5))]
    arena = torch.zeros(8192, dtype=torch.uint8)
    into = [arena[:4096], arena[4096:4096 + 777]]
    fp_core.io.writer.copy_to_host([e for e, _ in exts], into=into)
    _check_ordering(log)
    assert pinned == []
    for (e, src), buf in zip(exts, into):
        assert e.host is buf and torch.equal(buf, src)


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_background_device_copies_wait_for_the_callers_stream_at_save(disk_dir, fake_cuda, monkeypatch, policy):
    """A caller on a stream of its own calls save(): the copies the background writer makes
    later, on its own thread, must still be ordered after that stream as it was at save()."""
    log, _ = fake_cuda
    keys: set[int] = set()
    monkeypatch.setattr(fp_core.format.plan, "_residue", lambda storage, alignment: 0 if storage._cdata in keys else 64)
    real_build = fp_core.saving.local.build

    def build_(obj, alignment=4096, congruent=False):
        plan = real_build(obj, alignment, congruent=congruent)
        for s in plan.storages:
            if s.source.untyped_storage()._cdata in keys:
                s.source = s.source.as_subclass(_FakeCudaTensor)
        return plan

    monkeypatch.setattr(fp_core.saving.local, "build", build_)
    state = {"big": torch.randn(2 << 20), "small": torch.randn(100)}  # 8 MiB in the background, 400 B in save()
    keys |= _keys(*state.values())
    path = os.path.join(disk_dir, f"{policy}.pt")
    with fp_core.AsyncCheckpointer(policy=policy) as ckpt:
        with torch.cuda.stream(_FakeStream(name="caller_side")):
            h = ckpt.save(state, path)
        h.result()
    assert sum(1 for e in log if e[0] == "copy") == 2
    _check_ordering(log, caller="caller_side")
    assert_identical(state, torch.load(path, weights_only=True))


def test_snapshot_arena_is_pinned_for_device_storages():
    dev, _ = _fake_device_extent(4096, 1)
    cpu = StorageExtent(8192, 100, torch.zeros(100, dtype=torch.uint8), 1)
    assert fp_core.io.arena.arena_need([cpu])[1] is False
    size, pin = fp_core.io.arena.arena_need([cpu, dev])
    assert pin is True and size >= 4096 + 100


# ====================================================================== device batches

def _meta(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device="meta")


def _swap_to_device(plan, keys: set[int]) -> list[StorageExtent]:
    """Make the plan's storages of ``keys`` (storage ids) read as device memory: a meta
    source (nothing can read it); the live CPU memory stays behind as ``_emulated_source``."""
    swapped = []
    for s in plan.storages:
        if s.source.untyped_storage()._cdata in keys:
            s._emulated_source = s.source  # type: ignore[attr-defined]
            s.source = _meta(s.length)
            swapped.append(s)
    return swapped


def _keys(*tensors: torch.Tensor) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


def _batch_state() -> tuple[dict, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    dev = [torch.randn(n, generator=g) for n in (100_000, 120_000, 300_000, 50_000, 60_000, 10)]  # 0.4-1.2 MB
    obj = {"d": dev, "cpu": torch.randn(200_000, generator=g), "meta": {"step": 3}}
    return obj, dev


def test_batches_cut_device_storages_at_storage_boundaries(monkeypatch):
    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", 1 << 20)
    # A state with device tensors is not plain (state_pickle): torch's pickler lays it out
    # block-aligned. Built from CPU tensors here, it must be laid out the same way.
    monkeypatch.setattr(fp_core.format.plan, "PLAIN_STORAGE_ALIGNMENT", None)
    obj, dev = _batch_state()
    plan = build(obj, 4096)
    assert fp_core.io.writer._batches(plan, 0, plan.tail_start) == [(0, plan.tail_start)]  # all on the CPU: one
    swapped = _swap_to_device(plan, _keys(*dev))
    assert len(swapped) == len(dev)
    cuts = fp_core.io.writer._batches(plan, 0, plan.tail_start)
    assert cuts[0][0] == 0 and cuts[-1][1] == plan.tail_start
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))  # contiguous
    starts = {s.offset for s in plan.storages}
    assert all(lo in starts for lo, _ in cuts[1:]), "a cut inside a storage"
    largest = max(s.length for s in swapped)
    for lo, hi in cuts:
        inside = [s for s in swapped if lo <= s.offset < hi]
        assert sum(s.length for s in inside) <= max(fp_core.io.writer.DEVICE_BATCH_BYTES, largest)
        assert all(s.end <= hi or hi == plan.tail_start for s in inside)
    assert len(cuts) >= 3


@pytest.fixture
def device_layout(monkeypatch):
    """Lay out storages of the given ids as build() lays out device storages: block-aligned;
    every other (CPU) storage of a ``congruent`` plan at 64 modulo 4 KiB, where torch puts
    a large CPU tensor (a small one may land anywhere 64-byte aligned: fixed here, so that
    the layout does not depend on where this run's allocations happened to fall)."""
    keys: set[int] = set()
    monkeypatch.setattr(fp_core.format.plan, "_residue", lambda storage, alignment: 0 if storage._cdata in keys else 64)
    return keys


def test_batch_cuts_are_block_aligned_in_a_congruent_plan_with_cpu_storages(monkeypatch, device_layout):
    """What a CUDA model with torch's Adam checkpoints: device weights and moments, and a CPU
    ``step`` scalar per parameter, laid out by AsyncCheckpointer (``congruent=True``)."""
    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", 1 << 20)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g) for n in (300_000, 1000, 300_000, 1000)]  # 1.2 MB > a batch
    state = {i: {"step": torch.tensor(float(i + 1)), "exp_avg": torch.randn(p.numel(), generator=g),
                 "exp_avg_sq": torch.randn(p.numel(), generator=g)} for i, p in enumerate(params)}
    obj = {"model": params, "optim": {"state": state}}
    device = params + [t for v in state.values() for k, t in v.items() if k != "step"]
    device_layout.update(_keys(*device))
    plan = build(obj, 4096, congruent=True)
    _swap_to_device(plan, _keys(*device))
    assert all(s.offset % 4096 == 64 for s in plan.storages if s.length == 4), "the CPU scalars sit at +64"
    cuts = fp_core.io.writer._batches(plan, 0, plan.tail_start)
    assert len(cuts) > 1
    assert all(lo % 4096 == 0 for lo, _ in cuts), f"unaligned batch starts: {[lo for lo, _ in cuts if lo % 4096]}"


def test_batch_cuts_are_block_aligned_in_a_safetensors_plan(monkeypatch):
    """save_pretrained of a model on the GPU: a safetensors plan of device tensors."""
    from fp_core.format.safetensors_plan import build_safetensors

    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", 1 << 20)
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate((300_001, 250_003, 333_333, 7))}
    plan = build_safetensors(tensors, 4096)
    for s in plan.storages:
        s.source = _meta(s.length)
    cuts = fp_core.io.writer._batches(plan, 0, plan.tail_start)
    assert len(cuts) > 1
    assert all(lo % 4096 == 0 for lo, _ in cuts), f"unaligned batch starts: {[lo for lo, _ in cuts if lo % 4096]}"


class _Staging:
    """Stand-in for the pinned staging copies: reads the live memory behind an emulated
    device storage; counts the bytes held (staged, not yet released) and their peak."""

    def __init__(self, delay: float = 0.0) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[float, int, int, bool]] = []  # (time, storage length, device?, into an arena?)
        self.held = 0
        self.peak = 0
        self.delay = delay

    def copy_to_host(self, extents: list[StorageExtent], into: list[torch.Tensor] | None = None) -> None:
        for i, s in enumerate(extents):
            src = getattr(s, "_emulated_source", s.source)
            assert src.device.type == "cpu", "the writer staged a storage nobody can read"
            buf = into[i] if into is not None else torch.empty(s.length, dtype=torch.uint8)
            if self.delay:
                time.sleep(self.delay)
            buf.copy_(src)
            s.host = buf
            device = hasattr(s, "_emulated_source")
            with self.lock:
                if device and into is None:
                    self.held += s.length
                    self.peak = max(self.peak, self.held)
                self.events.append((time.perf_counter(), s.length, device, into is not None))

    def release(self, staged: list[StorageExtent]) -> None:
        with self.lock:
            self.held -= sum(s.length for s in staged if hasattr(s, "_emulated_source"))
        for s in staged:
            s.host = None


def test_write_single_holds_one_batch_of_device_staging_at_a_time(disk_dir, monkeypatch):
    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", 1 << 20)
    monkeypatch.setattr(fp_core.format.plan, "PLAIN_STORAGE_ALIGNMENT", None)  # laid out as a device state is
    st = _Staging()
    monkeypatch.setattr(fp_core.io.writer, "copy_to_host", st.copy_to_host)
    monkeypatch.setattr(fp_core.io.writer, "_release", st.release)
    obj, dev = _batch_state()
    expected = copy.deepcopy(obj)
    plan = build(obj, 4096)
    swapped = _swap_to_device(plan, _keys(*dev))
    path = os.path.join(disk_dir, "batches.pt")
    options = EngineOptions()
    fenced_at: list[int] = []
    with open_engine(path, options, create=True) as engine:
        fp_core.io.writer.write_single(engine, plan, options, on_body_written=lambda: fenced_at.append(len(st.events)))
        engine.sync()
    assert fenced_at == [len(st.events)], "a device storage was staged after the fence's callback"
    assert st.held == 0, "staging copies not released"
    largest = max(s.length for s in swapped)
    assert 0 < st.peak <= max(fp_core.io.writer.DEVICE_BATCH_BYTES, largest)
    assert {n for _, n, device, _ in st.events if device} == {s.length for s in swapped}
    fp_core.verify(path)
    assert_identical(expected, torch.load(path, weights_only=True))


def test_write_single_of_a_safetensors_plan_with_device_storages(disk_dir, monkeypatch):
    from safetensors.torch import load_file

    from fp_core.format.safetensors_plan import build_safetensors

    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", 1 << 20)
    st = _Staging()
    monkeypatch.setattr(fp_core.io.writer, "copy_to_host", st.copy_to_host)
    monkeypatch.setattr(fp_core.io.writer, "_release", st.release)
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate((300_001, 250_003, 333_333, 7))}
    plan = build_safetensors(tensors, 4096)
    for s in plan.storages:
        s._emulated_source = s.source  # type: ignore[attr-defined]
        s.source = _meta(s.length)
    path = os.path.join(disk_dir, "m.safetensors")
    options = EngineOptions()
    with open_engine(path, options, create=True) as engine:
        fp_core.io.writer.write_single(engine, plan, options)
        engine.sync()
    assert st.held == 0
    assert len(fp_core.io.writer._batches(plan, 0, plan.tail_start)) > 1  # packed tensors span batch cuts
    staged = [n for _, n, device, _ in st.events if device]
    assert sorted(staged) == sorted(s.length for s in plan.storages), "a device tensor was staged twice"
    assert st.peak <= 2 * max(fp_core.io.writer.DEVICE_BATCH_BYTES, max(staged))
    got = load_file(path)
    assert all(torch.equal(got[k], t) for k, t in tensors.items())


# ====================================================================== pipeline, emulated device


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20_000, 64)  # 5 MB: above small_tensor_bytes
        self.fc = torch.nn.Linear(64, 64)
        self.bn = torch.nn.BatchNorm1d(64)

    def forward(self, ids):
        return self.bn(self.fc(self.emb(ids)))


def _tensors(obj) -> list[torch.Tensor]:
    from fp_core.tools.common import tensors_in
    return tensors_in(obj)


@pytest.fixture
def emulated_device(monkeypatch):
    """Storages of tensors given to ``register`` read as device memory in every plan that
    fp_core.api builds, laid out as device storages are (block-aligned; the others at 64
    modulo 4 KiB, as in ``device_layout``); staging
    (``copy_to_host``, in the writer and the pipeline) reads the live CPU memory behind
    them, 10 ms per storage (slower than the step, so the fence has to wait for it)."""
    st = _Staging(delay=0.01)
    keys: set[int] = set()
    real_build = fp_core.saving.local.build
    monkeypatch.setattr(fp_core.format.plan, "_residue", lambda storage, alignment: 0 if storage._cdata in keys else 64)

    def build_(obj, alignment=4096, congruent=False):
        plan = real_build(obj, alignment, congruent=congruent)
        _swap_to_device(plan, keys)
        return plan

    monkeypatch.setattr(fp_core.saving.local, "build", build_)
    monkeypatch.setattr(fp_core.io.writer, "copy_to_host", st.copy_to_host)
    monkeypatch.setattr(fp_core.pipeline.checkpointer, "copy_to_host", st.copy_to_host)
    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", 1 << 20)
    st.register = lambda *ts: keys.update(_keys(*ts))  # type: ignore[attr-defined]
    return st


@pytest.mark.parametrize("policy,steps", [
    ("overlap", "device"), ("snapshot", "device"),
    ("overlap", "cpu"), ("snapshot", "cpu")])
def test_emulated_device_checkpoint_equals_state_at_save_time(disk_dir, emulated_device, policy, steps):
    """``steps``: where Adam's ``step`` scalars live: on the device (capturable/fused Adam,
    everything device memory) or on the CPU (torch's default for a CUDA model)."""
    st = emulated_device
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(seed):
        g = torch.Generator().manual_seed(seed)
        loss = model(torch.randint(0, 20_000, (16,), generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        return loss

    step(0)
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    on_device = _tensors(state) if steps == "device" else \
        _tensors(state["model"]) + [t for v in state["optim"]["state"].values() for k, t in v.items() if k != "step"]
    st.register(*on_device)
    expected = copy.deepcopy(state)
    path = os.path.join(disk_dir, f"{policy}.pt")
    fenced: list[float] = []
    with fp_core.AsyncCheckpointer(policy=policy) as ckpt:
        inner = ckpt.fence

        def timed_fence():
            inner()
            fenced.append(time.perf_counter())

        ckpt.fence = timed_fence  # the optimizer hook looks it up at each step
        h = ckpt.save(state, path)
        returned = time.perf_counter()
        step(1)  # forward changes the BatchNorm statistics (small: copied inside save())
        with torch.no_grad():
            model.bn.running_mean.add_(100.0)
        opt.step()  # fences first
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # after the fence: must not reach the file
        ckpt.wait()
    assert h.result().policy == policy
    assert fenced, "the optimizer step did not fence"
    small = [t for t, n, device, _ in st.events if device and n <= ckpt.small_tensor_bytes]
    big = [(t, arena) for t, n, device, arena in st.events if device and n > ckpt.small_tensor_bytes]
    assert small and max(small) <= returned, "a small device tensor was staged after save() returned"
    assert big and max(t for t, _ in big) <= fenced[0], "the fence released before every device byte was staged"
    assert all(arena == (policy == "snapshot") for _, arena in big), "snapshot copies go into its arena"
    fp_core.verify(path)
    assert_identical(expected, torch.load(path, weights_only=True))
    assert_no_temps(disk_dir)


# ====================================================================== replica sampling


def _extent(t: torch.Tensor) -> StorageExtent:
    return StorageExtent(0, t.untyped_storage().nbytes(), byte_view(t.untyped_storage()), 0)


def test_replica_sample_sees_first_bytes_and_agrees_on_equal_storages():
    from fp_core.parallel.distributed import _sample_crc

    a = torch.zeros(1 << 16, dtype=torch.uint8)
    b = a.clone()
    b[0] = 1
    assert _sample_crc(_extent(a)) == _sample_crc(_extent(a.clone()))
    assert _sample_crc(_extent(a)) != _sample_crc(_extent(b))


def test_replica_sample_sees_the_last_bytes():
    from fp_core.parallel.distributed import _sample_crc

    a = torch.zeros(1 << 16, dtype=torch.uint8)
    b = a.clone()
    b[-8:] = 1
    assert _sample_crc(_extent(a)) != _sample_crc(_extent(b))


@pytest.mark.parametrize("n", [0, 1, 63, 64 * 9, 64 * 9 + 1, 1 << 20, (1 << 20) + 7])
def test_device_replica_sample_reads_the_same_windows_as_the_cpu_one(n):
    """Device storages are sampled with one gather (distributed._gather, run here on the CPU):
    the same bytes, in the same order, as the native reads of a CPU storage."""
    from fp_core import _native
    from fp_core.parallel.distributed import _gather, _sample_crc, sample_spans

    t = torch.randint(0, 256, (n,), dtype=torch.uint8)
    spans = sample_spans(n)
    assert spans[0][0] == 0 if n else spans == []
    if n:
        assert spans[-1][0] + spans[-1][1] == n  # the last byte is read
    assert _native.crc32c(_gather(t, spans).numpy().tobytes()) == _sample_crc(_extent(t))


def test_dtype_matrix_covers_every_byte_sized_dtype():
    names = {str(d).removeprefix("torch.") for d in all_dtypes()}
    assert {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
            "complex64"} <= names
    if hasattr(torch, "float8_e4m3fn"):
        assert {"float8_e4m3fn", "float8_e5m2"} <= names


def test_device_work_after_save_runs_on_a_side_stream_ordered_after_the_callers(fake_cuda):
    """A sharded or collective save's device work on the background writer (clones,
    gathers, copies): on a side stream that waited for the caller's stream as it was at
    save(), under the device's guard, synchronised when the block ends."""
    log, _ = fake_cuda
    ext, _ = _fake_device_extent(4096, 1)
    with torch.cuda.stream(_FakeStream(name="caller_side")):
        fp_core.io.writer.mark_ready([ext])  # at save(), on the caller's thread
    _FakeCudaTensor.streams = _Streams()  # the writer thread: its current stream is the default
    with fp_core.io.writer.device_work_after_save([ext]):
        inside = torch.cuda.current_stream().name
        assert _FakeCudaTensor.devices == ["cuda:0"]
        ext.source.clone().copy_(ext.source)  # device work issued in the block
    assert inside not in ("default", "caller_side")
    assert ("wait", inside, "caller_side") in log
    assert log.index(("wait", inside, "caller_side")) < next(i for i, e in enumerate(log) if e[0] == "copy")
    assert log[-1] == ("sync", inside) and torch.cuda.current_stream().name == "default"
    # extents without a ready point (a save made on the caller's thread): nothing entered
    n = len(log)
    ext.ready = None
    with fp_core.io.writer.device_work_after_save([ext]):
        assert torch.cuda.current_stream().name == "default"
    assert len(log) == n


def test_a_failing_stream_wait_does_not_hide_the_error_on_its_way_out(caplog):
    """The streams are waited for in ``finally``: a sticky CUDA error there is logged, not
    raised over the error that made the copies stop (and raised when there is none)."""

    class Sticky:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(MemoryError, match="pinned"):
        try:
            raise MemoryError("pinned allocation failed")
        finally:
            fp_core.io.writer._synchronize([Sticky()])
    assert "illegal memory access" in caplog.text
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fp_core.io.writer._synchronize([Sticky()])
