"""README.md's headline table: one row per question a newcomer asks, each figure taken from
the docs/performance.md table that holds it in full (rendered from the same results), so the
two pages never disagree."""

from __future__ import annotations

import re

from . import TABLES, Results, TableError, row, table
from .frameworks import LIGHTNING, _lightning_run
from .sync_save import BENCH_4G

SOURCES = ("save-4GiB", "load-2GiB", "async-every-iteration", "lightning-finetune", "sharded-file",
           "writer-process-kills")


class _Rendered:
    """A docs table rendered from the results, read by row label and column name."""

    def __init__(self, r: Results, name: str) -> None:
        lines = TABLES[name].render(r)
        self.name, self.r = name, r
        self.header = _cells(lines[0])
        self.rows = [_cells(line) for line in lines[2:]]

    def cell(self, label: str, column: str) -> str:
        """The cell under the first column named ``column`` of the row labelled ``label``, or else of the one row whose label starts with it, without
        its bold."""
        found = [c for c in self.rows if c[0] == label] or [c for c in self.rows if c[0].startswith(label)]
        if len(found) != 1:
            raise TableError(f"table {self.r.table}: table {self.name}, rendered from {self.r.directory}, has "
                             f"{len(found)} rows labelled {label!r}, not one")
        if column not in self.header or len(found[0]) != len(self.header):
            raise TableError(f"table {self.r.table}: table {self.name}, rendered from {self.r.directory}, has no "
                             f"column {column!r} in its row {label!r}")
        return found[0][self.header.index(column)]

    def number(self, label: str, column: str) -> float:
        """The cell as a number (its unit after it ignored)."""
        cell = self.cell(label, column)
        m = re.match(r"[+-]?\d+(?:\.\d+)?", cell)
        if m is None:
            raise TableError(f"table {self.r.table}: table {self.name}, rendered from {self.r.directory}, holds "
                             f"{cell!r}, not a figure, in row {label!r}, column {column!r}")
        return float(m.group(0))


def _cells(line: str) -> list[str]:
    return [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]


def _large_mib(r: Results) -> float:
    """The size of stock's checkpoint in the latest ``--large`` run of the Lightning example."""
    m = re.search(r"([\d.]+) MiB", _lightning_run(r, True)["stock"].group(0))
    if m is None:
        raise r.error(LIGHTNING, "checkpoint size in stock's --large row")
    return float(m.group(1))


def _gib(r: Results, name: str) -> str:
    size = float(r.match(name, r"^checkpoint: ([\d.]+) GiB of tensors", "checkpoint size line").group(1))
    return f"{size:g} GiB"


@table("headline", BENCH_4G, "bench-load-2GiB.txt", "bench-async.txt", LIGHTNING, "sharded-file.txt",
       "process-writer-kills.json")
def headline(r: Results) -> list[str]:
    save, load = _Rendered(r, "save-4GiB"), _Rendered(r, "load-2GiB")
    steps, lightning = _Rendered(r, "async-every-iteration"), _Rendered(r, "lightning-finetune")
    sharded, kills = _Rendered(r, "sharded-file"), _Rendered(r, "writer-process-kills")
    tensors = r.match(BENCH_4G, r"^checkpoint: [\d.]+ GiB of tensors \((\d+) tensors\)", "tensor count").group(1)
    ckpt = r.match("bench-async.txt", r"^checkpoint ([\d.]+ GB) ", "checkpoint size line").group(1)
    step = steps.number("no checkpoint", "step (s, median)")
    large_mib = _large_mib(r)
    auto, torch_save = "AsyncCheckpointer() (`auto`)", "torch.save + fsync"
    mmap = "torch.load(mmap=True) + touch every page"
    stalls = {k: lightning.cell(k, "`--large`: stall per checkpoint") for k in ("stock", "Lightning AsyncCheckpointIO", "FastPersistIO")}
    most = sharded.header[-1]  # the most ranks the sharded-file run has
    by_process, by_thread, file_layout = '`writer="process"`', '`writer="thread"`', '`layout="file"`'
    process, thread = kills.cell(by_process, "generation 2 committed"), kills.cell(by_thread, "generation 2 committed")
    return [
        row("question", "FastPersist", "baseline"),
        "|---|---:|---:|",
        row(f"save {_gib(r, BENCH_4G)} model + Adam state ({tensors} tensors)",
            f"**{save.cell('(f)', 'GB/s')} GB/s**, {save.cell('(f)', 'vs device')} of the device",
            f"`torch.save` + fsync {save.cell('(b)', 'GB/s')} GB/s ({save.cell('(f)', 'vs torch.save')} slower)"),
        row(f"resume {_gib(r, 'bench-load-2GiB.txt')} into existing tensors (`load_into`), cold",
            f"**{load.cell('`fp_core.load_into(existing state)`', 'vs device')}** of the device",
            f"`torch.load(mmap=True)` + touch {load.cell(mmap, 'vs device')}"),
        row(f"training blocked per {ckpt} checkpoint, every step (`AsyncCheckpointer`)",
            f"**{steps.cell(auto, 'blocked per checkpoint')}**",
            f"`torch.save` + fsync {steps.cell(torch_save, 'blocked per checkpoint')}"),
        row(f"step slowdown, a {ckpt} checkpoint every ~{step:.0f} s step", f"**{steps.cell(auto, 'slowdown')}**",
            f"the same bytes written with no checkpoint: {steps.cell('floor', 'slowdown')}"),
        row(f"Lightning, {large_mib * 2**20 / 1e9:.2f} GB checkpoint every step (`--large`): stall per checkpoint",
            f"**{stalls['FastPersistIO']}**",
            f"stock {stalls['stock']}, `AsyncCheckpointIO` {stalls['Lightning AsyncCheckpointIO']}"),
        row(f"FSDP2 state to one file, {most} (`layout=\"file\"`)", f"**{sharded.cell(file_layout, most)}**",
            "gather to rank 0 + `torch.save` " + re.sub(r" \(.*\)$", "", sharded.cell("(a)", most))),
        row(f"trainer SIGKILLed right after `save()` and its fence, {kills.cell(by_process, 'trials')} "
            "trials (`writer=\"process\"`)", f"**{process}** committed", f"thread writer {thread}"),
    ]
