"""The Lightning ``CheckpointIO`` plugin: saves handed to ``fp_core.AsyncCheckpointer``,
blocking only where no training step follows, placeholders under pending names, the fence
before each optimizer step, remote paths through ``fp_core.remote``, and the saves every
rank makes together (DDP's collective checkpoint, the sharded strategies' routed saves).

:class:`_FastPersistIOImpl` knows no Lightning namespace; ``FastPersistIO`` (``lightning``)
is made here and ``PLFastPersistIO`` (``pytorch_lightning``) in
:mod:`fp_integrations.lightning`, both importable from there.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Any

import fp_core
from fp_core import AsyncCheckpointError, CheckpointError
from fp_core import paths as fp_paths
from fp_core import remote as fp_remote
from fp_core.pipeline.checkpointer import fence_before_update, optim_hooks
from fp_core.saving import commit as fp_commit
from fp_core.sharded import map_containers

from ._policy import ErrorPolicy, FastPersistWarning, checkpointer_options

log = logging.getLogger("fastpersist")

_HPC_NAME = re.compile(r"^hpc_ckpt_\d+\.ckpt$")  # SLURM auto-requeue: the process is killed right after
_SPAWN_TEMP_NAME = ".temp.ckpt"  # ddp_spawn hands the final weights back through this file, then exits
_STORAGE_OPTION_KEYS = frozenset({"blocking"})
_RUNTIME_ATTRS = ("_lock", "_ckpt", "_pending", "_committed", "_unlogged", "_hook", "_hook_finalizer",
                  "_torn_down", "save_call_seconds", "fence_seconds", "fence_count",
                  "fence_overlaps", "_collective", "_collective_next", "_save_calls", "load_stats")
_plugins: weakref.WeakSet = weakref.WeakSet()  # every plugin of this process, for the fork hook below


def _forget_parents_saves() -> None:
    for plugin in list(_plugins):
        plugin._forget_after_fork()


os.register_at_fork(after_in_child=_forget_parents_saves)
# What ranks other than 0 pass as the path of a collective save: only rank 0 names the file.
_PEER_PATH = "fastpersist-peer-rank.ckpt"


def _copy_sharded_state(obj: Any, devices: set | None = None) -> Any:
    """``obj`` with every tensor copied; a ``ShardedTensor`` becomes one over copies of its
    local shards, with the same global metadata (no communication). The devices copied on
    are added to ``devices``."""
    import torch
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    def copy(t: torch.Tensor) -> torch.Tensor:
        if devices is not None:
            devices.add(t.device)
        return t.detach().clone()

    if isinstance(obj, ShardedTensor):
        shards = [Shard(copy(s.tensor), s.metadata) for s in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group)
    if isinstance(obj, torch.Tensor):
        return copy(obj)
    return map_containers(obj, lambda x: _copy_sharded_state(x, devices))


class _Pending:
    __slots__ = ("handle", "placeholder", "call_seconds")

    def __init__(self, handle: Any, placeholder: int | None) -> None:
        self.handle = handle
        self.placeholder = placeholder
        self.call_seconds = 0.0


class _FastPersistIOImpl:
    """Namespace-independent implementation; mixed into each namespace's ``CheckpointIO``."""

    def __init__(self, *, async_save: bool = True, policy: str = "auto", max_in_flight: int = 1,
                 verify: bool = True, on_error: str = "raise", visible_pending: bool = True,
                 on_commit: Any = None, keep_stats: int = 1000, storage_options: dict | None = None,
                 keep_local: bool = False, **options: Any) -> None:
        """
        Args:
            async_save: write in the background (default). ``False``: every save is synchronous
                (still FastPersist's atomic, durable native writer).
            policy: "auto" | "overlap" | "snapshot", see ``fp_core.AsyncCheckpointer``.
            max_in_flight: saves not yet durable at once; a further save waits for the oldest.
            verify: ``load_checkpoint`` (resume, ``load_from_checkpoint``) checks every byte of a
                FastPersist checkpoint against its checksums and refuses a damaged one with
                ``CorruptCheckpointError`` naming the tensor (default; files written by other
                tools load unchecked). ``False`` skips the check (a faster load).
            on_error: "raise" (default): a failed background save fails ``fit()``; "warn": a
                ``FastPersistWarning`` is issued and training continues.
            visible_pending: make a pending checkpoint's name exist at once (see module doc).
            on_commit: optional ``fn(path, stats)`` run in the background after each save is
                durable under its final name (must be picklable for ``ddp_spawn``).
            keep_stats: how many committed ``SaveStats`` to keep in ``self.stats``.
            storage_options: fsspec options (endpoint, credentials...) for remote paths;
                default: fsspec's own configuration. Not to be confused with the per-call
                ``save_checkpoint(storage_options={"blocking": True})``.
            keep_local: keep the committed file of a remote save in the local cache, so a
                ``load_checkpoint`` of it skips the download (see :mod:`fp_core.remote`).
            **options: engine options (``backend``, ``queue_depth``, ``chunk_bytes``,
                ``copy_threads``, ``io_threads``) and other ``AsyncCheckpointer`` options
                (``snapshot_budget_bytes``, ``small_tensor_bytes``, ``when_busy``, ``huge_pages``,
                ``collapse_live_tensors``, ``writer="process"`` with ``resume_from_memory``: the
                writer in its own process, a checkpoint past its fence survives the trainer,
                and ``ckpt_path`` resumes from its shared-memory image after a crash).
        """
        super().__init__()
        self.errors = ErrorPolicy(on_error)
        # engine options and the other AsyncCheckpointer options, checked now (not at the first save)
        self.engine_options, self.checkpointer_options = checkpointer_options(options, policy)
        self.async_save = async_save
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.verify = verify
        self.on_error = on_error
        self.visible_pending = visible_pending
        self.on_commit = on_commit
        self.keep_stats = keep_stats
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict of fsspec options, not {type(storage_options).__name__}")
        self.storage_options = None if storage_options is None else dict(storage_options)
        self.keep_local = bool(keep_local)
        self._init_runtime()

    def _forget_after_fork(self) -> None:
        """In a forked child (Fabric's ``ddp_fork``, a DataLoader worker): the parent's pending
        saves and their placeholders are the parent's; the child neither waits for them nor
        removes their names (the core forgets the saves themselves)."""
        self._lock = threading.RLock()
        for entries in self._pending.values():
            for e in entries:
                if e.placeholder is not None:
                    fp_commit.settle(e.placeholder)  # our copy of the descriptor; the parent keeps its lock
                    e.placeholder = None
        self._pending = {}

    # ------------------------------------------------------------------ pickling (ddp_spawn)
    def _init_runtime(self) -> None:
        _plugins.add(self)
        self._lock = threading.RLock()
        self._ckpt: Any = None  # fp_core.AsyncCheckpointer, created at the first async save
        self._pending: dict[str, list[_Pending]] = {}
        self._committed: deque = deque(maxlen=self.keep_stats)  # SaveStats, oldest first
        self._unlogged: deque = deque()  # for FastPersistCallback(log_stats=True)
        self._hook: Any = None
        self._hook_finalizer: Any = None
        # No training step seen since this plugin was made or torn down: a save now has no
        # step after it to overlap, so it completes before returning (see _must_block).
        self._torn_down = True
        self.save_call_seconds: list[float] = []  # training-thread time inside each save_checkpoint
        self.fence_seconds = 0.0  # training-thread time spent waiting at fences
        self.fence_count = 0  # fences run (optimizer steps while a checkpointer exists)
        self.fence_overlaps = 0  # fences that found a save still in flight (the write overlapped a step)
        # DDP with FastPersistCallback: every rank writes a share of each checkpoint.
        self._collective = False
        self._collective_next: Any = None  # the checkpoint dict rank 0 will receive next
        self._save_calls = 0  # saves handed to this plugin (lightning_sharded: a save that never came)
        # what this rank read at the last resume of a sharded model from one file (lightning_sharded)
        self.load_stats: Any = None
        self._install_hook()  # an optimizer step from now on means training is running
        _route_strategies(self)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in _RUNTIME_ATTRS:
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # ------------------------------------------------------------------ CheckpointIO API
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path``; returns before the write is done unless blocking.

        ``storage_options={"blocking": True}`` makes this save durable before returning.
        """
        blocking = self._parse_storage_options(storage_options)
        t0 = time.perf_counter()
        self._save_calls += 1
        is_remote, path = fp_paths.is_remote(path), fp_paths.key(path)
        if not is_remote:  # object stores have no directories; never an empty marker object
            os.makedirs(os.path.dirname(path), exist_ok=True)
        name = path.rstrip("/").rsplit("/", 1)[-1]
        self._install_hook()  # the next optimizer step marks training as running (see teardown)
        if not self.async_save or _HPC_NAME.match(name) or name == _SPAWN_TEMP_NAME or self._must_block():
            blocking = True
        try:
            with self._lock:
                self._sweep()
                entry = self._start_save(checkpoint, path, blocking, is_remote)
            if blocking and entry is not None:
                entry.handle.result()
        except Exception as e:
            self.errors.handle(e, f"saving checkpoint {path}")
        finally:
            dt = time.perf_counter() - t0
            self.save_call_seconds.append(dt)
            if len(self.save_call_seconds) > self.keep_stats:
                del self.save_call_seconds[0]

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint (waiting for a pending save of it first), like ``TorchCheckpointIO``.

        A remote URL is downloaded into local staging (or found in the ``keep_local``
        cache) and loaded with the native loader."""
        is_remote, p = fp_paths.is_remote(path), fp_paths.key(path)
        self._wait_for(p)
        if map_location is None:
            map_location = "cpu"  # TorchCheckpointIO's default keeps storages on the CPU
        if is_remote:
            if not fp_remote.exists(p, storage_options=self.storage_options):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            return self._load(p, map_location, weights_only,
                              storage_options=self.storage_options, keep_local=self.keep_local)
        if not os.path.exists(p):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if fp_commit.is_placeholder(p):
            raise CheckpointError(
                f"checkpoint {path} is the placeholder of a FastPersist save that never finished (the writing "
                "process was killed?); `fastpersist clean DIR`, or the next save into that directory, removes it")
        return self._load(p, map_location, weights_only)

    def _load(self, p: str, map_location: Any, weights_only: bool | None, **remote: Any) -> dict[str, Any]:
        # "auto": a damaged FastPersist checkpoint is refused, naming the record and tensor;
        # a file written by another tool (stock Lightning) has nothing to check against.
        return fp_core.load(p, map_location=map_location, weights_only=weights_only,
                            verify="auto" if self.verify else False, **remote)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` after every pending save (never under a write); silent if missing."""
        is_remote, p = fp_paths.is_remote(path), fp_paths.key(path)
        if is_remote:
            remove = functools.partial(fp_remote.remove, p, recursive=True, storage_options=self.storage_options)
            remove.__name__ = f"remove {p}"  # type: ignore[attr-defined]  # names the job in errors
        else:
            remove = functools.partial(fp_commit.remove, p)  # as TorchCheckpointIO's; frees in the background
        try:
            with self._lock:
                self._sweep()
                ckpt = self._ckpt
                if ckpt is not None:
                    if ckpt.pending():
                        ckpt.enqueue(remove)  # errors surface at the next call, like a save's
                        return
                    # None pending, but a save may have failed since the last call: the
                    # checkpoint it was to replace stays (the failure is raised instead).
                    ckpt.raise_failures(saves_only=True)
            remove()
        except Exception as e:
            self.errors.handle(e, f"removing checkpoint {path}")

    def teardown(self) -> None:
        """Drain pending writes (end of fit/validate/test/predict). Raises a pending failure,
        unless an exception is already propagating (then it is logged, not raised)."""
        in_flight = sys.exc_info()[1]
        self._install_hook()  # clears _torn_down at the next optimizer step
        with self._lock:
            self._torn_down = True  # later saves are blocking until training resumes
            ckpt, self._ckpt = self._ckpt, None
        if ckpt is None:
            return
        try:
            ckpt.close()
        except Exception as e:
            if in_flight is not None:
                log.error("fastpersist: a pending checkpoint failed while another error propagated: %s", e)
                warnings.warn(f"a pending checkpoint failed while another error propagated: {e}",
                              FastPersistWarning, stacklevel=2)
            else:
                self.errors.handle(e, "draining pending checkpoints at teardown")
        finally:
            with self._lock:
                self._sweep(final=True)

    def _must_block(self) -> bool:
        """Is no training step coming after this save for it to overlap?

        * Called by a wrapping ``CheckpointIO`` (Lightning's ``AsyncCheckpointIO`` calls us on
          its own thread, and no wrapper passes ``teardown()`` on): the wrapper is the
          background, so the save completes here and nothing is left pending at the end
          of ``fit``.
        * Called by a Lightning ``Trainer``: asynchronous only while it is fitting
          (``trainer.save_checkpoint()`` before or after ``fit``, in ``validate``/``test``:
          complete when it returns, as ``load_from_checkpoint`` reads the file next).
        * Otherwise (Fabric, direct calls): asynchronous once an optimizer step has run since
          this plugin was made or torn down.
        """
        io_bases = tuple(c for c in type(self).__mro__ if c.__name__ == "CheckpointIO")
        frame = sys._getframe(2)
        for _ in range(16):
            if frame is None:
                break
            obj = frame.f_locals.get("self")
            if obj is not None and obj is not self:
                if isinstance(obj, io_bases) and getattr(obj, "_checkpoint_io", None) is self:
                    return True  # a CheckpointIO wrapping this one
                state = getattr(obj, "state", None)
                if hasattr(obj, "strategy") and hasattr(state, "fn") and hasattr(state, "status"):
                    return not (state.fn == "fit" and state.status == "running")  # a Trainer
            frame = frame.f_back
        return self._torn_down

    # ------------------------------------------------------------------ extras
    def wait(self) -> None:
        """Block until every pending checkpoint is durable (raises a pending failure)."""
        ckpt = self._ckpt
        if ckpt is None:
            return
        try:
            ckpt.wait()
        except Exception as e:
            self.errors.handle(e, "waiting for pending checkpoints")
        finally:
            with self._lock:
                self._sweep()

    def pending(self, path: Any = None) -> bool:
        """Is a save (of ``path``, or any) still in progress?"""
        ckpt = self._ckpt
        if ckpt is None:
            return False
        return ckpt.pending(None if path is None else fp_paths.key(path))

    @property
    def stats(self) -> list[Any]:
        """``fp_core.SaveStats`` of committed saves, oldest first (``keep_stats`` most recent)."""
        return list(self._committed)

    @property
    def last_stats(self) -> Any:
        return self._committed[-1] if self._committed else None

    def pop_unlogged_stats(self) -> list[Any]:
        """Committed ``SaveStats`` not yet handed to a logger (used by ``FastPersistCallback``)."""
        out = []
        while self._unlogged:
            out.append(self._unlogged.popleft())
        return out

    def fence(self) -> None:
        """Wait until no pending save reads live training memory (called before parameters change)."""
        ckpt = self._ckpt
        if ckpt is None:
            return
        t0 = time.perf_counter()
        self.fence_count += 1
        if ckpt.pending():
            self.fence_overlaps += 1
        try:
            ckpt.fence()
        except Exception as e:
            self.errors.handle(e, "background checkpoint")
        finally:
            self.fence_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ sharded strategies
    def save_sharded(self, state: dict[str, Any], path: str, extra_files: dict[str, bytes]) -> None:
        """Every rank: save sharded (DTensor) ``state`` into the checkpoint directory ``path``
        (Lightning's sharded strategies, routed here by :mod:`fp_integrations.lightning_sharded`);
        in the background unless the save must block, as :meth:`save_checkpoint`."""
        self._save_every_rank(state, path, "saving sharded checkpoint", extra_files=extra_files)

    def save_file(self, checkpoint: dict[str, Any], path: str) -> None:
        """Every rank: save ``checkpoint`` (its model and optimizer state DTensors) as one
        ``torch.save`` file of the full state at ``path``, each rank writing its own rows
        (``layout="file"``, routed here by :mod:`fp_integrations.lightning_sharded`), in the
        background unless the save must block, as :meth:`save_checkpoint`. A failure on any
        rank fails it on every rank, and the checkpoint under ``path`` before it is kept."""
        self._save_every_rank(checkpoint, path, "saving checkpoint", layout="file")

    def _save_every_rank(self, state: dict[str, Any], path: str, what: str, **save_kw: Any) -> None:
        """A save every rank makes together (``save_kw``: a sharded directory's
        ``extra_files``, or ``layout="file"``), queued or blocking as :meth:`save_checkpoint`'s."""
        import torch.distributed as dist

        from fp_core.sharded import has_sharded_tensor

        t0 = time.perf_counter()
        self._save_calls += 1
        self._install_hook()
        name = os.path.basename(path.rstrip("/"))
        # as save_checkpoint: SLURM requeue saves are durable before the process is killed
        blocking = not self.async_save or bool(_HPC_NAME.match(name)) or name == _SPAWN_TEMP_NAME \
            or self._must_block()
        # the user's on_commit runs once per checkpoint: where the checkpoint is committed
        on_commit = self._on_commit if not dist.is_initialized() or dist.get_rank() == 0 else self._record
        try:
            if "extra_files" in save_kw and has_sharded_tensor(state):  # FSDP1: DCP's async save, our writer
                self._save_sharded_tensors(state, path, save_kw["extra_files"], on_commit, blocking)
                return
            with self._lock:
                self._sweep()
                if blocking and self._ckpt is None:
                    on_commit(path, fp_core.save(state, path, **save_kw, **self.engine_options))
                    return
                ckpt = self._checkpointer()
                try:
                    handle = ckpt.save(state, path, on_commit=on_commit, **save_kw)
                except AsyncCheckpointError as e:  # an earlier background save failed (now reported)
                    self.errors.handle(e, "background checkpoint")
                    # a collective save is queued before the earlier failure is raised
                    handle = getattr(e, "handle", None) or ckpt.save(state, path, on_commit=on_commit, **save_kw)
                self._pending.setdefault(path, []).append(_Pending(handle, None))
            if blocking:
                handle.result()
        except Exception as e:
            self.errors.handle(e, f"{what} {path}")
        finally:
            self.save_call_seconds.append(time.perf_counter() - t0)
            if len(self.save_call_seconds) > self.keep_stats:
                del self.save_call_seconds[0]

    def _save_sharded_tensors(self, state: dict[str, Any], path: str, extra_files: dict[str, bytes],
                              on_commit: Any, blocking: bool) -> None:
        """FSDP1's ``ShardedTensor`` state: the pipeline cannot rebuild ShardedTensors over
        its snapshot, and DCP's ``async_save`` cannot stage them (torch 2.13). So this call
        copies every tensor (the snapshot, the time it holds the caller) and queues
        ``dcp.save`` of the copy with ``FastPersistWriter`` on the checkpointer's worker,
        after every earlier save; removals, loads and teardown wait for it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from fp_core.parallel.dcp import FastPersistWriter, device_work_after, record_ready
        from fp_core.parallel.distributed import coordination_group

        ckpt = self._checkpointer()
        group = coordination_group(None)
        t0 = time.perf_counter()
        devices: set = set()
        copy = _copy_sharded_state(state, devices)
        # The clones are queued on this thread's current streams; the worker's reads of them
        # wait for that point (its own current stream is another), not for what it holds.
        ready = record_ready(devices)
        staged = time.perf_counter() - t0

        def save() -> Any:
            writer = FastPersistWriter(path, extra_files=extra_files, **self.engine_options)
            try:
                with device_work_after(ready):
                    dcp.save(copy, storage_writer=writer, process_group=group)
            except CheckpointException as e:
                raise CheckpointError(f"sharded checkpoint {path} not written: {e}") from e
            stats = fp_core.SaveStats(path=path, bytes=int(writer.stats.get("bytes", 0)),
                                      seconds=time.perf_counter() - t0, backend=str(writer.stats.get("backend", "")),
                                      policy="snapshot", blocked_seconds=staged)
            on_commit(path, stats)
            return stats

        save.__name__ = f"save {path}"  # names the job in errors
        handle = ckpt.enqueue(save, after=[], save=True)  # runs even if an earlier save failed: the peers wait for it
        self._pending.setdefault(path, []).append(_Pending(handle, None))
        if blocking:
            handle.result()

    def wait_for_path(self, path: str) -> None:
        """Block until no save of ``path`` is pending (raises its failure)."""
        with self._lock:
            jobs = [e.handle for e in self._pending.get(path, [])]
        for h in jobs:  # FSDP1's saves are jobs, not the pipeline's saves
            try:
                h.result()
            except Exception as e:
                self.errors.handle(e, f"waiting for checkpoint {path}")
        self._wait_for(path)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _parse_storage_options(storage_options: Any) -> bool:
        if storage_options is None:
            return False
        if not isinstance(storage_options, dict) or set(storage_options) - _STORAGE_OPTION_KEYS:
            raise TypeError(f"FastPersistIO storage_options must be None or a dict with keys "
                            f"{sorted(_STORAGE_OPTION_KEYS)}, got {storage_options!r}")
        return bool(storage_options.get("blocking", False))

    def _checkpointer(self) -> Any:
        if self._ckpt is None:
            rest = dict(self.checkpointer_options)
            if self._collective:
                import torch.distributed as dist

                rest.setdefault("group", dist.group.WORLD)
            self._ckpt = fp_core.AsyncCheckpointer(
                policy=self.policy, max_in_flight=self.max_in_flight,
                install_optimizer_hook=False,  # ours runs the fence after the step's closure
                **self.engine_options, **rest)
        self._install_hook()
        return self._ckpt

    # ------------------------------------------------------------------ DDP: all ranks write
    def enable_collective(self) -> None:
        """Every rank takes part in each checkpoint (called on every rank by the callback).

        Lightning hands the checkpoint to the plugin on rank 0 only; ``FastPersistCallback``
        sees it on every rank (``on_save_checkpoint``) and calls :meth:`participate` there,
        so each rank writes a near-equal byte range of the one file (``fp_core.save(...,
        group=...)``). Must run on every rank at the same point (creates a gloo group).
        """
        from fp_core.parallel.distributed import coordination_group

        coordination_group(None)  # collective: create it now, on the main thread, on every rank
        if self._ckpt is not None and getattr(self._ckpt, "group", None) is None:
            self._ckpt.close()  # a local-only checkpointer from before: replace it
            self._ckpt = None
        self._collective = True

    def expect_collective(self, checkpoint: Any) -> None:
        """Rank 0: the next ``save_checkpoint`` of this very dict is collective."""
        self._collective_next = checkpoint

    def participate(self, checkpoint: Any) -> None:
        """Ranks > 0: write this rank's share of the checkpoint rank 0 is about to save."""
        try:
            self._checkpointer().save(checkpoint, _PEER_PATH)
        except Exception as e:
            self.errors.handle(e, "writing this rank's share of a checkpoint")

    def _start_save(self, checkpoint: Any, path: str, blocking: bool, is_remote: bool = False) -> _Pending | None:
        """Start one save: collective when the other ranks joined it (see enable_collective)."""
        remote_kw = {"storage_options": self.storage_options, "keep_local": self.keep_local} if is_remote else {}
        peers_waiting = self._collective and checkpoint is self._collective_next
        self._collective_next = None
        if self._collective:
            # The other ranks take part only in saves they saw (on_save_checkpoint); a save
            # to a URL is written here alone, and the waiting peers are told so.
            if peers_waiting and is_remote:
                self._checkpointer().decline()
            remote_kw["local"] = not peers_waiting or is_remote
        if blocking and self._ckpt is None and not self._collective:
            # nothing in the background to order against: plain synchronous save, no thread
            stats = fp_core.save(checkpoint, path, **remote_kw, **self.engine_options)
            self._on_commit(path, stats)
            return None
        ckpt = self._checkpointer()
        placeholder: int | None = None  # the placeholder's lock, held until the save is over
        # no placeholder for a remote path: an empty object would look like a complete checkpoint
        if self.visible_pending and not blocking and not is_remote and not os.path.lexists(path):
            placeholder = fp_commit.claim(path)
        try:
            try:
                handle = ckpt.save(checkpoint, path, on_commit=self._on_commit, **remote_kw)
            except AsyncCheckpointError as e:  # an earlier background save failed (now reported)
                self.errors.handle(e, "background checkpoint")  # raises unless on_error="warn"
                # a collective save is queued before the earlier failure is raised
                handle = getattr(e, "handle", None) or ckpt.save(checkpoint, path, on_commit=self._on_commit,
                                                                 **remote_kw)
        except BaseException:
            if placeholder is not None:
                fp_commit.release(path, placeholder)
            raise
        entry = _Pending(handle, placeholder)
        self._pending.setdefault(path, []).append(entry)
        return entry

    def _on_commit(self, path: str, stats: Any) -> None:
        # runs on the background thread once the file is durable under its final name
        self._record(path, stats)
        if self.on_commit is not None:
            self.on_commit(path, stats)

    def _record(self, path: str, stats: Any) -> None:
        self._committed.append(stats)
        self._unlogged.append(stats)
        if len(self._unlogged) > self.keep_stats:
            self._unlogged.popleft()

    def _sweep(self, final: bool = False) -> None:
        """Forget finished saves; remove placeholders of failed ones. Caller holds the lock."""
        for path in list(self._pending):
            entries = self._pending[path]
            keep = [e for e in entries if not e.handle.done()]
            for e in entries:
                if e.handle.done() and e.placeholder is not None:
                    if e.handle.exception() is not None and not keep:
                        fp_commit.release(path, e.placeholder)  # a failed save leaves no name behind
                    else:
                        fp_commit.settle(e.placeholder)
                    e.placeholder = None
            if keep and not final:
                self._pending[path] = keep
            else:
                del self._pending[path]

    def _wait_for(self, path: str) -> None:
        ckpt = self._ckpt
        if ckpt is None:
            return
        targets = {path} if fp_remote.is_remote(path) else {path, os.path.realpath(path)}
        try:
            for t in targets:
                if ckpt.pending(t):
                    ckpt.wait_for(t)
            # a failure since the last call is raised here, as a pending save's is: if it
            # was a save of this path, the file there is the older one, not to be read past
            ckpt.raise_failures()
        except Exception as e:
            self.errors.handle(e, f"waiting for checkpoint {path}")
        with self._lock:
            self._sweep()

    # -- the fence before the optimizer step
    def _install_hook(self) -> None:
        if self._hook is not None:
            return
        ref = weakref.ref(self)

        def hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
            me = ref()
            return None if me is None else me._on_optimizer_step(args, kwargs)

        self._hook = optim_hooks.register(hook)
        # The finalizer may run in the middle of any optimizer step (the garbage collector
        # picks the moment): it only switches the hook off, torch's dict is left alone.
        self._hook_finalizer = weakref.finalize(self, functools.partial(self._hook.remove, defer=True))

    def _on_optimizer_step(self, args: Any, kwargs: Any) -> Any:
        self._torn_down = False  # training is running: saves are asynchronous again
        if self._ckpt is None:
            return None
        # fence after the step's closure (forward+backward), right before the update
        return fence_before_update(args, kwargs, self.fence)


def _route_strategies(plugin: _FastPersistIOImpl) -> None:
    """Let the plugin alone route Lightning's sharded strategies: the ``Strategy`` class of
    the plugin's own package gets its ``checkpoint_io`` setter wrapped (once per process;
    see :func:`fp_integrations.lightning_sharded.patch_strategy_class`)."""
    from . import lightning_sharded

    if _LCheckpointIO is not None and isinstance(plugin, _LCheckpointIO):
        from lightning.pytorch.strategies.strategy import Strategy

        lightning_sharded.patch_strategy_class(Strategy, FastPersistIO)
    elif "pytorch_lightning" in sys.modules and type(plugin).__name__ == "PLFastPersistIO":
        from pytorch_lightning.strategies.strategy import Strategy as PLStrategy

        lightning_sharded.patch_strategy_class(PLStrategy, type(plugin))


try:  # the ``lightning`` package
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LCheckpointIO
except ImportError:  # pragma: no cover - depends on the environment
    _LCheckpointIO = None
else:

    class FastPersistIO(_FastPersistIOImpl, _LCheckpointIO):
        """FastPersist ``CheckpointIO`` for ``lightning`` (``lightning.pytorch.Trainer``, ``lightning.Fabric``)."""

    # pickled by name (ddp_spawn) as fp_integrations.lightning.FastPersistIO, where users import it from
    FastPersistIO.__module__ = "fp_integrations.lightning"
