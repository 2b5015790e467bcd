"""Lightning's FSDPStrategy(state_dict_type="sharded") on one GPU with FastPersist (FSDP1:
ShardedTensor state, saved by DCP with FastPersistWriter): fit 4 steps with ModelCheckpoint
(every 2 steps, save_last), then a Trainer with max_steps=4 restores "last" and stops.

Usage: python lightning_fsdp_gpu.py DIR   (writes DIR/result.json)
"""

from __future__ import annotations

import json
import os
import sys

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fp_core  # noqa: E402
from fp_integrations.lightning import FastPersistCallback, FastPersistIO  # noqa: E402


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(64, 64, generator=g), torch.randn(64, 8, generator=g)), batch_size=8)


def trainer(d: str, steps: int) -> tuple[Trainer, FastPersistIO]:
    plugin = FastPersistIO()
    mc = ModelCheckpoint(dirpath=os.path.join(d, "ckpts"), every_n_train_steps=2, save_top_k=-1, save_last=True)
    t = Trainer(accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                strategy=FSDPStrategy(state_dict_type="sharded", auto_wrap_policy={torch.nn.Linear}),
                plugins=[plugin], callbacks=[FastPersistCallback(), mc], enable_model_summary=False)
    return t, plugin


def weights(m: Net) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in m.state_dict().items()}


def main() -> None:
    d = sys.argv[1]
    t1, plugin = trainer(d, 4)
    m1 = Net()
    t1.fit(m1)
    saved = weights(m1)
    t2, _ = trainer(d, 4)
    m2 = Net()
    t2.fit(m2, ckpt_path="last")
    ckpts = os.path.join(d, "ckpts")
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump({"listing": sorted(os.listdir(ckpts)),
                   "files": sorted(os.listdir(os.path.join(ckpts, "last.ckpt"))),
                   "verified": {n: fp_core.verify(os.path.join(ckpts, n))["files"] for n in sorted(os.listdir(ckpts))},
                   "stats": len(plugin.stats),
                   "restored_equal": all(torch.equal(saved[k], v) for k, v in weights(m2).items())}, f)


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
