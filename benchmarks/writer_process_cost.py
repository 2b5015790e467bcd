"""What one writer process per training process costs (issue #40: one writer per process
or one per machine): its memory and its start, for K trainers on one machine.

    python benchmarks/writer_process_cost.py --trainers 1,2,4 --out benchmarks/results/writer-process-cost.txt

Each of K trainer processes makes an ``AsyncCheckpointer(writer="process")`` and saves a
small state twice. Reported per trainer: the first save's time to ``result()`` (it starts
the writer: a fresh interpreter importing torch, in the background of that save) against
the second's, and the writer's memory once idle: resident (RSS) and proportional (PSS:
shared library pages divided among the processes mapping them, which is what the writers
add together on one machine). A per-machine writer would save K - 1 of these; each
trainer's own writer keeps ranks' failures apart and needs no election.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
import torch, fp_core
d = sys.argv[1]
ck = fp_core.AsyncCheckpointer(writer="process")
st = {{"w": torch.randn(1 << 18)}}
t0 = time.perf_counter(); ck.save(st, os.path.join(d, "a.pt")).result(); first = time.perf_counter() - t0
t0 = time.perf_counter(); ck.save(st, os.path.join(d, "b.pt")).result(); second = time.perf_counter() - t0
pid = ck._writer_proc.pid
mem = {{}}
with open(f"/proc/{{pid}}/smaps_rollup") as f:
    for line in f:
        k, _, v = line.partition(":")
        if k in ("Rss", "Pss"):
            mem[k] = int(v.split()[0]) * 1024
print(json.dumps({{"first_s": first, "second_s": second, "rss": mem["Rss"], "pss": mem["Pss"]}}))
sys.stdout.flush()
input()  # hold until every trainer has measured: PSS shares pages among the writers alive
ck.close()
"""


def run(k: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        procs = []
        for i in range(k):
            sub = os.path.join(d, str(i))
            os.mkdir(sub)
            procs.append(subprocess.Popen([sys.executable, "-c", CHILD.format(repo=REPO), sub], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True))
        rows = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.communicate("\n", timeout=120)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainers", default="1,2,4")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lines = ["# python benchmarks/writer_process_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
             "| trainers | first save (starts the writer), s | second save, s | writer RSS, MiB | writer PSS, MiB | "
             "all writers' PSS, MiB |", "|---:|---:|---:|---:|---:|---:|"]
    for k in [int(x) for x in a.trainers.split(",")]:
        rows = run(k)
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        lines.append(f"| {k} | {med['first_s']:.2f} | {med['second_s']:.3f} | {med['rss'] / 2**20:.0f} | "
                     f"{med['pss'] / 2**20:.0f} | {sum(r['pss'] for r in rows) / 2**20:.0f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
