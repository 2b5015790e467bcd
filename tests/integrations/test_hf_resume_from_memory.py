"""The HF Trainer's resume from memory: ``FastPersistCallback(writer="process",
resume_from_memory=True)`` in a run SIGKILLed after a checkpoint, then
``trainer.train(resume_from_checkpoint=...)`` in a new process reads the checkpoint's files
from the images the orphaned writer left in shared memory, and resumes exactly as the
stock Trainer does from disk. The runs are in tests/helpers/hf_resume_from_memory.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
HELPERS = os.path.join(os.path.dirname(HERE), "helpers")
SCRIPT = os.path.join(HELPERS, "hf_resume_from_memory.py")
sys.path.insert(0, HELPERS)
sys.path.insert(0, HERE)

import fp_core  # noqa: E402

WRITTEN_BY_THE_WRITER = {"model.safetensors", "optimizer.pt", "scheduler.pt"}
SHARDS = {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}


def _start(args: list[str], shm: str) -> tuple[subprocess.Popen, Any]:
    env = dict(os.environ, FASTPERSIST_SHM_DIR=shm, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    err = tempfile.TemporaryFile()  # not a pipe: runs at once would block on a full one
    return subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.DEVNULL, stderr=err, env=env), err


def _finish(run: tuple[subprocess.Popen, Any], expect: int) -> None:
    p, err = run
    p.wait(timeout=300)
    err.seek(0)
    assert p.returncode == expect, err.read()[-3000:].decode(errors="replace")
    err.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs killed right after checkpoint-4's fence (its orphaned writer commits the
    files and then the directory), at once: ``on`` (resume_from_memory, one
    safetensors file), ``sharded`` (the same, the weights in three shards) and ``off``
    (without resume_from_memory, shared memory of its own). Each orphaned writer is gone
    before the checkpoints are resumed; then one process resumes ``on``'s checkpoint as
    stock, from memory, with damaged images and with none, and ``sharded``'s as stock,
    from memory, and from memory in a run that saves on. Yields ``{name: (run directory, shared-memory root)}``."""
    from process_writer_victim import wait_gone

    roots = {k: os.path.join("/dev/shm", "fp-hfm-" + uuid.uuid4().hex[:8]) for k in ("shared", "off")}
    for r in roots.values():
        os.mkdir(r)
    setup = {"on": ("on", roots["shared"]), "sharded": ("on", roots["shared"], "sharded"),
             "off": ("off", roots["off"])}
    out = {k: (str(tmp_path_factory.mktemp(k)), v[1]) for k, v in setup.items()}
    try:
        procs = {k: _start(["kill", out[k][0], v[0], *v[2:]], v[1]) for k, v in setup.items()}
        for p in procs.values():
            _finish(p, -signal.SIGKILL)
        for d, _ in out.values():
            with open(os.path.join(d, "writer.pid")) as f:
                assert wait_gone(int(f.read()), 60)  # the orphaned writer has left, images kept or not
            fp_core.verify(os.path.join(d, "checkpoint-4"))  # committed: the directory and its files
        _finish(_start(["resume", out["on"][0], "stock", "fp", "damage", "remove",
                        out["sharded"][0], "stock", "fp", "save"], roots["shared"]), 0)
        yield out
    finally:
        for r in roots.values():
            shutil.rmtree(r, ignore_errors=True)


def _report(d: str, step: str) -> tuple[dict, dict]:
    with open(os.path.join(d, f"{step}.json")) as f:
        report = json.load(f)
    return report, torch.load(os.path.join(d, f"{step}.pt"), weights_only=False)


def _same(a, b, where: str = "") -> None:
    """Bit-exact equality of two captured states (tensors: dtype, shape and every bit)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.numel() and a.dim() else a, b.view(torch.uint8)
                           if b.numel() and b.dim() else b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _resumed_as_stock(d: str, step: str) -> dict:
    """``step``'s resume equals the stock Trainer's resume from disk: right after the load
    (weights, optimizer, scheduler, global step, RNG) and after training on to step 8."""
    report, got = _report(d, step)
    _, want = _report(d, "stock")
    assert got["at_resume"]["global_step"] == 4 and got["end"]["global_step"] == 8
    _same(got["at_resume"], want["at_resume"], "at_resume")
    _same(got["end"], want["end"], "end")
    return report


def test_resume_reads_every_file_the_writer_wrote_from_its_image(runs):
    killed = runs["on"][0]
    report = _resumed_as_stock(killed, "fp")
    sizes = {n: os.path.getsize(os.path.join(killed, "checkpoint-4", n)) for n in WRITTEN_BY_THE_WRITER}
    assert report["memory"]["files"] == sizes  # weights, optimizer and scheduler: from memory
    assert report["hits"] == len(WRITTEN_BY_THE_WRITER)
    # checked as they were read from memory, not read from disk for the check before
    assert report["memory"]["left_to_images"] == sorted(WRITTEN_BY_THE_WRITER)
    assert report["memory"]["unverified"] == []
    assert report["warnings"] == []


def test_sharded_weights_are_read_from_their_images(runs):
    report = _resumed_as_stock(runs["sharded"][0], "fp")
    assert set(report["memory"]["files"]) == SHARDS | {"optimizer.pt", "scheduler.pt"}
    assert set(report["memory"]["left_to_images"]) == set(report["memory"]["files"])
    assert report["hits"] == 5 and report["warnings"] == []


def test_a_run_resumed_from_memory_that_saves_on_leaves_no_image_at_its_end(runs):
    report = _resumed_as_stock(runs["sharded"][0], "save")
    assert report["hits"] == 5
    # the killed runs' images it read, and its own arenas, are gone with its clean end
    assert report["left"] == []


def test_a_damaged_image_is_refused_and_the_disk_read(runs):
    report = _resumed_as_stock(runs["on"][0], "damage")
    assert set(report["damaged"]) == WRITTEN_BY_THE_WRITER  # a byte of each image flipped
    assert report["hits"] == 0 and report["memory"]["files"] == {}
    # found before the resume, so not checked on disk then: each checked before its disk read
    assert report["memory"]["left_to_images"] == sorted(WRITTEN_BY_THE_WRITER)
    assert report["memory"]["unverified"] == []
    assert len(report["warnings"]) == len(WRITTEN_BY_THE_WRITER)
    for name in WRITTEN_BY_THE_WRITER:  # each one named, with its checksum failure
        [w] = [w for w in report["warnings"] if f"checkpoint-4/{name} failed" in w]
        assert "CorruptCheckpointError" in w and "loading from disk" in w


def test_without_an_image_the_disk_is_read(runs):
    report = _resumed_as_stock(runs["on"][0], "remove")
    assert len(report["removed"]) == len(WRITTEN_BY_THE_WRITER)
    assert report["hits"] == 0 and report["memory"]["files"] == {} and report["warnings"] == []
    assert report["memory"]["left_to_images"] == []  # the whole directory checked on disk first


def test_without_resume_from_memory_no_image_is_left(runs):
    d, shm = runs["off"]
    assert os.listdir(os.path.join(shm, f"fastpersist-{os.geteuid()}")) == []  # the writer kept nothing
    # so the resume reads the disk: test_without_an_image_the_disk_is_read
    assert {n for n in os.listdir(os.path.join(d, "checkpoint-4"))} >= WRITTEN_BY_THE_WRITER


def test_the_reads_are_redirected_only_within_the_resume(tmp_path, shm_root):
    import safetensors.torch as st_torch
    import transformers.trainer_utils as tu

    from fp_integrations.hf_resume import _reads_from_memory

    stock = (torch.load, st_torch.load_file, tu.safe_load_file)
    other = tmp_path / "elsewhere.pt"
    torch.save({"x": torch.arange(3)}, other)
    (tmp_path / "checkpoint-1").mkdir()
    fp_core.save({"y": torch.ones(2)}, tmp_path / "checkpoint-1" / "optimizer.pt")
    st_torch.save_file({"z": torch.zeros(2)}, tmp_path / "checkpoint-1" / "model.safetensors")
    read: dict = {}
    with pytest.raises(RuntimeError, match="inside"):
        with _reads_from_memory(str(tmp_path / "checkpoint-1"), read):
            assert torch.load is not stock[0] and st_torch.load_file is not stock[1]
            assert tu.safe_load_file is st_torch.load_file
            # a file outside the checkpoint directory, and files in it without an image:
            # the stock reads themselves
            assert torch.equal(torch.load(other, weights_only=True)["x"], torch.arange(3))
            assert torch.equal(torch.load(tmp_path / "checkpoint-1" / "optimizer.pt", weights_only=True)["y"],
                               torch.ones(2))
            assert torch.equal(st_torch.load_file(tmp_path / "checkpoint-1" / "model.safetensors")["z"],
                               torch.zeros(2))
            raise RuntimeError("inside")
    assert (torch.load, st_torch.load_file, tu.safe_load_file) == stock  # restored, also on an error
    assert read == {}
