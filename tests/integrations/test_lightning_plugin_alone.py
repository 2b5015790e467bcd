"""``Trainer(plugins=[FastPersistIO()])`` alone (no FastPersistCallback) with Lightning's
ModelParallelStrategy (FSDP2 on CPU processes over gloo), side by side with stock Lightning
running the same script (tests/helpers/lightning_plugin_alone.py):

* ``save_distributed_checkpoint=False``: every rank writes its own rows of the one .ckpt
  file, which holds what stock writes (plain ``torch.load`` reads it); ``ckpt_path="last"``
  resumes on 2 processes and on 1 (and a 1-process file on 2), each rank reading only its
  own rows, bit for bit where stock resumes; a rank failing mid-save keeps the previous file.
* ``save_distributed_checkpoint=True``: the sharded directory goes through FastPersist.
* A strategy that saves without its CheckpointIO warns once; other strategies and other
  CheckpointIOs are untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import HELPERS, assert_identical, free_port

import fp_core

pytest.importorskip("lightning")


def _run(d, mode: str, layout: str, phase: str, nproc: int = 2) -> list[dict]:
    return _run_many([(d, mode, layout, phase)], nproc)[0]


def _run_many(jobs: list[tuple], nproc: int = 2) -> list[list[dict]]:
    """Runs of one mode in one launch, one after the other (each in its own directory; torch
    and Lightning are imported once); each run's per-rank results, in order."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           free_port(), os.path.join(HELPERS, "lightning_plugin_alone.py")]
    for d, mode, layout, phase in jobs:
        cmd += [str(d), mode, layout, phase]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300 * len(jobs))
    assert p.returncode == 0, p.stderr[-4000:]
    return [[json.loads((d / f"{mode}-{layout}-{phase}-{r}.json").read_text()) for r in range(nproc)]
            for d, mode, layout, phase in jobs]


def _records(d, mode: str, layout: str, phase: str) -> dict:
    return torch.load(d / f"{mode}-{layout}-{phase}-0.pt")


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def file_runs(tmp_path_factory):
    """Fit 4 steps on 2 processes (ours and stock), then: resume on 2, on 1, and a save
    failing on rank 1; and a fit on 1 process resumed on 2."""
    base = tmp_path_factory.mktemp("fit")
    out: dict = {"base": base}
    out["fit"] = {m: _run(base, m, "file", "fit") for m in ("fastpersist", "stock", "callback")}
    # The later runs share launches by mode and process count (ours never in one process with
    # stock; each run first in its launch where its stock twin is): 7 launches, not 11.
    r1 = _copy(base, tmp_path_factory.mktemp("resume1") / "run")
    one = tmp_path_factory.mktemp("one")
    fp1, _ = _run_many([(r1, "fastpersist", "file", "resume"), (one, "fastpersist", "file", "fit")], 1)
    out["resume1"] = (r1, {"fastpersist": fp1, "stock": _run(r1, "stock", "file", "resume", 1)})
    r2 = _copy(base, tmp_path_factory.mktemp("resume2") / "run")
    fail = _copy(base, tmp_path_factory.mktemp("fail") / "run")
    last = fail / "ckpts-fastpersist-file" / "last.ckpt"
    out["fail_before"] = hashlib.sha256(last.read_bytes()).hexdigest()
    o2 = _copy(one, tmp_path_factory.mktemp("one_to_two") / "run")
    shutil.copytree(o2 / "ckpts-fastpersist-file", o2 / "ckpts-stock-file")  # stock's "last" is our file
    fp_r2, fp_o2, fp_fail = _run_many([(r2, "fastpersist", "file", "resume"), (o2, "fastpersist", "file", "resume"),
                                       (fail, "fastpersist", "file", "fail")])
    st_r2, st_o2 = _run_many([(r2, "stock", "file", "resume"), (o2, "stock", "file", "resume")])
    out["resume2"] = (r2, {"fastpersist": fp_r2, "stock": st_r2})
    out["fail"] = (fail, fp_fail)
    out["one_to_two"] = (one, o2, {"fastpersist": fp_o2, "stock": st_o2})
    return out


def _strip_paths(obj, roots):
    """``obj`` with the run directories in its strings (ModelCheckpoint's paths) made equal."""
    if isinstance(obj, dict):
        return {_strip_paths(k, roots): _strip_paths(v, roots) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip_paths(v, roots) for v in obj)
    if isinstance(obj, str):
        for r in roots:
            obj = obj.replace(r, "<run>")
        return obj
    return obj


def test_plugin_alone_every_rank_writes_the_file_stock_writes(file_runs):
    base = file_runs["base"]
    fp = file_runs["fit"]["fastpersist"]
    # routed by the plugin alone; every save of every rank went through it, none warned
    assert all(r["routed"] and not r["warnings"] for r in fp)
    assert [r["stats"] for r in fp] == [["sstep=2.ckpt", "last.ckpt", "sstep=4.ckpt", "last.ckpt"]] * 2
    # inside fit: in the background (the pipeline's policies), fenced before the next step
    assert all(p in ("overlap", "snapshot") for r in fp for p in r["policies"]), fp
    names = sorted(os.listdir(base / "ckpts-fastpersist-file"))
    assert names == sorted(os.listdir(base / "ckpts-stock-file")) == ["last.ckpt", "sstep=2.ckpt", "sstep=4.ckpt"]
    roots = [str(base / "ckpts-fastpersist-file"), str(base / "ckpts-stock-file")]
    for name in names:
        ours = base / "ckpts-fastpersist-file" / name
        assert fp_core.verify(str(ours))["bytes"] > 0  # FastPersist's, checksummed
        # plain torch.load on one process: stock's keys and order, full tensors, optimizer
        # state keyed by parameter id, equal to stock's bit for bit (the runs are the same)
        mine = torch.load(ours, weights_only=True)
        theirs = torch.load(base / "ckpts-stock-file" / name, weights_only=True)
        assert_identical(_strip_paths(mine, roots), _strip_paths(theirs, roots), name)
        assert list(mine["optimizer_states"][0]["state"]) == list(range(8))
        assert mine["state_dict"]["net.0.weight"].shape == (37, 16)
    # with FastPersistCallback as well: the same files, written the same way
    assert all(r["routed"] and not r["warnings"] for r in file_runs["fit"]["callback"])
    assert [r["stats"] for r in file_runs["fit"]["callback"]] == [r["stats"] for r in fp]
    roots.append(str(base / "ckpts-callback-file"))
    for name in names:
        assert_identical(_strip_paths(torch.load(base / "ckpts-callback-file" / name, weights_only=True), roots),
                      _strip_paths(torch.load(base / "ckpts-fastpersist-file" / name, weights_only=True), roots))
    at4 = _records(base, "fastpersist", "file", "fit")["at_4"]
    last = torch.load(base / "ckpts-fastpersist-file" / "last.ckpt", weights_only=True)
    assert torch.equal(last["state_dict"]["net.2.weight"], at4["w.2.weight"])
    assert torch.equal(last["optimizer_states"][0]["state"][2]["exp_avg"], at4["adam.2.exp_avg"])


@pytest.mark.parametrize("scenario", ["resume2", "resume1"])
def test_resume_from_the_file_on_two_and_one_process_is_exact(file_runs, scenario):
    d, runs = file_runs[scenario]
    at4 = _records(file_runs["base"], "fastpersist", "file", "fit")["at_4"]
    ours, stock = _records(d, "fastpersist", "file", "resume"), _records(d, "stock", "file", "resume")
    # restored: weights, Adam state and the scheduler's lr, bit for bit, as stock restores them
    assert _same(ours["restored"], at4) and _same(stock["restored"], at4)
    # and the steps after it end where stock's end
    assert _same(ours["at_6"], stock["at_6"])
    assert [r["global_step"] for r in runs["fastpersist"]] == [r["global_step"] for r in runs["stock"]]
    assert sorted(os.listdir(d / "ckpts-fastpersist-file")) == sorted(os.listdir(d / "ckpts-stock-file"))
    # each rank read its own rows: together about the one-process read, each well under it
    full = sum(v.numel() * v.element_size() for v in at4.values())
    read = [r["load"]["tensor_bytes"] for r in runs["fastpersist"]]
    assert all(not r["load"]["whole_file"] for r in runs["fastpersist"])
    if len(read) == 1:
        assert full <= read[0] < full + 512
    else:
        assert all(b < 0.6 * full for b in read), (read, full)
        assert full <= sum(read) < full + 1024, (read, full)


def test_a_one_process_file_resumes_on_two_and_stock_reads_it(file_runs):
    one, d, runs = file_runs["one_to_two"]
    at4 = _records(one, "fastpersist", "file", "fit")["at_4"]
    ours, stock = _records(d, "fastpersist", "file", "resume"), _records(d, "stock", "file", "resume")
    assert _same(ours["restored"], at4) and _same(stock["restored"], at4)  # stock reads our file
    assert _same(ours["at_6"], stock["at_6"])
    assert all(r["routed"] for r in runs["fastpersist"])


def test_a_rank_failing_mid_save_keeps_the_previous_checkpoint(file_runs):
    d, runs = file_runs["fail"]
    # the write failing on rank 1 (in the background) fails the save, and fit, on every rank
    assert all("CollectiveSaveError: collective save of" in r["error"] and "rank 1: OSError: [Errno 5]" in r["error"]
               for r in runs), runs
    ckpts = d / "ckpts-fastpersist-file"
    names = os.listdir(ckpts)
    # nothing under the failed save's name, no temp file; a save queued behind it (last-v1,
    # when it was queued before the failure was raised) is complete
    assert "sstep=5.ckpt" not in names and not [n for n in names if n.startswith(".")], names
    assert {"last.ckpt", "sstep=2.ckpt", "sstep=4.ckpt"} <= set(names)
    assert hashlib.sha256((ckpts / "last.ckpt").read_bytes()).hexdigest() == file_runs["fail_before"]
    for n in names:
        fp_core.verify(str(ckpts / n))


def test_sharded_directories_with_the_plugin_alone(tmp_path):
    fit = _run(tmp_path, "fastpersist", "sharded", "fit")
    assert all(r["routed"] and not r["warnings"] for r in fit)
    assert [r["stats"] for r in fit] == [["sstep=2.ckpt", "last.ckpt", "sstep=4.ckpt", "last.ckpt"]] * 2
    ckpts = tmp_path / "ckpts-fastpersist-sharded"
    for name in os.listdir(ckpts):
        assert fp_core.verify(str(ckpts / name))["files"] == 3  # two rank files and meta.pt, checksummed
    _run(tmp_path, "fastpersist", "sharded", "resume")
    at4 = _records(tmp_path, "fastpersist", "sharded", "fit")["at_4"]
    assert _same(_records(tmp_path, "fastpersist", "sharded", "resume")["restored"], at4)


# --------------------------------------------------------------------------- one process


def _tiny_fit(tmp_path, strategy, plugin, steps: int = 4):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2, save_top_k=-1)
    t = Trainer(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin] if plugin else None,
                callbacks=[mc], max_steps=steps, logger=False, enable_progress_bar=False,
                enable_model_summary=False, limit_val_batches=0)
    t.fit(BoringModel())
    return t


def _self_saving(base: type) -> type:
    class SelfSaving(base):
        """A custom strategy that writes its checkpoints itself, past its CheckpointIO."""

        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            os.makedirs(os.path.dirname(filepath), exist_ok=True)
            torch.save(checkpoint, filepath)

    return SelfSaving


def test_a_strategy_saving_past_its_checkpoint_io_warns_once(tmp_path):
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from fp_integrations.lightning import FastPersistIO, FastPersistWarning

    plugin = FastPersistIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tiny_fit(tmp_path, _self_saving(SingleDeviceStrategy)(device=torch.device("cpu")), plugin)
    ours = [w for w in caught if issubclass(w.category, FastPersistWarning)]
    assert len(os.listdir(tmp_path / "ckpts")) == 2  # two saves, one warning
    assert len(ours) == 1, [str(w.message) for w in ours]
    msg = str(ours[0].message)
    assert "SelfSaving saved checkpoint" in msg and "step=2.ckpt" in msg and "self.checkpoint_io.save_checkpoint" in msg
    assert plugin.stats == []


def test_strategies_that_use_their_checkpoint_io_do_not_warn(tmp_path):
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from fp_integrations.lightning import FastPersistIO, FastPersistWarning

    class Delegating(SingleDeviceStrategy):
        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            checkpoint["custom"] = 1
            super().save_checkpoint(checkpoint, filepath, storage_options)

    for i, strategy in enumerate((Delegating(device=torch.device("cpu")), SingleDeviceStrategy(torch.device("cpu")))):
        plugin = FastPersistIO()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _tiny_fit(tmp_path / str(i), strategy, plugin)
        assert not [w for w in caught if issubclass(w.category, FastPersistWarning)]
        assert len(plugin.stats) == 2
        # an overriding save is watched (it delegated: no warning); the stock save is not wrapped at all
        assert ("save_checkpoint" in vars(strategy)) == (i == 0)


def test_deepspeed_is_named_in_the_warning(tmp_path):
    from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy

    from fp_integrations import lightning_sharded
    from fp_integrations.lightning import FastPersistIO, FastPersistWarning

    class DeepSpeedStrategy(_self_saving(SingleDeviceStrategy)):  # what the check sees: the class's name
        pass

    plugin = FastPersistIO()
    s = DeepSpeedStrategy(device=torch.device("cpu"))
    s.checkpoint_io = plugin  # as the Trainer assigns it: the setter watches the strategy
    wrapped = vars(s)["save_checkpoint"]
    lightning_sharded.on_assigned(s, plugin, Strategy)  # idempotent: wrapped once
    assert vars(s)["save_checkpoint"] is wrapped
    with pytest.warns(FastPersistWarning, match="DeepSpeed writes its own checkpoint directory"):
        s.save_checkpoint({"x": torch.ones(2)}, str(tmp_path / "a.ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.save_checkpoint({"x": torch.ones(2)}, str(tmp_path / "b.ckpt"))  # once
    assert torch.equal(torch.load(tmp_path / "b.ckpt")["x"], torch.ones(2))  # the strategy's own save ran


def test_other_checkpoint_ios_are_stored_as_stock_stores_them():
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

    from fp_integrations.lightning import FastPersistIO

    FastPersistIO()  # the setter is wrapped from the first plugin on
    prop = vars(Strategy)["checkpoint_io"]
    assert getattr(prop.fset, "_fastpersist", False)
    s = ModelParallelStrategy(save_distributed_checkpoint=False)
    io = TorchCheckpointIO()
    s.checkpoint_io = io
    assert s.checkpoint_io is io and not {"save_checkpoint", "load_checkpoint", "_fastpersist_sharded"} & set(vars(s))
    # wrapped in Lightning's AsyncCheckpointIO, the plugin still routes the strategy
    plugin = FastPersistIO()
    s2 = ModelParallelStrategy(save_distributed_checkpoint=False)
    s2.checkpoint_io = AsyncCheckpointIO(plugin)
    assert s2._fastpersist_sharded is plugin and "optimizer_state" in vars(s2)
    FastPersistIO()  # a later plugin does not wrap the setter again
    assert vars(Strategy)["checkpoint_io"] is prop
