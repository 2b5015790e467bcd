"""FastPersistIO with real Lightning Trainers on CPU: files, consistency, resume, DDP, errors."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as lp  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

import fp_core  # noqa: E402
from fp_integrations.lightning import FastPersistCallback, FastPersistIO, FastPersistWarning  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/integrations/ -> repo

# the model: Linear -> BatchNorm -> Linear (+ a >1 MiB layer so saves read live memory), Adam


class FixedDataset(torch.utils.data.Dataset):
    """64 random samples that do not depend on the global RNG (runs compare exactly)."""

    def __init__(self) -> None:
        self.data = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class Model(BoringModel):
    def __init__(self, hidden: int = 32, wide: int = 0, manual: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers = [torch.nn.Linear(32, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU()]
        if wide:
            layers += [torch.nn.Linear(hidden, wide), torch.nn.ReLU(), torch.nn.Linear(wide, hidden)]
        layers += [torch.nn.Linear(hidden, 2)]
        self.layer = torch.nn.Sequential(*layers)
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None
        return {"loss": loss}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(FixedDataset(), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def trainer(root, io=None, callbacks=(), module=lp, **kw):
    args = dict(default_root_dir=str(root), accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=8,
                limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False)
    args.update(kw)
    return module.Trainer(plugins=[io] if io is not None else None, callbacks=list(callbacks), **args)


def listing(d):
    return sorted(os.listdir(d))


def no_temp_files(d):
    left = [n for n in os.listdir(d) if n.endswith(".fptmp")]
    assert not left, left


def assert_same(a, b, where="ckpt"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class CapturingIO(FastPersistIO):
    """FastPersistIO that records a deep copy of what it was asked to save, at save time."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.captured = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.captured[os.path.abspath(path)] = copy.deepcopy(
            {k: checkpoint[k] for k in ("state_dict", "optimizer_states", "global_step") if k in checkpoint})
        super().save_checkpoint(checkpoint, path, storage_options)


# ---------------------------------------------------------------- plain plugin behaviour


def test_plugin_pickles_before_and_after_use(tmp_path):
    io = FastPersistIO(policy="overlap", max_in_flight=2, on_error="warn", queue_depth=8)
    training_running()
    io2 = pickle.loads(pickle.dumps(io))
    assert (io2.policy, io2.max_in_flight, io2.on_error, io2.engine_options) == ("overlap", 2, "warn", {"queue_depth": 8})
    io.save_checkpoint({"w": torch.randn(1000, 1000)}, tmp_path / "a.ckpt")
    io3 = pickle.loads(pickle.dumps(io))  # pending work does not travel; the copy is fresh
    assert not io3.pending()
    io.teardown()
    assert torch.equal(torch.load(tmp_path / "a.ckpt")["w"], io.load_checkpoint(tmp_path / "a.ckpt")["w"])


def training_running() -> None:
    """An optimizer step, as training makes: the plugin's saves are asynchronous from now on."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.sum().backward()
    opt.step()


def test_save_load_remove_semantics(tmp_path):
    io = FastPersistIO()
    training_running()
    big = {"w": torch.randn(2048, 2048), "step": 1}
    p = tmp_path / "sub" / "dir" / "x.ckpt"  # parent directories are created
    io.save_checkpoint(big, p)
    assert p.exists()  # visible at once (placeholder until the atomic rename)
    out = io.load_checkpoint(p)  # waits for the pending write
    assert torch.equal(out["w"], big["w"]) and out["step"] == 1
    assert out["w"].device.type == "cpu"
    # remove is ordered after pending writes: save, remove, save again -> the second save survives
    q = tmp_path / "q.ckpt"
    io.save_checkpoint({"v": torch.full((1024, 1024), 1.0)}, q)
    io.remove_checkpoint(q)
    io.save_checkpoint({"v": torch.full((1024, 1024), 2.0)}, q)
    io.wait()
    assert torch.load(q)["v"][0, 0].item() == 2.0
    # a pending save is never deleted under the write; the file is gone once it is durable
    r = tmp_path / "r.ckpt"
    io.save_checkpoint({"v": torch.randn(2048, 2048)}, r)
    io.remove_checkpoint(r)
    io.wait()
    assert not r.exists()
    io.remove_checkpoint(tmp_path / "missing.ckpt")  # silent, like TorchCheckpointIO
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.teardown()
    no_temp_files(tmp_path)
    assert fp_core.verify(p) is not None


def save_then_fail(io, fault, first, second) -> None:
    """``{"v": ones(256)}`` saved durably to ``first``, then a save to ``second`` that fails
    at once (ENOSPC) and has ended, its failure raised to nobody yet."""
    training_running()
    io.save_checkpoint({"v": torch.ones(256)}, first)
    io.wait()
    fault("write", errno=28)
    io.save_checkpoint({"v": torch.zeros(1024, 1024)}, second)
    for entries in list(io._pending.values()):
        for e in entries:
            assert e.handle.exception(timeout=60) is not None


def told(on_error: str, fn):
    """``fn()`` under the plugin's error policy, the full disk named: raised ("raise"), or
    warned and ``fn``'s result returned ("warn")."""
    if on_error == "raise":
        with pytest.raises(Exception, match="No space left"):
            fn()
        return None
    with pytest.warns(FastPersistWarning, match="No space left"):
        return fn()


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_removing_the_older_checkpoint_after_a_save_already_failed_keeps_it(tmp_path, fault, on_error):
    # save_top_k's rotation: save the new checkpoint, then remove the one it replaces. When
    # the save fails before the removal is asked for (a full disk fails it at once), the
    # older checkpoint must stay, and the failure be reported.
    io = FastPersistIO(on_error=on_error)
    old, new = tmp_path / "old.ckpt", tmp_path / "new.ckpt"
    save_then_fail(io, fault, old, new)
    told(on_error, lambda: io.remove_checkpoint(old))
    assert torch.equal(torch.load(old)["v"], torch.ones(256))
    assert not new.exists()
    io.remove_checkpoint(old)  # reported: the next removal runs
    assert not old.exists()
    io.teardown()


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_loading_a_path_whose_new_save_already_failed_says_so(tmp_path, fault, on_error):
    # The save over an existing checkpoint fails (and ends) before the load: the file there
    # is the older one, and the load must not return it as if the save had succeeded.
    io = FastPersistIO(on_error=on_error)
    p = tmp_path / "last.ckpt"
    save_then_fail(io, fault, p, p)
    out = told(on_error, lambda: io.load_checkpoint(p))
    if on_error == "warn":
        assert torch.equal(out["v"], torch.ones(256))  # told, then given the older file
    assert torch.equal(io.load_checkpoint(p)["v"], torch.ones(256))  # reported once
    io.teardown()


def test_blocking_saves(tmp_path):
    io = FastPersistIO()
    training_running()
    io.save_checkpoint({"w": torch.randn(1024, 1024)}, tmp_path / "a.ckpt", storage_options={"blocking": True})
    assert not io.pending()
    io.save_checkpoint({"w": torch.randn(1024, 1024)}, tmp_path / "a2.ckpt")
    io.save_checkpoint({"w": torch.randn(1024, 1024)}, tmp_path / "hpc_ckpt_3.ckpt")  # SLURM requeue: durable now
    assert not io.pending(tmp_path / "hpc_ckpt_3.ckpt") and not io.pending(tmp_path / "a2.ckpt")
    torch.load(tmp_path / "hpc_ckpt_3.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "b.ckpt", storage_options={"compress": True})
    io.teardown()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "after.ckpt")  # after teardown: blocking
    assert not io.pending()
    assert torch.equal(torch.load(tmp_path / "after.ckpt")["w"], torch.ones(3))


def test_verify_on_load(tmp_path):
    io = FastPersistIO(verify=True)
    p = tmp_path / "v.ckpt"
    io.save_checkpoint({"w": torch.randn(512, 512)}, p, storage_options={"blocking": True})
    io.load_checkpoint(p)
    with open(p, "r+b") as f:  # flip one byte inside the tensor data
        f.seek(os.path.getsize(p) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(fp_core.CorruptCheckpointError):
        io.load_checkpoint(p)


def test_resume_refuses_a_damaged_checkpoint_by_default(tmp_path):
    mc = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    trainer(tmp_path, FastPersistIO(), [mc], max_steps=4).fit(Model())
    last = tmp_path / "last.ckpt"
    rec = next(r for r in fp_core.inspect(last) if r.get("kind") == "storage" and r["size"] > 64)
    with open(last, "r+b") as f:  # flip one bit inside a tensor
        f.seek(rec["offset"] + rec["size"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(fp_core.CorruptCheckpointError, match=rec["name"]):
        trainer(tmp_path, FastPersistIO(), [], max_steps=6).fit(Model(), ckpt_path=str(last))
    # a checkpoint written by the stock IO still loads through the plugin (nothing to verify)
    stock = tmp_path / "stock.ckpt"
    TorchCheckpointIO().save_checkpoint({"w": torch.ones(2)}, stock)
    assert torch.equal(FastPersistIO().load_checkpoint(stock)["w"], torch.ones(2))


# ---------------------------------------------------------------- with the Trainer


@pytest.mark.parametrize("save_last", [True, "link"])
def test_same_files_as_stock(tmp_path, save_last):
    """save_top_k=2 with monitor every step + save_last: the same files (and link) as TorchCheckpointIO."""
    results = {}
    for name, io in (("stock", TorchCheckpointIO()), ("fp", FastPersistIO())):
        d = tmp_path / name
        lp.seed_everything(7)
        mc = ModelCheckpoint(dirpath=d, save_top_k=2, every_n_train_steps=1, monitor="loss", save_last=save_last)
        t = trainer(d, io, [mc])
        t.fit(Model())
        results[name] = (listing(d), os.path.basename(mc.best_model_path), os.path.basename(mc.last_model_path),
                         os.readlink(d / "last.ckpt") if (d / "last.ckpt").is_symlink() else None)
        for f in listing(d):
            torch.load(d / f, weights_only=False)  # every file is a complete torch.save zip
        no_temp_files(d)
    assert results["fp"] == results["stock"]
    assert len(results["fp"][0]) == 3


def test_pending_name_visible_to_model_checkpoint(tmp_path):
    """ModelCheckpoint's version counter asks ``fs.exists`` right after a save returns."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    io = FastPersistIO()
    training_running()
    p = tmp_path / "big.ckpt"
    io.save_checkpoint({"w": torch.randn(64, 1024, 1024)}, p)  # 256 MiB: still being written below
    was_pending = io.pending(p)
    assert get_filesystem(str(p)).exists(str(p)) and p.exists()
    io.teardown()
    assert p.stat().st_size > 256 * 2**20
    if not was_pending:
        pytest.skip("the write finished before the check (fast disk): visibility not exercised")


def test_version_counter_matches_stock(tmp_path):
    """A fixed file name: the -v1, -v2... counter checks existence right after a save, while the
    file may still be written; pending names are visible at once, so names match the stock IO."""
    results = {}
    for name, io in (("stock", TorchCheckpointIO()), ("fp", FastPersistIO())):
        d = tmp_path / name
        lp.seed_everything(7)
        mc = ModelCheckpoint(dirpath=d, filename="model", save_top_k=2, monitor="loss", every_n_train_steps=1)
        trainer(d, io, [mc], max_epochs=1, limit_train_batches=6).fit(Model(hidden=256, wide=2048))
        best_k = sorted(os.path.basename(p) for p in mc.best_k_models)
        # a second run into the same directory continues the counter; save_last="link" too
        mc2 = ModelCheckpoint(dirpath=d, filename="model", save_top_k=-1, every_n_train_steps=2, save_last="link")
        trainer(d, io, [mc2], max_epochs=1, limit_train_batches=4).fit(Model())
        mc3 = ModelCheckpoint(dirpath=d, save_top_k=0, save_last=True, every_n_train_steps=2)
        trainer(d, io, [mc3], max_epochs=1, limit_train_batches=4).fit(Model())
        results[name] = (listing(d), best_k, os.path.basename(mc2.last_model_path),
                         os.path.basename(mc3.last_model_path), os.readlink(d / "last.ckpt"))
    assert results["fp"] == results["stock"], results
    files = results["fp"][0]
    assert "model-v1.ckpt" in files and "last-v1.ckpt" in files


@pytest.mark.parametrize("policy", ["overlap", "snapshot"])
def test_checkpoint_equals_state_at_save_time(tmp_path, policy):
    """Every file holds exactly the state at its save call, though training ran on during the write."""
    io = CapturingIO(policy=policy)
    lp.seed_everything(3)
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1)
    trainer(tmp_path, io, [mc], max_epochs=1, limit_train_batches=6).fit(Model(hidden=1024, wide=4096))
    assert len(io.captured) == 6 and io.fence_count >= 5
    if policy == "snapshot":  # the disk write runs on across the next step (overlap-policy writes are too
        assert io.fence_overlaps >= 1  # quick on a small CPU model to be sure one is still in flight)
    for path, want in io.captured.items():
        got = torch.load(path, weights_only=False)
        assert_same(want, {k: got[k] for k in want}, os.path.basename(path))
    # the checkpoints really differ step to step (the test would catch a stale or torn file)
    sd = [v["state_dict"]["layer.3.weight"] for v in io.captured.values()]
    assert not torch.equal(sd[0], sd[-1])


@pytest.mark.parametrize("mode", ["accumulate", "bf16", "manual"])
def test_fence_under_accumulation_amp_manual(tmp_path, mode):
    kw, model = {}, Model(hidden=1024, wide=4096)
    if mode == "accumulate":
        kw["accumulate_grad_batches"] = 2
    elif mode == "bf16":
        kw["precision"] = "bf16-mixed"
    else:
        model = Model(hidden=1024, wide=4096, manual=True)
    io = CapturingIO(policy="overlap")
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1)
    trainer(tmp_path, io, [mc], max_epochs=1, limit_train_batches=8, **kw).fit(model)
    assert len(io.captured) == (4 if mode == "accumulate" else 8)
    assert io.fence_count >= len(io.captured) - 1
    for path, want in io.captured.items():
        got = torch.load(path, weights_only=False)
        assert_same(want, {k: got[k] for k in want}, os.path.basename(path))


def test_resume_reproduces_uninterrupted_run(tmp_path):
    lp.seed_everything(11)
    full = Model()
    trainer(tmp_path / "full", FastPersistIO(), max_epochs=3).fit(full)

    lp.seed_everything(11)
    part = Model()
    io = FastPersistIO()
    mc = ModelCheckpoint(dirpath=tmp_path / "part", save_last=True, every_n_epochs=1)
    trainer(tmp_path / "part", io, [mc], max_epochs=1).fit(part)  # stops after epoch 0

    lp.seed_everything(999)  # the resumed run must not depend on the fresh model's init
    resumed = Model()
    mc2 = ModelCheckpoint(dirpath=tmp_path / "part", save_last=True, every_n_epochs=1)
    t = trainer(tmp_path / "part", io, [mc2], max_epochs=3)
    t.fit(resumed, ckpt_path="last")
    assert t.global_step == 24
    assert_same(full.state_dict(), resumed.state_dict(), "final weights")
    assert_same(t.optimizers[0].state_dict()["state"], full.trainer.optimizers[0].state_dict()["state"], "adam")

    # LightningModule.load_from_checkpoint reads our files (plain torch.load underneath)
    loaded = Model.load_from_checkpoint(mc2.last_model_path)
    assert_same(loaded.state_dict(), resumed.state_dict(), "load_from_checkpoint")


def test_second_fit_after_teardown_is_async_again(tmp_path):
    io = FastPersistIO()
    model = Model(hidden=256, wide=2048)
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    t = trainer(tmp_path, io, [mc], max_epochs=1)
    t.validate(model, dataloaders=model.train_dataloader())  # teardown after validate too
    t.fit(model)
    n1 = len(io.stats)
    t2 = trainer(tmp_path, io, [ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)],
                 max_epochs=2)
    t2.fit(model, ckpt_path=mc.last_model_path or os.path.join(tmp_path, listing(tmp_path)[-1]))
    assert len(io.stats) > n1
    assert {s.policy for s in io.stats[n1:]} != {"sync"}, "saves of the second fit ran in the background"
    t2.save_checkpoint(tmp_path / "after_fit.ckpt")  # after teardown: complete when it returns
    assert not io.pending()
    assert Model.load_from_checkpoint(tmp_path / "after_fit.ckpt") is not None


def test_stats_logged(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    io = FastPersistIO()
    mc = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=2)
    t = trainer(tmp_path, io, [mc, FastPersistCallback(log_stats=True)], max_epochs=1,
                logger=CSVLogger(tmp_path, name="logs"))
    t.fit(Model())
    text = open(os.path.join(t.logger.log_dir, "metrics.csv")).read()
    assert "fastpersist/gbps" in text and "fastpersist/blocked_ms" in text and "fastpersist/write_ms" in text
    assert len(io.stats) == 4 and all(s.bytes > 0 for s in io.stats)


def test_pytorch_lightning_namespace(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint as PLModelCheckpoint
    from pytorch_lightning.demos.boring_classes import BoringModel as PLBoringModel

    from fp_integrations.lightning import PLFastPersistCallback, PLFastPersistIO

    class PLModel(PLBoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    io = PLFastPersistIO()
    mc = PLModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    t = trainer(tmp_path, io, [mc, PLFastPersistCallback()], module=pl, max_epochs=1)
    t.fit(PLModel())
    assert t.strategy.checkpoint_io is io
    assert len([f for f in listing(tmp_path) if f.endswith(".ckpt")]) == 4
    PLModel.load_from_checkpoint(mc.best_model_path)
    # each Trainer refuses the other namespace's class (they are distinct CheckpointIO types)
    with pytest.raises(Exception, match="invalid type for plugin"):
        trainer(tmp_path, FastPersistIO(), module=pl)


def test_fabric_save_load(tmp_path):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FastPersistIO()])
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model, opt = fabric.setup(model, opt)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "step": 5})
    model2 = torch.nn.Linear(64, 64)
    state = {"model": model2, "step": 0}
    rest = fabric.load(tmp_path / "f.ckpt", state)
    assert state["step"] == 5 and "optimizer" in rest
    assert torch.equal(model2.weight, model.weight.detach())


# ---------------------------------------------------------------- errors


def test_a_plugin_freed_in_the_middle_of_a_step_does_not_break_it():
    """The garbage collector may free an old plugin while torch iterates its global hooks
    (it did in CI: 'OrderedDict mutated during iteration' out of optimizer.step())."""
    import gc

    from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

    gc.collect()
    fp_core.pipeline.optim_hooks.flush()  # earlier tests' plugins: freed and out of the dict
    base = len(_global_optimizer_pre_hooks)
    io = FastPersistIO()
    io._install_hook()
    io.cycle = io  # only the cycle collector frees it
    del io
    calls = []
    collect = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(gc.collect()))
    last = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("last"))
    try:
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        p.grad = torch.ones(3)
        opt.step()  # the plugin is freed inside `collect`; `last` must still run
        assert calls[-1] == "last" and calls[0] > 0
        assert torch.equal(p.detach(), torch.full((3,), 0.9))
    finally:
        collect.remove()
        last.remove()
    fp_core.pipeline.optim_hooks.flush()  # a safe point: the freed plugin's hook leaves
    assert len(_global_optimizer_pre_hooks) == base


class ArmWriteFault(Callback):
    """Makes the save at global step ``at`` fail in the background with EIO: drains earlier
    saves, then arms the core's (process-wide, one-shot) native write fault. Lightning runs
    ModelCheckpoint's hooks after other callbacks', so its save comes next."""

    def __init__(self, at):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            from fp_core import _native

            trainer.strategy.checkpoint_io.wait()
            _native.inject_fault("write", errno=5)


def test_background_write_error_fails_fit(tmp_path):
    io = FastPersistIO()
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1)
    t = trainer(tmp_path, io, [ArmWriteFault(at=3), mc], max_epochs=1, limit_train_batches=8)
    with pytest.raises(fp_core.AsyncCheckpointError) as ei:
        t.fit(Model(hidden=256, wide=2048))
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == 5
    assert "step=3.ckpt" in str(ei.value)
    assert t.global_step <= 5  # raised at the next optimizer step's fence (or the next save)
    ckpts = listing(tmp_path)
    assert "epoch=0-step=3.ckpt" not in ckpts  # the failed save left nothing (no placeholder, no temp)
    assert {"epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"} <= set(ckpts)
    for f in ckpts:
        torch.load(tmp_path / f, weights_only=False)
    no_temp_files(tmp_path)


def test_background_error_warns_and_training_continues(tmp_path):
    io = FastPersistIO(on_error="warn")
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1)
    t = trainer(tmp_path, io, [ArmWriteFault(at=3), mc], max_epochs=1, limit_train_batches=8)
    with pytest.warns(FastPersistWarning, match="Input/output error"):
        t.fit(Model(hidden=256, wide=2048))
    assert t.global_step == 8
    ckpts = listing(tmp_path)
    assert ckpts == [f"epoch=0-step={i}.ckpt" for i in (1, 2, 4, 5, 6, 7, 8)]
    for f in ckpts:
        torch.load(tmp_path / f, weights_only=False)
    no_temp_files(tmp_path)


def _fail_on_commit(path, stats):
    if path.endswith("step=2.ckpt"):
        raise RuntimeError("on_commit failed for " + path)


def test_failing_on_commit_surfaces_in_fit(tmp_path):
    io = FastPersistIO(on_commit=_fail_on_commit)
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1)
    t = trainer(tmp_path, io, [mc], max_epochs=1, limit_train_batches=8)
    with pytest.raises(fp_core.AsyncCheckpointError, match="on_commit failed"):
        t.fit(Model())


class Boom(Exception):
    pass


class RaiseAt(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            raise Boom("user error")


def test_teardown_does_not_mask_exception(tmp_path):
    """A pending save fails while the user's exception propagates: fit raises the user's exception."""
    io = FastPersistIO(on_commit=_fail_on_commit)
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1)
    t = trainer(tmp_path, io, [mc, RaiseAt()], max_epochs=1)  # mc saves step 2, then RaiseAt raises
    with warnings.catch_warnings(record=True), pytest.raises(Boom):
        t.fit(Model())
    # the plugin works again afterwards
    io.save_checkpoint({"x": torch.ones(2)}, tmp_path / "again.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "again.ckpt")["x"], torch.ones(2))


# ---------------------------------------------------------------- DDP (CPU, gloo)


def test_ddp_spawn(tmp_path):
    io = FastPersistIO()
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=2, monitor="loss", every_n_train_steps=2, save_last=True)
    lp.seed_everything(5)
    model = Model()
    t = trainer(tmp_path, io, [mc], strategy="ddp_spawn", devices=2, max_epochs=1)
    t.fit(model)
    files = [f for f in listing(tmp_path) if f.endswith(".ckpt")]
    assert len(files) == 3 and "last.ckpt" in files
    for f in files:
        ck = torch.load(tmp_path / f, weights_only=False)
        assert ck["global_step"] in (2, 4, 6, 8)
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    # the weights handed back to the main process (through the plugin) are the trained ones
    assert_same(model.state_dict(), last["state_dict"], "ddp_spawn weights")
    no_temp_files(tmp_path)


class RecordWriters:
    """on_commit hook (picklable, for ddp_spawn): append ``path writers`` for each save."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, path: str, stats) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.path.basename(path)} {stats.writers}\n")


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_ddp_spawn_every_rank_writes_a_share(tmp_path, writer, shm_root):
    """With writer="process", the writer processes run each collective save among themselves."""
    log = str(tmp_path / "writers.log")
    io = FastPersistIO(on_commit=RecordWriters(log), writer=writer)
    mc = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=2, monitor="loss", every_n_train_steps=2,
                         save_last=True)
    lp.seed_everything(5)
    model = Model()
    t = trainer(tmp_path, io, [mc, FastPersistCallback()], strategy="ddp_spawn", devices=2, max_epochs=1)
    t.fit(model)
    rows = [line.split() for line in open(log).read().splitlines()]
    ckpt_rows = [(name, int(w)) for name, w in rows if name != ".temp.ckpt"]
    assert ckpt_rows and all(w == 2 for _, w in ckpt_rows), rows  # both ranks wrote every checkpoint
    assert [int(w) for name, w in rows if name == ".temp.ckpt"] == [1]  # the hand-back file: rank 0 alone
    for f in listing(tmp_path / "ck"):
        fp_core.verify(tmp_path / "ck" / f)
    last = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    assert_same(model.state_dict(), last["state_dict"], "ddp_spawn weights")
    no_temp_files(tmp_path / "ck")


DDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    sys.path[:0] = [{repo!r}, os.path.join({tests!r}, "integrations")]
    import lightning.pytorch as lp
    from lightning.pytorch.callbacks import ModelCheckpoint
    from fp_integrations.lightning import FastPersistIO, FastPersistCallback
    from test_lightning import Model
    out = sys.argv[1]
    lp.seed_everything(5)
    mc = ModelCheckpoint(dirpath=out, save_top_k=2, monitor="loss", every_n_train_steps=2, save_last=True)
    t = lp.Trainer(default_root_dir=out, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                   limit_train_batches=8, limit_val_batches=0, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, plugins=[FastPersistIO()], callbacks=[mc, FastPersistCallback()])
    m = Model()
    t.fit(m)
    t.save_checkpoint(os.path.join(out, "final-rank-call.ckpt"))
    torch.save(m.state_dict(), os.path.join(out, f"live-{{t.global_rank}}.pt"))
""")


@pytest.mark.slow
def test_ddp_script_launcher(tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT.format(repo=REPO, tests=os.path.join(REPO, "tests")))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=240,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    files = listing(out)
    assert "last.ckpt" in files and "final-rank-call.ckpt" in files
    live0 = torch.load(out / "live-0.pt")
    live1 = torch.load(out / "live-1.pt")
    params = [k for k in live0 if "running_" not in k and "num_batches" not in k]  # BN stats are per rank
    assert_same({k: live0[k] for k in params}, {k: live1[k] for k in params}, "replicas")
    assert_same(live0, torch.load(out / "final-rank-call.ckpt", weights_only=False)["state_dict"], "final")
    for f in files:
        if f.endswith(".ckpt"):
            fp_core.load(out / f, weights_only=False, verify=True)


def test_checkpointer_options_pass_through(tmp_path):
    """AsyncCheckpointer options given to the plugin reach the core (here: huge pages)."""
    io = FastPersistIO(policy="overlap", collapse_live_tensors=True, huge_pages=False)
    training_running()
    w = torch.randn(2048, 2048)  # 16 MiB, written in place under overlap
    io.save_checkpoint({"w": w}, tmp_path / "a.ckpt")
    io.wait()
    ckpt = io._ckpt
    assert ckpt.collapse_live_tensors and not ckpt.huge_pages
    ckpt.wait_huge_pages()
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], w)
    io.teardown()
    from fp_core.tools.procinfo import thp_mode
    if thp_mode() not in ("always", "madvise") or ckpt.huge_page_bytes == 0:
        pytest.skip("no transparent huge pages here, or the kernel declined MADV_COLLAPSE")
    assert ckpt.huge_page_bytes >= 12 * 1024 * 1024


# ---------------------------------------------------------------- saves with no step after them


def writer_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("fastpersist-writer")]


def test_save_outside_a_running_fit_is_complete_when_it_returns(tmp_path):
    """Lightning's test_save_last_saves_correct_last_model_path and
    test_load_from_checkpoint_hook_calls read the file with torch.load right after
    trainer.save_checkpoint: it must not be a placeholder then."""
    io = FastPersistIO()
    t = trainer(tmp_path, io)
    model = Model()
    t.strategy.connect(model)
    before = writer_threads()
    t.save_checkpoint(tmp_path / "before_fit.ckpt")
    assert os.path.getsize(tmp_path / "before_fit.ckpt") > 0 and not io.pending()
    assert torch.load(tmp_path / "before_fit.ckpt", weights_only=False)["state_dict"].keys() == model.state_dict().keys()
    assert writer_threads() == before  # no writer thread left running until interpreter exit
    t.validate(model, dataloaders=model.train_dataloader())
    t.save_checkpoint(tmp_path / "after_validate.ckpt")
    Model.load_from_checkpoint(tmp_path / "after_validate.ckpt")


def test_saves_inside_fit_stay_asynchronous(tmp_path):
    io = FastPersistIO()
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    t = trainer(tmp_path, io, [mc], max_epochs=1)
    t.fit(Model(hidden=256, wide=2048))
    assert len(io.stats) == 4
    assert all(s.policy in ("overlap", "snapshot") for s in io.stats), [s.policy for s in io.stats]


def test_fabric_save_before_any_step_is_complete(tmp_path):
    from lightning.fabric import Fabric

    io = FastPersistIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup(torch.nn.Linear(64, 64))
    fabric.save(tmp_path / "init.ckpt", {"model": model})
    assert not io.pending() and torch.load(tmp_path / "init.ckpt")["model"]["weight"].shape == (64, 64)


@pytest.mark.parametrize("fail", [False, True])
def test_wrapped_in_async_checkpoint_io_nothing_is_left_pending_after_fit(tmp_path, fault, fail):
    """AsyncCheckpointIO (any _WrappingCheckpointIO) never passes teardown() on: every save
    must be durable, and every failure reported, by the time fit returns."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    inner = FastPersistIO()
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    t = trainer(tmp_path, AsyncCheckpointIO(inner), [mc], max_epochs=1)
    if fail:
        fault("write", errno=5, after_bytes=0)
        with pytest.raises(Exception, match="Input/output error"):
            t.fit(Model(hidden=256, wide=2048))
        return
    t.fit(Model(hidden=256, wide=2048))
    assert not inner.pending()
    ckpts = [f for f in listing(tmp_path) if f.endswith(".ckpt")]
    assert len(ckpts) == 4
    for f in ckpts:
        fp_core.verify(tmp_path / f)
        Model.load_from_checkpoint(tmp_path / f)


LOGGING_PROBE = r"""
import logging, sys
seen = []
class H(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger().addHandler(H())  # the user's logging setup (as pytest's caplog), before Lightning's import
logging.getLogger().setLevel(logging.INFO)
import lightning.pytorch as lp
from lightning.pytorch.utilities.rank_zero import rank_zero_info
def state():
    lg = logging.getLogger("lightning.pytorch")
    return (lg.level, lg.propagate, [type(h).__name__ for h in lg.handlers])
before = state()
rank_zero_info("before import")
import fp_integrations.lightning as fl
io = fl.FastPersistIO()
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
t = lp.Trainer(plugins=[io], accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=sys.argv[1], enable_checkpointing=False)
t.fit(BoringModel())
rank_zero_info("after import and fit")
assert "pytorch_lightning" not in sys.modules, "importing the plugin imported pytorch_lightning"
assert state() == before, (state(), before)
assert "before import" in seen and "after import and fit" in seen, seen
print("OK")
"""


def test_importing_and_using_the_plugin_leaves_lightnings_logging_alone(tmp_path):
    r = subprocess.run([sys.executable, "-c", LOGGING_PROBE, str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


# ---------------------------------------------------------------- process exit


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_notebook"])
def test_fabric_fork_workers_commit_their_last_save_before_they_exit(tmp_path, strategy):
    """Fabric's fork launcher ends each worker with os._exit after multiprocessing's
    finalizers (no atexit): the final step's save, pending then, must still be committed
    (issue 38: last.ckpt was one step old)."""
    steps = 5
    helper = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "fabric_fork.py")
    r = subprocess.run([sys.executable, helper, str(tmp_path), str(steps), strategy],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert torch.load(tmp_path / "last.ckpt")["step"] == steps
    for step in range(1, steps + 1):
        assert torch.load(tmp_path / f"step-{step}.ckpt")["step"] == step
        fp_core.verify(str(tmp_path / f"step-{step}.ckpt"))
