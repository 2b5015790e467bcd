"""The documentation is plain Markdown, checked here instead of by a site builder: every
relative link and image in README.md, docs/ and benchmarks/README.md names a file that exists, every ``#anchor``
names a heading of its page (GitHub's slugs), code fences close, tables have their header
separator, the README stays short and its test command is the one CI runs."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 260

# [text](target) and ![alt](target); the target ends at whitespace (an optional "title") or ")".
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)


def doc_files(root: Path = REPO) -> list[Path]:
    """README.md, every Markdown page under docs/, and the benchmarks' page."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md")), root / "benchmarks" / "README.md"]


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, code spans blanked."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):]:
                fence = None
            continue
        yield number, CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lowercased, punctuation other
    than '-' and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, not its target
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        h = HEADING.match(line)
        if not h:
            continue
        base = slug(h.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in INLINE_LINK.finditer(line):
            yield number, m.group(1)
        d = REFERENCE_DEF.match(line)
        if d:
            yield number, d.group(1)


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """'file:line: target: why' for each relative link of ``path`` that leads nowhere."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for number, target in links(path):
        if EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(root)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where}: no such file {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
            continue
        if file_part and not dest.resolve().is_relative_to(root):
            problems.append(f"{where}: points outside the repository")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into a file that is not a Markdown page")
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return problems


def render_problems(path: Path, root: Path = REPO) -> list[str]:
    """An unclosed code fence, or a table whose second row is not its header separator with
    as many cells: both render as plain text on GitHub."""
    problems = []
    rel = path.relative_to(root)
    lines = path.read_text(encoding="utf-8").splitlines()
    fence: tuple[int, str] | None = None
    table_start: int | None = None
    for number, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = (number, m.group(1))
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[1][0] and len(m.group(1)) >= len(fence[1]):
                fence = None
            continue
        is_row = line.lstrip().startswith("|")
        if is_row and table_start is None:
            table_start = number
            header = line
            if number >= len(lines):
                problems.append(f"{rel}:{number}: a table without its header separator")
                continue
            sep = lines[number]  # the next line
            cells = [c.strip() for c in sep.strip().strip("|").split("|")]
            if not cells or not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                problems.append(f"{rel}:{number}: a table without its header separator (next line: {sep!r})")
            elif len(cells) != len(_cells(header)):
                problems.append(f"{rel}:{number}: the header has {len(_cells(header))} cells, its separator {len(cells)}")
        elif not is_row:
            table_start = None
    if fence is not None:
        problems.append(f"{rel}:{fence[0]}: a code fence {fence[1]} that never closes")
    return problems


def _cells(row: str) -> list[str]:
    row = re.sub(r"\\\|", "", CODE_SPAN.sub(lambda s: s.group(0).replace("|", ""), row))
    return row.strip().strip("|").split("|")


# ---------------------------------------------------------------- the repository's docs


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = [p for f in doc_files() for p in broken_links(f)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_page_renders_its_fences_and_tables() -> None:
    problems = [p for f in doc_files() for p in render_problems(f)]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_index() -> None:
    index = REPO / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index) if not EXTERNAL.match(t)}
    pages = [p for p in (REPO / "docs").glob("*.md") if p.name != "README.md"]
    missing = sorted(str(p.relative_to(REPO)) for p in pages if p.resolve() not in linked)
    assert not missing, f"docs/README.md does not link to {missing}"


def test_readme_is_short() -> None:
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES} (details go to docs/)"


def test_readme_test_command_is_the_one_ci_runs() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    marks = [i for i, line in enumerate(ci) if line.startswith("#") and "README's test command" in line
             and "keep the two in step" in line]
    assert len(marks) == 1, ".ci/run: no single '# The README's test command (keep the two in step):' line"
    command = ci[marks[0] + 1].strip()
    assert command, ".ci/run: nothing after the README's test command mark"
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert command in (line.strip() for line in readme), (
        f"README.md does not show .ci/run's test command verbatim on a line of its own:\n{command}")


def test_readme_main_job_command_runs_an_existing_example() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^python3 -m venv \.venv && .* && \.venv/bin/python (examples/\S+\.py)$", readme, re.M)
    assert m, "README.md: no set-up command that ends by running an example"
    assert (REPO / m.group(1)).is_file(), f"README.md's main-job command runs {m.group(1)}, which does not exist"


# ---------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Quick start", "quick-start"),
    ("What a save does at its path", "what-a-save-does-at-its-path"),
    ("Bad input and hostile users", "bad-input-and-hostile-users"),
    ("`fastpersist verify`: exit status", "fastpersist-verify-exit-status"),
    ("Save, 4 GiB (2412 tensors)", "save-4-gib-2412-tensors"),
    ("Sharded state: FSDP2 / HSDP", "sharded-state-fsdp2--hsdp"),
    ("The [writer](design.md) process", "the-writer-process"),
    ("snake_case and dash-ed", "snake_case-and-dash-ed"),
])
def test_slug_follows_githubs_rules(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_the_checker_finds_each_kind_of_broken_link(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "img.png").write_bytes(b"\x89PNG")
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section\n\n## A section\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#a-section) [ok](other.md#a-section-1) [ok](#page)\n"  # 3
        "![ok](../img.png) [ok](https://example.com/x.md#nope) [ok][ref]\n"  # 4
        "[missing](gone.md)\n"  # 5
        "![missing](../nothing.png)\n"  # 6
        "[bad anchor](other.md#no-such-section)\n"  # 7
        "[bad own anchor](#nope)\n"  # 8
        "`[in code](gone.md)`\n"  # 9: a code span, not a link
        "```\n[in a fence](gone.md)\n```\n"  # 10-12
        "[anchor into an image](../img.png#x)\n"  # 13
        "[ref]: other.md#a-section\n"  # 14
        "[badref]: gone-too.md\n"  # 15
    )
    problems = broken_links(page, tmp_path)
    lines = sorted(int(p.split(":")[1]) for p in problems)
    assert lines == [5, 6, 7, 8, 13, 15], problems
    assert all(p.startswith("docs/page.md:") for p in problems)
    assert any("gone.md: no such file docs/gone.md" in p for p in problems)
    assert any("#no-such-section in docs/other.md" in p for p in problems)


def test_the_checker_finds_broken_rendering(tmp_path: Path) -> None:
    good = tmp_path / "good.md"
    good.write_text("| a | b |\n|---|---:|\n| 1 | 2 |\n\n```bash\n| not a table\n```\n")
    assert render_problems(good, tmp_path) == []
    for text, what in [
        ("| a | b |\n| 1 | 2 |\n", "without its header separator"),
        ("| a | b |\n|---|\n| 1 | 2 |\n", "the header has 2 cells, its separator 1"),
        ("text\n```python\nx = 1\n", "never closes"),
    ]:
        bad = tmp_path / "bad.md"
        bad.write_text(text)
        problems = render_problems(bad, tmp_path)
        assert len(problems) == 1 and what in problems[0], (text, problems)


def test_readme_and_docs_exist() -> None:
    files = doc_files()
    assert all(f.is_file() for f in files)
    assert (REPO / "docs" / "README.md") in files and len(files) > 5, [str(f) for f in files]
    assert os.path.getsize(REPO / "README.md") > 0
