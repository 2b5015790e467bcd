"""pytest plugin: run Lightning's own test suite with FastPersistIO as the DEFAULT CheckpointIO.

Lightning creates its default ``CheckpointIO`` lazily, in ``Strategy.checkpoint_io``::

    if self._checkpoint_io is None:
        self._checkpoint_io = TorchCheckpointIO()                # plain strategies
    elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
        self._checkpoint_io.checkpoint_io = TorchCheckpointIO()  # base of AsyncCheckpointIO & co.

``TorchCheckpointIO`` there is a module global of ``lightning.pytorch.strategies.strategy``
(and of ``lightning.fabric.strategies.strategy`` for Fabric). This plugin rebinds those globals
to a factory that returns ``fp_integrations.lightning.FastPersistIO()`` (``PLFastPersistIO`` for
the ``pytorch_lightning`` / ``lightning_fabric`` namespaces), so every strategy that would get the
stock IO -- directly or as the base of an ``AsyncCheckpointIO`` -- gets FastPersist instead.
Nothing else changes: ``TorchCheckpointIO`` itself, an IO a test passes explicitly
(``plugins=[TorchCheckpointIO()]``) and XLA's ``XLACheckpointIO`` are untouched.

Use it either way:

* ``python -m pytest -p lightning_conftest ...`` with this directory on ``PYTHONPATH``;
* or copy this file as ``conftest.py`` into the directory *above* ``tests_pytorch``
  (Lightning's ``tests/``), so it is loaded before ``tests_pytorch/conftest.py``.

Environment:

* ``FASTPERSIST_LIGHTNING_SWAP``: ``1`` (default) swap; ``import`` only import
  ``fp_integrations.lightning`` (no swap: isolates side effects of the import itself);
  ``0`` do nothing (stock run with the file still installed).
* ``FASTPERSIST_IO_KWARGS``: JSON dict of ``FastPersistIO(**kwargs)``, e.g.
  ``'{"async_save": false}'`` or ``'{"visible_pending": false}'``.
* ``FASTPERSIST_SWAP_PL``: ``1`` also swaps the ``pytorch_lightning``/``lightning_fabric``
  namespaces even when they are not imported yet (default: only if already imported when this
  plugin loads; Lightning's own tests use the ``lightning`` namespace only).
* ``FASTPERSIST_REPO``: path of the FastPersist checkout, put on ``sys.path`` if
  ``fp_integrations`` is not importable (default: two levels above this file).

At the end of the session a line reports how many default IOs were created and how many
saves/loads/teardowns went through FastPersist (proof that the swap was in effect).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections import Counter
from typing import Any

_MODE = os.environ.get("FASTPERSIST_LIGHTNING_SWAP", "1").strip().lower()
_COUNTS: Counter = Counter()
_INSTALLED: list[str] = []


def _import_integration() -> Any:
    try:
        import fp_integrations.lightning as fpl
    except ImportError:
        repo = os.environ.get("FASTPERSIST_REPO") or os.path.abspath(
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        if repo not in sys.path:
            sys.path.insert(0, repo)
        import fp_integrations.lightning as fpl
    return fpl


def _counted(cls: type, name: str) -> None:
    """Count calls of ``cls.name`` (reaches FastPersist's own method unchanged)."""
    orig = cls.__dict__.get(name) or getattr(cls, name)
    if getattr(orig, "_fp_counted", False):
        return

    @functools.wraps(orig)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        _COUNTS[name] += 1
        return orig(self, *args, **kwargs)

    wrapper._fp_counted = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def _factory(cls: type, kwargs: dict) -> Any:
    def default_checkpoint_io() -> Any:
        _COUNTS["created"] += 1
        return cls(**kwargs)

    default_checkpoint_io.__name__ = default_checkpoint_io.__qualname__ = f"{cls.__name__}<default>"
    return default_checkpoint_io


def install() -> list[str]:
    """Swap the default ``TorchCheckpointIO`` for FastPersist in every strategy module found."""
    if _INSTALLED:
        return _INSTALLED
    fpl = _import_integration()
    if _MODE == "import":
        _INSTALLED.append("(import only, no swap)")
        return _INSTALLED
    kwargs = json.loads(os.environ.get("FASTPERSIST_IO_KWARGS") or "{}")
    import importlib

    targets = [
        ("lightning.pytorch.strategies.strategy", "FastPersistIO"),
        ("lightning.fabric.strategies.strategy", "FastPersistIO"),
        ("pytorch_lightning.strategies.strategy", "PLFastPersistIO"),
        ("lightning_fabric.strategies.strategy", "PLFastPersistIO"),
    ]
    for mod_name, cls_name in targets:
        if mod_name.startswith(("pytorch_lightning.", "lightning_fabric.")):
            # Only when that namespace is in use already (or asked for): importing pytorch_lightning
            # re-points lightning_utilities' rank_zero logger, which changes what Lightning's own
            # (``lightning.pytorch``) tests see in ``caplog``. PLFastPersistIO is made on first access.
            top = mod_name.split(".", 1)[0]
            if top not in sys.modules and os.environ.get("FASTPERSIST_SWAP_PL", "0") != "1":
                continue
        try:
            cls = getattr(fpl, cls_name)
            mod = importlib.import_module(mod_name)
        except (ImportError, AttributeError):
            continue
        if not hasattr(mod, "TorchCheckpointIO"):
            raise RuntimeError(f"{mod_name} has no TorchCheckpointIO global: this Lightning version is not supported")
        for meth in ("save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown"):
            _counted(cls, meth)
        mod.TorchCheckpointIO = _factory(cls, kwargs)
        _INSTALLED.append(f"{mod_name}.TorchCheckpointIO -> {cls_name}(**{kwargs})")
    if not _INSTALLED:
        raise RuntimeError("no Lightning strategy module found to patch")
    return _INSTALLED


if _MODE not in ("0", "off", "false", "no"):
    install()  # at import: before Lightning's conftest and the test modules run


def pytest_report_header(config: Any) -> list[str]:
    if _MODE in ("0", "off", "false", "no"):
        return ["fastpersist swap: OFF (FASTPERSIST_LIGHTNING_SWAP=0)"]
    return [f"fastpersist swap: {line}" for line in _INSTALLED]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _MODE in ("0", "off", "false", "no"):
        return
    if _MODE == "import":
        terminalreporter.write_line("fastpersist swap: import only (fp_integrations.lightning imported, no swap)")
        return
    c = _COUNTS
    terminalreporter.write_line(
        f"fastpersist swap: default IOs created={c['created']} save_checkpoint={c['save_checkpoint']} "
        f"load_checkpoint={c['load_checkpoint']} remove_checkpoint={c['remove_checkpoint']} teardown={c['teardown']}")
