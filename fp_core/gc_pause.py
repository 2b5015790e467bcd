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
it once, and a collector the user has disabled stays disabled.
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
