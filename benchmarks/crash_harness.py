"""Crash, fault and corruption harness for FastPersist: measured, not assumed.

    python benchmarks/crash_harness.py --trials 200 [--integration-trials 8] [--json benchmarks/results/reliability-harness.json]
    python benchmarks/crash_harness.py --only crash --trials 20
    python benchmarks/crash_harness.py --only faults,corruption

Crash trials: a child (tests/helpers/crash_child.py) saves generation after generation and
is SIGKILLed at an instant drawn uniformly over one save's duration (calibrated per mode:
the median start->durable time of a few saves), after 1-2 complete saves. After each kill:

* every file under a final name loads (torch.load) and verifies (fp_core.verify) and holds
  one whole generation the child started (every tensor encodes the generation);
* no rollback: the newest generation reported durable is still there (or a newer one);
* leftover temporary files (``.*.fptmp``) are counted, must name a dead writer's pid, and
  must be gone once the next child's first save into the directory is durable (the last
  trial's leftovers are removed with ``fastpersist clean DIR``, and counted).

Modes: sync (1 rank), async (AsyncCheckpointer, overlap/snapshot alternating, rotation keep
3 via enqueue(os.unlink)), dist-sync and dist-async (2 ranks, gloo on loopback, collective
saves; the victim is rank 0, rank 1 or both, and the survivor must exit with an error, not
hang), dist-file (2 ranks, DTensor state saved with layout="file" into one file of the full
state: it must torch.load and verify as one whole generation), dist-dcp (2 ranks, DTensor state through AsyncCheckpointer into a sharded DCP
directory: it must verify and load whole onto one process, through FastPersist's reader and
stock DCP's alike; a staging directory left is
counted, and a directory a kill left aside mid-commit is put back as the next save would,
and counted). Core children are forked from a forkserver that has torch/fp_core imported (so a
trial costs the saves, not an interpreter start). Lightning and HF rows run real
subprocesses.

Faults and corruption: see :func:`fault_rows` and :func:`corruption_rows`.
Needs root for the tmpfs / bind-mount / setuid / chattr rows (skipped otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
for p in (REPO, HELPERS):
    if p not in sys.path:
        sys.path.insert(0, p)

import crash_child  # noqa: E402
import torch  # noqa: E402
from process_writer_victim import wait_gone  # noqa: E402

import fp_core  # noqa: E402
from fp_core import _native  # noqa: E402

TMP_SUFFIX = ".fptmp"
DEFAULT_ROOT = "/work/bench-tmp"
CORE_MODES = ("sync", "async", "dist-sync", "dist-async", "dist-dcp", "dist-file")
# also on request (--modes): the writer in its own process (issue #40)
OTHER_MODES = ("async-process",)
MIB = {"sync": 16, "async": 16, "dist-sync": 16, "dist-async": 16, "dist-dcp": 16, "dist-file": 16,
       "async-process": 16}
WEIGHTS = {"sync": 0.3, "async": 0.3, "dist-sync": 0.2, "dist-async": 0.2, "dist-dcp": 0.2, "dist-file": 0.2,
           "async-process": 0.3}
ROTATING = ("async", "async-process")  # step-{gen}.pt files, the last few kept
DCP_LEFTOVERS = (".ckpt.fastpersist-staging", ".fastpersist-replaced-ckpt")  # a killed sharded save's
CLI = [sys.executable, "-m", "fp_core.tools.cli"]


def log(msg: str) -> None:
    print(msg, flush=True)


def temps(d: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(d) if n.startswith(".") and n.endswith(TMP_SUFFIX))
    except FileNotFoundError:
        return []


def dcp_leftovers(d: str) -> list[str]:
    """What a killed sharded save leaves: its staging directory (removed by the next save,
    which reuses the name) or the previous directory moved aside mid-commit."""
    try:
        return sorted(n for n in os.listdir(d) if n in DCP_LEFTOVERS)
    except FileNotFoundError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CTX = None


def context():
    """A forkserver with torch, torch.distributed, fp_core and crash_child imported."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "fp_core", "crash_child"])
    return _CTX


class Child:
    """One forked victim (one rank) and its message pipe."""

    def __init__(self, mode: str, d: str, **kw) -> None:
        ctx = context()
        self.rd, wr = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=crash_child.run, args=(mode, d, wr), kwargs=kw, daemon=True)
        self.proc.start()
        wr.close()
        self.msgs: list[tuple] = []

    def next(self, timeout: float) -> tuple | None:
        if self.rd.poll(timeout):
            try:
                m = self.rd.recv()
            except (EOFError, OSError):
                return None
            self.msgs.append(m)
            return m
        return None

    def drain(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while self.rd.poll(0):
                self.msgs.append(self.rd.recv())

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(self.proc.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def gens(self, kind: str) -> list[int]:
        return [m[1] for m in self.msgs if m[0] == kind]

    def error(self) -> str | None:
        return next((m[1] for m in self.msgs if m[0] == "E"), None)


def wait_for(child: Child, kind: str, count: int = 1, timeout: float = 120.0) -> tuple:
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        m = child.next(0.5)
        if m is None:
            if not child.proc.is_alive():
                child.drain()
                raise RuntimeError(f"child exited ({child.proc.exitcode}) before {kind}: {child.error()}")
            continue
        if m[0] == "E":
            raise RuntimeError(f"child failed: {m[1]}")
        if m[0] == kind:
            seen += 1
            if seen >= count:
                return m
    raise TimeoutError(f"no {kind} message within {timeout} s")


def start(mode: str, d: str, gen0: int, policy: str = "overlap") -> list[Child]:
    world = 2 if mode.startswith("dist") else 1
    port = free_port()
    return [Child(mode, d, mib=MIB[mode], policy=policy, rank=r, world=world, port=port, gen0=gen0)
            for r in range(world)]


def stop(children: list[Child]) -> None:
    for c in children:
        c.kill()
    for c in children:
        c.join(10)


def calibrate(mode: str, root: str) -> float:
    """Median start->durable time of saves 3..7 of a fresh child."""
    d = os.path.join(root, f"calib-{mode}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    kids = start(mode, d, gen0=0)
    try:
        wait_for(kids[0], "D", 7)
    finally:
        stop(kids)
    c = kids[0]
    s = {m[1]: m[2] for m in c.msgs if m[0] == "S"}
    durs = [m[2] - s[m[1]] for m in c.msgs if m[0] == "D" and m[1] >= 3]
    shutil.rmtree(d, ignore_errors=True)
    return statistics.median(durs)


def load_and_check(path: str) -> int:
    """torch.load + fp_core.verify + whole-generation check; returns the generation (a
    sharded directory: fp_core.verify, then a verified load onto one process)."""
    fp_core.verify(path)
    if os.path.isdir(path):
        return crash_child.check_state(crash_child.load_dcp_dir(path, MIB["dist-dcp"]))
    obj = torch.load(path, weights_only=True)
    g = crash_child.check_state(obj)
    obj2 = fp_core.load(path, verify=True)
    assert crash_child.check_state(obj2) == g
    return g


def check_core_dir(mode: str, d: str, started: set[int], durable_now: int | None) -> dict:
    """Every final name in ``d`` loads, verifies and holds a started generation; no rollback."""
    finals = sorted(n for n in os.listdir(d) if not n.startswith("."))
    problems: list[str] = []
    found: dict[str, int] = {}
    for n in finals:
        try:
            g = load_and_check(os.path.join(d, n))
        except Exception as e:  # noqa: BLE001
            problems.append(f"{n}: {type(e).__name__}: {e}")
            continue
        found[n] = g
        if g not in started:
            problems.append(f"{n} holds generation {g}, which no child started")
        if n.startswith("step-") and n != f"step-{g}.pt":
            problems.append(f"{n} holds generation {g}")
    if durable_now is not None:
        if mode in ROTATING:
            if f"step-{durable_now}.pt" not in found:
                problems.append(f"step-{durable_now}.pt was reported durable and is missing")
        else:
            name = "ckpt" if mode == "dist-dcp" else "ckpt.pt"
            if name not in found or found[name] < durable_now:
                problems.append(f"{name} holds {found.get(name)}, older than durable generation {durable_now}")
    return {"finals": found, "problems": problems}


def _whole_file(path: str) -> bool:
    """A temporary file left by a kill that passes verification: a whole checkpoint (killed
    between the link to its temporary name and the rename), not a partial one."""
    if not os.path.isfile(path):
        return False
    try:
        fp_core.verify(path)
    except Exception:  # noqa: BLE001 - any failure means not whole
        return False
    return True


def core_trials(mode: str, n: int, root: str, rng: random.Random, T: float) -> dict:
    d = os.path.join(root, f"crash-{mode}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    started: set[int] = set()
    res = {"mode": mode, "trials": 0, "failures": 0, "data_lost": 0, "mid_save_kills": 0, "temps_left": 0,
           "temps_whole": 0, "temps_cleaned_by_next_save": 0, "temps_cleaned_by_cli": 0, "survivor_errors": {}, "survivor_hung": 0,
           "calibrated_save_s": round(T, 4), "problems": [], "kill_offsets": []}
    prev_orphans: list[str] = []
    for i in range(n):
        gen0 = (i + 1) * 100000
        policy = ("overlap", "snapshot")[i % 2]
        kids = start(mode, d, gen0, policy)
        victims = kids
        try:
            warm = rng.randint(1, 2)
            first = wait_for(kids[0], "D", 1)
            gone = [o for o in prev_orphans if not os.path.exists(os.path.join(d, o))]
            res["temps_cleaned_by_next_save"] += len(gone)
            if len(gone) != len(prev_orphans):
                res["problems"].append(f"trial {i}: orphans not cleaned by the next save: "
                                       f"{sorted(set(prev_orphans) - set(gone))}")
            if warm > 1:
                wait_for(kids[0], "D", warm - 1)
            del first
            s = wait_for(kids[0], "S", 1)
            off = rng.uniform(0.0, T)
            time.sleep(max(0.0, s[2] + off - time.monotonic()))
            res["kill_offsets"].append(round(time.monotonic() - s[2], 4))
            if len(kids) > 1:
                victims = [[kids[0]], [kids[1]], kids][rng.randrange(3)]
            for c in victims:
                c.kill()
        except Exception as e:  # noqa: BLE001 - a child that failed on its own is a failure row
            res["problems"].append(f"trial {i}: {type(e).__name__}: {e}")
            res["failures"] += 1
            stop(kids)
            res["trials"] += 1
            continue
        for c in victims:
            c.join(10)
        for c in kids:
            if c in victims:
                continue
            code = c.join(30)  # the survivor must notice the dead peer and fail, not hang
            c.drain()
            if code is None:
                res["survivor_hung"] += 1
                res["problems"].append(f"trial {i}: surviving rank did not exit within 30 s")
                c.kill()
                c.join(10)
            else:
                err = (c.error() or f"exit {code}, no error message").split(":")[0]
                res["survivor_errors"][err] = res["survivor_errors"].get(err, 0) + 1
        for c in kids:
            c.drain()
        for pid in kids[0].gens("W"):  # a writer process outlives its trainer: let it commit, then check
            if not wait_gone(pid, 60):
                res["problems"].append(f"trial {i}: writer process {pid} still running 60 s after its trainer died")
        S, D = set(kids[0].gens("S")), kids[0].gens("D")
        started |= S
        if max(S) not in D:
            res["mid_save_kills"] += 1
        if mode == "dist-dcp":
            left = dcp_leftovers(d)
            res["staging_dirs_left"] = res.get("staging_dirs_left", 0) + left.count(DCP_LEFTOVERS[0])
            if DCP_LEFTOVERS[1] in left:  # killed between the commit's two renames
                res["aside_restored"] = res.get("aside_restored", 0) + 1
                fp_core.saving.commit.recover_dir(os.path.join(d, "ckpt"))  # what the next save does first
        chk = check_core_dir(mode, d, started, max(D) if D else None)
        res["trials"] += 1
        if chk["problems"]:
            res["failures"] += 1
            res["data_lost"] += 1
            res["problems"] += [f"trial {i}: {p}" for p in chk["problems"]]
        if mode in ROTATING:  # checked; drop the previous trials' rotation leftovers (bounded disk/check time)
            for n_, g_ in chk["finals"].items():
                if g_ < gen0:
                    os.unlink(os.path.join(d, n_))
        orphans = temps(d)
        pids = [str(c.proc.pid) for c in kids]
        for o in orphans:
            if o.endswith(TMP_SUFFIX) and not any(f"-{p}-" in o for p in pids):
                res["problems"].append(f"trial {i}: temp file {o} names no dead writer of this trial")
        res["temps_left"] += len(orphans)
        res["temps_whole"] += sum(1 for o in orphans if _whole_file(os.path.join(d, o)))
        prev_orphans = orphans
    # The last trial's leftovers: the CLI.
    r = subprocess.run(CLI + ["clean", d], capture_output=True, text=True, cwd=REPO)
    res["temps_cleaned_by_cli"] = sum(1 for line in r.stdout.splitlines() if line.startswith("removed "))
    if temps(d):
        res["problems"].append(f"fastpersist clean left {temps(d)}")
    if res["temps_cleaned_by_cli"] != len(prev_orphans):
        res["problems"].append(f"fastpersist clean removed {res['temps_cleaned_by_cli']} of {len(prev_orphans)}")
    offs = res.pop("kill_offsets")
    res["kill_offset_s"] = {"min": min(offs, default=0), "median": statistics.median(offs) if offs else 0,
                            "max": max(offs, default=0)}
    if not res["problems"]:
        shutil.rmtree(d, ignore_errors=True)
    return res


# ---------------------------------------------------------------- Lightning / HF


def _spawn(mode: str, d: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen([sys.executable, os.path.join(HELPERS, "crash_child.py"), mode, d],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _read_until(p: subprocess.Popen, kind: str, count: int, timeout: float = 300) -> list[str]:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    seen, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sel.select(1.0):
            if p.poll() is not None:
                raise RuntimeError(f"child exited {p.returncode}: {p.stderr.read()[-3000:]}")
            continue
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited {p.wait()}: {p.stderr.read()[-3000:]}")
        parts = line.split()
        if parts and parts[0] == "E":
            raise RuntimeError(line.strip())
        if parts and parts[0] == kind:
            seen += 1
            if seen >= count:
                return parts
    raise TimeoutError(f"no {kind} within {timeout} s")


def check_lightning_dir(d: str) -> dict:
    problems, empty = [], []
    last = os.path.join(d, "last.ckpt")
    if not os.path.exists(last):
        problems.append("last.ckpt missing")
    for n in sorted(os.listdir(d)):
        if n.startswith(".") or not n.endswith(".ckpt"):
            continue
        p = os.path.join(d, n)
        if fp_core.saving.commit.is_placeholder(p):
            empty.append(n)  # the plugin's visible_pending placeholder of a save in flight
            if n == "last.ckpt":
                problems.append("last.ckpt is a placeholder of a save that never completed")
            continue
        try:
            fp_core.verify(p)
            ck = torch.load(p, weights_only=False)
            tag = int(ck["state_dict"]["step_tag"])
            if tag != ck["global_step"]:
                problems.append(f"{n}: state_dict step_tag {tag} != global_step {ck['global_step']}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"{n}: {type(e).__name__}: {e}")
    return {"problems": problems, "empty_placeholders": empty}


def check_hf_dir(d: str) -> dict:
    from safetensors.torch import load_file
    from transformers.trainer_utils import get_last_checkpoint

    problems = []
    ckpts = sorted((n for n in os.listdir(d) if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1]))
    for n in ckpts:
        c = os.path.join(d, n)
        try:
            load_file(os.path.join(c, "model.safetensors"))
            fp_core.verify(os.path.join(c, "optimizer.pt"))
            torch.load(os.path.join(c, "optimizer.pt"), weights_only=True)
            with open(os.path.join(c, "trainer_state.json")) as f:
                st = json.load(f)
            if st["global_step"] != int(n.split("-")[1]):
                problems.append(f"{n}: trainer_state global_step {st['global_step']}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"{n}: {type(e).__name__}: {e}")
    last = get_last_checkpoint(d)
    if ckpts and (last is None or os.path.basename(last) != ckpts[-1]):
        problems.append(f"get_last_checkpoint picked {last}, newest is {ckpts[-1]}")
    staging = [n for n in os.listdir(d) if n.startswith(".fastpersist-staging-")]
    return {"problems": problems, "newest": ckpts[-1] if ckpts else None, "staging_left": staging}


def integration_trials(kind: str, n: int, root: str, rng: random.Random) -> dict:
    d = os.path.join(root, f"crash-{kind}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    res = {"mode": kind, "trials": 0, "failures": 0, "data_lost": 0, "temps_left": 0, "problems": [],
           "empty_placeholders_left": 0, "empty_placeholders_after_clean": 0, "staging_dirs_left": 0,
           "staging_cleaned_by_next_start": 0}
    T = None
    prev_staging: list[str] = []
    for i in range(n):
        p = _spawn(kind, d)
        try:
            if T is None:  # calibrate on the first run: the step (incl. its checkpoint) time
                a = float(_read_until(p, "D", 3)[2])
                b = float(_read_until(p, "D", 4)[2])
                T = (b - a) / 4
                res["calibrated_step_s"] = round(T, 4)
            else:
                _read_until(p, "D", rng.randint(2, 4))
            gone = [s for s in prev_staging if not os.path.exists(os.path.join(d, s))]
            res["staging_cleaned_by_next_start"] += len(gone)
            time.sleep(rng.uniform(0, T))
        except Exception as e:  # noqa: BLE001
            res["problems"].append(f"trial {i}: {type(e).__name__}: {str(e)[-1500:]}")
            res["failures"] += 1
            p.kill()
            p.wait()
            res["trials"] += 1
            if i == 0:
                break  # the integration does not run: one failure row, not n
            continue
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        p.stderr.close()
        res["trials"] += 1
        chk = check_lightning_dir(d) if kind == "lightning" else check_hf_dir(d)
        if chk["problems"]:
            res["failures"] += 1
            res["data_lost"] += 1
            res["problems"] += [f"trial {i}: {x}" for x in chk["problems"]]
        res["empty_placeholders_left"] += len(chk.get("empty_placeholders", []))
        prev_staging = chk.get("staging_left", [])
        res["staging_dirs_left"] += len(prev_staging)
        t = temps(d)
        for sub in os.listdir(d):
            if os.path.isdir(os.path.join(d, sub)):
                t += temps(os.path.join(d, sub))
        res["temps_left"] += len(t)
        fp_core.clean(d, recursive=True)
        # placeholders of the killed writer are marked (xattr) and removed by clean()
        if kind == "lightning":
            res["empty_placeholders_after_clean"] += len(check_lightning_dir(d).get("empty_placeholders", []))
    return res


# ---------------------------------------------------------------- faults


def _old(path: str) -> dict:
    old = {"old": torch.arange(1000), "tag": "old"}
    fp_core.save(old, path)
    return old


def _outcome(name: str, path: str, old: dict | None, fn, how: str) -> dict:
    row = {"scenario": name, "how": how}
    d = os.path.dirname(path)
    try:
        fn()
        row.update(exception=None, message="(no error)")
    except BaseException as e:  # noqa: BLE001
        row.update(exception=type(e).__name__, errno=getattr(e, "errno", None), message=str(e)[:300])
        if e.__cause__ is not None:
            c = e.__cause__
            row.update(cause=type(c).__name__, cause_errno=getattr(c, "errno", None), cause_message=str(c)[:300])
    row["temps_left"] = len(temps(d)) if os.path.isdir(d) else 0
    if old is not None:
        try:
            got = fp_core.load(path, verify=True)
            row["old_intact"] = bool(torch.equal(got["old"], old["old"]) and got["tag"] == "old")
        except Exception as e:  # noqa: BLE001
            row["old_intact"] = f"{type(e).__name__}: {e}"
    return row


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def _others_can_search(d: str) -> bool:
    d = os.path.abspath(d)
    while True:
        if not os.stat(d).st_mode & 0o001:
            return False
        parent = os.path.dirname(d)
        if parent == d:
            return True
        d = parent


def _as_nobody(path: str) -> list[str]:
    """Save from a forked child that dropped to uid/gid 65534 (root ignores mode bits)."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no exec (the interpreter lives under /root, unreadable to nobody)
        try:
            os.close(rd)
            os.setgid(65534)
            os.setuid(65534)
            try:
                fp_core.save({"x": torch.ones(10)}, path)
                msg = "saved"
            except BaseException as e:  # noqa: BLE001
                msg = f"{type(e).__name__}|{getattr(e, 'errno', None)}|{e}"
            os.write(wr, msg.encode()[:4000])
        finally:
            os._exit(0)
    os.close(wr)
    chunks = []
    while True:
        b = os.read(rd, 4096)
        if not b:
            break
        chunks.append(b)
    os.close(rd)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode().split("|")


def fault_rows(root: str) -> list[dict]:
    from fp_core import AsyncCheckpointer

    base = os.path.join(root, f"faults-{uuid.uuid4().hex[:8]}")
    os.makedirs(base)
    reach = base
    rows = []
    big = {"big": torch.ones(20 << 18)}  # 20 MiB
    mounts: list[str] = []
    try:
        # full disk: an 8 MiB tmpfs
        small = os.path.join(base, "small")
        os.makedirs(small)
        if _run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", small]).returncode == 0:
            mounts.append(small)
            path = os.path.join(small, "ckpt.pt")
            old = _old(path)
            rows.append(_outcome("full disk (sync)", path, old, lambda: fp_core.save(big, path),
                                 "8 MiB tmpfs, 20 MiB save"))

            def full_async():
                with AsyncCheckpointer() as ck:
                    ck.save(big, path)
            rows.append(_outcome("full disk (async)", path, old, full_async, "8 MiB tmpfs, AsyncCheckpointer"))
        else:
            rows.append({"scenario": "full disk", "skipped": "cannot mount tmpfs (not root?)"})

        # EIO
        d = os.path.join(base, "eio")
        os.makedirs(d)
        path = os.path.join(d, "ckpt.pt")
        old = _old(path)

        def eio():
            _native.inject_fault("write", errno=errno.EIO, after_bytes=1 << 20)
            try:
                fp_core.save(big, path)
            finally:
                _native.inject_fault(None)
        rows.append(_outcome("EIO on write (sync)", path, old, eio, 'inject_fault("write", errno=5, after 1 MiB)'))

        def eio_async():
            _native.inject_fault("write", errno=errno.EIO, after_bytes=1 << 20)
            try:
                with AsyncCheckpointer() as ck:
                    ck.save(big, path)
            finally:
                _native.inject_fault(None)
        rows.append(_outcome("EIO on write (async)", path, old, eio_async, "same, AsyncCheckpointer"))

        # read-only file system: ro bind mount
        src, ro = os.path.join(base, "rw"), os.path.join(base, "ro")
        os.makedirs(src)
        os.makedirs(ro)
        if _run(["mount", "--bind", "-o", "ro", src, ro]).returncode == 0:
            mounts.append(ro)
            _run(["mount", "-o", "remount,bind,ro", ro])
            old = _old(os.path.join(src, "ckpt.pt"))
            path = os.path.join(ro, "ckpt.pt")
            rows.append(_outcome("read-only file system", path, old, lambda: fp_core.save(big, path),
                                 "mount --bind -o ro"))
        else:
            rows.append({"scenario": "read-only file system", "skipped": "cannot bind mount"})

        # permission denied: root bypasses mode bits, so (a) drop to uid 65534, (b) chattr +i
        # uid 65534 must be able to reach the directory: use /tmp (1777) when an ancestor of
        # base (e.g. pytest's 0700 tmp dir) is not searchable by others
        reach = base if _others_can_search(base) else tempfile.mkdtemp(prefix="fp-perm-", dir="/tmp")
        os.chmod(reach, 0o755)
        d = os.path.join(reach, "perm")
        os.makedirs(d)
        path = os.path.join(d, "ckpt.pt")
        old = _old(path)
        if os.geteuid() == 0:
            # (c) the directory exists but a parent is not searchable (0700)
            locked = os.path.join(reach, "locked")
            os.makedirs(os.path.join(locked, "sub"))
            os.chmod(locked, 0o700)
            out = _as_nobody(os.path.join(locked, "sub", "ckpt.pt"))
            rows.append({"scenario": "permission denied (parent not searchable, uid 65534)",
                         "how": "DIR/locked is 0700 root; save DIR/locked/sub/ckpt.pt as uid 65534",
                         "exception": out[0], "errno": out[1] if len(out) > 1 else None,
                         "message": out[2] if len(out) > 2 else out[0], "temps_left": 0,
                         "old_intact": "n/a (no old checkpoint)"})
            out = _as_nobody(path)
            row = {"scenario": "permission denied (uid 65534)", "how": "dir owned by root, 0755; forked child setuid(65534)",
                   "exception": out[0], "errno": out[1] if len(out) > 1 else None,
                   "message": out[2] if len(out) > 2 else out[0], "temps_left": len(temps(d))}
            row["old_intact"] = bool(torch.equal(fp_core.load(path, verify=True)["old"], old["old"]))
            rows.append(row)
            if _run(["chattr", "+i", d]).returncode == 0:
                try:
                    rows.append(_outcome("permission denied (chattr +i, as root)", path, old,
                                         lambda: fp_core.save(big, path), "immutable directory, uid 0"))
                finally:
                    _run(["chattr", "-i", d])
        else:
            os.chmod(d, 0o555)
            rows.append(_outcome("permission denied (chmod 0555)", path, old, lambda: fp_core.save(big, path),
                                 "non-root"))
            os.chmod(d, 0o755)

        # the target directory removed during an async save
        for policy in ("overlap", "snapshot"):
            d = os.path.join(base, f"gone-{policy}")
            os.makedirs(d)
            path = os.path.join(d, "ckpt.pt")
            _old(path)

            def gone(policy=policy, path=path, d=d):
                with AsyncCheckpointer(policy=policy) as ck:
                    ck.save({"big": torch.ones(128 << 18)}, path)  # 128 MiB
                    shutil.rmtree(d)
            row = _outcome(f"directory removed during async save ({policy})", path, None, gone,
                           "rmtree(dir) right after ckpt.save() returns")
            row["dir_exists_after"] = os.path.exists(d)
            row["old_intact"] = "n/a (the user deleted it)"
            rows.append(row)

        # O_DIRECT refused
        d = os.path.join(base, "odirect")
        os.makedirs(d)
        path = os.path.join(d, "ckpt.pt")
        old = _old(path)
        for backend in ("auto", "io_uring", "threadpool"):
            def od(backend=backend):
                _native.inject_fault("o_direct")
                try:
                    st = fp_core.save({"old": old["old"], "tag": "old"}, path, backend=backend)
                finally:
                    _native.inject_fault(None)
                raise _Fallback(f"saved with backend={st.backend} ({st.backend_reason})")
            rows.append(_outcome(f"O_DIRECT refused (backend={backend})", path, old, od, 'inject_fault("o_direct")'))

        # io_uring refused
        d = os.path.join(base, "uring")
        os.makedirs(d)
        path = os.path.join(d, "ckpt.pt")
        old = _old(path)
        for backend in ("auto", "io_uring"):
            def ur(backend=backend):
                _native.inject_fault("io_uring_setup", errno=errno.ENOSYS)
                try:
                    st = fp_core.save({"old": old["old"], "tag": "old"}, path, backend=backend)
                finally:
                    _native.inject_fault(None)
                raise _Fallback(f"saved with backend={st.backend} ({st.backend_reason})")
            rows.append(_outcome(f"io_uring refused (backend={backend})", path, old, ur,
                                 'inject_fault("io_uring_setup", errno=ENOSYS)'))
    finally:
        _native.inject_fault(None)
        for m in reversed(mounts):
            _run(["umount", "-l", m])
        shutil.rmtree(base, ignore_errors=True)
        if reach != base:
            shutil.rmtree(reach, ignore_errors=True)
    for r in rows:
        if r.get("exception") == "_Fallback":
            r["exception"] = None  # not an error: the save succeeded on a fallback backend
    return rows


class _Fallback(Exception):
    pass


# ---------------------------------------------------------------- corruption


def corruption_rows(root: str) -> list[dict]:
    base = os.path.join(root, f"corrupt-{uuid.uuid4().hex[:8]}")
    os.makedirs(base)
    rows = []
    try:
        for kind in ("flipped bit", "zeroed 4 KiB block", "truncated to half"):
            path = os.path.join(base, kind.replace(" ", "_") + ".pt")
            fp_core.save({"model": {"weight": torch.randn(1 << 20), "bias": torch.randn(100)}, "step": 3}, path)
            rec = next(r for r in fp_core.inspect(path) if r.get("tensor") == "model.weight")
            with open(path, "r+b") as f:
                if kind == "flipped bit":
                    off = rec["offset"] + rec["size"] // 2 + 3
                    f.seek(off)
                    b = f.read(1)[0]
                    f.seek(off)
                    f.write(bytes([b ^ 0x10]))
                elif kind.startswith("zeroed"):
                    f.seek(rec["offset"] + 3 * 4096)
                    f.write(b"\0" * 4096)
            if kind.startswith("truncated"):
                os.truncate(path, os.path.getsize(path) // 2)
            r = subprocess.run(CLI + ["verify", path], capture_output=True, text=True, cwd=REPO)
            row = {"scenario": kind, "cli_exit": r.returncode, "cli_message": (r.stderr or r.stdout).strip()[:300],
                   "record": rec["name"]}
            try:
                fp_core.load(path, verify=True)
                row.update(load_exception=None, load_message="(loaded!)")
            except Exception as e:  # noqa: BLE001
                row.update(load_exception=type(e).__name__, load_message=str(e)[:300])
            row["names_record_or_tensor"] = ("model.weight" in row["cli_message"] or rec["name"] in row["cli_message"])
            rows.append(row)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


# ---------------------------------------------------------------- main


def run_crash(trials: int, integration_trials: int, root: str, seed: int, modes=CORE_MODES) -> list[dict]:
    rng = random.Random(seed)
    out = []
    per = {m: max(1, round(trials * WEIGHTS[m] / sum(WEIGHTS[x] for x in modes))) for m in modes}
    for m in modes:
        T = calibrate(m, root)
        log(f"[crash] {m}: calibrated save {T * 1e3:.0f} ms, {per[m]} trials")
        t0 = time.monotonic()
        r = core_trials(m, per[m], root, rng, T)
        r["wall_s"] = round(time.monotonic() - t0, 1)
        log(f"[crash] {m}: {json.dumps({k: v for k, v in r.items() if k != 'problems'})}")
        for p in r["problems"][:10]:
            log(f"    PROBLEM {p}")
        out.append(r)
    for kind in ("lightning", "hf"):
        if integration_trials <= 0:
            continue
        t0 = time.monotonic()
        r = integration_trials_fn(kind, integration_trials, root, rng)
        r["wall_s"] = round(time.monotonic() - t0, 1)
        log(f"[crash] {kind}: {json.dumps({k: v for k, v in r.items() if k != 'problems'})}")
        for p in r["problems"][:10]:
            log(f"    PROBLEM {p}")
        out.append(r)
    return out


integration_trials_fn = integration_trials


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200, help="core crash trials, spread over --modes by weight")
    ap.add_argument("--integration-trials", type=int, default=8, help="Lightning and HF crash trials each")
    ap.add_argument("--only", default="crash,faults,corruption")
    ap.add_argument("--modes", default=",".join(CORE_MODES),
                    help=f"comma list of {','.join(CORE_MODES + OTHER_MODES)}")
    ap.add_argument("--root", default=DEFAULT_ROOT)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.makedirs(a.root, exist_ok=True)
    only = set(a.only.split(","))
    report: dict = {}
    t0 = time.monotonic()
    if "faults" in only:
        report["faults"] = fault_rows(a.root)
        for r in report["faults"]:
            log(f"[fault] {json.dumps(r)}")
    if "corruption" in only:
        report["corruption"] = corruption_rows(a.root)
        for r in report["corruption"]:
            log(f"[corrupt] {json.dumps(r)}")
    if "crash" in only:
        report["crash"] = run_crash(a.trials, a.integration_trials, a.root, a.seed, tuple(a.modes.split(",")))
        tot = sum(r["trials"] for r in report["crash"])
        lost = sum(r["data_lost"] for r in report["crash"])
        fails = sum(r["failures"] for r in report["crash"])
        log(f"[crash] TOTAL trials={tot} failures={fails} data_lost={lost}")
    report["wall_s"] = round(time.monotonic() - t0, 1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = any(r["data_lost"] or r["failures"] for r in report.get("crash", []))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
