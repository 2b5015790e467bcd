"""FSDP2 under the Hugging Face ``Trainer``: which FSDP set-ups FastPersist saves, their
sharded state, and the full-state files written and read by rows.

``SHARDED_STATE_DICT`` checkpoints are accelerate's DCP directories, each rank writing its
shards. ``FULL_STATE_DICT`` checkpoints are stock's files of the full state, which every
rank writes its own rows of (``layout="file"``) and a resume fills by rows
(``fp_core.load_into``), so no rank gathers the full state.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from transformers import Trainer

from fp_core.pipeline.checkpointer import AsyncCheckpointer

from .hf_common import _safetensors_writes_go_to

# accelerate's sharded FSDP checkpoint: DCP directories of {"model": ...} and {"optimizer": ...}
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
FSDP_OPTIMIZER_DIR = "optimizer_0"
# accelerate's FULL_STATE_DICT checkpoint: the full model and optimizer state, torch.save files
FSDP_FULL_MODEL_NAME = "pytorch_model_fsdp.bin"
FSDP_FULL_OPTIMIZER_NAME = "optimizer.bin"


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
    from fp_core.parallel.sharded_file import Placeholders
    from fp_core.sharded import dtensor_type

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

