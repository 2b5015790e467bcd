"""Verify a checkpoint directory of files (the HF Trainer's ``checkpoint-N``): every file in it.

What the HF callback writes is a directory of ordinary files (``model.safetensors``,
``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``, ...) beside some the Trainer
writes itself (``rng_state.pth``, ``training_args.bin``) and, under FSDP, sharded DCP
directories. Each is checked for what it is (:func:`fp_core.integrity.verify`): a torch
file with a manifest byte for byte, a safetensors file against its checksums (or its
structure, written by another tool), JSON must parse, a sharded DCP directory rank file by
rank file (:func:`fp_core.dcp.verify_dir`). Files FastPersist did not write and cannot
check (a ``torch.save`` zip, a tokenizer's text files) are listed as unchecked. A damaged
file raises at once; a directory where nothing carries FastPersist's checksums raises
:class:`NotAFastPersistCheckpoint` once every file in it has been looked at.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable

from . import integrity
from .errors import NotAFastPersistCheckpoint

# Files of these kinds are checkpoints or parts of one: empty, they are damage. Any other
# empty file (an empty vocabulary, a marker) is nobody's checkpoint.
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".json", ".distcp")


def is_dcp_dir(path: str) -> bool:
    """A torch.distributed.checkpoint directory (FastPersist's or stock DCP's): it has DCP's
    ``.metadata``, or FastPersist's manifest of one (the names :mod:`fp_core.dcp` writes)."""
    return os.path.lexists(os.path.join(path, ".metadata")) or os.path.lexists(
        os.path.join(path, ".fastpersist-dcp.json"))


def verify_dir(path: str | os.PathLike, verify_dcp: Callable[[str], dict]) -> dict:
    """Verify every file of the directory ``path`` (see the module doc); its sharded DCP
    subdirectories with ``verify_dcp`` (:func:`fp_core.dcp.verify_dir`, which hands a
    directory that is not DCP's here). Returns a report: ``files`` checked (a DCP directory
    counts its rank files), ``verified`` of them against checksums, ``records``, ``bytes``,
    ``unchecked`` (names FastPersist cannot check) and ``reports`` (one per file or
    subdirectory checked)."""
    t0 = time.perf_counter()
    d = os.fspath(path)
    reports: list[dict] = []
    unchecked: list[str] = []
    for name in sorted(os.listdir(d)):
        if name.startswith("."):  # staging and bookkeeping of a save in progress, never a checkpoint
            continue
        p = os.path.join(d, name)
        st = os.lstat(p)
        if stat.S_ISDIR(st.st_mode):
            if not is_dcp_dir(p):
                unchecked.append(name + "/")
                continue
            try:
                reports.append({**verify_dcp(p), "kind": "dcp", "checksums": True})
            except NotAFastPersistCheckpoint:
                unchecked.append(name + "/")
            continue
        if not stat.S_ISREG(st.st_mode):
            unchecked.append(name)  # a link, a FIFO: not opened
            continue
        if st.st_size == 0 and not name.endswith(_CHECKPOINT_SUFFIXES):
            integrity.refuse_placeholder(p, 0)  # a pending save's placeholder is damage
            unchecked.append(name)
            continue
        try:
            reports.append(integrity.verify(p))
        except NotAFastPersistCheckpoint:
            unchecked.append(name)
    report = {
        "path": d, "kind": "directory",
        "files": sum(r.get("files", 1) for r in reports),
        "verified": sum(r.get("files", 1) for r in reports if r.get("checksums", True)),
        "records": sum(r.get("records", 0) for r in reports),
        "bytes": sum(r.get("bytes", 0) for r in reports),
        "unchecked": unchecked, "reports": reports, "seconds": time.perf_counter() - t0,
    }
    if not report["verified"]:
        raise NotAFastPersistCheckpoint(
            f"{d} holds no file with FastPersist checksums ({report['files']} checked for structure only; "
            f"unchecked: {', '.join(unchecked) or 'none'})")
    return report


def inspect_dir(path: str | os.PathLike, inspect_dcp: Callable[[str], list[dict]]) -> list[dict]:
    """The records of every checkpoint file in the directory (a DCP subdirectory's items,
    by ``inspect_dcp``), each row's name prefixed with its file's."""
    d = os.fspath(path)
    rows: list[dict] = []
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if name.startswith(".") or os.path.islink(p):
            continue
        try:
            found = inspect_dcp(p) if os.path.isdir(p) else integrity.inspect(p)
        except NotAFastPersistCheckpoint:
            continue
        rows += [{**r, "name": f"{name}:{r['name']}"} for r in found]
    if not rows:
        raise NotAFastPersistCheckpoint(f"{d} holds no checkpoint file FastPersist can list")
    return rows


__all__ = ["verify_dir", "inspect_dir", "is_dcp_dir"]
