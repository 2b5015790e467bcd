"""What both adapters share: one error policy, option checking, stats as metrics.

The adapters keep only their framework's glue; how a failed checkpoint is reported, which
options reach the core and what a committed save reports are decided here once.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any

from fp_core import AsyncCheckpointer, CheckpointError, EngineOptions
from fp_core.pipeline.checkpointer import POLICIES, WRITERS

log = logging.getLogger("fastpersist")


class FastPersistWarning(UserWarning):
    """A checkpoint failed and ``on_error="warn"`` let training continue, or a checkpoint was
    written past FastPersist (a strategy that saves without its ``CheckpointIO``)."""


class ErrorPolicy:
    """``on_error="raise"``: a failed checkpoint fails training. ``"warn"``: it is logged and
    warned once, and training continues. Either way a ``KeyboardInterrupt`` or
    ``SystemExit`` goes on up (nothing here catches them), and a programming error (a bad
    argument: ``TypeError``/``ValueError`` not raised by FastPersist) is always raised."""

    def __init__(self, on_error: str) -> None:
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        self.on_error = on_error

    def handle(self, e: Exception, what: str, stacklevel: int = 3) -> None:
        """Raise ``e``, or warn about it once (a failure already warned about is marked on
        the exception, not remembered by ``id()``, which a later failure could reuse)."""
        if self.on_error == "raise" or (isinstance(e, (TypeError, ValueError)) and not isinstance(e, CheckpointError)):
            raise e
        if getattr(e, "_fastpersist_reported", False):
            return
        with contextlib.suppress(AttributeError):
            e._fastpersist_reported = True  # type: ignore[attr-defined]
        msg = f"FastPersist: {what} failed, training continues (on_error='warn'): {type(e).__name__}: {e}"
        log.warning("%s", msg)  # the text, not the exception: never kept alive by a handler
        warnings.warn(msg, FastPersistWarning, stacklevel=stacklevel)

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()``, its failure handled by the policy (None when it was only warned about)."""
        try:
            return fn()
        except Exception as e:
            self.handle(e, what, stacklevel=4)
            return None


_CHECKPOINTER_OPTIONS = frozenset(inspect.signature(AsyncCheckpointer.__init__).parameters) - {
    "self", "engine_options", "policy", "max_in_flight", "group", "install_optimizer_hook"}


def checkpointer_options(options: dict[str, Any], policy: str = "auto") -> tuple[dict[str, Any], dict[str, Any]]:
    """Split an adapter's ``**options`` into engine options and other ``AsyncCheckpointer``
    options, checked now (a typo fails at construction, not at the first save)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    engine, rest = EngineOptions.pick(dict(options))
    unknown = set(rest) - _CHECKPOINTER_OPTIONS
    if unknown:
        raise TypeError(f"unknown FastPersist options {sorted(unknown)} (engine options: "
                        f"{sorted(EngineOptions.__dataclass_fields__)}; checkpointer options: "
                        f"{sorted(_CHECKPOINTER_OPTIONS)})")
    writer = rest.get("writer", "thread")
    if writer not in WRITERS:
        raise ValueError(f"writer must be one of {WRITERS}, not {writer!r}")
    if rest.get("resume_from_memory") and writer != "process":
        raise ValueError("resume_from_memory needs writer='process'")
    return {k: getattr(engine, k) for k in options if k in EngineOptions.__dataclass_fields__}, rest


def metrics(stats: Any, prefix: str = "fastpersist/") -> dict[str, float]:
    """A committed save's ``SaveStats`` as logger metrics."""
    return {
        f"{prefix}gbps": stats.gbps,
        f"{prefix}write_ms": stats.write_seconds * 1e3,
        f"{prefix}save_ms": stats.seconds * 1e3,
        f"{prefix}blocked_ms": stats.blocked_seconds * 1e3,
        f"{prefix}mib": stats.bytes / 2**20,
    }
