"""Is a state sharded (does it hold DTensors or ShardedTensors)? Asked of every save, so it
imports nothing: a state can hold a DTensor only once ``torch.distributed.tensor`` is
imported (importing it costs most of a second), a ShardedTensor only once its module is."""

from __future__ import annotations

import sys
from typing import Any

_DTENSOR_MODULE = "torch.distributed.tensor"
_SHARDED_TENSOR_MODULE = "torch.distributed._shard.sharded_tensor"


def dtensor_type() -> type | None:
    """``DTensor``, when its module has been imported (else no DTensor exists)."""
    return getattr(sys.modules.get(_DTENSOR_MODULE), "DTensor", None)


def sharded_tensor_type() -> type | None:
    """``ShardedTensor``, when its module has been imported."""
    return getattr(sys.modules.get(_SHARDED_TENSOR_MODULE), "ShardedTensor", None)


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


def is_sharded(obj: Any) -> bool:
    """Does ``obj`` hold a ``DTensor`` or ``ShardedTensor`` (so that only DCP can save it)?"""
    return _holds(obj, tuple(t for t in (dtensor_type(), sharded_tensor_type()) if t is not None))


def has_sharded_tensor(obj: Any) -> bool:
    """Does ``obj`` hold a ``ShardedTensor`` (FSDP1's sharded state: saved by ``dcp.save``
    with :class:`fp_core.dcp.FastPersistWriter`, not by the async pipeline)?"""
    kind = sharded_tensor_type()
    return kind is not None and _holds(obj, (kind,))


__all__ = ["is_sharded", "has_sharded_tensor", "dtensor_type", "sharded_tensor_type"]
