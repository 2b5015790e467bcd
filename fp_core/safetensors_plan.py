"""Lay out a ``{name: tensor}`` dict as a safetensors file, for the native writer.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
length, a JSON header, then the tensors' raw bytes packed in header order. The header is
padded with spaces (allowed by the format) so the data begins on a block boundary, which
keeps the bulk of the file in whole O_DIRECT blocks.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from .plan import FilePlan, StorageExtent, align_up
from .skeleton import SparseFile

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


def build_safetensors(tensors: Any, alignment: int, metadata: dict[str, str] | None = None) -> FilePlan:
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise TypeError("safetensors format takes a flat dict of {str: torch.Tensor}")
    seen: dict[tuple[torch.device, int], str] = {}
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
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
    text = json.dumps(header, separators=(",", ":")).encode()
    data_start = align_up(8 + len(text), alignment)
    text += b" " * (data_start - 8 - len(text))
    sparse = SparseFile()
    sparse.write(struct.pack("<Q", len(text)) + text)
    extents = []
    for i, (_, flat) in enumerate(views):
        lo = data_start + header[views[i][0]]["data_offsets"][0]
        if flat.numel():
            extents.append(StorageExtent(lo, flat.numel(), flat, i))
    file_size = data_start + offset
    sparse.seek(file_size)
    return FilePlan(file_size=file_size, alignment=alignment, skeleton=sparse, storages=extents,
                    manifest=None)
