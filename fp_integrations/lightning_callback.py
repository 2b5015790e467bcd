"""The Lightning companion callback: per-checkpoint stats to the loggers, a fence for
optimizers outside ``torch.optim``, and under DDP every rank's part in each checkpoint
(the sharded strategies' routing installed, or the collective save joined).

:class:`_FastPersistCallbackImpl` knows no Lightning namespace; ``FastPersistCallback``
(``lightning``) is made here and ``PLFastPersistCallback`` (``pytorch_lightning``) in
:mod:`fp_integrations.lightning`, both importable from there.
"""

from __future__ import annotations

from typing import Any

from ._policy import metrics
from .lightning_io import _FastPersistIOImpl


class _FastPersistCallbackImpl:
    """Companion callback (optional): logs per-checkpoint stats to the trainer's loggers,
    fences at ``on_before_optimizer_step`` (for optimizers that are not ``torch.optim``) and,
    under DDP, lets every rank write a share of each checkpoint (``all_ranks_write``).

    Lightning gives the checkpoint to the plugin on rank 0 only, but calls every callback's
    ``on_save_checkpoint`` on every rank with the same dict just before: there each rank > 0
    starts its part of a collective save (``fp_core.save(..., group=...)``), and rank 0's
    plugin joins it when the dict arrives. Saves rank 0 makes alone (``ddp_spawn``'s
    hand-back file, URLs) stay rank-0 saves. Ranks whose checkpoints differ fall back to
    rank 0 writing alone, with a warning.
    """

    def __init__(self, log_stats: bool = True, fence: bool = True, prefix: str = "fastpersist/",
                 all_ranks_write: bool = True) -> None:
        super().__init__()
        self.log_stats = log_stats
        self.fence = fence
        self.prefix = prefix
        self.all_ranks_write = all_ranks_write

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        import torch.distributed as dist

        from . import lightning_sharded

        plugin = self._plugin(trainer)
        if plugin is not None and lightning_sharded.install(trainer.strategy, plugin):
            return  # every rank saves its own shards (lightning_sharded); nothing to share
        if (plugin is not None and self.all_ranks_write and trainer.world_size > 1
                and dist.is_available() and dist.is_initialized() and not plugin._collective):
            plugin.enable_collective()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        plugin = self._plugin(trainer)
        if plugin is None or not plugin._collective or getattr(trainer.strategy, "_fastpersist_sharded", None):
            return
        if trainer.is_global_zero:
            plugin.expect_collective(checkpoint)
        else:
            plugin.participate(checkpoint)

    @staticmethod
    def _plugin(trainer: Any) -> _FastPersistIOImpl | None:
        io = getattr(trainer.strategy, "checkpoint_io", None)
        for _ in range(3):  # unwrap _WrappingCheckpointIO layers
            if isinstance(io, _FastPersistIOImpl):
                return io
            io = getattr(io, "checkpoint_io", None)
        return None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.fence:
            plugin = self._plugin(trainer)
            if plugin is not None:
                plugin.fence()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._log(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._log(trainer)  # after teardown: the last saves are committed now

    def _log(self, trainer: Any) -> None:
        if not self.log_stats or not trainer.is_global_zero:
            return
        plugin = self._plugin(trainer)
        if plugin is None:
            return
        for st in plugin.pop_unlogged_stats():
            row = metrics(st, self.prefix)
            for logger in trainer.loggers:
                logger.log_metrics(row, step=trainer.global_step)


try:  # the ``lightning`` package
    from lightning.pytorch.callbacks import Callback as _LCallback
except ImportError:  # pragma: no cover - depends on the environment
    pass
else:

    class FastPersistCallback(_FastPersistCallbackImpl, _LCallback):
        """Companion callback for ``lightning.pytorch.Trainer``."""

    # pickled by name (ddp_spawn) as fp_integrations.lightning.FastPersistCallback, where users import it from
    FastPersistCallback.__module__ = "fp_integrations.lightning"
