"""``load_into`` from a safetensors file: each tensor of its header described as a saved
tensor (its bytes' offset in the file, dtype, shape, row-major), so the same fills read
them straight into the targets, a DTensor's local shard only its own rows or block.

The header is read as untrusted input (:func:`fp_core.loading.safetensors_file.read_header`:
every shape against its data offsets, the offsets tiling the data, the data ending with
the file), so a header that lies about a tensor is :class:`CorruptCheckpointError` before
a byte is read. FastPersist's CRC-32C of each tensor, where its header carries them and
they belong to it, are what ``verify`` checks each tensor's bytes against: as the
manifest's records of a torch file, a sharded tensor's put together from the ranks'
pieces. A file without them (written by ``safetensors.torch.save_file``) loads unchecked
with ``verify=False`` or ``"auto"``; ``verify=True`` refuses it
(:class:`NotAFastPersistCheckpoint`), as it refuses a torch file without a manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import NotAFastPersistCheckpoint
from ..format.manifest import RecordInfo
from ..format.plain_unpickle import SavedTensor
from . import safetensors_file


@dataclass
class _Records:
    records: list[RecordInfo] = field(default_factory=list)


@dataclass
class RecordsView:
    """What a verified fill needs of a manifest: each tensor's bytes and CRC-32C as a record."""

    manifest: _Records


def structure(cf: Any, verify: bool | str) -> tuple[dict[str, SavedTensor], RecordsView | None, dict[int, int]]:
    """(``{name: SavedTensor}`` of the file's header, the records to check the reads
    against where ``verify`` checks this file (else None), data offset -> size of each
    tensor's bytes)."""
    h = safetensors_file.read_header(cf)
    if verify is True and not h.checksums:
        raise NotAFastPersistCheckpoint(f"{cf.path} is a safetensors file without FastPersist checksums (written "
                                        f"by another tool?){': ' + h.note if h.note else ''}; nothing to verify "
                                        "it against (verify='auto' loads it unchecked)")
    saved: dict[str, SavedTensor] = {}
    for t in h.tensors:
        stride, n = [], 1
        for size in reversed(t.shape):
            stride.append(n)
            n *= size
        saved[t.name] = SavedTensor(t.begin, t.end - t.begin, safetensors_file._TORCH[t.dtype], 0, tuple(t.shape),
                                    tuple(reversed(stride)))
    sizes = {t.begin: t.end - t.begin for t in h.tensors}
    if not (verify and h.checksums):
        return saved, None, sizes
    records = [RecordInfo(t.name, t.begin, t.end - t.begin, t.crc32c or 0, t.name, t.dtype) for t in h.tensors
               if t.end > t.begin]
    return saved, RecordsView(_Records(records)), sizes


__all__ = ["RecordsView", "structure"]
