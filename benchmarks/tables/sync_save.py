"""Tables of docs/performance.md's "Synchronous save" part (and the disk's fio figures)."""

from __future__ import annotations

import re

from . import Results, TableError, bold, row, table

BENCH_4G = "bench-4GiB.txt"
DISK_FIO = "disk-fio.txt"
SYNC_THP_AB = "bench-sync-2GiB-thp-ab.txt"
LOAD_THP_AB = "bench-load-2GiB-thp-ab.txt"
BENCH_SMALL = "bench-small.txt"
REPLACE_COST = "replace-cost.txt"

# The bench's row labels, as the page names them (the bench keeps its labels short).
SAVE_ROWS = (
    ("(a)", "(a) device limit: native engine, zero-copy, + fdatasync", False),
    ("(b)", "(b) torch.save + fsync", False),
    ("(c)", "(c) Lightning default (`_atomic_save`: BytesIO, then write) + fsync", False),
    ("(d)", "(d) safetensors `save_file` + fsync", False),
    ("(e)", "(e) `torch.distributed.checkpoint.save`", False),
    ("(f)", "**(f) `fp_core.save`** (atomic, fsync'ed, CRC-32C of every byte)", True),
)


@table("save-4GiB", BENCH_4G)
def save_4gib(r: Results) -> list[str]:
    out = [row("Save (durable)", "GB/s", "vs device", "vs torch.save", "peak RSS added"),
           "|---|---:|---:|---:|---:|"]
    for key, label, strong in SAVE_ROWS:
        c = r.row(BENCH_4G, "Save (durable)", key)
        out.append(row(label, *(bold(c[k], strong) for k in ("GB/s", "vs device", "vs torch", "peak RSS +"))))
    return out


class _Part(Results):
    """One part of a results file (one run of a loop, one size of a sweep): reads like the
    whole file, and its errors say which part held nothing."""

    def __init__(self, r: Results, name: str, text: str, where: str) -> None:
        super().__init__(r.directory, r.table)
        self._name = name
        self._text = text
        self._where = where

    def text(self, name: str) -> str:
        return self._text if name == self._name else super().text(name)

    def error(self, name: str, what: str) -> TableError:
        return super().error(name, f"{what} in its part {self._where!r}")


def _parts(r: Results, name: str, start: str, what: str) -> list[tuple[re.Match[str], _Part]]:
    """File ``name`` cut at every line that matches ``start``: (that line's match, the part
    from it to the next such line). TableError when no line matches."""
    text = r.text(name)
    found = list(re.finditer(start, text, re.M))
    if not found:
        raise r.error(name, what)
    ends = [m.start() for m in found[1:]] + [len(text)]
    return [(m, _Part(r, name, text[m.start():end], m.group(0).strip())) for m, end in zip(found, ends)]


def _cell(r: Results, name: str, pattern: str, what: str) -> str:
    """Group 1 of ``pattern``'s first match in file ``name``."""
    return r.match(name, pattern, what).group(1)


def _mib(size: str) -> str:
    """A size the scripts print in MiB, as the page writes it: GiB from 1 GiB on."""
    mib = float(size)
    return f"{mib / 1024:.0f} GiB" if mib >= 1024 else f"{size} MiB"


# disk-fio: (fio's job name, the page's label for it)
FIO_JOBS = (
    ("seqwrite", "sequential write, 4 MiB, QD32, O_DIRECT, io_uring, 4 GiB"),
    ("seqread", "sequential read, 4 MiB, QD32, O_DIRECT, io_uring, 4 GiB"),
    ("lat", "random read 4 KiB, QD1, O_DIRECT"),
)
_FIO_RATE = {"kB": 1e-6, "MB": 1e-3, "GB": 1.0}
_FIO_US = {"nsec": 1e-3, "usec": 1.0, "msec": 1e3}


def _fio_gbs(part: Results, job: str) -> str:
    """The job's bandwidth from fio's "Run status group" line, in decimal GB/s."""
    m = part.match(DISK_FIO, r"^\s*(?:READ|WRITE): bw=\S+ \((\d+(?:\.\d+)?)(kB|MB|GB)/s\)", f"bandwidth of job {job!r}")
    return f"{float(m.group(1)) * _FIO_RATE[m.group(2)]:.2f} GB/s"


def _fio_latency(part: Results, job: str) -> str:
    """The job's IOPS as fio prints them (a count gets thousands separators) and its median
    completion latency, the typical one: the mean carries the disk's rare stalls."""
    iops = _cell(part, DISK_FIO, r"^\s*read: IOPS=(\d+(?:\.\d+)?[kM]|\d+),", f"IOPS of job {job!r}")
    unit = _cell(part, DISK_FIO, r"^\s*clat percentiles \((\w+)\):", f"latency percentiles of job {job!r}")
    if unit not in _FIO_US:
        raise part.error(DISK_FIO, f"latency percentiles of job {job!r} in nsec, usec or msec")
    # the first of fio's fixed list of percentiles from the 50th on
    pcts = [(float(p), float(v)) for p, v in re.findall(r"(\d+\.\d+)th=\[\s*(\d+)\]", part.text(DISK_FIO))]
    median = next((v for p, v in pcts if p >= 50), None)
    if median is None:
        raise part.error(DISK_FIO, f"50th latency percentile of job {job!r}")
    count = f"{int(iops):,}" if iops.isdigit() else iops
    return f"{count} IOPS, ~{median * _FIO_US[unit]:.0f} us typical"


@table("disk-fio", DISK_FIO)
def disk_fio(r: Results) -> list[str]:
    out = [row("fio job", "result"), "|---|---|"]
    parts = {m.group(1): part for m, part in _parts(r, DISK_FIO, r"^# fio --name=(\w+)", "'# fio --name=' line")}
    for job, label in FIO_JOBS:
        if job not in parts:
            raise r.error(DISK_FIO, f"run of fio job {job!r}")
        out.append(row(label, _fio_latency(parts[job], job) if job == "lat" else _fio_gbs(parts[job], job)))
    return out


# huge-pages: (page label, results file, the row's line in each run, the page's command cell)
HUGE_PAGE_ROWS = (
    ("`fp_core.save` in the bench, alternated runs", SYNC_THP_AB, r"\(f\) fp_core\.save",
     "`for e in 1 0 1 0; do THP_MEM_ALLOC_ENABLE=$e fastpersist bench --dir DIR --size 2GiB --repeat 5 "
     "--only device,fastpersist; done` ([output](../benchmarks/results/bench-sync-2GiB-thp-ab.txt))"),
    ("`fp_core.load`, alternated runs", LOAD_THP_AB, r"fp_core\.load",
     "the same loop with `--repeat 3 --only load_device,load_device_fresh,load_fastpersist,load_into` "
     "([output](../benchmarks/results/bench-load-2GiB-thp-ab.txt))"),
    ("`fp_core.load_into`, alternated runs", LOAD_THP_AB, r"fp_core\.load_into\(existing state\)",
     "(the same output)"),
)


@table("huge-pages", SYNC_THP_AB, LOAD_THP_AB)
def huge_pages(r: Results) -> list[str]:
    out = [row("2 GiB, 2412 tensors", "without", "with `THP_MEM_ALLOC_ENABLE=1`", "command, output"),
           "|---|---:|---:|---|"]
    for label, name, line, command in HUGE_PAGE_ROWS:
        # each run of the loop is one part; its row's first "x" figure is its ratio to the
        # run's device row
        runs: dict[str, list[str]] = {"0": [], "1": []}
        for m, part in _parts(r, name, r"^== THP_MEM_ALLOC_ENABLE=([01])\b.*$", "run headed '== THP_MEM_ALLOC_ENABLE='"):
            runs[m.group(1)].append(_cell(part, name, rf"^{line}\s+[\d.]+\s+[\d.]+\s+(\d+\.\d+x)\s",
                                          f"row {line!r} with its ratio"))
        for on, ratios in runs.items():
            if not ratios:
                raise r.error(name, f"run with THP_MEM_ALLOC_ENABLE={on}")
        out.append(row(label, " / ".join(runs["0"]), " / ".join(runs["1"]), command))
    return out


@table("small-saves", BENCH_SMALL)
def small_saves(r: Results) -> list[str]:
    out = [row("state (2412 tensors)", "torch.save + fsync", "`fp_core.save`", "vs torch.save + fsync"),
           "|---:|---:|---:|---:|"]
    for m, part in _parts(r, BENCH_SMALL, r"^checkpoint: (\d+(?:\.\d+)? MiB) of tensors", "'checkpoint: ... MiB' line"):
        torch_save = part.row(BENCH_SMALL, "Save (durable)", "(b)")
        fp_save = part.row(BENCH_SMALL, "Save (durable)", "(f)")
        out.append(row(m.group(1), f"{torch_save['s']} s", f"{fp_save['s']} s", f"**{fp_save['vs torch']}**"))
    return out


# small-saves-early-write: (results file, the page's label for its state, the link's text)
EARLY_WRITE_ROWS = (
    ("sync-gap-early-64MiB.txt", "64 MiB", "64 MiB"),
    ("sync-gap-early-256MiB.txt", "256 MiB", "256 MiB"),
    ("sync-gap-early-2GiB-thp.txt", "2 GiB, `THP_MEM_ALLOC_ENABLE=1`", "2 GiB, THP"),
)


def _median(r: Results, name: str, label: str) -> str:
    """The median seconds of row ``label`` in a sync_gap.py or replace_cost.py summary."""
    return _cell(r, name, rf"^{re.escape(label)}\s+median (\d+\.\d+) s\b", f"median of row {label!r}")


@table("small-saves-early-write", *(name for name, _, _ in EARLY_WRITE_ROWS))
def small_saves_early_write(r: Results) -> list[str]:
    out = [row("state (2412 tensors)", "rounds", "written while pickling", "plan first", "output"),
           "|---|---:|---:|---:|---|"]
    for name, label, link in EARLY_WRITE_ROWS:
        rounds = _cell(r, name, r"; (\d+) rounds, order alternated", "'N rounds, order alternated' line")
        out.append(row(label, rounds, f"{_median(r, name, 'fp_core.save')} s",
                       f"{_median(r, name, 'save, plan first')} s", f"[{link}](../benchmarks/results/{name})"))
    return out


def _vs_torch(r: Results, label: str) -> str:
    """Row ``label``'s median ratio to torch.save + fsync in replace_cost.py's summary."""
    return _cell(r, REPLACE_COST,
                 rf"^{re.escape(label)}\s+median [\d.]+ s\s+[\d.]+ GB/s\s+vs torch\.save \+ fsync (\d+\.\d+x)",
                 f"ratio of row {label!r} to torch.save + fsync")


@table("save-over-last", REPLACE_COST)
def save_over_last(r: Results) -> list[str]:
    out = [row("state", "torch.save + fsync, over its last", "`fp_core.save`, new name", "`fp_core.save`, over its last",
               "freed in the rename instead"),
           "|---:|---:|---:|---:|---:|"]
    for m, part in _parts(r, REPLACE_COST, r"^(\d+) MiB in \d+ tensors;", "'N MiB in N tensors;' line"):
        out.append(row(_mib(m.group(1)), f"{_median(part, REPLACE_COST, 'torch.save + fsync')} s",
                       f"{_median(part, REPLACE_COST, 'fp_core.save, new name')} s",
                       f"**{_median(part, REPLACE_COST, 'fp_core.save')} s** ({_vs_torch(part, 'fp_core.save')})",
                       f"{_median(part, REPLACE_COST, 'fp_core.save, freed inline')} s ({_vs_torch(part, 'fp_core.save, freed inline')})"))
    return out
