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
``fp_core.dcp.FastPersistWriter``: the stock resume reads them), the small files as
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

import contextlib
import functools
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints

from fp_core import checkpoint_dir as fp_checkpoint_dir
from fp_core import commit as fp_commit
from fp_core import distributed as fp_dist
from fp_core import remote as fp_remote
from fp_core import retention
from fp_core.commit import fsync_file
from fp_core.pipeline import AsyncCheckpointer

from ._policy import ErrorPolicy, FastPersistWarning, checkpointer_options

log = logging.getLogger("fastpersist.hf")

__all__ = ["FastPersistCallback", "STAGING_PREFIX", "intercept_safetensors_writes", "verify_checkpoint_dir", "download_checkpoint",
           "remote_checkpoints"]

STAGING_PREFIX = ".fastpersist-staging-"
# accelerate's sharded FSDP checkpoint: DCP directories of {"model": ...} and {"optimizer": ...}
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
FSDP_OPTIMIZER_DIR = "optimizer_0"
# accelerate's FULL_STATE_DICT checkpoint: the full model and optimizer state, torch.save files
FSDP_FULL_MODEL_NAME = "pytorch_model_fsdp.bin"
FSDP_FULL_OPTIMIZER_NAME = "optimizer.bin"
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
_JIT_SENTINEL = "checkpoint-is-incomplete.txt"

# ---------------------------------------------------------------------------------------
# Routing save_pretrained's safetensors writes to the async checkpointer
# ---------------------------------------------------------------------------------------
_intercept_lock = threading.RLock()


@contextlib.contextmanager
def intercept_safetensors_writes(ckptr: AsyncCheckpointer, handles: list) -> Iterator[None]:
    """Within the block, safetensors files written by ``save_pretrained`` (and by the
    Trainer's plain-``nn.Module`` path) are handed to ``ckptr`` instead of written inline.

    This keeps ``save_pretrained``'s own state-dict logic (tied weights, weight-conversion
    revert, quantizer metadata, sharding, the index file, config files) byte-for-byte,
    and only replaces the final ``safe_save_file(tensors, filename, metadata)`` call.
    The handles of the started saves are appended to ``handles``. Main thread only.
    """
    def _save_file(tensors: dict, filename: Any, metadata: dict | None = None) -> None:
        handles.append(ckptr.save(dict(tensors), os.fspath(filename), format="safetensors",
                                  metadata=metadata, local=True))

    with _safetensors_writes_go_to(_save_file):
        yield


@contextlib.contextmanager
def _safetensors_writes_go_to(save_file: Callable[..., None]) -> Iterator[None]:
    """Within the block, ``safetensors.torch.save_file`` (and transformers' own reference
    to it, ``safe_save_file``) is ``save_file``; one block at a time, process-wide."""
    import safetensors.torch as st_torch
    import transformers.modeling_utils as mu

    with _intercept_lock:
        orig_mu = getattr(mu, "safe_save_file", None)
        orig_st = st_torch.save_file
        if orig_mu is not None:
            mu.safe_save_file = save_file
        st_torch.save_file = save_file
        try:
            yield
        finally:
            if orig_mu is not None:
                mu.safe_save_file = orig_mu
            st_torch.save_file = orig_st


# ---------------------------------------------------------------------------------------
# Resume from memory: the stock resume's reads of a checkpoint's files from their images
# ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _reads_from_memory(checkpoint: str, read: dict[str, int], unverified: list[str] | None = None) -> Iterator[None]:
    """Within the block, the stock resume's reads of a file directly in ``checkpoint`` that
    the writer process left a live shared-memory image of (``writer="process",
    resume_from_memory=True``, the file unchanged since) read that image instead of the
    disk: ``torch.load`` and safetensors' ``load_file`` of that path become
    ``fp_core.load`` of the image, every byte checked against the file's checksums. An
    image that fails is logged and the stock call reads the disk. Every other read is the
    stock call itself. ``read`` gets each file read from memory with its size.
    ``unverified``: names whose bytes on disk the resume's check left to this read (they
    had an image then): a stock read of one checks the file first (:func:`_verify_file`)
    and takes it out. Main thread, one block at a time, process-wide (as
    :func:`_safetensors_writes_go_to`)."""
    import safetensors.torch as st_torch
    import transformers.trainer_utils as tu

    import fp_core
    from fp_core import api as fp_api

    where = os.path.realpath(checkpoint)

    def image_of(f: Any) -> tuple[str, str] | None:
        """``(path, image)`` for a path in the checkpoint that has a live image."""
        if not isinstance(f, (str, os.PathLike)) or isinstance(os.fspath(f), bytes):
            return None
        p = os.fspath(f)
        if os.path.dirname(os.path.realpath(p)) != where:
            return None
        image = fp_api._memory_image(p)
        return None if image is None else (p, image)

    def from_image(found: tuple[str, str], **kw: Any) -> tuple[bool, Any]:
        p, image = found
        try:
            # through fp_core's bookkeeping of image reads: counted, the image removed at this
            # run's clean end (its owner gone), a failure logged there and raised as
            # _MemoryImageFailed: the stock call then reads the disk
            out = fp_api._from_memory(p, image, lambda: fp_core.load(image, verify=True, **kw))
        except fp_api._MemoryImageFailed:
            return False, None
        read[os.path.basename(p)] = os.path.getsize(image)
        if unverified and os.path.basename(p) in unverified:
            unverified.remove(os.path.basename(p))  # checked as it was read
        return True, out

    def from_disk(f: Any) -> None:
        """Before a stock read: a file whose check was left to its image is checked now."""
        if unverified and isinstance(f, (str, os.PathLike)) and not isinstance(os.fspath(f), bytes):
            p = os.fspath(f)
            name = os.path.basename(p)
            if name in unverified and os.path.dirname(os.path.realpath(p)) == where:
                _verify_file(p, checkpoint)
                unverified.remove(name)

    orig_torch_load = torch.load
    orig_load_file = st_torch.load_file
    orig_tu = getattr(tu, "safe_load_file", None)

    @functools.wraps(orig_torch_load)
    def torch_load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: bool | None = None,
                   mmap: bool | None = None, **pickle_load_args: Any) -> Any:
        # torch.load's own options beyond these (a pickle module, mmap) keep the stock read
        found = None if pickle_module is not None or mmap or pickle_load_args else image_of(f)
        if found is not None:
            ok, out = from_image(found, map_location=map_location, weights_only=weights_only)
            if ok:
                return out
        from_disk(f)
        return orig_torch_load(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap,
                               **pickle_load_args)

    @functools.wraps(orig_load_file)
    def load_file(filename: Any, device: Any = "cpu") -> dict[str, torch.Tensor]:
        found = image_of(filename)
        if found is not None:
            ok, out = from_image(found, map_location=device)
            if ok:
                return out
        from_disk(filename)
        return orig_load_file(filename, device=device)

    with _intercept_lock:
        torch.load = torch_load
        st_torch.load_file = load_file
        if orig_tu is not None:
            tu.safe_load_file = load_file  # load_sharded_checkpoint's own reference
        try:
            yield
        finally:
            torch.load = orig_torch_load
            st_torch.load_file = orig_load_file
            if orig_tu is not None:
                tu.safe_load_file = orig_tu


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------
def _fallback_reason(trainer: Any) -> str | None:
    """Why this trainer must keep the stock save, or None when we can take over."""
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed is enabled"
    if getattr(trainer, "is_fsdp_xla_enabled", False):
        return "FSDP on XLA is enabled"
    if getattr(trainer, "is_fsdp_enabled", False):
        reason = _fsdp_fallback_reason(trainer)
        if reason is not None:
            return reason
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        return "the model was sharded at load time"
    try:
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
        if is_torch_xla_available():
            return "XLA/TPU is in use"
        if is_sagemaker_mp_enabled():
            return "SageMaker model parallelism is enabled"
    except ImportError:  # pragma: no cover - older/newer transformers layout
        pass
    if getattr(args, "push_to_hub", False):
        return "push_to_hub is set (checkpoint uploads are not handled by FastPersist)"
    # FastPersist writes these itself: a subclass's own version would be silently skipped.
    for name in ("_save_checkpoint", "_save_optimizer_and_scheduler", "_save_scaler"):
        if getattr(type(trainer), name, None) is not getattr(Trainer, name, None):
            return f"{type(trainer).__name__} overrides {name}"
    return None


def _fsdp_plugin(trainer: Any) -> Any:
    return getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "fsdp_plugin", None)


def _fsdp_fallback_reason(trainer: Any) -> str | None:
    """FastPersist saves FSDP2's sharded state (SHARDED_STATE_DICT) in accelerate's layout;
    anything else under FSDP keeps the stock save."""
    plugin = _fsdp_plugin(trainer)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        return "FSDP1 is enabled (FastPersist saves FSDP2's sharded state)"
    if not any(t in str(getattr(plugin, "state_dict_type", "")) for t in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")):
        return f"FSDP with {plugin.state_dict_type} (FastPersist saves SHARDED_STATE_DICT and FULL_STATE_DICT)"
    if hasattr(getattr(trainer, "model", None), "peft_config"):  # how accelerate tells a PEFT model
        return "a PEFT model under FSDP (accelerate saves only its adapter)"
    if _fsdp_full(trainer) and isinstance(trainer, Trainer) and type(trainer).save_model is not Trainer.save_model:
        # FastPersist writes save_model's files itself under FULL_STATE_DICT
        return f"{type(trainer).__name__} overrides save_model"
    return None


def _fsdp_full(trainer: Any) -> bool:
    """FSDP2 with FULL_STATE_DICT: stock gathers the full state to rank 0 for every save."""
    plugin = _fsdp_plugin(trainer)
    return plugin is not None and "FULL_STATE_DICT" in str(getattr(plugin, "state_dict_type", ""))


def _fsdp_state(trainer: Any, *, optimizer: bool = True) -> tuple[dict, dict | None]:
    """The model's and optimizer's sharded (DTensor) state, as accelerate's
    ``save_fsdp_model`` / ``save_fsdp_optimizer`` take it for SHARDED_STATE_DICT. Under
    FULL_STATE_DICT the same sharded state, never gathered: its keys are those of the full
    state dict, and ``layout="file"`` writes the full tensors from every rank's rows."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    plugin = _fsdp_plugin(trainer)
    if _fsdp_full(trainer):
        # accelerate sets offload_to_cpu / rank0_only for its gather; the local shards stay put
        options = StateDictOptions(full_state_dict=False)
    else:
        options = StateDictOptions(full_state_dict=False,
                                   cpu_offload=bool(getattr(plugin.state_dict_config, "offload_to_cpu", False)),
                                   broadcast_from_rank0=bool(getattr(plugin.state_dict_config, "rank0_only", False)))
    model_sd = get_model_state_dict(trainer.model, options=options)
    optim_sd = None
    if optimizer and not trainer.args.save_only_model:
        optim_sd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
    return model_sd, optim_sd


def _save_file_layout(ckptr: AsyncCheckpointer, obj: Any, path: str, **kw: Any) -> Any:
    """Every rank's part of one file of the full state (``layout="file"``), collective: every
    rank calls it, in the same order."""
    return ckptr.save(obj, path, layout="file", **kw)


def _stand_ins(model_sd: dict) -> tuple[dict, Any]:
    """``model_sd`` with every DTensor replaced by a plain tensor of its global shape and
    dtype that holds no memory (the full tensor's stand-in, without its bytes). Names whose
    DTensors share their local memory (tied weights) share one stand-in, so
    ``save_pretrained`` drops the tied copies as it does for the model itself. (Stock's
    gather on several ranks gives each name a tensor of its own, and its file keeps the
    tied copy too: ``from_pretrained`` ties it again either way.)"""
    from fp_core.sharded import dtensor_type
    from fp_core.sharded_file import Placeholders

    kind = dtensor_type()
    first: dict[tuple, str] = {}  # local memory -> the first name over it
    alias: dict[str, str] = {}
    for k, v in model_sd.items():
        if kind is not None and isinstance(v, kind):
            local = v.to_local()
            key = (local.device, local.data_ptr(), tuple(v.shape), v.dtype) if local.numel() else ("empty", k)
            alias[k] = first.setdefault(key, k)
    names = sorted(set(alias.values()), key=list(model_sd).index)
    sizes = [model_sd[k].numel() * model_sd[k].element_size() for k in names]
    holes = Placeholders(sizes)
    stand_in = {k: holes.tensor(i, model_sd[k].shape, model_sd[k].dtype, n)
                for i, (k, n) in enumerate(zip(names, sizes))}
    out = dict(model_sd)
    for k, a in alias.items():
        out[k] = stand_in[a]
    return out, holes


@contextlib.contextmanager
def _record_safetensors_writes(calls: list) -> Iterator[None]:
    """Within the block, ``save_pretrained``'s safetensors writes are recorded as
    ``(filename, tensor names, metadata)`` and not written."""
    def _save_file(tensors: dict, filename: Any, metadata: dict | None = None) -> None:
        calls.append((os.fspath(filename), list(tensors), dict(metadata or {})))

    with _safetensors_writes_go_to(_save_file):
        yield


def _distributed() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _save_full_model(tr: Trainer, ckptr: AsyncCheckpointer, output_dir: str, model_sd: dict) -> list:
    """The Trainer's ``save_model`` under FSDP2 FULL_STATE_DICT, with no gather.

    The saving rank runs the Trainer's own ``_save`` (``save_pretrained``: tied weights,
    weight conversions, shards and index, config, processing class, ``training_args.bin``)
    on stand-ins of the full tensors, its safetensors writes recorded instead of done; the
    ranks learn that list from it, then every rank writes its rows of each file
    (``layout="file"``, same names, keys and metadata), in the same order. Returns the
    handles of those saves. Every rank calls it (collective)."""
    calls: list = []
    error: Exception | None = None
    if tr.args.should_save:
        try:
            stand_ins, holes = _stand_ins(model_sd)
            with _record_safetensors_writes(calls):
                tr._save(output_dir, state_dict=stand_ins)
            del stand_ins, holes
        except Exception as e:  # the other ranks wait for the list below: they hear of it first
            error = e
    if _distributed():
        # the training group, on the training thread: the checkpointer's worker uses its own
        box = [(calls, None if error is None else f"{type(error).__name__}: {error}")]
        torch.distributed.broadcast_object_list(box, src=0)
        calls, failure = box[0]
        if failure is not None and error is None:
            raise RuntimeError(f"{output_dir}: the saving rank's save_pretrained failed: {failure}")
    if error is not None:
        raise error
    handles = []
    for filename, names, metadata in calls:
        missing = [n for n in names if n not in model_sd]
        if missing:  # a weight conversion on save renamed or merged tensors: no rows to write
            raise ValueError(f"{filename}: save_pretrained writes {missing[:3]}, which the model's sharded "
                             "state dict does not hold; FastPersist cannot write them from the shards")
        handles.append(_save_file_layout(ckptr, {n: model_sd[n] for n in names}, filename,
                                         format="safetensors", metadata=metadata))
    return handles


def _load_full_state(tr: Trainer, checkpoint: str, model: Any = None, *, optimizer: bool) -> dict:
    """Fill the FSDP2 model (``optimizer=False``, from ``pytorch_model_fsdp.bin``) or its
    optimizer (from ``optimizer.bin``) from the full-state file: each rank reads only its own
    rows into its shards (``fp_core.load_into``); no rank loads the whole file, nothing is
    broadcast. Returns the ``LoadIntoStats`` of the read. Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import fp_core
    from fp_core import LoadIntoStats

    options = StateDictOptions(full_state_dict=False)
    model = model if model is not None else tr.model
    stats = LoadIntoStats()
    if not optimizer:
        # the sharded state dict's DTensors are views of the parameters' shards: filled in place
        target = get_model_state_dict(model, options=options)
        fp_core.load_into(target, os.path.join(checkpoint, FSDP_FULL_MODEL_NAME), stats=stats)
        set_model_state_dict(model, target, options=options)
    else:
        from accelerate.utils.fsdp_utils import _unwrap_optimizer

        opt = _unwrap_optimizer(tr.optimizer)
        # a fresh optimizer's state, created by torch as for any load; the file's values go
        # into it, and its param_groups (lr, betas, ...) come from the file
        target = get_optimizer_state_dict(model, opt, options=options)
        loaded = fp_core.load_into(target, os.path.join(checkpoint, FSDP_FULL_OPTIMIZER_NAME), stats=stats)
        set_optimizer_state_dict(model, opt, loaded, options=options)
    return {"tensor_bytes": stats.tensor_bytes, "tensors": stats.tensors, "whole_file": stats.whole_file}


def _find_trainer_on_stack(max_depth: int = 12) -> Trainer | None:
    f = sys._getframe(2)
    for _ in range(max_depth):
        if f is None:
            return None
        obj = f.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        f = f.f_back
    return None


@dataclass
class CheckpointRecord:
    """One checkpoint the callback started; ``stats`` of the callback lists these."""

    step: int
    path: str
    staging: str
    started: float
    blocked_seconds: float = 0.0  # time the training thread spent inside the save call
    fence_seconds: float = 0.0  # time later fences waited for this checkpoint
    commit_seconds: float | None = None  # save start -> committed (renamed + fsync'ed)
    bytes: int = 0
    ok: bool | None = None  # None while pending
    error: str | None = None
    remote: str | None = None  # the remote copy's URL (with remote_dir)
    uploaded: bool | None = None  # None: no upload (yet); False: the upload failed or was skipped
    upload_seconds: float | None = None
    handles: list = field(default_factory=list, repr=False)
    commit: Any = field(default=None, repr=False)
    upload: Any = field(default=None, repr=False)

    @property
    def last_job(self) -> Any:
        """The job after which this checkpoint is finished (its upload, else its commit)."""
        return self.upload if self.upload is not None else self.commit


class FastPersistCallback(TrainerCallback):
    """Asynchronous, atomic, durable Trainer checkpoints through fp_core.

    Args:
        trainer: the Trainer (optional; see the module doc for how it is found otherwise).
        policy: "auto" | "overlap" | "snapshot" — fp_core's staging policy.
        max_in_flight: checkpoints not yet committed at once (default 1). A save beyond it
            waits for the oldest to commit.
        on_error: "raise" (default) or "warn".
        fence_on_step_begin: True / False / "auto" (when the model has persistent
            buffers too big for the core's copy-at-save-time).
        remote_dir: an fsspec URL (``s3://bucket/run``): upload every committed
            checkpoint there, rotated like the local ones (see the module doc).
        storage_options: fsspec options (endpoint, credentials) for ``remote_dir``;
            default: fsspec's own configuration.
        keep_local: with ``remote_dir``, keep the local copies after upload (default
            False: removed once uploaded, except the best model checkpoint).
        wait_on_save: the Trainer calls every callback's ``on_save`` right after the save
            returns, and callbacks that read the checkpoint there (experiment trackers
            uploading ``checkpoint-N``) must find it committed. "auto" (default): wait for
            the commit when another callback overrides ``on_save``; True: always; False:
            never (the checkpoint appears once written, after ``on_save``).
        **engine_options: fp_core engine options (backend, queue_depth, ...) and other
            ``AsyncCheckpointer`` options (``huge_pages``, ``collapse_live_tensors``,
            ``snapshot_budget_bytes``, ``writer="process"``: each file written by a writer
            process, committed even if the trainer dies past the fence; with
            ``resume_from_memory=True`` the writer keeps the committed files' images in
            shared memory, and ``trainer.train(resume_from_checkpoint=...)`` on the same
            machine reads the weights, optimizer, scheduler and scaler files from them,
            every byte checked, where they still hold the files (else from disk);
            ``load_stats["memory"]`` lists what it read so).
    """

    def __init__(self, trainer: Trainer | None = None, *, policy: str = "auto", max_in_flight: int = 1,
                 on_error: str = "raise", fence_on_step_begin: bool | str = "auto",
                 remote_dir: str | None = None, storage_options: dict | None = None, keep_local: bool = False,
                 verify_on_resume: bool = True, all_ranks_write: bool = False, wait_on_save: bool | str = "auto",
                 **engine_options: Any) -> None:
        self.errors = ErrorPolicy(on_error)
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if fence_on_step_begin not in (True, False, "auto"):
            raise ValueError("fence_on_step_begin must be True, False or 'auto'")
        if wait_on_save not in (True, False, "auto"):
            raise ValueError("wait_on_save must be True, False or 'auto'")
        self.wait_on_save = wait_on_save
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.on_error = on_error
        self.fence_on_step_begin = fence_on_step_begin
        if remote_dir is not None:
            is_remote, remote_dir = fp_remote.split(os.fspath(remote_dir))
            if not is_remote:
                raise ValueError(f"remote_dir must be a remote fsspec URL (s3://..., gs://...), not {remote_dir!r}; "
                                 "local checkpoints go to TrainingArguments.output_dir")
            remote_dir = remote_dir.rstrip("/")
        self.remote_dir = remote_dir
        self.storage_options = storage_options
        self.keep_local = keep_local
        self.verify_on_resume = verify_on_resume
        self.all_ranks_write = all_ranks_write
        self._uploaded_local: list[str] = []  # local copies uploaded, to drop when keep_local=False
        engine, rest = checkpointer_options(engine_options, policy)
        self.engine_options = {**engine, **rest}
        self.trainer: Trainer | None = None
        self.records: list[CheckpointRecord] = []
        # what the last FSDP2 FULL_STATE_DICT resume read on this rank ("model", "optimizer")
        self.load_stats: dict[str, dict] = {}
        self.fallback_reason: str | None = None
        self._ckptr: AsyncCheckpointer | None = None
        self._group_ready = False  # fp_core's coordination group exists on every rank
        self._fence_step_begin = False
        self._pending: list[CheckpointRecord] = []
        self._scheduled: set[str] = set()  # checkpoints started and not (yet) known failed
        self._installed_on: Trainer | None = None
        self._logged_on_save = False
        self._warned_no_trainer = False
        if trainer is not None:
            self.attach(trainer)

    # ------------------------------------------------------------------ wiring
    def attach(self, trainer: Trainer) -> FastPersistCallback:
        """Bind to ``trainer`` and take over its checkpoint save (idempotent)."""
        if self._installed_on is trainer:
            return self
        if self._installed_on is not None:
            self._uninstall()
        self.trainer = trainer
        self.fallback_reason = _fallback_reason(trainer)
        if self.fallback_reason is not None:
            extra = f" Checkpoints are NOT uploaded to {self.remote_dir}." if self.remote_dir else ""
            warnings.warn(f"FastPersistCallback: {self.fallback_reason}; using the Trainer's stock "
                          f"(synchronous) checkpoint save.{extra}", stacklevel=2)
            self._installed_on = trainer
            return self
        trainer._save_checkpoint = self._save_checkpoint  # instance attribute shadows the method
        trainer._load_from_checkpoint = self._load_from_checkpoint
        trainer._load_optimizer_and_scheduler = self._load_optimizer_and_scheduler
        trainer._load_scaler = self._load_scaler
        if getattr(trainer, "is_fsdp_enabled", False) and _fsdp_full(trainer):
            trainer.save_model = self._save_model  # stock gathers the full state to rank 0
        self._installed_on = trainer
        return self

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> Any:
        """Resume: check the checkpoint's bytes against their checksums before loading any.
        A path that is not a directory gets the Trainer's own error ("Can't find a valid
        checkpoint at ...", a ValueError user code catches)."""
        if os.path.isdir(resume_from_checkpoint):
            stats = self.load_stats["memory"] = {"checkpoint": resume_from_checkpoint, "files": {},
                                                 "left_to_images": [], "unverified": []}
            if self.verify_on_resume:
                # the files the stock resume reads from their images are checked there, byte
                # for byte, and not read from disk here (a disk read of one checks it first)
                stats["left_to_images"] = sorted(_images_in(resume_from_checkpoint))
                stats["unverified"] = list(stats["left_to_images"])
                verify_checkpoint_dir(resume_from_checkpoint, read_elsewhere=stats["left_to_images"])
        tr = self.trainer
        if self._full_resume(resume_from_checkpoint, FSDP_FULL_MODEL_NAME, "_load_from_checkpoint"):
            tr.accelerator.wait_for_everyone()
            self.load_stats["model"] = _load_full_state(tr, resume_from_checkpoint, model, optimizer=False)
            tr.accelerator.wait_for_everyone()
            return None
        # the trainer's own class: a subclass's override of the load is kept
        with self._from_memory(resume_from_checkpoint):
            return type(tr)._load_from_checkpoint(tr, resume_from_checkpoint, model)

    def _from_memory(self, checkpoint: str | None) -> contextlib.AbstractContextManager:
        """The stock resume's reads of ``checkpoint``'s files from their shared-memory images
        where there are live ones (see :func:`_reads_from_memory`); what was read so is
        ``load_stats["memory"]``: ``{"checkpoint": path, "files": {name: bytes},
        "left_to_images": the files the check before the resume did not read from disk,
        "unverified": those of them not checked since (not read)}``."""
        if checkpoint is None or not os.path.isdir(checkpoint):
            return contextlib.nullcontext()
        stats = self.load_stats.get("memory")
        if stats is None or stats["checkpoint"] != checkpoint:
            stats = self.load_stats["memory"] = {"checkpoint": checkpoint, "files": {}, "left_to_images": [],
                                                 "unverified": []}
        return _reads_from_memory(checkpoint, stats["files"], stats["unverified"])

    def _full_resume(self, checkpoint: str | None, name: str, method: str) -> bool:
        """Resume FSDP2 FULL_STATE_DICT state from ``checkpoint/name`` by rows (not through the
        Trainer's ``method``, which reads the whole file on rank 0 and broadcasts it)?"""
        tr = self.trainer
        return (checkpoint is not None and getattr(tr, "is_fsdp_enabled", False) and _fsdp_full(tr)
                and getattr(type(tr), method) is getattr(Trainer, method)
                and os.path.isfile(os.path.join(checkpoint, name)))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's, with the FSDP2 FULL_STATE_DICT optimizer read by rows."""
        tr = self.trainer
        if not (self._full_resume(checkpoint, FSDP_FULL_OPTIMIZER_NAME, "_load_optimizer_and_scheduler")
                and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME))):
            with self._from_memory(checkpoint):
                return type(tr)._load_optimizer_and_scheduler(tr, checkpoint)
        from transformers.trainer_pt_utils import reissue_pt_warnings

        tr.accelerator.wait_for_everyone()
        self.load_stats["optimizer"] = _load_full_state(tr, checkpoint, optimizer=True)
        tr.accelerator.wait_for_everyone()
        with warnings.catch_warnings(record=True) as caught, self._from_memory(checkpoint):
            tr.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        reissue_pt_warnings(caught)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """The Trainer's, ``scaler.pt`` read from its shared-memory image where there is one."""
        tr = self.trainer
        with self._from_memory(checkpoint):
            return type(tr)._load_scaler(tr, checkpoint)

    def _save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``trainer.save_model()`` under FSDP2 FULL_STATE_DICT: stock's files (safetensors,
        config, processing class, training_args.bin) with every rank writing its rows of the
        safetensors (no gather); each file appears whole under its name. Every rank calls it,
        as the stock one; it returns once the files are durable."""
        tr = self.trainer
        output_dir = output_dir if output_dir is not None else tr.args.output_dir
        self.wait()  # this save's collectives follow the earlier checkpoints' on every rank
        own = self._ckptr is None  # after train() (closed at its end): a checkpointer for this save
        try:
            model_sd, _ = _fsdp_state(tr, optimizer=False)
            handles = _save_full_model(tr, self.checkpointer, output_dir, model_sd)
            del model_sd
            for h in handles:
                h.result()
        finally:
            if own:
                self.close()

    def _uninstall(self) -> None:
        t = self._installed_on
        ours = {"_save_checkpoint": self._save_checkpoint, "_load_from_checkpoint": self._load_from_checkpoint,
                "_load_optimizer_and_scheduler": self._load_optimizer_and_scheduler, "_load_scaler": self._load_scaler,
                "save_model": self._save_model}
        for name, method in ours.items():
            if t is not None and t.__dict__.get(name) == method:
                del t.__dict__[name]
        self._installed_on = None

    def detach(self) -> None:
        """Drain, then give the trainer its stock save back."""
        self.close()
        self._uninstall()
        self.trainer = None

    def _ensure_trainer(self) -> bool:
        if self.trainer is None:
            t = _find_trainer_on_stack()
            if t is not None:
                self.attach(t)
        if self.trainer is None and not self._warned_no_trainer:
            self._warned_no_trainer = True
            warnings.warn("FastPersistCallback could not find its Trainer; checkpoints use the stock "
                          "save. Call callback.attach(trainer).", stacklevel=3)
        return self.trainer is not None and self.fallback_reason is None

    @property
    def active(self) -> bool:
        return self.trainer is not None and self.fallback_reason is None

    @property
    def checkpointer(self) -> AsyncCheckpointer:
        if self._ckptr is None:
            # max_in_flight is per file in the core; we bound whole checkpoints ourselves.
            # The Trainer calls on_pre_optimizer_step (our fence) right before every
            # optimizer.step(). The core's global step pre-hook is kept as a second guard
            # with on_error="raise"; with "warn" it is left out, because an error it
            # surfaced would be raised from inside optimizer.step(), past our handling.
            group = torch.distributed.group.WORLD if self._collective() else None
            self._ckptr = AsyncCheckpointer(policy=self.policy, max_in_flight=1024,
                                            install_optimizer_hook=self.on_error == "raise",
                                            group=group, **self.engine_options)
        return self._ckptr

    # ------------------------------------------------------------------ errors
    def _reap(self) -> None:
        """Account for committed / failed checkpoints (main thread)."""
        still = []
        for rec in self._pending:
            if rec.last_job is None or not rec.last_job.done():
                still.append(rec)
                continue
            err = rec.commit.exception()
            if err is None and rec.ok is False:
                self._scheduled.discard(rec.path)
            elif err is not None:
                rec.ok, rec.error = False, f"{type(err).__name__}: {err}"
                self._scheduled.discard(rec.path)
            if rec.upload is not None and err is None:
                uerr = rec.upload.exception()
                if uerr is not None:
                    rec.uploaded = False
                    rec.error = f"upload to {rec.remote}: {type(uerr).__name__}: {uerr}"
        self._pending = still

    def _call(self, fn: Any, what: str) -> float:
        """``fn()`` under the error policy; the checkpoints it finished are accounted for."""
        t0 = time.perf_counter()
        try:
            self.errors.call(fn, what)
        finally:
            self._reap()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ public
    def fence(self) -> float:
        """Block until no in-flight save reads live training memory; returns seconds waited."""
        if self._ckptr is None or not self._pending:
            return 0.0
        dt = self._call(self._ckptr.fence, "checkpoint write")
        for rec in self._pending:
            rec.fence_seconds += dt
        return dt

    def wait(self) -> None:
        """Block until every started checkpoint is committed (and rotation done)."""
        if self._ckptr is not None:
            self._call(self._ckptr.wait, "checkpoint write")

    def close(self) -> None:
        if self._ckptr is not None:
            ck, self._ckptr = self._ckptr, None
            self._call(ck.close, "checkpoint write")

    @property
    def stats(self) -> list[CheckpointRecord]:
        return list(self.records)

    # ------------------------------------------------------------------ events
    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            self._ensure_trainer()

    def on_train_begin(self, args, state, control, **kwargs):
        if not self._ensure_trainer():
            return
        tr = self.trainer
        self._fence_step_begin = self._decide_step_begin_fence(kwargs.get("model") or tr.model)
        self._setup_group()
        # Remove staging directories left by a crashed run (nothing of ours is pending).
        if args.should_save and not self._pending and os.path.isdir(args.output_dir):
            fp_commit.recover_dirs(args.output_dir, (STAGING_PREFIX,))
        self._barrier()

    def on_step_begin(self, args, state, control, **kwargs):
        if self._fence_step_begin:
            self.fence()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.fence()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # _finalize_training logs the train summary right before _load_best_model and the
        # save_total_limit == 1 cleanup: every checkpoint must be committed by then.
        if logs and "train_runtime" in logs:
            self.wait()

    def on_train_end(self, args, state, control, **kwargs):
        self.wait()
        self.close()

    # ------------------------------------------------------------------ internals
    def _decide_step_begin_fence(self, model: Any) -> bool:
        if self.fence_on_step_begin != "auto":
            return bool(self.fence_on_step_begin)
        small = 1 << 20
        try:
            keys = set(model.state_dict().keys())
            for name, b in model.named_buffers():
                if name in keys and b.numel() * b.element_size() > small:
                    return True
        except Exception:  # noqa: BLE001 - conservative
            return True
        return False

    def _distributed(self) -> bool:
        return (torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1)

    def _setup_group(self) -> None:
        if self._group_ready or not self._distributed():
            return
        # fp_core's coordination group (gloo, apart from the training collectives): creating
        # it is collective, so every rank does it here, on the main thread.
        fp_dist.coordination_group(None)
        self._group_ready = True

    def _collective(self) -> bool:
        """Every rank writes a share of optimizer.pt (all_ranks_write, shared filesystem)."""
        tr = self.trainer
        return (self.all_ranks_write and self._group_ready and tr is not None
                and not tr.args.save_on_each_node and not tr.args.save_only_model)

    def _barrier(self) -> None:
        if self._group_ready:
            fp_dist.barrier()

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """transformers 5.24 ``Trainer._save_checkpoint``, asynchronous and atomic."""
        tr = self.trainer
        if tr is None or self.fallback_reason is not None:
            return Trainer._save_checkpoint(tr, model, trial)
        self._setup_group()  # normally done at on_train_begin
        args, state = tr.args, tr.state
        t0 = time.perf_counter()

        # Bound checkpoints in flight; also never stage the same step twice at once.
        self._reap()
        while len(self._pending) >= self.max_in_flight:
            self._call(lambda: self._pending[0].last_job.exception(), "checkpoint write")
            self._reap()

        checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if tr.hp_search_backend is None and trial is None:
            tr.store_flos()
        run_dir = tr._get_output_dir(trial=trial)
        final = os.path.join(run_dir, checkpoint_folder)
        staging = os.path.join(run_dir, f"{STAGING_PREFIX}{state.global_step}")
        rec = CheckpointRecord(step=state.global_step, path=final, staging=staging, started=t0)
        jit = os.path.exists(os.path.join(final, _JIT_SENTINEL))
        handles: list = rec.handles
        sync_files: list[str] = []  # plain files this rank wrote, fsync'ed before commit
        error: BaseException | None = None
        self._check_pending_errors()
        try:
            os.makedirs(run_dir, exist_ok=True)
            os.makedirs(staging, exist_ok=True)
            ckptr = self.checkpointer
            fsdp = bool(getattr(tr, "is_fsdp_enabled", False))
            fsdp_full = fsdp and _fsdp_full(tr)
            if fsdp_full:
                # FSDP2, FULL_STATE_DICT: stock's files (model.safetensors + config from
                # save_model, pytorch_model_fsdp.bin and optimizer.bin from accelerate, the
                # full state dicts, read by the stock resume), each written by every rank
                # from its own rows: no gather. Collective, in the same order on every rank.
                model_sd, optim_sd = _fsdp_state(tr)
                handles.extend(_save_full_model(tr, ckptr, staging, model_sd))
                if not args.save_only_model:  # stock writes these with the optimizer and scheduler
                    handles.append(_save_file_layout(ckptr, model_sd, os.path.join(staging, FSDP_FULL_MODEL_NAME)))
                    handles.append(_save_file_layout(ckptr, optim_sd, os.path.join(staging, FSDP_FULL_OPTIMIZER_NAME)))
                del model_sd, optim_sd
            elif fsdp:
                # FSDP2, SHARDED_STATE_DICT: accelerate's layout (stock resume reads it), every
                # rank its shards, first and in the same order on every rank (collective).
                model_sd, optim_sd = _fsdp_state(tr)
                handles.append(ckptr.save({"model": model_sd}, os.path.join(staging, FSDP_MODEL_DIR)))
                if optim_sd is not None:
                    handles.append(ckptr.save({"optimizer": optim_sd}, os.path.join(staging, FSDP_OPTIMIZER_DIR)))
                del model_sd, optim_sd
            elif self._collective() and not args.save_only_model:
                # First, on every rank in the same order: the ranks meet in this collective,
                # and a failure later on one rank must not leave the others waiting in it.
                # DP ranks hold the same optimizer state: each writes a near-equal byte range
                # of the one optimizer.pt (fp_core collective save; rank 0 names the file).
                handles.append(ckptr.save(tr.optimizer.state_dict(), os.path.join(staging, OPTIMIZER_NAME)))

            # 1. model weights (+ config, generation config, processing class, training_args.bin)
            if not fsdp_full:  # written above
                with intercept_safetensors_writes(ckptr, handles):
                    tr.save_model(staging, _internal_call=True)

            # 2. best model checkpoint: stock checks that the directory exists (after a barrier);
            #    the best one may be this very checkpoint, still staged: count those we started.
            if (args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST]
                    and state.best_global_step):
                best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
                if best_dir == final or best_dir in self._scheduled or os.path.exists(best_dir):
                    state.best_model_checkpoint = best_dir

            # 3. optimizer, scheduler, scaler (async), RNG (tiny; the Trainer's own method)
            if not args.save_only_model:
                if self._collective() or fsdp:
                    pass  # queued first, above
                elif args.should_save:
                    handles.append(ckptr.save(tr.optimizer.state_dict(), os.path.join(staging, OPTIMIZER_NAME),
                                              local=True))
                if args.should_save:
                    with warnings.catch_warnings(record=True) as caught:
                        sched_sd = tr.lr_scheduler.state_dict()
                    from transformers.trainer_pt_utils import reissue_pt_warnings
                    reissue_pt_warnings(caught)
                    handles.append(ckptr.save(sched_sd, os.path.join(staging, SCHEDULER_NAME), local=True))
                    scaler = getattr(tr.accelerator, "scaler", None)
                    if scaler is not None:
                        handles.append(ckptr.save(scaler.state_dict(), os.path.join(staging, SCALER_NAME),
                                                  local=True))
                rng_before = set(os.listdir(staging))
                tr._save_rng_state(staging)
                # this rank's RNG file(s) only: other ranks write into the same directory meanwhile
                sync_files += [os.path.join(staging, n) for n in sorted(set(os.listdir(staging)) - rng_before)
                               if n.startswith("rng_state")]

            # 4. trainer state, with the stateful callbacks as of now
            if args.should_save:
                for cb in [cb for cb in tr.callback_handler.callbacks + [tr.control]
                           if isinstance(cb, ExportableState)]:
                    cb_name = cb.__class__.__name__
                    cb_state = cb.state()
                    if isinstance(state.stateful_callbacks[cb_name], list):
                        state.stateful_callbacks[cb_name].append(cb_state)
                    else:
                        state.stateful_callbacks[cb_name] = cb_state
                state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
                # everything else this rank wrote inline (config, tokenizer, json, args, rng)
                written_async = {os.path.basename(h.path) for h in handles}
                sync_files = [os.path.join(staging, n) for n in sorted(os.listdir(staging))
                              if n not in written_async and not n.endswith(".fptmp")
                              and os.path.isfile(os.path.join(staging, n))]
        except Exception as e:  # reported below, after the ranks agree
            error = e

        # 5. commit (+ rotation) on the background worker, strictly after this checkpoint's writes
        best = state.best_model_checkpoint
        should_save = args.should_save
        save_total_limit = args.save_total_limit
        distributed = self._group_ready
        in_writer = None
        if error is None and should_save and not distributed:
            # writer="process": the writer commits the directory after its files, so a trainer
            # killed from here on still gets its checkpoint (None: this process commits it)
            try:
                in_writer = self.checkpointer.hand_over_dir_commit(staging, final, sync_files, handles)
            except Exception as e:  # noqa: BLE001 - the writer is gone: the save fails, reported below
                error = e

        def commit() -> bool:
            return self._commit(rec, list(handles), sync_files, run_dir, should_save, save_total_limit,
                                best, distributed, failed=error is not None, in_writer=in_writer)
        commit.__name__ = f"commit {checkpoint_folder}"
        # Enqueued even after a failure: it cleans the staging directory once the writes
        # already started have finished, and keeps the ranks' agreement steps paired.
        try:
            rec.commit = self.checkpointer.enqueue(commit, after=[])
            if should_save and error is None and save_total_limit:
                # rotation after the commit, a job of its own: if it fails, that is reported,
                # and the committed checkpoint (and its upload) stay as they are
                def rotate(rec: CheckpointRecord = rec) -> None:
                    if rec.ok:  # only once this checkpoint is committed
                        _rotate_local(run_dir, save_total_limit, best)

                rotate.__name__ = f"rotate {run_dir}"
                self.checkpointer.enqueue(rotate, after=[rec.commit])
            if self.remote_dir is not None and should_save and error is None:
                # 6. upload after the local commit (same FIFO worker), then rotate remotely
                rec.remote = f"{self.remote_dir}/{checkpoint_folder}"
                upload = functools.partial(self._upload, rec, best, save_total_limit)
                upload.__name__ = f"upload {checkpoint_folder} to {rec.remote}"  # type: ignore[attr-defined]
                rec.upload = self.checkpointer.enqueue(upload, after=[rec.commit])
        except Exception as e:
            error = error or e
        if error is not None and rec.commit is None and should_save:
            shutil.rmtree(staging, ignore_errors=True)
        self.records.append(rec)
        if rec.commit is not None:
            self._pending.append(rec)
            self._scheduled.add(final)
        if error is not None:
            rec.blocked_seconds = time.perf_counter() - t0
            rec.ok, rec.error = False, f"{type(error).__name__}: {error}"
            self._scheduled.discard(final)
            self.errors.handle(error, f"checkpoint {final}")
            return
        if jit:  # JIT (SIGTERM) checkpoint: the process is about to go away, make it durable now
            self.wait()
        elif self._must_commit_before_on_save(tr):
            self._call(rec.commit.result, f"checkpoint {final}")
        rec.blocked_seconds = time.perf_counter() - t0

    def _must_commit_before_on_save(self, tr: Trainer) -> bool:
        if self.wait_on_save is not True and self.wait_on_save is not False:  # "auto"
            readers = [type(cb).__name__ for cb in tr.callback_handler.callbacks
                       if cb is not self and type(cb).on_save is not TrainerCallback.on_save]
            if readers and not self._logged_on_save:
                self._logged_on_save = True
                log.info("FastPersist: %s handle on_save; each checkpoint is committed before the Trainer "
                         "calls it (wait_on_save=False to keep saves fully asynchronous)", ", ".join(readers))
            return bool(readers)
        return self.wait_on_save

    def _check_pending_errors(self) -> None:
        """Surface background failures of earlier checkpoints before starting a new one, so
        that one is reported on its own and does not also fail this checkpoint."""
        if self._ckptr is not None:
            self._call(self._ckptr.fence, "checkpoint write")
        self._reap()

    def _commit(self, rec: CheckpointRecord, handles: list, sync_files: list[str], run_dir: str,
                should_save: bool, save_total_limit: int | None, best: str | None, distributed: bool,
                failed: bool, in_writer: Callable[[], None] | None = None) -> bool:
        """Background worker: agree across ranks, rename staging -> checkpoint-N, rotate.
        ``in_writer``: the writer process commits the directory; this waits for it."""
        ok = not failed
        nbytes = 0
        for h in handles:  # FIFO worker: all of them have finished by now
            if h.exception() is not None:
                ok = False  # the core reports that error itself, at the next fence / wait
                if rec.error is None:  # the record says why
                    rec.error = f"{type(h.exception()).__name__}: {h.exception()}"
            else:
                nbytes += getattr(h.result(), "bytes", 0) or 0
        err: BaseException | None = None
        if in_writer is not None:
            try:
                in_writer()  # after its files; it fails where one of them failed
            except BaseException as e:  # noqa: BLE001
                if ok:
                    err = e
                ok = False
            if not ok:
                shutil.rmtree(rec.staging, ignore_errors=True)
            rec.bytes, rec.ok = nbytes, ok
            rec.commit_seconds = time.perf_counter() - rec.started
            if err is not None:
                raise err
            return ok
        if ok:
            try:
                for p in sync_files:
                    fsync_file(p)
            except OSError as e:
                ok = False
                if not distributed:
                    if should_save:  # nothing will commit it: the checkpoint-sized staging goes
                        shutil.rmtree(rec.staging, ignore_errors=True)
                    raise
                err = e  # raised once the other ranks know
        if distributed:
            ok = fp_dist.agree(ok)
        if should_save:
            try:
                if ok:
                    # every rank's files are final and synced (the handles, the fsyncs, the
                    # agreement): list them, so a file lost later is found missing on verify
                    fp_checkpoint_dir.write_dir_manifest(rec.staging)
                    fp_commit.publish_dir(rec.staging, rec.path)
                else:
                    shutil.rmtree(rec.staging, ignore_errors=True)
            except BaseException as e:  # noqa: BLE001
                err, ok = e, False
                shutil.rmtree(rec.staging, ignore_errors=True)

        if distributed:
            fp_dist.barrier()  # committed before any rank moves on
        rec.bytes = nbytes
        rec.ok = ok
        rec.commit_seconds = time.perf_counter() - rec.started
        if err is not None:
            raise err
        if not ok and not failed and not any(h.exception() for h in handles) and distributed:
            raise RuntimeError(f"checkpoint {rec.path} failed on another rank; not committed")
        return ok

    def _upload(self, rec: CheckpointRecord, best: str | None, save_total_limit: int | None) -> bool:
        """Background worker, after ``rec``'s commit: upload checkpoint-N, rotate remotely,
        drop local copies (``keep_local=False``). Raises on failure (a background error)."""
        if not rec.ok:  # not committed (the failure is reported through the commit / writes)
            return False
        t0 = time.perf_counter()
        try:
            fp_remote.upload_dir(rec.path, rec.remote, storage_options=self.storage_options)
        except BaseException:
            rec.uploaded = False
            raise
        rec.uploaded = True
        rec.upload_seconds = time.perf_counter() - t0
        self._rotate_remote(os.path.basename(rec.path), best, save_total_limit)
        if not self.keep_local:
            self._uploaded_local.append(rec.path)
            keep = [p for p in self._uploaded_local if best is not None and os.path.abspath(p) == os.path.abspath(best)]
            gone = [p for p in self._uploaded_local if p not in keep and os.path.isdir(p)]
            self._uploaded_local = keep
            fp_commit.retire_dirs(gone)  # renamed out of checkpoint-* first, like any rotation
        return True

    def _rotate_remote(self, newest: str, best: str | None, save_total_limit: int | None) -> None:
        """``save_total_limit`` for ``remote_dir``, among the complete remote checkpoints
        (the same rule as the local rotation)."""
        ckpts = remote_checkpoints(self.remote_dir, storage_options=self.storage_options)
        by_name = {u.rstrip("/").rsplit("/", 1)[-1]: u for u in ckpts}
        protected = {newest} | ({os.path.basename(os.path.normpath(best))} if best else set())
        for name in retention.to_delete(list(by_name), save_total_limit, protected):
            fp_remote.remove(by_name[name], recursive=True, storage_options=self.storage_options)


def verify_checkpoint_dir(path: str, *, read_elsewhere: Collection[str] = ()) -> int:
    """Refuse a damaged ``checkpoint-N`` directory before the Trainer resumes from it.

    Every file in it is checked for what it is (:func:`fp_core.verify` of the directory):
    files FastPersist wrote with a manifest (``optimizer.pt``, ``scheduler.pt``,
    ``scaler.pt``) byte for byte, safetensors files against the checksums FastPersist
    writes into their header (a file written by another tool: its structure, as
    safetensors' own parser checks it), JSON files must parse, FSDP's sharded DCP
    directories rank file by rank file. A directory the callback committed lists its files
    (:data:`fp_core.checkpoint_dir.DIR_MANIFEST`): one of them missing or of another size
    (``optimizer.pt`` deleted: the Trainer resumes with a fresh optimizer) is said in a
    :class:`FastPersistWarning`, and the files that are there are checked: a checkpoint
    edited on purpose (a model resharded, a file rewritten in another format) resumes as
    with the stock Trainer. Raises :class:`fp_core.CorruptCheckpointError` naming the file
    and the damaged record or tensor. Returns the number of files checked (0 for a
    directory in which nothing carries FastPersist's checksums: written by the Trainer
    alone, its structure checked). ``read_elsewhere``: files whose bytes the caller checks
    as it reads them (from their shared-memory images): here only their presence and size.
    """
    from fp_core import CorruptCheckpointError, NotAFastPersistCheckpoint, verify
    from fp_core.dcp import verify_dir as verify_dcp

    try:
        try:
            if read_elsewhere:
                return int(fp_checkpoint_dir.verify_dir(path, verify_dcp, skip=read_elsewhere)["files"])
            return int(verify(path)["files"])
        except fp_checkpoint_dir.DirectoryChangedError as e:
            warnings.warn(f"{path} changed since FastPersist committed it: {e.detail}; resuming from the files "
                          "that are there, as the stock Trainer would", FastPersistWarning, stacklevel=2)
            return int(fp_checkpoint_dir.verify_dir(path, verify_dcp, check_listed=False,
                                                    skip=read_elsewhere)["files"])
    except NotAFastPersistCheckpoint:
        return 0
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.path, e.record, f"{e.detail}; refusing to resume from {path}",
                                     tensor=e.tensor) from e


def _verify_file(path: str, checkpoint: str) -> None:
    """One file of ``checkpoint`` checked as :func:`verify_checkpoint_dir` checks it."""
    from fp_core import CorruptCheckpointError, NotAFastPersistCheckpoint, verify

    try:
        verify(path)
    except NotAFastPersistCheckpoint:
        pass
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.path, e.record, f"{e.detail}; refusing to resume from {checkpoint}",
                                     tensor=e.tensor) from e


# what the stock resume reads with torch.load or safetensors' load_file (FSDP's full-state
# files are read with fp_core.load_into, which finds their images itself)
_READ_BY_STOCK = re.compile(r"((pytorch_)?model(-\d+-of-\d+)?\.(safetensors|bin)|optimizer\.pt|scheduler\.pt|scaler\.pt)")


def _images_in(checkpoint: str) -> set[str]:
    """The files of ``checkpoint`` the stock resume reads that have a live shared-memory image."""
    from fp_core import api as fp_api

    return {n for n in os.listdir(checkpoint) if _READ_BY_STOCK.fullmatch(n)
            and os.path.isfile(os.path.join(checkpoint, n)) and fp_api._memory_image(os.path.join(checkpoint, n))}


def _rotate_local(run_dir: str, save_total_limit: int | None, best: str | None) -> None:
    """transformers' ``rotate_checkpoints`` (the same victims: ``fp_core.retention``), each
    victim renamed out of ``checkpoint-*`` before it is deleted (``fp_core.commit.retire_dirs``),
    so a kill during the slow recursive delete never leaves a half-deleted checkpoint-N."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    checkpoints = sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, use_mtime=True)
    protected = {checkpoints[-1]} | ({str(Path(best))} if best is not None else set()) if checkpoints else set()
    fp_commit.retire_dirs(retention.to_delete(checkpoints, save_total_limit, protected))


# ---------------------------------------------------------------------------------------
# Remote checkpoints
# ---------------------------------------------------------------------------------------
def _step_of(url: str) -> int | None:
    m = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", url.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def remote_checkpoints(remote_dir: str, *, storage_options: dict | None = None) -> list[str]:
    """URLs of the *complete* ``checkpoint-N`` directories under ``remote_dir``, oldest step
    first (incomplete ones -- an upload in progress, failed or being removed -- are left out)."""
    urls = fp_remote.list_complete(remote_dir, f"{PREFIX_CHECKPOINT_DIR}-", storage_options=storage_options)
    return [u for _, u in sorted((_step_of(u), u) for u in urls if _step_of(u) is not None)]


def download_checkpoint(remote_dir: str, *, storage_options: dict | None = None,
                        local_dir: str | os.PathLike | None = None, missing_ok: bool = False) -> str | None:
    """Download the newest complete ``checkpoint-N`` under ``remote_dir``; return its local path,
    for ``trainer.train(resume_from_checkpoint=...)``.

    ``local_dir``: the directory to put ``checkpoint-N`` in (``local_dir/checkpoint-N`` is
    replaced); default: FastPersist's local staging cache, where an unchanged checkpoint is
    reused without a second download. No complete checkpoint: ``FileNotFoundError``, or
    ``None`` with ``missing_ok=True`` (a first run starts from scratch).
    """
    ckpts = remote_checkpoints(remote_dir, storage_options=storage_options)
    if not ckpts:
        if missing_ok:
            return None
        raise FileNotFoundError(f"no complete {PREFIX_CHECKPOINT_DIR}-N directory under {remote_dir}")
    url = ckpts[-1]
    dest = None if local_dir is None else os.path.join(os.fspath(local_dir), url.rstrip("/").rsplit("/", 1)[-1])
    return fp_remote.download_dir(url, dest, storage_options=storage_options)
