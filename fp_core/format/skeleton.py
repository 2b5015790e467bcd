"""Capture torch.save's zip skeleton without materialising any tensor bytes.

torch writes a checkpoint as a stored (uncompressed) zip. Under
``torch.serialization.skip_data()`` it still writes every header, the pickle and the
small records, but *seeks over* each storage's bytes. :class:`SparseFile` records those
writes and seeks, so a 4 GiB checkpoint yields a skeleton of a few KiB plus a list of holes.
Storage alignment is raised to the O_DIRECT block size so that every storage's bytes start
on a block boundary (a tensor that sits on a page in memory is then written without a
copy), except for a plain state of many small tensors, where that padding would be a large
share of the file (:func:`storage_alignment`). A plain state is pickled by
:mod:`.state_pickle` rather than torch's pickler, into the same bytes.
"""

from __future__ import annotations

import bisect
import io
import pickle
import sys
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch.utils.serialization import config as _ser_config

from . import ziptail
from .state_pickle import NotPlainState, StorageEntry, plain_cpu_tensor
from .state_pickle import dumps as dumps_state

_STORAGE_TYPES = (torch.storage.TypedStorage, torch.UntypedStorage)

# torch's save config is process-global; serialise our patches of it.
_CONFIG_LOCK = threading.Lock()

_REBUILD_V2 = torch._utils._rebuild_tensor_v2


def fast_tensor_reduce(t: Any) -> Any:
    """What ``torch.Tensor.__reduce_ex__`` returns for a plain dense CPU tensor, built
    without its generic path; ``NotImplemented`` for every other object.

    torch's reduction of each tensor first runs a dozen checks for subclasses, fake,
    quantized, sparse, nested and device tensors, then builds its ``TypedStorage``
    wrapper through an argument-checking constructor twice. For the one case a state dict
    is made of (:func:`state_pickle.plain_cpu_tensor`) the result is the same tuple torch
    builds, so the pickle is byte for byte torch's (tests compare the two); anything else
    takes torch's own path. Used where :func:`state_pickle.dumps` does not apply.
    """
    if not plain_cpu_tensor(t):
        return NotImplemented
    # TypedStorage(wrap_storage=..., dtype=..., _internal=True) sets exactly these two.
    storage = object.__new__(torch.storage.TypedStorage)
    storage._untyped_storage = t.untyped_storage()
    storage.dtype = t.dtype
    return _REBUILD_V2, (storage, t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad, OrderedDict())


class SparseFile(io.RawIOBase):
    """A seekable, writable file whose unwritten regions are holes that cost no memory.

    Written regions are kept as sorted, non-overlapping ``(offset, bytearray)`` segments.
    Reads of holes return zeros (zipfile only ever reads the written header regions).
    """

    def __init__(self) -> None:
        super().__init__()
        self._starts: list[int] = []
        self._segs: list[bytearray] = []
        self._pos = 0
        self._size = 0

    @classmethod
    def adopt(cls, starts: list[int], segs: list[bytearray], size: int) -> SparseFile:
        """A file of these written segments (sorted, non-overlapping, non-empty) and size."""
        f = cls()
        f._starts, f._segs, f._size = starts, segs, size
        return f

    # -- io.RawIOBase protocol -------------------------------------------------------
    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError("negative seek position")
        self._pos = pos
        # A seek past the end (torch skipping a storage) extends the file with a hole.
        self._size = max(self._size, pos)
        return pos

    def write(self, data: Any) -> int:
        n = len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes
        if n:
            pos = self._pos
            if self._starts and self._starts[-1] + len(self._segs[-1]) == pos:
                self._segs[-1] += data  # appending to the last segment: torch writes in order
            else:
                self._put(pos, bytes(data))
            self._pos = pos + n
            if self._pos > self._size:
                self._size = self._pos
        return n

    def readinto(self, buf: Any) -> int:
        mv = memoryview(buf).cast("B")
        n = max(0, min(len(mv), self._size - self._pos))
        mv[:n] = self.pread(self._pos, n)
        self._pos += n
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        i = bisect.bisect_left(self._starts, size)  # segments from here on start past the end
        del self._starts[i:], self._segs[i:]
        if i and self._starts[i - 1] + len(self._segs[i - 1]) > size:
            del self._segs[i - 1][size - self._starts[i - 1]:]
        self._size = size
        return size

    def flush(self) -> None:
        pass

    # -- segment bookkeeping ----------------------------------------------------------
    def _put(self, off: int, data: bytes) -> None:
        end = off + len(data)
        i = bisect.bisect_right(self._starts, off) - 1
        # Fast path: torch and zipfile write sequentially, so most writes append.
        if i >= 0:
            s, b = self._starts[i], self._segs[i]
            if s + len(b) == off and (i + 1 == len(self._starts) or self._starts[i + 1] >= end):
                b.extend(data)
                return
        # General path: replace only the segments the write overlaps (a slice, found by
        # bisection), keeping the heads and tails that stick out. Each torch storage
        # skipped by a seek starts a new segment, so this runs once per record.
        lo = max(0, i)
        if lo < len(self._starts) and self._starts[lo] + len(self._segs[lo]) <= off:
            lo += 1
        hi = bisect.bisect_left(self._starts, end, lo)
        new_starts, new_segs = [], []
        if lo < hi and self._starts[lo] < off:
            new_starts.append(self._starts[lo])
            new_segs.append(self._segs[lo][: off - self._starts[lo]])
        new_starts.append(off)
        new_segs.append(bytearray(data))
        if lo < hi:
            s_last, b_last = self._starts[hi - 1], self._segs[hi - 1]
            if s_last + len(b_last) > end:
                new_starts.append(end)
                new_segs.append(b_last[end - s_last :])
        self._starts[lo:hi] = new_starts
        self._segs[lo:hi] = new_segs

    @property
    def size(self) -> int:
        return self._size

    def segments(self) -> list[tuple[int, bytes]]:
        """Written regions as ``(offset, bytes)``, sorted, non-overlapping."""
        return [(s, bytes(b)) for s, b in zip(self._starts, self._segs) if b]

    def segments_in(self, off: int, n: int) -> list[tuple[int, bytes]]:
        """The written parts of [off, off + n) as ``(offset relative to off, bytes)``."""
        return [(rel, bytes(v)) for rel, v in self.views_in(off, n)]

    def pread(self, off: int, n: int) -> bytes:
        end = off + n
        i = max(0, bisect.bisect_right(self._starts, off) - 1)
        if i < len(self._starts) and self._starts[i] <= off and end <= self._starts[i] + len(self._segs[i]):
            s = self._starts[i]  # inside one written segment: the common case (headers, the pickle)
            return bytes(self._segs[i][off - s: end - s])
        out = bytearray(n)
        while i < len(self._starts) and self._starts[i] < end:
            s, b = self._starts[i], self._segs[i]
            lo, hi = max(s, off), min(s + len(b), end)
            if lo < hi:
                out[lo - off : hi - off] = b[lo - s : hi - s]
            i += 1
        return bytes(out)

    def view(self, off: int, n: int) -> memoryview | bytes:
        """The bytes of [off, off + n) without a copy where one written segment holds them
        all (headers, gaps between storages); else as :meth:`pread`. Do not keep the view:
        a segment cannot grow while one exists."""
        i = bisect.bisect_right(self._starts, off) - 1
        if i >= 0:
            s = self._starts[i]
            seg = self._segs[i]
            if off + n <= s + len(seg):
                return memoryview(seg)[off - s: off + n - s]
        return self.pread(off, n)

    def _span(self, off: int, end: int) -> range:
        """Indices of the segments that may hold bytes of [off, end)."""
        starts = self._starts
        return range(max(0, bisect.bisect_right(starts, off) - 1), bisect.bisect_left(starts, end))

    def views_in(self, off: int, n: int) -> list[tuple[int, memoryview]]:
        """:meth:`segments_in` without copies (same caveat as :meth:`view`)."""
        out, end = [], off + n
        starts, segs = self._starts, self._segs
        for i in self._span(off, end):
            s, b = starts[i], segs[i]
            lo, hi = max(s, off), min(s + len(b), end)
            if lo < hi:
                out.append((lo - off, memoryview(b)[lo - s: hi - s]))
        return out

    def gather(self, off: int, n: int) -> tuple[bytes, list[tuple[int, int]]]:
        """The written parts of [off, off + n) joined into one buffer, and where each lies:
        ``(offset relative to off, length)``, in order, back to back in the buffer. One
        join, with no view object per segment (a plan has one segment per storage)."""
        parts: list = []
        where: list[tuple[int, int]] = []
        end = off + n
        starts, segs = self._starts, self._segs
        for i in self._span(off, end):
            s, b = starts[i], segs[i]
            lo, hi = max(s, off), min(s + len(b), end)
            if lo < hi:
                parts.append(b if lo == s and hi == s + len(b) else memoryview(b)[lo - s: hi - s])
                where.append((lo - off, hi - lo))
        return b"".join(parts), where

    def pwrite(self, off: int, data: bytes) -> None:
        self._put(off, data)
        self._size = max(self._size, off + len(data))


class _StorageRecorder:
    """Which storage got which record key in one torch.save (see :class:`_RecordingPickler`)."""

    def __init__(self, fast_tensors: bool = True, on_storage: Any = None) -> None:
        self.storages: dict[str, StorageEntry] = {}
        self.fast_tensors = fast_tensors
        self.on_storage = on_storage  # called with (key, entry) for each new key

    def record(self, key: str, obj: Any) -> None:
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
        else:
            storage, dtype = obj, torch.uint8
        new = key not in self.storages
        entry = self.storages[key] = (storage, dtype, storage.nbytes())
        if new and self.on_storage is not None:
            self.on_storage(key, entry)


_current = threading.local()  # the recorder of the capture running on this thread


class _RecordingPickler(pickle.Pickler):
    """The ``Pickler`` of the ``pickle_module`` we hand torch.save.

    torch.save builds its pickler as a subclass of ``pickle_module.Pickler`` whose
    ``persistent_id`` assigns record keys; wrapping that method (instead of re-implementing
    the key assignment) keeps us exactly in step with torch's own numbering and dtype
    checks. One class for every save, and no reference from the pickler's attributes back
    to the pickler: its memo holds every reduced tensor's storage, and a reference cycle
    would keep those alive (and leave tens of thousands of objects to the garbage
    collector) after the save instead of freeing them when torch.save returns.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        recorder: _StorageRecorder = _current.recorder
        torch_persistent_id = type(self).persistent_id
        this = weakref.ref(self)

        def persistent_id(obj: Any) -> Any:
            # torch's persistent_id returns None for anything but a storage; the pickler
            # asks for every object (tens of thousands per checkpoint), so the cheap type
            # test comes first.
            if not isinstance(obj, _STORAGE_TYPES):
                return None
            pid = torch_persistent_id(this(), obj)
            if pid is not None and pid[0] == "storage":
                recorder.record(pid[2], obj)
            return pid

        # An instance attribute wins over the class method when the C pickler looks up
        # persistent_id at construction.
        self.persistent_id = persistent_id
        self.fast_tensors = recorder.fast_tensors
        super().__init__(*args, **kwargs)

    def reducer_override(self, obj: Any) -> Any:  # called for non-builtin types only
        return fast_tensor_reduce(obj) if self.fast_tensors else NotImplemented


_PICKLE_MODULE = types.SimpleNamespace(Pickler=_RecordingPickler, Unpickler=pickle.Unpickler, __name__="pickle",
                                       load=pickle.load)


def capture(obj: Any, alignment: int, fast_tensors: bool = True, names: dict[int, tuple[str, str]] | None = None,
            plain_alignment: int | None = None) -> tuple[SparseFile, dict[str, StorageEntry]]:
    """torch.save's file for ``obj`` with data skipped: the skeleton and its storages by key.

    A plain state (:mod:`.state_pickle`) is pickled by our own writer and laid out by
    torch's zip writer; anything else runs torch.save itself under ``skip_data``, its
    tensors reduced by :func:`fast_tensor_reduce`. ``fast_tensors=False``: torch.save and
    torch's own reduction for everything (the tests compare the three). ``names`` is
    filled as :func:`state_pickle.dumps` does where our writer ran, left alone otherwise.
    ``plain_alignment``: the storage alignment where our writer ran (its tensors are all
    on the CPU) and block padding would be a large share of the file (see
    :func:`storage_alignment`), instead of ``alignment``."""
    if fast_tensors:
        try:
            data, storages = dumps_state(obj, names)
        except NotPlainState:
            pass
        else:
            return plain_skeleton(data, storages, alignment, plain_alignment), storages
    return torch_capture(obj, alignment, fast_tensors)


def torch_capture(obj: Any, alignment: int, fast_tensors: bool = True,
                  on_storage: Any = None) -> tuple[SparseFile, dict[str, StorageEntry]]:
    """torch.save's own file for ``obj`` with data skipped (its pickler, torch's order);
    ``on_storage(key, entry)`` is called for each storage as its pickler finds it."""
    sparse = SparseFile()
    recorder = _current.recorder = _StorageRecorder(fast_tensors, on_storage)
    with _CONFIG_LOCK:
        with _ser_config.patch({"save.storage_alignment": alignment, "save.compute_crc32": False}):
            with torch.serialization.skip_data():
                try:
                    torch.save(obj, sparse, pickle_module=_PICKLE_MODULE)
                finally:
                    _current.recorder = None
    return sparse, recorder.storages


def record_bytes(sparse: SparseFile, suffix: str) -> bytes:
    """The bytes of the skeleton's record whose name ends with ``suffix`` (``/data.pkl``)."""
    for e in ziptail.read_directory(sparse).entries:
        if e.name.endswith(suffix):
            return sparse.pread(ziptail.local_data_offset(sparse, e.header_offset), e.file_size)
    raise KeyError(suffix)


def storage_alignment(storages: dict[str, StorageEntry], alignment: int, plain_alignment: int | None) -> int:
    """``plain_alignment`` where padding each storage to ``alignment`` (half a block each,
    on average) would add more than 1/32 to the bytes: a state of thousands of small
    tensors. Otherwise blocks, where a storage that sits on a page in memory is written
    without a staging copy. Sizes alone decide: the same state gets the same file in every
    process (a collective save's ranks compare their layouts)."""
    if not plain_alignment or not storages:
        return alignment
    total = sum(n for _, _, n in storages.values())
    return plain_alignment if len(storages) * (alignment // 2) * 32 > total else alignment


class _SkeletonSink:
    """The file object torch's zip writer writes a skeleton into.

    The writer calls ``write`` four times per record (header, name, padding, data
    descriptor) and ``seek`` over each storage's bytes; ``write`` is the current segment's
    own ``bytearray.extend`` (the writer looks it up per call), so the thousands of small
    writes of a large state cost no Python frame each.
    """

    def __init__(self) -> None:
        self.starts = [0]
        self.segs = [bytearray()]
        self.write = self.segs[0].extend
        self.skipped = 0  # where the last skipped (storage) range began

    @property
    def position(self) -> int:
        return self.starts[-1] + len(self.segs[-1])

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_CUR or offset < 0:
            raise ValueError(f"unexpected seek ({offset}, {whence}) from torch's zip writer")
        end = self.starts[-1] + len(self.segs[-1])
        if offset:
            self.skipped = end
            seg = bytearray()
            self.starts.append(end + offset)
            self.segs.append(seg)
            self.write = seg.extend
        return end + offset

    def flush(self) -> None:
        pass

    def sparse_file(self) -> SparseFile:
        keep = [i for i, seg in enumerate(self.segs) if seg]
        return SparseFile.adopt([self.starts[i] for i in keep], [self.segs[i] for i in keep],
                                self.starts[-1] + len(self.segs[-1]))


def plain_skeleton(data: bytes, storages: dict[str, StorageEntry], alignment: int,
                   plain_alignment: int | None) -> SparseFile:
    """The skeleton of a plain state pickled by :mod:`.state_pickle` (``data``, its storages)."""
    return _zip_skeleton(data, storages, storage_alignment(storages, alignment, plain_alignment))


class StoragesFirst:
    """A state's skeleton with its storages' records first, laid out one by one as a
    pickler finds them (``on_storage`` of :func:`state_pickle.dumps` or
    :func:`torch_capture`), so their bytes can be written before ``data.pkl`` exists. torch's reader finds records through the central
    directory, so their order in the file is free; the records are the ones
    :func:`_zip_skeleton` writes, through the same writer. The storage alignment is decided
    by the storages found when the layout begins (sizes alone, as :func:`storage_alignment`)."""

    def __init__(self, first: dict[str, StorageEntry], alignment: int, plain_alignment: int | None) -> None:
        """``first``: the storages found when the layout begins; their sizes decide the
        storage alignment. Each storage is then laid out by :meth:`add`."""
        self.alignment = storage_alignment(first, alignment, plain_alignment)
        self._sink = _SkeletonSink()
        self._writer = torch._C.PyTorchFileWriter(self._sink, False, self.alignment)
        self._taken = 0  # segments handed out by take()
        self.offsets: list[tuple[str, int]] = []  # (key, offset of its bytes) of each storage with bytes

    def add(self, key: str, nbytes: int) -> int:
        """Lay out the next storage's record; where its bytes go."""
        self._writer.write_record_metadata(f"data/{key}", nbytes)
        if not nbytes:
            return self._sink.position
        self.offsets.append((key, self._sink.skipped))
        return self._sink.skipped

    @property
    def end(self) -> int:
        """Every byte before this is final (until :meth:`finish`)."""
        return self._sink.position

    def take(self, lo: int, hi: int) -> SparseFile:
        """A copy of the skeleton's bytes in [lo, hi) (``hi`` <= :attr:`end`); calls come
        in file order, each from where the last one ended."""
        starts, segs = self._sink.starts, self._sink.segs
        i, out_starts, out_segs = self._taken, [], []
        while i < len(segs) and starts[i] < hi:
            s, b = starts[i], segs[i]
            a, z = max(s, lo), min(s + len(b), hi)
            if a < z:
                out_starts.append(a)
                out_segs.append(bytearray(b[a - s: z - s]))
            if s + len(b) > hi or i == len(segs) - 1:  # the rest is the next call's (the last may grow)
                break
            i += 1
        self._taken = i
        return SparseFile.adopt(out_starts, out_segs, hi)

    def finish(self, data: bytes) -> SparseFile:
        """The whole skeleton, the pickle ``data`` and torch's small records after the storages."""
        _write_small_records(self._writer, data, self.alignment)
        self._writer.write_end_of_file()
        return self._sink.sparse_file()


def _write_small_records(writer: Any, data: bytes, alignment: int) -> None:
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
    align = str(alignment)
    writer.write_record(".storage_alignment", align, len(align))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))


def _zip_skeleton(data: bytes, storages: dict[str, StorageEntry], alignment: int) -> SparseFile:
    """The records torch.save's ``_save`` writes, in its order, through torch's own zip
    writer (CRCs off, as under our capture's config), storages skipped."""
    sink = _SkeletonSink()
    writer = torch._C.PyTorchFileWriter(sink, False, alignment)
    _write_small_records(writer, data, alignment)
    for key, (_, _, nbytes) in storages.items():
        writer.write_record_metadata(f"data/{key}", nbytes)
    writer.write_end_of_file()
    return sink.sparse_file()
