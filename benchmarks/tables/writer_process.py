"""Tables of docs/performance.md's "The writer process" part: kill trials (one trainer, then
two ranks), what a writer process per trainer costs, and the step cost beside the thread writer."""

from __future__ import annotations

import os
import re
from typing import Any

from . import Results, TableError, bold, row, table

KILLS = "process-writer-kills.json"
COLLECTIVE_KILLS = "process-writer-collective-kills.json"
COST = "writer-process-cost.txt"
ASYNC = "process-writer-async.txt"
ASYNC_PY = "process-writer-async-python-ops.txt"

# The outcomes a kill trial's checkpoint can have that the tables have a column for; any other
# (victim-error, writer-hung, "generation N") is a failed trial the tables cannot show, so it
# stops the rendering rather than vanishing from the counts.
OUTCOMES = ("committed", "previous", "torn")


def _json(r: Results, name: str) -> dict[str, Any]:
    report = r.json(name)
    if not isinstance(report, dict) or not isinstance(report.get("trials"), list) or not report["trials"]:
        raise r.error(name, "list of trials under 'trials'")
    return report


def _field(r: Results, name: str, obj: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise r.error(name, f"{key!r} in {obj!r}")
    return value


def _outcomes(r: Results, name: str, trials: list[dict[str, Any]], **match: str) -> dict[str, int]:
    """Counts of each outcome among the trials whose fields equal ``match``; TableError when
    there are none or one has an outcome the tables have no column for."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for t in trials:
        if all(t.get(k) == v for k, v in match.items()):
            result = _field(r, name, t, "result", str)
            if result not in counts:
                raise TableError(f"table {r.table}: {os.path.join(r.directory, name)}: a trial {match} ended {result!r}, "
                                 f"which the table has no column for: {t!r}")
            counts[result] += 1
    if not any(counts.values()):
        raise r.error(name, f"trials {match}")
    return counts


def _number(value: float) -> str:
    """A command-line figure as the page writes it: 300.0 -> 300, 62.5 -> 62.5."""
    return f"{value:g}"


# (writer, when) in the kills report -> the page's label; bold: the process writer's claim.
KILL_ROWS = (
    ("process", "after-fence", '`writer="process"`', True),
    ("thread", "after-fence", '`writer="thread"` (control)', False),
)


@table("writer-process-kills", KILLS)
def writer_process_kills(r: Results) -> list[str]:
    report = _json(r, KILLS)
    out = [row("writer", "trials", "generation 2 committed", "lost (generation 1 kept)", "torn"),
           "|---|---:|---:|---:|---:|"]
    for writer, when, label, strong in KILL_ROWS:
        c = _outcomes(r, KILLS, report["trials"], writer=writer, when=when)
        out.append(row(label, sum(c.values()), bold(c["committed"], strong), bold(c["previous"], strong), c["torn"]))
    # A kill while the snapshot is copied may come before save() hands the state to the writer:
    # generation 1 kept is then the right outcome, not a lost save, and the label says so.
    c = _outcomes(r, KILLS, report["trials"], writer="process", when="in-snapshot")
    delay = _field(r, KILLS, report, "snapshot_max_delay_ms", (int, float))
    mib = _field(r, KILLS, report, "snapshot_mib", int)
    kept = f"{c['previous']} (killed before the hand-over)" if c["previous"] else "0"
    out.append(row(f'`writer="process"`, killed 0-{_number(delay)} ms after `save()` of {mib} MiB',
                   sum(c.values()), c["committed"], kept, c["torn"]))
    return out


# kind in the collective kills report -> the page's label.
COLLECTIVE_ROWS = (
    ("collective", "collective (`group=`)"),
    ("file", '`layout="file"`'),
    ("dcp", "DCP directory"),
)


@table("writer-process-collective-kills", COLLECTIVE_KILLS)
def writer_process_collective_kills(r: Results) -> list[str]:
    report = _json(r, COLLECTIVE_KILLS)
    trials = report["trials"]
    out = [row("save", "rank 1 killed after its fence, ms", '`writer="process"`: committed / trials',
               '`writer="thread"` (control): committed / trials', "torn"),
           "|---|---:|---:|---:|---:|"]
    for kind, label in COLLECTIVE_ROWS:
        p = _outcomes(r, COLLECTIVE_KILLS, trials, kind=kind, writer="process")
        t = _outcomes(r, COLLECTIVE_KILLS, trials, kind=kind, writer="thread")
        # The kill delays drawn for this kind: the window the counts cover (both writers share
        # each draw).
        delays = [_field(r, COLLECTIVE_KILLS, x, "delay_ms", (int, float)) for x in trials if x.get("kind") == kind]
        out.append(row(label, f"{min(delays):.1f}-{max(delays):.1f}",
                       bold(f"{p['committed']} / {sum(p.values())}", True),
                       f"{t['committed']} / {sum(t.values())}", p["torn"] + t["torn"]))
    return out


# The cost script prints its table in Markdown; its column names -> the page's.
COST_COLUMNS = (
    ("trainers", "trainers"),
    ("first save (starts the writer), s", "first save to `result()`, s"),
    ("second save, s", "second save, s"),
    ("writer RSS, MiB", "writer RSS, MiB"),
    ("writer PSS, MiB", "writer PSS, MiB"),
    ("all writers' PSS, MiB", "all writers' PSS, MiB"),
)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@table("writer-process-cost", COST)
def writer_process_cost(r: Results) -> list[str]:
    lines = r.lines(COST)
    want = [ours for ours, _ in COST_COLUMNS]
    try:
        i = next(k for k, line in enumerate(lines) if line.startswith("|") and _cells(line) == want)
    except StopIteration:
        raise r.error(COST, f"table with the columns {want}") from None
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        if len(cells) != len(want) or not all(re.fullmatch(r"\d+(\.\d+)?", c) for c in cells):
            raise r.error(COST, f"row of {len(want)} figures (found {line!r})")
        rows.append(row(*cells))
    if not rows:
        raise r.error(COST, f"rows under the table with the columns {want}")
    return [row(*(page for _, page in COST_COLUMNS)), "|---:|---:|---:|---:|---:|---:|", *rows]


def _summary(r: Results, name: str) -> dict[str, dict[str, str]]:
    """The summary table ``fastpersist bench --async`` prints (a header line, no title):
    {row label: {column: cell}}."""
    return dict(r.aligned(name, header_start="step s (median)"))


# (the bench's row label, the page's mode)
ASYNC_ROWS = (
    ("fp_core AsyncCheckpointer() (policy='auto')", "`AsyncCheckpointer()` (auto, thread)"),
    ("fp_core AsyncCheckpointer(policy='snapshot')", '`policy="snapshot"` (thread)'),
    ("fp_core AsyncCheckpointer(writer='process')", '`writer="process"` (snapshot)'),
)


@table("writer-process-async", ASYNC, ASYNC_PY)
def writer_process_async(r: Results) -> list[str]:
    # The Python-heavy run is the one whose step holds the GIL; a plain run in its place would
    # render under the wrong step.
    r.match(ASYNC_PY, r"^# fastpersist bench --async .*--python-ops \d+", "bench --async --python-ops command line")
    if re.search(r"^# .*--python-ops", r.text(ASYNC), re.M):
        raise r.error(ASYNC, "plain step (its command line has --python-ops)")
    out = [row("step", "mode", "slowdown", "blocked / ckpt", "CPU s / ckpt"), "|---|---|---:|---:|---:|"]
    for step, name in (("plain", ASYNC), ("Python-heavy", ASYNC_PY)):
        summary = _summary(r, name)
        for key, mode in ASYNC_ROWS:
            c = summary.get(key)
            if c is None:
                raise r.error(name, f"row {key!r} in the summary table")
            try:
                out.append(row(step, mode, c["slowdown"], f"{c['blocked/ckpt s']} s", c["CPU s/ckpt"]))
            except KeyError as e:
                raise r.error(name, f"column {e.args[0]!r} in the summary table") from None
    return out
