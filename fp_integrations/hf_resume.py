"""Resume under the Hugging Face ``Trainer``: the checkpoint verified before any of it is
loaded, its files read from the writer process's shared-memory images where they are
live, and FSDP2's full-state files read by rows.

:class:`_ResumeHooks` holds the callback's replacements of the Trainer's load methods;
the functions below are what they call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings
from collections.abc import Collection, Iterator
from typing import Any

import torch
from transformers import Trainer

from fp_core.loading import checkpoint_dir as fp_checkpoint_dir

from ._policy import FastPersistWarning
from .hf_common import SCHEDULER_NAME, _intercept_lock
from .hf_fsdp import FSDP_FULL_MODEL_NAME, FSDP_FULL_OPTIMIZER_NAME, _fsdp_full, _load_full_state


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


def verify_checkpoint_dir(path: str, *, read_elsewhere: Collection[str] = ()) -> int:
    """Refuse a damaged ``checkpoint-N`` directory before the Trainer resumes from it.

    Every file in it is checked for what it is (:func:`fp_core.verify` of the directory):
    files FastPersist wrote with a manifest (``optimizer.pt``, ``scheduler.pt``,
    ``scaler.pt``) byte for byte, safetensors files against the checksums FastPersist
    writes into their header (a file written by another tool: its structure, as
    safetensors' own parser checks it), JSON files must parse, FSDP's sharded DCP
    directories rank file by rank file. A directory the callback committed lists its files
    (:data:`fp_core.loading.checkpoint_dir.DIR_MANIFEST`): one of them missing or of another size
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
    from fp_core.parallel.dcp import verify_dir as verify_dcp

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


class _ResumeHooks:
    """The Trainer's load methods as :class:`~fp_integrations.hf.FastPersistCallback`
    installs them: verify first, read shared-memory images where live, FSDP2 full state by
    rows. Mixed into the callback, whose ``trainer``, ``load_stats`` and
    ``verify_on_resume`` they use."""

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

