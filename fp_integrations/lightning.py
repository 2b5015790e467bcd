"""PyTorch Lightning integration: a ``CheckpointIO`` plugin that saves in the background.

Usage (``lightning`` package)::

    from fp_integrations.lightning import FastPersistIO, FastPersistCallback
    trainer = Trainer(plugins=[FastPersistIO()], callbacks=[FastPersistCallback(log_stats=True)])

    # remote checkpoints (see "Remote storage" below)
    from fp_integrations.lightning import FastPersistModelCheckpoint
    mc = FastPersistModelCheckpoint(dirpath="s3://bucket/run/ckpts", save_last=True)
    trainer = Trainer(plugins=[FastPersistIO()], callbacks=[mc])
    trainer.fit(model, ckpt_path="last")

Usage (``pytorch_lightning`` package; its ``CheckpointIO``/``Callback`` are different
classes, so it gets its own)::

    from fp_integrations.lightning import PLFastPersistIO, PLFastPersistCallback
    trainer = pytorch_lightning.Trainer(plugins=[PLFastPersistIO()])

The same plugin works with Fabric (``Fabric(plugins=[FastPersistIO()])``;
``PLFastPersistIO`` for ``lightning_fabric``).

What the plugin does
--------------------
* ``save_checkpoint`` hands the checkpoint to an ``fp_core.AsyncCheckpointer`` and returns
  while the file is written, synced and atomically renamed in the background. Files are
  ordinary ``torch.save`` zips (``torch.load``, ``load_from_checkpoint`` keep working).
* Consistency: parameters and optimizer state only change inside ``optimizer.step()``.
  The plugin registers a global ``torch.optim`` step pre-hook that *fences* (waits until
  no background save still reads live tensors) right before the update. When the step
  is given a closure (Lightning's automatic optimization runs forward and backward inside
  ``optimizer.step(closure)``) the fence runs after the closure, so the write overlaps the
  next forward and backward. Small tensors (BatchNorm statistics) are copied at save time.
* A save is asynchronous only while training runs and is *blocking* (durable before
  ``save_checkpoint`` returns) when no training step comes after it: a
  ``trainer.save_checkpoint`` before or after ``fit()`` or in ``validate``/``test``, a save
  by Fabric or by hand before any optimizer step (or after ``teardown()``), and a save made
  through a wrapping ``CheckpointIO`` such as Lightning's ``AsyncCheckpointIO`` (the
  wrapper is the background; no wrapper passes ``teardown()`` on, so nothing may be left
  pending when ``fit`` ends). Also when asked with ``storage_options={"blocking": True}``,
  for SLURM requeue saves (``hpc_ckpt_*.ckpt``, the process dies next) and for the
  ``ddp_spawn`` hand-back file (``.temp.ckpt``).
* While a save is pending its final name already exists (an empty placeholder marked with
  an extended attribute, replaced atomically by the finished file), so ``ModelCheckpoint``'s
  existence checks (the ``-v1`` version counter, ``save_last``) behave exactly as with the
  stock IO. Disable with ``visible_pending=False`` (filesystems without user xattrs get
  no placeholder). A crash mid-save can leave a placeholder behind: ``load_checkpoint``
  reports it clearly, and ``fastpersist clean DIR`` or the next save into the directory
  removes it (its writer is dead).
* ``remove_checkpoint`` runs on the background worker after every pending save, so a
  ``save_top_k`` rotation never deletes a file still being written, and is skipped when
  one of those saves failed, or one that ended before the call failed unreported (the
  older checkpoint is kept; the failure is raised).
* ``load_checkpoint`` waits for a pending save of that path (and raises one that already
  failed rather than read the older file past it). ``teardown()`` drains all.
* Errors in the background are raised at the next plugin call, at the next optimizer
  step, or at ``teardown()`` (never masking an exception already propagating), so
  ``fit()`` fails; ``on_error="warn"`` turns them into warnings and training continues.

Remote storage (``s3://``, ``gs://``, ``memory://``... any fsspec URL)
--------------------------------------------------------------------
Remote paths go through the core's remote tier (:mod:`fp_core.remote`), not the stock
``TorchCheckpointIO``: the checkpoint is written with the native engine into a private
local staging directory, committed there, then uploaded on the background worker
(object stores: one atomic PUT / completed multipart upload, so the remote object is
complete or absent). ``FastPersistIO(storage_options={...}, keep_local=False)``: the
fsspec options (endpoint, credentials) for every remote call of the plugin, and whether
the committed file stays in the local cache so a ``load_checkpoint`` of it skips the
download. The staging slot is removed when the upload ends, on success and on failure.

* ``save_checkpoint``: asynchronous as for local paths (blocking in the same cases).
  No directory is created and *no placeholder* is published for a remote path (an empty
  object would look complete), so until its upload finishes a pending checkpoint is not
  visible to ``ModelCheckpoint``'s own ``fs.exists`` calls. That matters only for its
  ``-v1`` version counter with a *fixed* ``filename`` (or a second run writing
  ``last.ckpt`` into a directory whose last save is still uploading); use
  :class:`FastPersistModelCheckpoint`, which also counts the plugin's pending saves.
* ``load_checkpoint``: waits for a pending save of that URL, then downloads it into
  staging (or uses the ``keep_local`` cache) and loads it with the native loader
  (``verify=True`` checks every byte). A missing object raises ``FileNotFoundError``.
* ``remove_checkpoint``: ``fp_core.remote.remove`` (recursive, as stock), run on the
  background worker after every pending save, skipped when one of them failed.
* Upload errors (store unreachable, access denied...) are background errors like any
  other: raised at the next plugin call / optimizer step / ``teardown`` (``on_error="warn"``:
  a ``FastPersistWarning``), and nothing complete-looking is left for the failed save.
* ``ModelCheckpoint`` makes its own fsspec calls on ``dirpath`` (``exists``, ``ls``):
  configure the store for fsspec itself (``fsspec.config.conf["s3"] = {...}``, the
  ``FSSPEC_S3`` environment variable, or the store's own environment such as
  ``AWS_ENDPOINT_URL_S3``) so both reach the same endpoint; the plugin's
  ``storage_options`` default to that configuration. With the store down, the version
  counter's ``exists`` call fails ``fit`` with the store's own error before the plugin
  is asked to save (``enable_version_counter=False`` leaves all store traffic to the plugin).
* Lightning bug (seen in 2.6.6): ``fit(ckpt_path="last")`` with a remote ``dirpath`` silently starts
  from scratch (``ModelCheckpoint._find_last_checkpoints`` returns the listed paths
  without their ``s3://`` prefix, which then resolve to the local filesystem, where
  nothing exists). :class:`FastPersistModelCheckpoint` returns full URLs, so
  ``ckpt_path="last"`` resumes from the newest remote ``last*.ckpt``.

Sharded strategies (``ModelParallelStrategy``, ``FSDPStrategy``): the plugin alone is enough.
They save without their ``CheckpointIO``; when Lightning assigns them this plugin they are
routed through it (:mod:`fp_integrations.lightning_sharded`): sharded directories written by
every rank in the background, and ``ModelParallelStrategy(save_distributed_checkpoint=False)``'s
one ``.ckpt`` written by every rank from its own shards, with no gather to rank 0, and resumed
with each rank reading only its own rows (any number of ranks). A strategy that saves
without its ``CheckpointIO`` and cannot be routed (DeepSpeed, a custom one) warns once.

Distributed (DDP): Lightning calls ``save_checkpoint``/``remove_checkpoint`` on global
rank 0 only. With the plugin alone, rank 0 writes every checkpoint. Add the callback —
``Trainer(plugins=[FastPersistIO()], callbacks=[FastPersistCallback()])``, the one extra
object — and every rank writes a near-equal byte range of each checkpoint into the one
file (``fp_core.save(..., group=...)`` on a dedicated gloo group): the callback sees the
checkpoint dict on every rank (``on_save_checkpoint``) and starts the other ranks' part;
rank 0's plugin joins when Lightning hands it the same dict. The file is rank 0's, byte for
byte: storages that differ between ranks (BatchNorm statistics) are sent from rank 0; if
ranks differ too much, rank 0 writes alone with a warning. Saves rank 0 makes alone
(``ddp_spawn``'s hand-back file, URLs) stay rank-0 saves and tell the others so.
"""

from __future__ import annotations

from typing import Any

# The plugin, the callback and the ModelCheckpoint live in modules by concern; users import
# from here, where the pytorch_lightning variants are made too.
from ._policy import FastPersistWarning
from .lightning_callback import _FastPersistCallbackImpl
from .lightning_checkpoint import _FastPersistModelCheckpointImpl
from .lightning_io import _FastPersistIOImpl

__all__ = ["FastPersistWarning"]

try:  # the ``lightning`` package
    from .lightning_callback import FastPersistCallback
    from .lightning_checkpoint import FastPersistModelCheckpoint
    from .lightning_io import FastPersistIO
except ImportError:  # pragma: no cover - depends on the environment
    pass
else:
    __all__ += ["FastPersistIO", "FastPersistCallback", "FastPersistModelCheckpoint"]

# The ``pytorch_lightning`` package (with ``lightning_fabric``): its classes are made on first
# use. Importing pytorch_lightning points lightning_utilities' rank_zero logger at
# ``pytorch_lightning``'s, so a ``lightning.pytorch`` user would stop seeing Lightning's own
# messages in their logging setup just because this module was imported.
_PL_NAMES = ("PLFastPersistIO", "PLFastPersistCallback", "PLFastPersistModelCheckpoint")


def _make_pl_classes() -> dict[str, type]:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _PLCheckpointIO
    from pytorch_lightning.callbacks import Callback as _PLCallback
    from pytorch_lightning.callbacks import ModelCheckpoint as _PLModelCheckpoint

    class PLFastPersistIO(_FastPersistIOImpl, _PLCheckpointIO):
        """FastPersist ``CheckpointIO`` for ``pytorch_lightning.Trainer`` and ``lightning_fabric.Fabric``."""

    class PLFastPersistCallback(_FastPersistCallbackImpl, _PLCallback):
        """Companion callback for ``pytorch_lightning.Trainer``."""

    class PLFastPersistModelCheckpoint(_FastPersistModelCheckpointImpl, _PLModelCheckpoint):
        __doc__ = _FastPersistModelCheckpointImpl.__doc__

    made = {c.__name__: c for c in (PLFastPersistIO, PLFastPersistCallback, PLFastPersistModelCheckpoint)}
    for c in made.values():  # pickled by name (ddp_spawn): fp_integrations.lightning.PLFastPersistIO
        c.__module__, c.__qualname__ = __name__, c.__name__
    return made


def __getattr__(name: str) -> Any:
    if name in _PL_NAMES:
        try:
            made = _make_pl_classes()
        except ImportError:
            raise ImportError(f"{name} needs the 'pytorch_lightning' package: pip install pytorch-lightning") \
                from None
        globals().update(made)
        return made[name]
    if name in ("FastPersistIO", "FastPersistCallback", "FastPersistModelCheckpoint"):
        raise ImportError(f"{name} needs the 'lightning' package: pip install lightning")
    raise AttributeError(name)
