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


class Beside:
    """``fn`` run on a thread of its own, beside the caller's work; wait for it before
    whatever it reads (a file, memory) is let go."""

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        self._out = threading.Event()
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
                self._error = e
            finally:
                self._out.set()

        threading.Thread(target=run, name=name, daemon=True).start()

    def error(self) -> BaseException | None:
        """Wait for ``fn`` to end (through interrupts, raised after); what it raised."""
        wait_until_out(self._out)
        return self._error

    def result(self) -> None:
        """Wait for ``fn`` to end; raise what it raised."""
        error = self.error()
        if error is not None:
            raise error
