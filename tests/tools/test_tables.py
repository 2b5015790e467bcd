"""benchmarks/tables/: every table of docs/performance.md and README.md is marked, has a
renderer that reads its results files, and equals what the committed results render to, so
no table holds a hand-copied figure; regenerate.py --tables rewrites only what differs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "benchmarks", "results")
SCRIPT = os.path.join(REPO, "benchmarks", "regenerate.py")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import tables  # noqa: E402

RENDERERS = tables.load_renderers()


def _page(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def _marked() -> dict[str, str]:
    """table name -> the page that holds it."""
    out: dict[str, str] = {}
    for page in tables.PAGES:
        for name, _, _ in tables.blocks(_page(page)):
            assert name not in out, f"table {name} is marked twice ({out[name]}, {page})"
            out[name] = page
    return out


def test_every_table_on_the_pages_is_marked():
    for page in tables.PAGES:
        text = _page(page)
        inside = set()
        for _, start, end in tables.blocks(text):
            inside.update(range(start, end))
        loose = [i + 1 for i, line in enumerate(text.split("\n")) if line.startswith("|") and i not in inside]
        assert not loose, f"{page}: table lines outside <!-- table --> markers: {loose}"


def test_every_marked_table_has_one_renderer_and_every_renderer_a_table():
    marked = _marked()
    assert sorted(marked) == sorted(RENDERERS)


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_a_table_reads_only_results_that_exist_and_fails_clearly_without_them(name, tmp_path):
    t = RENDERERS[name]
    assert t.sources, f"table {name} names no results file"
    for s in t.sources:
        assert os.path.isfile(os.path.join(RESULTS, s)), f"table {name}: no benchmarks/results/{s}"
    # with its sources gone it cannot render: it reads them and holds no figure of its own
    with pytest.raises(tables.TableError, match=rf"table {re.escape(name)}: .*{re.escape(str(tmp_path))}"):
        tables.render(name, str(tmp_path))


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_a_table_follows_its_results(name, tmp_path):
    """Every figure in the sources bumped by one in its last digit: the rendered table changes
    (a renderer that ignores its file, or prints a constant, fails here)."""
    shutil.copytree(RESULTS, tmp_path, dirs_exist_ok=True)
    before = tables.render(name, str(tmp_path))
    for s in RENDERERS[name].sources:
        path = tmp_path / s
        text = path.read_text()
        # only numbers with a decimal point: the labels' sizes (4GiB, 2412 tensors) stay put
        path.write_text(re.sub(r"(?<![\w.])(\d+\.\d*)([0-8])(?![\d.])", lambda m: m.group(1) + str(int(m.group(2)) + 1),
                               text))
    assert tables.render(name, str(tmp_path)) != before


def test_the_pages_hold_what_the_committed_results_render_to():
    assert tables.update_pages(RESULTS, check=True) == [], (
        "a table differs from benchmarks/results/: run .venv/bin/python benchmarks/regenerate.py --tables")


def test_regenerate_tables_rewrites_only_tables_and_refuses_a_results_file_without_a_row(tmp_path):
    repo = tmp_path / "repo"
    for page in tables.PAGES:
        (repo / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(REPO, page), repo / page)
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    perf = repo / "docs" / "performance.md"
    # a stale figure in a table and a figure in the prose: the table is rendered anew, the
    # prose is left alone
    text = perf.read_text()
    name, start, end = tables.blocks(text)[1]
    lines = text.split("\n")
    lines[end - 1] = re.sub(r"\d+\.\d+", "9.99", lines[end - 1])
    lines.insert(0, "prose 9.99")
    perf.write_text("\n".join(lines))
    assert tables.update_pages(str(results), check=True, repo=str(repo)) == ["docs/performance.md"]
    assert tables.update_pages(str(results), repo=str(repo)) == ["docs/performance.md"]
    assert perf.read_text() == "prose 9.99\n" + _page("docs/performance.md")
    assert tables.update_pages(str(results), check=True, repo=str(repo)) == []
    # a results file cut short: a clear error naming the table and the file, no page changed
    before = {p: (repo / p).read_text() for p in tables.PAGES}
    src = results / RENDERERS["save-4GiB"].sources[0]
    src.write_text(src.read_text().split("(f)")[0])
    with pytest.raises(tables.TableError, match=rf"table save-4GiB: {re.escape(str(src))} holds no row '\(f\)'"):
        tables.update_pages(str(results), repo=str(repo))
    assert {p: (repo / p).read_text() for p in tables.PAGES} == before


def test_regenerate_command_line_checks_and_says_what_is_wrong(tmp_path):
    ok = subprocess.run([sys.executable, SCRIPT, "--tables", "--check"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    shutil.copytree(RESULTS, tmp_path, dirs_exist_ok=True)
    os.remove(tmp_path / RENDERERS["save-4GiB"].sources[0])
    bad = subprocess.run([sys.executable, SCRIPT, "--tables", "--check", "--results", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "table save-4GiB: cannot read" in bad.stderr and "no page changed" in bad.stderr
    usage = subprocess.run([sys.executable, SCRIPT, "--check"], cwd=REPO, capture_output=True, text=True)
    assert usage.returncode == 2 and "--check goes with --tables" in usage.stderr
