"""Tables of docs/performance.md's "Collective and sharded saves" part: the collective save by
1, 2 and 4 writers, FSDP2 state to one file, the blkio scaling simulation and DCP."""

from __future__ import annotations

import re

from . import Results, bold, row, table

PARTITION = "partition-4GiB.txt"
SHARDED_FILE = "sharded-file.txt"
BLKIO = "blkio-scaling.txt"
DCP = "bench-dcp.txt"

_NUM = r"(\d+(?:\.\d+)?)"


def _block(r: Results, name: str, head: str, what: str) -> list[str]:
    """The lines after the first line matching ``head`` in file ``name``, up to the next blank
    line (a results file holds the latest run first, earlier runs below it)."""
    m = r.match(name, head, what)
    text = r.text(name)[m.end():]
    return text.split("\n\n", 1)[0].splitlines()


def _rows(r: Results, name: str, lines: list[str], pattern: str, keys: tuple[str, ...],
          where: str) -> dict[str, re.Match[str]]:
    """Each of ``keys`` matched by ``pattern`` (its group ``key`` the row's label) in ``lines``;
    TableError naming the first row that is missing."""
    found: dict[str, re.Match[str]] = {}
    for line in lines:
        m = re.match(pattern, line)
        if m and m.group("key") not in found:
            found[m.group("key")] = m
    for k in keys:
        if k not in found:
            raise r.error(name, f"row {k!r} {where}")
    return found


# ---------------------------------------------------------------- partition-4GiB

@table("partition-4GiB", PARTITION)
def partition_4gib(r: Results) -> list[str]:
    # the bench's rows: writers, GB/s, vs 1, seconds, each rank's MiB, then (N/W ..., within X KiB ...)
    found = r.matches(PARTITION, r"^\s*(\d+)\s+" + _NUM + r"\s+" + _NUM + r"\s+" + _NUM + r"\s+" + _NUM
                      + r" MiB.*?within " + _NUM + r" KiB", "rows of writers, GB/s, vs 1, seconds, bytes per rank")
    out = [row("writers", "aggregate GB/s", "vs 1 writer", "bytes per rank"), "|---:|---:|---:|---|"]
    for m in found:
        writers, gbps, vs1, _, mib, kib = m.groups()
        # one writer writes the whole file: no share to compare with N/W
        share = f"{float(mib):.0f} MiB" if writers == "1" else f"{float(mib):.0f} MiB each (within {kib} KiB of N/W)"
        out.append(row(writers, gbps, f"{vs1}x", share))
    return out


# ---------------------------------------------------------------- sharded-file

# the bench's row label -> the page's; the first row is the one the others are measured against
SHARDED_ROWS = (
    ("ours file", '**`layout="file"`** (every rank its rows, no gather)'),
    ("(a) gather+torch.save", "(a) gather to rank 0 + `torch.save` + fsync (Lightning's, HF's full state)"),
    ("(b) dcp+dcp_to_torch_save", "(b) DCP `FileSystemWriter` + `dcp_to_torch_save`"),
    ("(c) dcp hf consolidated", "(c) DCP `HuggingFaceStorageWriter`, consolidated safetensors"),
    ("(d) ours dcp", '(d) `layout="dcp"` (a directory)'),
)
SHARDED_WORLDS = (2, 4)


def _sharded_save(r: Results, world: int) -> dict[str, tuple[str, str]]:
    """label -> (median s, vs ours file) of the latest save run on ``world`` ranks."""
    lines = _block(r, SHARDED_FILE, rf"^{world} ranks \(torchrun.*\n\s*save\s*$", f"save run on {world} ranks")
    keys = tuple(k for k, _ in SHARDED_ROWS)
    pattern = r"^\s*(?P<key>" + "|".join(re.escape(k) for k in keys) + r")\s+" + _NUM + r"\s+" + _NUM + r"\s+" + _NUM + "x"
    found = _rows(r, SHARDED_FILE, lines, pattern, keys, f"in the save run on {world} ranks")
    return {k: (m.group(2), m.group(4)) for k, m in found.items()}


@table("sharded-file", SHARDED_FILE)
def sharded_file(r: Results) -> list[str]:
    runs = {w: _sharded_save(r, w) for w in SHARDED_WORLDS}
    out = [row("Save", *(f"{w} ranks" for w in SHARDED_WORLDS)), "|---|---:|---:|"]
    for i, (key, label) in enumerate(SHARDED_ROWS):
        cells = []
        for w in SHARDED_WORLDS:
            seconds, ratio = runs[w][key]
            if i == 0:
                cells.append(f"**{float(seconds):.2f} s**")
            else:
                # three significant figures: 16.8x, 11.0x, 1.49x
                cells.append(f"{float(seconds):.2f} s ({float(ratio):#.3g}x)")
        out.append(row(label, *cells))
    return out


# ---------------------------------------------------------------- blkio-scaling

def _blkio_run(r: Results, options: str) -> dict[str, re.Match[str]]:
    """W -> its row (W, W*B, file/W*B, gather/B, raw/W*B) in the run with engine ``options``."""
    lines = _block(r, BLKIO, r"^B = .*engine options " + re.escape(options) + r",.*\n.*per round.*$",
                   f"run with engine options {options}")
    pattern = (r"^\s*(?P<key>\d+)\s+(\d+)\s+" + _NUM + r"\s+" + _NUM + r"\s+" + _NUM + r"\s+" + _NUM + r"\s+"
               + _NUM + r"\s+" + _NUM + r"\s")
    found = {}
    for line in lines:
        m = re.match(pattern, line)
        if m:
            found[m.group("key")] = m
    if not found:
        raise r.error(BLKIO, f"rows of the run with engine options {options}")
    return found


@table("blkio-scaling", BLKIO)
def blkio_scaling(r: Results) -> list[str]:
    default = _blkio_run(r, "{}")
    depth2 = _blkio_run(r, '{"queue_depth": 2}')
    out = [row("W", "W*B MiB/s", "file / W*B (default depth / `queue_depth` 2)", "gather / B", "raw / W*B"),
           "|---|---|---|---|---|"]
    for w, a in default.items():
        b = depth2.get(w)
        if b is None:
            raise r.error(BLKIO, f'row W={w} in the run with engine options {{"queue_depth": 2}}')
        # groups: 2 W*B, 4 file/W*B, 6 gather/B, 8 raw/W*B
        out.append(row(w, a.group(2), *(f"{a.group(g)} / {b.group(g)}" for g in (4, 6, 8))))
    return out


# ---------------------------------------------------------------- dcp

# the bench's row -> the page's label, which stock row it is measured against, whether the
# ratio is a speed-up (stock / row) or a fraction of stock's time (row / stock), bold
DCP_ROWS = (
    ("save stock", "`dcp.save`, stock `FileSystemWriter` (fsync'ed)", "save stock", True, False),
    ("save fastpersist", "`dcp.save`, `FastPersistWriter` (fsync'ed, atomic, checksummed)", "save stock", True, True),
    ("async_save blocked stock", "`dcp.async_save` blocked, stock writer", "async_save blocked stock", False, False),
    ("async_save blocked fastpersist", "`dcp.async_save` blocked, `FastPersistWriter`", "async_save blocked stock",
     False, False),
    ("AsyncCheckpointer blocked", "`AsyncCheckpointer.save` + the next step's fence", "async_save blocked stock",
     False, True),
    ("load stock", "`dcp.load`, stock `FileSystemReader`", "load stock", True, False),
    ("load fastpersist", "`dcp.load`, `FastPersistReader`", "load stock", True, False),
    ("load fastpersist verify", "`dcp.load`, `FastPersistReader(verify=True)`", "load stock", True, False),
)


@table("dcp", DCP)
def dcp(r: Results) -> list[str]:
    keys = tuple(k for k, *_ in DCP_ROWS)
    lines = _block(r, DCP, r"^\s*row\s+seconds\s+GB/s\s*$", "table of rows, seconds, GB/s")
    # longest labels first: "load fastpersist verify" before "load fastpersist"
    alt = "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))
    found = _rows(r, DCP, lines, r"^\s*(?P<key>" + alt + r")\s+" + _NUM + r"(?:\s+" + _NUM + r")?\s*$", keys,
                  "under 'row seconds GB/s'")
    seconds = {k: float(m.group(2)) for k, m in found.items()}
    out = [row("Row", "seconds", "GB/s", "vs stock"), "|---|---:|---:|---:|"]
    for key, label, base, speedup, strong in DCP_ROWS:
        m = found[key]
        ratio = seconds[base] / seconds[key] if speedup else seconds[key] / seconds[base]
        cell = f"{ratio:.2f}x"
        # a row without a GB/s figure keeps its cell empty, written "| |" as the page does
        out.append(row(label, m.group(2), m.group(3) or "", bold(cell, strong)))
    return out
