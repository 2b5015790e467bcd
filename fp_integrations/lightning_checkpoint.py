"""A ``ModelCheckpoint`` for remote ``dirpath`` s and FastPersist's pending saves.

:class:`_FastPersistModelCheckpointImpl` knows no Lightning namespace;
``FastPersistModelCheckpoint`` (``lightning``) is made here and
``PLFastPersistModelCheckpoint`` (``pytorch_lightning``) in :mod:`fp_integrations.lightning`,
both importable from there.
"""

from __future__ import annotations

from typing import Any

from .lightning_callback import _FastPersistCallbackImpl


class _FastPersistModelCheckpointImpl:
    """``ModelCheckpoint`` that works with remote ``dirpath`` s and FastPersist's pending saves.

    * ``_find_last_checkpoints`` returns full URLs for a remote checkpoint directory
      (Lightning's own returns them without the ``s3://`` prefix, so ``ckpt_path="last"``
      silently finds nothing), so ``fit(ckpt_path="last")`` resumes from the store.
    * ``file_exists`` (the ``-v1`` version counter) also counts a save still pending in the
      trainer's FastPersist plugin: a remote checkpoint has no placeholder while it uploads.

    Everything else is the stock ``ModelCheckpoint``; local directories behave identically.
    """

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        found = super()._find_last_checkpoints(trainer)
        from fsspec.implementations.local import LocalFileSystem

        fs = getattr(self, "_fs", None)
        if fs is None or isinstance(fs, LocalFileSystem):
            return found
        return {fs.unstrip_protocol(p) for p in found}

    def file_exists(self, filepath: Any, trainer: Any) -> bool:
        plugin = _FastPersistCallbackImpl._plugin(trainer)
        if trainer.is_global_zero and plugin is not None and plugin.pending(filepath):
            return trainer.strategy.reduce_boolean_decision(True, all=False)  # same collective as stock
        return super().file_exists(filepath, trainer)


try:  # the ``lightning`` package
    from lightning.pytorch.callbacks import ModelCheckpoint as _LModelCheckpoint
except ImportError:  # pragma: no cover - depends on the environment
    pass
else:

    class FastPersistModelCheckpoint(_FastPersistModelCheckpointImpl, _LModelCheckpoint):
        __doc__ = _FastPersistModelCheckpointImpl.__doc__

    # pickled by name (ddp_spawn) as fp_integrations.lightning.FastPersistModelCheckpoint, where users import it from
    FastPersistModelCheckpoint.__module__ = "fp_integrations.lightning"
