"""Fast loading: ``torch.load`` semantics, the file read at the device's speed.

A zip checkpoint is read whole in one parallel O_DIRECT read and unpickled by torch
itself on top of those bytes (:mod:`fp_core.loading.file_image`). Where that is not possible
(a torch without ``torch.serialization._load(overall_storage=...)``, torch's legacy
format, TorchScript archives) ``torch.load`` reads through :class:`FastReader`, a file
object whose storage-sized reads are native and checked against the manifest.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .. import _native
from ..errors import CheckpointError, NotAFastPersistCheckpoint
from ..gc_pause import gc_paused
from . import file_image, safetensors_file
from .integrity import (
    CheckpointFile,
    ManifestView,
    check_crc,
    check_records_against_zip,
    check_storages,
    check_structure,
    damage_named,
    other_format,
    read_manifest,
)

_NATIVE_MIN = 1 << 20  # reads below this size go through the page cache
_MAX_HEADER_PAD = 4096  # FastPersist pads local headers to 4 KiB; stock torch.save to 64 B


class FastReader(file_image.PositionedReader):
    """A file object over an open :class:`CheckpointFile` for ``torch.load``.

    With ``view`` (a checked manifest), each storage record is checked against its CRC-32C
    as torch reads it.
    """

    def __init__(self, cf: CheckpointFile, view: ManifestView | None = None, threads: int = 4,
                 prefetch: bool = True) -> None:
        super().__init__(cf.size)
        self.cf = cf
        self.path = cf.path
        self._fd = cf.fd
        self._threads = threads
        self._native = cf.native_reader()
        self._view = view
        self._records: dict[tuple[int, int], Any] = {}
        self._checked: set[str] = set()
        if view is not None:
            self._records = {(r.offset, r.size): r for r in view.manifest.records if r.kind == "storage"}
        if prefetch:
            self.prefetch_small_reads()

    def prefetch_small_reads(self) -> None:
        """Ask the kernel to read every small region torch.load will touch, all at once.

        torch reads each record's 30-byte local header, the pickle and the small records
        one by one; on a cold cache each is a device round trip. Their offsets are
        all in the central directory, so one POSIX_FADV_WILLNEED per region queues them
        together. Large records are left out: they are read with O_DIRECT below.
        """
        try:
            infos = self._view.entries if self._view is not None else self.cf.zip_directory()[0]
        except CheckpointError:
            return  # not a zip: torch.load will say so
        ranges = []
        for i in infos:
            head = 30 + len(i.filename.encode()) + _MAX_HEADER_PAD
            small = i.file_size < _NATIVE_MIN
            ranges.append((i.header_offset, i.header_offset + head + (i.file_size if small else 0)))
        ranges.sort()
        merged: list[list[int]] = []
        for lo, hi in ranges:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            if lo < self._size:
                os.posix_fadvise(self._fd, lo, min(hi, self._size) - lo, os.POSIX_FADV_WILLNEED)

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = min(len(mv), max(0, self._size - self._pos))
        if n == 0:
            return 0
        rec = self._records.get((self._pos, n))
        if n >= _NATIVE_MIN:
            addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data
            crc = self._native.read_into(self._pos, addr, n, checksum=rec is not None, threads=self._threads)
        else:
            n = os.preadv(self._fd, [mv[:n]], self._pos)
            crc = _native.crc32c(mv[:n]) if rec is not None else 0
        if rec is not None:
            check_crc(self.path, rec, crc)
            self._checked.add(rec.name)
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self._size - self._pos
        buf = bytearray(max(0, min(size, self._size - self._pos)))
        n = self.readinto(buf)
        return bytes(buf[:n])

    def check_unread(self) -> None:
        """Records torch.load never asked for are still checked, so verify=True covers all."""
        if self._view is not None:
            check_storages(self.cf, self._view, [r for r in self._records.values() if r.name not in self._checked])

    def close(self) -> None:
        if not self.closed:
            self._native.close()
        super().close()


def load(path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None,
         verify: bool | str = False, mmap: bool = False) -> Any:
    """``torch.load`` of the local file ``path`` through the fast reader.

    ``verify=True`` checks every byte against the manifest (raising
    :class:`CorruptCheckpointError` naming the damaged record) while loading; storages
    are checked as they are read, so this costs a fraction of a separate ``verify``.
    ``verify="auto"`` does the same when the file has a manifest and loads a file
    written by another tool unchecked (``verify=True`` raises
    :class:`NotAFastPersistCheckpoint` for it). The file is opened once: the check and the
    load read the same file even if its name is replaced meanwhile. Without a check, a
    load that fails on a damaged file raises :class:`CorruptCheckpointError` naming the
    damage where the file's structure shows it (its own error chained); damage inside
    tensor bytes is found only by ``verify``.

    ``mmap=True``: as ``torch.load(mmap=True)``, the tensors are built on a private
    (copy-on-write) mapping of the file, whose pages the kernel reads in on several
    threads before the call returns (see :func:`fp_core.loading.file_image.map_image`). A file
    that cannot be read whole (torch's legacy format, a TorchScript archive) or a kernel
    older than Linux 5.14 gets tensors in memory of their own, as without it.

    A safetensors file (``fp_core.save(..., format="safetensors")``, a ``model.safetensors``)
    loads as ``safetensors.torch.load_file`` would: a ``{name: tensor}`` dict, checked
    against the checksums FastPersist writes into its header with ``verify`` (``True``: a
    file without any raises :class:`NotAFastPersistCheckpoint`). A JSON file raises
    :class:`NotAFastPersistCheckpoint` saying so.
    """
    if verify not in (True, False, "auto"):
        raise ValueError(f"verify must be True, False or 'auto', not {verify!r}")
    with CheckpointFile(path) as cf:
        kind = other_format(cf)
        if kind == "safetensors":  # FastPersist writes these too: loaded as load_file does
            return safetensors_file.load(cf, map_location, verify)
        if kind == "json":
            raise NotAFastPersistCheckpoint(f"{cf.path} is a JSON file, not a torch checkpoint: read it with "
                                            "json.load")
        whole = file_image.applies(map_location, mapped=mmap) and cf.pread(0, 4) == b"PK\x03\x04"
        view = None
        if verify:
            try:
                # read whole, the records are matched with the zip's headers in memory
                with gc_paused():  # see gc_pause: the zip directory's entries, the manifest's records
                    view = read_manifest(cf, check_records=not whole)
            except NotAFastPersistCheckpoint:
                if verify is True:
                    raise
        if view is None:  # unchecked: a load that fails on a damaged file says so
            with damage_named(cf):
                return _load(cf, None, whole, map_location, weights_only, mmap)
        return _load(cf, view, whole, map_location, weights_only, mmap)


def _load(cf: CheckpointFile, view: ManifestView | None, whole: bool, map_location: Any,
          weights_only: bool | None, mmap: bool) -> Any:
    """load's work once the file is open (and its manifest read and checked, ``view``)."""
    if whole:
        obj = file_image.load_image(cf, view, map_location, weights_only, mapped=mmap)
        if obj is not NotImplemented:
            return obj
        if view is not None:
            check_records_against_zip(cf, view)
    if view is not None:
        # Tail, structure and small records first: a damaged header must not
        # reach the unpickler. Storages are checked during the load below.
        check_structure(cf, view)
    with gc_paused(), FastReader(cf, view) as f:  # see gc_pause: the unpickled objects
        obj = torch.load(f, map_location=map_location, weights_only=weights_only)
        f.check_unread()
    return obj


__all__ = ["load", "FastReader"]
