"""How a rank of a multi-process test reports back: its result as JSON in the run's
directory (``result{rank}.json``; rank 0's also as ``result.json``, which
``conftest.run_ranks`` returns), then an immediate exit."""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from collections.abc import Iterator


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
