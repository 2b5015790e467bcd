"""Fabric(strategy=STRATEGY, devices=2, plugins=[FastPersistIO()]) saving every step, then
ending as Fabric's fork launcher ends its workers (multiprocessing: finalizers, then
os._exit). For tests/integrations/test_lightning.py.

Usage: python fabric_fork.py DIR STEPS [STRATEGY]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def train(fabric, d: str, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.Adam(model.parameters())
    model, opt = fabric.setup(model, opt)
    for step in range(1, steps + 1):
        loss = model(torch.randn(8, 512)).sum()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        state = {"model": model, "optimizer": opt, "step": step}
        fabric.save(os.path.join(d, f"step-{step}.ckpt"), state)
        fabric.save(os.path.join(d, "last.ckpt"), state)


def main() -> None:
    from lightning.fabric import Fabric

    from fp_integrations.lightning import FastPersistIO

    d, steps = sys.argv[1], int(sys.argv[2])
    strategy = sys.argv[3] if len(sys.argv) > 3 else "ddp_fork"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[FastPersistIO()])
    fabric.launch(train, d, steps)


if __name__ == "__main__":
    main()
