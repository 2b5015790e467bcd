"""A trainer whose checkpoint directory is committed by its writer process, SIGKILLed right
after the last checkpoint's fence (tests/core/test_process_writer.py).

``python dir_commit_victim.py RUN MIB``: checkpoint-1 (small) is written into
``RUN/.fastpersist-staging-1`` and committed as ``RUN/checkpoint-1`` by the writer process
(``hand_over_dir_commit``, as the HF callback does); then checkpoint-2 (``MIB`` MiB: still
being written when the trainer dies) is handed over the same way, the fence passes, the
writer's pid is printed and the process SIGKILLs itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import fp_core  # noqa: E402


def main(run: str, mib: int) -> None:
    ck = fp_core.AsyncCheckpointer(writer="process", policy="snapshot")
    for step in (1, 2):
        staging = os.path.join(run, f".fastpersist-staging-{step}")
        os.makedirs(staging, exist_ok=True)
        n = (1 << 18) if step == 1 else (mib << 18)
        h = ck.save({"w": torch.full((n,), float(step))}, os.path.join(staging, "optimizer.pt"))
        with open(os.path.join(staging, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step}, f)
        wait = ck.hand_over_dir_commit(staging, os.path.join(run, f"checkpoint-{step}"),
                                       [os.path.join(staging, "trainer_state.json")], [h])
        assert wait is not None, "the writer process does not hold the directory's files"
        if step == 1:
            ck.enqueue(wait).result()
    ck.fence()
    print(ck._writer_proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
