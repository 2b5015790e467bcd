"""Remote storage for the Hugging Face ``Trainer`` (``remote_dir``): each committed
``checkpoint-N`` uploaded, rotated among the complete remote checkpoints, local copies
dropped once uploaded; and the complete remote checkpoints listed and downloaded for a
resume.
"""

from __future__ import annotations

import os
import re
import time

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from fp_core import remote as fp_remote
from fp_core.saving import commit as fp_commit
from fp_core.saving import retention

from .hf_common import CheckpointRecord


def _step_of(url: str) -> int | None:
    m = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", url.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def remote_checkpoints(remote_dir: str, *, storage_options: dict | None = None) -> list[str]:
    """URLs of the *complete* ``checkpoint-N`` directories under ``remote_dir``, oldest step
    first (incomplete ones -- an upload in progress, failed or being removed -- are left out)."""
    urls = fp_remote.list_complete(remote_dir, f"{PREFIX_CHECKPOINT_DIR}-", storage_options=storage_options)
    return [u for _, u in sorted((_step_of(u), u) for u in urls if _step_of(u) is not None)]


def download_checkpoint(remote_dir: str, *, storage_options: dict | None = None,
                        local_dir: str | os.PathLike | None = None, missing_ok: bool = False) -> str | None:
    """Download the newest complete ``checkpoint-N`` under ``remote_dir``; return its local path,
    for ``trainer.train(resume_from_checkpoint=...)``.

    ``local_dir``: the directory to put ``checkpoint-N`` in (``local_dir/checkpoint-N`` is
    replaced); default: FastPersist's local staging cache, where an unchanged checkpoint is
    reused without a second download. No complete checkpoint: ``FileNotFoundError``, or
    ``None`` with ``missing_ok=True`` (a first run starts from scratch).
    """
    ckpts = remote_checkpoints(remote_dir, storage_options=storage_options)
    if not ckpts:
        if missing_ok:
            return None
        raise FileNotFoundError(f"no complete {PREFIX_CHECKPOINT_DIR}-N directory under {remote_dir}")
    url = ckpts[-1]
    dest = None if local_dir is None else os.path.join(os.fspath(local_dir), url.rstrip("/").rsplit("/", 1)[-1])
    return fp_remote.download_dir(url, dest, storage_options=storage_options)


class _RemoteCopies:
    """The background jobs that copy the callback's committed checkpoints to ``remote_dir``.
    Mixed into :class:`~fp_integrations.hf.FastPersistCallback`, whose ``remote_dir``,
    ``storage_options``, ``keep_local`` and ``_uploaded_local`` they use."""

    def _upload(self, rec: CheckpointRecord, best: str | None, save_total_limit: int | None) -> bool:
        """Background worker, after ``rec``'s commit: upload checkpoint-N, rotate remotely,
        drop local copies (``keep_local=False``). Raises on failure (a background error)."""
        if not rec.ok:  # not committed (the failure is reported through the commit / writes)
            return False
        t0 = time.perf_counter()
        try:
            fp_remote.upload_dir(rec.path, rec.remote, storage_options=self.storage_options)
        except BaseException:
            rec.uploaded = False
            raise
        rec.uploaded = True
        rec.upload_seconds = time.perf_counter() - t0
        self._rotate_remote(os.path.basename(rec.path), best, save_total_limit)
        if not self.keep_local:
            self._uploaded_local.append(rec.path)
            keep = [p for p in self._uploaded_local if best is not None and os.path.abspath(p) == os.path.abspath(best)]
            gone = [p for p in self._uploaded_local if p not in keep and os.path.isdir(p)]
            self._uploaded_local = keep
            fp_commit.retire_dirs(gone)  # renamed out of checkpoint-* first, like any rotation
        return True

    def _rotate_remote(self, newest: str, best: str | None, save_total_limit: int | None) -> None:
        """``save_total_limit`` for ``remote_dir``, among the complete remote checkpoints
        (the same rule as the local rotation)."""
        ckpts = remote_checkpoints(self.remote_dir, storage_options=self.storage_options)
        by_name = {u.rstrip("/").rsplit("/", 1)[-1]: u for u in ckpts}
        protected = {newest} | ({os.path.basename(os.path.normpath(best))} if best else set())
        for name in retention.to_delete(list(by_name), save_total_limit, protected):
            fp_remote.remove(by_name[name], recursive=True, storage_options=self.storage_options)

