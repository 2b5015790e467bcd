"""fp_core.tools apart from the runtime: the ``fastpersist`` command loads the benchmarks
only for ``bench``; the runtime never imports the tools; sizes parse one way everywhere."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

import fp_core
from fp_core.format.sizes import parse_size

HEAVY = ("fp_core.tools.bench", "fp_core.tools.bench_async", "fp_core.tools.common", "matplotlib",
         "torch.distributed.checkpoint", "lightning", "safetensors")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))


def test_verify_inspect_clean_do_not_import_the_benchmarks(tmp_path):
    good = str(tmp_path / "good.pt")
    fp_core.save({"w": torch.arange(1000, dtype=torch.float32)}, good)
    code = (
        "import sys\n"
        "from fp_core.tools.cli import main\n"
        "assert main(['verify', sys.argv[1]]) == 0\n"
        "assert main(['inspect', '--json', sys.argv[1]]) == 0\n"
        "assert main(['clean', sys.argv[2]]) == 0\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print('light')\n"
    )
    out = _python(code, good, str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"OK   {good}" in out.stdout and out.stdout.rstrip().endswith("light")


def test_bench_help_shows_every_option_without_importing_the_benchmarks():
    code = (
        "import contextlib, io, sys\n"
        "from fp_core.tools.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
        "    main(['bench', '--help'])\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print(buf.getvalue())\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stdout + out.stderr
    for flag in ("--size", "--only", "--async", "--device", "--dry-run", "--json-out", "--backend", "--chunk-bytes",
                 "--modes", "--iters", "--dtype", "--adam", "--no-write-probe"):
        assert flag in out.stdout, flag


def test_python_m_and_the_console_script_are_the_same_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "bench", "--dry-run", "--size", "64MiB",
                          "--dir", str(tmp_path / "x")], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("dry run: a 64.0 MiB state dict on cpu")
    assert not (tmp_path / "x").exists()
    out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "bench", "--size", "0", "--dry-run"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 2 and "size must be positive" in out.stderr


def _imports(path: str) -> set[str]:
    """Absolute module names a file imports (relative imports resolved against fp_core)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    pkg = os.path.relpath(os.path.dirname(path), REPO).replace(os.sep, ".")
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.update([base] + [f"{base}.{a.name}" for a in node.names])
    return names


def test_the_runtime_never_imports_the_tools():
    runtime = [os.path.join(REPO, d, f) for d in ("fp_core", "fp_integrations")
               for f in sorted(os.listdir(os.path.join(REPO, d))) if f.endswith(".py")]
    assert any(p.endswith("fp_core/api.py") for p in runtime)
    bad = {p: sorted(n for n in _imports(p) if n == "fp_core.tools" or n.startswith("fp_core.tools."))
           for p in runtime}
    assert not {p: n for p, n in bad.items() if n}


def test_neither_benchmark_imports_the_other():
    tools = os.path.join(REPO, "fp_core", "tools")
    bench, bench_async = (_imports(os.path.join(tools, f)) for f in ("bench.py", "bench_async.py"))
    assert not [n for n in bench if n.startswith("fp_core.tools.bench_async")]
    assert not [n for n in bench_async if n == "fp_core.tools.bench" or n.startswith("fp_core.tools.bench.")]
    heavy = ("torch", "numpy", "matplotlib", "fp_core.tools.bench", "fp_core.tools.bench_async", "fp_core.tools.common")
    for light in ("bench_args.py", "__init__.py"):  # what the CLI's parser and the package import
        found = {n for n in _imports(os.path.join(tools, light)) if n in heavy or n.startswith(tuple(h + "." for h in heavy))}
        assert not found, (light, found)


@pytest.mark.parametrize("text,want", [
    ("4GiB", 4 << 30), ("64M", 64 << 20), ("1.5G", 3 << 29), ("1024", 1024), ("20G", 20 << 30),
    ("512MiB", 512 << 20), ("8KiB", 8192), ("1TiB", 1 << 40), ("2Gi", 2 << 30), ("64m", 64 << 20),
    ("4gib", 4 << 30), (" 4 GiB ", 4 << 30), ("10B", 10), ("512KB", 512_000), ("4GB", 4_000_000_000),
    (".5G", 1 << 29), ("1e3", 1000), ("0", 0),
])
def test_parse_size_forms(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "GiB", "4 parsecs", "-1", "4PiB", "1.2.3M", "4 G B"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_clean_of_a_missing_directory_or_a_file_is_an_error_naming_it(tmp_path):
    missing, a_file = str(tmp_path / "no" / "such"), str(tmp_path / "f")
    open(a_file, "w").close()
    for path, why in ((missing, "no such directory"), (a_file, "not a directory")):
        out = subprocess.run([sys.executable, "-m", "fp_core.tools.cli", "clean", path], capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
        assert out.returncode == 2, out
        assert f"{path}: {why}" in out.stderr and "removed" not in out.stdout


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--json"], ["verify"]])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, args):
    """``fastpersist inspect ckpt | head -1``: the reader leaves after one line; the command
    exits 141 (SIGPIPE's status) with nothing on stderr, no BrokenPipeError traceback."""
    path = str(tmp_path / "many.pt")
    fp_core.save({f"layer.{i}.weight": torch.full((2,), float(i)) for i in range(3000)}, path)
    paths = [path] * (1 if args[0] == "inspect" else 3000)  # verify: a line per path
    cmd = [sys.executable, "-m", "fp_core.tools.cli", *args, *paths]
    producer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=dict(os.environ, PYTHONPATH=REPO))
    head = subprocess.run(["head", "-n", "1"], stdin=producer.stdout, capture_output=True, timeout=300)
    producer.stdout.close()
    err = producer.stderr.read().decode()
    assert producer.wait(timeout=300) == 141, err
    assert head.stdout and err == ""
