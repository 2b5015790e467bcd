"""``Trainer(plugins=[FastPersistIO()])`` alone with Lightning's
``FSDPStrategy(state_dict_type="full")`` (FSDP1) on 2 CPU processes over gloo, side by side
with stock Lightning running the same script (tests/helpers/lightning_fsdp1_full.py):
every rank writes its own flat-param ranges of the one .ckpt file, which holds what stock's
gather to rank 0 writes (plain ``torch.load`` reads it, stock resumes from it), with no
gather; ``ckpt_path`` resumes exactly on 2 processes and on 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HELPERS, assert_identical, free_port

import fp_core

pytest.importorskip("lightning")

# Collectives that move tensor data between ranks the way a gather does.
GATHERS = {"all_gather", "all_gather_into_tensor", "_all_gather_base", "gather", "reduce_scatter",
           "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "send", "recv", "isend", "irecv"}


def _launch(d, runs: list[tuple[str, str]], nproc: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           free_port(), os.path.join(HELPERS, "lightning_fsdp1_full.py")]
    for mode, phase in runs:
        cmd += [str(d), mode, phase]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches: on 2 processes, fit (ours, stock), resume each from its own last.ckpt,
    stock restoring ours, and a fit the route does not apply to; then on 1 process, resume
    each from the 2-process file."""
    d = tmp_path_factory.mktemp("fsdp1_full")
    _launch(d, [("fastpersist", "fit"), ("stock", "fit"), ("fastpersist", "resume"), ("stock", "resume"),
                ("stock", "stockreads"), ("fallback", "fit")], 2)
    _launch(d, [("fastpersist", "resume"), ("stock", "resume")], 1)
    return d


def _info(d, mode: str, phase: str, world: int) -> list[dict]:
    return [json.loads((d / f"{mode}-{phase}-{world}-{r}.json").read_text()) for r in range(world)]


def _records(d, mode: str, phase: str, world: int) -> dict:
    return torch.load(d / f"{mode}-{phase}-{world}-0.pt")


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _stock_named(x):
    """``x`` with the run's directory name in its strings (ModelCheckpoint's paths) as stock's."""
    if isinstance(x, str):
        return x.replace("fastpersist", "stock")
    if isinstance(x, dict):
        return type(x)((k, _stock_named(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_stock_named(v) for v in x)
    return x


def _assert_same_files(ours, stock):
    names = sorted(os.listdir(ours))
    assert names == sorted(os.listdir(stock)), (names, sorted(os.listdir(stock)))
    for name in names:
        assert fp_core.verify(str(ours / name))["bytes"] > 0  # FastPersist's, checksummed
        mine, theirs = torch.load(ours / name, weights_only=True), torch.load(stock / name, weights_only=True)
        assert_identical(_stock_named(mine), theirs, name)
        # the modules' versions, which load_state_dict hands to the modules' loaders
        assert mine["state_dict"]._metadata == theirs["state_dict"]._metadata, name
    return names


def test_plugin_alone_every_rank_writes_the_file_stock_writes(runs):
    fp = _info(runs, "fastpersist", "fit", 2)
    # routed by the plugin alone, the flat-shard route taken (no reason to gather), every save
    # of every rank through the plugin
    assert all(r["routed"] and r["why"] is None for r in fp), fp
    assert [r["stats"] for r in fp] == [["sstep=2.ckpt", "last.ckpt", "sstep=4.ckpt", "last.ckpt"]] * 2
    names = _assert_same_files(runs / "ckpts-fastpersist", runs / "ckpts-stock")
    assert names == ["last.ckpt", "sstep=2.ckpt", "sstep=4.ckpt"]
    last = torch.load(runs / "ckpts-fastpersist" / "last.ckpt", weights_only=True)
    # stock's keys: the model's names, the optimizer state keyed by parameter id
    assert list(last["state_dict"]) == ["seen", "net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias",
                                        "net.4.weight", "net.4.bias"]
    assert sorted(last["optimizer_states"][0]["state"]) == list(range(6))
    at4 = _records(runs, "fastpersist", "fit", 2)["at_4"]
    assert torch.equal(last["state_dict"]["net.2.weight"], at4["w.net.2.weight"])
    assert torch.equal(last["optimizer_states"][0]["state"][2]["exp_avg"], at4["adam.net.2.weight.exp_avg"])


def test_no_rank_gathers_the_state(runs):
    def gathered(info: list[dict]) -> list:
        return [c for r in info for c in r["tensor_collectives"] if c[0] in GATHERS]

    for phase in ("fit", "resume"):
        ours = _info(runs, "fastpersist", phase, 2)
        assert not gathered(ours), gathered(ours)
        # what does carry a tensor: Lightning's scalar decisions and rank 0's loops and
        # callbacks sent to every rank (their layout must agree), each a few KiB at most
        assert all(size < 8 << 10 for r in ours for _, _, size in r["tensor_collectives"]), ours
        # the check sees a gather where there is one: stock's FULL_STATE_DICT
        stock = gathered(_info(runs, "stock", phase, 2))
        assert stock and max(size for _, _, size in stock) > 100_000, stock


@pytest.mark.parametrize("world", [2, 1])
def test_resume_on_two_and_one_process_is_exact(runs, world):
    at4 = _records(runs, "fastpersist", "fit", 2)["at_4"]
    ours, stock = _records(runs, "fastpersist", "resume", world), _records(runs, "stock", "resume", world)
    # restored: weights, Adam state and the scheduler's lr, bit for bit, as stock restores them
    assert _same(ours["restored"], at4) and _same(stock["restored"], at4)
    assert _same(ours["at_6"], stock["at_6"])  # and the steps after it end where stock's end
    assert all(r["routed"] and r["why"] is None for r in _info(runs, "fastpersist", "resume", world))
    # the files written after the resume (every rank's ranges; on 1 process, all of them)
    # are stock's too
    _assert_same_files(runs / f"ckpts-fastpersist-resume{world}", runs / f"ckpts-stock-resume{world}")


def test_stock_lightning_resumes_from_our_file(runs):
    at4 = _records(runs, "fastpersist", "fit", 2)["at_4"]
    assert _same(_records(runs, "stock", "stockreads", 2)["restored"], at4)


def test_where_the_route_cannot_apply_stock_gathers_and_says_why(runs):
    info = _info(runs, "fallback", "fit", 2)
    why = "sharding strategy NO_SHARD (every rank holds every parameter)"
    assert all(r["routed"] and r["why"] == why for r in info), info
    # said once, by rank 0; stock's gather, then rank 0 hands the file to the plugin alone
    assert len(info[0]["logged"]) == 1 and why in info[0]["logged"][0] and not info[1]["logged"]
    assert info[0]["stats"] == ["sstep=2.ckpt", "last.ckpt", "sstep=4.ckpt", "last.ckpt"] and info[1]["stats"] == []
    last = runs / "ckpts-fallback" / "last.ckpt"
    assert fp_core.verify(str(last))["bytes"] > 0
    full = torch.load(last, weights_only=True)
    assert list(full["state_dict"])[1:] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias",
                                            "net.4.weight", "net.4.bias"]
    assert sorted(full["optimizer_states"][0]["state"]) == list(range(6))
