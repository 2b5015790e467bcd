"""A trainer that SIGKILLs itself mid-checkpoint (tests/core/test_process_writer.py,
benchmarks/process_writer_kills.py).

``python process_writer_victim.py DIR WRITER WHEN DELAY_MS MIB``

Generation 1 of a state (every byte of it encodes its generation) is saved to
``DIR/ckpt.pt`` and waited for; then generation 2 is saved to the same name and the process
kills itself:

* ``after-fence``: once ``save()`` has returned and ``fence()`` has passed, after DELAY_MS
  (the trainer would be running its next step; the write is still in flight).
* ``in-snapshot``: DELAY_MS after ``save()`` was called, from another thread, while the
  snapshot is (likely) still being copied.

Before dying it writes the writer process's pid (0 for the thread writer) to
``DIR/writer.pid``, so the caller can wait for an orphaned writer to finish.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import fp_core  # noqa: E402


def state(gen: int, mib: int) -> dict:
    n = mib << 18  # float32 elements
    return {"w": torch.full((n,), float(gen)), "b": torch.full((1000,), float(gen)), "gen": gen}


def check(path: str) -> int:
    """The generation the whole file at ``path`` holds (raises if torn or mixed)."""
    fp_core.verify(path)
    obj = torch.load(path, weights_only=True)
    g = obj["gen"]
    if not (bool((obj["w"] == g).all()) and bool((obj["b"] == g).all())):
        raise AssertionError(f"{path}: tensors do not all hold generation {g}")
    return g


def main(directory: str, writer: str, when: str, delay_ms: float, mib: int) -> None:
    path = os.path.join(directory, "ckpt.pt")
    ckpt = fp_core.AsyncCheckpointer(writer=writer, policy="snapshot")
    ckpt.save(state(1, mib), path)
    ckpt.wait()
    pid = ckpt._writer_proc.pid if ckpt._writer_proc is not None else 0
    with open(os.path.join(directory, "writer.pid"), "w") as f:
        f.write(str(pid))
    obj = state(2, mib)
    if when == "in-snapshot":
        t = threading.Timer(delay_ms / 1e3, os.kill, (os.getpid(), signal.SIGKILL))
        t.start()
        ckpt.save(obj, path)
        ckpt.fence()
        time.sleep(60)  # killed by the timer
    ckpt.save(obj, path)
    ckpt.fence()
    obj["w"].fill_(99.0)  # the next step changes the state: the checkpoint must not see it
    time.sleep(delay_ms / 1e3)
    os.kill(os.getpid(), signal.SIGKILL)


def wait_gone(pid: int, timeout: float = 120.0) -> bool:
    """Wait for process ``pid`` (not necessarily our child) to exit; False on timeout."""
    import select

    if pid <= 0:
        return True
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]))
