"""Read a zip skeleton's central directory and append one stored record, in one pass each.

zipfile can do both (``ZipFile(f, "a")``), but it reads the directory through thousands
of small reads and rewrites every entry on close, a large share of a save's fixed cost
for checkpoints of thousands of tensors. Here the directory is one read and is copied
as bytes; only the appended entry and the end records are new. Stored (uncompressed)
records only; zip64 where offsets, sizes or counts need it, as zipfile writes it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Protocol

_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD_SIG = 0x06054B50
_LOC64 = struct.Struct("<IIQI")  # 20 bytes
_LOC64_SIG = 0x07064B50
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_EOCD64_SIG = 0x06064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_CENTRAL_SIG = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_LOCAL_SIG = 0x04034B50
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_DOS_DATE_1980 = (0 << 9) | (1 << 5) | 1  # 1980-01-01, as zipfile's ZipInfo default


class _Sparse(Protocol):
    size: int

    def pread(self, off: int, n: int) -> bytes: ...
    def pwrite(self, off: int, data: bytes) -> None: ...
    def truncate(self, size: int | None = None) -> int: ...
    def segments_in(self, off: int, n: int) -> list[tuple[int, bytes]]: ...  # written parts, holes left out
    def view(self, off: int, n: int) -> memoryview | bytes: ...  # pread, without a copy where it can


@dataclass
class Entry:
    name: str
    header_offset: int
    file_size: int


@dataclass
class Directory:
    entries: list[Entry]
    offset: int  # where the central directory starts
    raw: bytes  # the central directory, verbatim


@dataclass
class Appended:
    header_offset: int  # the new record's local header
    data_offset: int
    central_entry: int  # its central directory entry


def read_directory(f: _Sparse) -> Directory:
    """The central directory of the zip in ``f`` (no trailing comment expected, as torch writes)."""
    size = f.size
    tail_len = min(size, _EOCD.size + _U16)
    tail = f.pread(size - tail_len, tail_len)
    at = tail.rfind(struct.pack("<I", _EOCD_SIG))
    if at < 0:
        raise ValueError("no zip end-of-central-directory record")
    eocd_off = size - tail_len + at
    _, _, _, _, count, cd_size, cd_off, _ = _EOCD.unpack_from(tail, at)
    if _U16 in (count,) or _U32 in (cd_size, cd_off):
        sig, _, eocd64_off, _ = _LOC64.unpack(f.pread(eocd_off - _LOC64.size, _LOC64.size))
        if sig != _LOC64_SIG:
            raise ValueError("zip64 end locator missing")
        fields = _EOCD64.unpack(f.pread(eocd64_off, _EOCD64.size))
        if fields[0] != _EOCD64_SIG:
            raise ValueError("zip64 end record missing")
        count, cd_size, cd_off = fields[7], fields[8], fields[9]
    raw = f.pread(cd_off, cd_size)
    entries, pos = [], 0
    for _ in range(count):
        (sig, _, _, _, _, _, _, _, csize, usize, nlen, elen, clen, _, _, _, lho) = _CENTRAL.unpack_from(raw, pos)
        if sig != _CENTRAL_SIG:
            raise ValueError(f"bad central directory entry at {cd_off + pos}")
        name = raw[pos + 46: pos + 46 + nlen].decode()
        if _U32 in (usize, csize, lho):
            usize, lho = _zip64_fields(raw[pos + 46 + nlen: pos + 46 + nlen + elen], usize, csize, lho)
        entries.append(Entry(name, lho, usize))
        pos += 46 + nlen + elen + clen
    return Directory(entries, cd_off, raw)


def _zip64_fields(extra: bytes, usize: int, csize: int, lho: int) -> tuple[int, int]:
    """Sizes and offset from the zip64 extra: present in this order, each only where the
    fixed field holds 0xFFFFFFFF (APPNOTE 4.5.3)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            vals = list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            if usize == _U32:
                usize = vals.pop(0)
            if csize == _U32:
                vals.pop(0)
            if lho == _U32:
                lho = vals.pop(0)
            return usize, lho
        pos += 4 + n
    raise ValueError("zip64 extra field missing")


def local_data_offset(f: _Sparse, header_offset: int) -> int:
    fields = _LOCAL.unpack(f.view(header_offset, _LOCAL.size))
    if fields[0] != _LOCAL_SIG:
        raise ValueError(f"no zip local header at {header_offset}")
    return header_offset + _LOCAL.size + fields[9] + fields[10]


_PAD_TAG = 0x4246  # "FB": the extra field torch pads records with


def relayout(src: _Sparse, d: Directory, out: _Sparse, residues: dict[str, int], modulus: int,
             default_align: int = 64) -> Directory:
    """Copy the zip in ``src`` into the empty ``out`` with each record's data moved to a
    chosen position modulo ``modulus``: record ``name`` starts at ``residues[name]``
    (mod ``modulus``), every other record on ``default_align``.

    Only the padding extra field of each local header changes size; headers, names,
    other extra fields, record bytes and data descriptors are copied as they are, the
    central directory gets the new header offsets (zip64 where an offset needs it).
    Record bytes ``src`` holds as holes (skipped tensor data) stay holes. Why: the
    async writer sends a tensor straight from its memory to O_DIRECT only when its
    address and its file offset agree modulo the block size, and torch puts tensors
    at page + 64.
    """
    order = sorted(range(len(d.entries)), key=lambda i: d.entries[i].header_offset)
    new_offsets: dict[int, int] = {}
    pos = 0
    for k, i in enumerate(order):
        e = d.entries[i]
        nxt = d.entries[order[k + 1]].header_offset if k + 1 < len(order) else d.offset
        # The entry's written parts, read once: its header (+ record bytes when they were
        # written) and, after a skipped record's hole, its data descriptor.
        segs = src.segments_in(e.header_offset, nxt - e.header_offset)
        head = segs[0][1] if segs and segs[0][0] == 0 else b""
        if len(head) < _LOCAL.size or _LOCAL.unpack_from(head)[0] != _LOCAL_SIG:
            raise ValueError(f"no zip local header at {e.header_offset}")
        fields = list(_LOCAL.unpack_from(head))
        nlen, elen = fields[9], fields[10]
        old_hdr = _LOCAL.size + nlen + elen
        if len(head) < old_hdr:
            raise ValueError(f"zip local header at {e.header_offset} is cut short")
        name = head[_LOCAL.size: _LOCAL.size + nlen]
        extra = _drop_field(head[_LOCAL.size + nlen: old_hdr], _PAD_TAG)
        want, mod = (residues[e.name] % modulus, modulus) if e.name in residues else (0, default_align)
        pad = (want - (pos + _LOCAL.size + nlen + len(extra))) % mod
        if pad:
            while pad < 4:  # a field needs its 4-byte header
                pad += mod
            extra += struct.pack("<HH", _PAD_TAG, pad - 4) + b"Z" * (pad - 4)
        fields[10] = len(extra)
        shift = pos + _LOCAL.size + nlen + len(extra) - old_hdr  # old entry offset -> new file offset
        out.pwrite(pos, _LOCAL.pack(*fields) + name + extra + head[old_hdr:])
        for rel, seg in segs[1:]:
            out.pwrite(rel + shift, seg)
        new_offsets[e.header_offset] = pos
        pos = nxt - e.header_offset + shift
    central, p, raw = bytearray(), 0, d.raw
    for e in d.entries:
        fixed = list(_CENTRAL.unpack_from(raw, p))
        nlen, elen, clen = fixed[10], fixed[11], fixed[12]
        name = raw[p + 46: p + 46 + nlen]
        extra = raw[p + 46 + nlen: p + 46 + nlen + elen]
        comment = raw[p + 46 + nlen + elen: p + 46 + nlen + elen + clen]
        usize, csize = e.file_size, e.file_size  # stored records
        if fixed[8] != _U32:
            csize = fixed[8]
        lho = new_offsets[e.header_offset]
        big = [v for v in (usize, csize, lho) if v >= _U32]
        extra = _drop_field(extra, 0x0001)
        if big:
            extra = struct.pack(f"<HH{len(big)}Q", 0x0001, 8 * len(big), *big) + extra
            fixed[1], fixed[2] = max(fixed[1], 45), max(fixed[2], 45)
        fixed[8], fixed[9], fixed[16] = min(csize, _U32), min(usize, _U32), min(lho, _U32)
        fixed[11] = len(extra)
        central += _CENTRAL.pack(*fixed) + name + extra + comment
        p += 46 + nlen + elen + clen
    _write_end(out, pos, bytes(central), len(d.entries), b"")
    entries = [Entry(e.name, new_offsets[e.header_offset], e.file_size) for e in d.entries]
    return Directory(entries, pos, bytes(central))


def _drop_field(extra: bytes, tag: int) -> bytes:
    """``extra`` without the fields tagged ``tag``."""
    out, pos = b"", 0
    while pos + 4 <= len(extra):
        t, n = struct.unpack_from("<HH", extra, pos)
        if t != tag:
            out += extra[pos: pos + 4 + n]
        pos += 4 + n
    return out


def _write_end(f: _Sparse, cd_off: int, central: bytes, count: int, comment: bytes) -> None:
    """Write the central directory at ``cd_off`` and the end records after it; cut the file there."""
    end = cd_off + len(central)
    records = central
    if count > _U16 or len(central) > _U32 or cd_off > _U32:
        eocd64 = _EOCD64.pack(_EOCD64_SIG, _EOCD64.size - 12, 45, 45, 0, 0, count, count, len(central), cd_off)
        records += eocd64 + _LOC64.pack(_LOC64_SIG, 0, end, 1)
    records += _EOCD.pack(_EOCD_SIG, 0, 0, min(count, _U16), min(count, _U16), min(len(central), _U32),
                          min(cd_off, _U32), len(comment)) + comment
    f.pwrite(cd_off, records)
    f.truncate(cd_off + len(records))


def append_stored(f: _Sparse, d: Directory, name: str, data: bytes, comment: bytes) -> Appended:
    """Write ``name`` (stored) where the directory was, then the directory + new end records."""
    bname = name.encode()
    crc = zlib.crc32(data)
    hdr = d.offset
    local = _LOCAL.pack(_LOCAL_SIG, 20, 0, 0, 0, _DOS_DATE_1980, crc, len(data), len(data), len(bname), 0)
    f.pwrite(hdr, local + bname + data)
    cd_off = hdr + len(local) + len(bname) + len(data)
    extra = b""
    lho = hdr
    if hdr >= _U32:
        extra, lho = struct.pack("<HHQ", 0x0001, 8, hdr), _U32
    version = 45 if extra else 20
    entry = _CENTRAL.pack(_CENTRAL_SIG, version, version, 0, 0, 0, _DOS_DATE_1980, crc, len(data), len(data),
                          len(bname), len(extra), 0, 0, 0, 0, lho) + bname + extra
    _write_end(f, cd_off, d.raw + entry, len(d.entries) + 1, comment)
    return Appended(hdr, hdr + len(local) + len(bname), cd_off + len(d.raw))
