"""Sweep fp_core.save engine options on the bench state dict (best of --repeat per setting).

    .venv/bin/python benchmarks/sweep_engine_options.py --dir /work/bench-tmp/sweep --size 1GiB
"""

from __future__ import annotations

import argparse
import os
import time

from fp_core import save
from fp_core.tools.bench import make_state_dict
from fp_core.tools.bench_args import size_arg as parse_size
from fp_core.tools.common import payload_bytes

SETTINGS = [
    {},
    {"copy_threads": 1},
    {"copy_threads": 2, "queue_depth": 32},
    {"copy_threads": 2, "queue_depth": 8},
    {"chunk_bytes": 8 << 20},
    {"chunk_bytes": 16 << 20, "queue_depth": 8},
    {"chunk_bytes": 1 << 20, "queue_depth": 32},
    {"backend": "threadpool"},
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="./bench-out")
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    sd = make_state_dict(a.size)
    n = payload_bytes(sd)
    path = os.path.join(a.dir, "sweep.pt")
    print(f"{'options':48s} {'GB/s':>6s} {'total s':>8s} {'serialize':>9s} {'write':>6s} {'copy+crc':>8s}")
    for opts in SETTINGS:
        runs = []
        for _ in range(a.repeat):
            os.sync()
            time.sleep(0.3)
            runs.append(save(sd, path, **opts))
        st = min(runs, key=lambda s: s.seconds)
        print(f"{str(opts or 'defaults'):48s} {n / st.seconds / 1e9:6.2f} {st.seconds:8.2f} "
              f"{st.serialize_seconds:9.2f} {st.write_seconds:6.2f} {st.copy_seconds:8.2f}", flush=True)
    os.unlink(path)


if __name__ == "__main__":
    main()
