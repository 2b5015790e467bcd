"""CUDA sources: staged through pinned host memory on a side stream. Skipped without a GPU.

Selected by ``pytest -m cuda`` (benchmarks/gpu_check.sh runs them on a lent GPU). What can
be checked without a device is checked on the CPU in tests/core/test_cuda_logic.py.

* byte-exact round trips of device tensors of every dtype, views and non-contiguous ones
  included, through fp_core.save and both async policies; loads with ``map_location``;
* ``overlap`` / ``snapshot`` with the optimizer stepping right after ``save()``: the file
  holds the state at ``save()``; kernels on another stream after the fence (and on small
  tensors, copied inside ``save()``, right after it) never reach the file; work the caller
  queued on its own current stream before ``save()`` does;
* pinned staging memory within its budget over 50 saves; ``auto`` reaching ``snapshot``;
* Lightning and the HF Trainer on the GPU: the same files as stock, holding the state at
  each save; the replica check's sampling of device tensors.
"""

from __future__ import annotations

import copy
import gc
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic GEMMs: stock and FastPersist runs compare

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import assert_no_temps, rss_bytes  # noqa: E402
from test_cuda_logic import assert_same_tensors, assert_views_share_storage, dtype_state  # noqa: E402

import fp_core  # noqa: E402
import fp_core.io.writer  # noqa: E402
from fp_core.format.plan import StorageExtent, build, byte_view  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MiB = 1 << 20


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def assert_equal_values(want, got, where: str = "ckpt") -> None:
    """Exact equality (values and dtypes, any device) of nested checkpoint objects."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert want.dtype == got.dtype and want.shape == got.shape, f"{where}: dtype/shape differ"
        a, b = want.detach().cpu(), got.detach().cpu()
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "-"
            raise AssertionError(f"{where}: values differ (max abs diff {diff})")
    elif isinstance(want, dict):
        assert set(want) == set(got), f"{where}: keys {set(want) ^ set(got)}"
        for k in want:
            assert_equal_values(want[k], got[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(want) == len(got), where
        for i, (x, y) in enumerate(zip(want, got)):
            assert_equal_values(x, y, f"{where}[{i}]")
    else:
        assert want == got, f"{where}: {want!r} != {got!r}"


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles for about ``seconds`` of torch.cuda._sleep."""
    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 2_000_000
    return int(seconds * rate_khz * 1e3)


# ====================================================================== round trips


def test_cuda_round_trip_keeps_device_and_aliasing(disk_dir):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 1024, device="cuda", generator=g)
    s = {"w": w, "view": w[3:7], "h": torch.randn(333, device="cuda", generator=g).half(),
         "cpu": torch.arange(10), "bf": torch.ones(5, device="cuda", dtype=torch.bfloat16)}
    path = os.path.join(disk_dir, "c.pt")
    fp_core.save(s, path)
    got = torch.load(path)
    assert got["w"].device.type == "cuda" and got["cpu"].device.type == "cpu"
    for k in s:
        assert torch.equal(got[k].cpu(), s[k].cpu())
    assert got["view"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
    fp_core.verify(path)
    cpu = fp_core.load(path, map_location="cpu")
    assert torch.equal(cpu["w"], s["w"].cpu())


@pytest.mark.parametrize("how", ["save", "overlap", "snapshot"])
def test_every_dtype_and_view_round_trips_byte_exact(disk_dir, how):
    state = dtype_state("cuda")
    path = os.path.join(disk_dir, f"{how}.pt")
    if how == "save":
        st = fp_core.save(state, path)
        assert st.device_copy_seconds > 0
    else:
        with fp_core.AsyncCheckpointer(policy=how) as ckpt:
            h = ckpt.save(state, path)
        assert h.result().policy == how
    fp_core.verify(path)
    for got, device in ((torch.load(path, weights_only=True), "cuda"),
                        (fp_core.load(path, weights_only=True, verify=True), "cuda"),
                        (fp_core.load(path, weights_only=True, map_location="cpu"), "cpu")):
        assert_same_tensors(state, got, device=device)
        assert_views_share_storage(got)
    assert_no_temps(disk_dir)


def test_safetensors_of_device_tensors_larger_than_a_staging_batch(disk_dir, monkeypatch):
    """A model over DEVICE_BATCH_BYTES (save_pretrained of BERT-base on a GPU: 440 MB): the
    staging batches of a packed safetensors file must still start block-aligned."""
    from safetensors.torch import load_file

    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", 1 * MiB)
    g = torch.Generator(device="cuda").manual_seed(5)
    tensors = {f"layer{i}.weight": torch.randn(n, device="cuda", generator=g)
               for i, n in enumerate((300_001, 250_003, 333_333, 7, 600_001))}
    for how in ("save", "async"):
        path = os.path.join(disk_dir, f"{how}.safetensors")
        if how == "save":
            fp_core.save(tensors, path, format="safetensors")
        else:
            with fp_core.AsyncCheckpointer(policy="overlap") as ckpt:
                ckpt.save(tensors, path, format="safetensors")
        got = load_file(path)
        for k, t in tensors.items():
            assert torch.equal(got[k], t.cpu()), (how, k)


def test_safetensors_format_with_device_tensors(disk_dir):
    from safetensors.torch import load_file

    g = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(256, 300, device="cuda", generator=g)
    tensors = {"w": base, "nc": base.t()[:, ::3], "h": base[:7].half(), "bf": base[:5].bfloat16(),
               "i": torch.arange(100, device="cuda", dtype=torch.int32)}
    path = os.path.join(disk_dir, "m.safetensors")
    fp_core.save(tensors, path, format="safetensors")
    got = load_file(path)
    for k, t in tensors.items():
        assert torch.equal(got[k], t.cpu().contiguous()), k


@pytest.mark.parametrize("map_location", ["cuda", "cuda:0", torch.device("cuda", 0), {"cpu": "cuda:0"},
                                          lambda storage, loc: storage.cuda()],
                         ids=["str", "str-index", "device", "dict", "callable"])
def test_map_location_cuda_loads_through_fp_core_load(disk_dir, map_location):
    g = torch.Generator().manual_seed(2)
    state = {"w": torch.randn(512, 1024, generator=g), "v": None, "i": torch.arange(7)}
    state["v"] = state["w"][10:20]
    path = os.path.join(disk_dir, "cpu.pt")
    fp_core.save(state, path)
    for verify in (False, True):
        got = fp_core.load(path, map_location=map_location, weights_only=True, verify=verify)
        for k in ("w", "v", "i"):
            assert got[k].device.type == "cuda", k
            assert torch.equal(got[k].cpu(), state[k])
        assert got["v"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


def test_device_checkpoint_loads_where_it_was_and_where_asked(disk_dir):
    state = {"w": torch.randn(300, 300, device="cuda"), "c": torch.ones(3)}
    path = os.path.join(disk_dir, "dev.pt")
    fp_core.save(state, path)
    assert fp_core.load(path)["w"].device.type == "cuda"
    assert fp_core.load(path, map_location="cpu")["w"].device.type == "cpu"
    assert fp_core.load(path, map_location={"cuda:0": "cpu"})["w"].device.type == "cpu"


# ====================================================================== consistency under async


class Net(torch.nn.Module):
    """Embedding (the bulk of the bytes) + Linear + BatchNorm (buffers that change in forward)."""

    def __init__(self, vocab: int = 250_000, width: int = 1024) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)  # 1 GB at the default: the write outlasts a step
        self.fc = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)

    def forward(self, ids):
        return self.bn(self.fc(self.emb(ids)))


def _train_step(model, opt, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, model.emb.num_embeddings, (64,), device="cuda", generator=g)
    loss = model(ids).square().mean()
    opt.zero_grad(set_to_none=False)
    loss.backward()


def _model_and_state(vocab: int = 250_000, fused: bool = False):
    """Net with Adam, one step taken. torch's Adam keeps each ``step`` on the CPU (a CPU
    storage after every parameter's moments in the file); ``fused=True`` keeps it on the GPU."""
    torch.manual_seed(0)
    model = Net(vocab).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    _train_step(model, opt, 0)
    opt.step()
    return model, opt


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_checkpoint_equals_state_at_save_time(disk_dir, policy):
    model, opt = _model_and_state()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 1}
    expected = _to_cpu(state)
    path = os.path.join(disk_dir, f"{policy}.pt")
    with fp_core.AsyncCheckpointer(policy=policy) as ckpt:
        h = ckpt.save(state, path)
        _train_step(model, opt, 1)  # BatchNorm statistics change in forward (small: copied in save())
        with torch.no_grad():
            model.bn.running_mean.add_(100.0)
            model.bn.num_batches_tracked.add_(5)
        still_running = not h.done()
        opt.step()  # fenced by the installed hook
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ckpt.wait()
    assert h.result().policy == policy
    got = torch.load(path, map_location="cpu", weights_only=True)
    assert_equal_values(expected, got)
    assert got["model"]["emb.weight"].dtype == torch.float32
    fp_core.verify(path)
    if not still_running:
        pytest.skip("the write finished before the step (fast disk): overlap with training not exercised")


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_optimizer_step_on_another_stream_after_the_fence_does_not_reach_the_file(disk_dir, policy):
    model, opt = _model_and_state(fused=True)  # every storage on the GPU: only the stream ordering is tested
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = _to_cpu(state)
    side = torch.cuda.Stream()
    path = os.path.join(disk_dir, f"{policy}.pt")
    with fp_core.AsyncCheckpointer(policy=policy) as ckpt:
        ckpt.save(state, path)
        _train_step(model, opt, 1)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            opt.step()  # the hook fences on the host, then the update runs on the side stream
            torch.cuda._sleep(_sleep_cycles(0.05))
            with torch.no_grad():
                model.emb.weight.fill_(7.0)
        torch.cuda.current_stream().wait_stream(side)
        ckpt.wait()
    assert_equal_values(expected, torch.load(path, map_location="cpu", weights_only=True))


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_small_tensor_written_on_another_stream_right_after_save_keeps_its_save_time_value(disk_dir, policy):
    """Tensors up to ``small_tensor_bytes`` (BatchNorm statistics, counters) are copied inside
    ``save()``: a kernel on any stream right after it, with no fence, does not reach the file."""
    big = torch.randn(64 * MiB // 4, device="cuda")
    small = torch.arange(1000, device="cuda", dtype=torch.float32)
    expected = small.cpu()
    side = torch.cuda.Stream()
    path = os.path.join(disk_dir, f"{policy}.pt")
    with fp_core.AsyncCheckpointer(policy=policy) as ckpt:
        h = ckpt.save({"big": big, "small": small}, path)
        with torch.cuda.stream(side):
            small.fill_(-1.0)
        side.synchronize()
        h.result()
    got = torch.load(path, map_location="cpu", weights_only=True)
    assert torch.equal(got["small"], expected)
    assert torch.equal(got["big"], big.cpu())


@pytest.mark.parametrize("how", ["save", "overlap", "snapshot"])
def test_save_sees_work_queued_on_the_callers_current_stream(disk_dir, how):
    """A caller on a stream of its own (an optimizer step queued there, not yet run) and then
    ``save()`` in the same stream context: the file holds the result, as torch.save's copies
    (ordered on the current stream) would. The background writer runs on another thread,
    whose current stream is the default one: it must order its copies after the caller's
    stream as it was at ``save()``, not after its own."""
    big = torch.zeros(64 * MiB // 4, device="cuda")
    odd = torch.zeros(1_000_003, device="cuda")  # ends off a block: a sync save stages its last block apart
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    path = os.path.join(disk_dir, f"{how}.pt")
    ckpt = fp_core.AsyncCheckpointer(policy=how) if how != "save" else None
    try:
        with torch.cuda.stream(side):
            torch.cuda._sleep(_sleep_cycles(0.3))  # the "step" is still running when save() is called
            big.fill_(3.0)
            odd.fill_(3.0)
            if ckpt is None:
                fp_core.save({"big": big, "odd": odd}, path)
            else:
                ckpt.save({"big": big, "odd": odd}, path)
        if ckpt is not None:
            ckpt.wait()
    finally:
        if ckpt is not None:
            ckpt.close()
    for name, got in torch.load(path, map_location="cpu", weights_only=True).items():
        assert bool((got == 3.0).all()), \
            f"{name}: the file holds values from before the caller's queued work ({got[:4]}, {got[-4:]})"


def test_overlap_with_device_batches_and_cpu_step_tensors(disk_dir, monkeypatch):
    """torch's Adam keeps ``step`` on the CPU for a CUDA model: device storages larger than
    a staging batch followed by CPU scalars in the file (the batches must still be cut at
    block boundaries for O_DIRECT)."""
    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", 1 * MiB)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    assert any(v["step"].device.type == "cpu" for v in opt.state_dict()["state"].values())
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = _to_cpu(state)
    path = os.path.join(disk_dir, "adam.pt")
    with fp_core.AsyncCheckpointer(policy="overlap") as ckpt:
        ckpt.save(state, path)
    assert_equal_values(expected, torch.load(path, map_location="cpu", weights_only=True))
    fp_core.verify(path)


# ====================================================================== pinned memory


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pinned_stats() -> dict | None:
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None:
        return None
    try:
        st = fn()
    except Exception:  # noqa: BLE001 - not on this torch build
        return None
    return st if "allocated_bytes.current" in st else None


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_pinned_staging_stays_within_budget_over_50_saves(disk_dir, monkeypatch, policy):
    batch = 32 * MiB
    monkeypatch.setattr(fp_core.io.writer, "DEVICE_BATCH_BYTES", batch)
    g = torch.Generator(device="cuda").manual_seed(3)
    big = [torch.randn(n // 4, device="cuda", generator=g) for n in (12 * MiB,) * 4 + (40 * MiB,)]
    small = [torch.randn(16 * 1024, device="cuda", generator=g) for _ in range(16)]  # 64 KiB each
    state = {"big": big, "small": small, "cpu": torch.arange(100)}
    small_pinned = sum(_pow2(t.numel() * 4) for t in small)
    largest = max(t.numel() * 4 for t in big)
    total = sum(t.numel() * 4 for t in big + small)
    if policy == "overlap":  # one batch of staging copies (each rounded up to a power of two) + the small ones
        budget = 2 * max(batch, largest) + small_pinned
    else:  # the arena (registered, of its own size: fp_core.io.pinned_host) + the small ones
        budget = total + 4096 * (len(big) + len(small) + 2) + small_pinned
    budget += 4 * MiB
    paths = [os.path.join(disk_dir, f"{policy}{i}.pt") for i in (0, 1)]
    marks: dict[int, tuple[int, dict | None]] = {}
    expected = None
    with fp_core.AsyncCheckpointer(policy=policy) as ckpt:
        for i in range(50):
            if i == 10:
                ckpt.wait()
                if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
                    torch.cuda.reset_peak_host_memory_stats()
                marks[10] = (rss_bytes(), _pinned_stats())
            if i == 49:
                expected = _to_cpu(state)
            ckpt.save(state, paths[i % 2])
            ckpt.fence()
            with torch.no_grad():
                for t in big:
                    t.add_(1.0)
        ckpt.wait()
        marks[50] = (rss_bytes(), _pinned_stats())
        assert ckpt.hook_installed is False
    assert_equal_values(expected, torch.load(paths[1], map_location="cpu", weights_only=True))
    rss_growth = marks[50][0] - marks[10][0]
    assert rss_growth < 64 * MiB, f"host memory grew by {rss_growth / MiB:.0f} MiB over 40 saves"
    s10, s50 = marks[10][1], marks[50][1]
    if s10 is None or s50 is None:
        pytest.skip("this torch has no torch.cuda.host_memory_stats: only RSS was checked")
    grown = s50["allocated_bytes.current"] - s10["allocated_bytes.current"]
    assert grown <= 0, f"pinned memory held by the allocator grew by {grown / MiB:.1f} MiB over 40 saves"
    peak = s50.get("active_bytes.peak")
    if peak is not None:
        assert peak <= budget, f"pinned staging peaked at {peak / MiB:.0f} MiB, budget {budget / MiB:.0f} MiB"


def test_pinned_arena_is_registered_at_its_own_size_and_copies_asynchronously():
    """A snapshot arena for device tensors is page-locked memory of the size asked for
    (not torch's pinned allocator, which rounds 48 MiB + 1 page up to 64 MiB and keeps it
    cached), copies from the device into it are asynchronous, and dropping it releases it."""
    from fp_core.io.arena import Arena

    nbytes = 48 * MiB + 4096
    before = _pinned_stats()
    arena = Arena(nbytes, pin=True, huge=True)
    assert arena.buf.numel() == nbytes and arena.buf.is_pinned()
    after = _pinned_stats()
    if before is not None and after is not None:  # not taken from torch's caching host allocator
        assert after["allocated_bytes.current"] == before["allocated_bytes.current"]
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        arena.buf.copy_(src, non_blocking=True)
    side.synchronize()
    assert torch.equal(arena.buf, src.cpu())
    addr = arena.buf.data_ptr()
    del arena
    gc.collect()
    with open("/proc/self/maps") as f:  # unregistered, then unmapped (fp_core.io.pinned_host)
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f]
    assert not any(lo <= addr < hi for lo, hi in spans), "the arena's pages are still mapped after it was dropped"
    torch.cuda.synchronize()


def test_auto_reaches_snapshot_with_device_tensors(disk_dir, caplog):
    """auto writes its first save with overlap while the writer prepares a (pinned) arena,
    then snapshots into it: preparing a pinned arena must not fail."""
    g = torch.Generator(device="cuda").manual_seed(4)
    state = {"w": torch.randn(32 * MiB // 4, device="cuda", generator=g), "b": torch.randn(8, device="cuda")}
    stats = []
    with caplog.at_level("WARNING", logger="fastpersist"):
        with fp_core.AsyncCheckpointer(policy="auto") as ckpt:
            for i in range(3):
                stats.append(ckpt.save(state, os.path.join(disk_dir, f"auto{i}.pt")).result())
                ckpt.enqueue(lambda: None, after=[]).result()  # the writer has run the arena's warm-up too
    assert not [r for r in caplog.records if "snapshot arena" in r.getMessage()], caplog.text
    policies = [st.policy for st in stats]
    assert policies == ["overlap", "snapshot", "snapshot"], (policies, [st.extra.get("policy_reason") for st in stats])
    for i in range(3):
        assert_equal_values(state, torch.load(os.path.join(disk_dir, f"auto{i}.pt"), map_location="cpu"))


# ====================================================================== replica check


def _extent(t: torch.Tensor) -> StorageExtent:
    plan = build({"t": t}, 4096)
    assert len(plan.storages) == 1
    return plan.storages[0]


def test_replica_sample_sees_the_last_bytes_of_a_device_tensor():
    from fp_core.parallel.distributed import _sample_crc

    n = 4 * MiB
    a = torch.zeros(n, dtype=torch.uint8, device="cuda")
    last = a.clone()
    last[-8:] = 1
    first = a.clone()
    first[0] = 1
    assert _sample_crc(_extent(a)) == _sample_crc(_extent(a.clone())), "equal replicas must agree"
    assert _sample_crc(_extent(a)) != _sample_crc(_extent(first))
    assert _sample_crc(_extent(a)) != _sample_crc(_extent(last)), "a difference in the last bytes went unseen"
    f = torch.zeros(n // 4, device="cuda")
    g = f.clone()
    g[-1] = 1.0
    assert _sample_crc(StorageExtent(0, n, byte_view(f.untyped_storage()), 0)) != \
        _sample_crc(StorageExtent(0, n, byte_view(g.untyped_storage()), 0))


# ====================================================================== Lightning on the GPU


def _lightning():
    lp = pytest.importorskip("lightning.pytorch")
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fp_integrations.lightning import FastPersistIO
    return lp, TorchCheckpointIO, ModelCheckpoint, FastPersistIO


@pytest.fixture
def deterministic_cudnn():
    saved = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = saved


def test_lightning_gpu_trainer_writes_the_same_checkpoints_as_stock(disk_dir, deterministic_cudnn):
    lp, TorchCheckpointIO, ModelCheckpoint, FastPersistIO = _lightning()

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i]

    class Model(lp.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),
                                             torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 2))

        def training_step(self, batch, batch_idx):
            return self.layer(batch).square().mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Data(), batch_size=8)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    class CapturingIO(FastPersistIO):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.captured = {}

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.captured[os.path.basename(path)] = _to_cpu(
                {k: checkpoint[k] for k in ("state_dict", "optimizer_states", "global_step")})
            super().save_checkpoint(checkpoint, path, storage_options)

    dirs = {}
    fp_io = CapturingIO()
    for name, io in (("stock", TorchCheckpointIO()), ("fp", fp_io)):
        d = os.path.join(disk_dir, name)
        dirs[name] = d
        lp.seed_everything(7)
        mc = ModelCheckpoint(dirpath=d, save_top_k=-1, every_n_train_steps=1)
        trainer = lp.Trainer(default_root_dir=d, accelerator="gpu", devices=1, max_epochs=1, limit_train_batches=6,
                             limit_val_batches=0, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, plugins=[io], callbacks=[mc])
        trainer.fit(Model())
    files = sorted(os.listdir(dirs["fp"]))
    assert files == sorted(os.listdir(dirs["stock"])) and len(files) == 6
    assert not [n for n in files if n.endswith(".fptmp")]
    assert fp_io.fence_count >= 5
    for f in files:
        fp_path, stock_path = os.path.join(dirs["fp"], f), os.path.join(dirs["stock"], f)
        fp_core.verify(fp_path)
        got = torch.load(fp_path, map_location="cpu", weights_only=False)
        want = {k: got[k] for k in fp_io.captured[f]}
        assert_equal_values(fp_io.captured[f], want, f"{f} vs the state at its save")
        stock = torch.load(stock_path, map_location="cpu", weights_only=False)
        for k in ("state_dict", "optimizer_states", "global_step", "epoch"):
            assert_equal_values(stock[k], got[k], f"{f} vs stock: {k}")
        assert torch.load(fp_path, weights_only=False)["state_dict"]["layer.0.weight"].device.type == "cuda"


# ====================================================================== HF Trainer on the GPU


def test_hf_trainer_on_the_gpu_writes_the_same_checkpoints_as_stock(disk_dir):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from fp_integrations.hf import FastPersistCallback

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randint(0, 4096, (64, 16), generator=g)
            self.y = torch.randint(0, 2, (64,), generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.y[i]}

    class Capture(TrainerCallback):
        """The model and optimizer as they are when the step's checkpoint is taken."""

        def __init__(self):
            self.states = {}

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step % args.save_steps == 0:
                self.states[state.global_step] = (_to_cpu(model.state_dict()), _to_cpu(optimizer.state_dict()))

    def run(out, fp):
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=1024, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, attn_implementation="eager")
        model = BertForSequenceClassification(cfg)
        args = TrainingArguments(output_dir=out, max_steps=6, save_steps=2, per_device_train_batch_size=8,
                                 use_cpu=False, report_to=[], dataloader_num_workers=0, disable_tqdm=True,
                                 logging_steps=1, seed=42)
        cap = Capture()
        cbs = ([FastPersistCallback()] if fp else []) + [cap]
        t = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=cbs)
        t.train()
        assert next(t.model.parameters()).device.type == "cuda"
        return cap, (cbs[0] if fp else None)

    stock_dir, fp_dir = os.path.join(disk_dir, "stock"), os.path.join(disk_dir, "fp")
    stock_cap, _ = run(stock_dir, fp=False)
    fp_cap, cb = run(fp_dir, fp=True)
    assert [r.ok for r in cb.records] == [True, True, True]
    ckpts = sorted(n for n in os.listdir(fp_dir) if n.startswith("checkpoint-"))
    assert ckpts == sorted(n for n in os.listdir(stock_dir) if n.startswith("checkpoint-")) and len(ckpts) == 3
    for c in ckpts:
        step = int(c.split("-")[1])
        a, b = os.path.join(stock_dir, c), os.path.join(fp_dir, c)
        assert sorted(os.listdir(a)) == sorted(os.listdir(b)), c
        weights = load_file(os.path.join(b, "model.safetensors"))
        optim = torch.load(os.path.join(b, "optimizer.pt"), map_location="cpu", weights_only=True)
        model_sd, optim_sd = fp_cap.states[step]
        assert_equal_values({k: model_sd[k] for k in weights}, weights, f"{c} vs the model at its save")
        assert_equal_values(optim_sd["state"], optim["state"], f"{c} vs the optimizer at its save")
        assert_equal_values(load_file(os.path.join(a, "model.safetensors")), weights, f"{c} vs stock weights")
        stock_optim = torch.load(os.path.join(a, "optimizer.pt"), map_location="cpu", weights_only=True)
        assert_equal_values(stock_optim["state"], optim["state"], f"{c} vs stock optimizer")
