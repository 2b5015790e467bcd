"""``fastpersist bench --async``: what checkpointing every iteration costs a training loop.

A CPU MLP with Adam (default ~94M float32 parameters: a ~1.1 GB checkpoint of weights +
Adam state) trains for ``--iters`` measured iterations after ``--warmup``, saving a
checkpoint after every optimizer step, with each of these side by side in one process:

* ``none``       no checkpoint (the baseline step time)
* ``torch``      synchronous torch.save + fsync
* ``lightning``  Lightning's AsyncCheckpointIO(TorchCheckpointIO): clone every tensor on
                 the training thread, torch.save in a ThreadPoolExecutor(1)
* ``dcp``        torch.distributed.checkpoint.async_save (1-process gloo group), waiting
                 for the previous save's future before starting the next
* ``auto`` / ``overlap`` / ``snapshot``  fp_core.AsyncCheckpointer with that policy
                 (fence through the optimizer step pre-hook). Each mode's run starts a new
                 checkpointer, as a new training process would: ``snapshot`` fills a fresh
                 arena in its first save (the fence waits for it), ``auto`` writes its first
                 save with overlap and snapshots once an arena is warm
* ``overlap_bg`` / ``snapshot_bg``  the same with ``cpu_work_at_save=False``: the copy and
                 the checksums of CPU tensors on the background writer instead of inside
                 ``save()`` (the default for CPU tensors)
* ``overlap_huge``  overlap with ``collapse_live_tensors=True``: the live tensors are
                 moved onto huge pages once (in the first round; they stay there, so it
                 runs only beside ``none`` and ``disk``; compare with another run)
* ``snapshot_4k`` snapshot with ``huge_pages=False``: the arena on 4 KiB pages, as the
                 process writer's shared-memory arena is where shmem THP is off
* ``process``    AsyncCheckpointer(policy='snapshot', writer='process'): the writer in a
                 process of its own, snapshots in shared memory (its first save also starts
                 the process: a warm-up cost)
* ``disk``       no checkpoint: the same number of bytes written after each step from a
                 fixed buffer by the native engine (O_DIRECT, no checksums, no plan,
                 fsync), on a background thread, from ordinary memory (4 KiB pages where
                 THP is "madvise"). What the disk itself costs the step: on a virtual disk
                 the host's I/O work slows the guest's cores, by the page written
                 (AsyncCheckpointer's ``huge_pages`` writes from 2 MiB pages to avoid it)

Slowdown = a mode's total step time against the mean of the no-checkpoint runs right
before and right after it (every mode runs between two), median over ``--rounds``; with 6
rounds or more the targets also give that median's 95% confidence interval (order
statistics) and say whether the run settles the 5% target (on this VM rounds spread by
+-5 points: 12 rounds are what it took to tell anything apart).
CPU s/ckpt = the process's CPU time per iteration (user + system) minus the no-checkpoint
run's: what each checkpoint costs in CPU, which a CPU-bound training loop pays in steps.

Warm-up +s = how much longer the ``--warmup`` iterations (and their saves) took than the
no-checkpoint run's: one-time costs kept out of the measured steps, such as ``snapshot``'s
first fill of a fresh arena or the arena ``auto`` warms after its first save. Give enough
warm-up iterations for them to end (3 for ``auto`` with 2 s steps here), or they land on
the first measured steps.

Blocked time per checkpoint = time the training thread spends in the save call plus any
wait it causes later (the fence before the next step, a wait for the previous save).

``--device cuda`` (``--dtype float32|bfloat16|float16``) trains the same MLP on the GPU: the
checkpoint is then device memory, which every mode copies to the host its own way (torch.save
and DCP through pageable or pinned copies, AsyncCheckpointer through pinned staging on a side
stream). Each step ends with a device synchronisation (as a loop that logs its loss does), so
step times are the GPU's; the batch is calibrated the same way (``--compute-ms``), from larger
probe batches. ``--dry-run`` prints what would run (model, checkpoint size, modes) and exits
without touching a device: ``fastpersist bench --async --device cuda --dry-run`` checks a GPU
command line on a machine without one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..saving.commit import fsync_file
from .bench_args import DTYPE_NAMES, MODES, engine_options
from .common import describe_device, describe_pages, format_targets, payload_bytes, remove, tensors_in
from .procinfo import available_memory, cpu_seconds

LABELS = {
    "none": "no checkpoint",
    "disk": "  floor: same bytes to disk, no ckpt",
    "torch": "torch.save + fsync (sync)",
    "lightning": "Lightning AsyncCheckpointIO (clone + thread)",
    "dcp": "torch.distributed.checkpoint.async_save",
    "auto": "fp_core AsyncCheckpointer() (policy='auto')",
    "overlap": "fp_core AsyncCheckpointer(policy='overlap')",
    "snapshot": "fp_core AsyncCheckpointer(policy='snapshot')",
    "overlap_bg": "  overlap, CPU work in the background",
    "snapshot_bg": "  snapshot, CPU work in the background",
    "overlap_huge": "  overlap, live tensors moved to huge pages",
    "snapshot_4k": "  snapshot, arena on 4 KiB pages",
    "process": "fp_core AsyncCheckpointer(writer='process')",
}
HUGE_PAGE = 2 << 20
BACKGROUND_MODES = ("overlap_bg", "snapshot_bg")  # cpu_work_at_save=False
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class Trainer:
    """An MLP of ``layers`` Linear(width, width) + ReLU with Adam, on ``device`` in ``dtype``."""

    def __init__(self, width: int, layers: int, batch: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, fused_adam: bool = False) -> None:
        torch.manual_seed(seed)
        self.device = torch.device(device)
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(width, width, device=self.device, dtype=dtype), nn.ReLU()]
        self.model = nn.Sequential(*mods)
        self.dtype = dtype
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5, **({"fused": True} if fused_adam else {}))
        self.set_batch(batch)
        self.python_ops = 0  # small ops per step (a Python-heavy step: the GIL is busy)
        self._small = torch.zeros(8)

    def set_batch(self, batch: int) -> None:
        width = self.model[0].in_features
        self.x = torch.randn(batch, width, device=self.device, dtype=self.dtype)
        self.y = torch.randn(batch, width, device=self.device, dtype=self.dtype)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        small = self._small
        for _ in range(self.python_ops):  # each a Python call into torch, under the GIL
            small = small.add(1.0).mul_(0.5)
        self._small = small
        self.opt.step()
        if self.device.type == "cuda":  # the step is done when the GPU is (a loop logging its loss waits too)
            torch.cuda.current_stream(self.device).synchronize()  # this stream only, not a checkpoint's copies

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}


def checkpoint_bytes(width: int, layers: int, dtype: torch.dtype) -> int:
    """Tensor bytes of the MLP's checkpoint once Adam has stepped: every parameter three
    times (weights, exp_avg, exp_avg_sq) plus one float32 ``step`` scalar per parameter."""
    params = layers * (width * width + width)
    return 3 * params * torch.empty(0, dtype=dtype).element_size() + 2 * layers * 4


def max_batch_for(tr: Trainer, fraction: float = 0.5) -> int | None:
    """The largest batch whose activations (about six width-sized rows per layer and sample:
    outputs, ReLU outputs and their gradients) fit ``fraction`` of the free device memory
    (on the CPU: a quarter of MemAvailable, the checkpoints' copies need the rest); None
    where that cannot be read."""
    if tr.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(tr.device)
    else:
        free = available_memory()
        if free is None:
            return None
        fraction = min(fraction, 0.25)
    width, layers = tr.model[0].in_features, len(tr.model) // 2
    per_sample = 6 * layers * width * tr.x.element_size()
    return max(1, int(free * fraction) // per_sample)


def calibrate_batch(tr: Trainer, target_ms: float, tolerance: float = 0.05, tries: int = 4,
                    start: tuple[int, int] = (8, 64), max_batch: int | None = None) -> int:
    """Batch size whose step takes about target_ms: a linear fit of two small batches
    (``start``), then secant steps through measurements at the predicted batch until one
    lands within ``tolerance`` (step time is not linear in the batch from 8 up to
    thousands, so the fit alone, or one refit, can miss by far). ``max_batch``
    caps every guess (device memory); a GPU needs larger probes than 8 and 64, whose steps
    only measure kernel launches."""

    def step_ms(b: int) -> float:
        tr.set_batch(b)
        tr.step()
        ts = []
        for _ in range(2):
            t0 = time.perf_counter()
            tr.step()
            ts.append(time.perf_counter() - t0)
        return min(ts) * 1e3

    def fit(p: tuple[int, float], q: tuple[int, float]) -> int:
        per = (q[1] - p[1]) / (q[0] - p[0]) if q[0] != p[0] else 0.0
        if per <= 0:
            # no slope measured (noise, a pause of the VM while one was timed): step from
            # what was measured, never extrapolate (a floored slope asked for millions)
            below = [b for b, t in (p, q) if t < target_ms]
            guess = 4 * max(below) if below else max(1, min(p[0], q[0]) // 2)
        else:
            guess = max(1, int(round(p[0] + (target_ms - p[1]) / per)))
        return min(guess, max_batch) if max_batch else guess

    small, large = start
    if max_batch:
        large = min(large, max_batch)
        small = min(small, max(1, large // 8))
    p = (small, step_ms(small))
    q = (large, step_ms(large))
    guess = fit(p, q)
    for _ in range(tries):
        if guess <= large or guess in (p[0], q[0]):
            break
        p, q = q, (guess, step_ms(guess))
        if abs(q[1] - target_ms) <= tolerance * target_ms:
            break
        guess = fit(p, q)
    return guess


class Mode:
    """One way of checkpointing: ``save`` after each step, ``before_step`` hooks, ``drain``."""

    blocked: float = 0.0  # accumulated blocked seconds on the training thread

    def __init__(self, path: str) -> None:
        self.path = path
        self.blocked = 0.0

    def save(self, tr: Trainer) -> None:
        pass

    def drain(self) -> None:
        pass


class DiskOnly(Mode):
    """The checkpoint's byte count written from a fixed aligned buffer after each step
    (one write in flight; waiting for the previous one counts as blocked)."""

    def __init__(self, path: str, tr: Trainer, engine_options: dict[str, Any], huge: bool = True) -> None:
        super().__init__(path)
        import mmap
        from concurrent.futures import ThreadPoolExecutor

        from .. import _native
        from ..io.engine import EngineOptions
        self.options = EngineOptions(**engine_options)
        tensors = tensors_in(tr.state())  # device tensors too: their bytes are what a checkpoint writes
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if huge:
            # Where the disk's work alone is measured from: FastPersist's own buffers (staging,
            # arena) sit on 2 MiB pages, and writing from 4 KiB ones costs this VM's guest far
            # more while it runs (docs/performance.md, "The slowdown and the disk floor").
            m = mmap.mmap(-1, self.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.raw = torch.frombuffer(m, dtype=torch.uint8)
            skip = -self.raw.data_ptr() % HUGE_PAGE
            _native.advise_huge(self.raw.data_ptr() + skip, self.nbytes)
        else:
            self.raw = torch.empty(self.nbytes + 4096, dtype=torch.uint8)
            skip = -self.raw.data_ptr() % 4096
        self.buf = self.raw[skip:skip + self.nbytes]
        pos = 0
        for t in tensors:  # the checkpoint's own bytes, should the disk care what it stores
            n = t.numel() * t.element_size()
            self.buf[pos:pos + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            pos += n
        # Say which pages the floor writes from: THP "always" or torch's THP_MEM_ALLOC_ENABLE
        # put this buffer on 2 MiB pages, and the floor then costs less than from 4 KiB.
        from .procinfo import huge_page_bytes
        huge = huge_page_bytes(self.buf.data_ptr(), self.nbytes)
        pages = "2 MiB pages" if huge >= self.nbytes // 2 else "4 KiB pages"
        self.label = LABELS["disk"].replace(", no ckpt", f" ({pages}), no ckpt")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="bench-disk")
        self.future: Any = None

    def _write(self) -> None:
        from ..io.engine import open_engine
        tmp = self.path + ".tmp"  # a new file replacing the last, as a checkpoint commit does
        eng = open_engine(tmp, self.options)
        try:
            eng.write([(0, self.buf.data_ptr(), self.nbytes)], 0, self.nbytes, checksum=False, zero_copy=True)
            eng.truncate(self.nbytes)
            eng.sync()
        finally:
            eng.close()
        os.replace(tmp, self.path)

    def save(self, tr: Trainer) -> None:
        t0 = time.perf_counter()
        if self.future is not None:
            self.future.result()
        self.blocked += time.perf_counter() - t0
        self.future = self.pool.submit(self._write)

    def drain(self) -> None:
        if self.future is not None:
            self.future.result()
        self.pool.shutdown()


class TorchSync(Mode):
    def save(self, tr: Trainer) -> None:
        t0 = time.perf_counter()
        torch.save(tr.state(), self.path)
        fsync_file(self.path)
        self.blocked += time.perf_counter() - t0


class LightningAsync(Mode):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, tr: Trainer) -> None:
        t0 = time.perf_counter()
        self.io.save_checkpoint(tr.state(), self.path)
        self.blocked += time.perf_counter() - t0

    def drain(self) -> None:
        self.io.teardown()


class DcpAsync(Mode):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        import torch.distributed as dist
        self.dist = dist
        self.owns_pg = False
        if not dist.is_initialized():
            store = tempfile.mktemp(prefix="fp-bench-store-", dir=os.path.dirname(path))
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
            self.owns_pg, self.store = True, store
        self.future: Any = None

    def save(self, tr: Trainer) -> None:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        if self.future is not None:
            self.future.result()  # DCP's documented pattern: one save in flight
        self.future = dcp.async_save(tr.state(), storage_writer=dcp.FileSystemWriter(self.path, sync_files=True))
        self.blocked += time.perf_counter() - t0

    def drain(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None
        if self.owns_pg:
            self.dist.destroy_process_group()
            try:
                os.unlink(self.store)
            except OSError:
                pass


class FastPersistAsync(Mode):
    def __init__(self, path: str, policy: str, engine_options: dict[str, Any],
                 cpu_work_at_save: bool | None = None, collapse_live_tensors: bool = False,
                 writer: str = "thread", huge_pages: bool = True) -> None:
        super().__init__(path)
        from ..pipeline.checkpointer import AsyncCheckpointer
        self.ckpt = AsyncCheckpointer(policy=policy, cpu_work_at_save=cpu_work_at_save,
                                      collapse_live_tensors=collapse_live_tensors, writer=writer,
                                      huge_pages=huge_pages, **engine_options)
        inner = self.ckpt.fence

        def timed_fence() -> None:  # the optimizer pre-hook calls self.fence()
            t0 = time.perf_counter()
            inner()
            self.blocked += time.perf_counter() - t0
        self.ckpt.fence = timed_fence  # type: ignore[method-assign]
        self.stats: list[Any] = []

    def save(self, tr: Trainer) -> None:
        t0 = time.perf_counter()
        h = self.ckpt.save(tr.state(), self.path)
        self.blocked += time.perf_counter() - t0
        self.handles = getattr(self, "handles", []) + [h]

    def drain(self) -> None:
        self.ckpt.close()
        self.stats = [h.result() for h in getattr(self, "handles", [])]
        self.huge_page_bytes = self.ckpt.huge_page_bytes


def run_mode(mode_name: str, tr: Trainer, workdir: str, iters: int, warmup: int,
             engine_options: dict[str, Any], floor_huge: bool = True) -> dict[str, Any]:
    path = os.path.join(workdir, f"async-{mode_name}" + (".dcp" if mode_name == "dcp" else ".pt"))
    mode: Mode
    if mode_name == "none":
        mode = Mode(path)
    elif mode_name == "disk":
        mode = DiskOnly(path, tr, engine_options, huge=floor_huge)
    elif mode_name == "torch":
        mode = TorchSync(path)
    elif mode_name == "lightning":
        mode = LightningAsync(path)
    elif mode_name == "dcp":
        mode = DcpAsync(path)
    elif mode_name == "overlap_huge":
        mode = FastPersistAsync(path, "overlap", engine_options, collapse_live_tensors=True)
    elif mode_name == "snapshot_4k":
        mode = FastPersistAsync(path, "snapshot", engine_options, huge_pages=False)
    elif mode_name == "process":
        mode = FastPersistAsync(path, "snapshot", engine_options, writer="process")
    elif mode_name in BACKGROUND_MODES:
        mode = FastPersistAsync(path, mode_name.removesuffix("_bg"), engine_options, cpu_work_at_save=False)
    else:
        mode = FastPersistAsync(path, mode_name, engine_options)
    steps = []
    warm = []  # the warm-up iterations' steps: where one-time costs (a fresh arena) land
    blocked = []
    cpu0 = 0.0
    try:
        for i in range(warmup + iters):
            if i == warmup:
                cpu0 = cpu_seconds()
            b0 = mode.blocked
            t0 = time.perf_counter()
            tr.step()
            mode.save(tr)
            dt = time.perf_counter() - t0
            if i >= warmup:
                steps.append(dt)
                blocked.append(mode.blocked - b0)
            else:
                warm.append(dt)
        cpu_per_iter = (cpu_seconds() - cpu0) / max(1, iters)
        t0 = time.perf_counter()
        mode.drain()
        drain = time.perf_counter() - t0
    except BaseException:
        try:  # stop its background work before the next mode runs; the first error is the one reported
            mode.drain()
        except BaseException:  # noqa: BLE001
            pass
        remove(path)
        raise
    out = {"mode": mode_name, "label": getattr(mode, "label", LABELS[mode_name]), "step_seconds": steps,
           "median_step": statistics.median(steps), "mean_step": statistics.mean(steps),
           "total_seconds": sum(steps), "warmup_seconds": sum(warm), "blocked_per_ckpt": statistics.mean(blocked) if mode_name != "none" else 0.0,
           "drain_seconds": drain, "cpu_per_iter": cpu_per_iter}
    if isinstance(mode, FastPersistAsync) and mode.stats:
        st = mode.stats[-1]
        out["fp_stats"] = {"seconds": st.seconds, "write_seconds": st.write_seconds, "policy": st.policy,
                           "snapshot_seconds": st.extra.get("snapshot_seconds"), "backend": st.backend,
                           "at_save_seconds": st.extra.get("at_save_seconds"),
                           "device_copy_seconds": st.device_copy_seconds,
                           "huge_page_bytes": mode.huge_page_bytes,
                           # every save's policy in order, warm-up included (auto changes its mind)
                           "policies": [x.policy for x in mode.stats]}
    remove(path)
    del mode
    gc.collect()
    if tr.device.type == "cuda":  # clones and staging copies a mode left in the caching allocator
        torch.cuda.empty_cache()
    os.sync()  # a mode's dirty page cache must not be written back during the next one
    return out


def measure_writes(tr: Trainer, workdir: str, engine_options: dict[str, Any]) -> dict[str, float]:
    """The write alone, on an idle machine: fp_core.save and torch.save + fsync (best of 2)."""
    from ..api import save
    p = os.path.join(workdir, "async-write-probe.pt")
    fp, ts = [], []
    for _ in range(2):
        fp.append(save(tr.state(), p, **engine_options).seconds)
        os.unlink(p)
        t0 = time.perf_counter()
        torch.save(tr.state(), p)
        fsync_file(p)
        ts.append(time.perf_counter() - t0)
        os.unlink(p)
    return {"fastpersist_save": min(fp), "torch_save": min(ts)}


def run_async(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
    if "overlap_huge" in modes and set(modes) - {"none", "disk", "overlap_huge"}:
        raise SystemExit("--modes: overlap_huge moves the trainer's tensors onto huge pages for the rest of "
                         "the process, so every later mode would write from them too: run it with none,disk only")
    device = torch.device(getattr(args, "device", "cpu"))
    dtype = DTYPES[getattr(args, "dtype", "float32")]
    if getattr(args, "dry_run", False):
        return _dry_run(args, modes, device, dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "--dry-run checks the command line without one")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    workdir = args.dir
    os.makedirs(workdir, exist_ok=True)
    eng = engine_options(args)
    fused = getattr(args, "adam", "default") == "fused"
    tr = Trainer(args.width, args.layers, args.batch or 8, device=device, dtype=dtype, fused_adam=fused)
    tr.python_ops = getattr(args, "python_ops", 0)
    if args.batch:
        batch = args.batch
    elif device.type == "cuda":  # 8 and 64 only time kernel launches on a GPU
        batch = calibrate_batch(tr, args.compute_ms, start=(64, 1024), max_batch=max_batch_for(tr))
    else:
        batch = calibrate_batch(tr, args.compute_ms, max_batch=max_batch_for(tr))
    tr.set_batch(batch)
    tr.step()  # Adam state exists from here on
    nbytes = payload_bytes(tr.state())
    nparams = sum(p.numel() for p in tr.model.parameters())
    where = describe_device(tr.device)
    log(f"MLP {args.layers}x{args.width} {str(dtype).removeprefix('torch.')} on {where}, {'fused ' if fused else ''}Adam: "
        f"{nparams / 1e6:.1f}M params, "
        f"checkpoint {nbytes / 1e9:.2f} GB, batch {batch}, torch threads {torch.get_num_threads()}, "
        f"{f'{tr.python_ops} small Python ops per step, ' if tr.python_ops else ''}"
        f"engine options {eng or 'defaults'}")
    huge_share, pages_line = describe_pages(tr.state())
    log(pages_line)  # what overlap writes in place from, and what a snapshot copies from
    writes = None
    if getattr(args, "write_probe", True):
        writes = measure_writes(tr, workdir, eng)
        log(f"write alone: fp_core.save {writes['fastpersist_save']:.2f} s, "
            f"torch.save+fsync {writes['torch_save']:.2f} s")
    # Every mode runs between two no-checkpoint runs and is measured against their mean:
    # a VM's step time drifts over the minutes of a round, and a baseline taken only at
    # the start (or the ends) of the round lands that drift on the modes.
    rounds = max(1, getattr(args, "rounds", 1))
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    base_for: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    failed: dict[str, str] = {}  # a mode that raised: reported, left out of later rounds

    def run(m: str, rnd: int) -> dict[str, Any]:
        log(f"  round {rnd + 1}/{rounds}: {LABELS[m]} ...")
        r = run_mode(m, tr, workdir, args.iters, args.warmup, eng,
                     floor_huge=getattr(args, "floor_pages", "huge") == "huge")
        # one line per run as it ends: a run cut short by a time limit still leaves its figures
        log(f"    {m}: step median {r['median_step']:.3f} s, total {r['total_seconds']:.2f} s, blocked/ckpt "
            f"{r['blocked_per_ckpt']:.3f} s, warm-up {r['warmup_seconds']:.2f} s, drain {r['drain_seconds']:.2f} s"
            + (f", policies {r['fp_stats']['policies']}" if r.get("fp_stats") else ""))
        return r

    def attempt(m: str, rnd: int) -> dict[str, Any] | None:
        if m == "none":  # the baseline must run: without it no row means anything
            return run(m, rnd)
        try:
            return run(m, rnd)
        except Exception as e:  # noqa: BLE001 - one failing competitor must not stop the table
            failed[m] = f"{type(e).__name__}: {e}"
            per_mode[m].clear()
            base_for[m].clear()
            log(f"    {m} failed: {failed[m]}")
            return None

    for rnd in range(rounds):
        if "none" not in modes:
            for m in modes:
                if m not in failed and (r := attempt(m, rnd)) is not None:
                    per_mode[m].append(r)
            continue
        nones = [run("none", rnd)]
        for m in modes:
            if m == "none" or m in failed:
                continue
            r = attempt(m, rnd)
            if r is None:
                continue
            per_mode[m].append(r)
            nones.append(run("none", rnd))
            base_for[m].append(_mean_runs(nones[-2:]))
        per_mode["none"].append(_mean_runs(nones))
        base_for["none"].append(per_mode["none"][-1])
    results = [{"mode": m, "label": LABELS[m], "error": failed[m]} if m in failed
               else merge_rounds(per_mode[m], base_for[m] or None, per_mode.get("torch")) for m in modes]
    base = next((r for r in results if r["mode"] == "none"), None)
    res = {"checkpoint_bytes": nbytes, "params": nparams, "batch": batch, "iters": args.iters, "rounds": rounds,
           "warmup": args.warmup, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
           "device": str(tr.device), "device_name": where, "dtype": str(dtype).removeprefix("torch."),
           "adam": "fused" if fused else "default",
           "engine_options": eng, "compute_seconds": base["median_step"] if base else None,
           "write_alone_seconds": writes, "huge_page_share": huge_share, "pages": pages_line, "modes": results}
    floor = next((r for r in results if r["mode"] == "disk" and r.get("slowdown_per_round")), None)
    if floor:
        for r in results:
            if r["mode"] not in ("none", "disk") and r.get("slowdown_per_round"):
                r["over_floor"] = statistics.median(
                    a - b for a, b in zip(r["slowdown_per_round"], floor["slowdown_per_round"]))
    res["targets"] = async_targets(res)
    if getattr(args, "plot", None):
        plot_async(res, args.plot)
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(format_async(res))
    return 0


def _dry_run(args: argparse.Namespace, modes: list[str], device: torch.device, dtype: torch.dtype) -> int:
    """What the command would run, from its arguments alone (no device, no disk touched)."""
    nbytes = checkpoint_bytes(args.width, args.layers, dtype)
    plan = {"dry_run": True, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "adam": getattr(args, "adam", "default"),
            "cuda_available": torch.cuda.is_available(), "width": args.width, "layers": args.layers,
            "params": args.layers * (args.width ** 2 + args.width), "checkpoint_bytes": nbytes,
            "modes": modes, "iters": args.iters, "warmup": args.warmup, "rounds": max(1, args.rounds),
            "batch": args.batch, "compute_ms": args.compute_ms, "write_probe": getattr(args, "write_probe", True),
            "dir": os.path.abspath(args.dir), "engine_options": engine_options(args)}
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        runs = len(modes) + (len(modes) - 1 if "none" in modes else 0)
        adam = "fused Adam" if plan["adam"] == "fused" else "Adam"
        print(f"dry run: MLP {args.layers}x{args.width} {plan['dtype']} on {device} "
              f"({plan['params'] / 1e6:.1f}M params + {adam}), a {nbytes / 1e9:.2f} GB checkpoint after every step; "
              f"modes {','.join(modes)} ({runs} runs per round with the baselines), "
              f"{args.warmup} warm-up + {args.iters} measured iterations each, {plan['rounds']} round(s); "
              f"batch {args.batch or f'calibrated to ~{args.compute_ms:.0f} ms'}; dir {plan['dir']}"
              + ("" if device.type != "cuda" or plan["cuda_available"] else "; no CUDA device here"))
    return 0


def _mean_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Baseline runs as one: their steps pooled, totals and CPU averaged."""
    out = dict(runs[0])
    out["step_seconds"] = [x for r in runs for x in r["step_seconds"]]
    for k in ("total_seconds", "warmup_seconds", "cpu_per_iter"):
        out[k] = statistics.mean(r[k] for r in runs)
    out["median_step"] = statistics.median(out["step_seconds"])
    out["mean_step"] = statistics.mean(out["step_seconds"])
    return out


def merge_rounds(runs: list[dict[str, Any]], base: list[dict[str, Any]] | None,
                 sync: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One row from a mode's rounds: slowdown and blocked ratio are medians of per-round
    values, each against the baseline (no checkpoint / torch.save) of the same round."""
    steps = [x for r in runs for x in r["step_seconds"]]
    out = dict(runs[-1])
    out.update(step_seconds=steps, median_step=statistics.median(steps), mean_step=statistics.mean(steps),
               total_seconds=sum(r["total_seconds"] for r in runs),
               blocked_per_ckpt=statistics.mean(r["blocked_per_ckpt"] for r in runs),
               drain_seconds=max(r["drain_seconds"] for r in runs),
               cpu_per_iter=statistics.median(r["cpu_per_iter"] for r in runs))
    out["slowdown_per_round"] = [r["total_seconds"] / b["total_seconds"] - 1 for r, b in zip(runs, base)] if base else []
    out["slowdown"] = statistics.median(out["slowdown_per_round"]) if base else None
    costed = bool(base) and out["mode"] != "none"  # the baseline is not measured against itself
    out["slowdown_ci"] = median_ci(out["slowdown_per_round"]) if costed else None
    # The same difference in seconds per iteration. Not a fixed price per checkpoint on this
    # VM: the floor's was 0.12 s at 2.1 s steps and 0.19 s at 3.6 s (a guess: the host's
    # share of the disk's work outlasts the write), so it cannot say from which step length
    # a slowdown target would hold.
    out["cost_per_round"] = [(r["total_seconds"] - b["total_seconds"]) / len(r["step_seconds"])
                             for r, b in zip(runs, base)] if base else []
    out["cost_per_ckpt"] = statistics.median(out["cost_per_round"]) if costed else None
    # What the warm-up iterations took beyond the baseline's: one-time costs (a first save
    # into fresh memory, the arena auto warms after it) kept out of the measured steps.
    out["first_cost_per_round"] = [r["warmup_seconds"] - b["warmup_seconds"] for r, b in zip(runs, base)] \
        if costed else []
    out["first_cost"] = statistics.median(out["first_cost_per_round"]) if out["first_cost_per_round"] else None
    out["cpu_per_ckpt"] = statistics.median(r["cpu_per_iter"] - b["cpu_per_iter"] for r, b in zip(runs, base)) \
        if costed else None
    if sync and all(b["blocked_per_ckpt"] for b in sync) and out["mode"] not in ("none", "disk"):
        out["blocked_vs_torch_save"] = statistics.median(
            r["blocked_per_ckpt"] / b["blocked_per_ckpt"] for r, b in zip(runs, sync))
    else:
        out["blocked_vs_torch_save"] = None
    return out


def median_ci(values: list[float], conf: float = 0.95) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of ``values``: the order
    statistics x(k) and x(n+1-k) for the largest k whose coverage 1 - 2 P(Binomial(n, 1/2)
    < k) is at least ``conf``. Returns (low, high, coverage), or None when there are too
    few values for that coverage (fewer than 6 at 95%)."""
    from math import comb

    xs, n = sorted(values), len(values)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(comb(n, i) for i in range(k)) / 2 ** n
        if coverage < conf:
            break
        best = (xs[k - 1], xs[n - k], coverage)
    return best


def async_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in res["modes"]:
        if r.get("error"):
            continue
        if r["mode"] in ("auto", "overlap", "snapshot") and r["slowdown"] is not None:
            t = {"target": f"{r['mode']}: slowdown <= 5%", "value": round(100 * r["slowdown"], 1),
                 "pass": r["slowdown"] <= 0.05}
            ci = r.get("slowdown_ci")
            if ci:  # is the median's side of 5% more than this run's spread?
                lo, hi, cov = ci
                verdict = "met" if hi <= 0.05 else "missed" if lo > 0.05 else "not settled by this run"
                t["note"] = f"median's {100 * cov:.0f}% CI {100 * lo:+.1f}..{100 * hi:+.1f}%: {verdict}"
            out.append(t)
        if r["mode"] in ("auto", "overlap", "snapshot") and r["blocked_vs_torch_save"] is not None:
            out.append({"target": f"{r['mode']}: blocked <= 10% of torch.save's",
                        "value": round(100 * r["blocked_vs_torch_save"], 1), "pass": r["blocked_vs_torch_save"] <= 0.10})
    return out


def format_async(res: dict[str, Any]) -> str:
    w = res.get("write_alone_seconds")
    alone = (f"fp_core.save {w['fastpersist_save']:.2f} s, torch.save+fsync {w['torch_save']:.2f} s" if w
             else "not measured (--no-write-probe)")
    compute = "-" if res.get("compute_seconds") is None else f"{res['compute_seconds']:.2f} s"
    where = res.get("device_name") or res.get("device") or "cpu"
    adam = "fused Adam" if res.get("adam") == "fused" else "Adam"
    lines = [f"checkpoint {res['checkpoint_bytes'] / 1e9:.2f} GB ({res['params'] / 1e6:.1f}M params + {adam}, "
             f"{res.get('dtype', 'float32')} on {where}), "
             f"batch {res['batch']}, {res['rounds']} rounds x {res['iters']} iterations after {res['warmup']} warm-up, "
             f"torch threads {res['torch_threads']} of {res['cpus']} CPUs, engine {res['engine_options'] or 'defaults'}",
             f"compute per iteration (no checkpoint): {compute}; write alone: {alone}"]
    if res.get("pages"):
        lines.append(res["pages"])
    lines.append("")
    heads = ["", "step s (median)", "slowdown", "cost/ckpt s", "blocked/ckpt s", "vs torch.save", "CPU s/ckpt",
             "warm-up +s", "drain at end s"]
    table = []
    for r in res["modes"]:
        if r.get("error"):
            table.append([r["label"], "failed"] + ["-"] * (len(heads) - 2))
            continue
        table.append([r["label"], f"{r['median_step']:.3f}",
                      "-" if r["slowdown"] is None else f"{100 * r['slowdown']:+.1f}%",
                      "-" if r.get("cost_per_ckpt") is None else f"{r['cost_per_ckpt']:+.3f}",
                      f"{r['blocked_per_ckpt']:.3f}",
                      "-" if r["blocked_vs_torch_save"] is None or r["mode"] == "none"
                      else f"{100 * r['blocked_vs_torch_save']:.1f}%",
                      "-" if r.get("cpu_per_ckpt") is None else f"{r['cpu_per_ckpt']:.2f}",
                      "-" if r.get("first_cost") is None else f"{r['first_cost']:+.2f}",
                      f"{r['drain_seconds']:.2f}"])
    widths = [max(len(str(x[i])) for x in [heads] + table) for i in range(len(heads))]
    for t in [heads] + table:
        lines.append("  ".join(str(x).ljust(wd) if i == 0 else str(x).rjust(wd) for i, (x, wd) in enumerate(zip(t, widths))))
    for r in res["modes"]:
        if r.get("error"):
            lines.append(f"  {r['mode']} failed: {r['error']}")
    for r in res["modes"]:
        if r.get("fp_stats"):
            s = r["fp_stats"]
            snap = f", snapshot {s['snapshot_seconds']:.2f} s" if s.get("snapshot_seconds") else ""
            if s.get("at_save_seconds"):
                snap += f"; {'copy' if s['policy'] == 'snapshot' else 'checksums'} inside save() {s['at_save_seconds']:.2f} s"
            if s.get("huge_page_bytes"):
                snap += f"; live tensors moved to huge pages {s['huge_page_bytes'] / 1e9:.2f} GB"
            policies = s.get("policies") or [s["policy"]]
            runs = ", ".join(f"{p} x{policies.count(p)}" for p in dict.fromkeys(policies))
            if s.get("device_copy_seconds"):
                snap += f"; device-to-host staging {s['device_copy_seconds']:.2f} s"
            lines.append(f"  {r['mode']}: last save {s['seconds']:.2f} s in the background (write "
                         f"{s['write_seconds']:.2f} s{snap}, policy {s['policy']}; saves of the last round: {runs})")
    lines.append("slowdown per round (each against the no-checkpoint runs around it):")
    for r in res["modes"]:
        if r["mode"] != "none" and r.get("slowdown_per_round"):
            lines.append(f"  {r['mode']}: " + ", ".join(f"{100 * x:+.1f}%" for x in r["slowdown_per_round"]))
    over = [r for r in res["modes"] if r.get("over_floor") is not None]
    if over:
        lines.append("slowdown beyond the disk floor (per round, the mode's minus the floor's; median):")
        lines += [f"  {r['mode']}: {100 * r['over_floor']:+.1f} points" for r in over]
    lines += format_targets(res["targets"], unit="%")
    return "\n".join(lines)


def plot_async(res: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["modes"] if not r.get("error")]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    y = list(range(len(rows)))[::-1]
    ax.barh(y, [r["median_step"] for r in rows], color="#1f77b4", label="step time")
    ax.barh(y, [r["blocked_per_ckpt"] for r in rows], color="#d62728", label="blocked per checkpoint")
    ax.set_yticks(y, [r["label"] for r in rows], fontsize=8)
    ax.set_xlabel("seconds per iteration")
    ax.legend(fontsize=8)
    ax.set_title(f"Checkpoint every iteration: {res['checkpoint_bytes'] / 1e9:.2f} GB, {res['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
