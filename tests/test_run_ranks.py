"""conftest.run_ranks: ranks are forks of a forkserver with torch imported, each seeing what
``python SCRIPT ARGS`` would (argv, the test's environment and working directory, its own
folder first on sys.path, its exit status, its exit handlers); a test that changes a
variable read at import time gets fresh interpreters instead."""

from __future__ import annotations

import json
import os

import pytest
from conftest import HELPERS, rank_results, run_ranks


def _change_an_import_time_variable(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2")


def test_ranks_fork_with_torch_imported_and_see_the_tests_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FP_RANK_PROBE", "seen")
    monkeypatch.chdir(tmp_path)
    results = rank_results("rank_probe.py", tmp_path, "x", world=3)
    for r, res in enumerate(results):
        assert res["preloaded"] and res["probe"] == "seen" and res["cwd"] == str(tmp_path), res
        assert res["argv"][:2] == [str(r), "3"] and res["argv"][3:] == [str(tmp_path), "x"], res
        assert res["path0"] == HELPERS


def test_a_variable_read_at_import_time_gets_fresh_interpreters(tmp_path, monkeypatch):
    _change_an_import_time_variable(monkeypatch)
    results = rank_results("rank_probe.py", tmp_path)
    assert all(not r["preloaded"] and r["omp"] == os.environ["OMP_NUM_THREADS"] for r in results), results


@pytest.mark.parametrize("fresh", [False, True])
def test_a_failing_rank_fails_the_run_with_its_status_and_stderr(tmp_path, monkeypatch, fresh):
    if fresh:
        _change_an_import_time_variable(monkeypatch)
    with pytest.raises(AssertionError, match=r"\[0, 3\].*rank 1 fails on purpose"):
        run_ranks("rank_probe.py", tmp_path, "fail")


@pytest.mark.parametrize("fresh", [False, True])
def test_exit_handlers_run_after_the_script_and_see_an_unhandled_error(tmp_path, monkeypatch, fresh):
    if fresh:
        _change_an_import_time_variable(monkeypatch)
    with pytest.raises(AssertionError, match=r"(?s)\[0, 1\].*Traceback.*rank_probe.py.*RuntimeError: rank 1 raises on purpose"):
        run_ranks("rank_probe.py", tmp_path, "atexit")
    seen = [json.loads((tmp_path / f"atexit{r}.json").read_text())["last"] for r in range(2)]
    assert seen == ["None", "RuntimeError('rank 1 raises on purpose')"], seen
