"""A process that saves and then ends by one of the ways a process ends, for
tests/core/test_user_files.py. Prints one JSON line of what it saw.

Usage: python exit_paths.py SCENARIO DIR
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fp_core  # noqa: E402

N = 4 << 20  # floats: 16 MiB, a save still pending when the child returns


def state(gen: int) -> dict:
    return {"w": torch.full((N,), float(gen)), "gen": gen}


def save_and_return(path: str, gen: int) -> None:
    """A multiprocessing child's target: queue an async save and return at once."""
    fp_core.AsyncCheckpointer().save(state(gen), path)


def plugin_save_and_return(path: str, gen: int) -> None:
    """As Fabric's ddp_fork worker does: the Lightning plugin saves while training runs."""
    from fp_integrations.lightning import FastPersistIO

    io = FastPersistIO()
    io._torn_down = False  # a training step ran: saves are asynchronous
    io.save_checkpoint(state(gen), path)


def main() -> None:
    scenario, d = sys.argv[1], sys.argv[2]
    path = os.path.join(d, "ckpt.pt")
    out: dict = {}
    if scenario in ("fork", "forkserver", "spawn"):
        ctx = mp.get_context(scenario)
        p = ctx.Process(target=save_and_return, args=(path, 3))
        p.start()
        p.join()
        out["exitcode"] = p.exitcode
    elif scenario in ("plugin-fork", "plugin-forkserver"):
        ctx = mp.get_context(scenario.split("-")[1])
        p = ctx.Process(target=plugin_save_and_return, args=(path, 4))
        p.start()
        p.join()
        out["exitcode"] = p.exitcode
    elif scenario == "os-exit":  # nothing of ours runs: the placeholder's name holds text, not 0 bytes
        from fp_integrations.lightning import FastPersistIO

        io = FastPersistIO()
        io._torn_down = False
        io.save_checkpoint(state(5), path)
        os._exit(0)
    elif scenario == "inherit":
        # The parent's save is pending when it forks: the child must neither write it nor
        # wait for it, and may save on its own; the parent's save still commits.
        ckpt = fp_core.AsyncCheckpointer()
        h = ckpt.save(state(6), path)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                # the parent's temporary file is not held open by the child
                for fd in os.listdir("/proc/self/fd"):
                    try:
                        if os.readlink(f"/proc/self/fd/{fd}").startswith(d):
                            code = 5
                    except OSError:
                        pass
                t0 = time.monotonic()
                ckpt.wait()  # nothing of the parent's to wait for
                waited = time.monotonic() - t0
                try:
                    h.result(timeout=5)
                    code = 3  # the parent's save must not read as done in the child
                except fp_core.CheckpointError:
                    pass
                # small: torch's OpenMP pool, used by the parent, does not survive a fork
                ckpt.save({"w": torch.arange(1000.0), "gen": 7}, os.path.join(d, "child.pt")).result()
                ckpt.close()
                code = code or (4 if waited > 5 else 0)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        h.result()
        ckpt.close()
        out["child_status"] = os.waitstatus_to_exitcode(status)
    elif scenario == "fork-during-write":
        # Children forked again and again while the parent's engine writes (its copy threads
        # take and return staging buffers all the time): each must save on its own, not
        # wait forever on a lock one of the parent's threads held at the fork.
        ckpt = fp_core.AsyncCheckpointer(policy="overlap")
        h = ckpt.save({"w": torch.ones(128 << 20)}, path)  # 512 MiB
        children: dict[int, float] = {}
        statuses: list = []
        while not h.done() or children:
            if not h.done() and len(children) < 4:
                pid = os.fork()
                if pid == 0:
                    try:
                        fp_core.save({"w": torch.arange(1000.0)}, os.path.join(d, f"child-{os.getpid()}.pt"))
                        os._exit(0)
                    except BaseException:  # noqa: BLE001
                        os._exit(2)
                children[pid] = time.monotonic()
            for pid, t0 in list(children.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses.append(os.waitstatus_to_exitcode(status))
                    del children[pid]
                elif time.monotonic() - t0 > 30:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    statuses.append("hung")
                    del children[pid]
            time.sleep(0.002)
        h.result()
        ckpt.close()
        out["children"] = statuses
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
