"""Tables of docs/performance.md's "Loads" part: the cold 2 GiB load, the mapped loads and
what a resume's first write pays for them."""

from __future__ import annotations

import re

from . import Results, bold, row, table

BENCH_LOAD_2G = "bench-load-2GiB.txt"
LOAD_MAPPED = "load-mapped-4GiB.txt"
RESUME_COST = "resume-cost-2GiB.txt"


def _labelled(r: Results, name: str, first: str) -> dict[str, dict[str, str]]:
    """The table in file ``name`` whose header's first name is ``first`` and names its label
    column (the form load_mapped.py and resume_cost.py print): {label: {column: cell}}, up
    to the first blank line. Names and cells are separated by two spaces or more."""
    lines = r.lines(name)
    i = next((k for k, line in enumerate(lines) if re.split(r"\s{2,}", line.strip())[0] == first), None)
    if i is None:
        raise r.error(name, f"table headed {first!r}")
    columns = re.split(r"\s{2,}", lines[i].strip())[1:]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[i + 1:]:
        if not line.strip():
            break
        label, *cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == len(columns):
            rows[label] = dict(zip(columns, cells))
    return rows


def _get(r: Results, name: str, rows: dict[str, dict[str, str]], label: str, column: str) -> str:
    try:
        return rows[label][column]
    except KeyError:
        raise r.error(name, f"row {label!r} with a {column!r} cell") from None


# load-2GiB: (the bench's row label, the page's label, bold GB/s, vs device, vs 4 KiB pages)
LOAD_ROWS = (
    ("device limit: native Reader, O_DIRECT",
     "device limit: native reader, O_DIRECT, into memory faulted in before (huge pages)", (False, False, False)),
    ("native Reader into 4 KiB pages (a model's tensors)",
     "native reader into 4 KiB pages faulted in before (where a model's tensors are)", (False, False, False)),
    ("native Reader into fresh memory (a load's floor)",
     "native reader into fresh memory (where any load returning new tensors starts)", (False, False, False)),
    ("torch.load(mmap=True) + touch every page", "torch.load(mmap=True) + touch every page", (False, False, False)),
    ("fp_core.load", "**`fp_core.load`**", (True, True, False)),
    ("fp_core.load(verify=True)", "`fp_core.load(verify=True)`", (False, False, False)),
    ("fp_core.load_into(existing state)", "**`fp_core.load_into(existing state)`**", (True, True, True)),
    ("fp_core.load_into(existing state, verify=True)", "`fp_core.load_into(existing state, verify=True)`",
     (False, False, False)),
)


@table("load-2GiB", BENCH_LOAD_2G)
def load_2gib(r: Results) -> list[str]:
    out = [row("Load (cold page cache)", "GB/s", "vs device", "vs 4 KiB pages"), "|---|---:|---:|---:|"]
    rows = dict(r.aligned(BENCH_LOAD_2G, "Load (cold page cache)"))
    for key, label, strong in LOAD_ROWS:
        if key not in rows:
            raise r.error(BENCH_LOAD_2G, f"row {key!r} under 'Load (cold page cache)'")
        cells = [rows[key][c] for c in ("GB/s", "vs load_device", "vs load_device_4k")]
        out.append(row(label, *(bold(c, b) for c, b in zip(cells, strong))))
    return out


# mapped-loads: (load_mapped.py's row label, the page's file cell, the page's reader cell)
MAPPED_ROWS = (
    ("fp_core file: torch.load(mmap=True) + touch", "fp_core.save's", "torch.load(mmap=True)"),
    ("fp_core file: fp_core.load(mmap=True) + touch", "fp_core.save's", "fp_core.load(mmap=True)"),
    ("fp_core file: fp_core.load(mmap=True, verify=True) + touch", "fp_core.save's",
     "fp_core.load(mmap=True, verify=True)"),
    ("fp_core file: fp_core.load", "fp_core.save's", "fp_core.load (fresh memory)"),
    ("torch file: torch.load(mmap=True) + touch", "torch.save's", "torch.load(mmap=True)"),
    ("torch file: fp_core.load(mmap=True) + touch", "torch.save's", "fp_core.load(mmap=True)"),
)


@table("mapped-loads", LOAD_MAPPED)
def mapped_loads(r: Results) -> list[str]:
    out = [row("file", "reader (+ touch every page)", "s", "vs device row", "vs torch mmap, same file"),
           "|---|---|---:|---:|---:|"]
    rows = _labelled(r, LOAD_MAPPED, "row")
    for key, file, reader in MAPPED_ROWS:
        out.append(row(file, reader, *(_get(r, LOAD_MAPPED, rows, key, c)
                                       for c in ("s", "vs device", "vs torch mmap, same file"))))
    return out


# resume-first-write: (the page's label, resume_cost.py's load row or None, its load + first
# write row, whether the page bolds the second)
RESUME_ROWS = (
    ("`fp_core.load`", "fp_core.load", "fp_core.load + first write", True),
    ("`torch.load(mmap=True)` + touch", "torch.load(mmap=True) + touch",
     "torch.load(mmap=True) + touch + first write", False),
    # resume_cost.py times a mapped fp_core.load only with its first write
    ("`fp_core.load(mmap=True)`", None, "fp_core.load(mmap=True) + touch + first write", False),
)


@table("resume-first-write", RESUME_COST)
def resume_first_write(r: Results) -> list[str]:
    out = [row("2 GiB, 2412 tensors", "load", "load + first write"), "|---|---:|---:|"]
    rows = _labelled(r, RESUME_COST, "row")
    for label, load, written, strong in RESUME_ROWS:
        load_cell = f"{_get(r, RESUME_COST, rows, load, 's')} s" if load else ""
        out.append(row(label, load_cell, bold(f"{_get(r, RESUME_COST, rows, written, 's')} s", strong)))
    return out
