"""A rank of a collective save run by the writer processes (tests/core/test_process_writer_collective.py).

``python process_writer_collective.py RANK WORLD PORT DIR SCENARIO``

Every rank holds the same state (a data-parallel replica, every byte encoding its
generation) and saves it with ``AsyncCheckpointer(writer="process", group=WORLD)``; the
writers run the collective save among themselves. Each rank writes ``DIR/result{rank}.json``.

* ``together``: two collective saves (both writers write a share), a save that fails on one
  rank only (an unpicklable object there: every rank fails, the file keeps generation 2),
  rank 0 declining one save that it writes alone, and one more collective save.
* ``kill-after-fence``: rank 1 SIGKILLs itself right after generation 2's save and fence;
  rank 0's save must still commit (rank 1's orphaned writer does its share).
* ``sharded-kill-after-fence``, ``dcp-kill-after-fence``: the same with FSDP2-like DTensor
  state saved as one file (``layout="file"``) or a DCP directory: rank 1's orphaned writer
  writes its rows.
* ``writer-killed``: rank 1's writer is SIGKILLed between saves: the next collective save
  fails on every rank with an error that says so, and generation 1 stays; the save after
  it forms the writers' group again (collective, DCP and one-file saves go on). Then rank
  0's writer is killed as a save is handed over: it and the next may fail, the rest commit.
* ``decline-first``: rank 0 declines before any collective save; then a group of rank 0 alone.
* ``submesh``: DTensors on ``mesh["dp"]`` of a named 2-D mesh, saved four times as DCP directories.
* ``no-shared-memory-on-1``: rank 1 may not use shared memory: every rank's collective
  saves stay on the thread writer (one route for all), and they succeed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fp_core  # noqa: E402

MIB = int(os.environ.get("FP_TEST_MIB", "3"))  # the benchmark's states are larger


def state(gen: int) -> dict:
    return {"w": torch.full((MIB << 18,), float(gen)), "b": torch.full((1000,), float(gen)),
            "h": torch.full((77, 3), gen, dtype=torch.bfloat16), "gen": gen}


def sharded_state(gen: int, mesh) -> dict:
    """``state(gen)`` as FSDP2 holds it: rows sharded (uneven), a replicated tensor, a plain one."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = state(gen)
    return {"w": distribute_tensor(full["w"][: 7 * ((MIB << 18) // 7 - 1)].reshape(-1, 7).clone(), mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Replicate()]), "h": full["h"], "gen": gen}


def generation(path: str) -> int:
    """The generation the whole file (or DCP directory) holds (raises if torn or mixed)."""
    fp_core.verify(path)
    if os.path.isdir(path):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, path + ".pt")
        path += ".pt"
    obj = torch.load(path, weights_only=True)
    g = obj["gen"]
    assert all(bool((obj[k] == g).all()) for k in ("w", "b", "h")), f"{path}: mixed generations"
    return g


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return ""


def main(rank: int, world: int, port: str, d: str, scenario: str) -> dict:
    path = os.path.join(d, "ckpt.pt")
    out: dict = {"rank": rank}
    if scenario == "no-shared-memory-on-1" and rank == 1:
        bad = os.path.join(d, "shm-not-private")
        os.makedirs(os.path.join(bad, f"fastpersist-{os.geteuid()}"), mode=0o777, exist_ok=True)
        os.chmod(os.path.join(bad, f"fastpersist-{os.geteuid()}"), 0o777)
        os.environ["FASTPERSIST_SHM_DIR"] = bad
    # the benchmark's control runs the same trials with the thread writer (FP_TEST_WRITER=thread)
    ck = fp_core.AsyncCheckpointer(writer=os.environ.get("FP_TEST_WRITER", "process"), group=dist.group.WORLD,
                                   policy="snapshot", timeout_s=60)
    if scenario == "decline-first":
        return decline_first(ck, rank, d, out)
    if scenario == "submesh":
        return submesh(ck, rank, world, d, out)
    st = state(1)
    stats = ck.save(st, path).result()
    out["first"] = {"writer": stats.extra.get("writer"), "writer_ranks": stats.extra.get("writer_ranks"),
                    "rank_bytes": stats.extra.get("rank_bytes")}
    out["writer_pid"] = ck._writer_proc.pid if ck._writer_proc is not None else 0
    kill_delay = float(os.environ.get("FP_KILL_DELAY_MS", "0")) / 1e3  # after the fence (the benchmark's)
    if scenario == "together":
        first_join = ck._writers._join_seq
        h = ck.save(state(2), path)
        ck.fence()
        h.result()
        bad = state(3)
        if rank == 1:
            bad["lock"] = threading.Lock()  # cannot be pickled: this rank has no layout
        out["plan_error"] = error_of(lambda: ck.save(bad, path).result())
        dist.barrier()
        out["after_plan_error"] = generation(path)
        if rank == 0:
            ck.decline()
            ck.save(state(4), os.path.join(d, "alone.pt"), local=True).result()
            declined = None
        else:
            declined = ck.save(state(4), os.path.join(d, "peer-path.pt")).result().extra.get("declined")
        out["declined"] = declined
        ck.wait()
        out["alone"] = generation(os.path.join(d, "alone.pt")) if rank == 0 else None
        ck.save(state(5), path).result()
        out["last"] = generation(path)
        # the failed save in the writers' group had it formed again (it may leave the group's
        # collectives out of step), once; the saves after it went on in the new one
        out["rejoined"] = ck._writers._join_seq > first_join
    elif scenario == "kill-after-fence":
        with open(os.path.join(d, f"writer{rank}.pid"), "w") as f:
            f.write(str(out["writer_pid"]))
        st2 = state(2)
        h = ck.save(st2, path)
        ck.fence()
        if rank == 1:
            time.sleep(kill_delay)
            os.kill(os.getpid(), signal.SIGKILL)
        st2["w"].fill_(99.0)  # the next step: the checkpoint must not see it
        out["second"] = error_of(h.result)
        out["gen"] = generation(path)  # the thread writer's control: rank 0's save fails, 1 stays
    elif scenario in ("sharded-kill-after-fence", "dcp-kill-after-fence"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        layout = "file" if scenario.startswith("sharded") else "dcp"
        one = os.path.join(d, "full.pt" if layout == "file" else "dcp-dir")
        ck.save(sharded_state(1, mesh), one, layout=layout).result()
        with open(os.path.join(d, f"writer{rank}.pid"), "w") as f:
            f.write(str(out["writer_pid"]))
        st2 = sharded_state(2, mesh)
        h = ck.save(st2, one, layout=layout)
        ck.fence()
        if rank == 1:
            time.sleep(kill_delay)
            os.kill(os.getpid(), signal.SIGKILL)
        st2["w"].to_local().fill_(99.0)  # the next step: the checkpoint must not see it
        stats = h.result()
        out["second"] = {"writer": stats.extra.get("writer"), "layout": stats.extra.get("layout", "dcp")}
        out["gen"] = generation(one)
    elif scenario == "writer-killed":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        one = os.path.join(d, "dcp-dir")
        ck.save(sharded_state(1, mesh), one, layout="dcp").result()  # the writers' meshes are made
        dist.barrier()
        if rank == 1:
            os.kill(ck._writer_proc.pid, signal.SIGKILL)
            ck._writer_proc.proc.wait()
        dist.barrier()
        t0 = time.monotonic()
        out["second"] = error_of(lambda: ck.save(state(2), path).result())
        out["second_seconds"] = time.monotonic() - t0
        dist.barrier()
        out["gen"] = generation(path)
        # the next save forms the writers' group again: collective, DCP (meshes over the new
        # group) and one-file sharded saves all go on in the writer processes
        out["third"] = error_of(lambda: ck.save(state(3), path).result())
        out["third_writer"] = ck.save(state(3), path).result().extra.get("writer")
        ck.save(sharded_state(3, mesh), one, layout="dcp").result()
        ck.save(sharded_state(3, mesh), os.path.join(d, "full.pt"), layout="file").result()
        dist.barrier()
        out["after"] = [generation(path), generation(one), generation(os.path.join(d, "full.pt"))]
        # rank 0's writer (its trainer hosts the store) killed right after a save is handed
        # over: that save and at most the next fail, every later one commits
        h = ck.save(state(4), path)
        if rank == 0:
            os.kill(ck._writer_proc.pid, signal.SIGKILL)
            ck._writer_proc.proc.wait()
        outcomes = [error_of(h.result)]
        for g in (5, 6, 7):
            outcomes.append(error_of(lambda g=g: ck.save(state(g), path).result()))
        out["outcomes"] = outcomes
        dist.barrier()
        out["last"] = generation(path)
    elif scenario == "no-shared-memory-on-1":
        ck.save(state(2), path).result()
        out["gen"] = generation(path)
    out["close"] = error_of(ck.close)
    out["writer_alive_after_close"] = out["writer_pid"] > 0 and os.path.exists(f"/proc/{out['writer_pid']}")
    return out


def decline_first(ck, rank: int, d: str, out: dict) -> dict:
    """Rank 0's first collective act is a decline (Lightning's first checkpoint to a URL): it
    meets the peers' first collective save in the writers' join. Then a save over a group
    that is not the whole world goes to the thread writer at once, asking nobody."""
    t0 = time.monotonic()
    if rank == 0:
        ck.decline()
        ck.save(state(1), os.path.join(d, "alone.pt"), local=True).result()
    else:
        out["declined"] = ck.save(state(1), os.path.join(d, "peer-path.pt")).result().extra.get("declined")
    ck.save(state(2), os.path.join(d, "ckpt.pt")).result()
    out["seconds"] = time.monotonic() - t0
    out["writer"] = ck.save(state(3), os.path.join(d, "ckpt.pt")).result().extra.get("writer")
    g0 = dist.new_group([0])
    if rank == 0:
        sub = fp_core.AsyncCheckpointer(writer="process", group=g0, timeout_s=60)
        t0 = time.monotonic()
        stats = sub.save(state(4), os.path.join(d, "sub.pt")).result()
        out["sub"] = {"seconds": time.monotonic() - t0, "writer": stats.extra.get("writer", "thread")}
        sub.close()
    dist.barrier()
    out["close"] = error_of(ck.close)
    return out


def submesh(ck, rank: int, world: int, d: str, out: dict) -> dict:
    """DTensors on a part of a named 2-D mesh (HSDP's and FSDP + TP's ``mesh["dp"]``) saved
    as DCP directories, several times: the writers make the root mesh once, and its groups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    fds = []
    for gen in range(1, 5):
        full = state(gen)
        st = {"w": distribute_tensor(full["w"].reshape(-1, 3), mesh["dp"], [Shard(0)]), "gen": gen}
        stats = ck.save(st, os.path.join(d, "dcp-dir")).result()
        out.setdefault("writers", []).append(stats.extra.get("writer"))
        fds.append(len(os.listdir(f"/proc/{ck._writer_proc.pid}/fd")))
    out["fds"] = fds
    dist.barrier()
    if rank == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(os.path.join(d, "dcp-dir"), os.path.join(d, "dcp.pt"))
        got = torch.load(os.path.join(d, "dcp.pt"), weights_only=True)
        out["equal"] = got["gen"] == 4 and torch.equal(got["w"], state(4)["w"].reshape(-1, 3))
    out["close"] = error_of(ck.close)
    return out


if __name__ == "__main__":
    rank, world, port, d, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = main(rank, world, port, d, scenario)
    except BaseException:  # noqa: BLE001 - reported to the test
        result = {"rank": rank, "crash": traceback.format_exc()}
    with open(os.path.join(d, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    if rank == 0:
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump(result, f)
    os._exit(0)  # a peer may be gone: no teardown collective
