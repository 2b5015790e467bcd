"""The native engine built with AddressSanitizer and UndefinedBehaviorSanitizer.

Every source of the extension (setup.py's ``sources``: the engine and its binding) is
compiled into a temporary directory with ``-fsanitize=address,undefined`` and driven, in
a child Python with libasan preloaded, by tests/helpers/native_sanitizer_driver.py
(every entry point, each backend, fault injection, the refusals of untrusted offsets,
EFAULT).  Any report of either sanitizer aborts the child; the test wants a clean exit.
tests/native/test_native_engine_c.py does the same for the engine alone, without Python.

The build uses setup.py's own compile arguments (read from it, so the two cannot drift)
but not Python's CFLAGS: those carry -fwrapv, under which signed overflow is defined and
UBSan does not look for it.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
from conftest import HELPERS, REPO

DRIVER = os.path.join(HELPERS, "native_sanitizer_driver.py")
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g",
            "-O1"]


def _setup_py_extension_args() -> tuple[list[str], list[str], list[str]]:
    """sources (absolute paths), extra_compile_args and libraries of the Extension in setup.py."""
    with open(os.path.join(REPO, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension":
            kw = {k.arg: k.value for k in node.keywords}
            sources = ast.literal_eval(kw["sources"])
            args = ast.literal_eval(kw["extra_compile_args"]) if "extra_compile_args" in kw else []
            libs = ast.literal_eval(kw["libraries"]) if "libraries" in kw else []
            return [os.path.join(REPO, s) for s in sources], list(args), list(libs)
    raise AssertionError("no Extension(...) in setup.py")


def _runtime(gcc: str, name: str) -> str | None:
    r = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True)
    p = r.stdout.strip()
    return p if r.returncode == 0 and os.path.isabs(p) and os.path.exists(p) else None


@pytest.fixture(scope="module")
def sanitized_build(tmp_path_factory):
    gcc = shutil.which("gcc")
    if not gcc:
        pytest.skip("gcc is not installed")
    libasan = _runtime(gcc, "libasan.so")
    if not libasan:
        pytest.skip("gcc has no libasan.so here (install libasan / gcc's sanitizer runtime)")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip(f"no Python.h in {include}")
    sources, args, libs = _setup_py_extension_args()
    out = tmp_path_factory.mktemp("asan-build")
    so = str(out / ("_native" + sysconfig.get_config_var("EXT_SUFFIX")))
    # the sanitizer's -O1 comes after setup.py's -O2 and wins
    cmd = [gcc, "-shared", "-fPIC", *args, *SANITIZE, f"-I{include}", *sources, "-o", so, *(f"-l{lib}" for lib in libs)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"sanitizer build failed:\n{' '.join(cmd)}\n{r.stderr}"
    return so, libasan


def test_native_engine_is_clean_under_asan_and_ubsan(sanitized_build, tmp_path):
    so, libasan = sanitized_build
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=libasan,  # the runtime must come first; libubsan is linked in by the build
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONMALLOC="malloc",  # every object allocation goes through ASan's malloc
    )
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, DRIVER, so, str(work)], capture_output=True, text=True, env=env,
                       timeout=240)
    report = f"exit status {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-12000:]}"
    assert "AddressSanitizer" not in r.stderr, report
    assert "runtime error" not in r.stderr, report
    assert r.returncode == 0, report
    assert r.stdout.strip().endswith("DRIVER-OK"), report
