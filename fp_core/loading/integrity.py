"""Read a checkpoint's manifest and check its bytes against it (``verify``, ``inspect``).

A checkpoint file is untrusted input: every offset, length and name read from it is
checked against the file and against the zip's own central directory before it is used,
and anything that does not fit raises :class:`CorruptCheckpointError` naming the file
(never an ``EOFError``, ``KeyError`` or ``MemoryError`` from deep inside, never work
beyond the file's size). Every read of one check goes through one open descriptor
(:class:`CheckpointFile`), so a file atomically replaced under its name meanwhile (a
trainer rewriting ``last.ckpt``) is checked whole, old or new, never half of each.
"""

from __future__ import annotations

import bisect
import errno
import os
import stat
import struct
import threading
import time
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _native
from ..errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from ..format.manifest import RECORD_SUFFIX, STRUCTURE, TAIL, TAIL_COMMENT_PREFIX, Manifest, RecordInfo
from ..format.plan import structure_ranges
from ..io import read_depth

_CHUNK = 16 << 20  # bytes read at once when checksumming from the descriptor
_SCATTER_BATCH = 64 << 20  # scratch one scatter read fills when checksumming ranges (reused batch after batch)
_EOCD_SCAN = 22 + 0xFFFF  # the zip's end record and the longest comment it can carry
_LOCAL_HEADER = 30
_MANIFEST_BYTES_PER_ENTRY = 64 << 10  # a manifest larger than this per zip entry is not ours
_SMALL_RECORD = 1 << 20  # another tool's records up to this size are checked when a load of its file fails


_PLACEHOLDER_MAX = 4096  # a pending save's placeholder is empty or holds a short text marker


def refuse_placeholder(path: str, size: int) -> None:
    """Raise :class:`CorruptCheckpointError` for what cannot be a checkpoint of any format
    FastPersist reads: the placeholder a pending save leaves under its final name (the
    save never completed: its process was killed or the save failed), or an empty file.
    Said here so that no load or check ends in a bare ``EOFError`` from deep inside."""
    from ..saving.commit import placeholder_owner

    owner = placeholder_owner(path)
    if owner is not None:
        raise CorruptCheckpointError(path, "<file>", f"the placeholder of a save that never completed (writer "
                                     f"{owner}): no checkpoint was written under this name; `fastpersist clean` "
                                     "removes it")
    if size == 0:
        raise CorruptCheckpointError(path, "<file>", "empty file, 0 bytes (a save or copy that never completed?)")


class CheckpointFile:
    """A checkpoint file opened once; every read of one verification or load goes through it.

    Readers that need their own descriptor (the native O_DIRECT reader, zipfile) reopen
    this one through ``/proc/self/fd``: the same inode, whatever happens to the name.
    """

    def __init__(self, path: str | os.PathLike, checkpoint: bool = True) -> None:
        """``checkpoint``: the file is a whole checkpoint, so an empty one or a pending
        save's placeholder is refused (:func:`refuse_placeholder`); False for a part of one
        (a DCP rank file, which a rank with nothing to save leaves empty)."""
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(self.fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory, not a checkpoint file", self.path)
            self.size = st.st_size
            if checkpoint and self.size <= _PLACEHOLDER_MAX:
                refuse_placeholder(self.path, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self._zip: tuple[list[zipfile.ZipInfo], bytes, int] | None = None
        self._headers: dict[int, bytes] = {}  # local header offset -> its fixed 30 bytes, once read
        # The whole file, once a loader has read it through this descriptor: checks then
        # read memory instead of making one small cold read per zip header.
        self.image: memoryview | None = None

    def pread(self, off: int, n: int) -> bytes:
        """``n`` bytes at ``off`` (fewer at the end of the file); ``n`` is capped by the size."""
        if off < 0:
            raise CorruptCheckpointError(self.path, STRUCTURE, f"an offset ({off}) before the start of the file")
        n = max(0, min(n, self.size - off))
        if self.image is not None:
            return bytes(self.image[off:off + n])
        out = bytearray()
        while len(out) < n:
            chunk = os.pread(self.fd, min(n - len(out), _CHUNK), off + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def crc(self, off: int, n: int) -> int:
        """CRC-32C of [off, off + n), read a chunk at a time (memory bounded whatever ``n`` is)."""
        if off < 0 or n < 0:
            raise CorruptCheckpointError(self.path, STRUCTURE, f"a range ({off}, {n} bytes) outside the file")
        if self.image is not None:
            if off + n > self.size:
                raise CorruptCheckpointError(self.path, STRUCTURE, f"file ends at byte {self.size}, before {off + n}")
            return _native.crc32c(self.image[off:off + n])
        crc, pos = 0, 0
        while pos < n:
            chunk = os.pread(self.fd, min(n - pos, _CHUNK), off + pos)
            if not chunk:
                raise CorruptCheckpointError(self.path, STRUCTURE, f"file ends at byte {off + pos}, before {off + n}")
            crc = _native.crc32c(chunk, crc)
            pos += len(chunk)
        return crc

    def native_reader(self) -> _NamedReader:
        return _NamedReader(self.path, _native.Reader(f"/proc/self/fd/{self.fd}", direct=True))

    def zip_directory(self) -> tuple[list[zipfile.ZipInfo], bytes, int]:
        """``(entries, comment, start of the central directory)``, read once."""
        if self._zip is None:
            try:
                with os.fdopen(os.dup(self.fd), "rb") as f, zipfile.ZipFile(f) as z:
                    entries, comment, start_dir = z.infolist(), z.comment, z.start_dir
            except Exception as e:  # noqa: BLE001 - crafted zips raise ValueError, struct.error, EOFError...
                if not self.carries_tail_mark() and self._legacy_torch_file():
                    raise NotAFastPersistCheckpoint(f"{self.path} is in torch's legacy (non-zip) format") from None
                raise CorruptCheckpointError(self.path, STRUCTURE, f"not a complete zip file (truncated?): "
                                             f"{type(e).__name__}: {e}") from None
            bad = next((i for i in entries if not 0 <= i.header_offset < start_dir), None)
            if bad is not None or not 0 <= start_dir <= self.size:
                raise CorruptCheckpointError(self.path, STRUCTURE, "the zip directory points outside the file")
            self._zip = (entries, comment, start_dir)
        return self._zip

    def _legacy_torch_file(self) -> bool:
        """torch.save(..., _use_new_zipfile_serialization=False): a pickle, not a zip."""
        return self.pread(0, 2) in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")

    def carries_tail_mark(self) -> bool:
        """Does the file end in FastPersist's tail-checksum comment? Then it was written with
        a manifest, and a manifest that cannot be found means damage, not another tool."""
        scan = min(self.size, _EOCD_SCAN)
        return TAIL_COMMENT_PREFIX in self.pread(self.size - scan, scan)

    def data_offset(self, info: zipfile.ZipInfo) -> int:
        """Where ``info``'s data starts, from its local header; checked to lie in the file."""
        head = self._headers.get(info.header_offset)
        if head is None:
            head = self.pread(info.header_offset, _LOCAL_HEADER)
        if len(head) < _LOCAL_HEADER or struct.unpack_from("<I", head)[0] != 0x04034B50:
            raise CorruptCheckpointError(self.path, info.filename, f"local header at byte {info.header_offset} "
                                         "is damaged")
        n, e = struct.unpack_from("<HH", head, 26)
        off = info.header_offset + _LOCAL_HEADER + n + e
        if off + info.file_size > self.size:
            raise CorruptCheckpointError(self.path, info.filename, f"{info.file_size} bytes at byte {off} run past "
                                         f"the end of the {self.size}-byte file")
        return off

    def data_offsets(self, infos: list[zipfile.ZipInfo]) -> list[int]:
        """:meth:`data_offset` of each of ``infos``, their local headers read together.

        One native scatter read for all (a cold file's headers lie one before each record,
        spread over the file: read one by one, each is a device round trip); kept, so later
        checks of the same headers read memory.
        """
        todo = sorted({i.header_offset for i in infos if i.header_offset not in self._headers})
        if self.image is None and len(todo) > 1 and todo[-1] + _LOCAL_HEADER <= self.size:
            heads = np.zeros((len(todo), _LOCAL_HEADER), dtype=np.uint8)
            base = heads.ctypes.data
            with self.native_reader() as r:
                r.read_scatter([(off, base + k * _LOCAL_HEADER, _LOCAL_HEADER) for k, off in enumerate(todo)],
                               threads=read_depth.THREADS)
            for k, off in enumerate(todo):
                self._headers[off] = heads[k].tobytes()
        return [self.data_offset(i) for i in infos]

    def crc_of_ranges(self, ranges: list[tuple[int, int]], stop: threading.Event | None = None) -> int:
        """CRC-32C of the bytes of ``ranges`` ((offset, length) pairs, sorted, inside the
        file) one after another (``stop``: see :meth:`crcs_of_ranges`)."""
        crc = 0
        for (_, n), part in zip(ranges, self.crcs_of_ranges(ranges, stop=stop)):
            crc = _native.crc32c_combine(crc, part, n)
        return crc

    def crcs_of_ranges(self, ranges: list[tuple[int, int]], what: str = STRUCTURE,
                       stop: threading.Event | None = None) -> list[int]:
        """CRC-32C of each of ``ranges`` ((offset, length) pairs, sorted by offset, inside
        the file): native scatter reads at the loads' depth, a scratch buffer's worth at a
        time, small ranges read together. ``what`` names the ranges in the error a file
        cut short meanwhile raises. ``stop`` (checked between reads): set, InterruptedError."""
        if self.image is not None:
            return [self.crc(off, n) for off, n in ranges]
        chunk = read_depth.CHUNK
        pieces: list[tuple[int, int, int]] = []  # (offset, length, index of its range)
        for k, (off, n) in enumerate(ranges):  # at most a chunk each, as the scatter read takes them
            pieces += [(p, min(chunk, off + n - p), k) for p in range(off, off + n, chunk)]
        crcs = [0] * len(ranges)
        if not pieces:
            return crcs
        scratch = np.empty(min(_SCATTER_BATCH, sum(n for _, n, _ in pieces)), dtype=np.uint8)
        i = 0
        with self.native_reader() as r:
            while i < len(pieces):  # a batch fills the scratch buffer
                if stop is not None and stop.is_set():
                    raise InterruptedError(f"checking {what} of {self.path} was stopped")
                batch, used = [], 0
                while i < len(pieces) and used + pieces[i][1] <= scratch.nbytes:
                    batch.append((pieces[i][0], scratch.ctypes.data + used, pieces[i][1]))
                    used += pieces[i][1]
                    i += 1
                try:
                    parts = r.read_scatter(batch, checksum=True, threads=read_depth.THREADS, chunk_bytes=chunk)
                except EOFError:
                    end = max(off + n for off, _, n in batch)
                    raise CorruptCheckpointError(self.path, what, f"file ends at byte {self.size}, before "
                                                 f"{end}") from None
                for (_, _, n), (_, _, k), part in zip(batch, pieces[i - len(batch):i], parts):
                    crcs[k] = _native.crc32c_combine(crcs[k], part, n)
        return crcs

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _NamedReader:
    """The native reader of a reopened descriptor, whose errors name the checkpoint's path
    (not ``/proc/self/fd/N``)."""

    def __init__(self, path: str, reader: _native.Reader) -> None:
        self.path, self._r = path, reader

    def read_into(self, *args: Any, **kwargs: Any) -> Any:
        return self._named(self._r.read_into, *args, **kwargs)

    def read_scatter(self, *args: Any, **kwargs: Any) -> list[int]:
        return self._named(self._r.read_scatter, *args, **kwargs)

    def _named(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.path) from e
        except EOFError as e:
            raise EOFError(str(e).replace(repr(self._r.path), repr(self.path))) from e

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> _NamedReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class ManifestView:
    path: str
    manifest: Manifest
    header_offset: int  # where the tail starts (the manifest's local header)
    entries: list[zipfile.ZipInfo] = field(default_factory=list)


def read_manifest(cf: CheckpointFile, check_tail: bool = True, check_records: bool = True) -> ManifestView:
    """Locate, check and parse the manifest of ``cf``.

    With ``check_tail``, the tail's CRC-32C (zip comment) is checked before the manifest is
    parsed. With ``check_records``, the manifest's records must match the zip's central
    directory and local headers exactly (:func:`check_records_against_zip`): one record per entry, each at its entry's data offset with its entry's size, sorted and
    disjoint, all before the manifest. Raises :class:`NotAFastPersistCheckpoint` for a zip
    without a manifest and without FastPersist's tail mark, :class:`CorruptCheckpointError`
    for everything else that does not fit.
    """
    path = cf.path
    entries, comment, start_dir = cf.zip_directory()
    found = [i for i in entries if i.filename.endswith("/" + RECORD_SUFFIX)]
    if not found:
        if comment.startswith(TAIL_COMMENT_PREFIX) or cf.carries_tail_mark():
            raise CorruptCheckpointError(path, TAIL, "the file carries FastPersist's tail checksum but no manifest "
                                         "record in its zip directory (the directory is damaged)")
        raise NotAFastPersistCheckpoint(f"{path} has no FastPersist manifest (written by another tool?)")
    if len(found) > 1:
        raise CorruptCheckpointError(path, TAIL, f"{len(found)} manifest records in the zip directory")
    minfo = found[0]
    if minfo.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(path, TAIL, "the manifest record is compressed")
    moff = cf.data_offset(minfo)
    if moff + minfo.file_size != start_dir:
        raise CorruptCheckpointError(path, TAIL, "the manifest record does not end where the zip directory begins")
    if minfo.file_size > _MANIFEST_BYTES_PER_ENTRY * len(entries):
        raise CorruptCheckpointError(path, TAIL, f"a {minfo.file_size}-byte manifest for {len(entries)} zip entries")
    if check_tail:
        if not comment.startswith(TAIL_COMMENT_PREFIX) or len(comment) != len(TAIL_COMMENT_PREFIX) + 8:
            raise CorruptCheckpointError(path, TAIL, f"zip comment {comment[:40]!r} is not a FastPersist tail checksum")
        try:
            want = int(comment[len(TAIL_COMMENT_PREFIX):], 16)
        except ValueError:
            raise CorruptCheckpointError(path, TAIL, f"zip comment {comment!r} is not a FastPersist tail checksum") \
                from None
        got = cf.crc(minfo.header_offset, cf.size - 8 - minfo.header_offset)
        if got != want:
            raise CorruptCheckpointError(path, TAIL, f"CRC-32C {got:08x}, expected {want:08x}")
    try:
        manifest = Manifest.from_bytes(cf.pread(moff, minfo.file_size), max_records=len(entries))
    except ValueError as e:
        raise CorruptCheckpointError(path, TAIL, f"manifest does not parse: {e}") from None
    if manifest.file_size != cf.size:
        raise CorruptCheckpointError(path, STRUCTURE, f"file is {cf.size} bytes, manifest says {manifest.file_size}")
    view = ManifestView(path, manifest, minfo.header_offset, entries)
    if check_records:
        check_records_against_zip(cf, view)
    return view


def check_records_against_zip(cf: CheckpointFile, view: ManifestView) -> None:
    """The manifest's records against the zip's entries and local headers (see
    :func:`read_manifest`; a loader that reads the file whole calls it once the bytes are
    in memory, instead of one cold read per local header)."""
    by_name = check_records_against_directory(cf, view)
    infos = [by_name[r.name] for r in view.manifest.records]
    for r, info, off in zip(view.manifest.records, infos, cf.data_offsets(infos)):  # every local header in one read
        if r.offset != off:
            raise CorruptCheckpointError(cf.path, TAIL, f"record {r.name}: the manifest says {r.size} bytes at byte "
                                         f"{r.offset}, the zip directory {info.file_size} at byte {off}")


def check_records_against_directory(cf: CheckpointFile, view: ManifestView) -> dict[str, zipfile.ZipInfo]:
    """The manifest's records against the zip's central directory, no local header read:
    one record per entry, stored, of its entry's size, sorted, disjoint, inside the file
    and before the manifest. Returns the entries by name. A verified load that takes its
    offsets from the manifest checks the local headers beside its reads
    (:func:`check_records_against_zip`: the structure's CRC covers their bytes too)."""
    path, m = cf.path, view.manifest
    minfo = next(i for i in view.entries if i.filename.endswith("/" + RECORD_SUFFIX))
    by_name = {i.filename: i for i in view.entries if i is not minfo}
    if len(by_name) != len(view.entries) - 1:
        raise CorruptCheckpointError(path, STRUCTURE, "the zip directory names an entry twice")
    names = [r.name for r in m.records]
    if len(set(names)) != len(names) or set(names) != set(by_name):
        missing, unknown = sorted(set(by_name) - set(names)), sorted(set(names) - set(by_name))
        dup = len(names) - len(set(names))
        raise CorruptCheckpointError(path, TAIL, "manifest records do not match the zip's entries: "
                                     f"missing {missing[:3]}, unknown {unknown[:3]}, {dup} repeated")
    starts = sorted(i.header_offset for i in view.entries)
    end = 0
    for r in m.records:
        info = by_name[r.name]
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpointError(path, r.name, "the record is compressed", tensor=r.tensor)
        if r.offset < end:
            raise CorruptCheckpointError(path, TAIL, f"record {r.name} at byte {r.offset} overlaps or precedes the "
                                         "record before it (records must be sorted and disjoint)")
        # between the end of its own local header's name and the next entry's header
        name_len = len(info.filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"))
        k = bisect.bisect_right(starts, info.header_offset)
        limit = starts[k] if k < len(starts) else cf.size
        if (r.size != info.file_size or r.offset < info.header_offset + _LOCAL_HEADER + name_len
                or r.offset + r.size > limit):
            raise CorruptCheckpointError(path, TAIL, f"record {r.name}: the manifest says {r.size} bytes at byte "
                                         f"{r.offset}, the zip directory {info.file_size} after its header at byte "
                                         f"{info.header_offset}")
        end = r.offset + r.size
    if end > minfo.header_offset:
        raise CorruptCheckpointError(path, TAIL, "records run into the manifest")
    return by_name


def check_structure(cf: CheckpointFile, view: ManifestView) -> None:
    """Check the zip structure and the small records (pickle, version...) of a file."""
    check_zip_structure(cf, view)
    check_small_records(cf, view)


def check_zip_structure(cf: CheckpointFile, view: ManifestView, stop: threading.Event | None = None) -> None:
    """Check every byte no record covers (local headers, padding, the central directory
    before the tail) against the manifest's structure CRC. ``stop``: set, the check ends
    (InterruptedError) after the read in progress."""
    m = view.manifest
    covered = [(r.offset, r.offset + r.size) for r in m.records]
    got = cf.crc_of_ranges(structure_ranges(covered, view.header_offset), stop)
    if got != m.structure_crc32c:
        raise CorruptCheckpointError(cf.path, STRUCTURE, f"CRC-32C {got:08x}, expected {m.structure_crc32c:08x}")


def check_small_records(cf: CheckpointFile, view: ManifestView) -> None:
    """Check the records that are not storages (the pickle, torch's version records)."""
    for r in view.manifest.records:
        if r.kind == "record":
            check_crc(cf.path, r, cf.crc(r.offset, r.size))


_KEPT_RECORDS = frozenset(("data.pkl", "byteorder"))


def read_small_records(cf: CheckpointFile, view: ManifestView, keep: int = 64 << 20) -> dict[str, bytes]:
    """The records that are not storages (the pickle, torch's version records), each
    checked against the manifest; the pickle and the byte order kept, by name (a few
    kilobytes to a few megabytes), the others checked a chunk at a time, as is a pickle
    over ``keep`` bytes (its reader reads it itself)."""
    out = {}
    for r in view.manifest.records:
        if r.kind == "record" and (r.size > keep or r.name.rpartition("/")[2] not in _KEPT_RECORDS):
            check_crc(cf.path, r, cf.crc(r.offset, r.size))
        elif r.kind == "record":
            data = cf.pread(r.offset, r.size)
            if len(data) != r.size:
                raise CorruptCheckpointError(cf.path, r.name, f"file ends before the record's {r.size} bytes")
            check_crc(cf.path, r, _native.crc32c(data))
            out[r.name] = data
    return out


def find_damage(cf: CheckpointFile) -> CorruptCheckpointError | None:
    """The damage that explains a failed unchecked load of ``cf``, if its structure shows
    one: the tail, the manifest against the zip, the zip's structure and the small records
    (the pickle among them) for a FastPersist file; for another tool's zip, a directory
    that reads, local headers in the file under the directory's names and small records
    that match the zip's own CRC-32 (:func:`_check_zip_of_another_tool`). ``None`` where
    none is found (the load's own error then stands: a missing class, a device that is
    not there...)."""
    if cf.pread(0, 4) != b"PK\x03\x04" and not cf.carries_tail_mark():
        return None  # not a zip at all (empty, a pointer file, another format): the load's own error
    try:
        view = read_manifest(cf)
        check_structure(cf, view)
    except CorruptCheckpointError as e:
        return e
    except NotAFastPersistCheckpoint:
        try:
            _check_zip_of_another_tool(cf)
        except CorruptCheckpointError as e:
            return e
        except NotAFastPersistCheckpoint:
            return None  # torch's legacy format: nothing here to check it against
    return None


def _check_zip_of_another_tool(cf: CheckpointFile) -> None:
    """A zip without a manifest (``torch.save``'s): its directory reads, each entry's local
    header lies in the file under the directory's name, and its small records (the
    pickle, torch's version records) match the zip's own CRC-32 where it has one
    (``torch.utils.serialization.config.save.compute_crc32 = False`` writes 0)."""
    entries = cf.zip_directory()[0]
    for info, off in zip(entries, cf.data_offsets(entries)):
        name = info.filename.encode()
        if cf.pread(info.header_offset + _LOCAL_HEADER, len(name)) != name:
            raise CorruptCheckpointError(cf.path, info.filename, f"the local header at byte {info.header_offset} "
                                         "names another record than the zip directory")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size <= _SMALL_RECORD and info.CRC:
            crc = zlib.crc32(cf.pread(off, info.file_size))
            if crc != info.CRC:
                raise CorruptCheckpointError(cf.path, info.filename, f"CRC-32 {crc:08x}, the zip directory says "
                                             f"{info.CRC:08x}")


@contextmanager
def damage_named(cf: CheckpointFile) -> Iterator[None]:
    """Around an unchecked load of ``cf``: an error that a damaged file explains (torch's
    zip reader not finding a record, the unpickler meeting a bad opcode, a seek before the
    file's start) becomes the :class:`CorruptCheckpointError` naming the path and the
    damaged part, the load's error chained to it. Costs nothing unless the load fails."""
    try:
        yield
    except CorruptCheckpointError:
        raise
    except Exception as e:
        damage = find_damage(cf)
        if damage is None:
            raise
        raise damage from e


def check_crc(path: str, record: RecordInfo, crc: int) -> None:
    if crc != record.crc32c:
        raise CorruptCheckpointError(path, record.name, f"CRC-32C {crc:08x}, expected {record.crc32c:08x}",
                                     tensor=record.tensor)


def check_storages(cf: CheckpointFile, view: ManifestView, records: list[RecordInfo] | None = None) -> None:
    """Check the storage records (every one, or ``records``): read together, in file order,
    the first damaged one in the file named."""
    todo = sorted((r for r in (view.manifest.records if records is None else records) if r.kind == "storage"),
                  key=lambda r: r.offset)
    for r, crc in zip(todo, cf.crcs_of_ranges([(r.offset, r.size) for r in todo], "storage records")):
        check_crc(cf.path, r, crc)


def other_format(cf: CheckpointFile) -> str | None:
    """What ``cf`` is when it is not a zip (FastPersist's or torch's): ``"safetensors"``,
    ``"json"`` or ``"foreign"`` (none of the formats FastPersist writes); None for a zip, a
    file ending in FastPersist's tail mark (a damaged one of ours) or torch's legacy format
    (their own checks say what they are)."""
    if cf.pread(0, 4) == b"PK\x03\x04":
        return None
    from . import safetensors_file

    if safetensors_file.looks_like(cf):
        return "safetensors"
    if cf.carries_tail_mark() or cf._legacy_torch_file():
        return None
    if safetensors_file.looks_like_json(cf):
        return "json"
    return "foreign"


def _not_ours(path: str) -> NotAFastPersistCheckpoint:
    return NotAFastPersistCheckpoint(f"{path} is not a FastPersist checkpoint: neither a zip (torch.save), a "
                                     "safetensors file nor JSON")


def verify(path: str | os.PathLike) -> dict:
    """Check every byte of ``path`` against its manifest.

    Returns a small report; raises :class:`CorruptCheckpointError` naming the first damaged
    record (and the tensor that uses it), or :class:`NotAFastPersistCheckpoint`. A
    safetensors file is checked against the checksums FastPersist writes into its header,
    or, written by another tool, its structure (``"checksums": False`` in the report); a
    JSON file must parse (``"kind": "json"``).
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    with CheckpointFile(path) as cf:
        kind = other_format(cf)
        if kind is not None:
            from . import safetensors_file

            if kind == "safetensors":
                return safetensors_file.verify(cf)
            if kind == "json":
                return safetensors_file.check_json(cf)
            raise _not_ours(path)
        view = read_manifest(cf)
        check_structure(cf, view)
        check_storages(cf, view)
    return {
        "path": path,
        "records": len(view.manifest.records),
        "bytes": view.manifest.file_size,
        "seconds": time.perf_counter() - t0,
    }


def inspect(path: str | os.PathLike) -> list[dict]:
    """The records of a checkpoint: name, tensor, dtype, size, offset, checksum (a
    safetensors file: its tensors, with their shapes)."""
    with CheckpointFile(path) as cf:
        kind = other_format(cf)
        if kind == "safetensors":
            from . import safetensors_file

            return safetensors_file.inspect(cf)
        if kind is not None:
            raise NotAFastPersistCheckpoint(f"{cf.path} is a JSON file, not a checkpoint: nothing to list") \
                if kind == "json" else _not_ours(cf.path)
        try:
            m = read_manifest(cf, check_tail=False).manifest
        except NotAFastPersistCheckpoint:
            return [{"name": i.filename, "size": i.file_size, "offset": i.header_offset}
                    for i in cf.zip_directory()[0]]
    return [
        {"name": r.name, "kind": r.kind, "tensor": r.tensor, "dtype": r.dtype, "size": r.size,
         "offset": r.offset, "crc32c": f"{r.crc32c:08x}"}
        for r in m.records
    ]
