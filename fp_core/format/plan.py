"""Turn a Python object into a FilePlan: the skeleton bytes plus the storages' byte extents.

The plan is format-blind downstream: the writer, the partitioner and the checksums only
see the skeleton's written segments and the storages' extents, which together tile the file.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _native
from ..gc_pause import gc_paused
from . import ziptail
from .manifest import RECORD_SUFFIX, TAIL_COMMENT, Manifest, RecordInfo
from .skeleton import SparseFile, capture


def align_down(x: int, a: int) -> int:
    return x - x % a


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass
class StorageExtent:
    """A tensor's bytes at ``offset`` in the file (one zip record, or one safetensors tensor).

    ``source`` is a flat uint8 view of exactly those bytes, on whatever device they live
    (given as that tensor, or as the ``UntypedStorage`` itself: the view is made the
    first time it is asked for, which a CPU save of small tensors never does);
    ``host``, when set, is a CPU copy taken earlier (a snapshot, a device staging copy)
    that the writer reads instead.
    """

    offset: int
    length: int
    _source: torch.Tensor | torch.UntypedStorage
    record: int  # index into Manifest.records (or the tensor's index for safetensors)
    host: torch.Tensor | None = None
    # CRC-32C of ranges of the bytes to write, by (start, length) inside the storage,
    # computed while ``host`` was copied or at save time (writer.stage_cpu): the writer
    # passes them on instead of reading the bytes again.
    host_crcs: dict[tuple[int, int], int] | None = None
    # CUDA event recorded on the caller's stream at save time (writer.mark_ready): device
    # copies made later wait for it.
    ready: Any = None
    # Where ``offset`` lies inside the record's storage: a piece of a storage (a rank's
    # rows of a sharded tensor, its share of a replicated one) reports its CRCs at that place.
    record_start: int = 0
    # Whether ``_source`` lives in CPU memory, found once: the writer asks per storage
    # several times a save, and a storage's ``device`` builds a new object every time.
    _source_on_cpu: bool | None = field(default=None, repr=False, compare=False)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def source(self) -> torch.Tensor:
        src = self._source
        if isinstance(src, torch.UntypedStorage):
            src = self._source = byte_view(src)
        return src

    @source.setter
    def source(self, tensor: torch.Tensor) -> None:
        self._source = tensor
        self._source_on_cpu = None

    @property
    def source_on_cpu(self) -> bool:
        """Whether the storage itself lives in CPU memory (whatever copy it has)."""
        cpu = self._source_on_cpu
        if cpu is None:
            cpu = self._source_on_cpu = self._source.device.type == "cpu"
        return cpu

    @property
    def on_cpu(self) -> bool:
        """Whether the bytes to write are in CPU memory now: the source, or a host copy."""
        return self.host is not None or self.source_on_cpu

    @property
    def data(self) -> torch.Tensor:
        """The bytes to write: the host copy when one was taken (it holds the values as of
        the save; the live ``source`` may have moved on), else the source."""
        return self.host if self.host is not None else self.source

    def addr(self) -> int:
        """Address of the bytes to write; valid only when ``on_cpu``."""
        return (self.host if self.host is not None else self._source).data_ptr()


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class FilePlan:
    file_size: int
    alignment: int
    skeleton: SparseFile
    storages: list[StorageExtent]
    manifest: Manifest | None  # None for formats without one (safetensors)
    manifest_header_offset: int = 0  # where the tail (manifest + central directory) begins
    manifest_offset: int = 0  # the manifest record's data
    manifest_size: int = 0
    manifest_central_entry: int = 0  # offset of its central directory entry
    serialize_seconds: float = 0.0
    # fp_core.pipeline.fence_cut.FenceCut of an overlap save whose fence may copy the unwritten rest
    cut: Any = None

    @property
    def tail_start(self) -> int:
        """First block that holds tail bytes: written last, once every checksum is in."""
        if self.manifest is None:
            return align_down(self.file_size, self.alignment)
        return align_down(self.manifest_header_offset, self.alignment)

    @property
    def storage_bytes(self) -> int:
        return sum(s.length for s in self.storages)

    def storages_in(self, start: int, end: int) -> list[StorageExtent]:
        """The storages that overlap [start, end), in file order (``storages`` is sorted
        by offset and its extents are disjoint, so two bisections find them)."""
        i = bisect.bisect_right(self.storages, start, key=_end)  # the first that ends after start
        j = bisect.bisect_left(self.storages, end, lo=i, key=_offset)  # the first that starts at or after end
        return self.storages[i:j]


def _end(s: StorageExtent) -> int:
    return s.offset + s.length


def _offset(s: StorageExtent) -> int:
    return s.offset


def leaves(obj: Any, is_leaf: Any, max_items: int = 1_000_000) -> list[tuple[str, Any]]:
    """(path, object) of every object ``is_leaf`` takes in ``obj``'s dicts, lists and
    tuples (not looked into), in order; paths as ``model.layers[0].weight``. Containers
    met twice are walked once, and at most ``max_items`` of them."""
    out: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", obj)]
    seen: set[int] = set()
    while stack and len(seen) < max_items:
        path, o = stack.pop()
        if is_leaf(o):
            out.append((path or "<root>", o))
            continue
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, dict):
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in o.items()]
        elif isinstance(o, (list, tuple)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(o)]
        else:
            continue
        stack.extend(reversed(items))
    return out


def _is_tensor(o: Any) -> bool:
    return isinstance(o, torch.Tensor)


def tensor_names(obj: Any, max_items: int = 1_000_000) -> dict[int, tuple[str, str]]:
    """Map storage identity -> (first tensor path, dtype) by walking containers.

    Only used to name records in the manifest, so that verify can say *which tensor* is
    damaged; objects it cannot walk just leave their records unnamed.
    """
    names: dict[int, tuple[str, str]] = {}
    for path, o in leaves(obj, _is_tensor, max_items):
        try:
            key = o.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            continue
        names.setdefault(key, (path, str(o.dtype).removeprefix("torch.")))
    return names


# Storage alignment of a plan for a plain CPU state (state_pickle's) of many small tensors:
# torch's own. Block padding costs up to a block per tensor (a third more bytes to write,
# sync and free for a state dict of thousands of small tensors) and buys little there:
# the engine stages every storage that is not congruent with its address, and torch's
# tensors sit at page + 64. skeleton.storage_alignment decides which states qualify.
PLAIN_STORAGE_ALIGNMENT = 64


def build(obj: Any, alignment: int = 4096, congruent: bool = False) -> FilePlan:
    """Capture ``obj``'s torch.save skeleton and lay out the file, manifest included.

    ``congruent``: place each CPU storage at a file offset that agrees with its address
    modulo ``alignment`` (torch's CPU tensors sit at page + 64), so the engine can write
    its block-aligned middle straight from the tensor with O_DIRECT, no staging copy.
    Otherwise storages start on :data:`PLAIN_STORAGE_ALIGNMENT` where the state is plain
    (see :mod:`.state_pickle`: CPU tensors only) and block padding would add more than
    1/32 to its bytes, else on ``alignment``; either way the file's own structure (tail,
    manifest) keeps ``alignment``.
    """
    with gc_paused():  # see gc_pause: a full collection mid-pickle costs more than the pickle
        return _build(obj, alignment, congruent)


def _build(obj: Any, alignment: int, congruent: bool) -> FilePlan:
    names: dict[int, tuple[str, str]] = {}
    sparse, storages_by_key = capture(obj, alignment, names=names,
                                      plain_alignment=None if congruent else PLAIN_STORAGE_ALIGNMENT)
    if not names:  # torch's pickler ran: walk the object for them
        names = tensor_names(obj)
    return from_skeleton(sparse, storages_by_key, names, alignment, congruent)


def from_skeleton(sparse: SparseFile, storages_by_key: dict[str, Any], names: dict[int, tuple[str, str]],
                  alignment: int, congruent: bool = False) -> FilePlan:
    """The plan of a captured skeleton: its storages' extents, and the manifest appended."""
    # Read torch's records from the skeleton's central directory, then append ours.
    directory = ziptail.read_directory(sparse)
    prefix = directory.entries[0].name.split("/", 1)[0]
    if congruent:
        residues = {f"{prefix}/data/{key}": _residue(storage, alignment)
                    for key, (storage, _, _) in storages_by_key.items()}
        moved = SparseFile()
        directory = ziptail.relayout(sparse, directory, moved, residues, alignment)
        sparse = moved
    records: list[RecordInfo] = []
    storages: list[StorageExtent] = []
    for entry in directory.entries:
        data_offset = ziptail.local_data_offset(sparse, entry.header_offset)
        rel = entry.name.split("/", 1)[1] if "/" in entry.name else entry.name
        key = rel[len("data/") :] if rel.startswith("data/") else None
        if key is not None and key in storages_by_key:
            storage, dtype, nbytes = storages_by_key[key]
            # torch pickles some dtypes (float8, uint16...) through untyped storages, so
            # the recorder sees uint8; the tensor that uses the storage knows better.
            tensor, tensor_dtype = names.get(storage._cdata, (None, None))
            dtype_name = str(dtype).removeprefix("torch.")
            if dtype == torch.uint8 and tensor_dtype is not None:
                dtype_name = tensor_dtype
            rec = RecordInfo(entry.name, data_offset, nbytes, tensor=tensor, dtype=dtype_name, kind="storage")
            if nbytes:
                storages.append(StorageExtent(data_offset, nbytes, storage, len(records)))
        else:
            rec = RecordInfo(entry.name, data_offset, entry.file_size, kind="record")
        records.append(rec)

    manifest = Manifest(file_size=0, alignment=alignment, records=records)
    manifest.freeze()  # the records change no more, but for their CRCs
    reserved = manifest.reserved_size()
    added = ziptail.append_stored(sparse, directory, f"{prefix}/{RECORD_SUFFIX}", b" " * reserved, TAIL_COMMENT)
    manifest.file_size = sparse.size
    plan = FilePlan(
        file_size=sparse.size,
        alignment=alignment,
        skeleton=sparse,
        storages=sorted(storages, key=lambda s: s.offset),
        manifest=manifest,
        manifest_header_offset=added.header_offset,
        manifest_offset=added.data_offset,
        manifest_size=reserved,
        manifest_central_entry=added.central_entry,
    )
    _checksum_skeleton_records(plan)
    return plan


def _residue(storage: torch.UntypedStorage, alignment: int) -> int:
    """Where a storage should start modulo ``alignment``: like its address when that can
    be sent to O_DIRECT (CPU memory, 64-byte aligned as torch allocates), else aligned."""
    if storage.device.type != "cpu":
        return 0
    addr = storage.data_ptr()
    return addr % alignment if addr % 64 == 0 else 0


def _checksum_skeleton_records(plan: FilePlan) -> None:
    """CRCs of what the skeleton alone determines: small records and the zip structure."""
    covered = []
    for rec in plan.manifest.records:
        if rec.kind == "record":
            rec.crc32c = _native.crc32c(plan.skeleton.view(rec.offset, rec.size))
        covered.append((rec.offset, rec.offset + rec.size))
    plan.manifest.structure_crc32c = structure_crc(
        covered, plan.manifest_header_offset, plan.skeleton.view
    )


def structure_ranges(covered: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """(offset, length) of every stretch of [0, end) outside the record data ranges
    ``covered`` ((lo, hi) pairs), in file order: the bytes the structure CRC covers."""
    out, pos = [], 0
    for lo, hi in sorted(covered) + [(end, end)]:
        stop = min(lo, end)
        if pos < stop:
            out.append((pos, stop - pos))
        pos = max(pos, hi)
        if pos >= end:
            break
    return out


def structure_crc(covered: list[tuple[int, int]], end: int, pread: Any, chunk: int = 16 << 20) -> int:
    """CRC-32C of every byte in [0, end) outside the record data ranges ``covered``
    (read ``chunk`` bytes at a time: a file's gaps can be large when it is not ours)."""
    crc = 0
    for pos, n in structure_ranges(covered, end):
        for p in range(pos, pos + n, chunk):
            crc = _native.crc32c(pread(p, min(chunk, pos + n - p)), crc)
    return crc
