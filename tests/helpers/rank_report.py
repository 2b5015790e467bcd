"""How a rank of a multi-process test joins its peers (:func:`join`, from the command line
``conftest.run_ranks`` gives it) and reports back: its result as JSON in the run's
directory (``result{rank}.json``; rank 0's also as ``result.json``, which
``conftest.run_ranks`` returns), then an immediate exit."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Iterator


def join() -> tuple[int, int, str, str]:
    """``RANK WORLD PORT DIR SCENARIO`` from the command line: the gloo process group is
    joined on loopback; returns (rank, world, DIR, SCENARIO)."""
    import torch.distributed as dist

    rank, world, port, d, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world, d, scenario


def report_and_exit(d: str, rank: int, result: dict) -> None:
    for name in [f"result{rank}.json"] + (["result.json"] if rank == 0 else []):
        with open(os.path.join(d, name), "w") as f:
            json.dump(result, f)
    os._exit(0)  # skip destroy_process_group: a dead peer would make it hang


@contextlib.contextmanager
def reported(d: str, rank: int, result: dict) -> Iterator[dict]:
    """Run a rank's scenario: ``result["ok"]`` it ended, or the error and its traceback;
    then report and exit (the block's exception is reported, never raised)."""
    try:
        yield result
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
    report_and_exit(d, rank, result)
