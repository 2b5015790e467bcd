"""Run a helper script as ``__main__`` in a process forked from the test session's forkserver
(:func:`conftest.run_ranks`), which has torch, torch.distributed and fp_core imported once:
a rank then starts in a fraction of an interpreter's start, with the same argv, environment,
working directory and exit status as ``python SCRIPT ARGS...``. What differs: the exit
handlers registered with ``atexit`` do not run (a ``multiprocessing`` child ends with
``os._exit`` after its finalizers), so a rank script ends as every one here does, with
``rank_report.report_and_exit`` or ``rank_exit.finish``."""

from __future__ import annotations

import os
import runpy
import sys


def run(script: str, argv: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # as python SCRIPT puts the script's folder first
    runpy.run_path(script, run_name="__main__")
