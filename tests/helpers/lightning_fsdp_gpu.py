"""Lightning's FSDPStrategy on one GPU with FastPersist: fit 4 steps with ModelCheckpoint
(every 2 steps, save_last), then a Trainer with max_steps=4 restores "last" and stops.

Usage: python lightning_fsdp_gpu.py DIR [SCENARIO]   (writes DIR/result.json). SCENARIO:

* ``callback`` (default): ``state_dict_type="sharded"`` (FSDP1: ShardedTensor state, saved
  by DCP with FastPersistWriter), FastPersistIO with FastPersistCallback;
* ``alone-sharded``: the same with FastPersistIO alone (no callback): the plugin routes it;
* ``alone-full``: ``state_dict_type="full"`` with FastPersistIO alone: one .ckpt file, written
  from the FSDP1 flat-param shards on the GPU (FlatShards, no gather).
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

sys.path.insert(0, os.path.dirname(__file__))
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


def trainer(d: str, steps: int, scenario: str) -> tuple[Trainer, FastPersistIO]:
    plugin = FastPersistIO()
    mc = ModelCheckpoint(dirpath=os.path.join(d, "ckpts"), every_n_train_steps=2, save_top_k=-1, save_last=True)
    kind = "full" if scenario == "alone-full" else "sharded"
    t = Trainer(accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                strategy=FSDPStrategy(state_dict_type=kind, auto_wrap_policy={torch.nn.Linear}),
                plugins=[plugin], callbacks=[*([FastPersistCallback()] if scenario == "callback" else []), mc],
                enable_model_summary=False)
    return t, plugin


def weights(m: Net) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in m.state_dict().items()}


def main() -> None:
    d = sys.argv[1]
    scenario = sys.argv[2] if len(sys.argv) > 2 else "callback"
    t1, plugin = trainer(d, 4, scenario)
    m1 = Net()
    t1.fit(m1)
    saved = weights(m1)
    t2, _ = trainer(d, 4, scenario)
    m2 = Net()
    t2.fit(m2, ckpt_path="last")
    ckpts = os.path.join(d, "ckpts")
    last = os.path.join(ckpts, "last.ckpt")
    full = torch.load(last, weights_only=True) if os.path.isfile(last) else None
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump({"listing": sorted(os.listdir(ckpts)),
                   "files": sorted(os.listdir(last)) if full is None else [],
                   "routed": getattr(t1.strategy, "_fastpersist_sharded", None) is plugin,
                   # full: why the flat-shard route does not apply (None: every save took it)
                   "why": t1.strategy.__dict__.get("_fastpersist_fsdp1_why", "unset"),
                   "devices": sorted({str(v.device) for v in full["state_dict"].values()}) if full else None,
                   # a full checkpoint: stock's keys, loadable by plain torch.load
                   "full_keys": sorted(full) if full is not None else None,
                   "full_equal": None if full is None else all(
                       k in full["state_dict"] and torch.equal(full["state_dict"][k].float().cpu(), v) for k, v in saved.items()),
                   # a directory: the files checked; a file: 1
                   "verified": {n: fp_core.verify(os.path.join(ckpts, n)).get("files", 1)
                                for n in sorted(os.listdir(ckpts))},
                   "stats": len(plugin.stats),
                   "restored_equal": all(torch.equal(saved[k], v) for k, v in weights(m2).items())}, f)


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()  # see rank_exit: torch's teardown of FSDP2 ranks aborts now and then
