"""Cold ``dcp.load`` of one sharded checkpoint with DCP's stock reader and FastPersist's
(with and without ``verify``), into an existing state, page cache dropped before each.

One process, no process group (``no_dist``); the checkpoint (both writers' copies) is
written once into ``--dir`` by the first run and reused. Meant to be run alternately from
two checkouts, the stock row being each process's own reference:

    for i in 1 2 3; do
        (cd OLD && PYTHONPATH=$PWD python benchmarks/dcp_load_ab.py --dir D --size 1GiB)
        (cd NEW && PYTHONPATH=$PWD python benchmarks/dcp_load_ab.py --dir D --size 1GiB)
    done

Prints the checkout it imported fp_core from and the seconds of every round per row.
``benchmarks/regenerate.py --only dcp-load-ab`` reruns the A/B kept in
``benchmarks/results/dcp-load-ab.txt`` (this script, from the newer commit, run in both).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch.distributed.checkpoint as dcp

import fp_core
from fp_core.format.sizes import parse_size
from fp_core.parallel.dcp import FastPersistReader, FastPersistWriter
from fp_core.tools.bench import drop_all_caches, make_state_dict, settle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the two checkpoints go (kept between runs)")
    ap.add_argument("--size", default="1GiB", help="state size (2412 tensors, as fastpersist bench's)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    size = parse_size(args.size)
    fp, stock = os.path.join(args.dir, "fp"), os.path.join(args.dir, "stock")
    if not os.path.exists(fp):
        sd = make_state_dict(size, seed=0)
        dcp.save(sd, storage_writer=FastPersistWriter(fp), no_dist=True)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
        del sd
    target = make_state_dict(size, seed=1)  # a resumed job's state, built before its load
    readers = {"stock": lambda: dcp.FileSystemReader(stock), "fp": lambda: FastPersistReader(fp),
               "fp_verify": lambda: FastPersistReader(fp, verify=True)}
    res: dict[str, list[float]] = {k: [] for k in readers}
    for _ in range(args.rounds):
        for key, make in readers.items():
            os.sync()
            drop_all_caches()
            settle(0.3)
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=make(), no_dist=True)
            res[key].append(round(time.perf_counter() - t0, 3))
    print(os.path.dirname(os.path.dirname(os.path.abspath(fp_core.__file__))), json.dumps(res))


if __name__ == "__main__":
    main()
