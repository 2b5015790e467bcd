"""The integrity manifest stored inside every FastPersist checkpoint.

It is one extra zip record, ``<archive>/.fastpersist/manifest.json``, that torch.load
ignores. It holds a CRC-32C for every other record (each tensor storage, the pickle, the
small torch records) and one for the zip structure itself (local headers, data
descriptors, central directory), so every byte of the file is covered.

Why CRC-32C in a manifest rather than zip's own CRC-32 fields: the SSE4.2 instruction
computes CRC-32C at memory speed while the bytes are being copied into staging, and a zip
record's CRC sits in its local header *before* its data, which O_DIRECT has already
written by the time the data's checksum is known. The manifest record sits at the end of
the file and is written last, once every checksum is in. (torch itself writes CRC 0 when
``compute_crc32`` is off and never checks zip CRCs on load.)

What the manifest cannot cover is itself: the *tail* of the file, from the manifest's local
header to the end (manifest, central directory, end records), is covered by one CRC-32C
written as the last 8 characters of the zip comment (``fastpersist-tail-crc32c=XXXXXXXX``),
which excludes only those 8 characters. So every byte is checked, and a damaged manifest
is told apart from a damaged tensor.

The record's size must be fixed before the data is written (it decides where the central
directory lands), so the text is padded with spaces (valid JSON whitespace) to a length
reserved from a placeholder with the widest possible numbers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FORMAT = "fastpersist/1"
_str = json.encoder.encode_basestring_ascii  # a JSON string exactly as json.dumps writes it
RECORD_SUFFIX = ".fastpersist/manifest.json"
STRUCTURE = "<zip structure>"
TAIL = "<manifest and central directory>"
TAIL_COMMENT_PREFIX = b"fastpersist-tail-crc32c="
TAIL_COMMENT = TAIL_COMMENT_PREFIX + b"00000000"


@dataclass
class RecordInfo:
    """One zip record as the manifest describes it."""

    name: str  # zip record name, e.g. "archive/data/3"
    offset: int  # file offset of the record's data
    size: int  # bytes of data
    crc32c: int = 0
    tensor: str | None = None  # the first tensor path that uses this storage
    dtype: str | None = None
    kind: str = "storage"  # "storage" | "record"


@dataclass
class Manifest:
    file_size: int
    alignment: int
    records: list[RecordInfo] = field(default_factory=list)
    structure_crc32c: int = 0  # CRC-32C over every byte that no record's data covers

    # Set by freeze(): the records' text with a "%08x" where each CRC goes.
    _records_format: str | None = field(default=None, init=False, repr=False, compare=False)
    _frozen: list[RecordInfo] | None = field(default=None, init=False, repr=False, compare=False)

    def freeze(self) -> None:
        """Render the records' text once, leaving out only their CRCs: a plan's records
        are final but for their checksums, and a checkpoint of thousands of tensors
        renders its manifest twice per save (its reserved size, then the text written
        last, after the last byte of the body). Later changes to a record's other fields
        are not seen; a record added, removed or replaced drops the frozen text."""
        self._records_format = self._format_records()
        self._frozen = list(self.records)

    def _format_records(self) -> str:
        # one dict per record for json.dumps costs more than the strings themselves
        return ",".join([
            (f'{{"name":{_str(r.name)},"kind":{_str(r.kind)},"offset":{int(r.offset)},"size":{int(r.size)},'
             '"crc32c":"').replace("%", "%%") + "%08x"
            + ('"' + (f',"tensor":{_str(r.tensor)}' if r.tensor is not None else "")
               + (f',"dtype":{_str(r.dtype)}' if r.dtype is not None else "") + "}").replace("%", "%%")
            for r in self.records])

    def _records_text(self) -> str:
        frozen = self._frozen
        same = frozen is not None and len(frozen) == len(self.records) and all(
            a is b for a, b in zip(frozen, self.records))
        fmt = self._records_format if same else self._format_records()
        return fmt % tuple([r.crc32c for r in self.records])

    def to_bytes(self, pad_to: int | None = None) -> bytes:
        # The bytes of json.dumps(doc, separators=(",", ":")) for the document below,
        # written record by record (tests compare the two for every kind of name).
        data = (f'{{"format":{_str(FORMAT)},"checksum":"crc32c","file_size":{int(self.file_size)},'
                f'"alignment":{int(self.alignment)},"structure_crc32c":"{self.structure_crc32c:08x}",'
                f'"records":[{self._records_text()}]}}').encode()
        if pad_to is not None:
            if len(data) > pad_to:
                raise ValueError(f"manifest of {len(data)} bytes exceeds its reserved {pad_to}")
            data += b" " * (pad_to - len(data))
        return data

    def reserved_size(self) -> int:
        """Bytes to reserve: this manifest with the widest file size it could ever state."""
        return len(self.to_bytes()) - len(str(int(self.file_size))) + len(str(10**16))

    @classmethod
    def from_bytes(cls, data: bytes, max_records: int | None = None) -> Manifest:
        """Parse a manifest, checking every field's type and range.

        The bytes come from a file, so they are untrusted: anything but the exact shape
        :meth:`to_bytes` writes raises ``ValueError`` saying which field is wrong (never a
        ``KeyError``/``TypeError`` from deep inside, never unbounded work).
        ``max_records``: at most this many records (the zip's own entry count).
        """
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("format") != FORMAT:
            raise ValueError(f"unknown manifest format {_short(doc.get('format'))}")
        if doc.get("checksum", "crc32c") != "crc32c":
            raise ValueError(f"unknown checksum {_short(doc.get('checksum'))}")
        alignment = _int(doc, "alignment", "manifest")
        if alignment < 1 or alignment & (alignment - 1) or alignment > 1 << 30:
            raise ValueError(f"alignment {alignment} is not a power of two up to 1 GiB")
        raw = doc.get("records")
        if not isinstance(raw, list):
            raise ValueError("'records' is not a list")
        if max_records is not None and len(raw) > max_records:
            raise ValueError(f"{len(raw)} records, more than the file's {max_records} zip entries")
        records = []
        for i, r in enumerate(raw):
            if type(r) is not dict:
                raise ValueError(f"record {i} is not an object")
            name = r.get("name")
            if type(name) is not str or not name:
                raise ValueError(f"record {i} has no name")
            kind = r.get("kind", "storage")
            if kind != "storage" and kind != "record":
                raise ValueError(f"record {i} ({name}) has the unknown kind {_short(kind)}")
            tensor, dtype = r.get("tensor"), r.get("dtype")
            if not (tensor is None or type(tensor) is str) or not (dtype is None or type(dtype) is str):
                raise ValueError(f"record {i} ({name}) has a non-string tensor name or dtype")
            offset, size, crc = r.get("offset"), r.get("size"), r.get("crc32c")
            if type(offset) is not int or type(size) is not int or not (0 <= offset < 1 << 62 and 0 <= size < 1 << 62):
                where = f"record {i}"
                _int(r, "offset", where), _int(r, "size", where)  # raises, naming the field
            if type(crc) is not str or not _HEX8.fullmatch(crc):
                _hex32(r, "crc32c", f"record {i}")  # raises, naming the field
            records.append(RecordInfo(name, offset, size, int(crc, 16), tensor, dtype, kind))
        return cls(file_size=_int(doc, "file_size", "manifest"), alignment=alignment,
                   structure_crc32c=_hex32(doc, "structure_crc32c", "manifest"), records=records)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(doc: dict, key: str, where: str) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 62:
        raise ValueError(f"{where}: {key} is {_short(v)}, not a non-negative integer")
    return v


_HEX8 = re.compile(r"[0-9a-fA-F]{8}")


def _hex32(doc: dict, key: str, where: str) -> int:
    v = doc.get(key)
    if not isinstance(v, str) or not _HEX8.fullmatch(v):
        raise ValueError(f"{where}: {key} is {_short(v)}, not 8 hex digits")
    return int(v, 16)
