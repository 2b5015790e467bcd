"""The HF Trainer with FSDP2 and FULL_STATE_DICT, with FastPersistCallback, on 2 CPU
processes (issue #39 item 6): checkpoints and ``save_model()`` hold stock's files, keys and
tensors (``model.safetensors`` + config, ``pytorch_model_fsdp.bin``, ``optimizer.bin``), every
rank writing its own rows of each, with no gather; ``from_pretrained`` on one process, the
callback's and the stock Trainer's resume on 2 and on 1 process(es) read them; a rank failing
mid-save leaves the previous checkpoint-N as it was.

accelerate turns FSDP on only for GPU-like distributed types, so the helper
(tests/helpers/hf_fsdp_full.py) forces its state to MULTI_GPU; FSDP2 runs on the CPU over gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HELPERS, free_port

pytest.importorskip("accelerate")

ST_FILES = ["config.json", "generation_config.json", "model.safetensors", "training_args.bin"]
TIED = {"lm_head.weight": "transformer.wte.weight"}  # GPT-2's output embedding: {tied: source}
CKPT_FILES = ST_FILES + ["optimizer.bin", "pytorch_model_fsdp.bin", "scheduler.pt", "trainer_state.json"]


def _torchrun(d: str, world: int, phases: str) -> None:
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                        "--master-port", free_port(), os.path.join(HELPERS, "hf_fsdp_full.py"), d, phases],
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("hf_fsdp_full"))
    _torchrun(d, 2, "stock,fp,fp_resume,stock_resume,stock_resume_stock,fp_resume_stock,fail,fail_model,fail_pretrained,stock_only_model,fp_only_model")
    _torchrun(d, 1, "fp_resume,stock_resume,stock_resume_stock,fp_resume_stock")
    return d


def _res(d: str, name: str) -> dict:
    with open(os.path.join(d, name + ".json")) as f:
        return json.load(f)


def _safetensors(path: str) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k}"


def _groups(groups: list) -> list:
    # the stock resume (accelerate's load_fsdp_optimizer) turns Adam's ``betas`` tuple into a
    # list; an uninterrupted run, and a resume through the callback, keep the tuple
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def _assert_same_optimizer(a: dict, b: dict, what: str) -> None:
    assert _groups(a["param_groups"]) == _groups(b["param_groups"]), what
    assert list(a["state"]) == list(b["state"]), what
    for k in a["state"]:
        _assert_same_tensors(a["state"][k], b["state"][k], f"{what}: {k}")


def _load(path: str) -> dict:
    return torch.load(path, weights_only=True)


def _assert_checkpoint_equal(ours: str, stock: str) -> None:
    """Our checkpoint-N holds stock's files, keys and tensors; its safetensors header holds
    stock's metadata (and FastPersist's checksums beside it)."""
    meta, tensors = _safetensors(os.path.join(ours, "model.safetensors"))
    stock_meta, stock_tensors = _safetensors(os.path.join(stock, "model.safetensors"))
    assert stock_meta == {"format": "pt"} and {k: meta[k] for k in stock_meta} == stock_meta, meta
    # save_pretrained drops the tied output embedding (it shares the input embedding's
    # memory); stock's gather on 2 ranks gives it memory of its own, so its file keeps it
    for tied, source in TIED.items():
        if tied in stock_tensors and tied not in tensors:
            assert torch.equal(stock_tensors.pop(tied), tensors[source]), tied
    _assert_same_tensors(tensors, stock_tensors, ours)
    if os.path.exists(os.path.join(stock, "optimizer.bin")):
        _assert_same_tensors(_load(os.path.join(ours, "pytorch_model_fsdp.bin")),
                             _load(os.path.join(stock, "pytorch_model_fsdp.bin")), ours)
        _assert_same_optimizer(_load(os.path.join(ours, "optimizer.bin")),
                               _load(os.path.join(stock, "optimizer.bin")), ours)
    with open(os.path.join(ours, "config.json")) as f, open(os.path.join(stock, "config.json")) as g:
        assert json.load(f) == json.load(g)


def test_checkpoints_and_save_model_hold_stocks_files_written_without_a_gather(runs):
    from fp_integrations.hf import verify_checkpoint_dir

    fp, stock = _res(runs, "fp"), _res(runs, "stock")
    assert fp["saves"] == [[2, True, None], [4, True, None]]
    assert fp["losses"] == stock["losses"] and len(fp["losses"]) == 4
    rng = ["rng_state_0.pth", "rng_state_1.pth"]
    for step in (2, 4):
        name = f"checkpoint-{step}"
        assert stock["listing"][name] == sorted(CKPT_FILES + rng)
        assert fp["listing"][name] == sorted([".fastpersist-dir.json"] + CKPT_FILES + rng)
        _assert_checkpoint_equal(os.path.join(runs, "fp", name), os.path.join(runs, "stock", name))
        # every file carries FastPersist's checksums or is listed and checked for what it is
        assert verify_checkpoint_dir(os.path.join(runs, "fp", name)) >= 3
    assert fp["listing"]["final"] == stock["listing"]["final"] == ST_FILES
    _assert_checkpoint_equal(os.path.join(runs, "fp", "final"), os.path.join(runs, "stock", "final"))
    # the stock saves gather every DTensor to rank 0; ours gather none
    assert stock["gathers"] > 0 and fp["gathers"] == 0


def test_save_only_model_writes_what_stock_writes(runs):
    """save_only_model: stock writes no optimizer, and no pytorch_model_fsdp.bin (it goes with
    the optimizer); neither do we."""
    fp, stock = _res(runs, "fp_only_model"), _res(runs, "stock_only_model")
    assert fp["saves"] == [[2, True, None], [4, True, None]] and fp["gathers"] == 0
    for name in ("checkpoint-2", "checkpoint-4"):
        assert stock["listing"][name] == sorted(ST_FILES + ["trainer_state.json"])
        assert fp["listing"][name] == sorted([".fastpersist-dir.json"] + stock["listing"][name])
        _assert_checkpoint_equal(os.path.join(runs, "fp_only_model", name), os.path.join(runs, "stock_only_model", name))


@pytest.mark.parametrize("sub", ["checkpoint-2", "checkpoint-4", "final"])
def test_from_pretrained_on_one_process_reads_the_stock_gathers_model(runs, sub):
    from transformers import GPT2LMHeadModel

    ours = GPT2LMHeadModel.from_pretrained(os.path.join(runs, "fp", sub))
    stock = GPT2LMHeadModel.from_pretrained(os.path.join(runs, "stock", sub))
    _assert_same_tensors(ours.state_dict(), stock.state_dict(), sub)
    # the tied output embedding is tied again on load, as with stock's file
    assert ours.lm_head.weight.data_ptr() == ours.transformer.wte.weight.data_ptr()
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(x).logits, stock(x).logits)


def _state_bytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


@pytest.mark.parametrize("world", [2, 1])
def test_resume_on_2_and_1_processes_continues_as_stock_resume(runs, world):
    """Resuming from our checkpoint-2 through the callback (which verifies it, then reads
    each rank's rows) and through the stock Trainer, and through the callback from stock's
    checkpoint-2, continues bit-equal to the stock Trainer resumed from stock's checkpoint-2:
    the same losses and the same checkpoint-4 (weights and optimizer)."""
    tag = "" if world == 2 else f".w{world}"
    base = _res(runs, "stock_resume_stock" + tag)
    for phase in ("fp_resume", "stock_resume", "fp_resume_stock"):
        got = _res(runs, phase + tag)
        assert got["losses"] == base["losses"] and len(got["losses"]) == 4, phase
        ours = os.path.join(runs, phase + tag, "checkpoint-4")
        _assert_checkpoint_equal(ours, os.path.join(runs, "stock_resume_stock" + tag, "checkpoint-4"))
    if world == 2:  # on 2 processes, resuming repeats the uninterrupted run
        assert base["losses"] == _res(runs, "stock")["losses"]
    # the callback filled the model and optimizer from the files by rows: rank 0 read its
    # share of them (on 1 process: all of it), never the whole file through torch's loader
    ckpt = os.path.join(runs, "stock", "checkpoint-2")
    full = {"model": _state_bytes(_load(os.path.join(ckpt, "pytorch_model_fsdp.bin"))),
            "optimizer": _state_bytes(_load(os.path.join(ckpt, "optimizer.bin")))}
    for phase in ("fp_resume", "fp_resume_stock"):
        got = _res(runs, phase + tag)
        assert got["saves"] == ([[4, True, None]]), phase
        for what, n in full.items():
            st = got["load_stats"][what]
            assert not st["whole_file"], (phase, what)
            if world == 1:
                assert st["tensor_bytes"] == n, (phase, what)
            else:  # half the rows, and the step counters every rank holds
                assert n // 3 < st["tensor_bytes"] < 2 * n // 3, (phase, what, st, n)


@pytest.mark.parametrize("phase,error", [
    ("fail", ["injected write failure on rank 1", "optimizer.bin"]),
    ("fail_model", ["injected write failure on rank 0", "model.safetensors"]),
    ("fail_pretrained", ["injected save_pretrained failure"])])
def test_a_rank_failing_mid_save_leaves_the_previous_checkpoint_intact(runs, phase, error):
    """One rank's part of the step-4 checkpoint fails (its write of the last file, after the
    model files are written; of the first; the saving rank's save_pretrained, which the
    others wait for): no checkpoint-4 appears, and no rank hangs."""
    from fp_integrations.hf import verify_checkpoint_dir

    res = _res(runs, phase)
    (step2, ok2, err2), (step4, ok4, err4) = res["saves"]
    assert (step2, ok2, err2) == (2, True, None)
    assert (step4, ok4) == (4, False) and all(e in err4 for e in error), err4
    # no checkpoint-4, no staging directory left, checkpoint-2 whole and equal to the run's
    # that did not fail
    assert res["listing"][""] == ["checkpoint-2"]
    ckpt2 = os.path.join(runs, phase, "checkpoint-2")
    assert verify_checkpoint_dir(ckpt2) >= 3
    _assert_checkpoint_equal(ckpt2, os.path.join(runs, "stock", "checkpoint-2"))
    assert res["losses"] == _res(runs, "stock")["losses"]  # training went on (on_error="warn")
