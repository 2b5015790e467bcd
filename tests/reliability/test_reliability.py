"""Reliability, measured: SIGKILL at random instants, faults, corruption, a short soak.

A fast subset of ``benchmarks/crash_harness.py`` (which runs >= 200 crash trials) and
``benchmarks/soak.py`` (1000 saves); the figures of the full runs are in docs/reliability.md.
The Lightning / HF crash rows are marked ``slow`` (each child imports the framework).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
from conftest import REPO, fs_type

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import crash_harness as ch  # noqa: E402
import soak as soak_mod  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only (SIGKILL, /proc, mounts)")


def _assert_clean(res: dict) -> None:
    assert res["problems"] == [], "\n".join(res["problems"])
    assert res["failures"] == 0 and res["data_lost"] == 0, res


@pytest.mark.parametrize("mode,trials", [("sync", 4), ("async", 4), ("dist-sync", 3), ("dist-async", 3), ("dist-dcp", 2), ("dist-file", 2)])
def test_sigkill_at_random_instants(disk_dir, mode, trials):
    rng = random.Random(hash(mode) & 0xFFFF)
    T = ch.calibrate(mode, disk_dir)
    res = ch.core_trials(mode, trials, disk_dir, rng, T)
    print(f"{mode}: {res}")
    _assert_clean(res)
    assert res["trials"] == trials
    # every orphan was either removed by the next child's first save or by `fastpersist clean`
    assert res["temps_cleaned_by_next_save"] + res["temps_cleaned_by_cli"] == res["temps_left"], res
    assert res["survivor_hung"] == 0


def test_crash_subset_lands_mid_save(disk_dir):
    """The kill instants are not all between saves; a kill mid-save leaves nothing behind where
    the file being written is unnamed (O_TMPFILE), an orphan to clean where it is not. (With
    O_TMPFILE a kill in the microseconds between the link to a temporary name and the rename
    over the checkpoint's leaves the whole file there: rare, and never a partial one.)"""
    from fp_core.saving import commit

    rng = random.Random(7)
    T = ch.calibrate("sync", disk_dir)
    res = ch.core_trials("sync", 4, disk_dir, rng, T)
    _assert_clean(res)
    assert res["mid_save_kills"] >= 2, res
    if commit.tmpfile_supported(disk_dir):
        assert res["temps_left"] == res["temps_whole"] <= 1, res
    else:
        assert res["temps_left"] >= 1, res


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lightning", "hf"])
def test_integration_crash(disk_dir, kind):
    pytest.importorskip("lightning" if kind == "lightning" else "transformers")
    res = ch.integration_trials(kind, 2, disk_dir, random.Random(3))
    print(f"{kind}: {res}")
    _assert_clean(res)  # last.ckpt / the newest checkpoint-N always complete
    # A kill mid-save may leave FastPersistIO's pending-name placeholder; it is marked with
    # its writer, so fp_core.clean (and the next save into the directory) removes it.
    assert res.get("empty_placeholders_after_clean", 0) == 0, res


@pytest.fixture(scope="module")
def fault_table(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the fault table mounts tmpfs / bind mounts: needs root")
    return {r["scenario"]: r for r in ch.fault_rows(str(tmp_path_factory.mktemp("faults")))}


EXPECTED = {
    "full disk (sync)": ("OSError", 28),
    "full disk (async)": ("OSError", 28),  # no room for it: refused inside save(), before any write
    "EIO on write (sync)": ("OSError", 5),
    "EIO on write (async)": ("AsyncCheckpointError", 5),
    "read-only file system": ("OSError", 30),
    "permission denied (uid 65534)": ("PermissionError", 13),
    "permission denied (chattr +i, as root)": ("PermissionError", 13),
    "directory removed during async save (overlap)": ("AsyncCheckpointError", 2),
    "directory removed during async save (snapshot)": ("AsyncCheckpointError", 2),
    "O_DIRECT refused (backend=auto)": (None, None),
    "O_DIRECT refused (backend=io_uring)": ("OSError", 22),
    "io_uring refused (backend=auto)": (None, None),
    "io_uring refused (backend=io_uring)": ("OSError", 38),
}


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_fault_table(fault_table, scenario):
    if scenario not in fault_table:
        pytest.skip(f"{scenario}: not run here")
    row = fault_table[scenario]
    exc, err = EXPECTED[scenario]
    assert row["exception"] == exc, row
    if exc is not None:
        got = row.get("cause_errno") if exc == "AsyncCheckpointError" else row.get("errno")
        assert int(got) == err, row
        assert "/" in row["message"], f"message names no path: {row}"
    else:
        assert "saved with backend=" in row["message"], row
    assert row["temps_left"] == 0, row
    assert row["old_intact"] is True or str(row["old_intact"]).startswith("n/a"), row


def test_permission_denied_on_unsearchable_parent_says_so(fault_table):
    """An unsearchable parent is reported as permission denied, not as a missing directory."""
    row = fault_table.get("permission denied (parent not searchable, uid 65534)")
    if row is None:
        pytest.skip("not run here")
    assert row["exception"] == "PermissionError", row


@pytest.fixture(scope="module")
def corruption_table(tmp_path_factory):
    """ch.corruption_rows once for the module (it makes all three kinds, each with a CLI
    run; it ran in full for each kind), on a real disk as the disk_dir fixture picks it."""
    import shutil
    import uuid

    from conftest import DISK_TMP_ROOT

    d = str(tmp_path_factory.mktemp("corrupt"))
    if fs_type(d) in ("tmpfs", "ramfs", "overlay"):
        d = os.path.join(DISK_TMP_ROOT, uuid.uuid4().hex)
        os.makedirs(d)
        try:
            return {r["scenario"]: r for r in ch.corruption_rows(d)}
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return {r["scenario"]: r for r in ch.corruption_rows(d)}


@pytest.mark.parametrize("kind", ["flipped bit", "zeroed 4 KiB block", "truncated to half"])
def test_corruption_detected_by_cli_and_load(corruption_table, kind):
    row = corruption_table[kind]
    assert row["cli_exit"] == 1, row
    assert row["load_exception"] == "CorruptCheckpointError", row
    if kind == "truncated to half":
        assert "<zip structure>" in row["cli_message"] and "truncated" in row["cli_message"], row
    else:
        assert "model.weight" in row["cli_message"] and row["record"] in row["cli_message"], row
        assert "model.weight" in row["load_message"], row


def test_short_soak_no_growth(disk_dir):
    res = soak_mod.soak(os.path.join(disk_dir, "soak"), saves=120, mib=1, keep=3, every=30, log=lambda *_: None)
    print({k: v for k, v in res.items() if k != "samples"})
    assert res["problems"] == [], res
