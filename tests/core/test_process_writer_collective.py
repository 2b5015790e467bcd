"""Collective saves (``group=``) with ``writer="process"``: the writer processes run the
collective save among themselves, over a gloo group of their own, so a rank's trainer
killed after its fence does not fail the save (tests/helpers/process_writer_collective.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import HELPERS, assert_no_temps, free_port, rank_results

sys.path.insert(0, HELPERS)
from process_writer_collective import generation  # noqa: E402
from process_writer_victim import wait_gone  # noqa: E402

SCRIPT = "process_writer_collective.py"


def _images(root: str) -> list[str]:
    d = os.path.join(root, f"fastpersist-{os.geteuid()}")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _no_crash(results: list[dict]) -> None:
    for r in results:
        assert "crash" not in r, r["crash"]


def test_the_writers_save_together_fail_together_and_pair_with_a_decline(tmp_path, shm_root):
    results = rank_results(SCRIPT, tmp_path, "together", timeout=180)
    _no_crash(results)
    for r in results:
        assert r["first"]["writer"] == "process" and r["first"]["writer_ranks"] == [0, 1], r
        assert r["first"]["rank_bytes"] > 1 << 20  # each writer wrote a share of the one file
        # one rank could not lay its state out: every rank fails, the file keeps generation 2
        assert r["after_plan_error"] == 2, r
        assert r["last"] == 5 and r["close"] == "" and not r["writer_alive_after_close"], r
        assert r["rejoined"], r
    r0, r1 = results
    assert "CollectiveSaveError" in r0["plan_error"] and "rank 1" in r0["plan_error"], r0
    assert "cannot pickle" in r0["plan_error"] and "CheckpointSerializationError" in r1["plan_error"], r1
    assert r0["alone"] == 4 and r1["declined"] is True  # rank 0 wrote that one alone; rank 1's writer was told
    assert not os.path.exists(tmp_path / "peer-path.pt")
    assert generation(str(tmp_path / "ckpt.pt")) == 5
    assert_no_temps(str(tmp_path))
    assert _images(shm_root) == []


@pytest.mark.parametrize("scenario,name", [("kill-after-fence", "ckpt.pt"),
                                           ("sharded-kill-after-fence", "full.pt"),
                                           ("dcp-kill-after-fence", "dcp-dir")])
def test_a_trainer_killed_after_the_fence_does_not_fail_the_collective_save(tmp_path, shm_root, scenario, name):
    """Rank 1 SIGKILLs itself right after generation 2's fence: its orphaned writer still
    writes its share (its rows, for sharded state saved as one file) with rank 0's writer,
    and rank 0's save commits."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HELPERS, SCRIPT), str(r), "2", port, str(tmp_path),
                               scenario], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -signal.SIGKILL, outs[1][1][-3000:]
    assert procs[0].returncode == 0, outs[0][1][-3000:]
    with open(tmp_path / "result0.json") as f:
        r0 = json.load(f)
    assert "crash" not in r0, r0["crash"]
    assert r0["second"] in ("", {"writer": "process", "layout": "file"}, {"writer": "process", "layout": "dcp"}), r0
    assert r0["gen"] == 2, r0
    orphan = int(open(tmp_path / "writer1.pid").read())
    assert wait_gone(orphan, 60), "rank 1's orphaned writer did not finish"
    assert generation(str(tmp_path / name)) == 2
    (tmp_path / "dcp-dir.pt").unlink(missing_ok=True)  # generation()'s conversion of a DCP directory
    assert_no_temps(str(tmp_path))
    assert _images(shm_root) == []


def test_a_writer_killed_fails_the_next_collective_save_on_every_rank_and_the_group_forms_again(tmp_path, shm_root):
    results = rank_results(SCRIPT, tmp_path, "writer-killed", timeout=180)
    _no_crash(results)
    r0, r1 = results
    assert "writer process" in r1["second"] and "forms the group again" in r1["second"], r1
    assert "CollectiveSaveError" in r0["second"], r0  # its writer's peer is gone: at once, not at a timeout
    for r in results:
        assert r["gen"] == 1 and r["second_seconds"] < 30 and r["close"] == "", r
        # the group formed again at the next save, every kind of collective save on it
        assert r["third"] == "" and r["third_writer"] == "process" and r["after"] == [3, 3, 3], r
        assert all(o == "" for o in r["outcomes"][2:]) and r["last"] == 7, r
        assert all("CollectiveSaveError" in o or "writer" in o for o in r["outcomes"][:2] if o), r
    assert_no_temps(str(tmp_path))
    assert _images(shm_root) == []


def test_one_rank_without_shared_memory_keeps_every_ranks_collective_saves_on_the_thread(tmp_path, shm_root):
    """The route is agreed by all ranks: one that cannot have a writer process sends every
    rank's collective saves to the thread writer (never a mix, which would wait forever)."""
    results = rank_results(SCRIPT, tmp_path, "no-shared-memory-on-1", timeout=180)
    _no_crash(results)
    for r in results:
        assert r["first"]["writer"] is None and r["first"]["writer_ranks"] == [0, 1], r
        assert r["gen"] == 2 and r["close"] == "", r
    assert_no_temps(str(tmp_path))


def test_a_decline_first_meets_the_peers_join_and_a_subgroup_asks_nobody(tmp_path, shm_root):
    results = rank_results(SCRIPT, tmp_path, "decline-first", timeout=180)
    _no_crash(results)
    r0, r1 = results
    assert r1["declined"] is True and generation(str(tmp_path / "alone.pt")) == 1
    assert all(r["writer"] == "process" and r["seconds"] < 30 and r["close"] == "" for r in results), results
    assert r0["sub"]["writer"] == "thread" and r0["sub"]["seconds"] < 10, r0  # not a wait for ranks never coming
    assert generation(str(tmp_path / "ckpt.pt")) == 3 and generation(str(tmp_path / "sub.pt")) == 4


def test_dcp_saves_on_a_submesh_make_the_writers_mesh_once(tmp_path, shm_root):
    results = rank_results(SCRIPT, tmp_path, "submesh", timeout=180)
    _no_crash(results)
    for r in results:
        assert r["writers"] == ["process"] * 4 and r["close"] == "", r
        assert r["fds"][1] == r["fds"][3], r  # no groups made per save
    assert results[0]["equal"] is True
