"""A rank that reports how it started: torch imported before its first line (a fork of the
session's forkserver) or not (a fresh interpreter), its argv, cwd and one variable."""

import sys

preloaded = "torch" in sys.modules

import json  # noqa: E402
import os  # noqa: E402

rank, d = int(sys.argv[1]), sys.argv[4]
out = {"preloaded": preloaded, "argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("FP_RANK_PROBE"),
       "omp": os.environ.get("OMP_NUM_THREADS"), "path0": sys.path[0]}
for name in [f"result{rank}.json"] + (["result.json"] if rank == 0 else []):
    with open(os.path.join(d, name), "w") as f:
        json.dump(out, f)
if rank == 1 and "fail" in sys.argv[5:]:
    print("rank 1 fails on purpose", file=sys.stderr)
    sys.exit(3)
if "atexit" in sys.argv[5:]:
    import atexit

    def _at_exit() -> None:  # what an exit handler sees: fp_core's drain reads sys.last_value
        with open(os.path.join(d, f"atexit{rank}.json"), "w") as f:
            json.dump({"last": repr(getattr(sys, "last_value", None))}, f)

    atexit.register(_at_exit)
    if rank == 1:
        raise RuntimeError("rank 1 raises on purpose")
