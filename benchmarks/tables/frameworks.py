"""Tables of docs/performance.md's "Frameworks" and "Reliability" parts."""

from __future__ import annotations

import re
from typing import Any

from . import Results, bold, row, table

HARNESS = "reliability-harness.json"
HARNESS_DCP = "reliability-harness-dcp.json"
HARNESS_FILE = "reliability-harness-dist-file.json"
PROCESS_KILLS = "process-writer-kills.json"
SOAK = "reliability-soak.json"


# ---------------------------------------------------------------- reliability

def _get(r: Results, name: str, obj: Any, *keys: str | int) -> Any:
    """``obj[k0][k1]...``; TableError naming the file and the path of keys that is missing."""
    for i, k in enumerate(keys):
        try:
            obj = obj[k]
        except (KeyError, IndexError, TypeError):
            raise r.error(name, "field " + "/".join(str(x) for x in keys[:i + 1])) from None
    return obj


def _crash(r: Results, name: str, mode: str) -> dict[str, Any]:
    """The crash harness's entry for ``mode`` in file ``name``."""
    for entry in _get(r, name, r.json(name), "crash"):
        if isinstance(entry, dict) and entry.get("mode") == mode:
            return entry
    raise r.error(name, f"crash entry of mode {mode!r}")


def _crash_cells(r: Results, name: str, modes: tuple[str, ...]) -> tuple[int, str]:
    """(trials, data lost) summed over the crash harness's ``modes`` in file ``name``; a trial
    that failed some other check is said beside the data lost, as the harness counts it."""
    entries = [_crash(r, name, m) for m in modes]
    trials = sum(_get(r, name, e, "trials") for e in entries)
    lost = sum(_get(r, name, e, "data_lost") for e in entries)
    failures = sum(_get(r, name, e, "failures") for e in entries)
    return trials, f"{lost} ({failures} failures)" if failures else str(lost)


# the crash harness's modes the first row sums, and the page's word for each
CORE_MODES = (("sync", "sync"), ("async", "async"), ("dist-sync", "2-rank collective"),
              ("dist-async", "2-rank async collective"))


@table("reliability", HARNESS, HARNESS_DCP, HARNESS_FILE, PROCESS_KILLS, SOAK)
def reliability(r: Results) -> list[str]:
    out = [row("scenario", "trials", "data lost"), "|---|---:|---:|"]

    trials, lost = _crash_cells(r, HARNESS, tuple(m for m, _ in CORE_MODES))
    out.append(row("SIGKILL at random instants: " + ", ".join(w for _, w in CORE_MODES), trials, lost))
    out.append(row("SIGKILL during Lightning `fit` (`last.ckpt` always loads and verifies)",
                   *_crash_cells(r, HARNESS, ("lightning",))))
    out.append(row("SIGKILL during HF `train` (newest `checkpoint-N` always complete)",
                   *_crash_cells(r, HARNESS, ("hf",))))
    out.append(row("SIGKILL during 2-rank sharded (DTensor) saves through `AsyncCheckpointer`",
                   *_crash_cells(r, HARNESS_DCP, ("dist-dcp",))))
    out.append(row('SIGKILL during 2-rank `layout="file"` saves of DTensor state',
                   *_crash_cells(r, HARNESS_FILE, ("dist-file",))))

    # a save past its fence is lost when generation 2 is not what the file holds afterwards
    kills = _get(r, PROCESS_KILLS, r.json(PROCESS_KILLS), "summary", "process after-fence")
    k_trials = _get(r, PROCESS_KILLS, kills, "trials")
    out.append(row('SIGKILL of a trainer right after its fence, `writer="process"`', k_trials,
                   k_trials - _get(r, PROCESS_KILLS, kills, "committed")))

    # a fault loses data when the previous checkpoint is no longer intact ("n/a" where there
    # was none, or the user removed it)
    harness = r.json(HARNESS)
    faults = _get(r, HARNESS, harness, "faults")
    if not faults:
        raise r.error(HARNESS, "fault entries")
    lost = sum(1 for i in range(len(faults)) if _get(r, HARNESS, faults, i, "old_intact") is False)
    out.append(row("full disk, EIO, read-only fs, permission denied, directory removed, O_DIRECT or io_uring refused",
                   f"{len(faults)} faults", lost))

    # damage is lost data when neither `fastpersist verify` nor `load(verify=True)` reports it
    damage = _get(r, HARNESS, harness, "corruption")
    if not damage:
        raise r.error(HARNESS, "corruption entries")
    missed = sum(1 for i in range(len(damage)) if _get(r, HARNESS, damage, i, "cli_exit") == 0
                 or not _get(r, HARNESS, damage, i, "load_exception"))
    named = sum(1 for i in range(len(damage)) if _get(r, HARNESS, damage, i, "names_record_or_tensor") is True)
    # a file cut short has no tensor to name: its error names the torn zip structure
    said = "damaged tensor named" if named == len(damage) else \
        f"the damaged tensor named in {named}, the torn zip structure in {len(damage) - named}"
    out.append(row("flipped bit, zeroed block, truncated file", len(damage),
                   f"{missed} (detected, {said})" if not missed else f"{missed} (not detected)"))

    soak = r.json(SOAK)
    g = {k: _get(r, SOAK, soak, k) for k in ("saves", "fd_growth", "thread_growth", "rss_growth_mib", "newest_ok",
                                           "problems")}
    # the soak is one run: it lost data when its newest checkpoint is not whole or a check failed
    lost = 0 if g["newest_ok"] is True and not g["problems"] else 1
    out.append(row(f"{g['saves']} async saves with rotation", 1,
                   f"{lost} (fds {g['fd_growth']:+d}, threads {g['thread_growth']:+d}, "
                   f"RSS {g['rss_growth_mib']:+.1f} MiB)"))
    return out


# ---------------------------------------------------------------- lightning-finetune

LIGHTNING = "lightning-finetune.txt"

# the example's mode -> the page's label, bold
LIGHTNING_ROWS = (
    ("stock", "stock TorchCheckpointIO", False),
    ("async", "Lightning AsyncCheckpointIO", False),
    ("fastpersist", "FastPersistIO", True),
)
_LIGHTNING_ROW = (r"^(?P<key>stock|async|fastpersist)\s+\d+\s+(?P<stall>[\d.]+ ms)\s+[\d.]+ ms\s+(?:[\d.]+ ms|-)\s+"
                  r"(?P<wall>[\d.]+ s)\s+[\d.]+ MiB\s+(?P<ratio>[\d.]+|inf)x\s*$")


def _lightning_run(r: Results, large: bool) -> dict[str, re.Match[str]]:
    """mode -> its row in the latest run of examples/lightning_finetune.py with (``large``) or
    without ``--large``. A run starts at its command line, ``$ CMD`` as typed or ``# CMD``
    as regenerate.py heads it; the latest run comes first."""
    head = r"^[#$] \S*python\S* examples/lightning_finetune\.py\b.*$"
    what = "run with --large" if large else "run without --large"
    starts = list(re.finditer(head, r.text(LIGHTNING), re.M))
    for i, start in enumerate(starts):
        if ("--large" in start.group(0)) != large:
            continue
        end = starts[i + 1].start() if i + 1 < len(starts) else len(r.text(LIGHTNING))
        found: dict[str, re.Match[str]] = {}
        for m in re.finditer(_LIGHTNING_ROW, r.text(LIGHTNING)[start.end():end], re.M):
            found.setdefault(m.group("key"), m)
        for key, _, _ in LIGHTNING_ROWS:
            if key not in found:
                raise r.error(LIGHTNING, f"row {key!r} in the latest {what}")
        return found
    raise r.error(LIGHTNING, what)


@table("lightning-finetune", LIGHTNING)
def lightning_finetune(r: Results) -> list[str]:
    small, large = _lightning_run(r, False), _lightning_run(r, True)
    out = [row("checkpoint IO", "stall per checkpoint", "wall", "stall vs stock", "`--large`: stall per checkpoint",
               "wall", "vs stock"), "|---|---:|---:|---:|---:|---:|---:|"]
    for key, label, strong in LIGHTNING_ROWS:
        a, b = small[key], large[key]
        cells = (label, a["stall"], a["wall"], a["ratio"] + "x", b["stall"], b["wall"], b["ratio"] + "x")
        out.append(row(*(bold(c, strong) for c in cells)))
    return out
