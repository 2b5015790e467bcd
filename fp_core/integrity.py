"""Read a checkpoint's manifest and check its bytes against it (``verify``, ``inspect``)."""

from __future__ import annotations

import os
import struct
import time
import zipfile
from dataclasses import dataclass

import numpy as np

from . import _native, remote
from .errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from .manifest import RECORD_SUFFIX, STRUCTURE, TAIL, TAIL_COMMENT_PREFIX, Manifest, RecordInfo
from .plan import structure_crc

_SCRATCH_BYTES = 16 << 20


@dataclass
class ManifestView:
    path: str
    manifest: Manifest
    header_offset: int  # where the tail starts


def _pread(fd: int, off: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), off + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read_manifest(path: str, check_tail: bool = True) -> ManifestView:
    """Locate and parse the manifest; with ``check_tail``, check the tail's CRC first."""
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            comment = z.comment
    except zipfile.BadZipFile as e:
        raise CorruptCheckpointError(path, STRUCTURE, f"not a complete zip file (truncated?): {e}") from e
    minfo = next((i for i in infos if i.filename.endswith("/" + RECORD_SUFFIX)), None)
    if minfo is None:
        raise NotAFastPersistCheckpoint(f"{path} has no FastPersist manifest (written by another tool?)")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = _pread(fd, minfo.header_offset, 30)
        if len(head) < 30 or struct.unpack_from("<I", head)[0] != 0x04034B50:
            raise CorruptCheckpointError(path, TAIL, "manifest local header is damaged")
        n, e = struct.unpack_from("<HH", head, 26)
        data_offset = minfo.header_offset + 30 + n + e
        if check_tail:
            if not comment.startswith(TAIL_COMMENT_PREFIX) or len(comment) != len(TAIL_COMMENT_PREFIX) + 8:
                raise CorruptCheckpointError(path, TAIL, f"zip comment {comment[:40]!r} is not a FastPersist tail checksum")
            want = int(comment[len(TAIL_COMMENT_PREFIX):], 16)
            got = _native.crc32c(_pread(fd, minfo.header_offset, size - 8 - minfo.header_offset))
            if got != want:
                raise CorruptCheckpointError(path, TAIL, f"CRC-32C {got:08x}, expected {want:08x}")
        raw = _pread(fd, data_offset, minfo.file_size)
    finally:
        os.close(fd)
    try:
        manifest = Manifest.from_bytes(raw)
    except (ValueError, KeyError) as e:
        raise CorruptCheckpointError(path, TAIL, f"manifest does not parse: {e}") from e
    if manifest.file_size != size:
        raise CorruptCheckpointError(path, STRUCTURE, f"file is {size} bytes, manifest says {manifest.file_size}")
    return ManifestView(path, manifest, minfo.header_offset)


def record_crc(reader: _native.Reader, offset: int, size: int, scratch: np.ndarray) -> int:
    crc, pos = 0, 0
    while pos < size:
        n = min(size - pos, scratch.nbytes)
        part = reader.read_into(offset + pos, scratch.ctypes.data, n, checksum=True)
        crc = _native.crc32c_combine(crc, part, n) if pos else part
        pos += n
    return crc


def check_structure(view: ManifestView) -> None:
    """Check the zip structure and the small records (pickle, version...) of a file."""
    m, path = view.manifest, view.path
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        covered = [(r.offset, r.offset + r.size) for r in m.records]
        got = structure_crc(covered, view.header_offset, lambda o, n: _pread(fd, o, n))
        if got != m.structure_crc32c:
            raise CorruptCheckpointError(path, STRUCTURE, f"CRC-32C {got:08x}, expected {m.structure_crc32c:08x}")
        for r in m.records:
            if r.kind == "record":
                check_crc(path, r, _native.crc32c(_pread(fd, r.offset, r.size)))
    finally:
        os.close(fd)


def check_crc(path: str, record: RecordInfo, crc: int) -> None:
    if crc != record.crc32c:
        raise CorruptCheckpointError(path, record.name, f"CRC-32C {crc:08x}, expected {record.crc32c:08x}",
                                     tensor=record.tensor)


def verify(path: str | os.PathLike) -> dict:
    """Check every byte of ``path`` against its manifest.

    Returns a small report; raises :class:`CorruptCheckpointError` naming the first damaged
    record (and the tensor that uses it), or :class:`NotAFastPersistCheckpoint`.
    """
    t0 = time.perf_counter()
    is_url, path = remote.split(os.fspath(path))
    if is_url:
        return remote.verify(path)
    view = read_manifest(path)
    check_structure(view)
    scratch = np.empty(_SCRATCH_BYTES, dtype=np.uint8)
    with _native.Reader(path, direct=True) as reader:
        for r in view.manifest.records:
            if r.kind == "storage":
                check_crc(path, r, record_crc(reader, r.offset, r.size, scratch) if r.size else 0)
    return {
        "path": path,
        "records": len(view.manifest.records),
        "bytes": view.manifest.file_size,
        "seconds": time.perf_counter() - t0,
    }


def inspect(path: str | os.PathLike) -> list[dict]:
    """The records of a checkpoint: name, tensor, dtype, size, offset, checksum."""
    path = os.fspath(path)
    try:
        m = read_manifest(path, check_tail=False).manifest
    except NotAFastPersistCheckpoint:
        with zipfile.ZipFile(path) as z:
            return [{"name": i.filename, "size": i.file_size, "offset": i.header_offset} for i in z.infolist()]
    return [
        {"name": r.name, "kind": r.kind, "tensor": r.tensor, "dtype": r.dtype, "size": r.size,
         "offset": r.offset, "crc32c": f"{r.crc32c:08x}"}
        for r in m.records
    ]
