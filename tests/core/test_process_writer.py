"""AsyncCheckpointer(writer="process"): the writer in its own process, snapshots in shared
memory, a checkpoint that survives its trainer, and resume from memory."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import HELPERS, assert_no_temps, free_port

import fp_core
from fp_core import AsyncCheckpointer, AsyncCheckpointError
from fp_core.io import memory_image

sys.path.insert(0, HELPERS)
from process_writer_victim import check, wait_gone  # noqa: E402

VICTIM = os.path.join(HELPERS, "process_writer_victim.py")




def _images(root: str) -> list[str]:
    d = os.path.join(root, f"fastpersist-{os.geteuid()}")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(600, 1000, generator=g)
    return {"model": {"w": w, "wt": w.t(), "b": torch.randn(3, generator=g), "i": torch.arange(7)},
            "optim": {"step": torch.tensor(5.0), "m": torch.randn(300_000, generator=g).to(torch.bfloat16)},
            "meta": ["x", 3, {"lr": 0.1}]}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_round_trip_and_the_image_is_the_file(disk_dir, shm_root):
    path = os.path.join(disk_dir, "ck.pt")
    with AsyncCheckpointer(writer="process", resume_from_memory=True) as ck:
        for seed in range(2):  # the second save reuses the arena (its image forgotten first)
            st = _state(seed)
            stats = ck.save(st, path).result()
            assert stats.extra["writer"] == "process" and stats.policy == "snapshot"
            out = torch.load(path, weights_only=True)
            assert _equal(out, st)
            fp_core.verify(path)
            image = memory_image.find(path)
            assert image is not None
            with open(image, "rb") as a, open(path, "rb") as b:
                assert a.read() == b.read()
            hits = memory_image.hits  # its own image, still this process's arena: read as a copy
            assert _equal(fp_core.load(path, weights_only=True), st) and memory_image.hits == hits + 1
        writer = ck._writer_proc.pid
        st = {"a": torch.randn(1000), "b": torch.arange(10)}
        ck.save(st, os.path.join(disk_dir, "m.safetensors"), format="safetensors").result()
    from safetensors.torch import load_file

    assert _equal(load_file(os.path.join(disk_dir, "m.safetensors")), st)
    assert wait_gone(writer, 10), "the writer process outlived close()"
    assert _images(shm_root) == []  # close() removes every arena and image
    assert_no_temps(disk_dir)


def test_the_checkpoint_is_the_state_at_save_while_steps_go_on(disk_dir, shm_root):
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with AsyncCheckpointer(writer="process") as ck:
        for step in range(4):
            want = {k: v.clone() for k, v in model.state_dict().items()}
            ck.save(model.state_dict(), os.path.join(disk_dir, f"s{step}.pt"))
            model(torch.randn(4, 512)).sum().backward()
            opt.step()  # the installed hook fences first
            opt.zero_grad()
            want_path = os.path.join(disk_dir, f"s{step}.pt")
            ck.wait_for(want_path)
            assert _equal(torch.load(want_path, weights_only=True), want)


def test_a_write_error_in_the_writer_is_raised_once_and_the_old_file_kept(disk_dir, shm_root, monkeypatch):
    monkeypatch.setenv("FASTPERSIST_WRITER_TEST_FAULT", "write:5")  # the writer's first write fails: EIO
    path = os.path.join(disk_dir, "ck.pt")
    torch.save({"old": torch.arange(5)}, path)
    before = open(path, "rb").read()
    ck = AsyncCheckpointer(writer="process")
    try:
        h = ck.save(_state(), path)
        h._done.wait(60)
        with pytest.raises(AsyncCheckpointError) as ei:
            ck.fence()
        cause = ei.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == 5 and path in str(cause), repr(cause)
        assert "in the checkpoint writer process" in "".join(getattr(cause, "__notes__", []))
        assert open(path, "rb").read() == before
        ck.fence()  # raised once
        ck.save(_state(1), path).result()  # the fault was one-shot: the same writer goes on
        assert _equal(torch.load(path, weights_only=True), _state(1))
    finally:
        ck.close()
    assert_no_temps(disk_dir)


def test_bad_paths_fail_in_save_itself(disk_dir, shm_root):
    with AsyncCheckpointer(writer="process") as ck:
        with pytest.raises((OSError, fp_core.CheckpointError)) as ei:
            ck.save(_state(), os.path.join(disk_dir, "missing", "ck.pt"))
        assert "missing" in str(ei.value)
        with pytest.raises(fp_core.CheckpointSerializationError):
            ck.save({"f": lambda: 1}, os.path.join(disk_dir, "x.pt"))
        ck.save(_state(), os.path.join(disk_dir, "ok.pt")).result()  # the skipped jobs do not stall it
    assert not os.path.exists(os.path.join(disk_dir, "x.pt"))


def test_a_writer_killed_mid_save_fails_that_save_and_the_next_starts_another(disk_dir, shm_root, monkeypatch,
                                                                               caplog):
    monkeypatch.setenv("FASTPERSIST_WRITER_TEST_FAULT", "kill_before_rename")  # SIGKILL in its first commit
    torch.save({"old": torch.arange(3)}, os.path.join(disk_dir, "a.pt"))  # replaced: link, then rename
    before = open(os.path.join(disk_dir, "a.pt"), "rb").read()
    with AsyncCheckpointer(writer="process") as ck:
        h = ck.save(_state(), os.path.join(disk_dir, "a.pt"))
        first = ck._writer_proc.pid
        with pytest.raises(AsyncCheckpointError) as ei:
            h.result(60)
        assert f"writer process (pid {first}) is gone" in str(ei.value) and "-9" in str(ei.value)
        assert open(os.path.join(disk_dir, "a.pt"), "rb").read() == before
        monkeypatch.delenv("FASTPERSIST_WRITER_TEST_FAULT")
        ck.fence()  # h.result() reported it: not raised again
        ck.save(_state(2), os.path.join(disk_dir, "c.pt")).result()
        second = ck._writer_proc.pid
        assert second != first
        os.kill(second, signal.SIGKILL)  # between saves: the next one starts a third, says so
        assert wait_gone(second, 10)
        ck.save(_state(3), os.path.join(disk_dir, "d.pt")).result()
        assert f"writer process {second} exited" in caplog.text
        assert _equal(torch.load(os.path.join(disk_dir, "d.pt"), weights_only=True), _state(3))
    fp_core.clean(disk_dir)  # the killed writer's file under its temporary name (its pid is gone)
    assert_no_temps(disk_dir)


@pytest.mark.parametrize("cut", ["interrupt", "oserror"])
def test_a_job_cut_short_on_its_way_to_the_writer_ends_that_writer_not_the_run(disk_dir, shm_root, cut):
    """^C (or a failed write) between the writes of one job's message: what the writer
    would read next is not a message. The stream ends there: the writer writes what it
    had whole and exits, the save raises, and the next save starts another writer."""
    small = {"w": torch.arange(1000, dtype=torch.float32)}  # copied in save(): handed over there
    with AsyncCheckpointer(writer="process") as ck:
        ck.save(small, os.path.join(disk_dir, "a.pt")).result()
        wp = ck._writer_proc
        real = wp.conn.send_bytes

        def half_then_fail(data):
            os.write(wp.conn.fileno(), len(data).to_bytes(4, "big") + bytes(data[: len(data) // 2]))
            raise KeyboardInterrupt if cut == "interrupt" else BrokenPipeError(32, "injected")

        wp.conn.send_bytes = half_then_fail
        with pytest.raises(KeyboardInterrupt if cut == "interrupt" else Exception):
            ck.save({"w": torch.zeros(1000)}, os.path.join(disk_dir, "b.pt")).result()
        wp.conn.send_bytes = real
        assert wait_gone(wp.pid, 30), "the writer cut short did not exit"
        assert not os.path.exists(os.path.join(disk_dir, "b.pt"))
        with contextlib.suppress(Exception):
            ck.wait()  # the failed save, if it was queued, is reported here once
        ck.save(small, os.path.join(disk_dir, "c.pt")).result()
        assert ck._writer_proc is not wp and ck._writer_proc.alive
    for name in ("a.pt", "c.pt"):
        assert _equal(torch.load(os.path.join(disk_dir, name), weights_only=True), small)
    assert_no_temps(disk_dir)


def test_saves_it_cannot_take_stay_on_the_thread_and_say_so(disk_dir, shm_root, caplog):
    caplog.set_level(logging.WARNING, "fastpersist")
    with AsyncCheckpointer(writer="process", snapshot_budget_bytes=1 << 20) as ck:
        st = _state()
        stats = ck.save(st, os.path.join(disk_dir, "big.pt")).result()
        assert "writer" not in stats.extra
        assert _equal(torch.load(os.path.join(disk_dir, "big.pt"), weights_only=True), st)
    assert "snapshot_budget_bytes" in caplog.text and "thread writer" in caplog.text


def _victim(directory: str, writer: str, when: str, delay_ms: float, mib: int = 64) -> int:
    """Run the victim; return the generation ``ckpt.pt`` holds once its writer is gone."""
    r = subprocess.run([sys.executable, VICTIM, directory, writer, when, str(delay_ms), str(mib)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    pid = int(open(os.path.join(directory, "writer.pid")).read())
    assert wait_gone(pid, 60), "the orphaned writer did not finish"
    return check(os.path.join(directory, "ckpt.pt"))


def test_a_trainer_killed_after_the_fence_still_commits(disk_dir, shm_root):
    assert _victim(disk_dir, "process", "after-fence", 0, mib=32) == 2


def test_a_restart_loading_at_once_waits_for_the_orphaned_writers_commit(disk_dir, shm_root):
    """The restart's fp_core.load comes while the killed trainer's writer is still writing
    the newest checkpoint: it waits for that writer (its job's mark, the locks) and reads
    generation 2, not the generation 1 still under the name."""
    r = subprocess.run([sys.executable, VICTIM, disk_dir, "process", "after-fence", "0", "256"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    # At once, before the writer can have noticed the death: the trainer's own lock is free
    # the moment it died, and the job's mark says which file its writer still commits.
    writer = int(open(os.path.join(disk_dir, "writer.pid")).read())
    got = fp_core.load(os.path.join(disk_dir, "ckpt.pt"), weights_only=True)  # it waits for the commit
    assert got["gen"] == 2 and bool((got["b"] == 2).all())
    assert wait_gone(writer, 1)
    assert _images(shm_root) == []
    assert_no_temps(disk_dir)
    assert _images(shm_root) == []  # without resume_from_memory the orphan leaves nothing


def test_a_restart_listing_checkpoints_at_once_waits_for_the_directory_an_orphan_commits(disk_dir, shm_root):
    """The HF callback's checkpoint-N is committed by the writer process after its files. A
    restart that lists the checkpoints at once (get_last_checkpoint), then removes staging
    directories of crashed runs, first waits for that writer (wait_for_writers): it finds
    checkpoint-2, and no staging directory is taken from under the writer."""
    from fp_core.saving import commit

    r = subprocess.run([sys.executable, os.path.join(HELPERS, "dir_commit_victim.py"), disk_dir, "256"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    fp_core.api.wait_for_writers(disk_dir)
    assert sorted(n for n in os.listdir(disk_dir) if n.startswith("checkpoint-")) == ["checkpoint-1", "checkpoint-2"]
    commit.recover_dirs(disk_dir, (".fastpersist-staging-",))
    got = fp_core.load(os.path.join(disk_dir, "checkpoint-2", "optimizer.pt"), weights_only=True)
    assert got["w"].numel() == 256 << 18 and bool((got["w"] == 2).all())
    assert json.load(open(os.path.join(disk_dir, "checkpoint-2", "trainer_state.json"))) == {"global_step": 2}
    fp_core.verify(os.path.join(disk_dir, "checkpoint-2"))
    assert wait_gone(int(r.stdout.split()[0]), 30)
    assert _images(shm_root) == []


def test_sigterm_to_a_busy_writer_loses_nothing_handed_over_after_it(disk_dir, shm_root):
    """A scheduler's cancel signals every process of the job at once, while the trainer may
    still hand over its last save: the writer stays until its trainer closes it."""
    with AsyncCheckpointer(writer="process", policy="snapshot") as ck:
        ck.save(_state(), os.path.join(disk_dir, "a.pt")).result()
        os.kill(ck._writer_proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        for i in range(3):
            ck.save(_state(i), os.path.join(disk_dir, f"b{i}.pt")).result()
        pid = ck._writer_proc.pid
    assert wait_gone(pid, 10)
    for i in range(3):
        assert _equal(torch.load(os.path.join(disk_dir, f"b{i}.pt"), weights_only=True), _state(i))
    assert _images(shm_root) == []


def test_a_trainer_killed_in_its_snapshot_keeps_the_previous_checkpoint(disk_dir, shm_root):
    assert _victim(disk_dir, "process", "in-snapshot", 5, mib=128) in (1, 2)
    assert_no_temps(disk_dir)


def test_resume_from_memory_checks_and_falls_back_to_disk(disk_dir, shm_root, caplog):
    caplog.set_level(logging.INFO, "fastpersist")
    path = os.path.join(disk_dir, "ck.pt")
    # a trainer that saves and is then killed: its image stays for the restart
    script = os.path.join(disk_dir, "saver.py")
    with open(script, "w") as f:
        f.write("import os, signal, sys, torch\n"
                f"sys.path.insert(0, {os.path.dirname(HELPERS)!r}); sys.path.insert(0, {HELPERS!r})\n"
                "import fp_core\n"
                "torch.manual_seed(0)\n"
                "from test_pw_state import state\n"
                "ck = fp_core.AsyncCheckpointer(writer='process', resume_from_memory=True)\n"
                f"ck.save(state(), {path!r}); ck.wait()\n"
                "os.kill(os.getpid(), signal.SIGKILL)\n")
    with open(os.path.join(disk_dir, "test_pw_state.py"), "w") as f:
        f.write("import torch\n"
                "def state():\n"
                "    g = torch.Generator().manual_seed(0)\n"
                "    return {'w': torch.randn(600, 1000, generator=g), 'n': torch.arange(9)}\n")
    sys.path.insert(0, disk_dir)
    try:
        from test_pw_state import state
    finally:
        sys.path.remove(disk_dir)
    st = state()
    env = dict(os.environ, PYTHONPATH=disk_dir)
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    image = memory_image.find(path)
    assert image is not None, _images(shm_root)
    hits = memory_image.hits
    assert _equal(fp_core.load(path, weights_only=True), st)
    assert memory_image.hits == hits + 1 and "shared-memory image" in caplog.text
    target = {"w": torch.zeros(600, 1000), "n": torch.zeros(9, dtype=torch.long)}
    fp_core.load_into(target, path)
    assert memory_image.hits == hits + 2 and _equal(target, st)
    # a damaged image: the load says so and reads the disk
    with open(image, "r+b") as f:
        f.seek(os.path.getsize(image) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    caplog.clear()
    assert _equal(fp_core.load(path, weights_only=True), st)
    assert memory_image.hits == hits + 2 and "loading from disk" in caplog.text
    # the file replaced by another writer: the image no longer holds it
    torch.save({"other": torch.ones(2)}, path)
    assert memory_image.find(path) is None
    assert _equal(fp_core.load(path, weights_only=True), {"other": torch.ones(2)})
    # the next run's clean-up removes the stale image (its trainer is gone, its file changed)
    memory_image.clean_stale(memory_image.directory())
    assert _images(shm_root) == []


@pytest.mark.parametrize("kind", ["open", "symlink"])
def test_a_shared_memory_directory_that_is_not_private_is_not_used(disk_dir, shm_root, kind, caplog):
    d = os.path.join(shm_root, f"fastpersist-{os.geteuid()}")
    if kind == "open":
        os.mkdir(d)
        os.chmod(d, 0o777)
    else:
        other = os.path.join(shm_root, "elsewhere")
        os.mkdir(other, 0o700)
        os.symlink(other, d)
    caplog.set_level(logging.WARNING, "fastpersist")
    with AsyncCheckpointer(writer="process") as ck:
        st = _state()
        stats = ck.save(st, os.path.join(disk_dir, "ck.pt")).result()  # the thread writer takes it
        assert "writer" not in stats.extra
    assert _equal(torch.load(os.path.join(disk_dir, "ck.pt"), weights_only=True), st)
    assert d in caplog.text and "FASTPERSIST_SHM_DIR" in caplog.text and "thread writer" in caplog.text
    listed = os.listdir(d) if kind == "open" else os.listdir(os.path.join(shm_root, "elsewhere"))
    assert listed == []  # nothing created there
    assert memory_image.find(os.path.join(disk_dir, "ck.pt")) is None


def test_a_shared_memory_too_small_for_the_snapshot_goes_to_the_thread_writer(disk_dir, mount_tmpfs, monkeypatch,
                                                                              caplog):
    root = mount_tmpfs("8m", "shm")  # as Docker's default /dev/shm is small: no SIGBUS, no failure
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", root)
    caplog.set_level(logging.WARNING, "fastpersist")
    with AsyncCheckpointer(writer="process") as ck:
        st = {"w": torch.randn(4 << 20)}  # 16 MiB
        stats = ck.save(st, os.path.join(disk_dir, "big.pt")).result()
        assert "writer" not in stats.extra
        small = {"w": torch.randn(1 << 18)}
        assert ck.save(small, os.path.join(disk_dir, "small.pt")).result().extra["writer"] == "process"
    assert "MiB free for a 16 MiB snapshot" in caplog.text
    assert _equal(torch.load(os.path.join(disk_dir, "big.pt")), st)
    assert _equal(torch.load(os.path.join(disk_dir, "small.pt")), small)


def test_arenas_of_an_owner_whose_lock_is_held_are_never_cleaned(shm_root):
    """A restart's clean-up must leave alone the arenas an orphaned writer still has queued
    (its trainer is gone, the lock it inherited is held); once the lock goes, they go."""
    d = memory_image.directory()
    owner = memory_image.OwnerLock(d)
    arena = os.path.join(d, f"{owner.key}-0{memory_image.IMAGE_SUFFIX}")
    open(arena, "wb").close()
    memory_image.clean_stale(d)
    assert os.path.exists(arena) and not memory_image.frozen(arena)
    owner.release()
    assert memory_image.frozen(arena)
    memory_image.clean_stale(d)
    assert _images(shm_root) == []


def test_a_restart_waits_only_for_an_orphans_jobs_on_its_file(shm_root, caplog):
    """Which writers a restart's load waits for: an owner lock held (a writer still runs),
    its trainer's own lock free (the trainer is gone), and a job mark naming that file.
    A live trainer's writer, or a job for another file, is not waited for."""
    d = memory_image.directory()
    owner = memory_image.OwnerLock(d)
    image = os.path.join(d, f"{owner.key}-0{memory_image.IMAGE_SUFFIX}")
    mine, other = os.path.realpath("/x/ckpt.pt"), os.path.realpath("/x/other.pt")
    memory_image.mark_job(image, mine)

    def waited(target, timeout=0.4):
        t0 = time.monotonic()
        memory_image.wait_for_orphans(d, target, timeout=timeout)
        return time.monotonic() - t0 >= timeout

    try:
        assert not waited(mine)  # the trainer is alive: its writer is no orphan
        os.close(owner.trainer_fd)  # the trainer dies (its writer still holds the owner lock)
        owner.trainer_fd = -1
        assert waited(mine) and "still run" in caplog.text
        assert waited(None)  # a restart that does not know its file waits for any job
        assert not waited(other)
        memory_image.unmark_job(image)  # the writer committed it
        assert not waited(mine)
        memory_image.mark_job(image, mine)
    finally:
        owner.release()  # the writer is gone too: nothing to wait for, its mark is stale
    assert not waited(mine)
    memory_image.clean_stale(d)
    assert _images(shm_root) == []


def test_a_restart_with_the_same_pid_is_another_owner(disk_dir, shm_root):
    """In a container a restarted trainer often gets its predecessor's pid: the image that
    run kept is found, loaded mapped (its owner is gone), and the new run's arenas do not
    collide with it."""
    path = os.path.join(disk_dir, "ck.pt")
    st = _state()
    with AsyncCheckpointer(writer="process", resume_from_memory=True) as ck:
        ck.save(st, path).result()
        old = ck._writer_proc
        # what a SIGKILL leaves: the image and its record, the owner's lock let go
        old._free.clear()
        old._all = type(old._all)()
        old.lock.release()
        image = memory_image.find(path)
        assert image is not None and memory_image.frozen(image)
        ck._writer_proc = None  # the "restart" in this same process (same pid)
        hits = memory_image.hits
        assert _equal(fp_core.load(path, weights_only=True), st) and memory_image.hits == hits + 1
        ck.save(_state(1), path).result()  # no FileExistsError on an arena name
        assert ck._writer_proc.lock.key != old.lock.key
        old.close()
    assert _images(shm_root) == []  # the old image was superseded by the new commit; close removed the rest


def test_the_images_command_lists_kept_images_and_frees_only_those_of_runs_gone(disk_dir, shm_root, capsys):
    from fp_core.tools.cli import main

    gone_path, live_path = os.path.join(disk_dir, "gone.pt"), os.path.join(disk_dir, "live.pt")
    gone = AsyncCheckpointer(writer="process", resume_from_memory=True)
    gone.save(_state(), gone_path).result()
    wp = gone._writer_proc
    wp._free.clear()  # what a SIGKILL leaves: the image and its record, the owner's locks let go
    wp._all = type(wp._all)()
    wp.lock.release()
    with AsyncCheckpointer(writer="process", resume_from_memory=True) as live:
        live.save(_state(1), live_path).result()
        assert main(["images", "--json"]) == 0
        listed = {i["checkpoint"]: i for i in json.loads(capsys.readouterr().out)}
        assert listed[gone_path]["live"] is False and listed[live_path]["live"] is True
        assert all(i["current"] and i["bytes"] >= os.path.getsize(p) for p, i in listed.items())
        assert main(["images"]) == 0 and "owner gone" in capsys.readouterr().out
        assert main(["images", "--remove"]) == 0
        assert "1 image(s) removed" in capsys.readouterr().out
        assert memory_image.find(gone_path) is None  # freed: a load reads the disk
        assert memory_image.find(live_path) is not None  # a running trainer's image is never touched
        assert _equal(fp_core.load(gone_path, weights_only=True), _state())
    wp.close()
    assert _images(shm_root) == []


def test_a_failure_before_the_hand_over_does_not_stall_later_saves(disk_dir, shm_root, monkeypatch):
    """An arena that cannot be had on the writer thread (cpu_work_at_save=False) fails that
    save; its sequence number is skipped, so the next saves are not held up behind it."""
    from fp_core.pipeline.process_writer import WriterProcess

    real = WriterProcess.take_arena
    calls = {"n": 0}

    def flaky(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device (injected)")
        return real(self, *a, **kw)

    monkeypatch.setattr(WriterProcess, "take_arena", flaky)
    with AsyncCheckpointer(writer="process", cpu_work_at_save=False) as ck:
        ck.save(_state(0), os.path.join(disk_dir, "a.pt")).result(60)
        h = ck.save(_state(1), os.path.join(disk_dir, "b.pt"))
        with pytest.raises(AsyncCheckpointError):
            h.result(60)
        ck.save(_state(2), os.path.join(disk_dir, "c.pt")).result(60)
    assert not os.path.exists(os.path.join(disk_dir, "b.pt"))
    assert _equal(torch.load(os.path.join(disk_dir, "c.pt"), weights_only=True), _state(2))


def test_a_forked_child_leaves_the_parents_writer_alone(disk_dir, shm_root):
    with AsyncCheckpointer(writer="process") as ck:
        ck.save(_state(0), os.path.join(disk_dir, "a.pt")).result()
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say: it drops its copies and exits
            import gc

            ck._writer_proc = None
            gc.collect()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        ck.save(_state(1), os.path.join(disk_dir, "b.pt")).result(60)
    assert _equal(torch.load(os.path.join(disk_dir, "b.pt"), weights_only=True), _state(1))


def test_no_writer_is_left_after_an_exception_or_a_plain_exit(disk_dir, shm_root):
    code = ("import os, sys, torch\n"
            f"sys.path.insert(0, {os.path.dirname(HELPERS)!r})\n"
            "import fp_core\n"
            "ck = fp_core.AsyncCheckpointer(writer='process', resume_from_memory=True)\n"
            f"ck.save({{'w': torch.ones(1 << 20)}}, {os.path.join(disk_dir, 'a.pt')!r})\n"
            "print(ck._writer_proc.pid, flush=True)\n"
            "if sys.argv[1] == 'raise':\n"
            "    raise RuntimeError('training failed')\n")
    for how in ("raise", "exit"):
        r = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=120)
        assert r.returncode == (1 if how == "raise" else 0), r.stderr[-2000:]
        pid = int(r.stdout.split()[0])
        assert wait_gone(pid, 10), f"writer {pid} outlived its trainer's {how}"
        assert check_torch(os.path.join(disk_dir, "a.pt"))
        # an exit on an exception keeps the image for a restart; a plain exit closes it away
        # (and its first commit dropped the image the failed run left)
        assert (memory_image.find(os.path.join(disk_dir, "a.pt")) is not None) == (how == "raise")
    assert _images(shm_root) == []


def check_torch(path: str) -> bool:
    fp_core.verify(path)
    return bool((torch.load(path, weights_only=True)["w"] == 1).all())


def test_torchrun_a_killed_rank_and_the_restart_resume_from_memory(disk_dir, shm_root):
    """2 ranks; rank 1 SIGKILLed after step 3's fence, rank 0 stopped by torchrun; the restart
    finds both files committed and loads each from its shared-memory image."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                        "1", "--master-port", free_port(), os.path.join(HELPERS, "torchrun_process_writer.py"),
                        disk_dir], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(2):
        with open(os.path.join(disk_dir, f"result{rank}.json")) as f:
            res = json.load(f)
        assert res == {**res, "attempt": 1, "from_memory": True, "same": True, "step": 3}, res
        old_writer = int(open(os.path.join(disk_dir, f"writer{rank}.pid")).read())
        assert wait_gone(old_writer, 1), f"rank {rank}'s first writer is still running"
        assert torch.load(os.path.join(disk_dir, f"rank{rank}.pt"), weights_only=True)["step"] == 4
    assert _images(shm_root) == []  # the restart's commits superseded the old images; close removed its own
    assert_no_temps(disk_dir)


def test_overlap_reads_tensors_in_shared_memory_until_the_fence(disk_dir, shm_root):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 16))
    model.share_memory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = os.path.join(disk_dir, "ov.pt")
    with AsyncCheckpointer(writer="process", policy="overlap", resume_from_memory=True) as ck:
        for _ in range(3):
            want = {k: v.clone() for k, v in model.state_dict().items()}
            h = ck.save(model.state_dict(), path)
            model(torch.randn(4, 1024)).sum().backward()
            opt.step()  # the hook fences: the writer process has read the live tensors
            opt.zero_grad()
            stats = h.result()
            assert stats.policy == "overlap" and stats.extra["writer"] == "process"
            assert _equal(torch.load(path, weights_only=True), want)
            fp_core.verify(path)
            assert memory_image.find(path) is None  # the arena holds no image of an overlap save
        # tensors not in shared memory: the writer process needs a snapshot
        st = _state()
        stats = ck.save(st, os.path.join(disk_dir, "private.pt")).result()
        assert stats.policy == "snapshot" and _equal(torch.load(os.path.join(disk_dir, "private.pt")), st)
    assert_no_temps(disk_dir)


def test_small_shared_memory_overlap_and_a_bigger_snapshot_make_room(disk_dir, mount_tmpfs, monkeypatch):
    """A small /dev/shm (Docker's): an overlap save copies only its small tensors there
    (their pages taken first: no SIGBUS), and a snapshot that fits only once the free arena
    of another size is dropped gets that room."""
    root = mount_tmpfs("8m", "shm")
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", root)
    big = torch.randn(6 << 20).share_memory_()  # 24 MiB, read in place
    st = {"big": big, "small": torch.arange(1000)}
    with AsyncCheckpointer(writer="process", policy="overlap") as ck:
        stats = ck.save(st, os.path.join(disk_dir, "ov.pt")).result()
        assert stats.policy == "overlap" and stats.extra["writer"] == "process"
    assert _equal(torch.load(os.path.join(disk_dir, "ov.pt")), st)
    with AsyncCheckpointer(writer="process") as ck:
        a = {"w": torch.randn(5 << 18)}  # 5 MiB
        b = {"w": torch.randn(6 << 18)}  # 6 MiB: fits once a's arena is gone
        assert ck.save(a, os.path.join(disk_dir, "a.pt")).result().extra["writer"] == "process"
        assert ck.save(b, os.path.join(disk_dir, "b.pt")).result().extra["writer"] == "process"
    assert _equal(torch.load(os.path.join(disk_dir, "b.pt")), b)


def _killed_after_saving_old_a(disk_dir: str) -> None:
    """A run that saved ``old/a.pt`` with resume_from_memory, then was SIGKILLed."""
    os.mkdir(os.path.join(disk_dir, "old"))
    _killed_after_saving(os.path.join(disk_dir, "old", "a.pt"))


def _killed_after_saving(path: str) -> None:
    """A trainer that saved ``path`` with resume_from_memory (committed), then was SIGKILLed."""
    code = ("import os, signal, sys, torch\n"
            f"sys.path.insert(0, {os.path.dirname(HELPERS)!r})\n"
            "import fp_core\n"
            "ck = fp_core.AsyncCheckpointer(writer='process', resume_from_memory=True)\n"
            f"ck.save({{'w': torch.ones(1 << 20)}}, {path!r}).result()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]


@pytest.mark.parametrize("end", ["second commit", "clean close"])
def test_a_peer_killed_during_this_run_keeps_its_image_for_its_restart(disk_dir, shm_root, end):
    """Rank 1 of this run is killed after committing its file beside rank 0's; rank 0 lives
    on. Its second commit, which takes a killed run's images in its directory as superseded,
    and its clean close take only an earlier run's: rank 1's image is what rank 1's restart
    resumes from, and stays."""
    earlier, peer = os.path.join(disk_dir, "earlier.pt"), os.path.join(disk_dir, "rank1.pt")
    _killed_after_saving(earlier)  # a run before this one
    with AsyncCheckpointer(writer="process", resume_from_memory=True) as ck:
        ck.save(_state(0), os.path.join(disk_dir, "rank0.pt")).result()
        _killed_after_saving(peer)
        assert memory_image.find(peer) is not None and memory_image.find(earlier) is not None
        ck.save(_state(1), os.path.join(disk_dir, "rank0.pt")).result()
        if end == "second commit":
            assert memory_image.find(peer) is not None and memory_image.find(earlier) is None
    kept = {i["checkpoint"] for i in memory_image.kept_images(memory_image.directory())}
    assert peer in kept and earlier not in kept, kept
    hits = memory_image.hits
    assert torch.equal(fp_core.load(peer, weights_only=True)["w"], torch.ones(1 << 20))
    assert memory_image.hits == hits + 1  # the restart of rank 1 reads it from memory


def test_a_clean_end_of_the_restart_drops_the_image_it_resumed_from(disk_dir, shm_root):
    _killed_after_saving_old_a(disk_dir)
    assert memory_image.find(os.path.join(disk_dir, "old", "a.pt")) is not None
    with AsyncCheckpointer(writer="process", resume_from_memory=True) as ck:
        got = fp_core.load(os.path.join(disk_dir, "old", "a.pt"))
        ck.save(got, os.path.join(disk_dir, "new.pt")).result()  # elsewhere: the old image stays meanwhile
        assert memory_image.find(os.path.join(disk_dir, "old", "a.pt")) is not None
    assert _images(shm_root) == []  # the clean close dropped the image it resumed from


def test_the_image_of_a_checkpoint_rotated_away_is_dropped_by_a_later_commit(disk_dir, shm_root):
    """A restart keeps the image it resumed from while that file is there (a second crash
    resumes from it again); once the file is gone (rotated away), a commit drops it."""
    _killed_after_saving_old_a(disk_dir)
    old = os.path.join(disk_dir, "old", "a.pt")
    with AsyncCheckpointer(writer="process", resume_from_memory=True) as ck:
        got = fp_core.load(old)
        for i in range(3):
            ck.save(got, os.path.join(disk_dir, f"new{i}.pt")).result()
        assert memory_image.find(old) is not None  # still the file it holds
        os.unlink(old)  # rotated away
        ck.save(got, os.path.join(disk_dir, "new3.pt")).result()
        images = {i["checkpoint"] for i in memory_image.kept_images(memory_image.directory())}
        assert old not in images and os.path.join(disk_dir, "new3.pt") in images
