"""benchmarks/regenerate.py: its listing names scripts and results that exist, every file in
benchmarks/results/ has a producer, the bench command lines parse, the index has a row per
entry, and a run replaces an output only when every command of its entry succeeded."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "regenerate.py")
RESULTS = os.path.join(REPO, "benchmarks", "results")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import regenerate  # noqa: E402

SCRIPT_PATH = re.compile(r"(?:benchmarks|examples)/[\w/.-]+\.(?:py|sh)")


def _listing() -> dict[str, tuple[list[str], list[str]]]:
    """``--list`` parsed: entry name -> (output paths, command lines)."""
    out = subprocess.run([sys.executable, SCRIPT, "--list", "--scratch", "/scratch"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    entries: dict[str, tuple[list[str], list[str]]] = {}
    name = None
    for line in out.splitlines():
        if line.startswith("    "):
            assert name is not None, line
            entries[name][1].append(line.strip())
        else:
            name, _, outs = line.partition(": ")
            assert name not in entries, f"entry {name} listed twice"
            entries[name] = (outs.split(), [])
    return entries


def test_list_names_scripts_and_results_that_exist():
    entries = _listing()
    assert set(entries) == {e.name for e in regenerate.ENTRIES}
    for name, (outs, cmds) in entries.items():
        assert outs, f"{name} lists no output"
        assert cmds, f"{name} lists no command"
        for o in outs:
            assert o.startswith("benchmarks/results/"), (name, o)
            assert os.path.isfile(os.path.join(REPO, o)), f"{name}: {o} does not exist"
        for c in cmds:
            scripts = SCRIPT_PATH.findall(c)
            # fio: the independent measure of the disk, a tool of its own
            assert scripts or "fastpersist bench" in c or c.startswith("fio "), f"{name}: no script named in {c!r}"
            for s in scripts:
                assert os.path.isfile(os.path.join(REPO, s)), f"{name}: {s} does not exist"
            assert "/scratch/" + name in c or "--dir" not in c, f"{name}: --dir outside its scratch: {c!r}"


def test_every_result_file_has_one_producer():
    produced: dict[str, str] = {}
    for e in regenerate.ENTRIES:
        for o in e.outputs:
            assert o not in produced, f"{o} written by {produced[o]} and {e.name}"
            produced[o] = e.name
    on_disk = []
    for root, _, files in os.walk(RESULTS):
        on_disk += [os.path.relpath(os.path.join(root, f), RESULTS) for f in files]
    orphans = [f for f in on_disk if f != "README.md" and f not in produced
               and not any(f.startswith(p) for p in regenerate.OTHER_PRODUCERS)]
    assert not orphans, f"no entry of benchmarks/regenerate.py writes {orphans}"
    missing = [o for o in produced if o not in on_disk]
    assert not missing, f"entries name outputs that are not in benchmarks/results/: {missing}"


def test_bench_command_lines_parse():
    """Every ``fastpersist bench`` line, as the listing runs it, passes the CLI's own parser
    and sizing (``--dry-run``), loop variables given a value each loop takes."""
    from fp_core.tools.cli import main

    seen = 0
    for e in regenerate.ENTRIES:
        for c in e.commands:
            text = regenerate.render(c, "/scratch/x", "/scratch/out").replace("$pg", "huge").replace("$e", "1")
            for seg in re.findall(r"fastpersist (bench[^;)]*)", text):
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    rc = main(shlex.split(seg) + ["--dry-run"])
                assert rc in (0, None), f"{e.name}: {seg!r} exits {rc}: {buf.getvalue()}"
                assert "dry run" in buf.getvalue(), (e.name, seg, buf.getvalue())
                seen += 1
    assert seen >= 20


def test_index_has_a_row_per_entry_linking_outputs_and_docs():
    with open(os.path.join(RESULTS, "README.md")) as f:
        text = f.read()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| Name")}
    assert set(rows) == {e.name for e in regenerate.ENTRIES}
    for e in regenerate.ENTRIES:
        for o in e.outputs:
            assert f"]({o})" in rows[e.name], f"the index's {e.name} row does not link {o}"
        page = re.search(r"\]\(\.\./\.\./docs/([\w.]+)", rows[e.name])
        assert page, f"the index's {e.name} row links no docs page"
        assert os.path.isfile(os.path.join(REPO, "docs", page.group(1))), page.group(1)


def test_unknown_only_names_the_entry():
    r = subprocess.run([sys.executable, SCRIPT, "--only", "no-such-bench", "--list"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "no-such-bench" in r.stderr


def _entry(name: str, *commands: str, stdout: str | None = "out.txt") -> regenerate.Entry:
    return regenerate.Entry(name, "a question", commands, stdout, "performance.md")


def test_run_writes_header_then_output_and_moves_written_files(tmp_path):
    results = tmp_path / "results"
    e = _entry("demo", "echo first", "python -c 'import json; json.dump([1, 2], open(\"{out:r.json}\", \"w\"))'; "
               "echo second")
    assert regenerate.run_entry(e, str(tmp_path / "scratch"), str(results))
    lines = (results / "out.txt").read_text().splitlines()
    assert lines[0].startswith("# echo first   (") and lines[0].endswith(")")
    assert lines[1] == "first"
    assert lines[2].startswith("# python -c ") and "benchmarks/results/r.json" in lines[2]
    assert lines[3] == "second"
    assert json.loads((results / "r.json").read_text()) == [1, 2]
    assert sorted(os.listdir(results)) == ["out.txt", "r.json"]


@pytest.mark.parametrize("commands", [
    ("echo partial", "exit 3"),                     # a later command fails
    ("echo partial | false",),                       # a pipeline's first stage succeeds, its last fails
    ("echo partial; test -e {out:r.json}",),         # its own check for the declared file fails
    ("echo written but r.json is not",),             # exits 0, declared file never written
])
def test_failed_run_keeps_the_previous_results(tmp_path, commands):
    results = tmp_path / "results"
    results.mkdir()
    (results / "out.txt").write_text("previous\n")
    (results / "r.json").write_text("[0]")
    cmds = commands if any("{out:" in c for c in commands) else commands + (": {out:r.json}",)
    e = _entry("demo", *cmds)
    assert not regenerate.run_entry(e, str(tmp_path / "scratch"), str(results))
    assert (results / "out.txt").read_text() == "previous\n"
    assert (results / "r.json").read_text() == "[0]"
    assert sorted(os.listdir(results)) == ["out.txt", "r.json"]


def test_tree_placeholder_unpacks_and_builds_a_commit(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    e = _entry("tree", "cd {tree:" + head + "} && python -c 'import fp_core._native, fp_core; print(fp_core.__file__)'")
    assert regenerate.run_entry(e, str(tmp_path / "scratch"), str(tmp_path / "results"))
    out = (tmp_path / "results" / "out.txt").read_text().splitlines()
    assert out[1] == str(tmp_path / "scratch" / "regenerate-trees" / head / "fp_core" / "__init__.py")
