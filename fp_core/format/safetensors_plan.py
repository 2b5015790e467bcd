"""Lay out a ``{name: tensor}`` dict as a safetensors file, for the native writer.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
length, a JSON header, then the tensors' raw bytes packed in header order. The header is
padded with spaces (allowed by the format) so the data begins on a block boundary (a
multiple of :data:`LAYOUT_ALIGNMENT`), which keeps the bulk of the file in whole O_DIRECT
blocks.

Every byte is checksummed, in the header's ``__metadata__`` (string values, as the format
wants; safetensors and ``from_pretrained`` ignore keys they do not know):

* ``fastpersist.crc32c``: the CRC-32C of each tensor's bytes, 8 hex digits each, the
  tensors in file order (by their data offsets, then name);
* ``fastpersist.header_crc32c``: the CRC-32C of the whole header (the length, the JSON and
  its padding, up to the data) with these 8 digits read as ``00000000``;
* ``fastpersist.file_size``: the file's size.

These three are the last keys of ``__metadata__``, in this order (any the caller passes,
copied from another file, are dropped), and the data starts on a block boundary: the
layout by which :mod:`fp_core.loading.safetensors_file` tells a header FastPersist wrote (whose
checksums must all check) from metadata copied into a file another tool wrote.

The CRCs are known only once the tensors are written, and the header comes first: it is
laid out with ``0`` digits (the same width), written with the body, and written again with
the real values after the last tensor (:meth:`SafetensorsPlan.finish_header`), before the
file is synced and committed. ``"format": "pt"`` is added when the caller gives no
``format``: ``from_pretrained`` refuses a file whose metadata lacks it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _native
from .plan import FilePlan, StorageExtent, align_up
from .skeleton import SparseFile

CRC_KEY = "fastpersist.crc32c"
HEADER_CRC_KEY = "fastpersist.header_crc32c"
SIZE_KEY = "fastpersist.file_size"
ZERO_CRC = "00000000"
# the data starts on a multiple of this: part of the layout that tells FastPersist's
# headers from another tool's (fp_core.loading.safetensors_file)
LAYOUT_ALIGNMENT = 4096


def crc_order(entries: dict[str, tuple[int, int]]) -> list[str]:
    """Tensor names in the order of ``fastpersist.crc32c``: by (begin, end) of their data
    offsets, then name (tensors of no bytes share an offset)."""
    return sorted(entries, key=lambda n: (entries[n][0], entries[n][1], n))


def header_crc_span(header: bytes) -> int | None:
    """Where, in the header bytes ``header`` (from the file's first byte), the 8 digits of
    ``fastpersist.header_crc32c`` start; None unless the key appears exactly once, as
    FastPersist writes it (compact JSON)."""
    key = json.dumps(HEADER_CRC_KEY).encode() + b':"'
    at = header.find(key)
    if at < 0 or header.find(key, at + 1) >= 0:
        return None
    return at + len(key)


@dataclass
class SafetensorsPlan(FilePlan):
    """A safetensors file's plan: ``finish_header`` writes the checksums into its header."""

    data_start: int = 0  # the header's end: where the tensors' bytes begin
    crc_at: int = 0  # file offset of the first digit of fastpersist.crc32c
    order: list[int] = field(default_factory=list)  # extent record numbers in crc_order

    def finish_header(self, pieces: list[Any]) -> tuple[int, int]:
        """Fold the writer's per-piece CRCs (``PieceCrc``: record, start, length, crc) into
        each tensor's, put them into the header in the skeleton, then the header's own CRC.
        Returns the byte range ``[0, data_start)`` to write again."""
        by_record: dict[int, list[Any]] = {}
        for pc in pieces:
            by_record.setdefault(pc.record, []).append(pc)
        lengths = {s.record: s.length for s in self.storages}
        digits = []
        for rec in self.order:
            crc, pos = 0, 0
            for pc in sorted(by_record.get(rec, []), key=lambda pc: pc.start):
                if pc.start != pos:
                    raise RuntimeError(f"checksum pieces of tensor {rec} do not tile it (gap at byte {pos})")
                crc = _native.crc32c_combine(crc, pc.crc, pc.length) if pos else pc.crc
                pos += pc.length
            if pos != lengths.get(rec, 0):
                raise RuntimeError(f"checksum pieces of tensor {rec} cover {pos} of {lengths.get(rec, 0)} bytes")
            digits.append(f"{crc:08x}")
        sk = self.skeleton
        sk.pwrite(self.crc_at, "".join(digits).encode())
        head = bytearray(sk.pread(0, self.data_start))
        at = header_crc_span(bytes(head))
        assert at is not None and head[at:at + 8] == ZERO_CRC.encode()
        sk.pwrite(at, f"{_native.crc32c(bytes(head)):08x}".encode())
        return 0, self.data_start

# safetensors dtype names (safetensors/src/tensor.rs)
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a tensor's bytes, in row-major order (copying only if non-contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def build_safetensors(tensors: Any, alignment: int, metadata: dict[str, str] | None = None) -> SafetensorsPlan:
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise TypeError("safetensors format takes a flat dict of {str: torch.Tensor}")
    seen: dict[tuple[torch.device, int], str] = {}
    if alignment % LAYOUT_ALIGNMENT:
        raise ValueError(f"a safetensors file's data starts on a multiple of {LAYOUT_ALIGNMENT} bytes, not "
                         f"{alignment}")
    # the caller's copy of FastPersist's keys (another file's) goes: ours come last, in order
    ours = (CRC_KEY, HEADER_CRC_KEY, SIZE_KEY)
    meta = {str(k): str(v) for k, v in (metadata or {}).items() if str(k) not in ours}
    meta.setdefault("format", "pt")
    header: dict[str, Any] = {"__metadata__": meta}
    views: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        if t.numel() and t.is_contiguous():
            key = (t.device, t.data_ptr())
            if key in seen:
                raise ValueError(f"tensors {seen[key]!r} and {name!r} share memory; safetensors stores each "
                                 "tensor once: drop the duplicate (as save_pretrained does for tied weights)")
            seen[key] = name
        flat = _flat_bytes(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + flat.numel()]}
        views.append((name, flat))
        offset += flat.numel()
    names = [name for name, _ in views]
    order = crc_order({n: tuple(header[n]["data_offsets"]) for n in names})
    index = {n: i for i, n in enumerate(names)}
    meta[CRC_KEY] = ZERO_CRC * len(views)  # the real values once the tensors are written
    meta[HEADER_CRC_KEY] = ZERO_CRC
    data_start = 0
    while True:  # the file size is in the header, whose length can move where the data starts
        meta[SIZE_KEY] = str(data_start + offset)
        text = json.dumps(header, separators=(",", ":")).encode()
        if align_up(8 + len(text), alignment) == data_start:
            break
        data_start = align_up(8 + len(text), alignment)
    text += b" " * (data_start - 8 - len(text))
    key = json.dumps(CRC_KEY).encode() + b':"'
    assert text.count(key) == 1  # every other string in the header is escaped JSON
    sparse = SparseFile()
    sparse.write(struct.pack("<Q", len(text)) + text)
    extents = []
    for i, (_, flat) in enumerate(views):
        lo = data_start + header[views[i][0]]["data_offsets"][0]
        if flat.numel():
            extents.append(StorageExtent(lo, flat.numel(), flat, i))
    file_size = data_start + offset
    sparse.seek(file_size)
    return SafetensorsPlan(file_size=file_size, alignment=alignment, skeleton=sparse, storages=extents,
                           manifest=None, data_start=data_start, crc_at=8 + text.index(key) + len(key),
                           order=[index[n] for n in order])
