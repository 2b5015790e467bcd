"""A checkpoint read whole into memory, and an unpickler building its tensors there.

The file is read into one fresh, page-aligned buffer laid out like the file: O_DIRECT
straight into it (no staging copy, no page cache, several reads in flight), its pages
faulted in by a thread running ahead of the reads, and the CRC-32C of every storage record
computed on the read threads right after its bytes arrive. The unpickler then builds
every tensor on a slice of that buffer (:mod:`fp_core.format.plain_unpickle` for a plain pickle,
else torch's own, ``torch.serialization._load``, the function behind
``torch.load(mmap=True)``), so storage bytes are read once and never
copied; loaded CPU tensors share one allocation the size of the file, as those of
``torch.load(mmap=True)`` share one mapping.

The unpickling waits for the whole read: torch's zip reader reads a local header per
storage, and those small reads, made from the descriptor while the large reads stream,
cost more than they would overlap (from memory they cost nothing). The checks
(the manifest against the zip's headers, the structure) read memory too.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import inspect
import io
import mmap
import os
import pickle
import threading
import weakref
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .. import _native
from ..errors import CorruptCheckpointError
from ..format import plain_unpickle
from ..format.manifest import STRUCTURE, RecordInfo
from ..gc_pause import gc_paused
from ..io import read_depth
from ..io.thread_wait import wait_until_out
from .integrity import CheckpointFile, ManifestView, check_crc, check_records_against_zip, check_structure

_PAGE = mmap.PAGESIZE


def _torch_unpickle() -> Any:
    """``torch.serialization._load`` when it takes ``overall_storage`` (torch >= 2.1), else None."""
    fn = getattr(torch.serialization, "_load", None)
    try:
        return fn if fn is not None and "overall_storage" in inspect.signature(fn).parameters else None
    except (TypeError, ValueError):
        return None


_UNPICKLE = _torch_unpickle()
AVAILABLE = _UNPICKLE is not None


def _on_cpu(map_location: Any) -> bool:
    """Whether ``map_location`` leaves a CPU file's tensors on the CPU (None, or the CPU)."""
    if map_location is None:
        return True
    if isinstance(map_location, str):
        return map_location == "cpu"
    return isinstance(map_location, torch.device) and map_location.type == "cpu"


def applies(map_location: Any, mapped: bool = False) -> bool:
    """Whether to read a file whole for this load: where its tensors stay on the CPU
    (``map_location`` None or CPU; a file saved from device tensors read with None waits
    for its bytes anyway), and where torch takes each storage's offset from its zip
    header (``torch.utils.serialization.config.load.calculate_storage_offsets`` off, its
    default: computed offsets assume torch's own layout, not FastPersist's async one).
    Loads onto a device keep the per-storage reads: a whole-file host buffer would double
    their peak host memory. A ``mapped`` load (``mmap=True``) applies to every
    ``map_location``: its host buffer is the file's page cache, not memory of its own."""
    from torch.utils.serialization import config

    if not AVAILABLE or getattr(config.load, "calculate_storage_offsets", False):
        return False
    if mapped and str(map_location) != "meta":  # meta tensors read no bytes: nothing to map in
        return True
    return _on_cpu(map_location)


def resolve_weights_only(weights_only: bool | None) -> bool:
    """What ``torch.load`` itself would use: its default and its two forcing variables."""
    not_set = weights_only is None
    if not_set:
        default = getattr(torch.serialization, "_default_to_weights_only", None)
        weights_only = default(None) if default is not None else True
    truthy = ("1", "y", "yes", "true")
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in truthy:
        return True
    if os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in truthy and not_set:
        return False
    return bool(weights_only)


class _FaultAhead:
    """Faults fresh pages in (MADV_POPULATE_WRITE) on a thread of its own, ahead of the
    reads, which walk the buffer in the same order. One populate call faults a range in
    far faster than the reads' page-by-page faults, and faults do not run in parallel
    (a VM serialises them), so one thread running ahead takes them off the reads' path."""

    STEP = 32 << 20

    def __init__(self, addr: int, length: int) -> None:
        self._addr, self._length = addr, length
        self._stopped = threading.Event()
        self._out = threading.Event()  # the thread no longer touches the buffer
        self._thread = threading.Thread(target=self._run, name="fastpersist-fault-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for off in range(0, self._length, self.STEP):
                if self._stopped.is_set():
                    return
                try:
                    _native.populate(self._addr + off, min(self.STEP, self._length - off))
                except OSError:
                    return  # the reads fault the pages in themselves
        finally:
            self._out.set()

    def stop(self) -> None:
        """Stop and wait until the thread no longer touches the buffer (it must never
        outlive it); on an event, not by join(): see :mod:`fp_core.io.thread_wait`."""
        self._stopped.set()
        wait_until_out(self._out)


def read_image(cf: CheckpointFile, checked: list[RecordInfo]) -> mmap.mmap:
    """The file's bytes in a fresh page-aligned buffer (one native read, O_DIRECT straight
    into it); each of the ``checked`` storage records' CRC-32C is computed on the read
    threads as its bytes land and compared with its manifest's."""
    # Private anonymous memory (Python's default for -1 is a shared, shmem-backed mapping).
    # No MADV_HUGEPAGE: with this kernel's "defrag=madvise", huge-page faults compact
    # memory and fault slower than 4 KiB pages (docs/performance.md, "Fresh memory").
    length = max(_PAGE, -(-cf.size // _PAGE) * _PAGE)
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        faulting = _FaultAhead(addr, length)
        try:
            with cf.native_reader() as reader:
                _, crcs = reader.read_into(0, addr, cf.size, threads=read_depth.THREADS, chunk_bytes=read_depth.CHUNK,
                                           ranges=[(r.offset, r.size) for r in checked])
        finally:
            faulting.stop()
        for r, crc in zip(checked, crcs):
            check_crc(cf.path, r, crc)
    except BaseException:
        buf.close()
        raise
    return buf


MAP_CHUNK = 16 << 20  # a populate call's share of a mapped file: several in flight, each reading ahead
MAP_THREADS = 4  # populate calls in flight: each keeps the kernel's reads of its range going


def map_image(cf: CheckpointFile, checked: list[RecordInfo]) -> memoryview | None:
    """The file mapped private (copy-on-write), its pages read in by the kernel before
    anything is unpickled, ``MAP_THREADS`` ranges at once; each of the ``checked``
    storage records' CRC-32C computed on the same threads as its pages arrive. None where
    this kernel cannot read a mapping in without touching it (MADV_POPULATE_READ, Linux
    5.14): the caller reads into memory of its own instead.

    Page-cache pages are filled by the disk, where new anonymous memory is first zeroed
    by the guest: on a VM the mapping can read near the disk's speed where fresh memory
    cannot, though not in every hour (docs/performance.md, "Mapped loads"). The tensors built on it stay mapped
    on the file, as those of ``torch.load(mmap=True)``: pages written are copied (private),
    and the file must not be truncated or rewritten in place while they live (FastPersist's
    saves replace files by rename, which leaves a mapped file as it was). A file found
    shorter than it was opened, while its ranges are read in, is a CorruptCheckpointError;
    one truncated after that raises SIGBUS where its pages are next read, as any mapping's.
    """
    buf = _map_private(cf.fd, cf.size)
    if buf is None:  # a filesystem that cannot map files: memory of its own
        return None
    return buf if read_mapping_in(cf, buf, checked) else None  # unmapped when dropped


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_private(fd: int, size: int) -> memoryview | None:
    """``size`` bytes of ``fd`` mapped private (copy-on-write), as a writable byte
    memoryview; unmapped once nothing refers to it (the tensors built on it). Mapped here
    rather than by Python's mmap, which keeps a duplicate of the descriptor open for the
    mapping's life (one per loaded file). None where the filesystem cannot map files."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    region = (ctypes.c_char * size).from_address(addr)
    weakref.finalize(region, _libc.munmap, addr, size)
    return memoryview(region).cast("B")


def _truncated(cf: CheckpointFile, off: int, end: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(cf.path, STRUCTURE, "the file was truncated while it was being loaded "
                                  f"(bytes [{off}, {end}) of {cf.size} are gone)")


def read_mapping_in(cf: CheckpointFile, buf: Any, checked: list[RecordInfo]) -> bool:
    """:func:`map_image`'s reads of ``buf``, the file's mapping; False where the kernel
    cannot (nothing read)."""
    addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    try:  # the first page asks the kernel whether it can
        _native.populate(addr, min(_PAGE, cf.size), write=False)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        if e.errno == errno.EFAULT:
            raise _truncated(cf, 0, min(_PAGE, cf.size)) from None
        raise
    ends = [r.offset + r.size for r in checked]

    def chunk(off: int) -> list[tuple[int, int, int]]:
        end = min(off + MAP_CHUNK, cf.size)
        try:
            _native.populate(addr + off, end - off, write=False)
        except OSError as e:
            if e.errno == errno.EFAULT:  # a page past the file's end: it shrank since it was opened
                raise _truncated(cf, off, end) from None
            raise OSError(e.errno, f"{cf.path}: reading the mapped file in: {e.strerror}") from None
        pieces = []
        i = bisect.bisect_right(ends, off)  # the first record ending after off
        while i < len(checked) and checked[i].offset < end:
            lo, hi = max(off, checked[i].offset), min(end, ends[i])
            pieces.append((i, _native.crc32c_addr(addr + lo, hi - lo), hi - lo))
            i += 1
        return pieces

    crcs: dict[int, int] = {}
    with ThreadPoolExecutor(MAP_THREADS, thread_name_prefix="fastpersist-map") as pool:
        for pieces in pool.map(chunk, range(0, cf.size, MAP_CHUNK)):  # in file order
            for i, crc, n in pieces:
                crcs[i] = _native.crc32c_combine(crcs[i], crc, n) if i in crcs else crc
    for i, r in enumerate(checked):
        check_crc(cf.path, r, crcs[i])
    return True


class PositionedReader(io.RawIOBase):
    """A read-only file object of ``_size`` bytes with a position (``_pos``): the seeking
    part of the file objects handed to torch's zip reader."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        if base + offset < 0:
            raise OSError(22, f"seek to byte {base + offset}")
        self._pos = base + offset
        return self._pos


class _MemoryFile(PositionedReader):
    """The file's bytes, already in memory, as the file object torch's zip reader wants."""

    def __init__(self, data: memoryview) -> None:
        super().__init__(len(data))
        self._data = data

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), len(self._data) - self._pos))
        mv[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


class _RecordSlices:
    """What torch's unpickler slices each storage from (its ``overall_storage``): the
    file's buffer, where every slice taken must be, once checked, a storage record's exact
    offset and size. A pickle that asks for other bytes (a neighbour's, a header's, past the
    file) is a :class:`CorruptCheckpointError`, never a tensor over them."""

    def __init__(self, path: str, storage: torch.UntypedStorage, size: int) -> None:
        self._path = path
        self._storage = storage
        self._size = size
        self.taken: list[tuple[int, int]] = []

    def __getitem__(self, key: slice) -> torch.UntypedStorage:
        start, stop = key.start, key.stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= self._size):
            raise CorruptCheckpointError(self._path, "data.pkl", f"the pickle asks for storage bytes [{start}, "
                                         f"{stop}) of a {self._size}-byte file")
        self.taken.append((start, stop - start))
        return self._storage[start:stop]

    def check(self, records: dict[int, int]) -> None:
        for start, n in self.taken:
            if records.get(start) != n:
                raise CorruptCheckpointError(self._path, "data.pkl", f"the pickle asks for {n} storage bytes at "
                                             f"byte {start}, where no storage record of that size lies")


def storage_records(cf: CheckpointFile, view: ManifestView | None) -> dict[int, int]:
    """Data offset -> size of every ``<archive>/data/<key>`` record (checked to lie in the file)."""
    if view is not None:
        return {r.offset: r.size for r in view.manifest.records if r.kind == "storage"}
    infos = storage_entries(cf)
    return {off: info.file_size for info, off in zip(infos, cf.data_offsets(infos))}


def storage_entries(cf: CheckpointFile) -> list[zipfile.ZipInfo]:
    """The zip's ``<archive>/data/<key>`` entries (stored, not compressed)."""
    out = []
    for info in cf.zip_directory()[0]:
        parts = info.filename.split("/")
        if len(parts) == 3 and parts[1] == "data" and info.compress_type == zipfile.ZIP_STORED:
            out.append(info)
    return out


def _checked_records(cf: CheckpointFile, view: ManifestView) -> list[RecordInfo]:
    """The storage records to checksum while reading: the manifest's (whose tail CRC held;
    they are matched against the zip's headers once the bytes are in memory), sorted,
    disjoint and inside the file, as the native reader needs them."""
    out = sorted((r for r in view.manifest.records if r.kind == "storage" and r.size), key=lambda r: r.offset)
    end = 0
    for r in out:
        if r.offset < end or r.size < 0 or r.offset + r.size > cf.size:
            raise CorruptCheckpointError(cf.path, STRUCTURE, f"record {r.name} ({r.size} bytes at byte {r.offset}) "
                                         "overlaps another or runs past the end of the file")
        end = r.offset + r.size
    return out


def unpickle(zf: Any, map_location: Any, weights_only: bool, slices: Any, path: str) -> Any:
    """torch's unpickler over ``zf``, every storage sliced from ``slices`` (its ``overall_storage``)."""
    if not weights_only:
        return _UNPICKLE(zf, map_location, pickle, overall_storage=slices, encoding="utf-8")
    try:
        return _UNPICKLE(zf, map_location, torch.serialization._weights_only_unpickler, overall_storage=slices,
                         encoding="utf-8")
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"Weights only load failed for {path}: {e}\nLoad with weights_only=False "
                                     "only if you trust the file's source.") from None


def _cpu_slices_at(zf: Any, slices: _RecordSlices) -> plain_unpickle.StorageAt:
    """Storages saved from the CPU, as slices of the file's buffer (what torch's unpickler
    makes of them with ``map_location`` None or the CPU); others are not plain here."""
    def storage_at(key: str, nbytes: int, location: str) -> torch.UntypedStorage:
        if location != "cpu":
            raise plain_unpickle.NotPlain(location)
        start = zf.get_record_offset(f"data/{key}")
        return slices[start:start + nbytes]
    return storage_at


def load_image(cf: CheckpointFile, view: ManifestView | None, map_location: Any, weights_only: bool | None,
               mapped: bool = False) -> Any:
    """torch.load of ``cf`` read whole (see the module); ``NotImplemented`` for a TorchScript
    archive, which ``torch.load`` must handle. With ``view`` (verify), every storage
    record (on the read threads), the manifest against the zip's headers, the zip
    structure and the small records (the pickle among them) are checked before anything
    is unpickled. ``mapped``: the tensors are built on the file's private mapping
    (:func:`map_image`) where the kernel allows, else on memory of their own."""
    wo = resolve_weights_only(weights_only)
    checked = _checked_records(cf, view) if view is not None else []
    buf: Any = map_image(cf, checked) if mapped else None
    if buf is None:
        if not _on_cpu(map_location):
            return NotImplemented  # a device load reads storage by storage (see applies)
        buf = read_image(cf, checked)
    try:
        cf.image = memoryview(buf)[:cf.size]  # later reads of cf (checks, records' offsets) from memory
        if view is not None:
            check_records_against_zip(cf, view)
            check_structure(cf, view)
        storage = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
        slices = _RecordSlices(cf.path, storage, cf.size)
        # see gc_pause: a full collection among the unpickled objects costs more than they do
        with gc_paused(), _MemoryFile(cf.image) as f, torch.serialization._open_zipfile_reader(f) as zf:
            if torch.serialization._is_torchscript_zip(zf):
                return NotImplemented
            obj = NotImplemented
            if _on_cpu(map_location):  # plain_unpickle builds CPU tensors only
                obj = plain_unpickle.unpickle(zf, _cpu_slices_at(zf, slices))
            if obj is NotImplemented:
                obj = unpickle(zf, map_location, wo, slices, cf.path)
        slices.check(storage_records(cf, view))
        return obj
    finally:
        if cf.image is not None:
            cf.image.release()
            cf.image = None
