"""``fastpersist bench``: FastPersist against the usual ways of writing a checkpoint.

Every row runs in this one process, on the same in-memory state dict (model weights plus
Adam state: a few large float32/bf16 tensors and many small ones), writing to ``--dir``.
Save rows report durable throughput (data on disk: fsync/fdatasync included); load rows
read a file whose pages were dropped from the page cache first (cold). GB/s is always
*tensor payload bytes* / seconds, so every row is measured against the same work.

    fastpersist bench --dir /mnt/nvme/bench --size 4GiB --repeat 3 --plot bench.png
    python -m fp_core.tools.cli bench --size 1GiB --json

``--device cuda`` builds the state dict on the GPU: the save rows then include the copy to the
host (torch.save's own, fp_core's pinned staging on a side stream), and the load rows load onto
the GPU (``map_location="cuda"``; safetensors ``device="cuda"``). The device-limit rows stay
host memory <-> disk: the engine's own speed, the bound of both. ``--dry-run`` prints what
would run and exits without building anything (a GPU command line checked without a GPU).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..saving.commit import fsync_file
from .bench_args import ALL_ROWS, LOAD_ROWS, SAVE_ROWS, engine_options
from .common import describe_device, describe_pages, format_targets, payload_bytes, remove
from .procinfo import status_field

MiB = 1 << 20
GiB = 1 << 30

LABELS = {
    "device": "(a) device limit: native Engine, zero-copy, + fdatasync",
    "torch": "(b) torch.save + fsync",
    "lightning": "(c) Lightning _atomic_save (BytesIO) + fsync",
    "safetensors": "(d) safetensors save_file + fsync",
    "dcp": "(e) torch.distributed.checkpoint.save (no_dist)",
    "fastpersist": "(f) fp_core.save",
    "load_device": "device limit: native Reader, O_DIRECT",
    "load_device_4k": "native Reader into 4 KiB pages (a model's tensors)",
    "load_device_fresh": "native Reader into fresh memory (a load's floor)",
    "load_torch": "torch.load (torch.save file)",
    "load_torch_mmap": "torch.load(mmap=True) + touch every page",
    "load_safetensors": "safetensors load_file + touch every page",
    "load_fastpersist": "fp_core.load",
    "load_fastpersist_verify": "fp_core.load(verify=True)",
    "load_fastpersist_mmap": "fp_core.load(mmap=True) + touch every page",
    "load_fastpersist_mmap_verify": "fp_core.load(mmap=True, verify=True) + touch",
    "load_into": "fp_core.load_into(existing state)",
    "load_into_verify": "fp_core.load_into(existing state, verify=True)",
}

def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


# ---------------------------------------------------------------------------- the state dict
def make_state_dict(nbytes: int, seed: int = 0, device: str | torch.device = "cpu") -> dict[str, Any]:
    """A model + Adam-like checkpoint of about ``nbytes`` tensor bytes.

    On ``device`` (built on the CPU, each tensor moved as it is made, so the host never
    holds more than one); the ``step`` scalars stay on the CPU, as Adam keeps them.

    A third is parameters, two thirds Adam's exp_avg/exp_avg_sq of the same shapes. The
    parameters: two large float32 matrices (70%), one bf16 embedding (20%), 200 mid-size
    float32 tensors (~10%) and 400 tiny ones (LayerNorm/bias-like, 1-4 KiB), plus one
    scalar ``step`` tensor per parameter in the optimizer state.
    """
    g = torch.Generator().manual_seed(seed)
    params = nbytes // 3
    shapes: list[tuple[str, int, torch.dtype]] = []  # (name, numel, dtype)
    shapes.append(("layers.0.mlp.weight", int(params * 0.35) // 4, torch.float32))
    shapes.append(("layers.1.mlp.weight", int(params * 0.35) // 4, torch.float32))
    shapes.append(("embed.weight", int(params * 0.20) // 2, torch.bfloat16))
    n_mid = 200
    mid = max(1, int(params * 0.10) // 4 // n_mid)
    shapes += [(f"blocks.{i}.proj.weight", mid, torch.float32) for i in range(n_mid)]
    shapes += [(f"blocks.{i % 200}.norm{i // 200}.{'weight' if i % 2 else 'bias'}", 256 + 768 * (i % 2),
                torch.float32) for i in range(400)]

    noise = torch.empty(4 * MiB, dtype=torch.float32).uniform_(-1, 1, generator=g)
    noise_by_dtype = {dt: noise.to(dt) for dt in (torch.float32, torch.bfloat16)}
    cursor = {"pos": 0}

    def tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
        cols = 1024 if numel >= 1 << 20 else 1
        t = torch.empty(numel // cols, cols, dtype=dtype) if cols > 1 else torch.empty(numel, dtype=dtype)
        # Fill from a 16 MiB block of random floats (fast; the bytes only need to be real data).
        src = noise_by_dtype[dtype]
        flat = t.view(-1)
        for lo in range(0, flat.numel(), src.numel()):
            n = min(src.numel(), flat.numel() - lo)
            start = cursor["pos"] % (src.numel() - n + 1)
            flat[lo: lo + n].copy_(src[start: start + n])
            cursor["pos"] += 7919
        return t if torch.device(device).type == "cpu" else t.to(device)

    model = {name: tensor(n, dt) for name, n, dt in shapes}
    state = {
        i: {"step": torch.tensor(100.0), "exp_avg": tensor(p.numel(), p.dtype).view_as(p),
            "exp_avg_sq": tensor(p.numel(), p.dtype).view_as(p).abs_()}
        for i, p in enumerate(model.values())
    }
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "params": list(range(len(model)))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "epoch": 3, "global_step": 1000}


def flatten_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """{dotted.name: tensor} of every tensor in ``obj`` (what safetensors can store)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


# ---------------------------------------------------------------------------- measurement
def _status_kib(field_name: str) -> int:
    return status_field(field_name, 0)


def _write_proc(path: str, text: str) -> bool:
    """Write a /proc control file; False where this process may not."""
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    return _write_proc("/proc/self/clear_refs", "5")


def check_peak_reset() -> bool:
    """Does reset_peak_rss really lower VmHWM here? (Touch 256 MiB, free it, reset.)"""
    buf = np.ones(256 * MiB, dtype=np.uint8)
    del buf
    gc.collect()
    high = _status_kib("VmHWM")
    if not reset_peak_rss():
        return False
    return _status_kib("VmHWM") < high - 128 * 1024


def drop_cache(path: str) -> None:
    """Evict ``path``'s pages from the page cache (fdatasync first so none are dirty)."""
    paths = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_all_caches() -> bool:
    """Drop the whole page cache when allowed (root); False where it is not."""
    return _write_proc("/proc/sys/vm/drop_caches", "1\n")


LOAD_SETTLE_S = 2.0  # between load rows: see evict_all


def settle(seconds: float = 0.5) -> None:
    """Flush dirty data and give the device a moment (deletes on a discard mount trim)."""
    os.sync()
    time.sleep(seconds)


def cache_drop_check(path: str, nbytes: int = 256 * MiB) -> dict[str, float]:
    """Read the first ``nbytes`` of ``path`` cold (after drop_cache) and then warm; GB/s."""
    nbytes = min(nbytes, os.path.getsize(path))
    buf = bytearray(8 * MiB)
    out = {}
    for label in ("cold", "warm"):
        if label == "cold":
            drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        t0 = time.perf_counter()
        pos = 0
        while pos < nbytes:
            n = os.preadv(fd, [memoryview(buf)[: min(len(buf), nbytes - pos)]], pos)
            if n <= 0:
                break
            pos += n
        dt = time.perf_counter() - t0
        os.close(fd)
        out[f"{label}_gbps"] = pos / dt / 1e9
    return out


@dataclass
class Row:
    key: str
    label: str
    kind: str  # save | load
    bytes: int
    seconds: list[float] = field(default_factory=list)
    peak_rss_added: int = 0  # bytes, max over repeats
    file_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def gbps(self) -> float:
        return self.bytes / self.median / 1e9 if self.seconds else 0.0


def sync_device() -> None:
    """Wait for the GPU when this process uses one (a timed row ends when its copies have)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(row: Row, fn: Callable[[], Any], repeat: int, before: Callable[[], None] | None = None,
            after: Callable[[Any], None] | None = None) -> None:
    """Time ``fn`` ``repeat`` times; ``before``/``after`` run untimed around each call."""
    for _ in range(repeat):
        if before is not None:
            before()
        gc.collect()
        reset_peak_rss()
        sync_device()
        rss0 = _status_kib("VmRSS")
        t0 = time.perf_counter()
        result = fn()
        sync_device()
        dt = time.perf_counter() - t0
        peak = _status_kib("VmHWM")
        row.seconds.append(dt)
        row.peak_rss_added = max(row.peak_rss_added, (peak - rss0) * 1024)
        if after is not None:
            after(result)
        del result
        gc.collect()


def run_rounds(kind: str, rows: list[Row], repeat: int, warmup: int, run_one: Callable[[Row], None],
               log: Callable[[str], None], on_counted: Callable[[], None] | None = None) -> None:
    """``warmup`` uncounted rounds, then ``repeat`` rounds, each running every row once.

    Rounds, not rows: a drift in the (shared, virtual) disk's speed hits all rows alike and
    the ratios compare runs made side by side. A row that fails is reported and skipped
    from then on; one failing competitor must not stop the table.
    """
    for rnd in range(-warmup, repeat):
        if rnd == 0:  # the warm-up rounds' figures are dropped
            for row in rows:
                row.seconds.clear()
            if on_counted is not None:
                on_counted()
        log(f"  {kind} round {rnd + 1}/{repeat}" if rnd >= 0 else f"  {kind} warm-up round")
        for row in rows:
            if row.error:
                continue
            try:
                run_one(row)
            except Exception as e:  # noqa: BLE001
                row.error = f"{type(e).__name__}: {e}"
                log(f"    {row.label} failed: {row.error}")


# ---------------------------------------------------------------------------- save rows
def _aligned_buffer(nbytes: int, align: int) -> np.ndarray:
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    buf = raw[off: off + nbytes]
    buf[:] = 0xA5  # fault every page in before timing
    return buf


def save_device(path: str, buf: np.ndarray, opts: dict[str, Any]) -> dict:
    from .. import _native

    eng = _native.Engine(path, create=True, **opts)
    try:
        _, st = eng.write([(0, buf.ctypes.data, buf.nbytes)], 0, buf.nbytes, checksum=False, zero_copy=True)
        eng.sync()
    finally:
        eng.close()
    return {"backend": eng.backend}


def save_torch(sd: Any, path: str) -> None:
    torch.save(sd, path)
    fsync_file(path)


def _lightning_atomic_save() -> Callable[[Any, str], None]:
    try:
        from lightning.fabric.utilities.cloud_io import _atomic_save
        return _atomic_save
    except ImportError:
        def _atomic_save(checkpoint: Any, filepath: str) -> None:  # what Lightning does
            b = io.BytesIO()
            torch.save(checkpoint, b)
            with open(filepath, "wb") as f:
                f.write(b.getvalue())
        return _atomic_save


def save_lightning(sd: Any, path: str, atomic_save: Callable[[Any, str], None]) -> None:
    atomic_save(sd, path)
    fsync_file(path)


def save_safetensors(flat: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file
    save_file(flat, path)
    fsync_file(path)


def save_dcp(sd: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    # No process group: no_dist=True; FileSystemWriter fsyncs its files (sync_files=True).
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)


def save_fastpersist(sd: Any, path: str, opts: dict[str, Any]) -> Any:
    from ..api import save
    return save(sd, path, **opts)


# ---------------------------------------------------------------------------- load rows
def load_device(path: str, buf: np.ndarray, nbytes: int) -> None:
    """The native reader into memory faulted in before, at the depth the device reads
    fastest with (FastPersist's own reads use it too). The device row's buffer is numpy's,
    which asks for transparent huge pages; the ``load_device_4k`` row's is on 4 KiB pages,
    as torch's tensors are unless ``THP_MEM_ALLOC_ENABLE=1``: O_DIRECT reads into them
    run slower on some hosts (a VM maps every page for the device), and ``load_into``
    fills such tensors."""
    from .. import _native
    from ..io import read_depth
    with _native.Reader(path, direct=True) as r:
        r.read_into(0, buf.ctypes.data, nbytes, checksum=False, threads=read_depth.THREADS,
                    chunk_bytes=read_depth.CHUNK)


def _small_page_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of private anonymous memory kept on 4 KiB pages, faulted in."""
    import mmap

    m = mmap.mmap(-1, max(4096, -(-nbytes // 4096) * 4096), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):
        pass  # a kernel without transparent huge pages (EINVAL): its pages are 4 KiB anyway
    buf = np.frombuffer(m, dtype=np.uint8)[:nbytes]
    buf[:] = 0xA5  # fault every page in before timing
    return buf


def _read_small_pages(path: str, small_pages: dict[str, Any], nbytes: int) -> None:
    """The ``load_device_4k`` row: its buffer, or the error that made it (the row fails)."""
    if "error" in small_pages:
        raise small_pages["error"]
    load_device(path, small_pages["buf"], nbytes)


def load_device_fresh(path: str, nbytes: int) -> None:
    """The native reader into memory never touched before, as any load that returns new
    tensors must use: the reads fault its pages in."""
    import mmap

    from .. import _native
    from ..io import read_depth
    buf = mmap.mmap(-1, -(-nbytes // 4096) * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        with _native.Reader(path, direct=True) as r:
            r.read_into(0, np.frombuffer(buf, dtype=np.uint8).ctypes.data, nbytes, checksum=False,
                        threads=read_depth.THREADS, chunk_bytes=read_depth.CHUNK)
    finally:
        buf.close()


def touch_pages(obj: Any) -> Any:
    """Read one byte per 4 KiB page of every CPU tensor, so lazily mapped data is really
    loaded (a device tensor's bytes were copied to it: nothing is left to map in)."""
    for t in flatten_tensors(obj).values():
        if t.numel() and t.device.type == "cpu":
            int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return obj


def _same(obj: Any) -> Any:
    return obj


def load_torch_mmap(path: str, map_location: Any = None) -> Any:
    return touch_pages(torch.load(path, mmap=True, weights_only=True, map_location=map_location))


def load_safetensors(path: str, device: str = "cpu") -> Any:
    from safetensors.torch import load_file
    return touch_pages(load_file(path, device=device))  # load_file maps the file lazily: touch to compare like with like


# ---------------------------------------------------------------------------- the run
def selected_rows(args: argparse.Namespace) -> list[str]:
    only = [r.strip() for r in args.only.split(",")] if args.only else list(ALL_ROWS)
    unknown = [r for r in only if r not in ALL_ROWS]
    if unknown:
        raise SystemExit(f"--only: unknown rows {unknown}; choose from {','.join(ALL_ROWS)}")
    return only


def bench_device(args: argparse.Namespace) -> torch.device:
    """The device of the benchmark's state dict (``--device``), checked to exist here."""
    device = torch.device(getattr(args, "device", "cpu") or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "--dry-run checks the command line without one")
    return device


def device_labels(device: torch.device) -> dict[str, str]:
    """Row labels; on a GPU the loads say where they load to and the engine rows where from."""
    if device.type == "cpu":
        return dict(LABELS)
    return dict(LABELS, device=LABELS["device"] + " (host memory)",
                torch="(b) torch.save + fsync (torch's own device-to-host copies)",
                fastpersist="(f) fp_core.save (pinned staging on a side stream)",
                load_device=LABELS["load_device"] + " (into host memory)",
                load_device_4k="native Reader into 4 KiB host pages",
                load_torch=f"torch.load(map_location='{device.type}')",
                load_torch_mmap=f"torch.load(mmap=True, map_location='{device.type}')",
                load_safetensors=f"safetensors load_file(device='{device.type}')",
                load_fastpersist=f"fp_core.load(map_location='{device.type}')",
                load_fastpersist_verify=f"fp_core.load(map_location='{device.type}', verify=True)",
                load_fastpersist_mmap=f"fp_core.load(mmap=True, map_location='{device.type}')",
                load_fastpersist_mmap_verify=f"fp_core.load(mmap=True, map_location='{device.type}', verify=True)")


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """What ``run_sync`` would do, from the arguments alone (no state dict, no device)."""
    device = torch.device(getattr(args, "device", "cpu") or "cpu")
    only = selected_rows(args)
    return {"dry_run": True, "device": str(device), "cuda_available": torch.cuda.is_available(),
            "size_bytes": args.size, "rows": only, "repeat": max(1, args.repeat),
            "warmup_rounds": max(0, args.warmup_rounds), "dir": os.path.abspath(args.dir),
            "engine_options": engine_options(args)}


def run_sync(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    only = selected_rows(args)
    device = bench_device(args)
    labels = device_labels(device)
    map_location = None if device.type == "cpu" else device.type
    os.makedirs(args.dir, exist_ok=True)
    opts = engine_options(args)
    repeat = max(1, args.repeat)
    warmup = max(0, args.warmup_rounds)

    t0 = time.perf_counter()
    sd = make_state_dict(args.size, device=device)
    flat = flatten_tensors(sd)
    n_tensors = len(flat)
    nbytes = payload_bytes(sd)
    where = describe_device(device)
    log(f"state dict: {fmt_bytes(nbytes)} in {len(flat)} tensors on {where} (built in {time.perf_counter() - t0:.1f} s); "
        f"dir {os.path.abspath(args.dir)}; repeat {repeat} (median); torch threads {torch.get_num_threads()}")
    huge_share, pages_line = describe_pages(flat)
    log(pages_line)
    peak_ok = check_peak_reset()
    if not peak_ok:
        log("warning: /proc/self/clear_refs does not reset VmHWM here; peak RSS column is process-wide")

    files = {k: os.path.join(args.dir, f"bench-{k}.{ext}") for k, ext in
             (("device", "bin"), ("torch", "pt"), ("lightning", "ckpt"), ("safetensors", "safetensors"),
              ("dcp", "dcp"), ("fastpersist", "pt"))}
    rows: dict[str, Row] = {}
    keep = {"torch": any(r in only for r in ("load_torch", "load_torch_mmap")),
            "safetensors": "load_safetensors" in only,
            "fastpersist": any(r.startswith("load_fastpersist") for r in only),
            "device": any(r in only for r in ("load_device", "load_device_4k", "load_device_fresh"))}

    def clear(path: str) -> Callable[[], None]:
        def before() -> None:
            remove(path)
            settle()
        return before

    from .. import _native
    align = 4096
    dev_buf = None
    if "device" in only or keep["device"]:
        probe = _native.Engine(os.path.join(args.dir, ".bench-probe"), create=True, **opts)
        align = max(align, probe.mem_alignment, probe.alignment)
        probe.close()
        remove(os.path.join(args.dir, ".bench-probe"))
        dev_buf = _aligned_buffer((nbytes + align - 1) // align * align, align)

    atomic_save = _lightning_atomic_save()
    data = {"sd": sd, "flat": flat}  # dropped before the loads
    del sd, flat
    savers: dict[str, Callable[[], Any]] = {
        "device": lambda: save_device(files["device"], dev_buf, opts),
        "torch": lambda: save_torch(data["sd"], files["torch"]),
        "lightning": lambda: save_lightning(data["sd"], files["lightning"], atomic_save),
        "safetensors": lambda: save_safetensors(data["flat"], files["safetensors"]),
        "dcp": lambda: save_dcp(data["sd"], files["dcp"]),
        "fastpersist": lambda: save_fastpersist(data["sd"], files["fastpersist"], opts),
    }
    fp_stats: list[Any] = []
    save_keys = [k for k in SAVE_ROWS if k in only]
    for key in save_keys:
        rows[key] = Row(key, labels[key], "save", nbytes)
    def save_one(row: Row) -> None:
        try:
            after = {"fastpersist": fp_stats.append, "device": row.extra.update}.get(row.key)
            measure(row, savers[row.key], 1, before=clear(files[row.key]), after=after)
            p = files[row.key]
            row.file_bytes = (sum(os.path.getsize(os.path.join(p, n)) for n in os.listdir(p))
                              if os.path.isdir(p) else os.path.getsize(p))
        finally:
            if not keep.get(row.key):
                remove(files[row.key])

    run_rounds("save", [rows[k] for k in save_keys], repeat, warmup, save_one, log, on_counted=fp_stats.clear)
    if fp_stats:
        st = fp_stats[len(fp_stats) // 2]
        rows["fastpersist"].extra = {k: v for k, v in st.as_dict().items() if k not in ("path", "extra")}

    # ---- loads: each file dropped from the page cache before each read
    def ensure(key: str, writer: Callable[[], Any]) -> str:
        if not os.path.exists(files[key]):
            writer()
        return files[key]

    loaders: dict[str, tuple[str, Callable[[], Any]]] = {}
    small_pages: dict[str, Any] = {}  # its buffer (or the error making it), made once the saves' state is gone
    if "load_device" in only:
        ensure("device", savers["device"])
        loaders["load_device"] = (files["device"], lambda: load_device(files["device"], dev_buf, nbytes))
    if "load_device_4k" in only:
        ensure("device", savers["device"])
        loaders["load_device_4k"] = (files["device"], lambda: _read_small_pages(files["device"], small_pages, nbytes))
    if "load_device_fresh" in only:
        ensure("device", savers["device"])
        loaders["load_device_fresh"] = (files["device"], lambda: load_device_fresh(files["device"], nbytes))
    if "load_torch" in only or "load_torch_mmap" in only:
        ensure("torch", savers["torch"])
        loaders["load_torch"] = (files["torch"], lambda: torch.load(files["torch"], weights_only=True,
                                                                    map_location=map_location))
        loaders["load_torch_mmap"] = (files["torch"], lambda: load_torch_mmap(files["torch"], map_location))
    if "load_safetensors" in only:
        ensure("safetensors", savers["safetensors"])
        loaders["load_safetensors"] = (files["safetensors"],
                                       lambda: load_safetensors(files["safetensors"], map_location or "cpu"))
    if any(r.startswith("load_fastpersist") for r in only):
        from ..loading.loader import load as fp_load
        ensure("fastpersist", savers["fastpersist"])
        for key, mapped, check in (("load_fastpersist", False, False), ("load_fastpersist_verify", False, True),
                                   ("load_fastpersist_mmap", True, False), ("load_fastpersist_mmap_verify", True, True)):
            # mapped tensors are touched as torch.load(mmap=True)'s are: loaded, not just mapped
            loaders[key] = (files["fastpersist"],
                            lambda mapped=mapped, check=check: (touch_pages if mapped else _same)(
                                fp_load(files["fastpersist"], weights_only=True, verify=check, mmap=mapped,
                                        map_location=map_location)))
    if "load_into" in only or "load_into_verify" in only:
        from ..api import load_into
        ensure("fastpersist", savers["fastpersist"])
        loaders["load_into"] = (files["fastpersist"], lambda: load_into(target["sd"], files["fastpersist"]))
        loaders["load_into_verify"] = (files["fastpersist"],
                                       lambda: load_into(target["sd"], files["fastpersist"], verify=True))
    # Loads run without the benchmark's own state dict in memory (a training job loads
    # before it has one) and with the saves' page cache (gigabytes of buffered writes)
    # dropped, so reclaim inside the first loads does not decide the table.
    data.clear()
    savers.clear()
    gc.collect()
    # what load_into fills: a resumed job's state, built (and so touched) before its load
    target = {"sd": make_state_dict(args.size, seed=1, device=device)} if "load_into" in loaders else {}
    if "load_device_4k" in loaders:
        try:
            small_pages["buf"] = _small_page_buffer(nbytes)
        except (OSError, MemoryError) as e:  # the row fails, not the table
            small_pages["error"] = e
    if "load_device" not in loaders:
        dev_buf = None  # only the device row reads into it
    settle()  # the root fs may be mounted with discard: let deletions finish before timing reads
    drop_all_caches()
    drop_check = None
    load_keys = [k for k in LOAD_ROWS if k in only and k in loaders]
    for key in load_keys:
        path = loaders[key][0]
        rows[key] = Row(key, labels[key], "load", nbytes, file_bytes=os.path.getsize(path))
        if drop_check is None:
            drop_check = cache_drop_check(path)
            log(f"  page-cache drop check on {os.path.basename(path)}: first 256 MiB read cold "
                f"{drop_check['cold_gbps']:.2f} GB/s, warm {drop_check['warm_gbps']:.2f} GB/s")
    def evict_all() -> None:
        # Every bench file leaves the page cache, not only this row's: pages an earlier
        # row left behind (mmap rows touch a whole file) would otherwise have to be
        # reclaimed inside this row's allocations.
        for p, _ in loaders.values():
            if os.path.exists(p):
                drop_cache(p)
        # The previous row freed a file's worth of memory, which a VM hands back to its host
        # while the next row would run (the whole guest slows meanwhile): each row starts
        # from a quiet machine, as a resuming process does.
        settle(LOAD_SETTLE_S)

    run_rounds("load", [rows[k] for k in load_keys], repeat, warmup,
               lambda row: measure(row, loaders[row.key][1], 1, before=evict_all), log)
    for key in ("device", "torch", "safetensors", "fastpersist"):
        remove(files[key])
    dev_buf = None
    small_pages.clear()

    return {
        "size_bytes": nbytes,
        "tensors": n_tensors,
        "device": str(device),
        "device_name": where,
        "dir": os.path.abspath(args.dir),
        "repeat": repeat,
        "warmup_rounds": warmup,
        "engine_options": opts,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "huge_page_share": huge_share,
        "pages": pages_line,
        "peak_rss_reset_works": peak_ok,
        "page_cache_drop_check": drop_check,
        "rows": [dict(asdict(r), median_seconds=r.median, gbps=r.gbps) for r in rows.values()],
        "targets": targets(rows, device.type),
    }


def paired_ratio(seconds: list[float], base_seconds: list[float]) -> float:
    """Median over rounds of (row speed / base speed), each round's runs made side by side.

    Both rows move the same bytes, so a speed ratio is the inverse ratio of times. Pairing
    by round cancels slow drifts of the device that a ratio of medians would keep.
    """
    pairs = [b / s for s, b in zip(seconds, base_seconds) if s > 0]
    return statistics.median(pairs) if pairs else float("nan")


def targets(rows: dict[str, Row], device_type: str = "cpu") -> list[dict[str, Any]]:
    """The table's targets; ``device_type``: where the loads load to (the 4 KiB-page row is
    the reference of ``load_into`` only for targets in host memory)."""
    out = []

    def ok(r: str) -> bool:
        return r in rows and not rows[r].error and bool(rows[r].seconds)

    def ratio(r: str, base: str) -> float:
        return paired_ratio(rows[r].seconds, rows[base].seconds)

    if ok("fastpersist") and ok("device"):
        v = ratio("fastpersist", "device")
        out.append({"target": "(f) >= 0.9 x (a)", "value": round(v, 3), "pass": v >= 0.9})
        # the form of the same target: single rounds of a noisy disk miss it now and then
        per = [b / f for f, b in zip(rows["fastpersist"].seconds, rows["device"].seconds) if f > 0]
        met = sum(x >= 0.9 for x in per)
        out.append({"target": "(f) >= 0.9 x (a) in at least 4 of 5 rounds",
                    "value": f"{met} of {len(per)} (" + " ".join(f"{x:.2f}" for x in per) + ")",
                    "pass": met >= 0.8 * len(per)})
    if ok("fastpersist") and ok("torch"):
        v = ratio("fastpersist", "torch")
        out.append({"target": "(f) >= 3 x (b)", "value": round(v, 3), "pass": v >= 3.0})
    if ok("fastpersist"):
        v = rows["fastpersist"].peak_rss_added / MiB
        out.append({"target": "(f) peak RSS added <= 300 MiB", "value": round(v, 1), "pass": v <= 300})
    if ok("load_fastpersist") and ok("load_torch"):
        v = ratio("load_fastpersist", "load_torch")
        out.append({"target": "fp_core.load >= 2 x torch.load (cold)", "value": round(v, 3), "pass": v >= 2.0})
    for key in ("load_fastpersist", "load_fastpersist_verify", "load_fastpersist_mmap", "load_fastpersist_mmap_verify",
                "load_into", "load_into_verify"):
        if ok(key) and ok("load_device"):
            v = ratio(key, "load_device")
            out.append({"target": f"{key} >= 0.9 x load_device", "value": round(v, 3), "pass": v >= 0.9})
        if key.startswith("load_into") and device_type == "cpu" and ok(key) and ok("load_device_4k"):
            v = ratio(key, "load_device_4k")
            out.append({"target": f"{key} >= 0.9 x load_device_4k (the tensors' pages)", "value": round(v, 3),
                        "pass": v >= 0.9})
        if key.startswith("load_fastpersist") and ok(key) and ok("load_device_fresh"):
            v = ratio(key, "load_device_fresh")
            out.append({"target": f"{key} >= 0.9 x load_device_fresh (fresh memory)", "value": round(v, 3),
                        "pass": v >= 0.9})
        if ok(key) and ok("load_torch_mmap"):
            v = ratio(key, "load_torch_mmap")
            out.append({"target": f"{key} > load_torch_mmap", "value": round(v, 3), "pass": v > 1.0})
    return out


def format_report(res: dict[str, Any]) -> str:
    rows = res["rows"]
    by = {r["key"]: r for r in rows}
    lines = [f"checkpoint: {fmt_bytes(res['size_bytes'])} of tensors ({res['tensors']} tensors"
             f"{', on ' + res['device_name'] if res.get('device', 'cpu') != 'cpu' else ''}), "
             f"median of {res['repeat']} rounds after {res.get('warmup_rounds', 0)} warm-up (each round runs "
             f"every row once; ratios are medians of per-round ratios), dir {res['dir']}, {res['cpus']} CPUs"]
    if res.get("pages"):
        lines.append(res["pages"])

    def ratio(r: dict, base: str) -> str:
        b = by.get(base)
        if not b or b["error"] or not r["seconds"] or not b["seconds"]:
            return "-"
        return f"{paired_ratio(r['seconds'], b['seconds']):.2f}x"

    for kind, bases, title in (("save", ("device", "torch"), "Save (durable)"),
                               ("load", ("load_device", "load_device_4k", "load_torch"), "Load (cold page cache)")):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        bases = tuple(b for b in bases if b in by)
        heads = ["", "GB/s", "s"] + [f"vs {b}" for b in bases] + ["peak RSS +"]
        table = []
        for r in sel:
            if r["error"]:
                table.append([r["label"], "failed", r["error"][:60]] + [""] * (len(heads) - 3))
                continue
            table.append([r["label"], f"{r['gbps']:.2f}", f"{r['median_seconds']:.2f}"]
                         + [ratio(r, b) for b in bases] + [f"{r['peak_rss_added'] / MiB:.0f} MiB"])
        widths = [max(len(str(x[i])) for x in [heads] + table) for i in range(len(heads))]
        lines.append("")
        lines.append(title)
        lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(heads, widths))))
        for t in table:
            lines.append("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)
                                   for i, (x, w) in enumerate(zip(t, widths))))
    fp = by.get("fastpersist")
    if fp and fp.get("extra"):
        e = fp["extra"]
        lines.append("")
        lines.append(f"fp_core.save split (median run): backend {e.get('backend')}, serialize "
                     f"{e.get('serialize_seconds', 0):.3f} s, write {e.get('write_seconds', 0):.3f} s "
                     f"(copy+crc {e.get('copy_seconds', 0):.3f} s summed over copy threads), "
                     f"sync {e.get('sync_seconds', 0):.3f} s, total {e.get('seconds', 0):.3f} s")
    lines += format_targets(res["targets"])
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if not r["error"]]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    colors = ["#d62728" if r["key"] in ("fastpersist", "load_fastpersist", "load_fastpersist_verify",
                                        "load_fastpersist_mmap", "load_fastpersist_mmap_verify", "load_into",
                                        "load_into_verify")
              else "#7f7f7f" if r["key"] in ("device", "load_device", "load_device_4k", "load_device_fresh")
              else "#1f77b4" for r in rows]
    y = list(range(len(rows)))[::-1]
    ax.barh(y, [r["gbps"] for r in rows], color=colors)
    ax.set_yticks(y, [("save: " if r["kind"] == "save" else "load: ") + r["label"] for r in rows], fontsize=8)
    for yi, r in zip(y, rows):
        ax.text(r["gbps"], yi, f" {r['gbps']:.2f}", va="center", fontsize=8)
    ax.set_xlabel("GB/s (tensor bytes / wall time, durable saves, cold loads)")
    ax.set_title(f"FastPersist bench: {fmt_bytes(res['size_bytes'])} checkpoint, {res['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- CLI
def run(args: argparse.Namespace) -> int:
    """``fastpersist bench`` without ``--async`` (the arguments of
    :func:`fp_core.tools.bench_args.add_arguments`): the table, or the plan with ``--dry-run``."""
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
    if getattr(args, "dry_run", False):
        plan = dry_run(args)
        if args.json:
            print(json.dumps(plan, indent=2))
        else:
            print(f"dry run: a {fmt_bytes(plan['size_bytes'])} state dict on {plan['device']}, rows "
                  f"{','.join(plan['rows'])}, {plan['warmup_rounds']} warm-up + {plan['repeat']} rounds, "
                  f"dir {plan['dir']}" + ("" if plan["device"] == "cpu" or plan["cuda_available"]
                                          else "; no CUDA device here"))
        return 0
    results = []
    for size in getattr(args, "sizes", None) or [args.size]:
        one = argparse.Namespace(**{**vars(args), "size": size})
        results.append(run_sync(one, log))
    if args.plot:
        plot(results[-1], args.plot)
        log(f"plot written to {args.plot}")
    out: Any = results[0] if len(results) == 1 else results
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2, default=str)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print("\n\n".join(format_report(res) for res in results))
    return 0

