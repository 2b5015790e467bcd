"""What the Hugging Face modules share: the Trainer's checkpoint file names, the record
of one checkpoint, and the process-wide routing of ``safetensors`` writes.

The save path hands ``save_pretrained``'s writes to the checkpointer, the FSDP path records
them, and the resume's reads of shared-memory images take the same lock, so the routing
and its lock live here once.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fp_core.pipeline.checkpointer import AsyncCheckpointer

TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"

# ---------------------------------------------------------------------------------------
# Routing save_pretrained's safetensors writes to the async checkpointer
# ---------------------------------------------------------------------------------------
_intercept_lock = threading.RLock()


@contextlib.contextmanager
def intercept_safetensors_writes(ckptr: AsyncCheckpointer, handles: list) -> Iterator[None]:
    """Within the block, safetensors files written by ``save_pretrained`` (and by the
    Trainer's plain-``nn.Module`` path) are handed to ``ckptr`` instead of written inline.

    This keeps ``save_pretrained``'s own state-dict logic (tied weights, weight-conversion
    revert, quantizer metadata, sharding, the index file, config files) byte-for-byte,
    and only replaces the final ``safe_save_file(tensors, filename, metadata)`` call.
    The handles of the started saves are appended to ``handles``. Main thread only.
    """
    def _save_file(tensors: dict, filename: Any, metadata: dict | None = None) -> None:
        handles.append(ckptr.save(dict(tensors), os.fspath(filename), format="safetensors",
                                  metadata=metadata, local=True))

    with _safetensors_writes_go_to(_save_file):
        yield


@contextlib.contextmanager
def _safetensors_writes_go_to(save_file: Callable[..., None]) -> Iterator[None]:
    """Within the block, ``safetensors.torch.save_file`` (and transformers' own reference
    to it, ``safe_save_file``) is ``save_file``; one block at a time, process-wide."""
    import safetensors.torch as st_torch
    import transformers.modeling_utils as mu

    with _intercept_lock:
        orig_mu = getattr(mu, "safe_save_file", None)
        orig_st = st_torch.save_file
        if orig_mu is not None:
            mu.safe_save_file = save_file
        st_torch.save_file = save_file
        try:
            yield
        finally:
            if orig_mu is not None:
                mu.safe_save_file = orig_mu
            st_torch.save_file = orig_st


@dataclass
class CheckpointRecord:
    """One checkpoint the callback started; ``stats`` of the callback lists these."""

    step: int
    path: str
    staging: str
    started: float
    blocked_seconds: float = 0.0  # time the training thread spent inside the save call
    fence_seconds: float = 0.0  # time later fences waited for this checkpoint
    commit_seconds: float | None = None  # save start -> committed (renamed + fsync'ed)
    bytes: int = 0
    ok: bool | None = None  # None while pending
    error: str | None = None
    remote: str | None = None  # the remote copy's URL (with remote_dir)
    uploaded: bool | None = None  # None: no upload (yet); False: the upload failed or was skipped
    upload_seconds: float | None = None
    handles: list = field(default_factory=list, repr=False)
    commit: Any = field(default=None, repr=False)
    upload: Any = field(default=None, repr=False)

    @property
    def last_job(self) -> Any:
        """The job after which this checkpoint is finished (its upload, else its commit)."""
        return self.upload if self.upload is not None else self.commit

