"""Lightning's sharded strategies on FastPersist: ``ModelParallelStrategy`` and
``FSDPStrategy(state_dict_type="sharded")``.

Those strategies never hand a sharded checkpoint to the ``CheckpointIO``: every rank calls
``torch.distributed.checkpoint.save`` with DCP's stock writer itself, then rank 0 writes
``meta.pt`` into the directory (so a crash in between leaves a directory without it).
``FastPersistCallback.setup`` routes them through the plugin instead (:func:`install`):

* ``save_checkpoint``: the same directory (``__<rank>_0.distcp`` files, ``.metadata``,
  ``meta.pt``), written by every rank through ``fp_core.AsyncCheckpointer`` (the DTensor
  state becomes an ``fp_core.dcp_save.DcpSave`` job): in the background while training
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
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

_METADATA_FILENAME = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
_patch_lock = threading.RLock()


def sharded_state_key(strategy: Any) -> str | None:
    """The key Lightning saves the model's sharded state under, or None when ``strategy``
    does not save sharded checkpoints through DCP."""
    names = {c.__name__ for c in type(strategy).__mro__}
    if "ModelParallelStrategy" in names and getattr(strategy, "_save_distributed_checkpoint", False):
        return "state_dict"
    if "FSDPStrategy" in names and getattr(strategy, "_state_dict_type", None) == "sharded":
        return "model"
    return None


def install(strategy: Any, plugin: Any) -> bool:
    """Route ``strategy``'s sharded saves and loads through ``plugin`` (a FastPersist
    ``CheckpointIO``); True when ``strategy`` is one that saves sharded checkpoints."""
    if sharded_state_key(strategy) is None:
        return False
    if getattr(strategy, "_fastpersist_sharded", None) is plugin:
        return True
    stock_save = type(strategy).save_checkpoint.__get__(strategy)
    stock_load = type(strategy).load_checkpoint.__get__(strategy)

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        key = sharded_state_key(strategy)
        if key is None or storage_options is not None:  # stock's own answer (a TypeError for the latter)
            return stock_save(checkpoint, filepath, storage_options)
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
        from fp_core import dcp as fp_dcp

        if not fp_dcp.is_checkpoint_dir(path):  # a file, or a directory stock DCP wrote
            return stock_load(checkpoint_path, weights_only)
        if plugin.verify:
            fp_dcp.verify_extra_files(path)
        with _reads_through_fastpersist(strategy, verify=plugin.verify):
            return stock_load(checkpoint_path, weights_only)

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
    strategy._fastpersist_sharded = plugin
    return True


@contextlib.contextmanager
def _reads_through_fastpersist(strategy: Any, verify: bool) -> Iterator[None]:
    """Lightning's sharded loads call ``_distributed_checkpoint_load(state, path)`` (stock
    DCP reads) from the strategy modules; for this load, they read with FastPersistReader."""
    import torch.distributed.checkpoint as dcp

    from fp_core.dcp import FastPersistReader

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


__all__ = ["install", "sharded_state_key"]
