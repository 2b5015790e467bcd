"""Loading into tensors that already exist: a resume fills the model's and the optimizer's
own tensors, reading each one's bytes from the file straight into its memory.

The file's structure comes from its pickle, each tensor described by its storage's
offset in the file and its view of it: read by :mod:`fp_core.plain_unpickle` where the
pickle is plain (a :class:`~fp_core.plain_unpickle.SavedTensor` per tensor, no tensor
built; the offsets from the manifest where its checksums hold, so that the reads start
without waiting for thousands of small cold header reads (with ``verify=True`` the
headers are checked against it beside the reads), else from the local headers, all read
in one scatter read), else by torch's
unpickler with every storage on the meta device (``map_location="meta"``). Each saved
tensor is matched with the target's tensor at the same place (same keys, shape and
dtype), and one native scatter read fills them all: pieces near each other in the file
read together, up to 2 MiB per request, many in flight, O_DIRECT straight in where the
target is aligned like the file. No fresh memory is touched: the target's pages are
already there. A target that cannot be filled in place (on a device, not contiguous, a
view of part of a saved storage) is filled from a host copy of its record.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import file_image, loader, plain_unpickle, read_depth
from .errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from .gc_pause import gc_paused
from .integrity import (
    CheckpointFile,
    ManifestView,
    check_crc,
    check_records_against_directory,
    check_records_against_zip,
    check_storages,
    check_zip_structure,
    damage_named,
    read_manifest,
    read_small_records,
)
from .loader import FastReader
from .plain_unpickle import SavedTensor
from .thread_wait import Beside


@dataclass(slots=True)
class _Fill:
    key: str
    target: torch.Tensor
    offset: int  # of the tensor's bytes in the file
    nbytes: int  # that its view spans (from its first element to its last)
    record: tuple[int, int]  # (offset, size) of the storage record holding them
    source: Any  # SavedTensor (storage offset, strides) for a copy; a loaded tensor where read whole


class _MetaSlices:
    """The ``overall_storage`` torch's unpickler slices storages from: a meta storage per
    slice, tagged with its offset in the file (torch takes it from the record's zip
    header), so the structure is read without a byte of tensor data."""

    def __getitem__(self, key: slice) -> torch.UntypedStorage:
        st = torch.UntypedStorage(key.stop - key.start, device="meta")
        st._fp_offset = key.start
        return st


def _meta_offset(t: torch.Tensor) -> int | None:
    return getattr(t.untyped_storage(), "_fp_offset", None)


def _keep_on_meta(storage: Any, location: str) -> Any:
    return storage


def _described(t: torch.Tensor) -> SavedTensor | torch.Tensor:
    """A meta tensor of torch's unpickler as a :class:`SavedTensor`; a loaded one as it is."""
    off = _meta_offset(t)
    if off is None:
        return t
    return SavedTensor(off, t.untyped_storage().nbytes(), t.dtype, t.storage_offset(), tuple(t.shape), t.stride())


def _match(saved: Any, target: Any, key: str, fills: list[_Fill]) -> Any:
    """The saved structure with each tensor replaced by the target's; the fills to make."""
    if isinstance(saved, (SavedTensor, torch.Tensor)):
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"load_into: {key or 'the object'} is a tensor in the file but "
                             f"{type(target).__name__} in the target")
        if saved.shape != target.shape or saved.dtype != target.dtype:
            raise ValueError(f"load_into: {key or 'the tensor'} is {tuple(saved.shape)} {saved.dtype} in the file, "
                             f"{tuple(target.shape)} {target.dtype} in the target")
        if isinstance(saved, torch.Tensor):
            saved = _described(saved)
        if isinstance(saved, torch.Tensor):  # read whole (no offsets): copied from the loaded tensor
            fills.append(_Fill(key, target, -1, 0, (-1, 0), saved))
            return target
        last, numel = 0, 1  # the view's last element past its first, and how many it has
        for n, st in zip(saved.shape, saved.stride):
            last += (n - 1) * st
            numel *= n
        if numel == 0:
            return target  # nothing to read (an empty view may point anywhere, even past its storage)
        es = saved.element_size
        # the bytes the view spans: numel * es where it is dense, less for an expanded one (stride 0)
        fills.append(_Fill(key, target, saved.offset + saved.storage_offset * es, (last + 1) * es,
                           (saved.offset, saved.storage_nbytes), saved))
        return target
    if isinstance(saved, Mapping):
        if not isinstance(target, Mapping):
            raise ValueError(f"load_into: {key or 'the object'} is a mapping in the file but "
                             f"{type(target).__name__} in the target")
        if len(saved) != len(target) or not all(k in target for k in saved):
            missing = [k for k in saved if k not in target]
            unexpected = [k for k in target if k not in saved]
            raise ValueError(f"load_into: keys of {key or 'the object'} differ: in the file only {missing[:5]}, "
                             f"in the target only {unexpected[:5]}")
        out = {k: _match(v, target[k], f"{key}.{k}" if key else str(k), fills) for k, v in saved.items()}
        if type(saved) is dict:
            return out
        try:
            return type(saved)(out)  # an OrderedDict stays one
        except TypeError:
            return out
    if isinstance(saved, (list, tuple)) and not hasattr(saved, "_fields"):
        if not isinstance(target, (list, tuple)) or len(target) != len(saved):
            raise ValueError(f"load_into: {key or 'the object'} is a sequence of {len(saved)} in the file, "
                             f"not so in the target")
        items = [_match(v, t, f"{key}[{i}]", fills) for i, (v, t) in enumerate(zip(saved, target))]
        return type(saved)(items)
    return saved  # numbers, strings, ...: the file's


def _in_archive(by_name: dict[str, Any], archive: str) -> dict[str, Any]:
    """The items named ``<archive>/<name>``, by ``<name>`` (torch reads the folder of the
    zip's first entry)."""
    return {name: v for k, v in by_name.items() for a, _, name in [k.partition("/")] if a == archive}


def _under_archive(cf: CheckpointFile, entries: list[Any], offsets: list[int]) -> dict[str, int]:
    """Record name under the archive (``data/<key>``) -> data offset, for the archive torch
    reads: the folder of the zip's first entry (its zip reader's rule)."""
    archive = cf.zip_directory()[0][0].filename.partition("/")[0]
    return {name: off for i, off in zip(entries, offsets)
            for a, _, name in [i.filename.partition("/")] if a == archive}


def load_into(target: Any, path: str | os.PathLike, *, verify: bool = False,
              weights_only: bool | None = True) -> Any:
    """Fill ``target`` (a state dict, or nested dicts/lists/tuples of tensors, shaped like
    the saved object: ``{"model": model.state_dict(), "optim": ...}``) from the checkpoint
    at ``path``, in place; returns the saved object with the target's tensors in it
    (numbers, strings and other leaves come from the file).

    Every saved tensor needs a target tensor of the same shape and dtype at the same keys
    (``ValueError`` naming the first that differs, before any byte is read). With
    ``verify=True`` every record read is checked against the manifest
    (:class:`CorruptCheckpointError` naming it; the targets then hold unchecked bytes,
    also where only the zip's headers are damaged: they are checked while the tensors are
    read into the targets). Without it, a load that fails on a damaged file raises
    :class:`CorruptCheckpointError` naming the damage where the structure shows it.
    """
    if not file_image.applies(None):
        # no offsets from torch's headers here: load it whole (checked there) and copy
        return _load_and_copy(target, path, verify, weights_only)
    with CheckpointFile(path) as cf:
        if not verify:
            with damage_named(cf):  # a load that fails on a damaged file says so
                return _fill(cf, None, target, path, weights_only, _unchecked_layout(cf))
        with gc_paused():  # see gc_pause: the zip directory's entries, the manifest's records
            view = read_manifest(cf, check_records=False)  # its tail's CRC held
            check_records_against_directory(cf, view)  # the storages' offsets are the manifest's
        try:
            small = read_small_records(cf, view)  # the pickle, checked before it is unpickled
        except CorruptCheckpointError:
            check_zip_structure(cf, view)  # a damaged structure is named first, as everywhere
            raise
        # The zip's local headers (each against its record's offset in the manifest) and the
        # rest of its structure are checked beside the reads, their scattered small reads in
        # the time the reads wait for the disk, not before them; a damaged structure is
        # still the error raised.
        def check_structure(stop: threading.Event) -> None:
            check_records_against_zip(cf, view)
            check_zip_structure(cf, view, stop)

        structure = Beside(check_structure, "fastpersist-verify-structure")
        try:
            result = _fill(cf, view, target, path, weights_only, (view, small), structure.start)
        except BaseException as e:
            interrupted = not isinstance(e, Exception)
            damaged = structure.error(stop=interrupted)
            if isinstance(damaged, CorruptCheckpointError) and not interrupted:
                raise damaged from e
            raise
        structure.result()
        return result


Layout = tuple[ManifestView, dict[str, bytes]]  # a manifest, and its records other than storages


def _unchecked_layout(cf: CheckpointFile) -> Layout | None:
    """For a load without ``verify``: the manifest and the pickle, where the tail's CRC and
    the pickle's hold and the records fit the zip's directory; None for anything else (a
    file of another tool, damage: the load then reads the zip's own headers, as torch)."""
    try:
        with gc_paused():
            view = read_manifest(cf, check_records=False)
            check_records_against_directory(cf, view)
        return view, read_small_records(cf, view)
    except (CorruptCheckpointError, NotAFastPersistCheckpoint):
        return None


def _fill(cf: CheckpointFile, view: ManifestView | None, target: Any, path: str | os.PathLike,
          weights_only: bool | None, layout: Layout | None = None,
          before_reads: Callable[[], None] = lambda: None) -> Any:
    """load_into's work once the file is open. ``view``: the manifest, checked, that every
    record read is checked against (``verify``). ``layout``: where the storages lie and the
    pickle, from a manifest whose checksums held: then the reads start without reading
    thousands of local headers first, each a small cold read (a verified load checks
    them beside its reads); without one, from the zip's headers."""
    verify = view is not None
    wo = file_image.resolve_weights_only(weights_only)
    # See gc_pause: a full collection among the objects built here (the zip directory's
    # entries, the structure, the fills) costs more than building them; the read after
    # builds none.
    with gc_paused():
        saved = NotImplemented
        entries = cf.zip_directory()[0]
        first = entries[0].filename if entries else ""
        if layout is not None and "/" in first:  # else torch's reader refuses the file: let it say so
            archive = first.partition("/")[0]
            storages = [r for r in layout[0].manifest.records if r.kind == "storage"]
            saved = plain_unpickle.structure(plain_unpickle.RecordBytes(_in_archive(layout[1], archive)),
                                             _in_archive({r.name: r.offset for r in storages}, archive))
            if saved is not NotImplemented:
                fills: list[_Fill] = []
                result = _match(saved, target, "", fills)
                sizes = {r.offset: r.size for r in storages}
    if saved is not NotImplemented:
        before_reads()
        _read_fills(cf, view, fills, sizes)
        return result
    with gc_paused():
        # every storage's data offset, its local header read in one scatter read
        entries = file_image.storage_entries(cf)
        offsets = cf.data_offsets(entries)
        if view is not None:  # verified: the headers torch's reader follows, before it unpickles
            check_records_against_zip(cf, view)
        sizes = {off: info.file_size for info, off in zip(entries, offsets)}
        with FastReader(cf, prefetch=False) as f, torch.serialization._open_zipfile_reader(f) as zf:
            swapped = zf.has_record("byteorder") and \
                zf.get_record("byteorder").decode(errors="replace") != sys.byteorder
            if not swapped:
                saved = plain_unpickle.structure(zf, _under_archive(cf, entries, offsets))
                if saved is NotImplemented:  # torch's unpickler; the headers it reads are cached ahead
                    f.prefetch_small_reads()
                    saved = file_image.unpickle(zf, _keep_on_meta, wo, _MetaSlices(), cf.path)
                fills: list[_Fill] = []
                result = _match(saved, target, "", fills)
    if swapped:
        return _load_and_copy(target, path, verify, weights_only)  # torch.load swaps its bytes
    before_reads()
    _read_fills(cf, view, fills, sizes)
    return result


def _load_and_copy(target: Any, path: str | os.PathLike, verify: bool, weights_only: bool | None) -> Any:
    """``load_into`` through a whole load and a copy into each target (checked there)."""
    saved = loader.load(path, map_location="cpu", weights_only=weights_only, verify=verify)
    copies: list[_Fill] = []
    result = _match(saved, target, "", copies)
    with torch.no_grad():
        for f in copies:
            f.target.copy_(f.source)
    return result


def _read_fills(cf: CheckpointFile, view: ManifestView | None, fills: list[_Fill], sizes: dict[int, int]) -> None:
    """``sizes``: data offset -> size of every storage record, from the zip's own headers."""
    records = {r.offset: r for r in view.manifest.records if r.kind == "storage"} if view is not None else {}
    seen: set[tuple[int, int, int]] = set()
    direct, copied = [], []
    for f in fills:
        start, size = f.record
        if sizes.get(start) != size or not start <= f.offset <= f.offset + f.nbytes <= start + size:
            raise CorruptCheckpointError(cf.path, "data.pkl", f"tensor {f.key}: the pickle asks for {size} storage "
                                         f"bytes at byte {start}, where no storage record of that size lies")
        t = f.target
        if t.device.type == "cpu" and t.is_contiguous() and f.source.is_contiguous():
            k = (t.data_ptr(), f.offset, f.nbytes)
            if k not in seen:  # tied weights: one tensor under two keys
                seen.add(k)
                direct.append(f)
        else:
            copied.append(f)
    checked: set[int] = set()
    with cf.native_reader() as reader:
        crcs = read_depth.scatter(reader, [(f.offset, f.target.data_ptr(), f.nbytes) for f in direct],
                                    view is not None)
        for f, crc in zip(direct, crcs):
            if (f.offset, f.nbytes) == f.record and f.record[0] in records:
                check_crc(cf.path, records[f.record[0]], crc)
                checked.add(f.record[0])
        for f in copied:
            off, size = f.record
            host = torch.empty(size, dtype=torch.uint8)
            crc = reader.read_into(off, host.data_ptr(), size, checksum=view is not None,
                                   threads=read_depth.THREADS, chunk_bytes=read_depth.CHUNK)
            if off in records:
                check_crc(cf.path, records[off], crc)
                checked.add(off)
            src = torch.empty(0, dtype=f.source.dtype).set_(host.untyped_storage(), f.source.storage_offset,
                                                              f.source.shape, f.source.stride)
            with torch.no_grad():
                f.target.copy_(src)
    if view is not None:  # records only partly read into targets are checked whole here
        rest = [r for off, r in records.items() if off not in checked]
        if rest:
            check_storages(cf, view, rest)


__all__ = ["load_into"]
