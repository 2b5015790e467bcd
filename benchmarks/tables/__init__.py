"""The tables of docs/performance.md and README.md, rendered from benchmarks/results/.

A table in those pages sits between two markers::

    <!-- table NAME: rendered by benchmarks/regenerate.py --tables -->
    | ... |
    <!-- /table -->

and :data:`TABLES` holds, for every NAME, a function that reads the committed outputs in the
results directory and returns the table's Markdown lines. ``regenerate.py --tables`` splices
every table in place (``--check``: says which differ and changes nothing); a benchmark run
through ``regenerate.py`` splices them after its outputs are written. So a figure in a table
is the one its output holds, never a hand copy.

The renderers live in one module per part of docs/performance.md (``sync_save``, ``loads``,
``async_saves``, ``writer_process``, ``sharded``, ``frameworks``, ``headline``); each registers its tables with
:func:`table`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ("docs/performance.md", "README.md")
MODULES = ("sync_save", "loads", "async_saves", "writer_process", "sharded", "frameworks", "headline")
BEGIN = re.compile(r"^<!-- table ([\w.-]+): rendered by benchmarks/regenerate\.py --tables -->$")
END = "<!-- /table -->"


class TableError(ValueError):
    """A results file does not hold what a table needs (missing, or a line not in the form
    its benchmark prints): names the table, the file and what was looked for."""


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    sources: tuple[str, ...]  # the files under benchmarks/results/ it reads
    render: Callable[[Results], list[str]]


TABLES: dict[str, Table] = {}


def table(name: str, *sources: str) -> Callable[[Callable[[Results], list[str]]], Callable[[Results], list[str]]]:
    """Register ``fn(results) -> Markdown lines`` as the renderer of table ``name``."""

    def register(fn: Callable[[Results], list[str]]) -> Callable[[Results], list[str]]:
        if name in TABLES:
            raise ValueError(f"two renderers for table {name!r}")
        TABLES[name] = Table(name, sources, fn)
        return fn

    return register


class Results:
    """Read access to one results directory for one table, with errors that name both."""

    def __init__(self, directory: str, table_name: str = "?") -> None:
        self.directory = directory
        self.table = table_name

    def text(self, name: str) -> str:
        path = os.path.join(self.directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise TableError(f"table {self.table}: cannot read {path}: {e.strerror or e}") from None

    def json(self, name: str) -> Any:
        """File ``name`` parsed as JSON; TableError naming it when it is not JSON."""
        try:
            return json.loads(self.text(name))
        except json.JSONDecodeError as e:
            raise self.error(name, f"JSON ({e})") from None

    def lines(self, name: str) -> list[str]:
        return self.text(name).splitlines()

    def error(self, name: str, what: str) -> TableError:
        return TableError(f"table {self.table}: {os.path.join(self.directory, name)} holds no {what}")

    def match(self, name: str, pattern: str, what: str | None = None, flags: int = re.M) -> re.Match[str]:
        """The first match of ``pattern`` in file ``name``; TableError when there is none."""
        m = re.search(pattern, self.text(name), flags)
        if m is None:
            raise self.error(name, what or f"line matching {pattern!r}")
        return m

    def matches(self, name: str, pattern: str, what: str | None = None, flags: int = re.M) -> list[re.Match[str]]:
        """Every match of ``pattern`` in file ``name``; TableError when there is none."""
        found = list(re.finditer(pattern, self.text(name), flags))
        if not found:
            raise self.error(name, what or f"line matching {pattern!r}")
        return found


    def aligned(self, name: str, title: str | None = None, *,
                header_start: str | None = None) -> list[tuple[str, dict[str, str]]]:
        """The rows of the right-aligned table in file ``name`` (the form ``fastpersist bench``
        and most scripts print) whose header is the line under ``title``, or else the first
        line starting with ``header_start`` (a table printed without a title): (label,
        {column: cell}) in order, up to the first blank line. The header's names end where
        their cells end."""
        lines = self.lines(name)
        if title is not None:
            i = next((k for k, line in enumerate(lines) if line.strip() == title), None)
            if i is None:
                raise self.error(name, f"table titled {title!r}")
            if i + 1 >= len(lines) or not lines[i + 1].strip():
                raise self.error(name, f"header under {title!r}")
            h, where = i + 1, f"under {title!r}"
        else:
            h = next((k for k, line in enumerate(lines) if line.lstrip().startswith(str(header_start))), None)
            if h is None:
                raise self.error(name, f"table with a header starting {header_start!r}")
            where = f"under the header {header_start!r}"
        header = lines[h]
        cols = [(m.group(0), m.end()) for m in re.finditer(r"\S+(?: \S+)*", header)]
        rows = []
        for line in lines[h + 1:]:
            if not line.strip():
                break
            first = line[:cols[0][1]].rstrip()
            label, _, value = first.rpartition(" ")
            cells = {cols[0][0]: value}
            for (col, end), (_, prev) in zip(cols[1:], cols):
                cells[col] = line[prev:end].strip()
            rows.append((label.strip(), cells))
        if not rows:
            raise self.error(name, f"rows {where}")
        return rows

    def row(self, name: str, title: str, label_start: str) -> dict[str, str]:
        """The cells of the row whose label starts with ``label_start`` in :meth:`aligned`."""
        for label, cells in self.aligned(name, title):
            if label.startswith(label_start):
                return cells
        raise self.error(name, f"row {label_start!r} under {title!r}")


def load_renderers() -> dict[str, Table]:
    for m in MODULES:
        importlib.import_module(f"{__name__}.{m}")
    return TABLES


def row(*cells: object) -> str:
    """One Markdown table row; an empty cell is written ``| |``, as the pages write it."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def bold(text: object, on: bool = True) -> str:
    """``text`` in bold where ``on`` (the page's marking of FastPersist's rows)."""
    return f"**{text}**" if on else str(text)


def render(name: str, results_dir: str) -> list[str]:
    t = load_renderers().get(name)
    if t is None:
        raise TableError(f"no renderer for table {name!r} (benchmarks/tables/)")
    return t.render(Results(results_dir, name))


def blocks(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, line after the table) of every marked table in ``text``, 0-based
    line numbers of the table's own lines (the markers excluded)."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if m:
            j = i + 1
            while j < len(lines) and lines[j] != END:
                if BEGIN.match(lines[j]):
                    raise TableError(f"table {m.group(1)}: no {END} before the next table")
                j += 1
            if j == len(lines):
                raise TableError(f"table {m.group(1)}: no {END}")
            out.append((m.group(1), i + 1, j))
            i = j
        i += 1
    return out


def splice(text: str, results_dir: str) -> str:
    """``text`` with every marked table rendered anew from ``results_dir``."""
    lines = text.split("\n")
    for name, start, end in reversed(blocks(text)):
        lines[start:end] = render(name, results_dir)
    return "\n".join(lines)


def update_pages(results_dir: str, pages: Iterable[str] = PAGES, check: bool = False,
                 repo: str = REPO) -> list[str]:
    """Render every marked table of ``pages`` (paths under ``repo``); returns the pages whose
    tables changed. Every page is rendered before any is written, so a table that cannot be
    rendered changes no page. With ``check`` nothing is written."""
    rendered = []
    for page in pages:
        path = os.path.join(repo, page)
        with open(path, encoding="utf-8") as f:
            old = f.read()
        new = splice(old, results_dir)
        if new != old:
            rendered.append((page, path, new))
    if not check:
        for _, path, new in rendered:
            tmp = path + ".tables-tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(new)
            os.replace(tmp, path)
    return [page for page, _, _ in rendered]
