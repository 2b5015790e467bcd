"""The entry point: ``save``, ``load``, ``verify``, ``inspect``, and ``prepare``.

Every path is routed here, once: a local file, a remote fsspec URL (through the remote
tier), a file written by many ranks together, or per-rank files. :func:`prepare` turns a
save into a :class:`~fp_core.saving.job.SaveJob` that ``save`` runs at once and
``AsyncCheckpointer`` runs in the background. ``loader`` and ``integrity`` know local
files only.
"""

from __future__ import annotations

import os
from typing import Any

from . import paths
from .gc_pause import gc_paused
from .io.engine import EngineOptions
from .loading import integrity, loader
from .saving.job import SaveJob
from .saving.local import LocalSave
from .sharded import is_sharded
from .stats import SaveStats

# A synchronous save of at most this many bytes (a few seconds of writing) runs whole with
# the garbage collector paused, its write included: the early write's books (engine rows,
# checksum pieces) allocate on a thread while the disk writes, and a full collection there
# (tens of milliseconds over a large process) lands on the save's critical path. A larger
# save is paused only while it is serialised, so that cycles other threads make are not
# held for longer.
GC_PAUSED_SAVE_BYTES = 16 << 30


def prepare(obj: Any, path: str | os.PathLike, options: EngineOptions | None = None, *, format: str = "torch",
            metadata: dict[str, str] | None = None, group: Any = None, topology: Any = "replica",
            timeout_s: float | None = None, congruent: bool = False, storage_options: dict | None = None,
            keep_local: bool = False, extra_files: dict[str, bytes] | None = None,
            early_write: bool = False, layout: str | None = None) -> SaveJob:
    """Prepare the save of ``obj`` to ``path`` (pickled now: its structure is fixed); the
    returned job writes and commits it when run.

    ``group``: a collective save with the other ranks of that torch.distributed group.
    ``congruent``: lay local CPU tensors out congruent to their addresses, so they can be
    written without staging (the async pipeline's layout). ``early_write``: a local save
    that is run at once may start writing its storages while it is prepared
    (:mod:`fp_core.saving.early_write`).
    A state holding ``DTensor`` s (FSDP2, tensor parallel) is a sharded checkpoint: ``path``
    is a directory every rank of ``group`` (default: all) writes through DCP
    (:mod:`fp_core.parallel.dcp_save`), with ``extra_files`` (``{name: bytes}``) beside its shards;
    with ``layout="file"``, ``path`` is one ``torch.save`` file of the full state (with
    ``format="safetensors"``: one safetensors file of a flat ``{name: DTensor or tensor}``
    dict, ``metadata`` in its header) that every rank writes its own shards into
    (:mod:`fp_core.parallel.sharded_file`); FSDP1's ``ShardedTensor`` state (``ChunkShardingSpec``
    on dim 0) too, in the torch format.
    """
    options = options or EngineOptions()
    is_remote, p = paths.split(path)
    if layout not in (None, "dcp", "file"):
        raise ValueError(f"layout must be 'dcp' or 'file', not {layout!r}")
    if layout == "file" and is_sharded(obj):
        from .parallel.distributed import DEFAULT_TIMEOUT_S
        from .parallel.sharded_file import ShardedFileSave

        if is_remote:
            raise ValueError(f"layout=\"file\" saves to a remote URL ({p}) are not supported: save to a shared "
                             "local path, then upload it")
        if format not in ("torch", "safetensors") or extra_files:
            raise ValueError(f"{p}: layout=\"file\" writes one file, format='torch' or 'safetensors' (not "
                             f"{format!r}), no extra_files")
        return ShardedFileSave(obj, p, group, options=options, format=format, metadata=metadata,
                               timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    if layout == "dcp" and not is_sharded(obj):
        raise ValueError(f"{p}: layout=\"dcp\" is for sharded (DTensor) state; this state holds none")
    if is_sharded(obj):
        from .parallel.dcp_save import DcpSave

        if is_remote:
            raise ValueError(f"sharded checkpoints to a remote URL ({p}) are not supported: save to a local "
                             "directory, then upload it")
        if format != "torch":
            raise ValueError("a sharded checkpoint is a torch.distributed.checkpoint directory: format='torch'")
        from .parallel.distributed import DEFAULT_TIMEOUT_S

        return DcpSave(obj, p, group, options=options, extra_files=extra_files,
                       timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    if extra_files:
        raise ValueError("extra_files go with sharded (DTensor) checkpoints only")
    if is_remote:
        if group is not None:
            raise ValueError(f"collective saves to a remote URL ({p}) are not supported: save to a shared "
                             "local path, then upload it with fp_core.remote.upload_file on one rank")
        from .remote import RemoteSave

        return RemoteSave(obj, p, options, format, metadata, storage_options, keep_local)
    if group is not None:
        from .parallel.distributed import DEFAULT_TIMEOUT_S, CollectiveSave

        if format != "torch":
            raise ValueError("collective saves write the torch format")
        return CollectiveSave(obj, p, group, topology=topology, options=options,
                              timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    return LocalSave(obj, p, options, format, metadata, congruent=congruent, early_write=early_write)


def save(obj: Any, path: str | os.PathLike, *, format: str = "torch", metadata: dict[str, str] | None = None,
         group: Any = None, topology: Any = "replica", sharded: bool = False, timeout_s: float | None = None,
         storage_options: dict | None = None, keep_local: bool = False,
         extra_files: dict[str, bytes] | None = None, layout: str | None = None, **options: Any) -> SaveStats:
    """Write ``obj`` to ``path`` fast, atomically and durably; return the save's stats.

    ``format="torch"`` (default) writes a standard torch.save zip: ``torch.load(path)``
    returns an object equal to ``obj``, and a CRC-32C manifest inside it lets ``verify``
    check every byte. ``format="safetensors"`` writes a flat ``{name: tensor}`` dict as a
    safetensors file (``metadata`` goes in its header), as ``from_pretrained`` expects.

    Returns once the file is durable (data fdatasync'ed, renamed, directory fsync'ed). On
    any error nothing new is left under ``path`` and no temporary file remains.

    Engine options: ``backend`` ("auto" | "io_uring" | "threadpool" | "buffered"),
    ``queue_depth``, ``chunk_bytes``, ``copy_threads``, ``io_threads``.

    Collective saves (every rank of ``group``, a torch.distributed process group, calls
    this): ranks holding the same state write one file together, each a near-equal byte
    range (``topology``: "replica" = every rank, "node" = one per host, an int k = k per
    host, or a list of ranks); ``sharded=True`` when each rank holds different state and
    writes its own ``path``, all-or-nothing. See :mod:`fp_core.parallel.distributed`.

    Remote fsspec URLs (``s3://``, ``memory://``...) are staged locally, committed and
    uploaded before this returns (options ``storage_options=``, ``keep_local=``); see
    :mod:`fp_core.remote`. ``file://`` URLs are local paths.

    Sharded state (``DTensor`` s: FSDP2, tensor parallel; every rank calls this): ``path``
    is a checkpoint directory written through ``torch.distributed.checkpoint`` on the
    native engine, atomically, that stock ``dcp.load`` reads (see :mod:`fp_core.parallel.dcp`);
    ``extra_files`` (``{name: bytes}``) are written into it, checksummed. ``layout="file"``
    instead: ``path`` is one ``torch.save`` file of the full state (each DTensor, or FSDP1
    ``ShardedTensor`` chunked on dim 0, a plain tensor of its global shape, the keys
    unchanged) that every rank writes its own ``Shard(0)`` rows into, with no gather; ``Replicate()`` and plain tensors are split
    among their holders. With ``format="safetensors"`` and ``layout="file"``, a flat
    ``{name: DTensor or tensor}`` dict (a model's state dict under FSDP2's ``fully_shard``)
    is written the same way as one safetensors file of the full tensors, ``metadata`` in
    its header, as ``from_pretrained`` reads it; one tensor under two names (tied weights)
    is refused: drop the duplicate first, as ``save_pretrained`` does. Tensor parallel's
    ``Shard(d)`` and FSDP2 x TP's ``_StridedShard`` (any mesh) are written too, each local
    shard as the runs of the full tensor's bytes it holds; ``Partial`` is refused on every
    rank before anything is created (see :mod:`fp_core.parallel.sharded_file`).
    """
    opts, rest = EngineOptions.pick(dict(options))
    if rest:
        raise TypeError(f"fp_core.save got unknown options {sorted(rest)}")
    if sharded:
        if paths.is_remote(path):
            raise ValueError(f"sharded saves to a remote URL ({paths.split(path)[1]}) are not supported")
        if format != "torch":
            raise ValueError("collective saves write the torch format")
        from .parallel.distributed import DEFAULT_TIMEOUT_S, save_sharded

        return save_sharded(obj, path, group, options=opts,
                            timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    with gc_paused():
        job = prepare(obj, path, opts, format=format, metadata=metadata, group=group, topology=topology,
                      timeout_s=timeout_s, storage_options=storage_options, keep_local=keep_local,
                      extra_files=extra_files, early_write=True, layout=layout)
        plan = getattr(job, "plan", None)
        if plan is not None and plan.file_size <= GC_PAUSED_SAVE_BYTES:
            # Written within the pause too, and dropped before it ends: the plan's objects
            # are freed before the collector ever sees them (no young collection of all of them).
            stats = job.run()
            del job, plan
            return stats
    return job.run()


def load(path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None,
         verify: bool | str = False, *, mmap: bool = False, storage_options: dict | None = None,
         keep_local: bool = False) -> Any:
    """``torch.load`` of ``path`` through the fast reader (see :func:`fp_core.loading.loader.load`).

    ``verify=True`` checks every byte against the manifest while loading (raising
    :class:`CorruptCheckpointError` naming the damaged record); ``verify="auto"`` does so
    when the file has one and loads a file written by another tool unchecked. A remote
    fsspec URL is fetched into local staging (or found in the ``keep_local`` cache) and
    loaded from there; ``storage_options`` go to fsspec. See :mod:`fp_core.remote`.

    ``mmap=True``: as with ``torch.load(mmap=True)``, the tensors stay mapped on the file
    (copy-on-write), read in at the disk's speed before the call returns; the file must not
    be truncated or rewritten in place while they live.

    Where a process writer with ``resume_from_memory`` left the file's image in shared
    memory (``AsyncCheckpointer(writer="process")``) and the file is still the one it
    wrote, the image is read instead of the disk, every byte checked against the file's
    checksums; a failing image falls back to the disk (not with ``mmap``).
    """
    is_remote, p = paths.split(path)
    if is_remote:
        from . import remote

        return remote.load(p, map_location=map_location, weights_only=weights_only, verify=verify, mmap=mmap,
                           storage_options=storage_options, keep_local=keep_local)
    image = _memory_image(p)
    if image is not None:
        from .io.memory_image import frozen

        # The tensors are built on a mapping of the image where nobody writes into it again
        # (its trainer is gone: no later snapshot lands in it); else on a copy.
        mapped = frozen(image)
        if mmap and not mapped:
            image = None  # a mapping of an arena its trainer still fills: the disk file instead
    if image is not None:
        try:
            return _from_memory(p, image, lambda: loader.load(image, map_location=map_location,
                                                              weights_only=weights_only, verify=True,
                                                              mmap=mapped))
        except _MemoryImageFailed:
            pass
    return loader.load(p, map_location=map_location, weights_only=weights_only, verify=verify, mmap=mmap)


class _MemoryImageFailed(Exception):
    pass


def _memory_image(path: str) -> str | None:
    """The shared-memory image of the checkpoint file ``path`` that a process writer with
    ``resume_from_memory`` left (:mod:`fp_core.io.memory_image`), while it holds that file."""
    from .io import memory_image

    return memory_image.find(path)


def _from_memory(path: str, image: str, read: Any) -> Any:
    """``read()`` from the image (checked against every checksum); on any failure the
    caller reads the disk instead."""
    import logging

    log = logging.getLogger("fastpersist")
    try:
        out = read()
    except Exception as e:  # noqa: BLE001 - the file on disk is the reference: read it instead
        log.warning("fastpersist: the shared-memory image of %s failed (%s: %s); loading from disk",
                    path, type(e).__name__, e)
        raise _MemoryImageFailed from e
    log.info("fastpersist: %s loaded from its shared-memory image %s (every byte checked)", path, image)
    from .io import memory_image

    memory_image.hits += 1
    memory_image.loaded.add(image)
    return out


def load_into(target: Any, path: str | os.PathLike, *, verify: bool = False, weights_only: bool | None = True,
              storage_options: dict | None = None, keep_local: bool = False, stats: Any = None) -> Any:
    """Resume from the checkpoint at ``path``: ``target``'s tensors are filled in place, each
    one's bytes read straight into its memory; returns the saved object (what
    ``torch.load`` returns, with the target's tensors in it). ``target`` may hold the
    model, optimizer and scheduler themselves (``{"model": model, "optim": optimizer}``):
    each is then handed the file's state by its own ``load_state_dict`` (the file's lr,
    not the live one), and a fresh optimizer's state is created from the file. See
    :func:`fp_core.loading.load_in_place.load_into`. A remote URL is fetched into local staging
    first. DTensors (FSDP2, HSDP; any number of ranks) are filled from one file of the full
    state, each rank reading only its own rows. ``stats``: a
    :class:`fp_core.loading.sharded_load.LoadIntoStats` filled with the bytes read. As :func:`load`,
    a shared-memory image of the file is read instead of the disk where one holds it."""
    from .loading.load_in_place import load_into as fill

    is_remote, p = paths.split(path)
    if is_remote:
        from . import remote

        with remote.fetch(p, storage_options=storage_options, keep_local=keep_local) as local, \
                remote.named_by_url(p, local):
            return fill(target, local, verify=verify, weights_only=weights_only, stats=stats)
    image = _memory_image(p)
    if image is not None:
        try:
            return _from_memory(p, image, lambda: fill(target, image, verify=True, weights_only=weights_only,
                                                       stats=stats))
        except _MemoryImageFailed:
            pass
    return fill(target, p, verify=verify, weights_only=weights_only, stats=stats)


def verify(path: str | os.PathLike, *, storage_options: dict | None = None) -> dict:
    """Check every byte of a checkpoint against its manifest (a remote one on a staged
    copy; a sharded checkpoint directory rank file by rank file, naming the file and the
    FQN of a damaged item); see :func:`fp_core.loading.integrity.verify`."""
    is_remote, p = paths.split(path)
    if is_remote:
        from . import remote

        return remote.verify(p, storage_options=storage_options)
    if os.path.isdir(p):  # a sharded (torch.distributed.checkpoint) checkpoint directory
        from .parallel import dcp

        return dcp.verify_dir(p)
    return integrity.verify(p)


def inspect(path: str | os.PathLike) -> list[dict]:
    """The records of a local checkpoint (every rank file's items for a sharded checkpoint
    directory): name, tensor, dtype, size, offset, checksum."""
    p = paths.split(path)[1]
    if os.path.isdir(p):
        from .parallel import dcp

        return dcp.inspect_dir(p)
    return integrity.inspect(p)


def wait_for_writers(path: str | os.PathLike, timeout: float = 120.0) -> None:
    """Wait until no writer process whose trainer is gone (``writer="process"``, the trainer
    killed after a fence) still commits a checkpoint at or under the directory ``path``, at
    most ``timeout`` s. Call it before a restart lists the checkpoints there (the newest
    may be one such writer is committing). Returns at once where there is none."""
    from .io import memory_image

    memory_image.wait_for_writers_under(path, timeout)


__all__ = ["prepare", "save", "load", "load_into", "verify", "inspect", "wait_for_writers"]
