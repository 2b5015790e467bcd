"""FSDP1's full state (what ``FULL_STATE_DICT`` gathers) made on every rank from its own
``flat_param`` shards, as :class:`~fp_core.format.flat_shard.FlatShard` s: no gather.

Each FSDP1 ``FlatParameter`` shard holds, for each original parameter ``i``, elements
``[intra_param_start_idx, intra_param_end_idx]`` of that parameter's flattened form at
``offset_in_shard`` (``flat_param._shard_param_infos[i]``). So each parameter of the full
state dict is a FlatShard of this rank's piece, and each positive-dimensional optimizer
state of it (Adam's ``exp_avg``, ``exp_avg_sq``) too: with ``use_orig_params=True`` the
optimizer holds a 1-D state per original parameter, of this rank's piece; without it one
per ``FlatParameter``, cut by the same infos. Saved with ``layout="file"``
(:mod:`fp_core.parallel.sharded_file`), every rank writes its pieces into the one file
``FULL_STATE_DICT`` + ``FSDP.optim_state_dict`` would give, and plain ``torch.load`` reads
full tensors back.

The structure follows FSDP's own: the model's keys in ``state_dict()``'s order (each
module's parameters, then its persistent buffers, then its children; FSDP's wrapper names
removed), the optimizer state keyed by parameter name, ordered as
``FSDP.optim_state_dict`` orders it, its ``param_groups`` with parameter names. Buffers,
step counters and hyperparameters are plain tensors or values, the same on every rank (the
save splits their bytes among the ranks). The ranks exchange only metadata: which state
keys each parameter has, the dtypes, and the zero-dimensional values (step counters), so
a rank learns the step of a parameter whose elements it does not hold.

:func:`unsupported` says where this does not apply (the caller then gathers as stock does).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from ..format.flat_shard import FlatShard


def _fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m for m in model.modules() if isinstance(m, FSDP)]


def _handles(model: torch.nn.Module) -> list[Any]:
    return [m._handle for m in _fsdp_modules(model) if getattr(m, "_handle", None) is not None]


def unsupported(model: torch.nn.Module, optimizers: list[Any] = ()) -> str | None:
    """Why ``model`` (an FSDP1 root) and ``optimizers`` cannot be saved from their flat
    shards (None: they can): not FSDP1, replicated or hybrid sharding, parameters offloaded
    to the CPU, mixed precision (the saved dtypes are not the shards'), parameters shared
    between modules, modules with extra state, or an optimizer holding parameters FSDP does
    not manage."""
    from torch.distributed.fsdp import ShardingStrategy

    fsdp = _fsdp_modules(model)
    if not fsdp:
        return "the model is not wrapped in FSDP1's FullyShardedDataParallel"
    world = dist.get_world_size(fsdp[0].process_group) if dist.is_initialized() else 1
    for m in fsdp:
        handle = getattr(m, "_handle", None)
        strategy = m.sharding_strategy
        if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            return f"sharding strategy {strategy.name} (replicated shards)"
        if handle is not None and not handle.uses_sharded_strategy and world > 1:
            return f"sharding strategy {strategy.name} (every rank holds every parameter)"
        if m.cpu_offload.offload_params:
            return "CPU offload of the parameters"
        # Mixed precision whose dtypes are the originals' (Lightning's "32-true" sets float32
        # throughout) changes nothing saved; another param or buffer dtype does: the full
        # state holds the originals' dtypes, the shards or live buffers not
        if handle is not None and handle._uses_param_mixed_precision:
            return "mixed precision of the parameters (the full state's dtypes are not the shards')"
        bd = m.mixed_precision.buffer_dtype
        if bd is not None and any(dt.is_floating_point and dt != bd
                                  for dt in getattr(m, "_buffer_name_to_orig_dtype", {}).values()):
            return f"mixed precision of the buffers ({bd}: the full state holds their original dtypes)"
        if handle is not None and handle.flat_param._shared_param_infos:
            return "parameters shared between modules"
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    base = torch.nn.Module
    for mod in model.modules():
        if type(mod).get_extra_state is not base.get_extra_state:
            return f"module {type(mod).__name__} has extra state"
        if isinstance(mod, FSDP):  # its own state-dict hooks are FSDP's
            continue
        # state a module puts into its state dict itself (torchmetrics' metrics, custom
        # modules) is not in the parameters and buffers the flat shards are built from
        if (type(mod).state_dict is not base.state_dict or type(mod)._save_to_state_dict is not base._save_to_state_dict
                or mod._state_dict_hooks or mod._state_dict_pre_hooks):
            return f"module {type(mod).__name__} makes its own state dict (state_dict, _save_to_state_dict or hooks)"
    managed = {id(p) for h in _handles(model) for p in ([h.flat_param] + list(h.flat_param._params or []))}
    for opt in optimizers:
        for g in opt.param_groups:
            if any(id(p) not in managed for p in g["params"]):
                return f"{type(opt).__name__} holds parameters FSDP does not manage"
    return None


def _clean(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def _piece(flat: torch.Tensor, info: Any, shape: torch.Size) -> FlatShard:
    """Parameter ``info``'s elements in this rank's flat shard ``flat`` (1-D) as a FlatShard
    of the full parameter's ``shape``; an empty one where this rank holds none of it."""
    if not info.in_shard:
        return FlatShard(flat[:0], shape, 0)
    piece = flat[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
    return FlatShard(piece, shape, info.intra_param_start_idx)


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The full state dict of the FSDP1 ``model`` (the keys and order ``FULL_STATE_DICT``
    gives), every FSDP-managed parameter a FlatShard of this rank's piece, buffers and
    other parameters plain tensors on the CPU (the file holds CPU tensors, as
    ``FULL_STATE_DICT`` with ``offload_to_cpu``, Lightning's, gives them)."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    where: dict[tuple[int, str], tuple[Any, int]] = {}  # (module, name) -> (flat_param, index)
    for h in _handles(model):
        fp = h.flat_param
        for i, pi in enumerate(fp._param_infos):
            where[(id(pi.module), pi.param_name)] = (fp, i)
    out: dict[str, Any] = OrderedDict()  # as nn.Module.state_dict() returns it
    fsdp = _fsdp_modules(model)
    first = not dist.is_initialized() or not fsdp or dist.get_rank(fsdp[0].process_group) == 0

    def whole(t: torch.Tensor) -> FlatShard:
        # rank 0's copy, as stock's gather writes it: FSDP never syncs buffers, so the ranks'
        # may differ, and a replicated split would mix their bytes
        flat = t.detach().cpu().reshape(-1)
        return FlatShard(flat if first else flat[:0], t.shape, 0)

    def visit(module: torch.nn.Module, prefix: str) -> None:
        names = [n for n, p in module._parameters.items() if p is not None and not isinstance(p, FlatParameter)]
        # use_orig_params=False: the managed parameters are not registered while sharded;
        # FULL_STATE_DICT registers them again after the module's other parameters
        names += [n for (mid, n) in where if mid == id(module) and n not in names]
        for n in names:
            hit = where.get((id(module), n))
            if hit is None:
                out[_clean(prefix + n)] = whole(module._parameters[n])
            else:
                fp, i = hit
                out[_clean(prefix + n)] = _piece(fp.detach(), fp._shard_param_infos[i], fp._shapes[i])
        for n, b in module._buffers.items():
            if b is not None and n not in module._non_persistent_buffers_set:
                out[_clean(prefix + n)] = whole(b)
        for n, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{n}.")

    visit(model, "")
    # nn.Module.state_dict's record of each module's version (load_state_dict passes it to
    # the modules' loaders), under the modules' own names, FSDP's wrappers included
    out._metadata = OrderedDict(  # type: ignore[attr-defined]
        (name, {} if m._version is None else {"version": m._version}) for name, m in model.named_modules())
    return out


def _meta(state: dict[str, Any]) -> list[tuple[str, Any]]:
    """What the other ranks need of one parameter's optimizer state: each key, and for a
    tensor its dtype (positive-dimensional: a piece) or its value (zero-dimensional)."""
    out: list[tuple[str, Any]] = []
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out.append((k, ("piece", v.dtype) if v.dim() else ("scalar", v.dtype, v.item())))
        else:
            out.append((k, ("value", v)))
    return out


def optimizer_state(model: torch.nn.Module, optimizer: Any, group: Any = None) -> dict[str, Any]:
    """``FSDP.optim_state_dict(model, optimizer)``'s full state (keyed by parameter name),
    each positive-dimensional state tensor a FlatShard of this rank's piece. Every rank of
    ``group`` (the model's) calls it: the ranks exchange each parameter's state keys and
    zero-dimensional values (metadata, no tensor data)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
    fsdp = _fsdp_modules(model)
    handles = _handles(model)
    by_flat = {id(h.flat_param): h.flat_param for h in handles}
    by_orig: dict[int, tuple[Any, int]] = {}
    for h in handles:
        for i, p in enumerate(h.flat_param._params or []):
            by_orig[id(p)] = (h.flat_param, i)
    names = {}  # (flat_param, index) -> global name
    unit_of: dict[str, int] = {}
    units = {id(m) for m in fsdp}  # by identity: a module's __eq__ may be anything (torchmetrics)
    prefix_of = {id(m._handle.flat_param): name for name, m in model.named_modules()
                 if id(m) in units and m._handle is not None}
    for h in handles:
        fp = h.flat_param
        prefix = prefix_of.get(id(fp), "")
        for i, local in enumerate(fp._fqns):
            name = _clean(f"{prefix}.{local}" if prefix else local)
            names[(id(fp), i)] = name
            unit_of[name] = id(fp)
    use_orig = any(h._use_orig_params for h in handles)

    # This rank's pieces and metadata by parameter name, in the optimizer's order.
    order: list[str] = []
    local: dict[str, dict[str, Any]] = {}
    where: dict[str, tuple[Any, int]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            state = optimizer.state.get(p, {})
            if use_orig:
                fp, i = by_orig[id(p)]
                name = names[(id(fp), i)]
                order.append(name)
                where[name] = (fp, i)
                local[name] = dict(state)
                continue
            fp = by_flat[id(p)]
            for i in range(len(fp._fqns)):
                name = names[(id(fp), i)]
                order.append(name)
                where[name] = (fp, i)
                info = fp._shard_param_infos[i]
                cut = {}
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim():
                        v = v[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard] \
                            if info.in_shard else v[:0]
                    cut[k] = v
                local[name] = cut
    # only where this rank holds a piece of the parameter: an optimizer that makes its state
    # up front (Adagrad) has a step of 0 for a parameter with no elements here (as FSDP's
    # own gather skips such ranks)
    mine = {n: _meta(s) for n, s in local.items() if s and where[n][0]._shard_param_infos[where[n][1]].in_shard}
    world = dist.get_world_size(group)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    merged: dict[str, list[tuple[str, Any]]] = {}
    for ranks_meta in every:
        for n, m in ranks_meta.items():
            merged.setdefault(n, m)

    if use_orig:
        # FSDP.optim_state_dict: the names sorted, then grouped by FlatParameter in the order
        # each first appears
        groups: dict[int, list[str]] = {}
        for n in sorted(merged):
            groups.setdefault(unit_of[n], []).append(n)
        keys = [n for names_ in groups.values() for n in names_]
    else:
        keys = [n for n in order if n in merged]
    state_out: dict[str, Any] = {}
    for n in keys:
        fp, i = where[n]
        info, shape = fp._shard_param_infos[i], fp._shapes[i]
        mine_n = local.get(n, {})
        entry: dict[str, Any] = {}
        metas = merged[n]
        if not use_orig:  # unflattened as FSDP does: tensors, then 0-d tensors, then values, each by name
            metas = sorted(metas, key=lambda km: (("piece", "scalar", "value").index(km[1][0]), km[0]))
        else:  # gathered as FSDP does (_allgather_state_info): values, 0-d tensors, tensors, each by name
            metas = sorted(metas, key=lambda km: (("value", "scalar", "piece").index(km[1][0]), km[0]))
        for k, m in metas:
            if m[0] == "piece":
                v = mine_n.get(k)
                if v is None or not info.in_shard:
                    entry[k] = FlatShard(torch.empty(0, dtype=m[1]), shape, 0)
                else:
                    entry[k] = FlatShard(v.detach().reshape(-1), shape, info.intra_param_start_idx)
            elif m[0] == "scalar":  # the first holder's value on every rank: one layout, one value
                entry[k] = torch.tensor(m[2], dtype=m[1])
            else:
                entry[k] = copy.deepcopy(m[1])
        state_out[n] = entry

    groups_out = []
    for g in optimizer.param_groups:
        packed = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
        params: list[str] = []
        for p in g["params"]:
            if use_orig:
                fp, i = by_orig[id(p)]
                params.append(names[(id(fp), i)])
            else:
                fp = by_flat[id(p)]
                params += [names[(id(fp), i)] for i in range(len(fp._fqns))]
        packed["params"] = params
        groups_out.append(packed)
    return {"state": state_out, "param_groups": groups_out}


__all__ = ["model_state", "optimizer_state", "unsupported"]
