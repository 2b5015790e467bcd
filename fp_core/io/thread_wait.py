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
    """``fn(stop)`` run on a thread of its own, beside the caller's work, once
    :meth:`start` is called; wait for it (:meth:`error`, :meth:`result`) before whatever
    it reads (a file, memory) is let go. An interrupt while waiting sets ``stop``, which
    ``fn`` checks between its steps, and is raised once the thread is out."""

    def __init__(self, fn: Callable[[threading.Event], None], name: str) -> None:
        self._fn, self._name = fn, name
        self._out = threading.Event()
        self._stop = threading.Event()
        self._started = False
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._fn(self._stop)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by error()
            self._error = e
        finally:
            self._out.set()

    def start(self) -> None:
        self._started = True
        try:
            threading.Thread(target=self._run, name=self._name, daemon=True).start()
        except BaseException:
            self._out.set()  # no thread to wait for
            raise

    def error(self, stop: bool = False) -> BaseException | None:
        """Wait for ``fn`` to end (through interrupts, raised after); what it raised.
        ``stop``: ask it to stop first."""
        if not self._started:
            return None
        if stop:
            self._stop.set()
        wait_until_out(self._out, on_interrupt=self._stop.set)
        return self._error

    def result(self) -> None:
        """Wait for ``fn`` to end; raise what it raised."""
        error = self.error()
        if error is not None:
            raise error
