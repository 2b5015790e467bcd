"""Shared fixtures and helpers for the test suites under tests/ (native/, core/, integrations/,
reliability/, tools/; pyproject puts tests/ on sys.path, so any of them can ``from conftest import ...``)."""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
DISK_TMP_ROOT = os.path.join(os.path.dirname(REPO), "fp-test-tmp")
TMP_SUFFIX = ".fptmp"

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


# ---------------------------------------------------------------- file systems


def flip_byte(path: str, offset: int, mask: int = 0x01) -> None:
    """Damage one byte of a file in place: its bits in ``mask`` inverted."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def free_port() -> str:
    """A TCP port on loopback nobody listens on now (for torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


# Environment variables read when torch or fp_core is imported: a test that sets one gets
# fresh interpreters for its ranks, not forks of the forkserver that imported them before.
_IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "TORCH", "THP_", "CUDA", "PYTORCH", "GLOO_", "NCCL_", "FASTPERSIST",
                    "PYTHON", "LD_")


# Set by importing Lightning or transformers (in a test's body too), read by nothing that
# torch's import does here: a rank forked after them is what a fresh interpreter would be.
_SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK")


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_ENV) and k not in _SET_BY_IMPORTS}


# The session's own, as collection left them (importing Lightning or transformers sets some):
# the forkserver starts only from a test that left these alone, so that a test that set one is
# never what every later rank inherits.
_session_env: dict[str, dict[str, str]] = {}
_forkserver: dict = {}


def pytest_collection_finish(session) -> None:
    _session_env["env"] = _import_time_env()


def _rank_context():
    """The forkserver context ranks fork from (torch, torch.distributed and fp_core imported
    once per session), or None when this environment differs from the session's in a
    variable read at import time."""
    import multiprocessing as mp

    if _import_time_env() != _session_env.get("env"):
        return None
    if not _forkserver:
        if HELPERS not in sys.path:
            sys.path.insert(0, HELPERS)  # the forkserver imports forked_script from there
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "fp_core", "forked_script"])
        _forkserver["ctx"] = ctx
    return _forkserver["ctx"]


def _start_rank(argv: list[str], logs: str, rank: int):
    """Start ``python argv...`` as a fork of the forkserver (see :func:`_rank_context`) or,
    where that cannot stand in for a fresh interpreter, as one. Returns (wait(timeout) ->
    exit status or None, kill(), stderr())."""
    out, err = os.path.join(logs, f"rank{rank}.out"), os.path.join(logs, f"rank{rank}.err")

    def stderr() -> str:
        with open(err, errors="replace") as f:
            return f.read()

    ctx = _rank_context()
    if ctx is None:
        with open(out, "wb") as o, open(err, "wb") as e:
            p = subprocess.Popen([sys.executable, *argv], stdout=o, stderr=e)

        def wait(timeout: float):
            try:
                return p.wait(timeout)
            except subprocess.TimeoutExpired:
                return None

        return wait, p.kill, stderr
    import forked_script

    fork = ctx.Process(target=forked_script.run, args=(argv[0], argv[1:], dict(os.environ), os.getcwd(), out, err))
    fork.start()

    def wait_fork(timeout: float):
        fork.join(timeout)
        return fork.exitcode

    return wait_fork, fork.kill, stderr


def run_ranks(script: str, tmp_path, *args: str, world: int = 2, timeout: float = 300) -> dict:
    """Run ``tests/helpers/<script> RANK WORLD PORT DIR *args`` as ``world`` processes (a
    hung one is killed after ``timeout``); return the DIR/result.json rank 0 wrote. The ranks
    are forks of a forkserver with torch imported (the interpreter start is most of a small
    rank's time); each behaves as ``python SCRIPT ...`` would."""
    import tempfile
    import time

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fp-ranks-") as logs:
        ranks = [_start_rank([os.path.join(HELPERS, script), str(r), str(world), port, str(tmp_path), *args],
                             logs, r) for r in range(world)]
        deadline = time.monotonic() + timeout
        try:
            codes = [wait(max(0.0, deadline - time.monotonic())) for wait, _, _ in ranks]
        finally:
            for wait, kill, _ in ranks:  # a hung rank must not outlive the test
                if wait(0) is None:
                    kill()
                    wait(30)
        assert codes == [0] * world, (codes, [stderr()[-3000:] for _, _, stderr in ranks])
    with open(os.path.join(str(tmp_path), "result.json")) as f:
        return json.load(f)


def rank_results(script: str, tmp_path, *args: str, world: int = 2, timeout: float = 240) -> list[dict]:
    """:func:`run_ranks`, then every rank's own ``DIR/result{rank}.json``, in rank order."""
    run_ranks(script, tmp_path, *args, world=world, timeout=timeout)
    out = []
    for r in range(world):
        with open(os.path.join(str(tmp_path), f"result{r}.json")) as f:
            out.append(json.load(f))
    return out


def fs_type(path: str) -> str:
    """The file system type of the mount that holds ``path`` (from /proc/self/mounts)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


@pytest.fixture
def disk_dir(tmp_path) -> Iterator[str]:
    """A fresh directory on a real disk file system (O_DIRECT capable), removed afterwards.

    pytest's tmp_path is used when it is not on tmpfs; otherwise a directory under
    ``<repo>/../fp-test-tmp/``.
    """
    if fs_type(str(tmp_path)) not in ("tmpfs", "ramfs", "overlay"):
        yield str(tmp_path)
        return
    d = os.path.join(DISK_TMP_ROOT, uuid.uuid4().hex)
    os.makedirs(d)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_root(monkeypatch) -> Iterator[str]:
    """A shared-memory root of the test's own for the process writer's arenas
    (``FASTPERSIST_SHM_DIR``; the writer process inherits it), removed afterwards."""
    d = os.path.join("/dev/shm", "fp-pw-" + uuid.uuid4().hex[:8])
    os.mkdir(d)
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = os.path.join("/dev/shm", "fp-test-" + uuid.uuid4().hex)
    os.makedirs(d)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def mount_tmpfs(disk_dir) -> Iterator:
    """Factory: mount a tmpfs of ``size`` (e.g. "8m") on a fresh directory; unmounted afterwards."""
    mounted: list[str] = []

    def make(size: str, name: str = "small") -> str:
        d = os.path.join(disk_dir, name)
        os.makedirs(d, exist_ok=True)
        r = _run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d])
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield make
    for d in reversed(mounted):
        _run(["umount", "-l", d])


def _writable(d: str) -> bool:
    probe = os.path.join(d, ".probe")
    try:
        open(probe, "w").close()
    except OSError as e:
        assert e.errno in (errno.EROFS, errno.EACCES, errno.EPERM), e
        return False
    os.unlink(probe)
    return True


@pytest.fixture
def ro_bind(disk_dir) -> Iterator:
    """Factory: ``(src, ro)`` where ``ro`` is a read-only bind mount of the directory ``src``."""
    mounted: list[str] = []

    def make() -> tuple[str, str]:
        src = os.path.join(disk_dir, "rw")
        ro = os.path.join(disk_dir, "ro")
        os.makedirs(src, exist_ok=True)
        os.makedirs(ro, exist_ok=True)
        r = _run(["mount", "--bind", "-o", "ro", src, ro])
        if r.returncode != 0:
            pytest.skip(f"cannot make a read-only bind mount here: {r.stderr.strip()}")
        mounted.append(ro)
        if _writable(ro):  # older util-linux needs a remount to make a bind mount read-only
            _run(["mount", "-o", "remount,bind,ro", ro])
            if _writable(ro):
                pytest.skip("the bind mount stays writable here")
        return src, ro

    yield make
    for d in reversed(mounted):
        _run(["umount", "-l", d])


# ---------------------------------------------------------------- native fault hook


@pytest.fixture
def ctrl_c():
    """A function that sends SIGINT to the main thread (as Ctrl-C would, to the thread that
    waits), with Python's KeyboardInterrupt handler installed for the test: a process
    started in the background by a non-interactive shell inherits SIGINT ignored, and
    Python then installs no handler (the CI run here is such a process)."""
    import signal
    import threading

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, old)


def _native_module():
    from fp_core import _native

    return _native


@pytest.fixture(autouse=True)
def _clear_faults():
    """Every test starts and ends with no fault injected (the hook is process-wide)."""
    nat = _native_module()
    nat.inject_fault(None)
    yield
    nat.inject_fault(None)


@pytest.fixture
def fault():
    """``fault(kind, **kw)`` arms a native fault; cleared after the test (and by _clear_faults)."""
    nat = _native_module()

    def arm(kind, **kw):
        nat.inject_fault(kind, **kw)

    yield arm
    nat.inject_fault(None)


@pytest.fixture
def fresh_fallback_log():
    """The engine logs each distinct backend fallback once per process; forget what it logged."""
    from fp_core.io import engine

    saved = set(engine._reported)
    engine._reported.clear()
    yield
    engine._reported.clear()
    engine._reported.update(saved)


# ---------------------------------------------------------------- optimizer hooks (async pipeline)


def _settled_hooks() -> int:
    """torch's global pre-hook count once hooks freed or switched off earlier are out
    (their removal waits for a safe point: fp_core.pipeline.optim_hooks)."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    import fp_core

    gc.collect()
    fp_core.pipeline.optim_hooks.flush()
    return len(_global_optimizer_pre_hooks)


@pytest.fixture
def baseline_hooks():
    n = _settled_hooks()
    yield n
    assert _settled_hooks() == n, "an optimizer hook was left installed"


# ---------------------------------------------------------------- comparisons


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_tensor_identical(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.stride() == b.stride(), f"{where}: stride {a.stride()} != {b.stride()}"
    assert a.storage_offset() == b.storage_offset(), f"{where}: storage offset differs"
    assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
    assert tensor_bytes(a) == tensor_bytes(b), f"{where}: bytes differ"


def assert_identical(a, b, where: str = "obj") -> None:
    """Deep, byte-exact equality of checkpoint objects (containers, tensors, arrays, the rest)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b)} is not a tensor"
        assert_tensor_identical(a, b, where)
        return
    assert type(a) is type(b), f"{where}: type {type(a)} != {type(b)}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: array dtype/shape differ"
        assert a.tobytes() == b.tobytes(), f"{where}: array bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def temp_files(directory: str) -> list[str]:
    """FastPersist temporary files (``.<name>.<host>-<pid>-<hex>.fptmp``) in ``directory``."""
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith(".") and n.endswith(TMP_SUFFIX))
    except FileNotFoundError:
        return []


def assert_no_temps(directory: str) -> None:
    left = temp_files(directory)
    assert not left, f"temporary files left in {directory}: {left}"


# ---------------------------------------------------------------- process resources


from fp_core.tools.procinfo import fd_count  # noqa: E402
from fp_core.tools.procinfo import status_field as _status_field  # noqa: E402


def thread_count() -> int:
    return _status_field("Threads")


def rss_bytes() -> int:
    return _status_field("VmRSS") * 1024


def python_exe() -> str:
    return sys.executable


__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "HELPERS",
    "REPO",
    "fs_type",
    "tensor_bytes",
    "assert_identical",
    "assert_tensor_identical",
    "temp_files",
    "assert_no_temps",
    "fd_count",
    "thread_count",
    "rss_bytes",
]


# ---------------------------------------------------------------- S3 on loopback (remote tier)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1, one per test session."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    sys.path.insert(0, HELPERS)
    from s3_server import S3Server

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "NO_PROXY", "no_proxy")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    srv = S3Server().start()
    yield srv
    srv.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3(s3_server):
    """(server, bucket URL prefix, storage_options) with a fresh bucket; the server is up."""
    if not s3_server.running:
        s3_server.start()
    bucket = "fp-" + uuid.uuid4().hex[:12]
    s3_server.make_bucket(bucket)
    yield s3_server, f"s3://{bucket}", s3_server.storage_options()
    if not s3_server.running:
        s3_server.start()


@pytest.fixture
def staging(tmp_path):
    """The remote tier's local staging directory, private to the test."""
    from fp_core import remote

    d = str(tmp_path / "staging")
    remote.configure(staging_dir=d)
    yield d
    remote.configure(None, None)


@pytest.fixture
def fast_fail(monkeypatch):
    """s3fs retries connection errors 5 times with backoff; once is enough here."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
