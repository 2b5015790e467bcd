"""A rank of a collective-save test: run as a real process, report through a JSON file.

Usage: python dist_worker.py SCENARIO RANK WORLD PORT DIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fp_core  # noqa: E402
import fp_core.parallel.distributed  # noqa: E402
from fp_core import _native  # noqa: E402


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(1_500_000, generator=g), "b": torch.randn(4097, generator=g),
                  "emb": torch.randn(300, 77, generator=g).to(torch.bfloat16)},
        "optim": {"step": 7, "exp_avg": torch.randn(1_500_000, generator=g)},
        "meta": {"epoch": 3, "name": "run"},
    }


def main() -> None:
    scenario, rank, world, port, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict = {"rank": rank}
    try:
        path = os.path.join(d, "ckpt.pt")
        if scenario == "replica":
            depths = [fp_core.save(state(), path, group=dist.group.WORLD).extra["queue_depth"]]
            st = fp_core.save(state(), path, group=dist.group.WORLD)  # the host's ranks known now
            result.update(writers=st.writers, rank_bytes=st.extra["rank_bytes"], ranks=st.extra["writer_ranks"],
                          tail_start=st.extra["tail_start"], depths=depths + [st.extra["queue_depth"]])
        elif scenario.startswith("topology:"):
            topo = json.loads(scenario.split(":", 1)[1])
            st = fp_core.save(state(), path, group=dist.group.WORLD, topology=topo)
            result.update(writers=st.writers, rank_bytes=st.extra["rank_bytes"], ranks=st.extra["writer_ranks"])
        elif scenario == "mismatch":  # same layout, replicas drifted apart
            st = fp_core.save(state(seed=rank), path, group=dist.group.WORLD)
            result.update(writers=st.writers, ranks=st.extra["writer_ranks"])
        elif scenario == "small_differs":  # DDP: BatchNorm statistics and counters differ per rank
            obj = state()
            obj["model"]["bn.running_mean"] = torch.full((64,), float(rank))
            obj["meta"]["loss"] = 0.5 + rank
            st = fp_core.save(obj, path, group=dist.group.WORLD)
            result.update(writers=st.writers, ranks=st.extra["writer_ranks"],
                          differing=st.extra.get("differing_storages"))
        elif scenario == "layout_mismatch":
            obj = state()
            if rank == 1:
                obj["model"]["extra"] = torch.zeros(10)
            st = fp_core.save(obj, path, group=dist.group.WORLD)
            result.update(writers=st.writers, ranks=st.extra["writer_ranks"])
        elif scenario == "sharded":
            st = fp_core.save({"shard": torch.full((1000,), float(rank))}, os.path.join(d, f"shard{rank}.pt"),
                              group=dist.group.WORLD, sharded=True)
            result.update(bytes=st.bytes)
        elif scenario == "sharded_replace":
            # generation 2 over generation 1 (16 MiB shards): the previous shard, kept aside
            # during the publish, is freed by deferred_free's thread, not inline
            from fp_core.io import deferred_free

            shard = os.path.join(d, f"shard{rank}.pt")
            fp_core.save({"shard": torch.full((4 << 20,), 1.0)}, shard, group=dist.group.WORLD, sharded=True)
            with deferred_free.paused():
                fp_core.save({"shard": torch.full((4 << 20,), 2.0)}, shard, group=dist.group.WORLD, sharded=True)
                held = [n for n in os.listdir("/proc/self/fd")
                        if os.path.exists(f"/proc/self/fd/{n}")
                        and os.readlink(f"/proc/self/fd/{n}").endswith(".fptmp (deleted)")]
                result.update(pinned=len(held), pending=deferred_free.pending_bytes())
            deferred_free.wait()
            result.update(pending_after=deferred_free.pending_bytes(), live_after=deferred_free.live_count())
        elif scenario == "sharded_fail":
            if rank == 1:
                _native.inject_fault("write", errno=5)
            fp_core.save({"shard": torch.full((1000,), float(rank))}, os.path.join(d, f"shard{rank}.pt"),
                         group=dist.group.WORLD, sharded=True)
        elif scenario.startswith("sharded_publish_fail:"):
            # generation 1 commits; generation 2 fails on rank 1 at its rename, or after it at
            # the directory fsync: every rank must keep generation 1
            where = scenario.split(":", 1)[1]
            shard = os.path.join(d, f"shard{rank}.pt")
            fp_core.save({"gen": 1, "shard": torch.full((1000,), float(rank))}, shard, group=dist.group.WORLD,
                         sharded=True)
            if rank == 1:
                name = "publish" if where == "rename" else "fsync_dir"
                orig = getattr(fp_core.saving.commit, name)

                def failing(*a, **k):
                    if where == "dirsync":
                        orig(*a, **k) if name == "publish" else None
                    raise OSError(5, f"injected {where} failure", shard)

                setattr(fp_core.saving.commit, name, failing)  # a named temporary file's rename (no O_TMPFILE)
                if where == "rename":  # an unnamed file's link and rename: one native call
                    fp_core._native.inject_fault("rename", errno=5)
            fp_core.save({"gen": 2, "shard": torch.full((1000,), float(rank))}, shard, group=dist.group.WORLD,
                         sharded=True)
        elif scenario == "async":
            # Collective saves through the async pipeline while "training" continues.
            model = torch.nn.Linear(512, 512)
            torch.nn.init.constant_(model.weight, 1.0)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            expected = []
            stats = torch.zeros(16)  # a BatchNorm-like buffer, copied at save time
            with fp_core.AsyncCheckpointer(group=dist.group.WORLD, policy="overlap") as ckpt:
                for step in range(3):
                    expected.append({k: v.clone() for k, v in model.state_dict().items()})
                    expected[-1]["stats"] = stats.clone()
                    ckpt.save({**model.state_dict(), "stats": stats}, os.path.join(d, f"step{step}.pt"))
                    if rank == 0:  # changes right after the save, on one rank only (as in forward)
                        stats.add_(1)
                    model(torch.ones(4, 512)).sum().backward()
                    opt.step()  # the installed pre-hook fences first
                    opt.zero_grad()
            if rank == 0:
                for step, exp in enumerate(expected):
                    got = torch.load(os.path.join(d, f"step{step}.pt"))
                    assert all(torch.equal(got[k], exp[k]) for k in exp), f"step {step} differs"
                    fp_core.verify(os.path.join(d, f"step{step}.pt"))
        elif scenario == "fail":
            if rank == 1:
                _native.inject_fault("write", errno=5)
            fp_core.save(state(), path, group=dist.group.WORLD)
        elif scenario == "kill":
            if rank == 1:
                # die in the middle of the collective save: after planning, before writing
                orig = fp_core.parallel.distributed.write_range

                def dying(*a, **k):
                    os.kill(os.getpid(), signal.SIGKILL)
                    return orig(*a, **k)

                fp_core.parallel.distributed.write_range = dying
            fp_core.save(state(), path, group=dist.group.WORLD, timeout_s=30)
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
    with open(os.path.join(d, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip destroy_process_group: a dead peer would make it hang


if __name__ == "__main__":
    main()
