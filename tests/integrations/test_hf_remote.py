"""FastPersistCallback(remote_dir=...) against a real S3 server on loopback (moto's server
mode, tests/helpers/s3_server.py): upload + remote rotation, resume from the store, failures."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from conftest import HELPERS  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from fp_core import AsyncCheckpointError, remote  # noqa: E402
from fp_integrations.hf import download_checkpoint, remote_checkpoints  # noqa: E402

sys.path.insert(0, HELPERS)
from s3_server import S3Server  # noqa: E402
from test_hf import CKPT_FILES, StopAt, checkpoints, make_trainer, no_staging, optim_equal, state_equal  # noqa: E402


def names(urls):
    return [u.rstrip("/").rsplit("/", 1)[-1] for u in urls]


def keys(srv, bucket):
    resp = srv.boto3_client().list_objects_v2(Bucket=bucket[len("s3://"):])
    return sorted(o["Key"] for o in resp.get("Contents", []))


def test_remote_rotation_download_and_resume(s3, staging, tmp_path):
    srv, bucket, opts = s3
    run = f"{bucket}/run"
    remote_kw = {"remote_dir": run, "storage_options": opts}

    # straight 8 steps, a checkpoint every 2, save_total_limit=2; keep_local=True: local as stock
    straight, cb = make_trainer(tmp_path / "straight", fp=True, max_steps=8, save_steps=2, save_total_limit=2,
                                cb_kwargs={**remote_kw, "keep_local": True})
    straight.train()
    assert [(r.ok, r.uploaded) for r in cb.records] == [(True, True)] * 4
    assert names(remote_checkpoints(run, storage_options=opts)) == ["checkpoint-6", "checkpoint-8"]
    assert {k.split("/")[1] for k in keys(srv, bucket)} == {"checkpoint-6", "checkpoint-8"}  # rotated out: gone
    assert checkpoints(tmp_path / "straight") == ["checkpoint-6", "checkpoint-8"]
    assert no_staging(tmp_path / "straight")

    # the same run again into a fresh prefix, stopped after step 4 (keep_local=False: nothing local stays)
    run2 = f"{bucket}/run2"
    first, cb = make_trainer(tmp_path / "first", fp=True, max_steps=8, save_steps=2, save_total_limit=2,
                             callbacks=[StopAt(4)], cb_kwargs={"remote_dir": run2, "storage_options": opts})
    first.train()
    assert names(remote_checkpoints(run2, storage_options=opts)) == ["checkpoint-2", "checkpoint-4"]
    assert checkpoints(tmp_path / "first") == [] and no_staging(tmp_path / "first")
    # a newer checkpoint whose upload never finished (files, no marker) is not picked
    fs, rp = remote.filesystem(f"{run2}/checkpoint-6", opts)
    fs.pipe_file(rp + "/model.safetensors", b"torn")

    local = download_checkpoint(run2, storage_options=opts, local_dir=tmp_path / "dl")
    assert local == str(tmp_path / "dl" / "checkpoint-4")
    assert CKPT_FILES <= set(os.listdir(local))
    assert download_checkpoint(run2, storage_options=opts) != local  # default: the staging cache
    assert download_checkpoint(f"{bucket}/empty", storage_options=opts, missing_ok=True) is None
    with pytest.raises(FileNotFoundError):
        download_checkpoint(f"{bucket}/empty", storage_options=opts)

    second, cb = make_trainer(tmp_path / "second", fp=True, max_steps=8, save_steps=2, save_total_limit=2,
                              cb_kwargs={"remote_dir": run2, "storage_options": opts})
    second.train(resume_from_checkpoint=local)
    assert second.state.global_step == 8
    state_equal(second.model.state_dict(), straight.model.state_dict())
    optim_equal(second.optimizer.state_dict(), straight.optimizer.state_dict())
    assert names(remote_checkpoints(run2, storage_options=opts)) == ["checkpoint-6", "checkpoint-8"]
    assert [r.uploaded for r in cb.records] == [True, True]
    assert not os.listdir(os.path.join(staging, "pending"))


class StopServer(TrainerCallback):
    """At the end of step ``step`` (before its save): wait until earlier checkpoints are
    uploaded, then take the store down for the rest of the run."""

    def __init__(self, srv: S3Server, step: int) -> None:
        self.srv, self.step, self.fp = srv, step, None

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step and self.srv.running:
            self.fp.wait()
            self.srv.stop()


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_upload_failure_surfaces(s3, staging, tmp_path, fast_fail, on_error):
    srv, bucket, opts = s3
    run = f"{bucket}/run"
    stop = StopServer(srv, 4)
    t, cb = make_trainer(tmp_path / "out", fp=True, max_steps=6, save_steps=2, callbacks=[stop],
                         cb_kwargs={"remote_dir": run, "storage_options": opts, "on_error": on_error})
    stop.fp = cb
    if on_error == "raise":
        with pytest.raises(AsyncCheckpointError, match="upload checkpoint-4") as ei:
            t.train()
        assert ei.value.__cause__ is not None
    else:
        with pytest.warns(UserWarning, match="FastPersist.*upload checkpoint-4"):
            t.train()
        assert t.state.global_step == 6
    cb.wait()
    srv.start()
    assert names(remote_checkpoints(run, storage_options=opts)) == ["checkpoint-2"]
    assert not remote.is_complete(f"{run}/checkpoint-4", storage_options=opts)
    rec = {r.step: r for r in cb.records}
    assert rec[2].uploaded is True and rec[4].uploaded is False and rec[4].ok is True
    # the local copy of a checkpoint that did not reach the store is kept; staging is clean
    out = tmp_path / "out"
    assert "checkpoint-4" in checkpoints(out) and "checkpoint-2" not in checkpoints(out)
    assert no_staging(out) and not os.listdir(os.path.join(staging, "pending"))
    assert download_checkpoint(run, storage_options=opts).endswith("checkpoint-2")
