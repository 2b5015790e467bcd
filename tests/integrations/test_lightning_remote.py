"""FastPersistIO with remote (s3://) checkpoints, against a real S3 server on loopback
(moto's server mode, tests/helpers/s3_server.py): fit + resume, rotation, upload failures."""

from __future__ import annotations

import os
import sys
import time
import uuid

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import lightning.pytorch as lp  # noqa: E402
from conftest import HELPERS  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import fp_core  # noqa: E402
from fp_core import remote  # noqa: E402
from fp_integrations.lightning import FastPersistIO, FastPersistModelCheckpoint, FastPersistWarning  # noqa: E402

sys.path.insert(0, HELPERS)
from s3_server import S3Server  # noqa: E402
from test_lightning import Model, assert_same, trainer  # noqa: E402

# ---------------------------------------------------------------- fixtures


@pytest.fixture
def s3(s3_server, monkeypatch):
    """(server, bucket URL) with a fresh bucket. fsspec itself is configured for the server,
    as ModelCheckpoint makes its own fsspec calls on dirpath (exists / ls)."""
    import fsspec.config

    if not s3_server.running:
        s3_server.start()
    bucket = "fp-" + uuid.uuid4().hex[:12]
    s3_server.make_bucket(bucket)
    monkeypatch.setitem(fsspec.config.conf, "s3", s3_server.storage_options())
    yield s3_server, f"s3://{bucket}"
    if not s3_server.running:
        s3_server.start()


def staged_files(d: str) -> list[str]:
    out = []
    for root, _, files in os.walk(os.path.join(d, "pending")):
        out += [os.path.join(root, f) for f in files]
    return out


def keys(srv: S3Server, bucket_url: str) -> list[str]:
    resp = srv.boto3_client().list_objects_v2(Bucket=bucket_url[len("s3://"):])
    return sorted(o["Key"] for o in resp.get("Contents", []))


def slow_uploads(monkeypatch, seconds: float = 0.3) -> None:
    """Every upload takes at least ``seconds``: saves are still pending at the next step."""
    real = remote.upload_file

    def slow(*a, **kw):
        time.sleep(seconds)
        return real(*a, **kw)

    monkeypatch.setattr(remote, "upload_file", slow)


# ---------------------------------------------------------------- the plugin alone


def test_save_load_remove_remote(s3, staging):
    srv, bucket = s3
    io = FastPersistIO()
    url = f"{bucket}/plain/x.ckpt"
    big = {"w": torch.randn(1024, 1024), "step": 1}
    io.save_checkpoint(big, url)
    assert not os.path.exists(url.replace("s3://", ""))  # nothing local under the URL's name
    out = io.load_checkpoint(url)  # waits for the pending upload
    assert torch.equal(out["w"], big["w"]) and out["step"] == 1 and out["w"].device.type == "cpu"
    assert keys(srv, bucket) == ["plain/x.ckpt"]
    remote.verify(url)  # a complete FastPersist file, checksums and all
    # remove is ordered after pending saves: save, remove, save again -> the second survives
    q = f"{bucket}/plain/q.ckpt"
    io.save_checkpoint({"v": torch.full((512, 512), 1.0)}, q)
    io.remove_checkpoint(q)
    io.save_checkpoint({"v": torch.full((512, 512), 2.0)}, q)
    io.wait()
    assert io.load_checkpoint(q)["v"][0, 0].item() == 2.0
    io.remove_checkpoint(q)
    io.remove_checkpoint(f"{bucket}/plain/missing.ckpt")  # silent, like TorchCheckpointIO
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(f"{bucket}/plain/missing.ckpt")
    io.save_checkpoint({"w": torch.ones(3)}, f"{bucket}/plain/b.ckpt", storage_options={"blocking": True})
    assert not io.pending() and remote.exists(f"{bucket}/plain/b.ckpt")
    io.teardown()
    assert keys(srv, bucket) == ["plain/b.ckpt", "plain/x.ckpt"]
    assert [s.path for s in io.stats][:1] == [url]
    assert staged_files(staging) == []


def test_explicit_storage_options_and_keep_local(s3, staging, monkeypatch):
    """storage_options given to the plugin (not fsspec's config); keep_local caches the file."""
    import fsspec.config

    srv, bucket = s3
    monkeypatch.delitem(fsspec.config.conf, "s3")
    io = FastPersistIO(storage_options=srv.storage_options(), keep_local=True)
    url = f"{bucket}/k/last.ckpt"
    io.save_checkpoint({"w": torch.arange(10)}, url)
    io.wait()
    assert staged_files(staging) == []
    assert os.listdir(os.path.join(staging, "cache"))  # the committed copy is cached

    def no_download(*a, **kw):
        raise AssertionError("downloaded although the cached copy is valid")

    import s3fs
    monkeypatch.setattr(s3fs.S3FileSystem, "get_file", no_download)
    assert torch.equal(io.load_checkpoint(url)["w"], torch.arange(10))
    io.remove_checkpoint(url)
    assert not remote.exists(url, storage_options=srv.storage_options())
    io.teardown()


# ---------------------------------------------------------------- with the Trainer


def test_fit_rotate_and_resume_last_from_s3(s3, staging, tmp_path):
    """save_top_k=2 + save_last every step on s3://: rotation removes remote objects;
    fit(ckpt_path="last") resumes from the store and ends with the uninterrupted run's weights."""
    srv, bucket = s3
    lp.seed_everything(11)
    full = Model()
    trainer(tmp_path / "full", FastPersistIO(), max_epochs=3).fit(full)

    dirpath = f"{bucket}/ckpts"
    lp.seed_everything(11)
    part = Model()
    io = FastPersistIO()
    mc = FastPersistModelCheckpoint(dirpath=dirpath, save_top_k=2, monitor="loss", save_last=True,
                                    every_n_train_steps=1)
    trainer(tmp_path / "part", io, [mc], max_epochs=1).fit(part)  # stops after epoch 0 (8 steps)
    assert len(io.stats) > 8  # last.ckpt at every step + the top-k saves, all uploaded
    want = sorted(p[len(bucket) + 1:] for p in [*mc.best_k_models, mc.last_model_path])
    assert keys(srv, bucket) == want and len(want) == 3  # the 6 rotated-out checkpoints are gone
    for k in want:
        assert remote.verify(f"{bucket}/{k}")
    assert staged_files(staging) == []
    assert not os.path.exists(tmp_path / "part" / "checkpoints")  # nothing written locally

    lp.seed_everything(999)  # the resumed run must not depend on the fresh model's init
    resumed = Model()
    mc2 = FastPersistModelCheckpoint(dirpath=dirpath, save_top_k=2, monitor="loss", save_last=True,
                                     every_n_train_steps=1)
    t = trainer(tmp_path / "part", io, [mc2], max_epochs=3)
    t.fit(resumed, ckpt_path="last")
    assert t.ckpt_path == f"{dirpath}/last.ckpt"
    assert t.global_step == 24
    assert_same(full.state_dict(), resumed.state_dict(), "final weights")
    assert_same(t.optimizers[0].state_dict()["state"], full.trainer.optimizers[0].state_dict()["state"], "adam")
    assert len(keys(srv, bucket)) == 3 and staged_files(staging) == []
    # LightningModule.load_from_checkpoint streams it through fsspec (stock torch.load underneath)
    loaded = Model.load_from_checkpoint(mc2.last_model_path)
    assert_same(loaded.state_dict(), resumed.state_dict(), "load_from_checkpoint")


def test_version_counter_sees_pending_remote_saves(s3, staging, tmp_path, monkeypatch):
    """A fixed file name: the -v1 counter asks exists() while the last save still uploads (no
    placeholder on S3); FastPersistModelCheckpoint counts pending saves, so names match stock."""
    srv, bucket = s3

    class RecordingIO(TorchCheckpointIO):
        saved: list = []

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.saved.append(os.path.basename(path))
            super().save_checkpoint(checkpoint, path, storage_options)

    lp.seed_everything(7)
    mc = ModelCheckpoint(dirpath=tmp_path / "stock", filename="model", save_top_k=2, monitor="loss",
                         every_n_train_steps=1)
    trainer(tmp_path / "stock", RecordingIO(), [mc], max_epochs=1, limit_train_batches=5).fit(Model())
    stock = sorted(os.listdir(tmp_path / "stock"))

    slow_uploads(monkeypatch)
    lp.seed_everything(7)
    io = FastPersistIO()
    mc = FastPersistModelCheckpoint(dirpath=f"{bucket}/v", filename="model", save_top_k=2, monitor="loss",
                                    every_n_train_steps=1)
    trainer(tmp_path / "fp", io, [mc], max_epochs=1, limit_train_batches=5).fit(Model())
    # the same names, in the same order (a plain ModelCheckpoint overwrites model.ckpt at step 2)
    assert [st.path.rsplit("/", 1)[-1] for st in io.stats] == RecordingIO.saved
    assert [k.split("/")[-1] for k in keys(srv, bucket)] == stock
    assert "model-v1.ckpt" in stock


class StopServerAt(Callback):
    """Before the save of step ``step``: wait until the earlier checkpoints are uploaded, then
    take the store down (it stays down for the rest of the run)."""

    def __init__(self, srv: S3Server, io: FastPersistIO, step: int) -> None:
        self.srv, self.io, self.step = srv, io, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and self.srv.running:
            self.io.wait()
            self.srv.stop()


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_upload_failure_surfaces(s3, staging, tmp_path, fast_fail, on_error):
    """The server stops mid-run: fit fails with the upload error (or warns and trains on), no
    complete-looking object exists for a failed save, the local staging tier is empty."""
    srv, bucket = s3
    io = FastPersistIO(on_error=on_error, storage_options=srv.storage_options())
    # enable_version_counter=False: ModelCheckpoint itself does not ask the (dead) store anything,
    # so what fails is the plugin's upload
    mc = FastPersistModelCheckpoint(dirpath=f"{bucket}/f", save_top_k=-1, every_n_train_steps=1,
                                    enable_version_counter=False)
    t = trainer(tmp_path, io, [StopServerAt(srv, io, 3), mc], max_epochs=1)
    if on_error == "raise":
        with pytest.raises(fp_core.AsyncCheckpointError, match=r"s3://.*step=3\.ckpt") as ei:
            t.fit(Model())
        assert ei.value.__cause__ is not None
        assert t.global_step < 8
    else:
        with pytest.warns(FastPersistWarning, match="failed, training continues"):
            t.fit(Model())
        assert t.global_step == 8
    srv.start()
    assert keys(srv, bucket) == ["f/epoch=0-step=1.ckpt", "f/epoch=0-step=2.ckpt"]
    assert not remote.exists(f"{bucket}/f/epoch=0-step=3.ckpt", storage_options=srv.storage_options())
    assert [s.path.rsplit("/", 1)[-1] for s in io.stats] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert staged_files(staging) == []
    assert not io.pending()
