"""Victim processes for the crash harness (benchmarks/crash_harness.py, tests/test_reliability.py).

Each mode saves forever and reports progress; the harness SIGKILLs it at a random instant.
Progress is reported as small messages: ``("S", gen, t)`` just before a save of generation
``gen`` starts, ``("D", gen, t)`` once it is durable under its final name, ``("E", text)``
when a save raised (then the process exits 3). ``t`` is ``time.monotonic()`` (one clock
for every process on the host).

Generation ``g`` is a state in which every tensor encodes ``g`` (see :func:`state` and
:func:`check_state`), so a reader can tell a whole generation from a torn one.

Modes (``run(mode, directory, conn, **kw)`` in a forked process, or the CLI below):

* ``sync``       ``fp_core.save(state(g), DIR/ckpt.pt)`` in a loop (one fixed name, overwritten).
* ``async``      ``AsyncCheckpointer(policy)`` saves ``DIR/step-{g}.pt``, the loop mutates the
                 tensors after ``fence()`` (as an optimizer step would) and keeps the last 3
                 via ``ckpt.enqueue(os.unlink, old)``.
* ``dist-sync``  2 ranks over gloo: ``fp_core.save(state(g), DIR/ckpt.pt, group=WORLD)``.
* ``async-process`` as ``async``, with ``writer="process"``: the writer outlives the kill and
                 commits what was handed to it (the harness waits for it before checking).
* ``dist-async`` 2 ranks: ``AsyncCheckpointer(group=WORLD)`` saving ``DIR/ckpt.pt``.
* ``dist-dcp``   2 ranks: the same state as DTensors sharded over both ranks (``w``, ``m``
                 split in two, the rest replicated), saved by ``AsyncCheckpointer`` into the
                 sharded checkpoint directory ``DIR/ckpt`` (DCP with FastPersistWriter).
* ``dist-file``  2 ranks: the same DTensor state saved with ``fp_core.save(..., layout="file")``
                 into the one file ``DIR/ckpt.pt`` of the full state (each rank its rows).

CLI (heavier integrations, run as plain subprocesses; progress lines on stdout)::

    python crash_child.py lightning DIR     # Lightning fit, ModelCheckpoint(save_last, every step)
    python crash_child.py hf DIR            # HF Trainer, save_steps=1, FastPersistCallback
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import fp_core  # noqa: E402

KEEP = 3


def state(gen: int, mib: int, buf: dict | None = None) -> dict:
    """The checkpoint of generation ``gen``: ~``mib`` MiB, every tensor a function of gen."""
    n = mib * (1 << 20) // 4 // 2
    if buf is None:
        buf = {"w": torch.empty(n), "m": torch.empty(n), "b": torch.empty(1000, dtype=torch.float64),
               "i": torch.empty(17, dtype=torch.int64)}
    buf["w"].fill_(float(gen))
    buf["m"].fill_(-float(gen))
    buf["b"].fill_(gen + 0.5)
    buf["i"].fill_(gen)
    return {"gen": gen, "model": {"w": buf["w"], "b": buf["b"]}, "optim": {"exp_avg": buf["m"], "step": buf["i"]},
            "tail": [gen] * 3}


def check_state(obj: dict) -> int:
    """Raise AssertionError unless ``obj`` is one whole generation; return it."""
    g = obj["gen"]
    assert obj["tail"] == [g] * 3, f"tail {obj['tail']} != gen {g}"
    w, b = obj["model"]["w"], obj["model"]["b"]
    m, i = obj["optim"]["exp_avg"], obj["optim"]["step"]
    assert bool((w == float(g)).all()), f"model.w is not all {g}"
    assert bool((m == -float(g)).all()), f"optim.exp_avg is not all {-g}"
    assert bool((b == g + 0.5).all()), f"model.b is not all {g + 0.5}"
    assert bool((i == g).all()), f"optim.step is not all {g}"
    return g


def dtensor_state(gen: int, mib: int, buf: dict | None, mesh) -> tuple[dict, dict]:
    """:func:`state` with its tensors as DTensors over ``mesh`` (``w``, ``m`` sharded on dim
    0, ``b``, ``i`` replicated); ``buf`` holds the DTensors, refilled in place."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if buf is None:
        plain = state(gen, mib)
        buf = {"w": distribute_tensor(plain["model"]["w"], mesh, [Shard(0)]),
               "m": distribute_tensor(plain["optim"]["exp_avg"], mesh, [Shard(0)]),
               "b": distribute_tensor(plain["model"]["b"], mesh, [Replicate()]),
               "i": distribute_tensor(plain["optim"]["step"], mesh, [Replicate()])}
    buf["w"].to_local().fill_(float(gen))
    buf["m"].to_local().fill_(-float(gen))
    buf["b"].to_local().fill_(gen + 0.5)
    buf["i"].to_local().fill_(gen)
    return {"gen": gen, "model": {"w": buf["w"], "b": buf["b"]}, "optim": {"exp_avg": buf["m"], "step": buf["i"]},
            "tail": [gen] * 3}, buf


def load_dcp_dir(path: str, mib: int) -> dict:
    """A sharded crash checkpoint directory loaded whole into one process, by FastPersist's
    reader (verifying every item) and by stock DCP's; raises unless both read the same."""
    import torch.distributed.checkpoint as dcp

    from fp_core.parallel.dcp import FastPersistReader

    got = []
    for reader in (FastPersistReader(path, verify=True), dcp.FileSystemReader(path)):
        out = state(-1, mib)
        out["gen"], out["tail"] = None, None
        dcp.load(out, storage_reader=reader, no_dist=True)
        got.append(out)
    ours, stock = got
    assert ours["gen"] == stock["gen"] and ours["tail"] == stock["tail"], "stock DCP reads another generation"
    for part in ("model", "optim"):
        for k, v in ours[part].items():
            assert torch.equal(v, stock[part][k]), f"stock DCP reads other bytes for {part}.{k}"
    return ours


def _send(conn, *msg) -> None:
    if conn is None:
        sys.stdout.write(" ".join(str(x) for x in msg) + "\n")
        sys.stdout.flush()
    else:
        conn.send(msg)


def _durable(conn, gen: int) -> None:
    fp_core.saving.commit.wait_for_clean()  # leftovers of a killed run are gone by the first "D"
    _send(conn, "D", gen, time.monotonic())


def run(mode: str, directory: str, conn=None, mib: int = 16, policy: str = "overlap",
        rank: int = 0, world: int = 1, port: int = 0, gen0: int = 0) -> None:
    """Save generations gen0+1, gen0+2, ... forever (until killed)."""
    try:
        if mode.startswith("dist"):
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
            group = dist.group.WORLD
        else:
            group = None
        buf = None
        path = os.path.join(directory, "ckpt.pt")
        if mode in ("sync", "dist-sync"):
            gen = gen0
            while True:
                gen += 1
                obj = state(gen, mib, buf)
                buf = {"w": obj["model"]["w"], "m": obj["optim"]["exp_avg"], "b": obj["model"]["b"],
                       "i": obj["optim"]["step"]}
                _send(conn, "S", gen, time.monotonic())
                if group is None:
                    fp_core.save(obj, path)
                else:
                    fp_core.save(obj, path, group=group)
                fp_core.saving.commit.wait_for_clean()  # leftovers of a killed run are gone by the first "D"
                _send(conn, "D", gen, time.monotonic())
        elif mode == "dist-dcp":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
            ckpt = fp_core.AsyncCheckpointer(policy=policy)
            path = os.path.join(directory, "ckpt")
            gen = gen0
            while True:
                gen += 1
                ckpt.fence()
                obj, buf = dtensor_state(gen, mib, buf, mesh)
                _send(conn, "S", gen, time.monotonic())
                ckpt.save(obj, path, on_commit=lambda _p, _st, g=gen: _durable(conn, g))
        elif mode == "dist-file":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
            gen = gen0
            while True:
                gen += 1
                obj, buf = dtensor_state(gen, mib, buf, mesh)
                _send(conn, "S", gen, time.monotonic())
                fp_core.save(obj, path, layout="file")
                _durable(conn, gen)
        elif mode in ("async", "dist-async", "async-process"):
            ckpt = fp_core.AsyncCheckpointer(policy=policy, group=group,
                                             writer="process" if mode == "async-process" else "thread")
            gen = gen0
            while True:
                gen += 1
                ckpt.fence()  # the "optimizer step": no save reads live memory any more
                obj = state(gen, mib, buf)
                buf = {"w": obj["model"]["w"], "m": obj["optim"]["exp_avg"], "b": obj["model"]["b"],
                       "i": obj["optim"]["step"]}
                p = path if group is not None else os.path.join(directory, f"step-{gen}.pt")
                _send(conn, "S", gen, time.monotonic())
                ckpt.save(obj, p, on_commit=lambda _p, _st, g=gen: _durable(conn, g))
                if gen == gen0 + 1 and ckpt._writer_proc is not None:
                    _send(conn, "W", ckpt._writer_proc.pid)  # outlives this process: the harness waits for it
                if group is None and gen - gen0 > KEEP:
                    ckpt.enqueue(os.unlink, os.path.join(directory, f"step-{gen - KEEP}.pt"))
        else:
            raise ValueError(mode)
    except BaseException as e:  # noqa: BLE001 - reported to the harness, then exit
        _send(conn, "E", f"{type(e).__name__}: {e}".replace("\n", " ")[:2000])
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)


# ---------------------------------------------------------------- Lightning / HF (CLI)


def run_lightning(directory: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from fp_integrations.lightning import FastPersistIO

    class Tagged(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(1024, 2048)  # ~8 MiB of weights, ~24 MiB with Adam
            self.register_buffer("step_tag", torch.zeros((), dtype=torch.int64))

        def training_step(self, batch, _i):
            self.step_tag.fill_(self.global_step + 1)  # the global_step this batch's checkpoint carries
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Report(L.Callback):
        def on_train_batch_start(self, trainer, *_a):
            _send(None, "S", trainer.global_step + 1, time.monotonic())

        def on_train_batch_end(self, trainer, *_a):
            _send(None, "D", trainer.global_step, time.monotonic())  # save *started* (async)

    ds = TensorDataset(torch.randn(64, 1024))
    mc = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1, save_top_k=1)
    trainer = L.Trainer(max_steps=10**6, callbacks=[mc, Report()], plugins=[FastPersistIO()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Tagged(), DataLoader(ds, batch_size=8))


def run_hf(directory: str) -> None:
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from fp_integrations.hf import FastPersistCallback

    class DS(Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            ids = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Report(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            _send(None, "D", state.global_step, time.monotonic())

    cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=256, n_layer=4, n_head=4)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(output_dir=directory, save_steps=1, save_strategy="steps", max_steps=10**6, save_total_limit=3,
                             per_device_train_batch_size=2, logging_steps=10**6, report_to=[],
                             disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
    cb = FastPersistCallback()
    trainer = Trainer(model=model, args=args, train_dataset=DS(), callbacks=[cb, Report()])
    cb.attach(trainer)
    trainer.train(resume_from_checkpoint=any(n.startswith("checkpoint-") for n in os.listdir(directory)))


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    try:
        if mode == "lightning":
            run_lightning(directory)
        elif mode == "hf":
            run_hf(directory)
        else:
            run(mode, directory, None, mib=int(sys.argv[3]) if len(sys.argv) > 3 else 16)
    except BaseException as e:  # noqa: BLE001
        _send(None, "E", f"{type(e).__name__}: {e}".replace("\n", " ")[:2000])
        traceback.print_exc()
        sys.exit(3)


if __name__ == "__main__":
    main()
