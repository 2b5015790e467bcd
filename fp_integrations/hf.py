"""FastPersist for the Hugging Face ``Trainer`` (transformers 5.x).

    from fp_integrations.hf import FastPersistCallback
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[FastPersistCallback()])
    trainer.train()

What it does
------------
The callback takes over the Trainer's checkpoint save. It writes the same files as stock,
into the same ``output_dir/checkpoint-{global_step}`` directory:

* model weights as safetensors, exactly as ``save_pretrained`` lays them out (tied
  weights dropped, weight conversions reverted, shards + ``model.safetensors.index.json``
  past the shard size), plus ``config.json`` / ``generation_config.json``, the
  tokenizer / processor files and ``training_args.bin``;
* ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (AMP with a scaler) — standard
  ``torch.save`` zips, loadable with ``torch.load(weights_only=True)``;
* ``rng_state.pth`` / ``rng_state_{rank}.pth`` (one per rank) and ``trainer_state.json``
  (with the stateful callbacks updated, as stock).

Weights, optimizer, scheduler and scaler state go through ``fp_core.AsyncCheckpointer``:
the save returns promptly and the files are written while training goes on. The
checkpoint is staged in ``output_dir/.fastpersist-staging-{step}`` (a name that neither
``checkpoint-*`` globbing nor the Trainer's ``^checkpoint-(\\d+)$`` regex picks up), every
file is made durable, the list of its files and their sizes is written beside them
(``.fastpersist-dir.json``: a verify or resume then finds a file that went missing), and
only then is the directory renamed to ``checkpoint-{step}`` and the parent directory fsync'ed. So ``resume_from_checkpoint=True`` only ever sees
complete checkpoints. ``save_total_limit`` rotation runs after that commit, on the
background worker, choosing the same victims as stock's ``rotate_checkpoints`` but renaming
each out of the ``checkpoint-*`` namespace before deleting it.

How it takes over
-----------------
The Trainer's save *decisions* are kept untouched: ``DefaultFlowCallback`` sets
``control.should_save``, ``_maybe_log_save_evaluate`` logs, evaluates, updates
``best_metric`` / ``best_global_step`` (and applies ``save_strategy="best"``), then calls
``trainer._save_checkpoint(model, trial)`` and ``on_save``. The callback replaces
``_save_checkpoint`` **on that trainer instance** with an asynchronous re-implementation
of transformers 5.24's ``Trainer._save_checkpoint`` (store_flos, save_model,
best_model_checkpoint, optimizer/scheduler/scaler/RNG, stateful callbacks +
trainer_state.json, rotation). Intercepting at the ``should_save`` flag in ``on_step_end``
instead would run before that step's logging and evaluation (so ``trainer_state.json``
and best-model tracking would be one step stale) and cannot see ``save_strategy="best"``.

A callback does not receive the trainer. Pass it explicitly when you can::

    cb = FastPersistCallback(); trainer = Trainer(..., callbacks=[cb]); cb.attach(trainer)
    # or FastPersistCallback(trainer=trainer) + trainer.add_callback(cb)

Otherwise the callback finds the trainer that calls ``on_init_end`` / ``on_train_begin``
on it (the ``self`` of the calling ``Trainer`` method on the call stack).

Consistency and durability
--------------------------
* ``on_pre_optimizer_step``: fence — the background no longer reads live parameters or
  optimizer state. With ``on_error="raise"`` the core's global ``torch.optim`` step
  pre-hook is installed too, as a second guard. Tensors of at most 1 MiB (BatchNorm
  statistics, ``step`` counters) are copied by the core at save time.
* ``on_step_begin``: fence too when the model has persistent buffers larger than that
  (they may change during forward); ``fence_on_step_begin=True/False`` forces it.
* Drain (everything durable, committed and rotated) when the Trainer logs its final
  ``train_runtime`` summary — that is *before* ``_load_best_model`` and the
  ``save_total_limit == 1`` cleanup in ``_finalize_training`` — and again at
  ``on_train_end``. So the final checkpoint is durable before ``train()`` returns.
  ``cb.wait()`` drains by hand (e.g. after an exception stopped training).

Multi-process (torchrun / DDP)
------------------------------
Every rank writes its own ``rng_state_{rank}.pth``; ``args.should_save`` ranks write the
shared files. Each checkpoint ends with a job on each rank's background worker that
agrees with the other ranks (all-reduce of a success flag on a dedicated gloo group,
created at ``on_train_begin``), after which the saving rank commits and rotates, then a
barrier, so a rank's ``wait()`` returns only once the checkpoint is committed.
With ``all_ranks_write=True`` (``output_dir`` on a filesystem every rank sees), every rank
writes a near-equal byte range of ``optimizer.pt`` — the largest shared file, identical on
all data-parallel ranks — through ``fp_core``'s collective save; the other shared files
(``model.safetensors``, scheduler, json) come from the saving rank. ``save_on_each_node``
with a *shared* filesystem is not supported (two ranks would commit the same directory).

FSDP2 with ``SHARDED_STATE_DICT`` (accelerate's ``fsdp_version=2``): every rank saves its
shards of the model and optimizer in the background, in accelerate's layout
(``pytorch_model_fsdp_0/`` and ``optimizer_0/``, DCP directories written by
``fp_core.parallel.dcp.FastPersistWriter``: the stock resume reads them), the small files as
above, and the directory is committed after every rank's writes; resume verifies every
item.

FSDP2 with ``FULL_STATE_DICT``: stock gathers the full model to rank 0 twice per
checkpoint (``model.safetensors`` through ``save_model``, ``pytorch_model_fsdp.bin``) and
the full optimizer state once (``optimizer.bin``). The callback writes the same files,
names and keys with no gather: each is one file of the full state that every rank writes
its own rows of (``fp_core.save(..., layout="file")``; the optimizer file in the form of
``get_optimizer_state_dict(full_state_dict=True)``, parameter names as keys). For the
safetensors, the saving rank runs the Trainer's own ``_save`` / ``save_pretrained`` on
stand-ins of the full tensors that hold no memory (config, ``training_args.bin``, index
and shard names, ``{"format": "pt"}`` as stock) and the ranks write the tensors it would
have written; tied weights are dropped as ``save_pretrained`` drops them for the model
itself (stock's gather on several ranks unties them, so its file also holds
``lm_head.weight``; ``from_pretrained`` ties it again either way). ``trainer.save_model()``
is taken over the same way. ``from_pretrained`` on one process and the stock resume on any
world size read these files; a resume through the callback fills the model and the
optimizer from ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` with ``fp_core.load_into``,
each rank reading only its own rows (stock reads each whole file on rank 0 and broadcasts).

FSDP1, other FSDP state dict types, PEFT under FSDP, DeepSpeed (its own checkpoint
engine), XLA/TPU, SageMaker MP, models sharded at load time, ``push_to_hub`` and Trainer
subclasses that override ``_save_checkpoint`` (or ``save_model``, under FULL_STATE_DICT)
fall back to the stock save, with one warning.

Errors: ``on_error="raise"`` (default) re-raises a failed checkpoint in the training
loop (at the save itself, or at the next fence / drain for background failures);
``"warn"`` logs it, discards the incomplete checkpoint and keeps training.

Remote storage (``remote_dir``)
-------------------------------
The Trainer itself only writes local directories, so ``output_dir`` stays local and is
the fast tier; ``FastPersistCallback(remote_dir="s3://bucket/run", storage_options={...},
keep_local=False)`` adds a remote copy (any fsspec URL, see :mod:`fp_core.remote`):

* after each local commit, a job on the same background worker uploads
  ``checkpoint-N`` to ``{remote_dir}/checkpoint-N`` with ``fp_core.remote.upload_dir``:
  the files first, the ``.fastpersist-complete`` marker last, so a remote checkpoint
  directory is complete (marker present) or ignored (a failed or interrupted upload;
  its partial files are removed, best effort). Only the ``args.should_save`` rank uploads.
* remote rotation follows ``save_total_limit`` as the Trainer's local rotation does
  (oldest steps first; the newest and ``best_model_checkpoint`` are kept), among the
  *complete* remote checkpoints (``fp_core.remote.list_complete``); a directory is
  removed marker first.
* ``keep_local=False`` (default): once a checkpoint is uploaded its local copy is removed
  (except the current ``best_model_checkpoint``, which ``load_best_model_at_end`` reads);
  a checkpoint whose upload failed stays on local disk. ``keep_local=True``: local
  checkpoints are kept and rotated exactly as without ``remote_dir``.
* an upload failure is a background error like any other (``on_error`` raise / warn);
  ``cb.wait()`` / the end of ``train()`` also wait for the uploads.
* the upload runs on the checkpointer's worker, so a checkpoint started while the
  previous one is still uploading waits for it (``max_in_flight`` counts checkpoints until
  they are uploaded): the upload overlaps training up to the next save.
* resume: ``trainer.train(resume_from_checkpoint=download_checkpoint(remote_dir, ...))``;
  :func:`download_checkpoint` fetches the newest *complete* remote checkpoint.
"""

from __future__ import annotations

# The callback's parts live in modules by concern and users import from here. Names outside
# __all__ that code imports from here are re-exported with ``as`` (explicit for linters).
from ._policy import FastPersistWarning as FastPersistWarning
from .hf_callback import STAGING_PREFIX, FastPersistCallback
from .hf_common import OPTIMIZER_NAME as OPTIMIZER_NAME
from .hf_common import SCALER_NAME as SCALER_NAME
from .hf_common import SCHEDULER_NAME as SCHEDULER_NAME
from .hf_common import TRAINER_STATE_NAME as TRAINER_STATE_NAME
from .hf_common import CheckpointRecord as CheckpointRecord
from .hf_common import intercept_safetensors_writes
from .hf_fsdp import FSDP_FULL_MODEL_NAME as FSDP_FULL_MODEL_NAME
from .hf_fsdp import FSDP_FULL_OPTIMIZER_NAME as FSDP_FULL_OPTIMIZER_NAME
from .hf_fsdp import FSDP_MODEL_DIR as FSDP_MODEL_DIR
from .hf_fsdp import FSDP_OPTIMIZER_DIR as FSDP_OPTIMIZER_DIR
from .hf_remote import download_checkpoint, remote_checkpoints
from .hf_resume import verify_checkpoint_dir

__all__ = ["FastPersistCallback", "STAGING_PREFIX", "intercept_safetensors_writes", "verify_checkpoint_dir", "download_checkpoint",
           "remote_checkpoints"]
