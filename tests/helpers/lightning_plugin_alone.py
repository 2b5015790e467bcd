"""Lightning's ModelParallelStrategy (FSDP2 on CPU processes over gloo) with ``FastPersistIO``
alone (no FastPersistCallback), or stock, one phase per run.

Run under torchrun: ``python -m torch.distributed.run --nproc-per-node N THIS DIR MODE LAYOUT PHASE``.
MODE: ``fastpersist`` (the plugin alone), ``callback`` (the plugin with FastPersistCallback)
or ``stock``; LAYOUT: ``file``
(``save_distributed_checkpoint=False``: one .ckpt) or ``sharded`` (a DCP directory). PHASE:

* ``fit``: fit 4 steps from scratch, a checkpoint every epoch of 2 steps (top 2, and last);
  records this rank's weights and Adam state (full tensors) at step 4.
* ``resume``: a Trainer with max_steps=4 restores ``last`` and stops (its full weights and
  Adam state are recorded), then fit to 6 steps from ``last``; records the weights at 6.
* ``fail``: fit 2 more steps from ``last`` with a checkpoint at step 6 whose write fails on
  rank 1 (an injected EIO); records the error each rank saw.

Each rank writes DIR/<MODE>-<LAYOUT>-<PHASE>-<RANK>.pt (torch.save of its records) and
rank 0 DIR/<MODE>-<LAYOUT>-<PHASE>.json (the checkpoints, the plugin's saves).

Several runs can share one launch (``THIS DIR MODE LAYOUT PHASE DIR2 MODE2 ...``, one after
the other in the same process group; each its own Trainer, plugin and directory; ``fail``
only last): each launch imports torch and Lightning again, which is most of a run's time.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fp_integrations.lightning import FastPersistCallback, FastPersistIO  # noqa: E402


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # 37 and 5 rows: divided by neither 2 nor 4, so shards are uneven; the 4 MiB weight:
        # each rank's rows are long enough to be written O_DIRECT, where "fail" injects its EIO
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.ReLU(), torch.nn.Linear(37, 512),
                                       torch.nn.ReLU(), torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                       torch.nn.Linear(2048, 5))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("step_metric", float(self.global_step))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        # the same global batches on any number of ranks: each rank takes every world-th sample
        ds = TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 5, generator=g))
        return DataLoader(ds, batch_size=16 // self.trainer.world_size, shuffle=False)


class FailOnRank1(Callback):
    """Rank 1's next file write fails (EIO) from the first checkpoint of this fit on."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank == 1:
            from fp_core import _native

            _native.inject_fault("write", errno=5)


def make_trainer(d: str, mode: str, layout: str, steps: int, fail: bool = False) -> tuple[Trainer, FastPersistIO | None]:
    plugin = FastPersistIO() if mode != "stock" else None
    mc = ModelCheckpoint(dirpath=os.path.join(d, f"ckpts-{mode}-{layout}"), every_n_epochs=1, save_top_k=2,
                         monitor="step_metric", mode="max", save_last=True, filename="s{step}")
    world = int(os.environ["WORLD_SIZE"])
    t = Trainer(accelerator="cpu", devices=world,
                strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                               save_distributed_checkpoint=layout == "sharded"),
                plugins=[plugin] if plugin else None, callbacks=[mc, *([FailOnRank1()] if fail else []), *([FastPersistCallback()] if mode == "callback" else [])],
                max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=d)
    return t, plugin


def full_state(model: Net, trainer: Trainer) -> dict[str, torch.Tensor]:
    """The full weights and Adam state (gathered: every rank calls this)."""
    out = {f"w.{k}": v.full_tensor().clone() for k, v in model.net.state_dict().items()}
    opt = trainer.optimizers[0]
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for name, v in opt.state.get(p, {}).items():
            out[f"adam.{i}.{name}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    out["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    return out


def main() -> None:
    args = sys.argv[1:]
    assert args and len(args) % 4 == 0, args
    jobs = [args[i:i + 4] for i in range(0, len(args), 4)]
    assert all(job[3] != "fail" for job in jobs[:-1]), jobs  # a failed fit leaves its group unusable
    for i, (d, mode, layout, phase) in enumerate(jobs):
        t = run(d, mode, layout, phase)
        if i < len(jobs) - 1:
            t.strategy.barrier()  # every rank has written this run's results before the next starts
    if phase != "fail":
        t.strategy.barrier()
        torch.distributed.destroy_process_group()


def run(d: str, mode: str, layout: str, phase: str) -> Trainer:
    rank = int(os.environ["RANK"])
    rec: dict = {}
    info: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if phase == "fit":
            t, plugin = make_trainer(d, mode, layout, 4)
            m = Net()
            t.fit(m)
            rec["at_4"] = full_state(m, t)
        elif phase == "resume":
            t, plugin = make_trainer(d, mode, layout, 4)
            m = Net()
            t.fit(m, ckpt_path="last")
            rec["restored"] = full_state(m, t)
            if plugin is not None and plugin.load_stats is not None:
                st = plugin.load_stats
                info["load"] = {"tensor_bytes": st.tensor_bytes, "check_bytes": st.check_bytes,
                                "whole_file": st.whole_file}
            t, plugin = make_trainer(d, mode, layout, 6)
            m = Net()
            t.fit(m, ckpt_path="last")
            rec["at_6"] = full_state(m, t)
        elif phase == "fail":
            t, plugin = make_trainer(d, mode, layout, 6, fail=True)
            m = Net()
            try:
                t.fit(m, ckpt_path="last")
                info["error"] = None
            except Exception as e:  # noqa: BLE001 - reported to the test
                info["error"] = f"{type(e).__name__}: {e}"[:500]
        else:
            raise ValueError(phase)
    info["warnings"] = [str(w.message)[:300] for w in caught if "FastPersist" in type(w.message).__name__]
    info["stats"] = [os.path.basename(s.path) for s in (plugin.stats if plugin else [])]
    info["policies"] = [s.policy for s in (plugin.stats if plugin else [])]
    info["routed"] = getattr(t.strategy, "_fastpersist_sharded", None) is plugin if plugin else False
    info["global_step"] = t.global_step
    info["world"] = t.world_size
    torch.save(rec, os.path.join(d, f"{mode}-{layout}-{phase}-{rank}.pt"))
    with open(os.path.join(d, f"{mode}-{layout}-{phase}-{rank}.json"), "w") as f:
        json.dump(info, f)
    return t


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
