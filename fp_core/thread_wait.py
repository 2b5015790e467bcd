"""Waiting for a helper thread to be done with memory or a file it must not outlive.

On Python 3.11 a ``Thread.join()`` that Ctrl-C interrupts releases the running thread's own
state lock and marks it stopped: ``is_alive()`` then says False while it still runs. So the
thread sets an event on its way out, and the caller waits on that, through interrupts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def wait_until_out(out: threading.Event, on_interrupt: Callable[[], None] | None = None) -> None:
    """Block until ``out`` is set; an interrupt meanwhile (after ``on_interrupt``) is
    raised once it is."""
    interrupted: BaseException | None = None
    while not out.is_set():
        try:
            out.wait()
        except BaseException as e:  # noqa: BLE001 - raised below, once the thread is out
            interrupted = interrupted or e
            if on_interrupt is not None:
                on_interrupt()
    if interrupted is not None:
        raise interrupted
