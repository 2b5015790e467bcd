"""Lightning's ModelParallelStrategy (FSDP2 on 2 CPU processes over gloo) with FastPersist:
sharded checkpoints with ModelCheckpoint top-k and save_last, then ``ckpt_path="last"``.

Run under torchrun: ``python -m torch.distributed.run --nproc-per-node 2 THIS DIR MODE``.
MODE: ``fastpersist`` (plugin + callback) or ``stock``. Phases, each a fresh Trainer:
1. fit 6 steps, a checkpoint every epoch of 2 steps (top 2 by step, and last);
2. fit to 10 steps from ``ckpt_path="last"``;
3. (reference) fit 10 steps without interruption;
4. (fastpersist) stock Lightning resumes from a copy of phase 1's last checkpoint, and must
   end where phase 2 ended.
Before phase 2, a Trainer with ``max_steps=6`` restores ``last`` and stops: this rank's
weights and Adam state must equal phase 1's final ones, bit for bit.
Rank 0 writes DIR/result-MODE.json: the checkpoint directories, the plugin's save stats and
whether the resumed run ends with the same weights as the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fp_integrations.lightning import FastPersistCallback, FastPersistIO  # noqa: E402


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                       torch.nn.ReLU(), torch.nn.Linear(256, 4))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("step_metric", float(self.global_step))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        ds = TensorDataset(torch.randn(32, 32, generator=g), torch.randn(32, 4, generator=g))  # 2 steps an epoch
        return DataLoader(ds, batch_size=8, shuffle=False)


def trainer(d: str, mode: str, steps: int, ckpt_dir: str | None) -> tuple[Trainer, FastPersistIO | None]:
    plugin = FastPersistIO() if mode == "fastpersist" else None
    callbacks: list = [FastPersistCallback()] if plugin else []
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=2,
                                         monitor="step_metric", mode="max", save_last=True,
                                         filename="s{step}"))
    t = Trainer(accelerator="cpu", devices=2,
                strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                plugins=[plugin] if plugin else None, callbacks=callbacks, max_steps=steps, logger=False,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(ckpt_dir),
                default_root_dir=d)
    return t, plugin


def full_weights(model: Net) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.net.state_dict().items()}


def local_state(model: Net, trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and of Adam's state."""
    out = {f"w.{k}": v.to_local().clone() for k, v in model.net.state_dict().items()}
    for i, st in enumerate(trainer.optimizers[0].state.values()):
        for name, v in st.items():
            out[f"adam.{i}.{name}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _verify(path: str) -> str:
    import fp_core

    try:
        return f"{fp_core.verify(path)['files']} files"
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"[:200]


def main() -> None:
    d, mode = sys.argv[1], sys.argv[2]
    ckpts = os.path.join(d, f"ckpts-{mode}")
    t1, plugin = trainer(d, mode, 6, ckpts)
    m1 = Net()
    t1.fit(m1)
    at_six = local_state(m1, t1)
    first = sorted(os.listdir(ckpts)) if t1.is_global_zero else []
    cross = os.path.join(d, "cross.ckpt")
    if t1.is_global_zero and mode == "fastpersist":
        shutil.copytree(os.path.join(ckpts, "last.ckpt"), cross)
    t1.strategy.barrier()
    stats = [{"policy": s.policy, "bytes": s.bytes, "path": os.path.basename(s.path)} for s in (plugin.stats if plugin else [])]
    t0, _ = trainer(d, mode, 6, ckpts)  # restores step 6 and stops there
    m0 = Net()
    t0.fit(m0, ckpt_path="last")
    restored = t0.strategy.reduce_boolean_decision(same(local_state(m0, t0), at_six), all=True)
    t2, _ = trainer(d, mode, 10, ckpts)
    m2 = Net()
    t2.fit(m2, ckpt_path="last")
    resumed = full_weights(m2)
    t3, _ = trainer(d, mode, 10, None)
    m3 = Net()
    t3.fit(m3)
    straight = full_weights(m3)
    cross_exact = None
    if mode == "fastpersist":
        t4, _ = trainer(d, "stock", 10, None)
        m4 = Net()
        t4.fit(m4, ckpt_path=cross)
        cross_exact = all(torch.equal(v, resumed[k]) for k, v in full_weights(m4).items())
    if t3.is_global_zero:
        with open(os.path.join(d, f"result-{mode}.json"), "w") as f:
            json.dump({"after_first": first, "after_resume": sorted(os.listdir(ckpts)), "stats": stats,
                       "resumed_step": t2.global_step,
                       "restored_exact": restored,
                       "resume_same_as_straight": all(torch.equal(resumed[k], straight[k]) for k in straight),
                       "stock_resume_same": cross_exact,
                       "verified": {n: _verify(os.path.join(ckpts, n)) for n in sorted(os.listdir(ckpts))}}, f)
    # process groups torn down before exit (gloo's destructors at exit can race the other rank's)
    t3.strategy.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
