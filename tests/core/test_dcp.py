"""Sharded checkpoints through torch.distributed.checkpoint on the native engine
(fp_core.parallel.dcp.FastPersistWriter / FastPersistReader)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import HELPERS, REPO, flip_byte, free_port, run_ranks

import fp_core
from fp_core.errors import CorruptCheckpointError
from fp_core.parallel.dcp import FastPersistReader, FastPersistWriter, staging_path

warnings.filterwarnings("ignore", message=".*torch.distributed.*")


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 200, generator=g), "b": torch.randn(200, generator=g),
                      "half": torch.randn(33, generator=g).half(), "view": (torch.arange(1000) + seed)[100:160]},
            "step": seed, "name": "run"}


def blank() -> dict:
    return {"model": {"w": torch.zeros(300, 200), "b": torch.zeros(200), "half": torch.zeros(33).half(),
                      "view": torch.zeros(60, dtype=torch.int64)}, "step": -1, "name": ""}


def failure(ei) -> BaseException:
    """The exception a rank raised, out of DCP's CheckpointException (one process: rank 0)."""
    from torch.distributed.checkpoint.api import CheckpointException

    assert isinstance(ei.value, CheckpointException), ei.value
    err = ei.value.failures[0]
    return err[0] if isinstance(err, tuple) else err


def assert_state(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["step"] == want["step"] and got["name"] == want["name"]


def test_round_trip_through_our_reader_and_stocks(tmp_path):
    d = str(tmp_path / "ckpt")
    dcp.save(state(1), storage_writer=FastPersistWriter(d))
    assert sorted(os.listdir(d)) == [".fastpersist-dcp.json", ".metadata", "__0_0.distcp",
                                     "__0_0.distcp.fastpersist.json"]
    assert not os.path.exists(staging_path(d)) and sorted(os.listdir(tmp_path)) == ["ckpt"]
    for reader in (FastPersistReader(d), FastPersistReader(d, verify=True), None):
        got = blank()
        dcp.load(got, checkpoint_id=d) if reader is None else dcp.load(got, storage_reader=reader)
        assert_state(got, state(1))
    report = fp_core.verify(d)
    assert report["files"] == 1 and report["records"] == 6


def test_a_directory_written_by_stock_dcp_loads_through_our_reader(tmp_path):
    d = str(tmp_path / "stock")
    dcp.save(state(2), checkpoint_id=d)
    got = blank()
    dcp.load(got, storage_reader=FastPersistReader(d))
    assert_state(got, state(2))


def test_a_stock_directory_loads_through_a_verifying_reader_with_a_warning(tmp_path):
    """Stock FileSystemWriter output has no checksums: verify=True loads it and warns, naming
    the directory, that nothing was checked; it is never called corrupt."""
    d = str(tmp_path / "stock")
    dcp.save(state(3), checkpoint_id=d)
    got = blank()
    with pytest.warns(UserWarning, match=f"{d} was written by stock .*carries no checksums"):
        dcp.load(got, storage_reader=FastPersistReader(d, verify=True))
    assert_state(got, state(3))


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    d = str(tmp_path / "ckpt")
    dcp.save(state(1), storage_writer=FastPersistWriter(d))
    dcp.save(state(2), storage_writer=FastPersistWriter(d))
    got = blank()
    dcp.load(got, checkpoint_id=d)
    assert_state(got, state(2))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("after", [0, 64 << 10])
def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, fault, after):
    d = str(tmp_path / "ckpt")
    dcp.save(state(1), storage_writer=FastPersistWriter(d))
    before = sorted(os.listdir(d))
    fault("write", errno=5, after_bytes=after)
    with pytest.raises(BaseException) as ei:  # DCP raises CheckpointException, a BaseException
        dcp.save(state(2), storage_writer=FastPersistWriter(d))
    err = failure(ei)
    assert isinstance(err, OSError) and err.errno == 5, err
    assert sorted(os.listdir(d)) == before
    got = blank()
    dcp.load(got, storage_reader=FastPersistReader(d, verify=True))
    assert_state(got, state(1))
    fp_core.verify(d)


def test_a_damaged_item_is_found_and_named(tmp_path):
    from fp_core.tools import cli

    d = str(tmp_path / "ckpt")
    dcp.save(state(3), storage_writer=FastPersistWriter(d))
    item = next(r for r in fp_core.inspect(d) if r["tensor"] == "model.w")
    path = os.path.join(d, "__0_0.distcp")
    flip_byte(path, item["offset"] + item["size"] - 100, 0x10)
    with pytest.raises(CorruptCheckpointError, match="model.w") as ei:
        fp_core.verify(d)
    assert ei.value.path == path
    with pytest.raises(BaseException) as ei:  # DCP raises CheckpointException, a BaseException
        dcp.load(blank(), storage_reader=FastPersistReader(d, verify=True))
    err = failure(ei)
    assert isinstance(err, CorruptCheckpointError) and err.tensor == "model.w" and err.path == path
    assert cli.main(["verify", d]) == 1


def test_a_damaged_or_swapped_metadata_is_named(tmp_path):
    """.metadata decides where every read looks. Verified, it is checked against the
    directory manifest's CRC before it is unpickled: another save's .metadata (a valid
    pickle) is refused. Unverified, one that does not unpickle is named as damaged (inside
    DCP's own error, which reports what read_metadata raised), not a bare pickle error."""
    import shutil

    d, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    dcp.save(state(3), storage_writer=FastPersistWriter(d))
    dcp.save({"model": {"w": torch.ones(7)}}, storage_writer=FastPersistWriter(other))
    meta = os.path.join(d, ".metadata")
    good = open(meta, "rb").read()
    shutil.copyfile(os.path.join(other, ".metadata"), meta)
    with pytest.raises(BaseException) as ei:
        dcp.load(blank(), storage_reader=FastPersistReader(d, verify=True))
    assert f"corrupt checkpoint {meta}" in str(ei.value) and "CRC-32C" in str(ei.value)
    open(meta, "wb").write(good[:len(good) // 2])
    with pytest.raises(BaseException) as ei:
        dcp.load(blank(), storage_reader=FastPersistReader(d))
    assert f"corrupt checkpoint {meta}" in str(ei.value)
    open(meta, "wb").write(good)
    got = blank()
    dcp.load(got, storage_reader=FastPersistReader(d, verify=True))
    assert_state(got, state(3))


@pytest.mark.parametrize("edit", ["not json", "offset past the end", "overlap", "crc not hex", "data outside its item",
                                  "data size not the shape's", "dtype not a dtype", "dtype a torch submodule",
                                  "negative shape"])
def test_a_crafted_manifest_is_a_corrupt_checkpoint(tmp_path, edit):
    d = str(tmp_path / "ckpt")
    dcp.save(state(4), storage_writer=FastPersistWriter(d))
    mpath = os.path.join(d, "__0_0.distcp.fastpersist.json")
    doc = json.loads(open(mpath).read())
    if edit == "not json":
        raw = b"\xff{"
    else:
        if edit == "offset past the end":
            doc["items"][0]["offset"] = 10**15
        elif edit == "overlap":
            doc["items"][1]["offset"] = doc["items"][0]["offset"]
        elif edit == "crc not hex":
            doc["items"][0]["crc32c"] = "zz"
        else:
            t = next(it for it in doc["items"] if it["kind"] == "tensor" and it["shape"])
            if edit == "data outside its item":
                t["data"][0] = t["offset"] + t["length"]
            elif edit == "data size not the shape's":
                t["data"][1] += 4
            elif edit == "dtype not a dtype":
                t["dtype"] = "__class__"
            elif edit == "dtype a torch submodule":
                t["dtype"] = "onnx"  # looked up in a table, never imported by name
            else:
                t["shape"][0] = -1
        raw = json.dumps(doc).encode()
    open(mpath, "wb").write(raw)
    with pytest.raises(CorruptCheckpointError):
        fp_core.verify(d)
    with pytest.raises(BaseException) as ei:  # the reader parses the manifest too (read straight into targets)
        dcp.load(blank(), storage_reader=FastPersistReader(d))
    assert isinstance(failure(ei), CorruptCheckpointError)


def test_a_damaged_tensor_byte_is_found_when_read_straight_into_its_target(tmp_path):
    d = str(tmp_path / "ckpt")
    dcp.save(state(5), storage_writer=FastPersistWriter(d))
    doc = json.loads(open(os.path.join(d, "__0_0.distcp.fastpersist.json")).read())
    w = next(it for it in doc["items"] if it["fqn"] == "model.w")
    assert w["dtype"] == "float32" and w["shape"] == [300, 200] and w["data"][1] == 300 * 200 * 4
    got = blank()
    dcp.load(got, storage_reader=FastPersistReader(d, verify=True))  # intact: loads, equal
    assert_state(got, state(5))
    flip_byte(os.path.join(d, "__0_0.distcp"), w["data"][0] + 1000, 4)
    with pytest.raises(BaseException) as ei:
        dcp.load(blank(), storage_reader=FastPersistReader(d, verify=True))
    err = failure(ei)
    assert isinstance(err, CorruptCheckpointError) and err.tensor == "model.w"
    got = blank()
    dcp.load(got, storage_reader=FastPersistReader(d))  # unverified: the damaged byte arrives as is
    assert not torch.equal(got["model"]["w"], state(5)["model"]["w"])


def test_async_save_with_our_writer_keeps_the_state_at_save(tmp_path):
    d = str(tmp_path / "ckpt")
    s = state(5)
    fut = dcp.async_save(s, storage_writer=FastPersistWriter(d))
    s["model"]["w"].add_(1.0)  # training goes on; the checkpoint holds the values at async_save
    fut.result()
    got = blank()
    dcp.load(got, storage_reader=FastPersistReader(d, verify=True))
    assert_state(got, state(5))


def test_inspect_lists_every_item(tmp_path):
    d = str(tmp_path / "ckpt")
    dcp.save(state(6), storage_writer=FastPersistWriter(d))
    rows = fp_core.inspect(d)
    assert {r["tensor"] for r in rows} == {"model.w", "model.b", "model.half", "model.view", "step", "name"}
    assert all(r["name"].startswith("__0_0.distcp:") for r in rows)


def test_two_ranks_fsdp2_on_cpu(tmp_path):
    """FSDP2 (fully_shard) over gloo: each rank writes its shards; FastPersistReader (verifying)
    and stock DCP load them back into another sharded model."""
    res = run_ranks("dcp_fsdp2.py", tmp_path, timeout=240)
    assert res["loaded_equal"] == {"fastpersist": True, "stock": True}
    assert res["files"] == [".fastpersist-dcp.json", ".metadata", "__0_0.distcp", "__0_0.distcp.fastpersist.json",
                            "__1_0.distcp", "__1_0.distcp.fastpersist.json"]
    report = fp_core.verify(tmp_path / "ckpt")
    assert report["files"] == 2


@pytest.mark.parametrize("loss", ["rank file", "its manifest", "both", ".metadata damaged"])
def test_a_missing_or_swapped_piece_is_found(tmp_path, loss):
    d = str(tmp_path / "ckpt")
    dcp.save(state(7), storage_writer=FastPersistWriter(d))
    data = os.path.join(d, "__0_0.distcp")
    if loss in ("rank file", "both"):
        os.unlink(data)
    if loss in ("its manifest", "both"):
        os.unlink(data + ".fastpersist.json")
    if loss == ".metadata damaged":
        flip_byte(os.path.join(d, ".metadata"), 10)
    with pytest.raises(CorruptCheckpointError):
        fp_core.verify(d)


def test_a_stock_directory_is_not_called_verified(tmp_path):
    d = str(tmp_path / "stock")
    dcp.save(state(8), checkpoint_id=d)
    with pytest.raises(fp_core.NotAFastPersistCheckpoint):
        fp_core.verify(d)


@pytest.mark.parametrize("policy", ["overlap", "snapshot", "sync", "process"])
def test_fsdp2_state_saved_while_training_steps_on(tmp_path, policy, shm_root):
    """AsyncCheckpointer (and fp_core.save) take FSDP2 state: every rank writes its shards
    through DCP while three optimizer steps follow each save at once; each checkpoint holds
    the state at save time (the training did change it), its extra file, and verifies.
    ``process``: the writer processes run DCP's save among themselves."""
    res = run_ranks("dcp_async.py", tmp_path, policy)
    if policy != "sync":
        assert res["writers"] == ["process" if policy == "process" else "thread"] * 3, res
    assert len(res["saves"]) == 3
    for s in res["saves"]:
        assert s == {"equal": True, "meta": True, "changed_since": True}, s
    assert res["verify"] == {"step0": 3, "step1": 3, "step2": 3}  # two rank files and meta.txt


def test_a_rank_that_cannot_rebuild_its_state_fails_the_save_on_every_rank_at_once(tmp_path):
    """Rank 1 fails before it reaches DCP: it still joins the planning exchange and fails
    there, so rank 0 learns of it at once (not after the group's 300 s timeout)."""
    res = run_ranks("dcp_async.py", tmp_path, "rebuildfail")
    assert [s.get("equal") for s in res["saves"][:2]] == [True, True]
    bad = res["saves"][2]
    assert "step2" in bad["error"] and "rank 1" in bad["error"] and "cannot rebuild" in bad["error"], bad
    assert bad["seconds"] < 60 and bad["listing"] == ["step0", "step1"]


def test_an_earlier_failure_is_raised_after_this_ranks_part_of_a_sharded_save_is_queued(tmp_path):
    """Rank 0 has a failed job of its own pending: its next (sharded) save is still queued,
    so rank 1 is not left waiting in the collective; then the failure is raised, carrying
    the queued save's handle. Every checkpoint is whole."""
    res = run_ranks("dcp_async.py", tmp_path, "pendingfail")
    assert "ZeroDivisionError" in res["raised_after_queueing"]
    assert all(s == {"equal": True, "meta": True, "changed_since": True} for s in res["saves"]), res["saves"]
    assert res["verify"] == {"step0": 3, "step1": 3, "step2": 3}


def test_a_corrupt_checkpoint_error_crosses_ranks_whole():
    """DCP sends each rank's exception to every rank by pickle: it must arrive as itself."""
    import pickle

    e = CorruptCheckpointError("/ckpt/__1_0.distcp", "model.w", "CRC-32C 1, expected 2", tensor="model.w")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is CorruptCheckpointError and str(e2) == str(e)
    assert (e2.path, e2.record, e2.detail, e2.tensor) == (e.path, e.record, e.detail, e.tensor)


def test_the_captured_state_keeps_its_containers():
    import collections

    from fp_core.parallel.dcp_save import _capture, _rebuild

    Pair = collections.namedtuple("Pair", "a b")
    obj = {"p": Pair(torch.ones(2), 3), "d": collections.defaultdict(list, x=[torch.zeros(3)]),
           "o": collections.OrderedDict(k=torch.arange(4)), "t": (torch.ones(1), "s")}
    leaves: list = []
    got = _rebuild(_capture(obj, leaves))
    assert len(leaves) == 4
    assert type(got["p"]) is Pair and torch.equal(got["p"].a, torch.ones(2)) and got["p"].b == 3
    assert torch.equal(got["d"]["x"][0], torch.zeros(3))
    assert type(got["o"]) is collections.OrderedDict and torch.equal(got["o"]["k"], torch.arange(4))
    assert type(got["t"]) is tuple and got["t"][1] == "s"


def test_a_rank_failing_a_sharded_save_fails_it_on_every_rank(tmp_path):
    """Rank 1's write fails on the third save: both ranks get the error naming the path and
    rank 1's cause; no directory under its name and no staging directory remain."""
    res = run_ranks("dcp_async.py", tmp_path, "fail")
    assert [s.get("equal") for s in res["saves"][:2]] == [True, True]
    err = res["saves"][2]["error"]
    assert "step2" in err and "rank 1" in err and "Input/output error" in err, err
    assert res["saves"][2]["listing"] == ["step0", "step1"]
    assert res["verify"] == {"step0": 3, "step1": 3}


def test_extra_files_are_committed_with_the_checkpoint_and_checked(tmp_path):
    d = str(tmp_path / "ckpt")
    dcp.save(state(3), storage_writer=FastPersistWriter(d, extra_files={"meta.pt": b"lightning meta"}))
    assert (tmp_path / "ckpt" / "meta.pt").read_bytes() == b"lightning meta"
    assert fp_core.verify(d)["files"] == 2
    (tmp_path / "ckpt" / "meta.pt").write_bytes(b"lightning mexa")
    with pytest.raises(CorruptCheckpointError, match="meta.pt.*CRC-32C"):
        fp_core.verify(d)
    os.unlink(tmp_path / "ckpt" / "meta.pt")
    with pytest.raises(CorruptCheckpointError, match="meta.pt.*missing"):
        fp_core.verify(d)


def test_an_extra_file_replaced_by_a_symlink_is_corrupt(tmp_path):
    d = tmp_path / "ckpt"
    dcp.save(state(3), storage_writer=FastPersistWriter(d, extra_files={"meta.pt": b"meta"}))
    (tmp_path / "elsewhere").write_bytes(b"meta")
    os.unlink(d / "meta.pt")
    os.symlink(tmp_path / "elsewhere", d / "meta.pt")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        fp_core.verify(d)


@pytest.mark.parametrize("name", ["../escape", "/abs", ".metadata", ".hidden", "__0_0.distcp", "x.fastpersist.json", ""])
def test_extra_file_names_cannot_escape_or_shadow(tmp_path, name):
    with pytest.raises(ValueError, match="extra file name"):
        FastPersistWriter(str(tmp_path / "ckpt"), extra_files={name: b"x"})
    assert not os.path.exists(tmp_path / "escape")


def test_a_small_sharded_state_does_not_hold_the_fence_while_dcp_waits_for_a_late_rank(tmp_path):
    """Every tensor is small (copied inside save()): rank 0's fence opens at once, though its
    DCP planning waits 3 s for rank 1 to join."""
    res = run_ranks("dcp_fence.py", tmp_path)
    assert res["held_s"] < 1.5, res
    assert res["verified"] == 2


@pytest.mark.parametrize("delay", [0.0, 0.15, 0.4])
def test_every_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, delay):
    """SIGKILL to every rank while they save a sharded checkpoint over and over: the
    checkpoint saved before is untouched and verifies; under the name being saved there is
    a whole checkpoint or nothing; the next save clears the staging directory left behind."""
    import signal
    import time

    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HELPERS, "dcp_killed.py"), str(r), "2", port,
                               str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "saving-b").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.stderr.read()[-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.02)
        time.sleep(delay)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    expected = torch.load(tmp_path / "a-expected.pt")
    got = {k: torch.zeros_like(v) for k, v in expected.items()}
    assert fp_core.verify(tmp_path / "a")["files"] == 2
    dcp.load({"model": got}, storage_reader=FastPersistReader(tmp_path / "a", verify=True), no_dist=True)
    assert all(torch.equal(got[k], expected[k]) for k in expected)  # resharded onto one process
    b = tmp_path / "b"
    if b.exists():  # a save of b committed before the kill: whole
        assert fp_core.verify(b)["files"] == 2
    d = str(b)
    dcp.save(state(1), storage_writer=FastPersistWriter(d))  # the next save clears what the kill left
    assert not os.path.exists(staging_path(d))
    assert sorted(os.listdir(tmp_path)) == ["a", "a-expected.pt", "b", "saving-b"]


def test_a_kill_between_the_commits_two_renames_is_undone_by_the_next_save(tmp_path):
    """publish_dir moves the previous directory aside, then renames the new one in; killed in
    between, the name is missing and the previous checkpoint is aside. The next save puts it
    back first, so a failing next save still leaves it under its name."""
    from fp_core.saving.commit import REPLACED_PREFIX

    d = tmp_path / "ckpt"
    dcp.save(state(1), storage_writer=FastPersistWriter(d))
    os.rename(d, tmp_path / (REPLACED_PREFIX + "ckpt"))  # where the kill left it
    with pytest.raises(BaseException) as ei:  # DCP raises CheckpointException, a BaseException
        dcp.save(state(2), storage_writer=FastPersistWriter(d, fail_with=OSError(5, "injected")))
    assert "injected" in str(failure(ei))
    got = blank()
    dcp.load(got, storage_reader=FastPersistReader(d, verify=True))
    assert_state(got, state(1))
    # (dcp.save with our writer has no failure hook: its staging directory waits for the next save)
    assert sorted(os.listdir(tmp_path)) == [".ckpt.fastpersist-staging", "ckpt"]


def test_a_plain_save_does_not_pay_for_the_sharded_path(tmp_path):
    """Telling sharded state from plain state imports nothing: torch.distributed.tensor
    (most of a second to import) and DCP stay unimported by fp_core.save of a plain dict."""
    code = ("import sys, torch, fp_core; fp_core.save({'w': torch.ones(3)}, sys.argv[1]); "
            "print(sorted(m for m in ('torch.distributed.tensor', 'torch.distributed.checkpoint') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.pt")], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(HELPERS)))
    assert out.stdout.strip() == "[]"


def test_many_small_tensors_and_one_over_several_read_chunks_load_exactly_and_are_checked(tmp_path):
    # One scatter read fills them all: small tensors grouped a few per request, the large
    # one cut at the read chunk; verify checks each whole item, header bytes included.
    from fp_core.io.read_depth import CHUNK

    g = torch.Generator().manual_seed(7)
    big_n = (2 * CHUNK + 12345) // 4
    want = {"model": {f"p{i}": torch.randn(i % 7 + 1, generator=g) for i in range(600)}, "step": 1}
    want["model"]["big"] = torch.randn(big_n, generator=g)
    d = str(tmp_path / "ckpt")
    dcp.save(want, storage_writer=FastPersistWriter(d))

    def blank_like() -> dict:
        return {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": -1}

    for verify in (False, True):
        got = blank_like()
        dcp.load(got, storage_reader=FastPersistReader(d, verify=verify))
        assert got["step"] == 1 and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    doc = json.loads(open(os.path.join(d, "__0_0.distcp.fastpersist.json")).read())
    big = next(it for it in doc["items"] if it["fqn"] == "model.big")
    assert big["data"][0] - big["offset"] > 0  # torch.save's own header bytes lie before the tensor's
    flip_byte(os.path.join(d, "__0_0.distcp"), big["offset"] + 10)  # damage one of them
    with pytest.raises(BaseException) as ei:
        dcp.load(blank_like(), storage_reader=FastPersistReader(d, verify=True))
    err = failure(ei)
    assert isinstance(err, CorruptCheckpointError) and err.tensor == "model.big"
    got = blank_like()
    dcp.load(got, storage_reader=FastPersistReader(d))  # the tensor's own bytes are intact
    assert torch.equal(got["model"]["big"], want["model"]["big"])


def test_targets_sharing_memory_get_the_last_item_read_not_a_mix(tmp_path):
    # Tied weights: two saved items land in one target tensor. They are read one after the
    # other, in file order, as torch's reader does, never by parallel reads at once.
    from fp_core.io.read_depth import CHUNK

    n = 3 * CHUNK // 4
    a, b = torch.full((n,), 1.0), torch.full((n,), 2.0)
    d = str(tmp_path / "ckpt")
    dcp.save({"a": a, "b": b}, storage_writer=FastPersistWriter(d))
    for verify in (False, True):
        shared = torch.zeros(n)
        got = {"a": shared, "b": shared}
        dcp.load(got, storage_reader=FastPersistReader(d, verify=verify))
        assert torch.equal(shared, b)  # b lies after a in the file


def test_a_planner_that_resolves_into_one_scratch_buffer_still_loads_every_tensor(tmp_path):
    # resolve_tensor may hand out the same memory for every item and copy it out in
    # commit_tensor: such a planner's items are read and committed one at a time.
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class ScratchPlanner(DefaultLoadPlanner):
        scratch = torch.empty(1 << 20, dtype=torch.uint8)

        def resolve_tensor(self, read_item):
            t = super().resolve_tensor(read_item)
            return self.scratch[:t.nbytes].view(t.dtype).view(t.shape)

        def commit_tensor(self, read_item, tensor):
            super().resolve_tensor(read_item).copy_(tensor)

    d = str(tmp_path / "ckpt")
    dcp.save(state(6), storage_writer=FastPersistWriter(d))
    for verify in (False, True):
        got = blank()
        dcp.load(got, storage_reader=FastPersistReader(d, verify=verify), planner=ScratchPlanner())
        assert_state(got, state(6))


_SHARDED_STATS = """
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import fp_core
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
state = {"w": distribute_tensor(torch.randn(1024, 1024), mesh, [Shard(0)]), "step": 3}
st = fp_core.save(state, sys.argv[2])
ck = fp_core.AsyncCheckpointer()
h = ck.save(state, sys.argv[2] + "-async")
ck.wait()
print(json.dumps([st.as_dict(), h.result().as_dict()]))
dist.destroy_process_group()
"""


def test_sharded_save_stats_report_the_writes_and_syncs_that_happened(tmp_path):
    """SaveStats of a DTensor save: the alignment used, the time in fdatasync and commit,
    the number of write requests (they said 0 though every rank syncs its file)."""
    out = subprocess.run([sys.executable, "-c", _SHARDED_STATS, free_port(), str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    for st in json.loads(out.stdout.strip().splitlines()[-1]):
        assert st["alignment"] >= 4096 and st["alignment"] % 4096 == 0, st
        assert st["requests"] >= 1 and st["sync_seconds"] > 0 and st["write_seconds"] > 0, st
        assert st["bytes"] >= 4 << 20 and st["backend"], st
    assert fp_core.verify(tmp_path / "ckpt")["files"] == 1
