"""Global ``torch.optim`` step pre-hooks that can be removed from anywhere.

torch calls the global pre-hooks by iterating over its module-level hook dict. Removing
an entry while that loop runs makes its next step raise "OrderedDict mutated during
iteration" out of the user's ``optimizer.step()``. Two of our removals can land there: a
fence that runs inside our own hook (a step without a closure) and a finalizer that the
garbage collector runs in the middle of any step (a plugin from an earlier run being
freed: seen in CI). So a hook removed while one of our hooks is running, or by a
finalizer, is switched off at once (it returns without doing anything) and leaves the
dict at the next safe point: the next :func:`register` or :func:`remove` made outside a
hook, on the training thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

Hook = Callable[[Any, Any, Any], Any]

_deferred: list[Any] = []  # torch handles to drop at the next safe point (list ops: atomic)
_depth = threading.local()  # how many of our hooks this thread is inside


class OptimizerHook:
    """One registered global pre-hook; :meth:`remove` is safe from anywhere."""

    def __init__(self, hook: Hook) -> None:
        self.hook: Hook | None = hook
        self.active = True
        self._handle = register_optimizer_step_pre_hook(self._call)

    def _call(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        hook = self.hook
        if not self.active or hook is None:
            return None
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return hook(optimizer, args, kwargs)
        finally:
            _depth.n -= 1

    def remove(self, *, defer: bool = False) -> None:
        """Switch the hook off now; take it out of torch's dict now unless that may be
        mid-iteration (inside one of our hooks, or ``defer``: from a finalizer)."""
        self.active = False
        self.hook = None  # a switched-off hook must not keep its owner (and its arenas) alive
        if defer or in_hook():
            _deferred.append(self._handle)
            return
        flush()
        self._handle.remove()


def in_hook() -> bool:
    """Is this thread inside one of our optimizer hooks (torch is iterating its dict)?"""
    return getattr(_depth, "n", 0) > 0


def register(hook: Hook) -> OptimizerHook:
    """Register ``hook`` as a global optimizer step pre-hook (and drop deferred ones)."""
    flush()
    return OptimizerHook(hook)


def flush() -> None:
    """Take hooks removed earlier out of torch's dict, unless torch may be iterating it."""
    if in_hook():
        return
    while _deferred:
        try:
            handle = _deferred.pop()
        except IndexError:  # another thread took the last one
            return
        handle.remove()
