"""What collective, per-rank and sharded (DCP) saves do at a target path: one gloo rank in
its own process, for tests/core/test_user_files.py. Prints one JSON line of outcomes.

Usage: python user_files_dist.py DIR
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fp_core  # noqa: E402


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"


def main() -> None:
    d = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    world = dist.group.WORLD
    out: dict = {}
    sd = {"w": torch.arange(4096.0)}

    # a symlink is written through: the file it names is replaced, the link stays
    os.makedirs(os.path.join(d, "runs"))
    for name, kw in (("collective", {"group": world}), ("sharded", {"sharded": True, "group": world})):
        target = os.path.join(d, "runs", f"{name}.pt")
        fp_core.save({"w": torch.zeros(3)}, target)
        os.chmod(target, 0o600)
        link = os.path.join(d, f"{name}-last.pt")
        os.symlink(os.path.join("runs", f"{name}.pt"), link)
        out[f"{name}_link"] = outcome(lambda kw=kw, link=link: fp_core.save(sd, link, **kw))
        out[f"{name}_is_link"] = os.path.islink(link)
        out[f"{name}_target_equal"] = torch.equal(torch.load(target)["w"], sd["w"])
        out[f"{name}_mode"] = oct(stat.S_IMODE(os.stat(target).st_mode))

    # the async collective path
    ckpt = fp_core.AsyncCheckpointer(group=world)
    target = os.path.join(d, "runs", "async.pt")
    link = os.path.join(d, "async-last.pt")
    os.symlink(target, link)  # absolute, dangling: the target is created
    out["async_link"] = outcome(lambda: ckpt.save(sd, link).result())
    ckpt.close()
    out["async_is_link"] = os.path.islink(link)
    out["async_target_equal"] = os.path.isfile(target) and torch.equal(torch.load(target)["w"], sd["w"])

    # never renamed over a device or a FIFO
    fifo = os.path.join(d, "fifo")
    os.mkfifo(fifo)
    out["collective_fifo"] = outcome(lambda: fp_core.save(sd, fifo, group=world))
    out["fifo_kept"] = stat.S_ISFIFO(os.lstat(fifo).st_mode)
    out["sharded_fifo"] = outcome(lambda: fp_core.save(sd, fifo, sharded=True, group=world))
    out["fifo_kept_sharded"] = stat.S_ISFIFO(os.lstat(fifo).st_mode)

    # a sharded (DTensor) checkpoint directory named through a symlink
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    dt = {"w": distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0)])}
    real = os.path.join(d, "runs", "dcp-step-3")
    fp_core.save(dt, real)
    dlink = os.path.join(d, "dcp-last")
    os.symlink(os.path.join("runs", "dcp-step-3"), dlink)
    dt2 = {"w": distribute_tensor(torch.arange(64.0).reshape(8, 8) + 1, mesh, [Shard(0)])}
    out["dcp_link"] = outcome(lambda: fp_core.save(dt2, dlink))
    out["dcp_is_link"] = os.path.islink(dlink)
    out["dcp_verified"] = outcome(lambda: fp_core.verify(real))
    import torch.distributed.checkpoint as dcp

    back = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)])}
    dcp.load(back, checkpoint_id=real)
    out["dcp_target_equal"] = torch.equal(back["w"].full_tensor(), dt2["w"].full_tensor())
    # a file where a checkpoint directory goes is never renamed aside
    afile = os.path.join(d, "not-a-dir")
    with open(afile, "w") as f:
        f.write("user data")
    out["dcp_over_file"] = outcome(lambda: fp_core.save(dt2, afile))
    out["file_kept"] = open(afile).read() == "user data"
    out["dcp_over_fifo"] = outcome(lambda: fp_core.save(dt2, fifo))
    out["fifo_kept_dcp"] = stat.S_ISFIFO(os.lstat(fifo).st_mode)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
