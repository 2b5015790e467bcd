"""The Hugging Face ``Trainer`` callback and its save path: the Trainer's
``_save_checkpoint`` re-implemented asynchronously and atomically (staged, written in the
background, committed by rename, rotated), the fences that keep the background off live
state, and the choice of which trainers keep the stock save.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints

from fp_core import api as fp_api
from fp_core import remote as fp_remote
from fp_core.loading import checkpoint_dir as fp_checkpoint_dir
from fp_core.parallel import distributed as fp_dist
from fp_core.pipeline.checkpointer import AsyncCheckpointer
from fp_core.saving import commit as fp_commit
from fp_core.saving import retention
from fp_core.saving.commit import fsync_file

from ._policy import ErrorPolicy, checkpointer_options
from .hf_common import (
    OPTIMIZER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    CheckpointRecord,
    intercept_safetensors_writes,
)
from .hf_fsdp import (
    FSDP_FULL_MODEL_NAME,
    FSDP_FULL_OPTIMIZER_NAME,
    FSDP_MODEL_DIR,
    FSDP_OPTIMIZER_DIR,
    _fsdp_fallback_reason,
    _fsdp_full,
    _fsdp_state,
    _save_file_layout,
    _save_full_model,
)
from .hf_remote import _RemoteCopies
from .hf_resume import _ResumeHooks

log = logging.getLogger("fastpersist.hf")

STAGING_PREFIX = ".fastpersist-staging-"
_JIT_SENTINEL = "checkpoint-is-incomplete.txt"


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


class FastPersistCallback(_ResumeHooks, _RemoteCopies, TrainerCallback):
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
        # train(resume_from_checkpoint=True) lists the checkpoints before any other event: a
        # killed run's writer process may still be committing the newest one
        fp_api.wait_for_writers(args.output_dir)

    def on_train_begin(self, args, state, control, **kwargs):
        if not self._ensure_trainer():
            return
        tr = self.trainer
        self._fence_step_begin = self._decide_step_begin_fence(kwargs.get("model") or tr.model)
        self._setup_group()
        # Remove staging directories left by a crashed run (nothing of ours is pending).
        if args.should_save and not self._pending and os.path.isdir(args.output_dir):
            fp_api.wait_for_writers(args.output_dir)  # a staging directory a killed run's writer still commits
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
        in_writer: Callable[[], bool] | None = None
        # writer="process": the writer (under DDP or FSDP, every rank's writer, together)
        # commits the directory after its files, so a trainer killed from here on still gets
        # its checkpoint (None: the trainers commit it)
        if distributed:
            why = "" if error is None else f"{type(error).__name__}: {error}"
            try:
                in_writer = self.checkpointer.hand_over_dir_commit(staging, final, sync_files, handles,
                                                                   together=True, failed=why,
                                                                   should_save=should_save)
            except Exception as e:  # noqa: BLE001 - the writer is gone: the save fails, reported below
                error = error or e
                in_writer = _raises(e)  # the peers' writers fail it too: no trainer-side agreement
        elif error is None and should_save:
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
                failed: bool, in_writer: Callable[[], bool] | None = None) -> bool:
        """Background worker: agree across ranks, rename staging -> checkpoint-N, rotate.
        ``in_writer``: the writer process commits the directory; this waits for it (False:
        the writers left it to the trainers, on every rank)."""
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
        committed = raised = False
        if in_writer is not None:
            try:
                committed = in_writer()  # after its files; it fails where one of them failed
            except BaseException as e:  # noqa: BLE001
                if ok:
                    err = e
                ok, raised = False, True
        # done here where the writers committed or failed it (alike on every rank); where they
        # left it to the trainers (False on every rank), every rank goes on to the agreement,
        # even one whose own part failed
        if in_writer is not None and (committed or raised):
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


def _raises(error: BaseException) -> Callable[[], bool]:
    def fail() -> bool:
        raise error
    return fail


def _rotate_local(run_dir: str, save_total_limit: int | None, best: str | None) -> None:
    """transformers' ``rotate_checkpoints`` (the same victims: ``fp_core.saving.retention``), each
    victim renamed out of ``checkpoint-*`` before it is deleted (``fp_core.saving.commit.retire_dirs``),
    so a kill during the slow recursive delete never leaves a half-deleted checkpoint-N."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    checkpoints = sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, use_mtime=True)
    protected = {checkpoints[-1]} | ({str(Path(best))} if best is not None else set()) if checkpoints else set()
    fp_commit.retire_dirs(retention.to_delete(checkpoints, save_total_limit, protected))

