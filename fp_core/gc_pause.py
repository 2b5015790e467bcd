"""Keep Python's cyclic garbage collector out of a save's serialisation.

Pickling a state dict of thousands of tensors allocates tens of thousands of short-lived
container objects. Each 700 allocations run a young-generation collection and every few
of those can escalate into a full collection of the whole process (every object torch,
transformers and the user's program hold), which costs more than the rest of a small
save. The objects a save makes are freed by reference counting, not by the collector, so
pausing it for the few milliseconds of serialisation loses nothing: the collector
resumes on the caller's next allocations with whatever cycles were made meanwhile.

Process-wide and reference-counted: overlapping saves on several threads pause it once,
and a collector the user has disabled stays disabled.
"""

from __future__ import annotations

import gc
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
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
