"""Under torchrun (2 ranks, --max-restarts 1): a rank is killed after a checkpoint's fence,
torchrun restarts both, and each rank resumes from its writer process's committed file,
read from the shared-memory image (tests/core/test_process_writer.py).

``torchrun --nproc-per-node 2 --max-restarts 1 torchrun_process_writer.py DIR``

Attempt 0: each rank trains a small model (gradients all-reduced over gloo, as DDP does),
saving ``DIR/rank{r}.pt`` every step with ``AsyncCheckpointer(writer="process",
resume_from_memory=True)``. After step 3's save and fence, rank 1 SIGKILLs itself; rank 0
blocks in the next all-reduce until torchrun stops it. Attempt 1: each rank loads its file
with ``fp_core.load``, checks it holds step 3 exactly as a replay computes it, notes
whether it came from memory, saves once more and writes ``DIR/result{r}.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fp_core  # noqa: E402
from fp_core.io import memory_image  # noqa: E402

KILL_AFTER = 3


def train(steps: int, rank: int, model=None, opt=None, start: int = 0, on_step=None):
    if model is None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = model(torch.randn(16, 256, generator=g)).square().mean()
        loss.backward()
        for p in model.parameters():
            if dist.is_initialized():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(step, model, opt)
    return model, opt


def main(directory: str) -> None:
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        dist.init_process_group("gloo")
    else:
        # torchrun's store outlives the attempt and keeps attempt 0's gloo addresses under the
        # same keys: a restart that races them connects to a dead peer. A prefix per attempt.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                                rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    path = os.path.join(directory, f"rank{rank}.pt")
    w = os.environ.get("FP_WRITER", "process")
    ck = fp_core.AsyncCheckpointer(writer=w, resume_from_memory=w == "process")
    if attempt == 0:
        def on_step(step, model, opt):
            ck.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, path)
            if step == KILL_AFTER:
                ck.fence()
                with open(os.path.join(directory, f"writer{rank}.pid"), "w") as f:
                    f.write(str(ck._writer_proc.pid if ck._writer_proc else 0))
                # both ranks past step 3's fence before rank 1 dies: torchrun stops rank 0 the
                # moment rank 1 is gone, and a rank 0 still saving step 3 would resume from 2
                dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)

        train(10, rank, on_step=on_step)
        time.sleep(120)  # not reached: rank 0 blocks in the all-reduce of step 4 until stopped
        return
    hits = memory_image.hits
    t0 = time.perf_counter()
    got = fp_core.load(path, weights_only=True)
    load_s = time.perf_counter() - t0
    from_memory = memory_image.hits == hits + 1
    # the replay, without the process group: each rank's own gradients differ, so replay both
    # ranks' all-reduced steps by hand
    dist.barrier()
    models = [train(0, r)[0] for r in range(2)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    for step in range(1, KILL_AFTER + 1):
        grads = []
        for r, m in enumerate(models):
            g = torch.Generator().manual_seed(step * 10 + r)
            m(torch.randn(16, 256, generator=g)).square().mean().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        mean = [(a + b) / 2 for a, b in zip(*grads)]
        for m, o in zip(models, opts):
            for p, g in zip(m.parameters(), mean):
                p.grad = g.clone()
            o.step()
            o.zero_grad()
    want = models[rank].state_dict()
    same = got["step"] == KILL_AFTER and all(torch.equal(got["model"][k], want[k]) for k in want)
    ck.save({"model": got["model"], "step": got["step"] + 1}, path)
    ck.close()
    with open(os.path.join(directory, f"result{rank}.json"), "w") as f:
        json.dump({"attempt": attempt, "from_memory": from_memory, "same": same, "step": got["step"],
                   "load_s": load_s}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
