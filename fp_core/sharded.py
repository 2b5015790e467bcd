"""Is a state sharded (does it hold DTensors or ShardedTensors)? Asked of every save, so it
imports nothing: a state can hold a DTensor only once ``torch.distributed.tensor`` is
imported (importing it costs most of a second), a ShardedTensor only once its module is.
Also the walk over a state's containers that the sharded paths share (``map_containers``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

_DTENSOR_MODULE = "torch.distributed.tensor"
_SHARDED_TENSOR_MODULE = "torch.distributed._shard.sharded_tensor"
_FLAT_SHARD_MODULE = "fp_core.format.flat_shard"


def dtensor_type() -> type | None:
    """``DTensor``, when its module has been imported (else no DTensor exists)."""
    return getattr(sys.modules.get(_DTENSOR_MODULE), "DTensor", None)


def sharded_tensor_type() -> type | None:
    """``ShardedTensor``, when its module has been imported."""
    return getattr(sys.modules.get(_SHARDED_TENSOR_MODULE), "ShardedTensor", None)


def flat_shard_type() -> type | None:
    """``FlatShard`` (a rank's element range of a tensor: FSDP1's flat parameters), when
    its module has been imported."""
    return getattr(sys.modules.get(_FLAT_SHARD_MODULE), "FlatShard", None)


def _holds(obj: Any, kinds: tuple[type, ...]) -> bool:
    stack, seen = [obj], 0
    while kinds and stack and seen < 1_000_000:
        o = stack.pop()
        seen += 1
        if isinstance(o, kinds):
            return True
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return False


def map_containers(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to the values of its dicts, lists and tuples (named tuples
    and dict subclasses keep their type where it can be rebuilt, else become dict/tuple; a
    dict subclass keeps its attributes: a state dict's ``_metadata``, module versions)."""
    if isinstance(obj, dict):
        items = {k: fn(v) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            out = type(obj)(items)
        except Exception:  # noqa: BLE001 - a mapping with another constructor (defaultdict...)
            return items
        attrs = getattr(obj, "__dict__", None)
        if attrs:
            out.__dict__.update(attrs)
        return out
    if isinstance(obj, list):
        return [fn(v) for v in obj]
    if isinstance(obj, tuple):
        values = [fn(v) for v in obj]
        if hasattr(obj, "_fields"):
            try:
                return type(obj)(*values)
            except Exception:  # noqa: BLE001
                return tuple(values)
        return tuple(values)
    return obj


def is_sharded(obj: Any) -> bool:
    """Does ``obj`` hold a ``DTensor``, ``ShardedTensor`` or ``FlatShard`` (saved by every
    rank of its group: a DCP directory, or one file with ``layout="file"``)?"""
    kinds = (dtensor_type(), sharded_tensor_type(), flat_shard_type())
    return _holds(obj, tuple(t for t in kinds if t is not None))


def has_sharded_tensor(obj: Any) -> bool:
    """Does ``obj`` hold a ``ShardedTensor`` (FSDP1's sharded state: saved by ``dcp.save``
    with :class:`fp_core.parallel.dcp.FastPersistWriter`, not by the async pipeline)?"""
    kind = sharded_tensor_type()
    return kind is not None and _holds(obj, (kind,))


def has_flat_shard(obj: Any) -> bool:
    """Does ``obj`` hold a ``FlatShard`` (saved only as one file, ``layout="file"``)?"""
    kind = flat_shard_type()
    return kind is not None and _holds(obj, (kind,))


__all__ = ["is_sharded", "has_flat_shard", "has_sharded_tensor", "dtensor_type", "sharded_tensor_type", "flat_shard_type",
           "map_containers"]
