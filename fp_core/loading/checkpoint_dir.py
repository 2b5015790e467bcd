"""Verify a checkpoint directory of files (the HF Trainer's ``checkpoint-N``): every file in it.

What the HF callback writes is a directory of ordinary files (``model.safetensors``,
``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``, ...) beside some the Trainer
writes itself (``rng_state.pth``, ``training_args.bin``) and, under FSDP, sharded DCP
directories. Each is checked for what it is (:func:`fp_core.loading.integrity.verify`): a torch
file with a manifest byte for byte, a safetensors file against its checksums (or its
structure, written by another tool), JSON must parse, a sharded DCP directory rank file by
rank file (:func:`fp_core.parallel.dcp.verify_dir`). Files FastPersist did not write and cannot
check (a ``torch.save`` zip, a tokenizer's text files) are listed as unchecked. A damaged
file raises at once; a directory where nothing carries FastPersist's checksums raises
:class:`NotAFastPersistCheckpoint` once every file in it has been looked at.

Checking the files present does not tell that one is missing. So the HF callback writes,
into the staged directory just before it is published (:func:`write_dir_manifest`), a
directory manifest, :data:`DIR_MANIFEST`: every file's name and size and every
subdirectory's name. Where it is present, a listed file that is missing, of another size
or no longer a regular file (a listed directory: missing or not a directory) is damage
(:class:`CorruptCheckpointError` naming the directory and the file); a file present but not
listed (one a callback added after the commit) is checked for what it is, as before, and
reported under ``extra``. Directories without it (older saves, the stock Trainer's) are
verified file by file only. The manifest is a dotfile: the Trainer and ``from_pretrained``
never list or load it. It is read as untrusted input (its size bounded, names plain names,
sizes non-negative integers, a CRC-32C of its content): a damaged or crafted one is
:class:`CorruptCheckpointError`, and nothing outside the directory is ever looked at.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Collection

from .. import _native
from ..errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from ..saving import commit
from . import integrity

DIR_MANIFEST = ".fastpersist-dir.json"
DIR_MANIFEST_FORMAT = "fastpersist-checkpoint-dir/1"
# bounds on the untrusted manifest: a checkpoint directory holds tens of files, a file
# system's names are at most NAME_MAX bytes
MAX_DIR_MANIFEST_BYTES = 16 << 20
MAX_DIR_ENTRIES = 100_000
_NAME_MAX = 255

# Files of these kinds are checkpoints or parts of one: empty, they are damage. Any other
# empty file (an empty vocabulary, a marker) is nobody's checkpoint.
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".json", ".distcp")


def is_dcp_dir(path: str) -> bool:
    """A torch.distributed.checkpoint directory (FastPersist's or stock DCP's): it has DCP's
    ``.metadata``, or FastPersist's manifest of one (the names :mod:`fp_core.parallel.dcp` writes)."""
    return os.path.lexists(os.path.join(path, ".metadata")) or os.path.lexists(
        os.path.join(path, ".fastpersist-dcp.json"))


def _plain_name(name: object) -> bool:
    """A name of an entry of the directory itself: no path separator, no ``.``/``..``, no
    NUL, no dotfile (the writer lists none), at most NAME_MAX bytes."""
    if not isinstance(name, str) or not name or name.startswith(".") or "/" in name or "\0" in name:
        return False
    try:
        return len(name.encode("utf-8", "surrogateescape")) <= _NAME_MAX
    except UnicodeEncodeError:  # a lone surrogate no file system name decodes to
        return False


def _manifest_crc(files: dict[str, int], dirs: list[str]) -> str:
    body = json.dumps({"files": files, "dirs": dirs}, sort_keys=True, separators=(",", ":"))
    return f"{_native.crc32c(body.encode()):08x}"


def write_dir_manifest(staging: str | os.PathLike) -> dict:
    """Write :data:`DIR_MANIFEST` into the directory ``staging``, listing every regular file
    (name and size) and subdirectory in it (dotfiles and links left out: verify does not
    open those either), and fsync it. Call it once every other file of the directory is
    final and synced, before the directory is published (:func:`fp_core.saving.commit.publish_dir`,
    which syncs the directory and so the manifest's entry). Returns what it wrote."""
    d = os.fspath(staging)
    files: dict[str, int] = {}
    dirs: list[str] = []
    with os.scandir(d) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            if e.is_file(follow_symlinks=False):
                files[e.name] = e.stat(follow_symlinks=False).st_size
            elif e.is_dir(follow_symlinks=False):
                dirs.append(e.name)
    files = dict(sorted(files.items()))
    dirs.sort()
    doc = {"format": DIR_MANIFEST_FORMAT, "files": files, "dirs": dirs, "crc32c": _manifest_crc(files, dirs)}
    data = json.dumps(doc, separators=(",", ":")).encode()
    commit.write_durably(os.path.join(d, DIR_MANIFEST), data)
    return doc


def read_dir_manifest(path: str | os.PathLike) -> dict | None:
    """The directory manifest of the directory ``path`` (``{"files": {name: size}, "dirs":
    [name]}``), every field checked; None where there is none. Raises
    :class:`CorruptCheckpointError` naming the manifest and what is wrong with it."""
    d = os.fspath(path)
    p = os.path.join(d, DIR_MANIFEST)

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(p, DIR_MANIFEST, f"the directory manifest {why}")

    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink; EACCES...
        raise bad(f"cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise bad("is not a regular file")
        if st.st_size > MAX_DIR_MANIFEST_BYTES:
            raise bad(f"is {st.st_size} bytes, more than any FastPersist writes")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_DIR_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad(f"does not parse: {e}") from None
    if not isinstance(doc, dict):
        raise bad("is not a JSON object")
    if doc.get("format") != DIR_MANIFEST_FORMAT:
        raise bad(f"has the format {str(doc.get('format'))[:60]!r}, not {DIR_MANIFEST_FORMAT!r} "
                  "(written by a newer FastPersist?)")
    files, dirs, crc = doc.get("files"), doc.get("dirs"), doc.get("crc32c")
    if not isinstance(files, dict) or not isinstance(dirs, list) or not isinstance(crc, str):
        raise bad("lacks its files, dirs or crc32c")
    if len(files) + len(dirs) > MAX_DIR_ENTRIES:
        raise bad(f"lists {len(files) + len(dirs)} entries")
    for name, size in files.items():
        if not _plain_name(name):
            raise bad(f"lists {str(name)[:80]!r}, not a plain file name")
        if type(size) is not int or not 0 <= size < 1 << 63:
            raise bad(f"gives {name!r} the size {str(size)[:40]}")
    for name in dirs:
        if not _plain_name(name):
            raise bad(f"lists the directory {str(name)[:80]!r}, not a plain name")
    if len(set(dirs)) != len(dirs) or set(dirs) & set(files):
        raise bad("lists a name twice")
    if _manifest_crc(files, dirs) != crc:
        raise bad(f"does not match its CRC-32C {crc[:8]!r} (damaged)")
    return {"files": files, "dirs": dirs}


class DirectoryChangedError(CorruptCheckpointError):
    """A file the directory manifest lists is missing, of another size or of another kind.
    Damage, or an edit made on purpose after the commit (a model resharded, a file
    rewritten): ``fastpersist verify`` reports it as damage; a resume warns and goes on
    with the files that are there, as the stock Trainer would."""


def _check_listed(d: str, listed: dict) -> None:
    """Every entry the manifest lists is there, what it was and (a file) of its size."""
    where = f"listed in the directory manifest ({DIR_MANIFEST})"
    for name, size in sorted(listed["files"].items()):
        p = os.path.join(d, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise DirectoryChangedError(d, name, f"missing: {name}, {where}") from None
        if not stat.S_ISREG(st.st_mode):
            raise DirectoryChangedError(p, name, f"not a regular file: {name} is a file {where}")
        if st.st_size != size:
            raise DirectoryChangedError(p, name, f"{st.st_size} bytes, {size} {where} (truncated or replaced? "
                                         f"if it was replaced on purpose, remove {os.path.join(d, DIR_MANIFEST)})")
    for name in listed["dirs"]:
        p = os.path.join(d, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise DirectoryChangedError(d, name + "/", f"missing: the directory {name}, {where}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise DirectoryChangedError(p, name + "/", f"not a directory: {name} is one {where}")


def verify_dir(path: str | os.PathLike, verify_dcp: Callable[[str], dict], *, check_listed: bool = True,
               skip: Collection[str] = ()) -> dict:
    """Verify every file of the directory ``path`` (see the module doc); its sharded DCP
    subdirectories with ``verify_dcp`` (:func:`fp_core.parallel.dcp.verify_dir`, which hands a
    directory that is not DCP's here). Returns a report: ``files`` checked (a DCP directory
    counts its rank files), ``verified`` of them against checksums, ``records``, ``bytes``,
    ``unchecked`` (names FastPersist cannot check), ``reports`` (one per file or
    subdirectory checked), ``manifest`` (whether the directory has one: then every file it
    lists was found, of its size) and ``extra`` (names present that it does not list).
    ``skip``: regular files whose bytes the caller checks as it reads them (from their
    shared-memory images): listed ones still checked for presence and size, their bytes
    not read here; counted as verified, named in ``skipped``."""
    t0 = time.perf_counter()
    d = os.fspath(path)
    listed = read_dir_manifest(d)
    if listed is not None and check_listed:  # before any file is read: a missing one is found at once
        _check_listed(d, listed)
    reports: list[dict] = []
    unchecked: list[str] = []
    extra: list[str] = []
    skipped: list[str] = []
    for name in sorted(os.listdir(d)):
        if name.startswith("."):  # staging and bookkeeping of a save in progress, never a checkpoint
            continue
        p = os.path.join(d, name)
        st = os.lstat(p)
        if listed is not None and name not in listed["files"] and name not in listed["dirs"]:
            extra.append(name + "/" if stat.S_ISDIR(st.st_mode) else name)
        if name in skip and stat.S_ISREG(st.st_mode):
            skipped.append(name)
            reports.append({"path": p, "kind": "skipped", "checksums": True, "records": 0, "bytes": 0})
            continue
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
        "unchecked": unchecked, "reports": reports, "manifest": listed is not None, "extra": extra,
        "skipped": skipped,
        "seconds": time.perf_counter() - t0,
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


__all__ = ["verify_dir", "inspect_dir", "is_dcp_dir", "write_dir_manifest", "read_dir_manifest", "DIR_MANIFEST"]
