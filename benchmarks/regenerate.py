"""Regenerate the results in benchmarks/results/: every benchmark run with the arguments of
its latest output, each output rewritten only when its run succeeds.

    .venv/bin/python benchmarks/regenerate.py --list                 # print every command
    .venv/bin/python benchmarks/regenerate.py --only fence-blocked   # one entry (repeatable)
    .venv/bin/python benchmarks/regenerate.py --scratch /work/bench-tmp   # all of them: hours
    .venv/bin/python benchmarks/regenerate.py --index > benchmarks/results/README.md
    .venv/bin/python benchmarks/regenerate.py --tables            # re-render the docs' tables only
    .venv/bin/python benchmarks/regenerate.py --tables --check    # which tables differ from results/

``--scratch`` is where the benchmarks write their checkpoints: a directory on the disk under
test (the figures are that disk's), default /work/bench-tmp. ``--results`` writes the outputs
elsewhere (a trial run that leaves the committed results alone). A text output starts with
one ``# <command>   (<UTC time>, <commit>)`` line per command, then what it printed.

The A/B entries compare two commits: each is unpacked with ``git archive`` into the scratch
directory and its native module built there, so the comparison is the one its output shows
and not HEAD against the past. Some entries need what the machine may lack (root, fio,
cgroup v1 blkio, a Hugging Face model in the local cache); they fail alone and say why, and
the rest go on. After a run, every table of docs/performance.md and README.md is rendered
anew from the outputs (``benchmarks/tables/``), so a table never holds a hand-copied figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable

import tables

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
DEFAULT_SCRATCH = "/work/bench-tmp"
RELIABILITY = "reliability.md"

# Files under results/ that no entry here writes: the GPU check runs on a lent GPU machine
# with its own time box (OUT=benchmarks/results/gpu-check bash benchmarks/gpu_check.sh).
OTHER_PRODUCERS = {"gpu-check/": "OUT=benchmarks/results/gpu-check bash benchmarks/gpu_check.sh (needs a GPU)"}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One question: the commands whose outputs answer it and where those outputs go.

    ``commands`` are bash lines run from the repository root with .venv/bin first on PATH.
    Placeholders: ``{scratch}`` (this entry's scratch directory), ``{out:NAME}`` (a file the
    command writes itself, moved to results/NAME once every command succeeded) and
    ``{tree:COMMIT}`` (that commit unpacked and built). ``stdout``: the results file that
    collects what the commands print (None when the script writes its own output file).
    ``own_header``: the script prints its command line itself, so no header line is added.
    """

    name: str
    question: str
    commands: tuple[str, ...]
    stdout: str | None
    docs: str
    own_header: bool = False

    @property
    def outputs(self) -> list[str]:
        names = [self.stdout] if self.stdout else []
        for c in self.commands:
            names += [n for n in re.findall(r"\{out:([^}]+)\}", c) if n not in names]
        return names


def _bench_load(only: str) -> str:
    return "load_" + ",load_".join(only.split(","))


_LOAD_2G = _bench_load("device,device_4k,device_fresh,torch_mmap,fastpersist,fastpersist_verify,into,into_verify")
_LOAD_4G = _bench_load("device,device_fresh,torch,torch_mmap,safetensors,fastpersist,fastpersist_verify,into,into_verify")
_LOAD_4G_MMAP = _bench_load("device,device_fresh,torch,torch_mmap,safetensors,fastpersist,fastpersist_verify,"
                            "fastpersist_mmap,fastpersist_mmap_verify,into,into_verify")
_ASYNC_ALL = "none,disk,auto,overlap,snapshot,overlap_bg,snapshot_bg,torch,lightning,dcp"
_S = "fp_core.save"


def _thp_loop(values: str, cmd: str) -> str:
    return f'for e in {values}; do echo "== THP_MEM_ALLOC_ENABLE=$e $(date -u +%H:%M)"; THP_MEM_ALLOC_ENABLE=$e {cmd}; done'


def _sec(title: str) -> str:
    return f"performance.md#{title}"


def docs_link(docs: str) -> str:
    """A Markdown link from results/README.md to ``page.md#Heading`` (GitHub's anchor)."""
    page, _, title = docs.partition("#")
    if not title:
        return f"[docs/{page}](../../docs/{page})"
    slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    return f"[{page}: {title.replace('|', '/')}](../../docs/{page}#{slug})"


ENTRIES: tuple[Entry, ...] = (
    Entry("bench-4GiB", "Save and load throughput of a 4 GiB state: FastPersist against torch.save/load, "
          "Lightning, safetensors and the device", (
              "fastpersist bench --dir {scratch} --size 4GiB --repeat 5 --plot {out:bench-4GiB.png}",),
          "bench-4GiB.txt", _sec("Save, 4 GiB model + Adam state (2412 tensors)")),
    Entry("bench-sync-2GiB", "How close a 2 GiB fp_core.save comes to the device row (three runs)", tuple(
        "fastpersist bench --dir {scratch} --size 2GiB --only device,fastpersist --repeat 5" for _ in range(3)),
          "bench-sync-2GiB.txt", _sec("Save, 2 GiB: against the device row")),
    Entry("sync-gap-2GiB", "What the 2 GiB sync save's gap to the device is made of, one difference at a time",
          ("python benchmarks/sync_gap.py --dir {scratch} --size 2GiB --rounds 8",),
          "sync-gap-2GiB.txt", _sec("Save, 2 GiB: against the device row")),
    Entry("bench-sync-2GiB-thp-ab", "The sync save with torch's allocations on huge pages, alternated with 4 KiB pages",
          (_thp_loop("1 0 1 0", "fastpersist bench --dir {scratch} --size 2GiB --repeat 5 --only device,fastpersist"),),
          "bench-sync-2GiB-thp-ab.txt", _sec("CPU state on huge pages")),
    Entry("bench-load-2GiB-thp-ab", "Loads with torch's allocations on huge pages, alternated with 4 KiB pages",
          (_thp_loop("1 0 1 0", "fastpersist bench --dir {scratch} --size 2GiB --repeat 3 --only "
                     + _bench_load("device,device_fresh,fastpersist,into")),),
          "bench-load-2GiB-thp-ab.txt", _sec("CPU state on huge pages")),
    Entry("sync-gap-2GiB-thp", "The sync save's gap, row by row, with torch's allocations on huge pages",
          ("THP_MEM_ALLOC_ENABLE=1 python benchmarks/sync_gap.py --dir {scratch} --size 2GiB --rounds 6",),
          "sync-gap-2GiB-thp.txt", _sec("CPU state on huge pages")),
    Entry("sync-gap-early-2GiB-thp", "Writing storages while pickling against planning first, 2 GiB on huge pages",
          (f"THP_MEM_ALLOC_ENABLE=1 python benchmarks/sync_gap.py --dir {{scratch}} --size 2GiB --rounds 6 "
           f"--only {_S} --only 'save, plan first' --only extents",),
          "sync-gap-early-2GiB-thp.txt", _sec("CPU state on huge pages")),
    Entry("page-effects", "O_DIRECT write speed from huge-page against 4 KiB-page memory, zero-copy against staged",
          ("python benchmarks/page_effects.py --dir {scratch} --size 2147483648 --repeat 5",),
          "page-effects.txt", _sec("CPU state on huge pages"), own_header=True),
    Entry("bench-small", "Saves of small checkpoints of many tensors (19 / 67 / 263 MiB) against torch.save",
          ("fastpersist bench --dir {scratch} --sizes 16MiB,64MiB,260MiB --only device,torch,fastpersist --repeat 5",),
          "bench-small.txt", _sec("Small checkpoints of many tensors")),
    Entry("sync-gap-early-256MiB", "Writing storages while pickling against planning first, 256 MiB",
          (f"python benchmarks/sync_gap.py --dir {{scratch}} --size 256MiB --rounds 20 --only {_S} --only 'save, plan first'",),
          "sync-gap-early-256MiB.txt", _sec("Small checkpoints of many tensors")),
    Entry("sync-gap-early-64MiB", "Writing storages while pickling against planning first, 64 MiB",
          (f"python benchmarks/sync_gap.py --dir {{scratch}} --size 64MiB --rounds 20 --only {_S} --only 'save, plan first'",),
          "sync-gap-early-64MiB.txt", _sec("Small checkpoints of many tensors")),
    Entry("replace-cost", "What saving over the last checkpoint costs (the old file's freeing) against a new name",
          ("python benchmarks/replace_cost.py --dir {scratch} --sizes 64MiB,260MiB,2GiB --rounds 5",),
          "replace-cost.txt", _sec("Saving over the last checkpoint")),
    Entry("bench-load-2GiB", "Cold loads of 2 GiB: fp_core.load and load_into against the device and torch's mmap load",
          (f"fastpersist bench --dir {{scratch}} --size 2GiB --repeat 5 --only {_LOAD_2G}",),
          "bench-load-2GiB.txt", _sec("Load, 2 GiB model + Adam state (2412 tensors), cold")),
    Entry("bench-load-4GiB", "Cold loads of 4 GiB against torch.load, torch.load(mmap=True) and safetensors",
          (f"fastpersist bench --dir {{scratch}} --size 4GiB --repeat 3 --only {_LOAD_4G}",),
          "bench-load-4GiB.txt", _sec("Load, 2 GiB model + Adam state (2412 tensors), cold")),
    Entry("read-targets-2GiB", "What a read lands in: huge pages, 4 KiB pages, torch's tensors, tensors aligned like the file",
          ("python benchmarks/read_targets.py --dir {scratch} --size 2GiB --rounds 10",),
          "read-targets-2GiB.txt", _sec("Load, 2 GiB model + Adam state (2412 tensors), cold")),
    Entry("read-depth-2GiB", "How deep a cold read should be (reads in flight x chunk size)",
          ("python benchmarks/read_depth.py --dir {scratch} --size 2GiB --rounds 5 --device 4:4,8:8,16:4,32:2,64:2 "
           "--into 4:4,32:2 --load 4:4,32:2",),
          "read-depth-2GiB.txt", _sec("Load, 2 GiB model + Adam state (2412 tensors), cold")),
    Entry("bench-small-load", "Loads of small checkpoints (19 / 67 / 263 MiB) against torch.load",
          ("fastpersist bench --dir {scratch} --sizes 16MiB,64MiB,260MiB --repeat 5 --only "
           + _bench_load("device,torch,torch_mmap,fastpersist,into"),),
          "bench-small-load.txt", _sec("Small checkpoints, loaded")),
    Entry("bench-load-4GiB-mmap", "Mapped loads (fp_core's and torch's) against read loads, 4 GiB",
          (f"fastpersist bench --dir {{scratch}} --size 4GiB --repeat 3 --only {_LOAD_4G_MMAP}",),
          "bench-load-4GiB-mmap.txt", _sec("Mapped loads and what a resume pays for its memory")),
    Entry("load-mapped-4GiB", "Every mapped reader on the same 4 GiB file, touched page by page",
          ("python benchmarks/load_mapped.py --dir {scratch} --size 4GiB --rounds 4",),
          "load-mapped-4GiB.txt", _sec("Mapped loads and what a resume pays for its memory")),
    Entry("resume-cost-2GiB", "A load and then one write to every page (a resume's first optimizer step)",
          ("python benchmarks/resume_cost.py --dir {scratch} --size 2GiB --rounds 4",),
          "resume-cost-2GiB.txt", _sec("Mapped loads and what a resume pays for its memory")),
    Entry("fresh-memory", "What faulting in a fresh 1.13 GB arena costs, and what it costs a training step beside it",
          ("python benchmarks/fresh_memory.py --size 1.13e+09 --reps 2 --pause 15 --batch 975",),
          "fresh-memory.txt", _sec("Fresh memory"), own_header=True),
    Entry("bench-async", "Step time of a CPU training loop checkpointing 1.13 GB every iteration: every policy "
          "against torch.save, Lightning's and DCP's async saves", (
              f"fastpersist bench --async --dir {{scratch}} --modes {_ASYNC_ALL} --iters 4 --warmup 2 --rounds 4 "
              "--plot {out:bench-async.png}",),
          "bench-async.txt", _sec("A 1.13 GB checkpoint every iteration")),
    Entry("bench-async-policies", "FastPersist's policies against the disk floor (the same bytes written, no checkpoint)",
          ("fastpersist bench --async --dir {scratch} --modes none,disk,auto,overlap --iters 4 --warmup 3 --rounds 4",),
          "bench-async-policies.txt", _sec("The slowdown and the disk floor")),
    Entry("bench-async-2s-12rounds", "The slowdown at 2 s steps, 12 rounds (enough to tell it from the target)",
          ("fastpersist bench --async --dir {scratch} --modes none,disk,auto,overlap,snapshot --iters 4 --warmup 3 "
           "--rounds 12",),
          "bench-async-2s-12rounds.txt", _sec("The slowdown and the disk floor")),
    Entry("bench-async-4s-8rounds", "The slowdown at 4 s steps: does the cost per checkpoint stay fixed",
          ("fastpersist bench --async --dir {scratch} --modes none,disk,auto,overlap,snapshot --iters 4 --warmup 3 "
           "--rounds 8 --compute-ms 4000",),
          "bench-async-4s-8rounds.txt", _sec("The slowdown and the disk floor")),
    Entry("disk-interference", "What a disk write alone costs a training step (fio; the engine from 4 KiB and 2 MiB pages)",
          ("python benchmarks/disk_interference.py --dir {scratch} --reps 4 --batch 664",
           "python benchmarks/disk_interference.py --dir {scratch} --reps 4 --batch 664 --pages --no-fio"),
          "disk-interference.txt", _sec("The slowdown and the disk floor")),
    Entry("floor-pages-ab", "The disk floor written from 4 KiB pages against 2 MiB pages, alternated",
          ('for r in 1 2; do for pg in 4k huge; do echo "== floor $pg round $r"; fastpersist bench --async '
           "--dir {scratch} --modes none,disk --iters 4 --warmup 3 --rounds 2 --batch 493 --no-write-probe "
           "--floor-pages $pg; done; done",),
          "floor-pages-ab.txt", _sec("The slowdown and the disk floor")),
    Entry("fence-blocked", "What a save followed at once by its fence blocks, per policy, against torch.save + fsync",
          ("python benchmarks/fence_blocked.py --dir {scratch} --sizes 100MB,260MB,1GB --rounds 5 --tensors 48",),
          "fence-blocked.txt", _sec("A save followed at once by its fence")),
    Entry("process-writer-async", "The writer in its own process against the thread writer's policies, in one run",
          ("fastpersist bench --async --dir {scratch} --modes none,auto,snapshot,process --rounds 4 --iters 6 --warmup 3",),
          "process-writer-async.txt", _sec("The writer process")),
    Entry("process-writer-async-python-ops", "The same with a Python-heavy step (20000 small ops holding the GIL)",
          ("fastpersist bench --async --dir {scratch} --modes none,auto,snapshot,process --rounds 4 --iters 6 --warmup 3 "
           "--python-ops 20000",),
          "process-writer-async-python-ops.txt", _sec("The writer process")),
    Entry("process-writer-async-4k", "Whether the process writer's cost is its 4 KiB-page shared memory (snapshot_4k row)",
          ("fastpersist bench --async --dir {scratch} --modes none,snapshot,snapshot_4k,process --rounds 4 --iters 6 "
           "--warmup 3",),
          "process-writer-async-4k.txt", _sec("The writer process")),
    Entry("resume-from-memory", "A resume from the writer process's memory image against a resume from disk",
          ("python benchmarks/resume_from_memory.py --gib 2 --rounds 3 --dir {scratch}",),
          "resume-from-memory.txt", _sec("The writer process")),
    Entry("partition-4GiB", "Collective save of 4 GiB written by 1, 2 and 4 processes",
          ("python benchmarks/partition_bench.py --dir {scratch} --size 4GiB --repeat 3",),
          "partition-4GiB.txt", _sec("One 4 GiB checkpoint written by 1, 2 and 4 processes")),
    Entry("sharded-file", "FSDP2 state saved to one file on 4 and 2 ranks, and loaded on the other world size", (
        "torchrun --nproc-per-node 4 benchmarks/sharded_file_bench.py --dir {scratch} --drop-caches --keep {scratch}/full4.pt",
        "torchrun --nproc-per-node 2 benchmarks/sharded_file_bench.py --dir {scratch} --drop-caches --load {scratch}/full4.pt",
        "torchrun --nproc-per-node 2 benchmarks/sharded_file_bench.py --dir {scratch} --drop-caches --keep {scratch}/full2.pt",
        "torchrun --nproc-per-node 4 benchmarks/sharded_file_bench.py --dir {scratch} --drop-caches --load {scratch}/full2.pt"),
          "sharded-file.txt", _sec("One file from sharded state (`layout=\"file\"`)")),
    Entry("blkio-scaling", "The paper's scaling claim on one disk: a write bandwidth per rank (cgroup v1 blkio, root)",
          ("python benchmarks/blkio_scaling.py --dir {scratch}",
           "python benchmarks/blkio_scaling.py --dir {scratch} --engine-options '{\"queue_depth\": 2}'"),
          "blkio-scaling.txt", _sec("One file from sharded state (`layout=\"file\"`)")),
    Entry("bench-dcp", "torch.distributed.checkpoint save and load, stock against FastPersist's writer and reader, 2 ranks",
          ("fastpersist bench --dcp --dir {scratch} --repeat 3",),
          "bench-dcp.txt", _sec("Sharded checkpoints through `torch.distributed.checkpoint`")),
    Entry("dcp-load-ab", "FastPersistReader's one scatter read per rank file against the per-tensor reads before it",
          ("for i in 1 2 3; do for t in {tree:231b5c3} {tree:5e4024f}; do (cd $t && PYTHONPATH=$PWD "
           "python {tree:5e4024f}/benchmarks/dcp_load_ab.py --dir {scratch} --size 1GiB); done; done",),
          "dcp-load-ab.txt", _sec("Sharded checkpoints through `torch.distributed.checkpoint`")),
    Entry("hf-finetune", "The HF Trainer example: stall per checkpoint, stock against FastPersist (5 runs)",
          ("for i in 1 2 3 4 5; do python examples/hf_finetune.py --steps 30 --save-steps 10 --dir {scratch}; "
           "echo ---; done",),
          "hf-finetune.txt", _sec("Hugging Face Trainer, MiniLM fine-tune")),
    Entry("hf-first-checkpoint-ab", "The HF example's first checkpoint with its small copies on 4 KiB against huge pages",
          ("for i in 1 2 3 4; do for t in {tree:f3225c1} {tree:f3225c1^}; do echo \"== $t\"; (cd $t && "
           "PYTHONPATH=$PWD python examples/hf_finetune.py --steps 30 --save-steps 10 --dir {scratch}); done; done",),
          "hf-first-checkpoint-ab.txt", _sec("Hugging Face Trainer, MiniLM fine-tune")),
    Entry("overlap-ab", "overlap's slowdown before and after one change, the two commits alternated per round",
          ("bash benchmarks/ab_async.sh {tree:0103189} {tree:4c4dc95} 6 none,disk,overlap {scratch}",),
          "overlap-ab.txt", _sec("Tried and not kept")),
    Entry("reliability-harness", "Crash trials (SIGKILL mid-save), fault table and corruption detection",
          ("python benchmarks/crash_harness.py --trials 200 --integration-trials 8 --modes sync,async,dist-sync,dist-async "
           "--root {scratch} --json {out:reliability-harness.json}",),
          None, RELIABILITY),
    Entry("reliability-harness-dcp", "Crash trials of sharded (DTensor) saves through DCP",
          ("python benchmarks/crash_harness.py --only crash --modes dist-dcp --trials 50 --integration-trials 0 "
           "--root {scratch} --json {out:reliability-harness-dcp.json}",),
          None, RELIABILITY),
    Entry("reliability-harness-dist-file", "Crash trials of sharded saves to one file (layout=\"file\")",
          ("python benchmarks/crash_harness.py --only crash --modes dist-file --trials 50 --integration-trials 0 "
           "--root {scratch} --json {out:reliability-harness-dist-file.json}",),
          None, RELIABILITY),
    Entry("reliability-harness-async-process", "Crash trials of the writer in its own process",
          ("python benchmarks/crash_harness.py --only crash --modes async-process --trials 50 --integration-trials 0 "
           "--root {scratch} --json {out:reliability-harness-async-process.json}",),
          None, RELIABILITY),
    Entry("reliability-soak", "1000 async saves with rotation: file descriptors, threads and memory stay flat",
          ("python benchmarks/soak.py --saves 1000 --json {out:reliability-soak.json}",),
          None, RELIABILITY),
    Entry("process-writer-kills", "Trainers killed after save(): does the process writer still commit (thread as control)",
          ("python benchmarks/process_writer_kills.py --trials 100 --snapshot-trials 20 --dir {scratch} "
           "--out {out:process-writer-kills.json}",),
          None, RELIABILITY),
    Entry("writer-process-cost", "What one writer process per trainer costs: its start and its memory, "
          "for 1, 2 and 4 trainers on one machine",
          ("python benchmarks/writer_process_cost.py --trainers 1,2,4 --out {out:writer-process-cost.txt}",),
          None, _sec("The writer process")),
    Entry("process-writer-collective-kills", "One of two ranks killed after a collective or sharded save's fence: "
          "do the writer processes still commit it (thread as control)",
          ("python benchmarks/process_writer_collective_kills.py --trials 20 --dir {scratch} "
           "--out {out:process-writer-collective-kills.json}",),
          None, RELIABILITY),
    Entry("disk-fio", "The raw disk, measured by an independent tool: fio's sequential write and read "
          "(4 MiB, QD32, O_DIRECT, io_uring) and 4 KiB random reads at QD1", (
              "fio --name=seqwrite --filename={scratch}/fio.dat --rw=write --bs=4M --iodepth=32 --direct=1 "
              "--ioengine=io_uring --size=4G --end_fsync=1",
              "fio --name=seqread  --filename={scratch}/fio.dat --rw=read  --bs=4M --iodepth=32 --direct=1 "
              "--ioengine=io_uring --size=4G",
              "fio --name=lat --filename={scratch}/fio.dat --rw=randread --bs=4k --iodepth=1 --direct=1 "
              "--ioengine=psync --size=1G --runtime=3 --time_based && rm -f {scratch}/fio.dat"),
          "disk-fio.txt", _sec("The machine and how to read the figures")),
    Entry("lightning-finetune", "The Lightning example: the stall per checkpoint and fit's wall time, stock "
          "TorchCheckpointIO against AsyncCheckpointIO and FastPersistIO, default and --large",
          ("python examples/lightning_finetune.py", "python examples/lightning_finetune.py --large --steps 4"),
          "lightning-finetune.txt", _sec("Lightning, MiniLM fine-tune")),
)


def by_name() -> dict[str, Entry]:
    return {e.name: e for e in ENTRIES}


def _trees(cmd: str) -> list[str]:
    return re.findall(r"\{tree:([^}]+)\}", cmd)


def render(cmd: str, scratch: str, out_dir: str | None = None, trees: str | None = None) -> str:
    """``cmd`` with its placeholders filled: files to ``out_dir`` (the results folder when
    None, as the listing shows them), trees under ``trees`` (default: beside ``scratch``)."""
    trees = trees or os.path.join(os.path.dirname(scratch.rstrip("/")), "regenerate-trees")
    text = cmd.replace("{scratch}", scratch)
    text = re.sub(r"\{out:([^}]+)\}", lambda m: os.path.join(out_dir or "benchmarks/results", m.group(1)), text)
    return re.sub(r"\{tree:([^}]+)\}", lambda m: os.path.join(trees, m.group(1).replace("^", "~1")), text)


def listing(entries: Iterable[Entry], scratch: str) -> str:
    lines = []
    for e in entries:
        lines.append(f"{e.name}: " + " ".join("benchmarks/results/" + o for o in e.outputs))
        lines += ["    " + render(c, os.path.join(scratch, e.name)) for c in e.commands]
    return "\n".join(lines) + "\n"


def index(entries: Iterable[Entry], scratch: str = "DIR") -> str:
    """benchmarks/results/README.md: one row per question."""
    rows = ["# Benchmark results", "",
            "The latest output of every benchmark, one row per question. Each output starts with the "
            "command that produced it; `.venv/bin/python benchmarks/regenerate.py --only NAME --scratch "
            "DIR` reruns one (`--list` prints them all, no `--only` reruns everything: hours). Older "
            "runs are in git's history of this folder. `DIR` is a directory on the disk under test; "
            "`TREES/<commit>` is that commit unpacked and built (regenerate.py does it, for the A/B rows).", "",
            "| Name | Question | Command | Latest output | Feeds |", "|---|---|---|---|---|"]
    for e in entries:
        shown = ["`" + render(c, scratch, trees="TREES").replace("|", "\\|") + "`" for c in e.commands]
        cmd = shown[0] + f" ({len(shown)} runs)" if len(set(shown)) == 1 < len(shown) else "<br>".join(shown)
        outs = ", ".join(f"[{o}]({o})" for o in e.outputs)
        rows.append(f"| {e.name} | {e.question} | {cmd} | {outs} | {docs_link(e.docs)} |")
    rows += ["", "Not written by `regenerate.py`: " + "; ".join(
        f"`{k}` ({v})" for k, v in OTHER_PRODUCERS.items()) + ".", ""]
    return "\n".join(rows)


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return head + (" + working tree" if dirty else "")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _unpack(commit: str, trees_dir: str, log) -> str:
    """``commit`` extracted with git archive and its native module built, once per scratch."""
    dest = os.path.join(trees_dir, commit.replace("^", "~1"))
    if os.path.exists(os.path.join(dest, ".built")):
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=dest, check=True,
                   stdout=log, stderr=subprocess.STDOUT)
    open(os.path.join(dest, ".built"), "w").close()
    return dest


def run_entry(e: Entry, scratch: str, results: str) -> bool:
    """Run ``e``'s commands; True and its outputs in ``results`` on success, else the previous
    outputs untouched and False. The commands' stderr goes to a log in the scratch directory."""
    work = os.path.join(scratch, e.name)
    staging = os.path.join(scratch, ".regenerate-out", e.name)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    os.makedirs(staging)
    log_path = os.path.join(scratch, f"{e.name}.log")
    text_path = os.path.join(staging, e.stdout or f"{e.name}.stdout")
    commit = _commit()
    with open(log_path, "w") as log, open(text_path, "w") as text:
        for cmd in e.commands:
            for c in _trees(cmd):
                try:
                    _unpack(c, os.path.join(scratch, "regenerate-trees"), log)
                except (OSError, subprocess.CalledProcessError) as err:
                    print(f"{e.name}: cannot unpack and build {c}: {err} (log {log_path})", file=sys.stderr)
                    return False
            shown = render(cmd, work)
            if not e.own_header and e.stdout:
                now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
                text.write(f"# {shown}   ({now}, {commit})\n")
                text.flush()
            real = render(cmd, work, staging)
            rc = subprocess.run(["bash", "-o", "pipefail", "-c", real], cwd=REPO, env=_env(), stdout=text,
                                stderr=log).returncode
            if rc != 0:
                print(f"{e.name}: exit status {rc} from: {shown} (log {log_path}); previous results kept",
                      file=sys.stderr)
                return False
    missing = [o for o in e.outputs if not os.path.isfile(os.path.join(staging, o))]
    if missing:
        print(f"{e.name}: the run wrote no {', '.join(missing)}; previous results kept", file=sys.stderr)
        return False
    os.makedirs(results, exist_ok=True)
    for o in e.outputs:
        os.replace(os.path.join(staging, o), os.path.join(results, o))
    shutil.rmtree(staging, ignore_errors=True)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print each entry's outputs and commands, run nothing")
    ap.add_argument("--index", action="store_true", help="print benchmarks/results/README.md, run nothing")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run this entry (repeatable)")
    ap.add_argument("--scratch", default=DEFAULT_SCRATCH, help="a directory on the disk under test")
    ap.add_argument("--results", default=RESULTS, help="where the outputs go (default benchmarks/results)")
    ap.add_argument("--tables", action="store_true",
                    help="render the tables of docs/performance.md and README.md from the results, run nothing")
    ap.add_argument("--check", action="store_true", help="with --tables: list the pages that differ, write nothing")
    a = ap.parse_args(argv)
    if a.check and not a.tables:
        ap.error("--check goes with --tables")
    if a.tables:
        return render_tables(os.path.abspath(a.results), check=a.check)
    names = by_name()
    unknown = [n for n in a.only if n not in names]
    if unknown:
        ap.error(f"no entry named {', '.join(unknown)}; --list shows them")
    chosen = [names[n] for n in a.only] if a.only else list(ENTRIES)
    if a.list:
        sys.stdout.write(listing(chosen, a.scratch))
        return 0
    if a.index:
        sys.stdout.write(index(chosen))
        return 0
    scratch = os.path.abspath(a.scratch)
    failed = []
    for e in chosen:
        print(f"== {e.name}: {' '.join(shlex.quote(o) for o in e.outputs)}", flush=True)
        if not run_entry(e, scratch, os.path.abspath(a.results)):
            failed.append(e.name)
    if len(failed) < len(chosen):
        if os.path.realpath(a.results) == os.path.realpath(RESULTS):
            failed += ["tables"] if render_tables(RESULTS) else []
        else:
            print(f"tables: not rendered from {a.results} (a trial run; --tables --results {a.results} does)")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def render_tables(results: str, check: bool = False) -> int:
    """Re-render the docs' tables from ``results``; 1 (saying why) when a results file lacks
    what a table needs, or with ``check`` when a page differs."""
    try:
        changed = tables.update_pages(results, check=check)
    except tables.TableError as e:
        print(f"tables: {e}; no page changed", file=sys.stderr)
        return 1
    for page in changed:
        print(f"{page}: {'differs from' if check else 'tables rendered from'} {results}")
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
