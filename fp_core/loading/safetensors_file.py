"""Read a safetensors file: its header checked, its tensors verified, listed or loaded.

The header is untrusted input: its length, every tensor's dtype, shape and data offsets
are checked before anything is read by them, as safetensors' own parser does (offsets
sorted, contiguous, each span the size its dtype and shape say, the data covering the
file exactly). A file FastPersist wrote carries a CRC-32C of every tensor and of the
header itself (:mod:`fp_core.format.safetensors_plan`); one written by another tool has none,
and only its structure can be checked.

Whose checksums? A header with any of FastPersist's keys (``fastpersist.crc32c``,
``fastpersist.header_crc32c``, ``fastpersist.file_size``) claims them. They are taken for
this file's own, and every one of them must check (a missing key, a header CRC or a file
size that does not match is damage: :class:`CorruptCheckpointError`), unless the header's
*layout* shows that another tool wrote it around metadata copied from a FastPersist file.
FastPersist's layout is what damage to the header's text cannot change:

* the data starts on a multiple of :data:`LAYOUT_ALIGNMENT` bytes (the JSON padded with
  spaces; safetensors' own writer pads to 8). The header's length prefix says where, and
  the structure check above has already tied it to the tensors and the file's end;
* FastPersist's keys, those present, are the last ones of ``__metadata__``, in the order
  it writes them (positions, which a damaged byte in a key's name or value does not move;
  safetensors' writer keeps metadata in a hash map, in no fixed order).

So a damaged key name, a damaged digit of ``fastpersist.file_size`` or of the header CRC
in a file FastPersist wrote is always reported; a copy is reported as damage only in the
rare case where its layout happens to be FastPersist's (a false alarm, never a miss).

Every function takes an open :class:`fp_core.loading.integrity.CheckpointFile` (its ``pread``,
``crc``, ``crcs_of_ranges``): the check and the load read the same inode.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from ..format.safetensors_plan import (
    _DTYPES,
    CRC_KEY,
    HEADER_CRC_KEY,
    LAYOUT_ALIGNMENT,
    SIZE_KEY,
    ZERO_CRC,
    crc_order,
    header_crc_span,
)

HEADER = "<safetensors header>"
# FastPersist's keys in the order it writes them, last in __metadata__
_OUR_KEYS = (CRC_KEY, HEADER_CRC_KEY, SIZE_KEY)
MAX_HEADER = 100_000_000  # safetensors' own limit on the header's length
SUFFIX = ".safetensors"
_TORCH = {code: dtype for dtype, code in _DTYPES.items()}
_ITEMSIZE = {code: dtype.itemsize for dtype, code in _DTYPES.items()}


@dataclass
class Tensor:
    name: str
    dtype: str  # safetensors' name (F32, BF16...)
    shape: tuple[int, ...]
    begin: int  # file offsets of its bytes
    end: int
    crc32c: int | None = None


@dataclass
class Header:
    data_start: int
    tensors: list[Tensor]  # in file order (crc_order)
    metadata: dict[str, str] = field(default_factory=dict)
    checksums: bool = False  # carries FastPersist's CRCs that belong to this file
    note: str = ""  # why it has none, when it has FastPersist's keys


def looks_like(cf: Any) -> bool:
    """A safetensors file, by its first bytes (an 8-byte length, then a JSON object) or by
    its name; a damaged length is found by :func:`read_header`, not taken for another format."""
    if cf.path.endswith(SUFFIX):
        return True
    head = cf.pread(0, 9)
    return len(head) == 9 and head[8:9] == b"{" and head[:4] != b"PK\x03\x04"


def read_header(cf: Any) -> Header:
    """The header of ``cf``, every field checked; raises :class:`CorruptCheckpointError`
    naming the file and what does not fit."""
    path = cf.path
    if cf.size < 8:
        raise CorruptCheckpointError(path, HEADER, f"a {cf.size}-byte file is shorter than the header's length")
    (n,) = struct.unpack("<Q", cf.pread(0, 8))
    if n > MAX_HEADER or 8 + n > cf.size:
        raise CorruptCheckpointError(path, HEADER, f"a header of {n} bytes in a {cf.size}-byte file")
    raw = cf.pread(8, n)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(path, HEADER, f"does not parse: {e}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(path, HEADER, "not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptCheckpointError(path, HEADER, "__metadata__ is not a map of strings")
    data_start = 8 + n
    spans: dict[str, tuple[int, int]] = {}
    info: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in doc.items():
        if not isinstance(t, dict):
            raise CorruptCheckpointError(path, HEADER, f"tensor {name[:80]!r} is not an object")
        dtype, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if not isinstance(dtype, str):
            raise CorruptCheckpointError(path, HEADER, f"tensor {name[:80]!r} has no dtype")
        if dtype not in _ITEMSIZE:
            raise NotAFastPersistCheckpoint(f"{path}: tensor {name[:80]!r} has the safetensors dtype {dtype[:20]!r}, "
                                            "which FastPersist does not know (written by another tool)")
        if not _uints(shape) or len(shape) > 64 or not _uints(offs) or len(offs) != 2 or offs[0] > offs[1]:
            raise CorruptCheckpointError(path, HEADER, f"tensor {name[:80]!r}: shape {str(shape)[:60]} or "
                                         f"data_offsets {str(offs)[:60]} malformed")
        if math.prod(shape) * _ITEMSIZE[dtype] != offs[1] - offs[0]:
            raise CorruptCheckpointError(path, HEADER, f"tensor {name[:80]!r}: {offs[1] - offs[0]} bytes for "
                                         f"shape {shape} of {dtype}", tensor=name)
        spans[name] = (offs[0], offs[1])
        info[name] = (dtype, tuple(shape))
    order = crc_order(spans)
    end = 0
    for name in order:
        b, e = spans[name]
        if b != end:
            raise CorruptCheckpointError(path, HEADER, f"tensor {name[:80]!r} starts at data byte {b}, the one "
                                         f"before it ends at {end} (a gap or an overlap)", tensor=name)
        end = e
    if data_start + end != cf.size:
        raise CorruptCheckpointError(path, HEADER, f"the tensors end at byte {data_start + end}, the file at "
                                     f"{cf.size} (truncated or extended?)")
    tensors = [Tensor(nm, info[nm][0], info[nm][1], data_start + spans[nm][0], data_start + spans[nm][1])
               for nm in order]
    h = Header(data_start, tensors, meta)
    _read_checksums(cf, h, raw)
    return h


def _uints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and 0 <= x < 1 << 62 for x in v)


def _read_checksums(cf: Any, h: Header, raw: bytes) -> None:
    """FastPersist's CRCs from the metadata, when they belong to this file (see the module
    doc): its header's CRC and size checked, each tensor given its own."""
    meta, path = h.metadata, cf.path
    if not any(k in meta for k in _OUR_KEYS):
        return
    if not _our_layout(h):
        h.note = ("its FastPersist checksums belong to another file (metadata copied into a file another tool "
                  "laid out)")
        return
    missing = [k for k in _OUR_KEYS if k not in meta]
    if missing:
        raise CorruptCheckpointError(path, HEADER, f"{', '.join(missing)} missing beside FastPersist's other "
                                     "checksum keys (a damaged key name?)")
    at = header_crc_span(raw)
    if at is None:
        raise CorruptCheckpointError(path, HEADER, f"{HEADER_CRC_KEY} appears more than once")
    head = bytearray(cf.pread(0, h.data_start))
    want = meta[HEADER_CRC_KEY]
    head[8 + at:8 + at + 8] = ZERO_CRC.encode()
    got = f"{_crc(bytes(head)):08x}"
    if got != want:
        raise CorruptCheckpointError(path, HEADER, f"CRC-32C {got}, expected {want[:8]}")
    if meta[SIZE_KEY] != str(cf.size):  # under the CRC: a writer's error, not damage
        raise CorruptCheckpointError(path, HEADER, f"{SIZE_KEY} is {meta[SIZE_KEY][:24]}, the file {cf.size} bytes")
    digits = meta[CRC_KEY]
    if len(digits) != 8 * len(h.tensors):
        raise CorruptCheckpointError(path, HEADER, f"{len(digits) // 8} checksums for {len(h.tensors)} tensors")
    try:
        for k, t in enumerate(h.tensors):
            t.crc32c = int(digits[8 * k:8 * k + 8], 16)
    except ValueError:
        raise CorruptCheckpointError(path, HEADER, f"{CRC_KEY} is not hexadecimal") from None
    h.checksums = True


def _our_layout(h: Header) -> bool:
    """The header is laid out as FastPersist writes it: data aligned, FastPersist's keys
    (those present) last in ``__metadata__`` and in order. Positions and lengths only: a
    damaged byte in the header's text changes neither (see the module doc)."""
    if h.data_start % LAYOUT_ALIGNMENT:
        return False
    keys = list(h.metadata)
    tail = len(keys) - len(_OUR_KEYS)
    return all(keys.index(k) == tail + i for i, k in enumerate(_OUR_KEYS) if k in h.metadata)


def _crc(data: bytes) -> int:
    from .. import _native

    return _native.crc32c(data)


def check_tensors(cf: Any, h: Header) -> None:
    """Every tensor's bytes against its CRC-32C (a header with checksums), the first
    damaged one in the file named."""
    spans = [(t.begin, t.end - t.begin) for t in h.tensors]
    for t, crc in zip(h.tensors, cf.crcs_of_ranges(spans, "tensors")):
        if crc != t.crc32c:
            raise CorruptCheckpointError(cf.path, t.name, f"CRC-32C {crc:08x}, expected {t.crc32c:08x}",
                                         tensor=t.name)


def _structure_by_safetensors(cf: Any) -> None:
    """safetensors' own parser's judgement of a file without checksums, where it is installed."""
    try:
        from safetensors import safe_open
    except ImportError:
        return
    try:
        with safe_open(f"/proc/self/fd/{cf.fd}", framework="pt"):
            pass
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError and whatever a hostile header provokes
        raise CorruptCheckpointError(cf.path, HEADER, f"{type(e).__name__}: {e}") from None


def verify(cf: Any) -> dict:
    """Check a safetensors file: against its checksums where FastPersist wrote it, else its
    structure (``"checksums": False`` in the report: nothing recorded to check bytes against)."""
    t0 = time.perf_counter()
    h = read_header(cf)
    if h.checksums:
        check_tensors(cf, h)
    else:
        _structure_by_safetensors(cf)
    return {"path": cf.path, "kind": "safetensors", "checksums": h.checksums, "records": len(h.tensors),
            "bytes": cf.size, "seconds": time.perf_counter() - t0, **({"note": h.note} if h.note else {})}


def inspect(cf: Any) -> list[dict]:
    """A row per tensor: name, dtype, shape, size, offset, checksum ("" when none)."""
    h = read_header(cf)
    return [{"name": t.name, "kind": "tensor", "tensor": t.name, "dtype": t.dtype, "shape": list(t.shape),
             "size": t.end - t.begin, "offset": t.begin,
             "crc32c": f"{t.crc32c:08x}" if t.crc32c is not None else ""} for t in h.tensors]


def load(cf: Any, map_location: Any = None, verify: bool | str = False) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` of ``cf``: ``{name: tensor}``, the file read whole
    (the tensors are views of that one buffer). ``verify=True`` checks every byte against
    the checksums (:class:`NotAFastPersistCheckpoint` for a file without any), ``"auto"``
    where there are some. ``map_location``: a device (or its name) to move the tensors to."""
    from ..io import read_depth

    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError(f"{cf.path} is a safetensors file: map_location must be a device, not "
                        f"{type(map_location).__name__}")
    h = read_header(cf)
    if verify is True and not h.checksums:
        raise NotAFastPersistCheckpoint(f"{cf.path} is a safetensors file without FastPersist checksums (written "
                                        f"by another tool?){': ' + h.note if h.note else ''}; nothing to verify "
                                        "it against")
    buf = torch.empty(cf.size, dtype=torch.uint8)
    if cf.size:
        with cf.native_reader() as r:
            r.read_into(0, buf.data_ptr(), cf.size, threads=read_depth.THREADS, chunk_bytes=read_depth.CHUNK)
    cf.image = memoryview(buf.numpy())
    h = read_header(cf)  # again, from the bytes the tensors are made of
    if verify and h.checksums:
        check_tensors(cf, h)
    out: dict[str, torch.Tensor] = {}
    device = None if map_location is None else torch.device(map_location)
    for t in sorted(h.tensors, key=lambda t: t.begin):
        dtype = _TORCH[t.dtype]
        piece = buf[t.begin:t.end]
        if t.begin % dtype.itemsize:  # packed after an odd-sized tensor: a view needs alignment
            piece = piece.clone()
        tensor = piece.view(dtype).reshape(t.shape)
        out[t.name] = tensor if device is None else tensor.to(device)
    return out


def check_json(cf: Any, limit: int = 256 << 20) -> dict:
    """A JSON file (``trainer_state.json``, ``config.json``...): it must parse. JSON carries
    no checksums; the report says so."""
    t0 = time.perf_counter()
    if cf.size > limit:
        raise NotAFastPersistCheckpoint(f"{cf.path}: a {cf.size}-byte JSON file is larger than any FastPersist "
                                        "writes")
    try:
        json.loads(cf.pread(0, cf.size))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(cf.path, "<json>", f"does not parse: {e}") from None
    return {"path": cf.path, "kind": "json", "checksums": False, "records": 0, "bytes": cf.size,
            "seconds": time.perf_counter() - t0}


def looks_like_json(cf: Any) -> bool:
    if os.fspath(cf.path).endswith(".json"):
        return True
    head = cf.pread(0, 64).lstrip()
    return head[:1] in (b"{", b"[")


__all__ = ["looks_like", "read_header", "verify", "inspect", "load", "check_json", "looks_like_json"]
