"""The native engine on its own, without Python: native/tests/test_engine.c.

The engine's sources (setup.py's ``sources`` less the binding) are compiled with the C
test program and no Python include path, twice: plain -O2 (and without a warning under
-Wall -Wextra), and under AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer
too, where it can run).  Each binary writes and reads back files on every backend in a
temporary directory and must exit 0 with a clean sanitizer report.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shutil
import subprocess

import pytest
from conftest import REPO

NATIVE = os.path.join(REPO, "native")
TEST_PROGRAM = os.path.join(NATIVE, "tests", "test_engine.c")
BINDING = "native/binding.c"
WARNINGS = ["-std=gnu11", "-Wall", "-Wextra"]
BUILDS = {
    "plain": ["-O2"],
    "sanitized": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
                  "-g", "-O1"],
}


def _setup_py_extension() -> tuple[list[str], list[str]]:
    """sources and libraries of the Extension in setup.py."""
    with open(os.path.join(REPO, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension":
            kw = {k.arg: k.value for k in node.keywords}
            libs = ast.literal_eval(kw["libraries"]) if "libraries" in kw else []
            return list(ast.literal_eval(kw["sources"])), list(libs)
    raise AssertionError("no Extension(...) in setup.py")


def _engine_sources() -> list[str]:
    sources, _ = _setup_py_extension()
    return [os.path.join(REPO, s) for s in sources if s != BINDING]


def _runtime(gcc: str, name: str) -> str | None:
    r = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True)
    p = r.stdout.strip()
    return p if r.returncode == 0 and os.path.isabs(p) and os.path.exists(p) else None


def test_setup_py_builds_every_native_source_and_the_engine_is_free_of_python():
    sources, _ = _setup_py_extension()
    on_disk = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(NATIVE, "*.c")))
    assert sorted(sources) == on_disk, "setup.py's sources must list every native/*.c"
    assert BINDING in sources
    engine = [*_engine_sources(), *glob.glob(os.path.join(NATIVE, "*.h"))]
    for path in engine:
        with open(path) as f:
            text = f.read()
        assert not re.search(r"#\s*include\s*[<\"](Python|structmember)\.h", text), f"{path} includes Python"
        assert not re.search(r"\bPy[A-Z_]\w*", text), f"{path} uses the Python C API"


@pytest.mark.parametrize("build", list(BUILDS))
def test_engine_c_program(build, tmp_path):
    gcc = shutil.which("gcc")
    if not gcc:
        pytest.skip("gcc is not installed")
    env = dict(os.environ)
    if build == "sanitized":
        for lib in ("libasan.so", "libubsan.so"):
            if not _runtime(gcc, lib):
                pytest.skip(f"gcc has no {lib} here (install gcc's sanitizer runtime)")
        env.update(ASAN_OPTIONS="abort_on_error=1:detect_leaks=1", UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
    _, libs = _setup_py_extension()
    exe = str(tmp_path / f"test_engine-{build}")
    cmd = [gcc, *WARNINGS, *BUILDS[build], TEST_PROGRAM, *_engine_sources(), "-o", exe, *(f"-l{lib}" for lib in libs)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"build failed:\n{' '.join(cmd)}\n{r.stderr}"
    if build == "plain":
        assert "warning:" not in r.stderr, r.stderr

    work = tmp_path / "work"
    work.mkdir()

    def run():
        return subprocess.run([exe, str(work)], capture_output=True, text=True, env=env, timeout=120)

    r = run()
    if "LeakSanitizer has encountered a fatal error" in r.stderr:
        # LSan cannot stop the world here (ptrace refused in this sandbox): without it
        env["ASAN_OPTIONS"] = "abort_on_error=1:detect_leaks=0"
        r = run()
    report = f"exit status {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-12000:]}"
    for sanitizer in ("AddressSanitizer", "LeakSanitizer", "runtime error"):
        assert sanitizer not in r.stderr, report
    assert r.returncode == 0, report
    assert r.stdout.strip().endswith("OK"), report
    assert "buffered" in r.stdout.splitlines()[-2], report
    # the program checked every CRC-32C implementation up to the one this CPU uses by default
    from fp_core import _native
    assert f"crc32c: {_native.crc32c_impl()}" in r.stdout, report
