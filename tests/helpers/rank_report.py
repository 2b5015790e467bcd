"""How a rank of a multi-process test reports back: its result as JSON in the run's
directory (``result{rank}.json``; rank 0's also as ``result.json``, which
``conftest.run_ranks`` returns), then an immediate exit."""

from __future__ import annotations

import json
import os


def report_and_exit(d: str, rank: int, result: dict) -> None:
    for name in [f"result{rank}.json"] + (["result.json"] if rank == 0 else []):
        with open(os.path.join(d, name), "w") as f:
            json.dump(result, f)
    os._exit(0)  # skip destroy_process_group: a dead peer would make it hang
