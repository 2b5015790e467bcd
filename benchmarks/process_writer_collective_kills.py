"""Kill trials for collective and sharded saves with the process writer (issue #40): is a
save of every rank committed when one rank's trainer is SIGKILLed right after its fence?

    python benchmarks/process_writer_collective_kills.py --trials 20 --out benchmarks/results/process-writer-collective-kills.json

Each trial launches 2 ranks (gloo on loopback) of ``tests/helpers/process_writer_collective.py``:
generation 1 of a replicated state (``collective``), or of FSDP2-like DTensor state saved as
one file (``file``) or as a DCP directory (``dcp``), is saved and waited for; generation 2 is
saved (``--mib`` MiB, so that the write is still in flight), and rank 1 SIGKILLs itself a random 0..``--max-delay-ms`` after its fence. Once every
writer process has exited, the checkpoint must verify and hold one whole generation:
generation 2 is a commit, generation 1 a lost save, anything else torn. The same trials run
with the thread writer as the control, alternated with the process writer's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
sys.path.insert(0, HELPERS)
sys.path.insert(0, REPO)

from process_writer_collective import generation  # noqa: E402
from process_writer_victim import wait_gone  # noqa: E402

SCENARIOS = {"collective": ("kill-after-fence", "ckpt.pt"), "file": ("sharded-kill-after-fence", "full.pt"),
             "dcp": ("dcp-kill-after-fence", "dcp-dir")}


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def trial(root: str, kind: str, writer: str, delay_ms: float, mib: int) -> dict:
    scenario, name = SCENARIOS[kind]
    d = tempfile.mkdtemp(dir=root)
    out = {"kind": kind, "writer": writer, "delay_ms": round(delay_ms, 1)}
    env = dict(os.environ, FP_TEST_WRITER=writer, FP_KILL_DELAY_MS=f"{delay_ms:.1f}", FP_TEST_MIB=str(mib))
    try:
        port = _port()
        procs = [subprocess.Popen([sys.executable, os.path.join(HELPERS, "process_writer_collective.py"), str(r),
                                   "2", port, d, scenario], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, env=env) for r in range(2)]
        try:
            errs = [p.communicate(timeout=240)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if procs[1].returncode != -9:
            return {**out, "result": "victim-error", "detail": errs[1][-1500:]}
        for r in range(2):
            pid = int(open(os.path.join(d, f"writer{r}.pid")).read())
            if not wait_gone(pid, 120):
                return {**out, "result": "writer-hung"}
        try:
            gen = generation(os.path.join(d, name))
        except Exception as e:  # noqa: BLE001 - a torn or missing checkpoint is the finding
            return {**out, "result": "torn", "detail": f"{type(e).__name__}: {e}"}
        return {**out, "result": "committed" if gen == 2 else "previous" if gen == 1 else f"generation {gen}"}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="per kind and writer")
    ap.add_argument("--kinds", default="collective,file,dcp")
    ap.add_argument("--max-delay-ms", type=float, default=60.0)
    ap.add_argument("--mib", type=int, default=64, help="the replicated state's size (float32 MiB)")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk under test")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="fp-coll-kills-", dir=a.dir)
    rng = random.Random(40)
    rows = []
    t0 = time.perf_counter()
    try:
        for i in range(a.trials):
            for kind in a.kinds.split(","):
                delay = rng.uniform(0, a.max_delay_ms)
                for writer in (("process", "thread") if i % 2 == 0 else ("thread", "process")):
                    row = trial(root, kind, writer, delay, a.mib)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict = {}
    for row in rows:
        key = f"{row['kind']}/{row['writer']}"
        summary.setdefault(key, {})
        summary[key][row["result"]] = summary[key].get(row["result"], 0) + 1
    report = {"command": "python benchmarks/process_writer_collective_kills.py " + " ".join(sys.argv[1:] if argv is None
                                                                                          else argv),
              "seconds": round(time.perf_counter() - t0, 1), "summary": summary, "trials": rows}
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
