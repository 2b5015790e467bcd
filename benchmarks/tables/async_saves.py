"""Tables of docs/performance.md's "Async saves, overlapped with training" part, and the
resume-from-memory table of "The writer process"."""

from __future__ import annotations

import re
import shlex

from . import Results, bold, row, table

BENCH_ASYNC = "bench-async.txt"
BENCH_ASYNC_2S = "bench-async-2s-12rounds.txt"
BENCH_ASYNC_4S = "bench-async-4s-8rounds.txt"
FENCE_BLOCKED = "fence-blocked.txt"
RESUME_FROM_MEMORY = "resume-from-memory.txt"

DASH = "—"

# The columns ``fastpersist bench --async`` prints, in the order it prints them (the
# right-aligned table's header).
ASYNC_COLUMNS = ("step s (median)", "slowdown", "cost/ckpt s", "blocked/ckpt s", "vs torch.save")


def _grid(r: Results, name: str, columns: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """The right-aligned table in file ``name`` whose header starts with ``columns``:
    {row label: {column: cell}}. A header's names are separated by two spaces or more and end
    where their cells end; the rows run to the first blank line, and a line whose last
    fields do not end under the header's names (a note printed under the table) is no row."""
    lines = r.lines(name)
    headers = ((k, [(m.group(0), m.end()) for m in re.finditer(r"\S+(?: \S+)*", line)])
               for k, line in enumerate(lines))
    found = next(((k, heads) for k, heads in headers if tuple(h for h, _ in heads[:len(columns)]) == columns), None)
    if found is None:
        raise r.error(name, f"table with the columns {', '.join(columns)}")
    i, heads = found
    rows: dict[str, dict[str, str]] = {}
    for line in lines[i + 1:]:
        if not line.strip():
            break
        fields = list(re.finditer(r"\S+", line))
        if len(fields) <= len(heads):
            continue
        values = fields[-len(heads):]
        if [f.end() for f in values] != [end for _, end in heads]:
            continue
        rows[line[:values[0].start()].strip()] = {h: f.group(0) for (h, _), f in zip(heads, values)}
    return rows


def _cells(r: Results, name: str, grid: dict[str, dict[str, str]], label: str) -> dict[str, str]:
    """The row of ``grid`` labelled ``label``, or the only one whose label starts with it."""
    if label in grid:
        return grid[label]
    found = [cells for key, cells in grid.items() if key.startswith(label)]
    if len(found) != 1:
        raise r.error(name, f"row {label!r}" if not found else f"single row {label!r}")
    return found[0]


def _section(r: Results, name: str, title: str) -> dict[str, str]:
    """The indented ``key: value`` lines under the line that starts with ``title``."""
    lines = r.lines(name)
    try:
        i = next(k for k, line in enumerate(lines) if line.startswith(title))
    except StopIteration:
        raise r.error(name, f"section {title!r}") from None
    out: dict[str, str] = {}
    for line in lines[i + 1:]:
        m = re.match(r"^\s+(\S+): (.*)$", line)
        if m is None:
            break
        out[m.group(1)] = m.group(2)
    if not out:
        raise r.error(name, f"lines under {title!r}")
    return out


# ---------------------------------------------------------------- a checkpoint every iteration

# (the bench's row label, its key in "slowdown beyond the disk floor", the page's label,
#  whether the row writes checkpoints, bold). The page orders the rows as here.
EVERY_ITERATION_ROWS = (
    ("no checkpoint", None, "no checkpoint", False, False),
    ("floor: same bytes to disk", None, "floor: same bytes to disk, no checkpoint", False, False),
    ("torch.save + fsync", "torch", "torch.save + fsync", True, False),
    ("Lightning AsyncCheckpointIO (clone + thread)", "lightning", "Lightning AsyncCheckpointIO (clone + thread)",
     True, False),
    ("torch.distributed.checkpoint.async_save", "dcp", "torch.distributed.checkpoint.async_save", True, False),
    ("fp_core AsyncCheckpointer() (policy='auto')", "auto", "**AsyncCheckpointer()** (`auto`)", True, True),
    ("fp_core AsyncCheckpointer(policy='overlap')", "overlap", '**AsyncCheckpointer(policy="overlap")**', True, True),
    ("fp_core AsyncCheckpointer(policy='snapshot')", "snapshot", '**AsyncCheckpointer(policy="snapshot")**', True,
     True),
    ("overlap, CPU work in the background", "overlap_bg", "overlap, CPU work in the background", True, False),
    ("snapshot, CPU work in the background", "snapshot_bg", "snapshot, CPU work in the background", True, False),
)


def _seconds(cell: str) -> str:
    """``+0.152`` (the bench's cost, signed as a difference) as the page's ``0.152 s``."""
    return DASH if cell == "-" else f"{cell.removeprefix('+')} s"


def _share_of_torch(cell: str) -> str:
    """torch.save's own row is the reference: ``100.0%`` on the page is ``100%``."""
    if cell == "-":
        return DASH
    return "100%" if cell == "100.0%" else cell


@table("async-every-iteration", BENCH_ASYNC)
def async_every_iteration(r: Results) -> list[str]:
    grid = _grid(r, BENCH_ASYNC, ASYNC_COLUMNS)
    beyond = _section(r, BENCH_ASYNC, "slowdown beyond the disk floor")
    out = [row("mode", "step (s, median)", "slowdown", "cost per checkpoint", "beyond the disk floor",
                "blocked per checkpoint", "vs torch.save's"),
           "|---|---:|---:|---:|---:|---:|---:|"]
    for i, (key, floor_key, label, checkpoints, strong) in enumerate(EVERY_ITERATION_ROWS):
        c = _cells(r, BENCH_ASYNC, grid, key)
        reference = i == 0  # the step every slowdown is measured against
        if floor_key is None:
            # the reference has no floor to be beyond; the floor row is the floor
            points = "" if reference else DASH
        else:
            m = re.fullmatch(r"([+-]\d+(?:\.\d+)?) points", beyond.get(floor_key, ""))
            if m is None:
                raise r.error(BENCH_ASYNC, f"'{floor_key}: ... points' under 'slowdown beyond the disk floor'")
            points = m.group(1)
        cells = (c["step s (median)"],
                 DASH if reference else c["slowdown"],
                 _seconds(c["cost/ckpt s"]),
                 points,
                 _seconds(c["blocked/ckpt s"]) if checkpoints else DASH,
                 _share_of_torch(c["vs torch.save"]))
        out.append(row(label, *(bold(x, strong) for x in cells)))
    return out


# ---------------------------------------------------------------- the slowdown and the disk floor

FLOOR_RUNS = (BENCH_ASYNC_2S, BENCH_ASYNC_4S)
# the policy (the page's column and the key of its target line) -> the bench's row label
FLOOR_POLICIES = (("auto", "fp_core AsyncCheckpointer() (policy='auto')"),
                  ("overlap", "fp_core AsyncCheckpointer(policy='overlap')"),
                  ("snapshot", "fp_core AsyncCheckpointer(policy='snapshot')"))
# the options the page's prose names for every run; a row names the rest
FLOOR_COMMON_OPTIONS = {"--dir", "--modes", "--iters", "--warmup"}


def _own_options(r: Results, name: str) -> str:
    cmd = r.match(name, r"^# fastpersist bench (.*?)(?:\s{2,}\(.*)?$", "'# fastpersist bench ...' command line")
    args = shlex.split(cmd.group(1))
    own: list[str] = []
    k = 0
    while k < len(args):
        takes_value = k + 1 < len(args) and not args[k + 1].startswith("--")
        if args[k] not in FLOOR_COMMON_OPTIONS and args[k] != "--async":
            own.extend(args[k:k + 1 + takes_value])
        k += 1 + takes_value
    return " ".join(own)


@table("async-floor", *FLOOR_RUNS)
def async_floor(r: Results) -> list[str]:
    out = [row("steps", "rounds", "floor", *(policy for policy, _ in FLOOR_POLICIES), "output"),
           "|---|---:|---:|---:|---:|---:|---|"]
    for name in FLOOR_RUNS:
        step = r.match(name, r"^compute per iteration \(no checkpoint\): (\d+(?:\.\d+)?) s",
                       "'compute per iteration (no checkpoint): ... s'").group(1)
        rounds = r.match(name, r"(\d+) rounds x \d+ iterations", "'N rounds x M iterations'").group(1)
        calibrated = r.match(name, r"steps calibrated to ~(\d+(?:\.\d+)?) s", "'steps calibrated to ~N s'").group(1)
        grid = _grid(r, name, ASYNC_COLUMNS)
        cells = [_cells(r, name, grid, "floor:")["slowdown"]]
        for policy, key in FLOOR_POLICIES:
            slowdown = _cells(r, name, grid, key)["slowdown"]
            ci = r.match(name, rf"^\s*\[(?:PASS|FAIL)\] {policy}: slowdown <= .*?CI ([+-]\d+(?:\.\d+)?)"
                               rf"\.\.([+-]\d+(?:\.\d+)?)%", f"'[PASS|FAIL] {policy}: slowdown ...' target with a CI")
            cells.append(f"{slowdown} ({ci.group(1)}..{ci.group(2)})")
        out.append(row(f"{step} s (`{_own_options(r, name)}`)", rounds, *cells,
                        f"[{calibrated} s](../benchmarks/results/{name})"))
    return out


# ---------------------------------------------------------------- a save followed by its fence

# the script's mode label -> the page's column, bold
FENCE_MODES = (
    ("overlap, fence copies the rest", "overlap, fence copies the unwritten rest", False),
    ("overlap, fence waits for the write", "overlap, fence waits for the write", False),
    ("snapshot (warm arena)", "snapshot, warm arena", False),
    ("auto (warm arena)", "auto, warm arena", True),
)


def _state_label(mb: int) -> str:
    return f"{mb // 1000} GB" if mb >= 1000 and mb % 1000 == 0 else f"{mb} MB"


@table("fence-blocked", FENCE_BLOCKED)
def fence_blocked(r: Results) -> list[str]:
    r.match(FENCE_BLOCKED, r"^\s*state\s+mode\s+blocked s\s+vs torch\.save\+fsync\b", "header 'state  mode  ...'")
    states: dict[int, dict[str, str]] = {}
    state = None
    for line in r.lines(FENCE_BLOCKED):
        m = re.match(r"^\s*(?:(\d+)MB\s+)?([a-z].*?)\s{2,}(\d+\.\d+)\s+(\d+(?:\.\d+)?%)(?:\s|$)", line)
        if m is None:
            continue
        if m.group(1):
            state = int(m.group(1))
            states[state] = {}
        if state is not None:
            states[state][m.group(2)] = m.group(4)
    # a state for every size the run was asked for: a file cut short is refused, not rendered short
    # (the script prints each state's own bytes, which need not equal the size asked for)
    sizes = re.search(r"^# .*--sizes (\S+)", r.text(FENCE_BLOCKED), re.M)
    wanted = len(sizes.group(1).split(",")) if sizes else 1
    if len(states) < wanted:
        asked = f" (--sizes {sizes.group(1)})" if sizes else ""
        got = ", ".join(f"{mb}MB" for mb in states) or "none"
        raise r.error(FENCE_BLOCKED, f"rows for {wanted} states{asked}, only for {got}")
    out = [row("state", *(label for _, label, _ in FENCE_MODES)),
           "|---:|---:|---:|---:|---:|"]
    for mb, modes in states.items():
        cells = []
        for key, _, strong in FENCE_MODES:
            if key not in modes:
                raise r.error(FENCE_BLOCKED, f"row {key!r} for the state {mb}MB")
            cells.append(bold(modes[key], strong))
        out.append(row(_state_label(mb), *cells))
    return out


# ---------------------------------------------------------------- resume from memory

RESUME_COLUMNS = (("memory image (verify)", "memory image (every byte checked)", True),
                  ("disk (verify)", "disk, verify", False),
                  ("disk (no verify)", "disk, no verify", False))


@table("resume-from-memory", RESUME_FROM_MEMORY)
def resume_from_memory(r: Results) -> list[str]:
    grid = _grid(r, RESUME_FROM_MEMORY, ("s", "GB/s"))
    out = [row("", *(label for _, label, _ in RESUME_COLUMNS)),
           "|---|---:|---:|---:|"]
    for fn in ("load", "load_into"):
        cells = [bold(f"{_cells(r, RESUME_FROM_MEMORY, grid, f'{fn}, {key}')['s']} s", strong)
                 for key, _, strong in RESUME_COLUMNS]
        out.append(row(f"`fp_core.{fn}`", *cells))
    return out
