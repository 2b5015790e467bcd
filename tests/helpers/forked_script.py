"""Run a helper script as ``__main__`` in a process forked from the test session's forkserver
(:func:`conftest.run_ranks`), which has torch, torch.distributed and fp_core imported once:
a rank then starts in a fraction of an interpreter's start, with the same argv, environment,
working directory and exit status as ``python SCRIPT ARGS...``, and its exit handlers
(``atexit``) run as an interpreter's would: after the script, an unhandled exception printed
first (and left in ``sys.last_value``, as fp_core's exit drain reads it)."""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback


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
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = e.code
    except BaseException as e:  # noqa: BLE001 - printed and the status set, as the interpreter does
        tb = e.__traceback__  # from the script's own frame on, as the interpreter prints it
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb or e.__traceback__
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        status = 1
    atexit._run_exitfuncs()
    sys.exit(status)
