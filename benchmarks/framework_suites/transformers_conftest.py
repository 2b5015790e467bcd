"""pytest plugin: run transformers' own Trainer tests with ``FastPersistCallback()`` on EVERY Trainer.

``Trainer.__init__`` (and so every subclass that calls ``super().__init__``) is wrapped: once the
stock constructor has returned, the wrapper adds one ``fp_integrations.hf.FastPersistCallback``
with ``trainer.add_callback(cb)`` and binds it with ``cb.attach(trainer)`` -- exactly what a user
does with ``Trainer(..., callbacks=[cb]); cb.attach(trainer)``. From then on the trainer's
``_save_checkpoint`` / ``_load_from_checkpoint`` are FastPersist's (unless the callback falls
back to the stock save, e.g. DeepSpeed/FSDP/push_to_hub: that is counted and reported).
A Trainer that already carries a ``FastPersistCallback`` is left alone.

Use it either way:

* ``python -m pytest -p transformers_conftest ...`` with this directory on ``PYTHONPATH``;
* or copy this file as ``conftest.py`` next to transformers' ``tests/`` directory (the
  repository root), so it is loaded before the tests are collected.

Environment:

* ``FASTPERSIST_HF_INJECT``: ``1`` (default) inject; ``import`` only import
  ``fp_integrations.hf`` (no injection: isolates side effects of the import itself);
  ``0`` do nothing (stock run with the plugin still loaded).
* ``FASTPERSIST_HF_KWARGS``: JSON dict of ``FastPersistCallback(**kwargs)``, e.g.
  ``'{"verify_on_resume": false}'`` or ``'{"max_in_flight": 2}'``.
* ``FASTPERSIST_HF_REPORT``: path of a JSON file that receives, per test, how many
  Trainers got the callback and how many checkpoints / resumes went through FastPersist.
* ``FASTPERSIST_REPO``: path of the FastPersist checkout, put on ``sys.path`` if
  ``fp_integrations`` is not importable (default: two levels above this file).

At the end of the session a line reports how many Trainers got the callback, how many of them
fell back to the stock save (and why), and how many checkpoint saves / resumes went through
FastPersist -- the proof that the injection was in effect.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections import Counter
from typing import Any

_MODE = os.environ.get("FASTPERSIST_HF_INJECT", "1").strip().lower()
_COUNTS: Counter = Counter()
_FALLBACKS: Counter = Counter()
_PER_TEST: dict[str, dict[str, int]] = {}
_INSTALLED = False


def _import_integration() -> Any:
    try:
        import fp_integrations.hf as fph
    except ImportError:
        repo = os.environ.get("FASTPERSIST_REPO") or os.path.abspath(
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        if repo not in sys.path:
            sys.path.insert(0, repo)
        import fp_integrations.hf as fph
    return fph


def _count_method(cls: type, name: str, key: str, only_truthy: bool = False) -> None:
    """Count calls of ``cls.name``; the callback binds these methods onto the trainer in
    ``attach``, so wrapping the class attribute before any attach counts every call.
    ``only_truthy``: count only calls that returned a true value (``_commit``: committed)."""
    orig = getattr(cls, name)  # defined on the callback or one of its mixins (hf_resume, hf_remote)
    if getattr(orig, "_fp_counted", False):
        return

    @functools.wraps(orig)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not only_truthy:
            _COUNTS[key] += 1
            return orig(self, *args, **kwargs)
        result = orig(self, *args, **kwargs)
        if result:
            _COUNTS[key] += 1
        return result

    wrapper._fp_counted = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def install() -> None:
    """Wrap ``transformers.Trainer.__init__`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED or _MODE in ("0", "false", "no", "off"):
        return
    fph = _import_integration()
    if _MODE == "import":
        _INSTALLED = True
        return
    import transformers

    kwargs = json.loads(os.environ.get("FASTPERSIST_HF_KWARGS") or "{}")
    cb_cls = fph.FastPersistCallback
    _count_method(cb_cls, "_save_checkpoint", "saves")
    _count_method(cb_cls, "_load_from_checkpoint", "resumes")
    _count_method(cb_cls, "_commit", "committed", only_truthy=True)  # background worker

    trainer_cls = transformers.Trainer
    orig_init = trainer_cls.__init__

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        orig_init(self, *args, **kw)
        if any(isinstance(cb, cb_cls) for cb in self.callback_handler.callbacks):
            return
        cb = cb_cls(**kwargs)
        self.add_callback(cb)
        cb.attach(self)
        _COUNTS["trainers"] += 1
        if cb.fallback_reason is not None:
            _COUNTS["fallback"] += 1
            _FALLBACKS[cb.fallback_reason] += 1

    __init__._fp_original = orig_init  # type: ignore[attr-defined]
    trainer_cls.__init__ = __init__
    _INSTALLED = True


# ------------------------------------------------------------------ pytest hooks
def pytest_configure(config: Any) -> None:
    install()


def pytest_report_header(config: Any) -> str:
    return (f"fastpersist transformers_conftest: FASTPERSIST_HF_INJECT={_MODE} "
            f"kwargs={os.environ.get('FASTPERSIST_HF_KWARGS') or '{}'}")


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item: Any):  # noqa: ANN201
        before = dict(_COUNTS)
        yield
        delta = {k: _COUNTS[k] - before.get(k, 0) for k in ("trainers", "fallback", "saves", "committed", "resumes")}
        _PER_TEST[item.nodeid] = delta
except ImportError:  # pragma: no cover - imported outside pytest
    pass


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    if _MODE in ("0", "false", "no", "off"):
        terminalreporter.write_line("fastpersist: injection OFF (FASTPERSIST_HF_INJECT=0)")
        return
    if _MODE == "import":
        terminalreporter.write_line("fastpersist: fp_integrations.hf imported, no injection")
        return
    fb = "; ".join(f"{n} x {r}" for r, n in _FALLBACKS.most_common()) or "none"
    terminalreporter.write_line(
        f"fastpersist: FastPersistCallback injected into {_COUNTS['trainers']} Trainer(s); "
        f"{_COUNTS['saves']} checkpoint save(s) ({_COUNTS['committed']} committed) and "
        f"{_COUNTS['resumes']} resume(s) went through it; "
        f"fallbacks to the stock save: {_COUNTS['fallback']} ({fb})")
    path = os.environ.get("FASTPERSIST_HF_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"totals": dict(_COUNTS), "fallbacks": dict(_FALLBACKS), "per_test": _PER_TEST}, f, indent=1)
