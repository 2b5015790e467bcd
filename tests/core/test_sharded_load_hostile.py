"""load_into of hostile files (issue 39): a file whose pickle or zip directory declares
shapes, strides, offsets, dtypes or sizes that its records do not hold is a
CorruptCheckpointError naming the path, on one process and on every rank of a DTensor
load; no load writes outside its target (each target is a view fenced by sentinel bytes);
a rank that fails before its reads makes every rank raise promptly, not wait."""

from __future__ import annotations

import json
import os
import struct
import sys
import zipfile

import pytest
import torch
from conftest import HELPERS, flip_byte, rank_results

import fp_core
from fp_core.errors import CorruptCheckpointError, NotAFastPersistCheckpoint

sys.path.insert(0, HELPERS)
from sharded_load_hostile import (  # noqa: E402
    CASES,
    declared,
    directory_lies,
    fence_intact,
    fenced,
    record,
    write_lying,
)

WORKER = "sharded_load_hostile_worker.py"
WRITERS = ["fastpersist", "torch"]
DELTAS = [64, -64, 4096, -2048, 2**20]  # bytes the zip directory adds to a record's size


def _file_name(writer: str, case: str) -> str:
    return f"{writer}-{case}.pt".replace(" ", "_").replace("(", "").replace(")", "").replace(",", "")


def _verifies(writer: str) -> list[bool]:
    return [False, True] if writer == "fastpersist" else [False]  # verify needs our manifest


def _expect_load(path: str, target: dict, verify: bool, expect: str) -> None:
    if expect == "corrupt":
        with pytest.raises(CorruptCheckpointError) as e:
            fp_core.load_into(target, path, verify=verify)
        assert path in str(e.value)
    else:  # a view of part of its storage: what torch.load gives
        fp_core.load_into(target, path, verify=verify)
        assert torch.equal(target["w"], torch.load(path, weights_only=True)["w"])


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pickle_that_lies_about_its_record(tmp_path, writer, case):
    """Each lie in the pickle (a target shaped as it declares, so only the file is wrong)."""
    path = str(tmp_path / _file_name(writer, case))
    write_lying(path, case, writer)
    shape, dtype = declared(case)
    for verify in _verifies(writer):
        t, big = fenced(shape, dtype)
        _expect_load(path, {"w": t, "epoch": 0}, verify, CASES[case][-1])
        assert fence_intact(big, shape[0]), (case, verify)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("delta", DELTAS)
def test_a_zip_directory_that_lies_about_a_record_size(tmp_path, writer, delta):
    honest = str(tmp_path / "honest.pt")
    write_lying(honest, "smaller shape (a view of part of the storage)", writer)
    path = str(tmp_path / "lies.pt")
    directory_lies(honest, path, delta)
    for verify in _verifies(writer):
        t, big = fenced((48, 8), torch.float32)
        _expect_load(path, {"w": t, "epoch": 0}, verify, "corrupt")
        assert fence_intact(big, 48)


def test_a_target_of_another_shape_names_the_key_and_both_shapes(tmp_path):
    path = str(tmp_path / "ok.pt")
    fp_core.save({"model": {"w": record(), "b": torch.ones(8)}}, path)
    for shape in [(64, 9), (63, 8), (8, 64), (64 * 8,)]:
        t, big = fenced(shape, torch.float32)
        with pytest.raises(ValueError) as e:
            fp_core.load_into({"model": {"w": t, "b": torch.zeros(8)}}, path)
        msg = str(e.value)
        assert "model.w" in msg and "(64, 8)" in msg and str(tuple(shape)) in msg, msg
        assert fence_intact(big, shape[0])
    with pytest.raises(ValueError, match=r"model\.b.*torch\.float32.*torch\.float64"):
        fp_core.load_into({"model": {"w": torch.zeros(64, 8), "b": torch.zeros(8, dtype=torch.float64)}}, path)


def _ranks(scenario: str, d: str, timeout: float) -> list[dict]:
    out = rank_results(WORKER, d, scenario, world=2, timeout=timeout)
    assert all(r["ok"] for r in out), out
    return out


def test_lying_files_on_two_ranks_shard_replicate_hsdp(disk_dir):
    """Every lie, loaded into DTensors on 2 ranks (Shard(0), Replicate(), HSDP, Shard(1)), verified
    and not: every rank raises CorruptCheckpointError naming the path (also the rank
    whose rows lie inside the record), promptly; no sentinel around a local shard moves;
    a load that goes through fills each rank's rows as torch.load reads them."""
    cases = []
    for writer in WRITERS:
        for case in CASES:
            name = _file_name(writer, case)
            write_lying(os.path.join(disk_dir, name), case, writer)
            cases += [{"file": name, "case": case, "verify": v} for v in _verifies(writer)]
        honest = os.path.join(disk_dir, f"{writer}-honest.pt")
        write_lying(honest, "smaller shape (a view of part of the storage)", writer)
        for delta in (64, -64, 2**20):
            name = f"{writer}-directory{delta}.pt"
            directory_lies(honest, os.path.join(disk_dir, name), delta)
            cases += [{"file": name, "case": "directory", "shape": [48, 8], "verify": v} for v in _verifies(writer)]
    with open(os.path.join(disk_dir, "cases.json"), "w") as f:
        json.dump(cases, f)
    results = _ranks("family", disk_dir, timeout=400)
    loads = [x for r in results for x in r["loads"]]
    assert len(loads) == 2 * 4 * len(cases)
    for x in loads:
        what = (x["file"], x["layout"], x["verify"], x["outcome"])
        assert x["fence"], what
        assert x["seconds"] < 30, what  # no rank waits for a gloo timeout
        expect = CASES[x["case"]][-1] if x["case"] in CASES else "corrupt"
        if expect == "corrupt":
            assert x["outcome"].startswith("CorruptCheckpointError"), what
            assert os.path.join(disk_dir, x["file"]) in x["outcome"], what
        else:
            assert x["outcome"] == "" and x["filled"] is True, what


def test_a_rank_that_fails_before_its_reads_makes_every_rank_raise(disk_dir):
    """Rank 1 alone fails before reading (its file missing, its target of another shape,
    its file's pickle damaged), verified and not: rank 0 raises too, at once, naming rank 1
    and its cause; both then load a good file together (the ranks stay in step)."""
    good = os.path.join(disk_dir, "good.pt")
    fp_core.save({"w": record(), "epoch": 3}, good)
    raw = bytearray(open(good, "rb").read())
    with zipfile.ZipFile(good) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    n, e = struct.unpack_from("<HH", raw, info.header_offset + 26)
    at = info.header_offset + 30 + n + e
    assert raw[at:at + 2] == b"\x80\x02"
    raw[at] = 0x11  # an opcode no unpickler knows
    with open(os.path.join(disk_dir, "damaged_pickle.pt"), "wb") as f:
        f.write(bytes(raw))
    results = _ranks("one_fails", disk_dir, timeout=200)
    r0, r1 = (r["cases"] for r in results)
    for key, mine in r0.items():
        if key == "after":
            continue
        other = r1[key]
        assert other["outcome"], (key, other)  # rank 1 failed
        assert mine["outcome"], (key, mine)  # and rank 0 raised too
        assert mine["seconds"] < 30 and other["seconds"] < 30, (key, mine, other)
        assert "rank 1" in mine["outcome"], (key, mine)
        if key.startswith("missing file"):
            assert other["outcome"].startswith("FileNotFoundError"), other
            assert mine["outcome"].startswith("RuntimeError") and "FileNotFoundError" in mine["outcome"], mine
        elif key.startswith("target of another shape"):
            assert other["outcome"].startswith("ValueError") and "(65, 8)" in other["outcome"], other
            assert mine["outcome"].startswith("ValueError") and "(65, 8)" in mine["outcome"], mine
        else:
            assert other["outcome"].startswith("CorruptCheckpointError"), other
            assert mine["outcome"].startswith("CorruptCheckpointError"), mine
            assert "damaged_pickle.pt" in mine["outcome"], mine
    assert r0["after"]["outcome"] == "" and r1["after"]["outcome"] == "", (r0["after"], r1["after"])


def test_verify_auto_checks_a_file_with_a_manifest_and_loads_one_without(tmp_path):
    """verify="auto" (as fp_core.load takes it): a torch.save file loads unchecked (True
    refuses it); a FastPersist file is checked, a damaged byte in a tensor found."""
    plain, ours = str(tmp_path / "plain.pt"), str(tmp_path / "ours.pt")
    torch.save({"w": record()}, plain)
    fp_core.save({"w": record()}, ours)
    for path in (plain, ours):
        t = torch.zeros(64, 8)
        fp_core.load_into({"w": t}, path, verify="auto")
        assert torch.equal(t, record())
    with pytest.raises(NotAFastPersistCheckpoint):
        fp_core.load_into({"w": torch.zeros(64, 8)}, plain, verify=True)
    w = next(r for r in fp_core.inspect(ours) if r.get("tensor") == "w")
    flip_byte(ours, w["offset"] + 5)
    with pytest.raises(CorruptCheckpointError, match="tensor w"):
        fp_core.load_into({"w": torch.zeros(64, 8)}, ours, verify="auto")
    fp_core.load_into({"w": torch.zeros(64, 8)}, ours, verify=False)  # unchecked: the bytes as they are
    with pytest.raises(ValueError, match="verify must be"):
        fp_core.load_into({"w": torch.zeros(64, 8)}, ours, verify="yes")
