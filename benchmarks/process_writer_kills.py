"""Kill trials for the process writer (issue #40): is a checkpoint whose fence has passed
committed when its trainer is SIGKILLed right after?

    python benchmarks/process_writer_kills.py --trials 100 --snapshot-trials 20 --out benchmarks/results/process-writer-kills.json

Each trial runs ``tests/helpers/process_writer_victim.py`` in a fresh process: generation 1
of a state is saved and waited for, generation 2 is saved to the same name, and the victim
SIGKILLs itself a random 0..``--max-delay-ms`` after ``save()`` returned and ``fence()``
passed (``after-fence``), or a random 0..``--max-delay-ms`` after ``save()`` was called
(``in-snapshot``: often while the snapshot is still being copied). Once the victim's writer
process (if any) has exited, ``ckpt.pt`` must verify and hold one whole generation:

* ``after-fence``: generation 2 is a commit; generation 1 means the save was lost.
* ``in-snapshot``: either generation is fine (the kill may come after the hand-over); a
  torn or unverifiable file, or none, is a failure.

The same after-fence trials run with the thread writer as the control.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
sys.path.insert(0, HELPERS)
sys.path.insert(0, REPO)

from process_writer_victim import check, wait_gone  # noqa: E402


def trial(root: str, writer: str, when: str, delay_ms: float, mib: int) -> dict:
    d = tempfile.mkdtemp(dir=root)
    try:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, os.path.join(HELPERS, "process_writer_victim.py"), d, writer, when,
                            f"{delay_ms:.1f}", str(mib)], capture_output=True, text=True, timeout=300)
        out = {"writer": writer, "when": when, "delay_ms": round(delay_ms, 1)}
        if r.returncode != -signal.SIGKILL:
            return {**out, "result": "victim-error", "detail": r.stderr[-1500:]}
        pid = int(open(os.path.join(d, "writer.pid")).read())
        if not wait_gone(pid, 120):
            return {**out, "result": "writer-hung"}
        try:
            gen = check(os.path.join(d, "ckpt.pt"))
        except Exception as e:  # noqa: BLE001 - a torn or missing file is the finding
            return {**out, "result": "torn", "detail": f"{type(e).__name__}: {e}"}
        leftovers = [n for n in os.listdir(d) if n not in ("ckpt.pt", "writer.pid")]
        return {**out, "result": "committed" if gen == 2 else "previous", "leftovers": leftovers,
                "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100, help="after-fence trials per writer")
    ap.add_argument("--snapshot-trials", type=int, default=20, help="in-snapshot trials (process writer)")
    ap.add_argument("--mib", type=int, default=64, help="checkpoint size")
    ap.add_argument("--max-delay-ms", type=float, default=60.0)
    ap.add_argument("--snapshot-mib", type=int, default=512, help="checkpoint size of the in-snapshot trials")
    ap.add_argument("--snapshot-max-delay-ms", type=float, default=300.0)
    ap.add_argument("--dir", default=os.path.join(REPO, "..", "fp-kill-trials"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the JSON report here")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    os.makedirs(a.dir, exist_ok=True)
    plan = [(w, "after-fence") for _ in range(a.trials) for w in ("process", "thread")]
    plan += [("process", "in-snapshot")] * a.snapshot_trials
    results = []
    for i, (w, when) in enumerate(plan):
        snap = when == "in-snapshot"
        res = trial(a.dir, w, when, rng.uniform(0, a.snapshot_max_delay_ms if snap else a.max_delay_ms),
                    a.snapshot_mib if snap else a.mib)
        results.append(res)
        print(f"[{i + 1}/{len(plan)}] {w:7s} {when:11s} {res['delay_ms']:5.1f} ms: {res['result']}", flush=True)
    summary: dict = {}
    for r in results:
        key = f"{r['writer']} {r['when']}"
        s = summary.setdefault(key, {"trials": 0})
        s["trials"] += 1
        s[r["result"]] = s.get(r["result"], 0) + 1
        s["leftovers"] = s.get("leftovers", 0) + len(r.get("leftovers", []))
    report = {"command": " ".join(sys.argv), "mib": a.mib, "max_delay_ms": a.max_delay_ms,
              "snapshot_mib": a.snapshot_mib, "snapshot_max_delay_ms": a.snapshot_max_delay_ms, "summary": summary,
              "trials": results}
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
