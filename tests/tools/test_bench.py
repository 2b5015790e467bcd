"""The benchmark CLIs run end to end (tiny sizes) and report what their tables claim."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from fp_core.tools.bench import paired_ratio

# The CLI as ``-m fp_core.tools.cli`` runs it, except for what only makes a real
# disk's timings fair and that these tests never check (they check rows, rounds, ratios and
# cleanup): bench.settle keeps its os.sync() but not its sleep (0.5 s per save row, 2 s before
# every load row of every round: most of these tests' time), and the whole machine's page
# cache is not dropped (as for a bench run without root: drop_all_caches returns False; as
# root it made every later test of the session import torch & co. from the disk again).
# Lightning's _atomic_save is looked up when the "lightning" row first saves, not before
# every run (importing lightning took 3 to 8 s of each run; these tests never ask for that row).
_CLI_NO_SETTLE = ("import os, runpy; import fp_core.tools.bench as b; b.settle = lambda seconds=0.5: os.sync(); "
                  "b.drop_all_caches = lambda: False; las = b._lightning_atomic_save; "
                  "b._lightning_atomic_save = lambda: lambda sd, path: las()(sd, path); "
                  "runpy.run_module('fp_core.tools.cli', run_name='__main__', alter_sys=True)")


def _no_settle(monkeypatch) -> None:
    """The same for a bench run in this process."""
    from fp_core.tools import bench

    monkeypatch.setattr(bench, "settle", lambda seconds=0.5: os.sync())
    monkeypatch.setattr(bench, "drop_all_caches", lambda: False)


def _bench(args: list[str], cwd: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CLI_NO_SETTLE, "bench", *args, "--json"], cwd=cwd,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_paired_ratio_pairs_rounds():
    # round 1: row twice as fast as base; round 2: same speed; round 3: 4x
    assert paired_ratio([1.0, 2.0, 0.5], [2.0, 2.0, 2.0]) == 2.0
    assert paired_ratio([1.0], [3.0]) == 3.0


def test_sync_target_counts_the_rounds_at_the_device_row():
    from fp_core.tools.bench import Row, targets

    def row(key: str, seconds: list[float]) -> Row:
        return Row(key=key, label=key, kind="save", bytes=1, seconds=seconds)

    def per_round(fp: list[float]) -> dict:
        got = targets({"device": row("device", [1.0] * len(fp)), "fastpersist": row("fastpersist", fp)})
        return next(t for t in got if "rounds" in t["target"])

    t = per_round([1.0, 1.05, 1.2, 1.1, 1.0])  # 1.2 s against 1.0 s: 0.83x, the only miss
    assert t["pass"] and t["value"] == "4 of 5 (1.00 0.95 0.83 0.91 1.00)"
    t = per_round([1.0, 1.2, 1.2, 1.1, 1.0])
    assert not t["pass"] and t["value"].startswith("3 of 5")


def test_sync_bench_rounds_and_ratios(tmp_path):
    out_dir = tmp_path / "out"
    res = _bench(["--size", "8MiB", "--repeat", "2", "--dir", str(out_dir),
                  "--only", "device,torch,fastpersist,load_torch,load_fastpersist,load_fastpersist_mmap_verify"],
                 cwd=str(tmp_path))
    rows = {r["key"]: r for r in res["rows"]}
    assert res["repeat"] == 2 and res["warmup_rounds"] == 1  # 3 rounds ran, the first not counted
    assert set(rows) == {"device", "torch", "fastpersist", "load_torch", "load_fastpersist",
                         "load_fastpersist_mmap_verify"}
    for r in rows.values():
        assert not r["error"] and len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"])
    targets = {t["target"]: t for t in res["targets"]}
    want = paired_ratio(rows["fastpersist"]["seconds"], rows["device"]["seconds"])
    assert targets["(f) >= 0.9 x (a)"]["value"] == round(want, 3)
    want = paired_ratio(rows["load_fastpersist"]["seconds"], rows["load_torch"]["seconds"])
    assert targets["fp_core.load >= 2 x torch.load (cold)"]["value"] == round(want, 3)
    assert os.listdir(out_dir) == []  # every benchmark file removed


@pytest.mark.filterwarnings("ignore")
def test_async_bench_rounds(tmp_path):
    res = _bench(["--async", "--dir", str(tmp_path / "a"), "--modes", "none,auto,overlap,snapshot,overlap_bg", "--iters", "2",
                  "--warmup", "1", "--rounds", "2", "--width", "64", "--layers", "2", "--batch", "8"],
                 cwd=str(tmp_path))
    assert res["rounds"] == 2
    modes = {m["mode"]: m for m in res["modes"]}
    assert list(modes) == ["none", "auto", "overlap", "snapshot", "overlap_bg"]
    for name, m in modes.items():
        # 2 rounds x 2 iterations; the baseline runs before and after each of the 4 modes
        assert len(m["step_seconds"]) == (2 * 5 * 2 if name == "none" else 4)
        assert len(m["slowdown_per_round"]) == 2
        assert (m["cpu_per_ckpt"] is None) == (name == "none")
        assert (m["first_cost"] is None) == (name == "none") and m["warmup_seconds"] > 0
    assert modes["none"]["slowdown"] == 0.0
    assert os.listdir(tmp_path / "a") == []  # every mode's file removed
    ov = modes["overlap"]
    assert ov["slowdown"] == pytest.approx(sum(ov["slowdown_per_round"]) / 2)
    assert {t["target"] for t in res["targets"]} >= {"auto: slowdown <= 5%", "overlap: slowdown <= 5%",
                                                     "snapshot: slowdown <= 5%"}
    # each save's policy, the warm-up's included: 1 + 2 saves per round
    assert modes["overlap"]["fp_stats"]["policies"] == ["overlap"] * 3
    assert modes["snapshot"]["fp_stats"]["policies"] == ["snapshot"] * 3


def test_merge_rounds_keeps_one_time_costs_out_of_the_measured_steps():
    """The warm-up iterations' extra time is its own figure ("warm-up +s"), per round
    against the same round's baseline, and never enters slowdown or cost/ckpt."""
    from fp_core.tools.bench_async import merge_rounds

    def run(mode, steps, warm):
        return {"mode": mode, "label": mode, "step_seconds": steps, "total_seconds": sum(steps),
                "warmup_seconds": warm, "blocked_per_ckpt": 0.1, "drain_seconds": 0.0, "cpu_per_iter": 1.0}

    base = [run("none", [2.0, 2.0], 4.0), run("none", [2.0, 2.0], 4.2)]
    auto = merge_rounds([run("auto", [2.1, 2.1], 6.0), run("auto", [2.0, 2.2], 5.2)], base, None)
    assert auto["first_cost_per_round"] == pytest.approx([2.0, 1.0])
    assert auto["first_cost"] == pytest.approx(1.5)
    assert auto["cost_per_round"] == pytest.approx([0.1, 0.1]) and auto["slowdown"] == pytest.approx(0.05)
    none = merge_rounds(base, base, None)
    assert none["first_cost"] is None and none["first_cost_per_round"] == []


def test_median_ci_is_the_order_statistics_interval():
    from fp_core.tools.bench_async import median_ci

    assert median_ci([0.01] * 5) is None  # 5 rounds cannot give 95%
    xs = [0.07, 0.01, 0.05, 0.03, 0.02, 0.08, 0.04, 0.06]
    assert median_ci(xs) == (0.01, 0.08, pytest.approx(1 - 2 / 256))  # n = 8: min..max, 99.2%
    lo, hi, cov = median_ci([i / 100 for i in range(12)])
    assert (lo, hi) == (0.02, 0.09) and cov == pytest.approx(0.9614, abs=1e-4)  # n = 12: x(3)..x(10)


def test_slowdown_target_says_whether_the_run_settles_it():
    from fp_core.tools.bench_async import async_targets, median_ci

    def mode(name, per_round):
        return {"mode": name, "slowdown": sorted(per_round)[len(per_round) // 2], "slowdown_ci": median_ci(per_round),
                "blocked_vs_torch_save": None}

    res = {"modes": [mode("overlap", [0.01, 0.02, 0.03, 0.04, 0.02, 0.03]),
                     mode("snapshot", [0.01, 0.09, 0.03, 0.04, 0.06, 0.03]),
                     mode("auto", [0.06, 0.07, 0.08, 0.06, 0.09, 0.07])]}
    notes = {t["target"].split(":")[0]: t["note"] for t in async_targets(res)}
    assert notes["overlap"].endswith(": met") and notes["auto"].endswith(": missed")
    assert notes["snapshot"] == "median's 97% CI +1.0..+9.0%: not settled by this run"


@pytest.mark.parametrize("huge", [True, False])
def test_disk_floor_writes_the_checkpoints_bytes(tmp_path, huge):
    from fp_core.tools.bench_async import HUGE_PAGE, DiskOnly, Trainer
    from fp_core.tools.common import tensors_in

    tr = Trainer(64, 2, 8)
    tr.step()
    path = str(tmp_path / "floor.bin")
    mode = DiskOnly(path, tr, {}, huge=huge)
    assert mode.buf.data_ptr() % (HUGE_PAGE if huge else 4096) == 0
    expected = b"".join(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                        for t in tensors_in(tr.state()))
    assert mode.nbytes == len(expected) > 0
    mode.save(tr)
    mode.save(tr)  # waits for the first write: one in flight
    mode.drain()
    with open(path, "rb") as f:
        assert f.read() == expected


@pytest.mark.filterwarnings("ignore")
def test_async_bench_reports_slowdown_beyond_the_disk_floor(tmp_path):
    res = _bench(["--async", "--dir", str(tmp_path / "a"), "--modes", "none,disk,overlap", "--iters", "2",
                  "--warmup", "1", "--rounds", "2", "--width", "64", "--layers", "2", "--batch", "8"],
                 cwd=str(tmp_path))
    modes = {m["mode"]: m for m in res["modes"]}
    floor, ov = modes["disk"]["slowdown_per_round"], modes["overlap"]["slowdown_per_round"]
    assert ov and len(floor) == len(ov) == 2
    assert modes["overlap"]["over_floor"] == pytest.approx(sum(a - b for a, b in zip(ov, floor)) / 2)
    assert "over_floor" not in modes["disk"] and "over_floor" not in modes["none"]
    # cost/ckpt: the same per-round difference in seconds per iteration
    n = 2
    for m in (modes["disk"], modes["overlap"]):
        for i, (slow, cost) in enumerate(zip(m["slowdown_per_round"], m["cost_per_round"])):
            total = sum(m["step_seconds"][i * n:(i + 1) * n])
            assert cost == pytest.approx((total - total / (1 + slow)) / n)
        assert m["cost_per_ckpt"] == pytest.approx(sum(m["cost_per_round"]) / 2)
    assert modes["none"]["cost_per_ckpt"] is None
    assert modes["disk"]["label"].endswith(("(4 KiB pages), no ckpt", "(2 MiB pages), no ckpt"))


def test_overlap_huge_runs_only_beside_the_baselines(tmp_path):
    args = ["--async", "--dir", str(tmp_path / "a"), "--iters", "1", "--warmup", "0", "--rounds", "1",
            "--width", "64", "--layers", "2", "--batch", "8"]
    res = _bench(args + ["--modes", "none,disk,overlap_huge"], cwd=str(tmp_path))
    assert [m["mode"] for m in res["modes"]] == ["none", "disk", "overlap_huge"]
    assert res["modes"][2]["fp_stats"]["policy"] == "overlap"
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "bench", *args, "--modes", "none,overlap,overlap_huge"],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode != 0 and "overlap_huge moves the trainer's tensors" in out.stderr
    assert os.listdir(tmp_path / "a") == []


def test_calibration_lands_within_tolerance_of_a_nonlinear_step(monkeypatch):
    """The batch search converges on a step time that is far from linear in the batch
    (a clock advanced by the fake step, so the test does not depend on this machine)."""
    import fp_core.tools.bench_async as ba

    def cost_ms(b: int) -> float:
        return 5 + 0.002 * b ** 1.5

    class Fake:
        now = 0.0

        def set_batch(self, b: int) -> None:
            self.b = b

        def step(self) -> None:
            Fake.now += cost_ms(self.b) / 1e3

    monkeypatch.setattr(ba.time, "perf_counter", lambda: Fake.now)
    batch = ba.calibrate_batch(Fake(), 2000.0)  # type: ignore[arg-type]
    assert abs(cost_ms(batch) - 2000.0) <= 0.05 * 2000.0


# ---------------------------------------------------------------- device options (issue #16)


def test_async_bench_dry_run_for_cuda_needs_no_device(tmp_path):
    """The GPU command line of benchmarks/gpu_check.sh parses and sizes itself anywhere."""
    from fp_core.tools.bench_async import checkpoint_bytes

    args = ["--async", "--device", "cuda", "--dtype", "bfloat16", "--adam", "fused", "--width", "8192", "--layers", "14",
            "--modes", "none,auto,overlap,snapshot,torch,lightning,dcp", "--iters", "2", "--warmup", "1",
            "--rounds", "1", "--no-write-probe", "--dry-run", "--dir", str(tmp_path / "a")]
    plan = _bench(args, cwd=str(tmp_path))
    assert plan["dry_run"] and plan["device"] == "cuda" and plan["dtype"] == "bfloat16" and plan["adam"] == "fused"
    assert plan["checkpoint_bytes"] == checkpoint_bytes(8192, 14, torch.bfloat16) > 5e9
    assert plan["modes"] == ["none", "auto", "overlap", "snapshot", "torch", "lightning", "dcp"]
    assert plan["write_probe"] is False
    assert not (tmp_path / "a").exists()  # nothing built, nothing written
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "bench", *args], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0 and out.stdout.startswith("dry run: MLP 14x8192 bfloat16 on cuda (939.6M params + "
                                                         "fused Adam)"), out.stdout + out.stderr


def test_sync_bench_dry_run_for_cuda(tmp_path):
    plan = _bench(["--device", "cuda", "--size", "4GiB", "--only", "device,torch,fastpersist,load_torch,load_fastpersist",
                   "--dry-run", "--dir", str(tmp_path / "s")], cwd=str(tmp_path))
    assert plan["dry_run"] and plan["device"] == "cuda" and plan["size_bytes"] == 4 << 30
    assert plan["rows"] == ["device", "torch", "fastpersist", "load_torch", "load_fastpersist"]
    assert not (tmp_path / "s").exists()
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "bench", "--only", "nope", "--dry-run"], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode != 0 and "unknown rows" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("extra", [["--async"], []], ids=["async", "sync"])
def test_device_cuda_without_a_gpu_is_refused_with_a_reason(tmp_path, extra):
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "bench", *extra, "--device", "cuda", "--size", "1MiB",
                          "--dir", str(tmp_path / "x")], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode != 0 and "no CUDA device here" in out.stderr


def test_checkpoint_bytes_matches_the_trainers_checkpoint():
    from fp_core.tools.bench_async import Trainer, checkpoint_bytes
    from fp_core.tools.common import payload_bytes

    for dtype, fused in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
        tr = Trainer(64, 3, 4, dtype=dtype, fused_adam=fused)
        tr.step()
        assert tr.model[0].weight.dtype == dtype
        assert payload_bytes(tr.state()) == checkpoint_bytes(64, 3, dtype)
        steps = [v["step"] for v in tr.opt.state_dict()["state"].values()]
        assert all(s.dtype == torch.float32 for s in steps)


@pytest.mark.filterwarnings("ignore")
def test_async_bench_dtype_json_out_and_no_write_probe(tmp_path):
    from fp_core.tools.bench_async import checkpoint_bytes, format_async

    json_out = tmp_path / "res.json"
    res = _bench(["--async", "--dir", str(tmp_path / "a"), "--modes", "none,overlap", "--iters", "1", "--warmup", "0",
                  "--rounds", "1", "--width", "64", "--layers", "2", "--batch", "8", "--dtype", "bfloat16",
                  "--no-write-probe", "--json-out", str(json_out)], cwd=str(tmp_path))
    assert res["dtype"] == "bfloat16" and res["device"] == "cpu" and res["write_alone_seconds"] is None
    assert res["checkpoint_bytes"] == checkpoint_bytes(64, 2, torch.bfloat16)
    assert json.loads(json_out.read_text()) == res
    text = format_async(res)
    assert "write alone: not measured" in text and "bfloat16 on cpu" in text
    assert res["pages"].startswith("pages: ") and res["pages"] in text  # which pages the model sits on


@pytest.mark.filterwarnings("ignore")
def test_a_failing_mode_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    import fp_core.tools.bench_async as ba
    from fp_core.tools.bench_args import add_arguments

    def boom(self, tr):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ba.TorchSync, "save", boom)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--async", "--dir", str(tmp_path / "a"), "--modes", "none,torch,overlap", "--iters", "1",
                              "--warmup", "0", "--rounds", "2", "--width", "32", "--layers", "2", "--batch", "4",
                              "--no-write-probe"])
    logged: list[str] = []
    assert ba.run_async(args, logged.append) == 0
    out = capsys.readouterr().out
    assert "failed" in out and "No space left on device" in out
    assert sum("torch failed" in line for line in logged) == 1  # not retried in round 2
    assert any(line.strip().startswith("overlap: step median") for line in logged)  # per-run progress lines
    args.json = True
    assert ba.run_async(args, logged.append) == 0
    res = json.loads(capsys.readouterr().out)
    modes = {m["mode"]: m for m in res["modes"]}
    assert modes["torch"]["error"].startswith("OSError")
    assert len(modes["overlap"]["slowdown_per_round"]) == 2 and modes["overlap"]["blocked_vs_torch_save"] is None
    assert len(modes["none"]["step_seconds"]) == 2 * 2  # per round: before and after overlap (torch ran none)
    assert all(not t["target"].startswith("torch") for t in res["targets"])
    assert os.listdir(tmp_path / "a") == []


def test_calibration_caps_the_batch_and_starts_where_told(monkeypatch):
    import fp_core.tools.bench_async as ba

    seen: list[int] = []

    class Fake:
        now = 0.0

        def set_batch(self, b: int) -> None:
            self.b = b
            seen.append(b)

        def step(self) -> None:
            Fake.now += (3 + 0.1 * self.b) / 1e3  # launch-bound below ~30, then linear, as on a GPU

    monkeypatch.setattr(ba.time, "perf_counter", lambda: Fake.now)
    assert ba.calibrate_batch(Fake(), 1500.0, start=(64, 1024), max_batch=5000) == 5000  # 14970 wanted
    assert seen[:2] == [64, 1024] and max(seen) <= 5000
    seen.clear()
    batch = ba.calibrate_batch(Fake(), 1500.0, start=(64, 1024))
    assert abs(3 + 0.1 * batch - 1500) <= 0.05 * 1500


def test_sync_bench_json_out_names_the_device(tmp_path):
    json_out = tmp_path / "sync.json"
    res = _bench(["--size", "4MiB", "--repeat", "1", "--warmup-rounds", "0", "--dir", str(tmp_path / "s"),
                  "--only", "torch,fastpersist,load_fastpersist", "--json-out", str(json_out)], cwd=str(tmp_path))
    assert res["device"] == "cpu" and json.loads(json_out.read_text()) == res
    share = res["huge_page_share"]  # which pages the state sits on, said with every table
    assert share is None or 0.0 <= share <= 1.0
    assert res["pages"].startswith("pages: ") and "THP_MEM_ALLOC_ENABLE=" in res["pages"]
    assert {r["key"] for r in res["rows"]} == {"torch", "fastpersist", "load_fastpersist"}


@pytest.mark.parametrize("script,flags", [("lightning_finetune.py", ("--accelerator", "--devices", "--large")),
                                          ("hf_finetune.py", ("--device", "--large"))])
def test_examples_take_a_device(script, flags):
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", script), "--help"], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(f in out.stdout for f in flags), out.stdout


def test_calibration_never_extrapolates_from_a_flat_or_falling_pair(monkeypatch):
    """A VM pause made the small batch's step slower than the larger one's: the slope was
    floored and the fit asked for a batch of millions (24 GB of activations: the async bench
    was OOM-killed). Now it steps on from what it measured and still lands on the target."""
    import fp_core.tools.bench_async as ba

    seen: list[int] = []

    def cost_ms(b: int) -> float:
        return 5 + 0.5 * b

    class Fake:
        now = 0.0
        paused = True  # while the first batch is timed

        def set_batch(self, b: int) -> None:
            if b != 8:
                Fake.paused = False
            self.b = b
            seen.append(b)

        def step(self) -> None:
            Fake.now += (cost_ms(self.b) + (1000 if Fake.paused else 0)) / 1e3

    monkeypatch.setattr(ba.time, "perf_counter", lambda: Fake.now)
    batch = ba.calibrate_batch(Fake(), 2000.0, tries=6)  # type: ignore[arg-type]
    assert max(seen) <= 4 * 1024, seen
    assert abs(cost_ms(batch) - 2000.0) <= 0.05 * 2000.0, (batch, seen)


def test_cpu_calibration_is_capped_by_available_memory():
    import fp_core.tools.bench_async as ba

    tr = ba.Trainer(256, 2, 8)
    cap = ba.max_batch_for(tr)
    avail = ba.available_memory()
    assert avail is not None and cap is not None
    assert cap * 6 * 2 * 256 * 4 <= avail // 4 + 6 * 2 * 256 * 4


def test_load_into_is_also_measured_against_reads_into_4k_pages(tmp_path):
    """``load_into`` fills a model's tensors, on 4 KiB pages unless torch was told
    otherwise: the row that reads into such pages is its second reference."""
    res = _bench(["--size", "8MiB", "--repeat", "2", "--dir", str(tmp_path / "out"),
                  "--only", "load_device,load_device_4k,load_into"], cwd=str(tmp_path))
    rows = {r["key"]: r for r in res["rows"]}
    assert set(rows) == {"load_device", "load_device_4k", "load_into"}
    assert all(not r["error"] and len(r["seconds"]) == 2 for r in rows.values())
    targets = {t["target"]: t for t in res["targets"]}
    want = paired_ratio(rows["load_into"]["seconds"], rows["load_device_4k"]["seconds"])
    assert targets["load_into >= 0.9 x load_device_4k (the tensors' pages)"]["value"] == round(want, 3)
    assert "load_into >= 0.9 x load_device" in targets


def test_the_4k_row_reads_into_memory_off_huge_pages():
    import re

    from fp_core.tools.bench import _small_page_buffer

    buf = _small_page_buffer(64 << 20)  # made without THP too: its pages are 4 KiB there anyway
    assert (buf == 0xA5).all()
    if not os.path.isdir("/sys/kernel/mm/transparent_hugepage"):
        pytest.skip("a kernel without transparent huge pages: nothing to keep the buffer off")
    start = buf.ctypes.data
    with open("/proc/self/smaps") as f:
        text = f.read()
    for head, body in re.findall(r"^([0-9a-f]+-[0-9a-f]+) [^\n]*\n((?:[A-Z][^\n]*\n)+)", text, re.M):
        lo, hi = (int(x, 16) for x in head.split("-"))
        if lo <= start < hi:
            flags = re.search(r"VmFlags:([^\n]*)", body)
            if flags is None:
                pytest.skip("/proc/self/smaps has no VmFlags here")
            assert re.search(r"AnonHugePages:\s+0 kB", body)
            assert "nh" in flags.group(1).split()
            break
    else:
        pytest.fail("the buffer's mapping is not in /proc/self/smaps")


def test_a_4k_row_without_its_memory_fails_alone(tmp_path, monkeypatch):
    """The 4 KiB buffer is made outside the rounds: a failure to make it is the row's
    error, and the other rows still run."""
    import argparse

    from fp_core.tools import bench

    def refuse(nbytes):
        raise MemoryError("no memory for the 4 KiB row")

    monkeypatch.setattr(bench, "_small_page_buffer", refuse)
    _no_settle(monkeypatch)
    ns = argparse.Namespace(size=4 << 20, sizes=None, repeat=1, warmup_rounds=0, dir=str(tmp_path / "out"),
                            only="load_device,load_device_4k", device="cpu", backend=None, queue_depth=None,
                            chunk_bytes=None, copy_threads=None, io_threads=None)
    res = bench.run_sync(ns, lambda msg: None)
    rows = {r["key"]: r for r in res["rows"]}
    assert "no memory for the 4 KiB row" in rows["load_device_4k"]["error"]
    assert not rows["load_device"]["error"] and len(rows["load_device"]["seconds"]) == 1


@pytest.mark.filterwarnings("ignore")
def test_async_bench_runs_the_process_writer_and_a_python_heavy_step(tmp_path, shm_root):
    res = _bench(["--async", "--dir", str(tmp_path / "a"), "--modes", "none,snapshot_4k,process", "--iters", "2",
                  "--warmup", "1", "--rounds", "1", "--width", "64", "--layers", "2", "--batch", "8",
                  "--python-ops", "50"], cwd=str(tmp_path))
    modes = {m["mode"]: m for m in res["modes"]}
    assert modes["process"]["fp_stats"]["policies"] == ["snapshot"] * 3
    assert modes["snapshot_4k"]["fp_stats"]["policy"] == "snapshot"
    assert modes["process"]["label"] == "fp_core AsyncCheckpointer(writer='process')"
    assert os.listdir(os.path.join(shm_root, f"fastpersist-{os.geteuid()}")) == []  # the writer closed with its row
