"""Lightning's ``FSDPStrategy(state_dict_type="full")`` (FSDP1) on CPU processes over gloo,
with ``FastPersistIO`` alone (no FastPersistCallback) or stock, several runs per launch.

Run under torchrun: ``python -m torch.distributed.run --nproc-per-node N THIS DIR MODE PHASE
[DIR MODE PHASE ...]``. MODE: ``fastpersist`` (the plugin alone), ``stock``, or
``fallback`` (the plugin alone with ``sharding_strategy="NO_SHARD"``, where every rank
holds every parameter: the route does not apply, stock's gather writes). PHASE:

* ``fit``: fit 4 steps from scratch, a checkpoint every 2 steps (and last) into
  ``ckpts-<MODE>``; records the full weights and Adam state at step 4;
* ``resume``: a Trainer with max_steps=4 restores ``ckpts-<MODE>/last.ckpt`` and stops (its
  full weights and Adam state recorded), then one fits to 6 steps from it (recorded), its
  checkpoints into ``ckpts-<MODE>-resumed<WORLD>`` (the fit's stay as they are);
* ``stockreads``: stock restores ``ckpts-fastpersist/last.ckpt`` and stops (recorded).

FSDPStrategy refuses the CPU (``device_id``: FSDP1 asks for an accelerator unless given the
CPU device), so a subclass wraps the model itself with ``device_id=cpu``; and stock's
FULL_STATE_DICT context offloads to the CPU, which on a CPU model frees the memory it is
still reading (a crash), so on CPU it does not offload (the same tensors, already on the
CPU). Both are the test's adaptations to the CPU, the same for both modes.

Each rank writes DIR/<MODE>-<PHASE>-<WORLD>-<RANK>.pt (torch.save of its records) and .json
(info: the plugin's saves, whether the strategy was routed, the torch.distributed
collectives from each checkpoint's state dicts to the end of its save).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fsdp1_full_worker import Collectives  # noqa: E402

from fp_integrations.lightning import FastPersistIO  # noqa: E402


def _no_offload_on_cpu() -> None:
    import lightning.fabric.strategies.fsdp as fabric_fsdp
    import lightning.pytorch.strategies.fsdp as pl_fsdp

    def context(module, world_size: int, rank0_only: bool = True):
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.state_dict_type(module=module, state_dict_type=StateDictType.FULL_STATE_DICT,
                                    state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
                                    optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False,
                                                                                     rank0_only=rank0_only))

    pl_fsdp._get_full_state_dict_context = context
    fabric_fsdp._get_full_state_dict_context = context


class CpuFSDPStrategy(FSDPStrategy):
    """FSDPStrategy on CPU processes: the model wrapped with ``device_id=cpu``."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if not any(isinstance(m, FSDP) for m in model.modules()):
            model = FSDP(model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                         sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs)
        return super()._setup_model(model)


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # 37 and 5 rows: flat params that divide by neither 2 nor 4; a buffer
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.ReLU(), torch.nn.Linear(37, 512),
                                       torch.nn.ReLU(), torch.nn.Linear(512, 5))
        self.register_buffer("seen", torch.zeros(3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += 1
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        # the same global batches on any number of ranks
        ds = TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 5, generator=g))
        return DataLoader(ds, batch_size=8 // self.trainer.world_size, shuffle=False)


class CountCollectives(Callback):
    """The torch.distributed collectives from the start of each checkpoint's state (the
    model's and optimizer's state dicts) to the end of its save."""

    def __init__(self) -> None:
        self.calls: list = []
        self.active: Collectives | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.active is None:
            self.active = Collectives().__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.stop()

    def on_train_end(self, trainer, pl_module) -> None:
        self.stop()

    def stop(self) -> None:
        if self.active is not None:
            self.active.__exit__(None, None, None)
            self.calls += self.active.calls
            self.active = None


def make_trainer(d: str, mode: str, steps: int, out: str) -> tuple[Trainer, FastPersistIO | None, CountCollectives]:
    plugin = FastPersistIO() if mode != "stock" else None
    extra = {"sharding_strategy": "NO_SHARD"} if mode == "fallback" else {}
    mc = ModelCheckpoint(dirpath=os.path.join(d, out), every_n_train_steps=2, save_top_k=-1,
                         save_last=True, filename="s{step}")
    count = CountCollectives()
    world = int(os.environ["WORLD_SIZE"])
    t = Trainer(accelerator="cpu", devices=world,
                strategy=CpuFSDPStrategy(state_dict_type="full", auto_wrap_policy={torch.nn.Linear},
                                         process_group_backend="gloo", **extra),
                plugins=[plugin] if plugin else None, callbacks=[count, mc], max_steps=steps, logger=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=d)
    return t, plugin, count


def full_state(t: Trainer, m: Net) -> dict[str, torch.Tensor]:
    """The full weights and Adam state, gathered (every rank calls this)."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(t.strategy.model, writeback=False):
        out = {f"w.{k}": v.detach().clone() for k, v in m.state_dict().items()}
    opt = t.optimizers[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # no offload: on a CPU model it frees memory the state still reads (see the docstring)
        with FSDP.state_dict_type(t.strategy.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            osd = FSDP.optim_state_dict(t.strategy.model, opt)
    for name, s in osd["state"].items():
        for k, v in s.items():
            out[f"adam.{name}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    out["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    return out


class Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run(d: str, mode: str, phase: str) -> Trainer:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rec: dict = {}
    info: dict = {}
    logged = Logged()
    logging.getLogger("fastpersist").addHandler(logged)
    if phase == "fit":
        t, plugin, count = make_trainer(d, mode, 4, f"ckpts-{mode}")
        m = Net()
        t.fit(m)
        rec["at_4"] = full_state(t, m)
    else:
        src = os.path.join(d, "ckpts-fastpersist" if phase == "stockreads" else f"ckpts-{mode}", "last.ckpt")
        out = f"ckpts-{mode}-{phase}{world}"
        t, plugin, count = make_trainer(d, mode, 4, out)
        m = Net()
        t.fit(m, ckpt_path=src)
        rec["restored"] = full_state(t, m)
        if phase == "resume":
            t, plugin, count = make_trainer(d, mode, 6, out)
            m = Net()
            t.fit(m, ckpt_path=src)
            rec["at_6"] = full_state(t, m)
    count.stop()
    info["stats"] = [os.path.basename(s.path) for s in (plugin.stats if plugin else [])]
    info["routed"] = getattr(t.strategy, "_fastpersist_sharded", None) is plugin if plugin else False
    info["why"] = t.strategy.__dict__.get("_fastpersist_fsdp1_why", "unset")
    info["tensor_collectives"] = [c for c in count.calls if c[1]]
    info["collectives"] = sorted({c[0] for c in count.calls})
    info["global_step"] = t.global_step
    logging.getLogger("fastpersist").removeHandler(logged)
    info["logged"] = [m for m in logged.messages if "FSDPStrategy" in m]
    torch.save(rec, os.path.join(d, f"{mode}-{phase}-{world}-{rank}.pt"))
    with open(os.path.join(d, f"{mode}-{phase}-{world}-{rank}.json"), "w") as f:
        json.dump(info, f)
    return t


def main() -> None:
    _no_offload_on_cpu()
    args = sys.argv[1:]
    assert args and len(args) % 3 == 0, args
    for i in range(0, len(args), 3):
        t = run(*args[i:i + 3])
        t.strategy.barrier()  # every rank has written this run's results before the next starts
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    from rank_exit import finish

    finish()
