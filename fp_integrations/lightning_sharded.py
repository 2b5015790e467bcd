"""Lightning's sharded strategies on FastPersist: ``ModelParallelStrategy`` and
``FSDPStrategy`` (``state_dict_type="sharded"`` and ``"full"``).

Those strategies never hand a sharded checkpoint to the ``CheckpointIO``: every rank calls
``torch.distributed.checkpoint.save`` with DCP's stock writer itself, then rank 0 writes
``meta.pt`` into the directory (so a crash in between leaves a directory without it).
``FastPersistCallback.setup`` routes them through the plugin instead (:func:`install`):

* ``save_checkpoint``: the same directory (``__<rank>_0.distcp`` files, ``.metadata``,
  ``meta.pt``), written by every rank through ``fp_core.AsyncCheckpointer`` (the DTensor
  state becomes an ``fp_core.parallel.dcp_save.DcpSave`` job): in the background while training
  runs, fenced before the next optimizer step, blocking where the plugin's saves block;
  ``meta.pt`` is committed inside the directory with it, and the whole directory appears
  under its name at once, checksummed. FSDP1's ``ShardedTensor`` state is copied at save
  and written by ``dcp.save`` on the plugin's background worker instead.
* ``load_checkpoint`` (``ckpt_path=...``): waits for a pending save of that path, then
  Lightning's own load runs with its DCP reads going through ``FastPersistReader`` (with
  the plugin's ``verify``: every item checked against its checksum, and ``meta.pt`` too).
  ``FSDPStrategy`` reads optimizer state with DCP's stock ``FileSystemReader`` itself
  (unchecked, the layout is the same).
* A pending sharded save has no placeholder under its name (a directory appears whole):
  ModelCheckpoint's ``-v1`` counter with a fixed ``filename`` needs
  :class:`~fp_integrations.lightning.FastPersistModelCheckpoint`, which counts pending saves.
* ``remove_checkpoint`` is the plugin's: after every pending save.
* ``teardown`` drains this rank's pending saves (``ModelParallelStrategy`` does not tear
  its ``CheckpointIO`` down).

The state dict keys stay Lightning's ("state_dict" / "model", "optimizer_<i>"), so stock
Lightning loads these directories and FastPersist loads stock ones.

``ModelParallelStrategy(save_distributed_checkpoint=False)`` (one ``.ckpt`` file): stock
Lightning gathers the full model and optimizer state to rank 0, which writes the file. Routed,
no rank gathers anything: the checkpoint keeps each parameter's and each optimizer state's
DTensor, and every rank writes its own rows of the one file (``fp_core.save(...,
layout="file")``, :mod:`fp_core.parallel.sharded_file`), which holds what stock writes there (the
full ``state_dict``, ``optimizer_states`` keyed by parameter id as
``FSDP.rekey_optim_state_dict`` keys them, rank 0's loops, callbacks and schedulers), so
plain ``torch.load`` and stock Lightning read it; written in the background through the
plugin's ``AsyncCheckpointer`` where the plugin's saves are. ``ckpt_path=...`` of such a file (ours or
stock's) fills the sharded model and optimizer with ``fp_core.load_into``: each rank reads only
its own rows, on any number of ranks.

``FSDPStrategy(state_dict_type="full")`` (FSDP1, one ``.ckpt`` file): stock Lightning
gathers the full model and optimizer state to rank 0 (``FULL_STATE_DICT``), which writes
the file. Routed, no rank gathers anything: each rank's FSDP1 ``flat_param`` shard holds a
contiguous element range of each parameter's flattened form (and Adam's state the same
range), so the checkpoint's ``state_dict`` and ``optimizer_states`` are built on every rank
from those ranges as ``FlatShard`` s (:mod:`fp_core.parallel.fsdp1_flat`, with stock's keys,
order, dtypes and shapes, the optimizer state rekeyed by parameter id as stock rekeys it),
and every rank writes its ranges of the one file (``layout="file"``). Where that cannot
apply (CPU offload, mixed precision, ``use_orig_params=False``, replicated or hybrid
sharding, an optimizer over parameters FSDP does not manage, a remote path) the save is
stock's gather, and the first save logs why. ``ckpt_path=...`` keeps stock's load of the
full file (a ``torch.save`` file).

The plugin alone routes them: the first time Lightning assigns a FastPersist plugin to a
strategy (``Strategy.checkpoint_io``'s setter, which :func:`patch_strategy_class` wraps once
per process), :func:`on_assigned` installs the routing on that strategy object. A strategy
given any other ``CheckpointIO`` is untouched. A strategy that saves without its
``CheckpointIO`` and that this module cannot route (DeepSpeed, a custom one) warns once, at
its first save, naming the fix.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

_METADATA_FILENAME = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
_patch_lock = threading.RLock()
log = logging.getLogger("fastpersist")


def sharded_state_key(strategy: Any) -> str | None:
    """The key Lightning saves the model's sharded state under, or None when ``strategy``
    does not save sharded checkpoints through DCP."""
    names = {c.__name__ for c in type(strategy).__mro__}
    if "ModelParallelStrategy" in names and getattr(strategy, "_save_distributed_checkpoint", False):
        return "state_dict"
    if "FSDPStrategy" in names and getattr(strategy, "_state_dict_type", None) == "sharded":
        return "model"
    return None


def _class_names(strategy: Any) -> set[str]:
    return {c.__name__ for c in type(strategy).__mro__}


def file_mode(strategy: Any) -> bool:
    """Does ``strategy`` save one full-state ``.ckpt`` file that every rank can write its own
    part of (``ModelParallelStrategy(save_distributed_checkpoint=False)``: its rows;
    ``FSDPStrategy(state_dict_type="full")``: its flat-param ranges, see :func:`fsdp1_full_why`)?"""
    names = _class_names(strategy)
    if "ModelParallelStrategy" in names:
        return not getattr(strategy, "_save_distributed_checkpoint", True)
    return "FSDPStrategy" in names and getattr(strategy, "_state_dict_type", None) == "full"


def _is_fsdp(strategy: Any) -> bool:
    return "FSDPStrategy" in _class_names(strategy)


def fsdp1_full_why(strategy: Any) -> str | None:
    """Why ``FSDPStrategy(state_dict_type="full")``'s checkpoints cannot be written by every
    rank from its flat-param shards (then they are stock's gather to rank 0), or None when
    they can. Decided at the first save, the same on every rank (the model's and the
    strategy's configuration only), and logged once."""
    if "_fastpersist_fsdp1_why" in strategy.__dict__:
        return strategy.__dict__["_fastpersist_fsdp1_why"]
    from fp_core.parallel.sharded_file import fsdp1_flat

    if strategy.kwargs.get("use_orig_params") is False:
        why = "use_orig_params=False (stock keys the optimizer state by parameters FSDP1 has flattened)"
    else:
        optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers]
        why = fsdp1_flat.unsupported(strategy.model, optimizers)
    strategy._fastpersist_fsdp1_why = why
    if why is not None and strategy.global_rank == 0:
        log.warning("fastpersist: FSDPStrategy(state_dict_type=\"full\") checkpoints are gathered to rank 0 and "
                    "written by it, as stock does, not by every rank from its shards: %s", why)
    return why


def install(strategy: Any, plugin: Any) -> bool:
    """Route ``strategy``'s sharded saves and loads through ``plugin`` (a FastPersist
    ``CheckpointIO``); True when ``strategy`` is one whose saves this routes (a sharded
    checkpoint directory, or ``ModelParallelStrategy``'s one file written by every rank)."""
    if sharded_state_key(strategy) is None and not file_mode(strategy):
        return False
    with _patch_lock:
        if getattr(strategy, "_fastpersist_sharded", None) is plugin:
            return True
        _install(strategy, plugin)
    return True


def _install(strategy: Any, plugin: Any) -> None:
    stock_save = type(strategy).save_checkpoint.__get__(strategy)
    stock_load = type(strategy).load_checkpoint.__get__(strategy)
    stock_module_state = type(strategy).lightning_module_state_dict.__get__(strategy)
    stock_optimizer_state = type(strategy).optimizer_state.__get__(strategy)

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        key = sharded_state_key(strategy)
        if storage_options is not None or (key is None and not file_mode(strategy)):
            return stock_save(checkpoint, filepath, storage_options)  # stock's own answer (a TypeError for the former)
        if key is None:
            if _is_fsdp(strategy) and fsdp1_full_why(strategy) is not None:
                return stock_save(checkpoint, filepath, storage_options)
            return _save_file(strategy, plugin, checkpoint, filepath, stock_save)
        path = os.path.abspath(os.fspath(strategy.broadcast(filepath)))
        if os.path.isfile(path):  # as stock: a full checkpoint file under the name is replaced
            os.unlink(path)
        converted = {key: checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        meta = b""
        if strategy.global_rank == 0:
            import torch

            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            meta = buf.getvalue()
        plugin.save_sharded(converted, path, {_METADATA_FILENAME: meta} if meta else {})
        return None

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = os.fspath(strategy.broadcast(checkpoint_path))
        plugin.wait_for_path(os.path.abspath(path))
        from fp_core.parallel import dcp as fp_dcp

        if os.path.isfile(path) and "ModelParallelStrategy" in _class_names(strategy):
            loaded = _load_file(strategy, plugin, path, weights_only)
            if loaded is not None:
                return loaded
        if not fp_dcp.is_checkpoint_dir(path):  # a file, or a directory stock DCP wrote
            return stock_load(checkpoint_path, weights_only)
        if plugin.verify:
            fp_dcp.verify_extra_files(path)
        with _reads_through_fastpersist(strategy, verify=plugin.verify):
            return stock_load(checkpoint_path, weights_only)

    def lightning_module_state_dict() -> dict[str, Any]:
        if not file_mode(strategy):
            return stock_module_state()
        if _is_fsdp(strategy):
            if fsdp1_full_why(strategy) is not None:
                return stock_module_state()
            from fp_core.parallel.sharded_file import fsdp1_flat

            return fsdp1_flat.model_state(strategy.model)  # FlatShards: every rank writes its ranges
        # the DTensors themselves: every rank writes its own rows of the file (no gather)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(strategy.model)

    def optimizer_state(optimizer: Any) -> dict[str, Any]:
        if not file_mode(strategy):
            return stock_optimizer_state(optimizer)
        if _is_fsdp(strategy):
            if fsdp1_full_why(strategy) is not None:
                return stock_optimizer_state(optimizer)
            return _fsdp1_optimizer_state(strategy, optimizer)
        return _sharded_optimizer_state(strategy, optimizer)

    stock_teardown = type(strategy).teardown.__get__(strategy)

    def teardown() -> None:
        # ModelParallelStrategy.teardown does not tear its CheckpointIO down (it never used
        # it): the saves still pending on this rank are drained here.
        try:
            stock_teardown()
        finally:
            plugin.teardown()

    strategy.save_checkpoint = save_checkpoint
    strategy.load_checkpoint = load_checkpoint
    strategy.teardown = teardown
    if "ModelParallelStrategy" in _class_names(strategy) or _is_fsdp(strategy):
        strategy.lightning_module_state_dict = lightning_module_state_dict
        strategy.optimizer_state = optimizer_state
    strategy._fastpersist_sharded = plugin


def _sharded_optimizer_state(strategy: Any, optimizer: Any) -> dict[str, Any]:
    """The optimizer state stock ``ModelParallelStrategy.optimizer_state`` writes into a full
    checkpoint (keyed by parameter id, as ``FSDP.rekey_optim_state_dict`` keys it), with
    each state tensor left a DTensor, so no rank gathers it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
    state = get_optimizer_state_dict(strategy.model, optimizer, options=StateDictOptions(full_state_dict=False))
    try:
        from lightning.pytorch.strategies.model_parallel import _align_compiled_param_names_with_module
    except ImportError:  # pragma: no cover - pytorch_lightning only
        from pytorch_lightning.strategies.model_parallel import _align_compiled_param_names_with_module
    state = _align_compiled_param_names_with_module(state, strategy.model)
    return FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, strategy.model)


def _fsdp1_optimizer_state(strategy: Any, optimizer: Any) -> dict[str, Any]:
    """What stock ``FSDPStrategy.optimizer_state`` writes into a full checkpoint
    (``FSDP.optim_state_dict``'s full state, rekeyed by parameter id), each state tensor a
    FlatShard of this rank's range, so no rank gathers it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    from fp_core.parallel.sharded_file import fsdp1_flat

    model = strategy.model
    state = fsdp1_flat.optimizer_state(model, optimizer, group=model.process_group)
    return FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, model)


def _save_file(strategy: Any, plugin: Any, checkpoint: dict[str, Any], filepath: Any, stock_save: Any) -> None:
    """``ModelParallelStrategy(save_distributed_checkpoint=False)`` and
    ``FSDPStrategy(state_dict_type="full")``: every rank writes its own rows (DTensors) or
    flat-param ranges (FlatShards) of the one ``.ckpt`` file. Rank 0's loops, callbacks and schedulers are what the file
    holds (as stock, where rank 0 alone writes): they are sent to every rank first, so the
    ranks agree on the file's layout even where a callback's state differs between them."""
    path = strategy.broadcast(filepath)
    from fp_core import paths as fp_paths

    if fp_paths.is_remote(path) and _is_fsdp(strategy):
        # no file a rank can write its ranges into: stock's full state, gathered, to stock's path
        checkpoint["state_dict"] = type(strategy).lightning_module_state_dict(strategy)
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [type(strategy).optimizer_state(strategy, o) for o in strategy.optimizers]
        return stock_save(checkpoint, path, None)
    if fp_paths.is_remote(path):
        # no file a rank can write its rows into: the full state, gathered, goes to stock's path
        from fp_core.sharded import map_containers

        def full(x: Any) -> Any:
            return x.full_tensor() if hasattr(x, "full_tensor") else map_containers(x, full)

        checkpoint["state_dict"] = full(checkpoint["state_dict"])
        checkpoint["optimizer_states"] = full(checkpoint.get("optimizer_states", []))
        return stock_save(checkpoint, path, None)
    path = os.path.abspath(os.fspath(path))
    # rank 0 decides for all (another rank looking while rank 0 removes the directory could
    # see it half removed, and fail alone)
    is_dir = os.path.isdir(path)
    if strategy.broadcast(is_dir and not os.path.isfile(os.path.join(path, _METADATA_FILENAME))):
        raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
    if strategy.global_rank == 0:
        if is_dir:
            shutil.rmtree(path)  # as stock: a sharded checkpoint directory under the name is replaced
        os.makedirs(os.path.dirname(path), exist_ok=True)  # rank 0 creates the file (as stock, its directory)
    order = list(checkpoint)  # stock's key order, kept in the file
    tensors = {k: checkpoint.pop(k) for k in ("state_dict", "optimizer_states") if k in checkpoint}
    # rank 0's values, and on every rank a copy made by unpickling them: the ranks' pickles
    # of the file must agree byte for byte, and rank 0's own objects (tensors viewing larger
    # storages, objects shared between entries) pickle otherwise than a copy of them does
    rest = pickle.loads(pickle.dumps(strategy.broadcast(checkpoint)))
    ordered = {k: tensors[k] if k in tensors else rest[k] for k in order if k in tensors or k in rest}
    ordered.update({k: v for k, v in rest.items() if k not in ordered})
    plugin.save_file(ordered, path)


def _load_file(strategy: Any, plugin: Any, path: str, weights_only: bool | None) -> dict[str, Any] | None:
    """Fill ``ModelParallelStrategy``'s sharded model and optimizers from the full-state file
    ``path`` (FastPersist's or stock's): each rank reads only its own rows
    (``fp_core.load_into``). None where an optimizer does not hold exactly the model's
    parameters in the model's order (the file keys optimizer state by the parameter's place
    in the model, an optimizer by its place in the optimizer): stock's load rekeys that case."""
    import fp_core
    from fp_core.errors import NotAFastPersistCheckpoint

    model = strategy.model
    optimizers = list(strategy.optimizers)
    in_model = [id(p) for p in model.parameters()]
    for opt in optimizers:
        # the file's ids number the model's parameters, the optimizer's own its parameters
        if [id(p) for g in opt.param_groups for p in g["params"]] != in_model:
            return None
    import torch

    from fp_core.sharded import map_containers

    # The file's other entries (loops, callbacks, schedulers: small) are the target's too,
    # as load_into wants every entry that holds a tensor: their structure comes from a
    # mapped load, which reads the pickle and none of the model's or optimizer's bytes.
    mapped = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)

    def blank(x: Any) -> Any:
        return torch.empty_like(x) if isinstance(x, torch.Tensor) else map_containers(x, blank)

    target: dict[str, Any] = {k: blank(v) for k, v in mapped.items() if k not in ("state_dict", "optimizer_states")}
    del mapped
    target["state_dict"] = model
    if optimizers:
        target["optimizer_states"] = optimizers
    from fp_core import LoadIntoStats

    stats = LoadIntoStats()
    try:
        result = fp_core.load_into(target, path, verify=plugin.verify, weights_only=weights_only, stats=stats)
    except NotAFastPersistCheckpoint:  # written by stock Lightning: nothing to check against
        result = fp_core.load_into(target, path, verify=False, weights_only=weights_only, stats=stats)
    plugin.load_stats = stats
    result.pop("state_dict", None)  # as stock: the model's state is not handed on
    return result


def _fastpersist_plugin(io: Any, kind: type) -> Any:
    """``io`` itself, or the FastPersist plugin a wrapping ``CheckpointIO`` (Lightning's
    ``AsyncCheckpointIO``) holds; None for any other ``CheckpointIO``. Only stored attributes
    are read (no property of a user's class runs)."""
    for _ in range(3):
        if isinstance(io, kind):
            return io
        io = getattr(io, "__dict__", {}).get("_checkpoint_io")
    return None


def patch_strategy_class(strategy_cls: type, kind: type) -> None:
    """Make ``strategy_cls.checkpoint_io``'s setter (through which Lightning's Trainer hands
    every strategy its ``CheckpointIO``) call :func:`on_assigned` when the ``CheckpointIO``
    is a FastPersist plugin (an instance of ``kind``, or wrapped around one). Any other
    ``CheckpointIO`` is stored exactly as the stock setter stores it, and nothing else runs.
    Once per class and process (a lock; a second call finds the marked setter)."""
    with _patch_lock:
        prop = strategy_cls.__dict__.get("checkpoint_io")
        if not isinstance(prop, property) or prop.fset is None or getattr(prop.fset, "_fastpersist", None):
            return
        stock_set = prop.fset

        def fset(self: Any, io: Any) -> None:
            stock_set(self, io)
            plugin = _fastpersist_plugin(io, kind)
            if plugin is not None:
                on_assigned(self, plugin, strategy_cls)

        fset._fastpersist = True  # type: ignore[attr-defined]
        strategy_cls.checkpoint_io = property(prop.fget, fset, prop.fdel, prop.__doc__)


def on_assigned(strategy: Any, plugin: Any, base: type) -> None:
    """``plugin`` became ``strategy``'s ``CheckpointIO``: route its sharded saves
    (:func:`install`); a strategy that saves without its ``CheckpointIO`` and cannot be
    routed is watched, and its first save that never reaches the plugin warns."""
    if install(strategy, plugin):
        return
    names = _class_names(strategy)
    if "FSDPStrategy" in names or "ModelParallelStrategy" in names:
        return  # their full-state saves go to the CheckpointIO on rank 0
    if type(strategy).save_checkpoint is base.save_checkpoint:
        return  # the stock save: the CheckpointIO writes it
    with _patch_lock:
        if not isinstance(strategy.__dict__.get("save_checkpoint"), _Unrouted):
            strategy.save_checkpoint = _Unrouted(strategy, plugin)


class _Unrouted:
    """A strategy's own ``save_checkpoint``, watched: when it returns on global rank 0 and
    the plugin was not asked to save anything meanwhile, the checkpoint was written without
    FastPersist, which is said once (a ``FastPersistWarning`` naming the fix). A class, not
    a closure: a strategy is pickled with it for spawned processes."""

    def __init__(self, strategy: Any, plugin: Any) -> None:
        self.strategy = strategy
        self.plugin = plugin
        self.warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        before = self.plugin._save_calls
        out = type(self.strategy).save_checkpoint(self.strategy, *args, **kwargs)
        # Behind a wrapping CheckpointIO (AsyncCheckpointIO) the plugin may be called later,
        # on the wrapper's thread: only a plugin that is the strategy's own IO is judged.
        direct = self.strategy.__dict__.get("_checkpoint_io") is self.plugin
        if direct and not self.warned and self.plugin._save_calls == before \
                and getattr(self.strategy, "is_global_zero", True):
            self.warned = True
            from ._policy import FastPersistWarning

            name = type(self.strategy).__name__
            path = args[1] if len(args) > 1 else kwargs.get("filepath")
            fix = ("DeepSpeed writes its own checkpoint directory (its engine's save_checkpoint); for "
                   "FastPersist checkpoints use ModelParallelStrategy, FSDPStrategy or DDP"
                   if "DeepSpeedStrategy" in _class_names(self.strategy) else
                   f"make {name}.save_checkpoint hand the checkpoint to self.checkpoint_io.save_checkpoint "
                   "(as Lightning's Strategy.save_checkpoint does), or write it with fp_core.save there")
            warnings.warn(f"FastPersist: {name} saved checkpoint {path} itself, without its CheckpointIO: "
                          f"FastPersistIO did not write it (not atomic, not checksummed by FastPersist). "
                          f"Fix: {fix}.", FastPersistWarning, stacklevel=2)
        return out


@contextlib.contextmanager
def _reads_through_fastpersist(strategy: Any, verify: bool) -> Iterator[None]:
    """Lightning's sharded loads call ``_distributed_checkpoint_load(state, path)`` (stock
    DCP reads) from the strategy modules; for this load, they read with FastPersistReader."""
    import torch.distributed.checkpoint as dcp

    from fp_core.parallel.dcp import FastPersistReader

    def load(state: dict[str, Any], path: Any) -> None:
        dcp.load(state, storage_reader=FastPersistReader(path, verify=verify))

    modules = [sys.modules.get(type(strategy).__module__), sys.modules.get("lightning.fabric.strategies.model_parallel"),
               sys.modules.get("lightning_fabric.strategies.model_parallel")]
    with _patch_lock:
        saved = []
        for m in modules:
            if m is not None and hasattr(m, "_distributed_checkpoint_load"):
                saved.append((m, m._distributed_checkpoint_load))
                m._distributed_checkpoint_load = load
        try:
            yield
        finally:
            for m, fn in saved:
                m._distributed_checkpoint_load = fn


__all__ = ["file_mode", "fsdp1_full_why", "install", "on_assigned", "patch_strategy_class", "sharded_state_key"]
