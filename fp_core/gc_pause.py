"""Keep Python's cyclic garbage collector out of a save's serialisation and a load.

Pickling a state dict of thousands of tensors allocates tens of thousands of short-lived
container objects, and so does loading one (the zip directory's entries, the unpickled
structure). Each 700 allocations run a young-generation collection and every few of those
can escalate into a full collection of the whole process (every object torch,
transformers and the user's program hold), which costs more than the rest of a small
save, or than all of ``load_into``'s work before its read. The objects a save makes are
freed by reference counting, not by the collector, and a load's live on in its result,
so pausing it meanwhile loses nothing: the collector resumes on the caller's next
allocations with whatever cycles were made meanwhile.

Process-wide and reference-counted: overlapping saves and loads on several threads pause
it once, and a collector the user has disabled stays disabled. A child forked while a
pause is held (a DataLoader worker forked during a load on another thread) starts with
the collector as the user left it. Loads pause only while they build objects, not for
their reads.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_resume = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic garbage collection for the block (nestable, thread-safe)."""
    global _depth, _resume
    pid = os.getpid()
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        if os.getpid() == pid:  # a child forked inside the block starts unpaused (_after_fork)
            with _lock:
                _depth -= 1
                if _depth == 0 and _resume:
                    gc.enable()


def _after_fork() -> None:
    """A child forked while some thread held a pause (a DataLoader worker forked during a
    load on another thread) has no such thread: its collector is as the user left it, and
    its lock new (the parent's may have been held at the fork)."""
    global _lock, _depth
    _lock = threading.Lock()
    if _depth:
        _depth = 0
        if _resume:
            gc.enable()


os.register_at_fork(after_in_child=_after_fork)
