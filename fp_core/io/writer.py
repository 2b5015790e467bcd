"""Write a FilePlan's bytes through the native engine, checksumming as they are staged.

The file is written in two phases (see manifest.py): first everything before the tail,
which yields every storage's CRC-32C; then the tail, with the finished manifest and the
tail checksum in the zip comment.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import sys
import time
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _native
from ..format.manifest import TAIL_COMMENT_PREFIX
from ..format.plan import FilePlan, StorageExtent, align_down
from .engine import EngineOptions

log = logging.getLogger("fastpersist")

# Device tensors are copied to pinned host memory in batches of at most this many bytes
# (or one storage, when a single storage is larger), so host memory stays bounded.
DEVICE_BATCH_BYTES = 256 << 20


@dataclass
class PieceCrc:
    record: int
    start: int  # byte offset inside the storage
    length: int
    crc: int


@dataclass
class RangeStats:
    bytes: int = 0
    seconds: float = 0.0
    copy_seconds: float = 0.0
    io_wait_seconds: float = 0.0
    device_copy_seconds: float = 0.0
    requests: int = 0
    short_writes: int = 0
    zero_copy_bytes: int = 0  # written straight from their source, no staging copy

    def add(self, native: dict, seconds: float) -> None:
        self.bytes += int(native.get("bytes", 0))
        self.seconds += seconds
        self.copy_seconds += float(native.get("copy_seconds", 0.0))
        self.io_wait_seconds += float(native.get("io_wait_seconds", 0.0))
        self.requests += int(native.get("requests", 0))
        self.short_writes += int(native.get("short_writes", 0))
        self.zero_copy_bytes += int(native.get("zero_copy_bytes", 0))


def _bytes_addr(data: bytes, keep: list) -> int:
    arr = np.frombuffer(data, dtype=np.uint8)
    keep.append(arr)
    return arr.ctypes.data


def record_ready(devices: Iterable[torch.device]) -> dict[torch.device, Any]:
    """An event per CUDA device among ``devices``, recorded on the caller's current stream
    of that device: the point up to which the caller's device work is what a save holds."""
    events: dict[torch.device, Any] = {}
    for dev in devices:
        if dev.type == "cuda" and dev not in events:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            events[dev] = ev
    return events


def mark_ready(extents: list[StorageExtent]) -> None:
    """Record, on the caller's current stream of each device, the point the device
    storages' contents are final for this save: copies made later on another thread (the
    background writer, whose current stream is another) wait for that point, not for
    whatever that thread's stream holds."""
    events = record_ready(s.source.device for s in extents)
    for s in extents:
        if s.source.device in events:
            s.ready = events[s.source.device]


def _synchronize(streams: Any) -> None:
    """Wait for every stream; while another error is already on its way out (this runs in
    ``finally``), a failing wait (a sticky CUDA error) is logged, not raised over it."""
    leaving = sys.exc_info()[1]
    for stream in streams:
        try:
            stream.synchronize()
        except Exception as e:  # noqa: BLE001 - see above
            if leaving is None:
                raise
            log.error("fastpersist: waiting for a CUDA stream after %r failed too: %s", leaving, e)


@contextlib.contextmanager
def device_work_after_save(extents: list[StorageExtent]) -> Iterator[None]:
    """Run the block's device work (clones, gathers, copies issued on this thread: a
    sharded or collective save on the background writer) on a side stream per device that
    first waits for the point :func:`mark_ready` recorded at ``save()``: ordered after the
    caller's work of then, as :func:`copy_to_host` orders its copies, and not queued on this
    thread's default stream, behind the kernels the training issues meanwhile. Extents
    without a ready point (saves made on the caller's thread) change nothing."""
    events: dict[torch.device, Any] = {}
    for s in extents:
        if s.ready is not None:
            events.setdefault(s.source.device, s.ready)
    with device_work_after(events):
        yield


@contextlib.contextmanager
def device_work_after(events: dict[torch.device, Any]) -> Iterator[None]:
    """The block's device work on a side stream per device of ``events`` (from
    :func:`record_ready`), each waiting for its device's event first; every side stream
    is synchronised when the block ends, so the memory it read can be let go."""
    if not events:
        yield
        return
    sides = []
    with contextlib.ExitStack() as stack:
        for dev, ev in events.items():
            stack.enter_context(torch.cuda.device(dev))  # see copy_to_host: no context on another GPU
            side = torch.cuda.Stream(dev)
            side.wait_event(ev)
            stack.enter_context(torch.cuda.stream(side))
            sides.append(side)
        try:
            yield
        finally:
            _synchronize(sides)  # what the block left queued is done before its memory is let go


def copy_to_host(extents: list[StorageExtent], into: list[torch.Tensor] | None = None) -> None:
    """Give each extent a host copy (``host``), device sources via a side CUDA stream.

    ``into``, when given, are preallocated uint8 buffers of the same lengths (a snapshot
    arena); otherwise pinned (CUDA) or plain host buffers are allocated.
    """
    streams: dict[torch.device, Any] = {}
    try:
        for i, s in enumerate(extents):
            dev = s.source.device
            pin = dev.type == "cuda"
            buf = into[i] if into is not None else torch.empty(s.length, dtype=torch.uint8, pin_memory=pin)
            if pin:
                # The device guard first: a stream context alone, on a thread whose current
                # device is another (a writer thread's is cuda:0), sets that device back on
                # exit and so makes a context on it (memory on GPU 0 for every rank).
                with torch.cuda.device(dev):
                    if dev not in streams:  # one side stream per device, not one per storage
                        streams[dev] = torch.cuda.Stream(dev)
                    stream = streams[dev]
                    if s.ready is not None:  # after the work queued before save(), on the caller's stream
                        stream.wait_event(s.ready)
                    else:
                        stream.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(stream):
                        buf.copy_(s.source, non_blocking=True)
            else:
                buf.copy_(s.source)
            s.host = buf
    finally:
        # also when a copy or an allocation failed part-way: nothing may still be copying
        # into buffers the caller is about to drop or hand back to a pool
        _synchronize(streams.values())


SNAPSHOT_CONGRUENCE = 4096  # a snapshot copy agrees with its file offset modulo 4 KiB
PARALLEL_CHUNK = 8 << 20  # unit of work when several threads copy or checksum one storage


def stage_cpu(extents: list[StorageExtent], into: list[torch.Tensor] | None = None,
              pool: ThreadPoolExecutor | None = None, threads: int = 1, checksum: bool = True) -> None:
    """Checksum CPU storages (and copy them into ``into``, a snapshot arena, when given)
    in one pass over the source, split over ``threads`` of ``pool`` (one share of nearly
    equal bytes each: thousands of small pieces cost more as futures than as work).

    The CRCs go to each extent's ``host_crcs`` for the ranges :func:`split_congruent`
    will cut it into, so the writer finds them for the zero-copy middle and the staged
    head and tail and does not read the bytes again. With ``checksum=False`` (copies
    only) the copy runs faster and each extent keeps the ``host_crcs`` it had: those taken
    at save time (which a copy of bytes changed since then must not replace), or none, and
    then the engine checksums the copies as it writes them, off the caller's thread.
    """
    if not checksum and into is None:
        raise ValueError("stage_cpu: nothing to do without a checksum or a copy")
    jobs: list[tuple[int, tuple[int, int], int, int, int]] = []  # extent, range key, src, dst, n
    for i, s in enumerate(extents):
        src = s.source.data_ptr()
        base = into[i].data_ptr() if into is not None else src
        for _, addr, n in split_congruent(s.offset, base, s.length, SNAPSHOT_CONGRUENCE):
            start = addr - base
            for o in range(0, n, PARALLEL_CHUNK):
                dst = base + start + o if into is not None else 0
                jobs.append((i, (start, n), src + start + o, dst, min(PARALLEL_CHUNK, n - o)))

    def one(job: tuple[int, tuple[int, int], int, int, int]) -> int:
        _, _, src, dst, n = job
        return _native.copy_crc32c(dst, src, n, checksum=checksum) if dst else _native.crc32c_addr(src, n)

    def share(part: list[tuple[int, tuple[int, int], int, int, int]]) -> list[int]:
        return [one(j) for j in part]

    workers = threads if pool is not None else 1
    if workers > 1 and len(jobs) > 1:
        total, cuts, acc = sum(j[4] for j in jobs), [0], 0
        for k, j in enumerate(jobs):
            acc += j[4]
            if acc >= total * len(cuts) / workers and len(cuts) < workers:
                cuts.append(k + 1)
        cuts.append(len(jobs))
        parts = [jobs[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
        crcs = [c for part in pool.map(share, parts) for c in part]  # type: ignore[union-attr]
    else:
        crcs = share(jobs)
    if checksum:
        per: list[dict[tuple[int, int], int]] = [{} for _ in extents]
        for (i, key, _, _, n), crc in zip(jobs, crcs):  # chunks of a range come in order
            d = per[i]
            d[key] = _native.crc32c_combine(d[key], crc, n) if key in d else crc
        for s, d in zip(extents, per):
            s.host_crcs = d
    if into is not None:
        for s, buf in zip(extents, into):
            s.host = buf


def snapshot_to_host(extents: list[StorageExtent], into: list[torch.Tensor]) -> None:
    """Copy storages into ``into`` (a page-aligned snapshot arena): CPU ones through
    :func:`stage_cpu` (checksummed as they are copied), device ones through
    :func:`copy_to_host`."""
    device = [(s, buf) for s, buf in zip(extents, into) if s.source.device.type != "cpu"]
    if device:
        copy_to_host([s for s, _ in device], into=[b for _, b in device])
    cpu = [(s, buf) for s, buf in zip(extents, into) if s.source.device.type == "cpu"]
    if cpu:
        stage_cpu([s for s, _ in cpu], [b for _, b in cpu])


def _stage_device_storages(storages: list[StorageExtent], stats: RangeStats) -> list[StorageExtent]:
    """Copy these storages' device ones into pinned host memory; return them."""
    staged = [s for s in storages if not s.on_cpu]
    if not staged:
        return []
    t0 = time.perf_counter()
    copy_to_host(staged)
    stats.device_copy_seconds += time.perf_counter() - t0
    return staged


def _release(staged: list[StorageExtent]) -> None:
    for s in staged:
        s.host = None


def _batches(plan: FilePlan, start: int, end: int) -> list[tuple[int, int]]:
    """Cut [start, end) before device storages so they are staged a batch at a time.

    Cuts are block-aligned (a storage need not start on a block: CPU storages sit at their
    address modulo a page in the async layout, safetensors packs its tensors), and only
    device storages count towards a batch: CPU bytes are never staged whole.
    """
    storages = plan.storages_in(start, end)  # not the whole plan's: a range may be a small part
    if all(s.on_cpu for s in storages):
        return [(start, end)]
    cuts, acc = [start], 0
    for s in storages:
        if s.on_cpu or s.offset <= start:
            continue
        cut = align_down(s.offset, plan.alignment)
        if acc and acc + s.length > DEVICE_BATCH_BYTES and cut > cuts[-1]:
            cuts.append(cut)
            acc = 0
        acc += s.length
    cuts.append(end)
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass
class PreparedRows:
    """The engine rows of one range, built ahead by :func:`prepare_rows`."""

    start: int
    end: int
    rows: list[tuple]
    keep: list  # what the rows' addresses point into (the skeleton's bytes)


def _congruence(engine: _native.Engine) -> int:
    return max(engine.alignment, engine.mem_alignment)


def prepare_rows(engine: _native.Engine, plan: FilePlan, start: int, end: int) -> PreparedRows | None:
    """The rows :func:`write_range` would build for [start, end), built now: on a thread
    with nothing else to do while the writing thread is still busy, so that the disk does
    not wait for thousands of rows between two ranges. None where they cannot be built
    ahead: a device storage's host copy is made and let go by the writing thread (one
    staged for the batch before this one, whose end cuts it, may be gone by the time these
    rows are written), and an overlap save's cut claims its batches as they are written."""
    if plan.cut is not None:
        return None
    storages = plan.storages_in(start, end)
    if not all(s.source_on_cpu and s.host is None for s in storages):
        return None
    keep: list = []
    return PreparedRows(start, end, _extents(plan, storages, start, end, _congruence(engine), keep), keep)


def write_range(engine: _native.Engine, plan: FilePlan, start: int, end: int,
                options: EngineOptions, stats: RangeStats,
                carry: list[StorageExtent] | None = None,
                prepared: PreparedRows | None = None) -> list[PieceCrc]:
    """Write the plan's bytes in [start, end); return the CRC of every storage piece written.

    With ``plan.cut`` (an overlap save whose fence may copy the rest), the range is
    written in the cut's batches, each claimed first: from live memory, or from the copies
    the fence made of it. ``carry``: device storages staged here that run on past ``end``
    are added to it, still staged, for the caller to write on from and release (without
    it, released here). ``prepared``: this range's rows from :func:`prepare_rows`."""
    if prepared is not None:
        if (prepared.start, prepared.end) != (start, end):
            raise ValueError(f"rows prepared for [{prepared.start}, {prepared.end}), not [{start}, {end})")
        return _write_rows(engine, prepared.rows, start, end, stats)
    out: list[PieceCrc] = []
    congruence = _congruence(engine)
    cut = plan.cut
    batches = ([(i, *cut.ranges[i]) for i in cut.index(start, end)] if cut is not None
               else [(None, lo, hi) for lo, hi in _batches(plan, start, end)])
    # A device storage that runs on past its batch's end (a packed layout: batches are cut
    # at blocks) keeps its staging copy for the next batch, not copied twice.
    carried: list[StorageExtent] = []
    try:
        for k, lo, hi in batches:
            if k is not None:
                cut.claim(k)
            storages = plan.storages_in(lo, hi)
            staged = carried + _stage_device_storages(storages, stats)
            carried = []
            try:
                keep: list = []
                rows = _extents(plan, storages, lo, hi, congruence, keep)
                pieces = _write_rows(engine, rows, lo, hi, stats)
            except BaseException:
                _release(staged)
                raise
            carried = [s for s in staged if s.offset + s.length > hi]
            _release([s for s in staged if s.offset + s.length <= hi])
            if k is not None:
                cut.done(k)
            out.extend(pieces)
    except BaseException:
        _release(carried)
        raise
    if carry is not None:
        carry.extend(carried)
    else:
        _release(carried)  # past this range's end: another range (a peer's, in a collective save) stages its own
    return out


def _write_rows(engine: _native.Engine, rows: list[tuple], lo: int, hi: int, stats: RangeStats) -> list[PieceCrc]:
    t0 = time.perf_counter()
    crcs, native_stats = engine.write([r[:4] for r in rows], lo, hi, checksum=True, zero_copy=True)
    stats.add(native_stats, time.perf_counter() - t0)
    return [PieceCrc(r[4].record, r[4].record_start + r[5], r[2], crc) for r, crc in zip(rows, crcs)
            if r[4] is not None]


def _extents(plan: FilePlan, storages: list[StorageExtent], lo: int, hi: int, congruence: int,
             keep: list) -> list[tuple]:
    """Every byte of [lo, hi) as engine extents in file order: rows of ``(file offset,
    address, length, known CRC or None, storage or None, byte of the storage)``.

    One pass of plain tuples: a state dict of thousands of small tensors spends more
    here per tensor than the engine spends writing it."""
    # The skeleton's bytes in the range, copied once into one buffer (thousands of
    # segments, one per storage gap, need no object each).
    blob, where = plan.skeleton.gather(lo, hi - lo)
    base = _bytes_addr(blob, keep) if blob else 0
    rows: list[tuple] = []
    at = 0
    for rel, n in where:
        rows.append((lo + rel, base + at, n, None, None, 0))
        at += n
    for s in storages:
        so = s.offset
        a = so if so > lo else lo
        b = so + s.length
        if b > hi:
            b = hi
        if b <= a:  # an empty storage
            continue
        first = a - so
        addr, n, known = s.addr() + first, b - a, s.host_crcs
        if n < congruence or (addr - a) % congruence:  # not congruent: one staged extent
            rows.append((a, addr, n, known.get((first, n)) if known else None, s, first))
            continue
        for off, ad, m in split_congruent(a, addr, n, congruence):
            start = first + off - a
            rows.append((off, ad, m, known.get((start, m)) if known else None, s, start))
    rows.sort(key=_row_offset)
    return rows


def _row_offset(row: tuple) -> int:
    return row[0]


def split_congruent(offset: int, addr: int, length: int, congruence: int) -> list[tuple[int, int, int]]:
    """Cut one extent so that its block-aligned middle can be written without staging.

    When the source address and the file offset agree modulo ``congruence`` (a snapshot
    arena is carved that way), the middle starts on a block boundary in memory and in
    the file, and the engine writes it straight from the source (``zero_copy``); the
    head and tail share staging blocks with their neighbours. Live tensors agree when
    the plan was built ``congruent`` (the async pipeline's); otherwise (torch allocates
    at page + 64, storages start on 4 KiB) they stay one staged extent.
    """
    if length < congruence or (addr - offset) % congruence:
        return [(offset, addr, length)]
    head = -offset % congruence
    mid = (length - head) // congruence * congruence
    if not mid:
        return [(offset, addr, length)]
    out = [(offset, addr, head)] if head else []
    out.append((offset + head, addr + head, mid))
    if length - head - mid:
        out.append((offset + head + mid, addr + head + mid, length - head - mid))
    return out


def combine_piece_crcs(plan: FilePlan, pieces: list[PieceCrc]) -> None:
    """Fold per-piece CRCs (from any number of writers) into each storage record's CRC."""
    by_record: dict[int, list[PieceCrc]] = {}
    for pc in pieces:
        by_record.setdefault(pc.record, []).append(pc)
    for s in plan.storages:
        parts = sorted(by_record.get(s.record, []), key=lambda pc: pc.start)
        crc, pos = 0, 0
        for pc in parts:
            if pc.start != pos:
                raise RuntimeError(f"checksum pieces of {plan.manifest.records[s.record].name} "
                                   f"do not tile it (gap at byte {pos})")
            crc = _native.crc32c_combine(crc, pc.crc, pc.length) if pos else pc.crc
            pos += pc.length
        if pos != s.length:
            raise RuntimeError(f"checksum pieces of {plan.manifest.records[s.record].name} "
                               f"cover {pos} of {s.length} bytes")
        plan.manifest.records[s.record].crc32c = crc


def tail_piece_crcs(plan: FilePlan) -> list[PieceCrc]:
    """CRCs of storage bytes that fall inside the tail range, computed before it is written."""
    lo, hi = plan.tail_start, plan.file_size
    storages = plan.storages_in(lo, hi)
    staged = _stage_device_storages(storages, RangeStats())
    try:
        out = []
        for s in storages:
            a, b = max(s.offset, lo), min(s.end, hi)
            if b > a:
                first = a - s.offset
                out.append(PieceCrc(s.record, first, b - a, _native.crc32c_addr(s.addr() + first, b - a)))
        return out
    finally:
        _release(staged)


def finish_tail(plan: FilePlan) -> None:
    """Write the final manifest into the skeleton, fix its zip CRC, stamp the tail CRC."""
    data = plan.manifest.to_bytes(pad_to=plan.manifest_size)
    sk = plan.skeleton
    sk.pwrite(plan.manifest_offset, data)
    zcrc = struct.pack("<I", zlib.crc32(data))
    sk.pwrite(plan.manifest_header_offset + 14, zcrc)  # local header CRC-32 field
    sk.pwrite(plan.manifest_central_entry + 16, zcrc)  # central directory CRC-32 field
    covered = plan.file_size - 8 - plan.manifest_header_offset
    tail_crc = _native.crc32c(sk.pread(plan.manifest_header_offset, covered))
    assert sk.pread(plan.file_size - 8 - len(TAIL_COMMENT_PREFIX), len(TAIL_COMMENT_PREFIX)) == TAIL_COMMENT_PREFIX
    sk.pwrite(plan.file_size - 8, f"{tail_crc:08x}".encode())


def write_single(engine: _native.Engine, plan: FilePlan, options: EngineOptions,
                 on_body_written: Any = None, early: Any = None) -> RangeStats:
    """One writer writes the whole file: body, then the checksummed tail.

    ``on_body_written`` is called once no live tensor memory will be read again (the
    async pipeline's fence releases there). ``early``: a
    :class:`fp_core.saving.early_write.EarlyWrite` that wrote the file's start while the plan was
    made; the rest is written after it.
    """
    start, pieces, stats = 0, [], RangeStats()
    if early is not None:
        pieces, stats = early.result()  # the rest adds to the early write's stats
        start = early.end
    carry: list[StorageExtent] = []  # a device storage the body's end cuts: staged once for both
    try:
        if start < plan.tail_start:  # else the early write wrote the whole body
            pieces = pieces + write_range(engine, plan, start, plan.tail_start, options, stats, carry=carry)
        write_tail(engine, plan, pieces, options, stats, on_body_written)
    finally:
        _release(carry)
    return stats


def write_tail(engine: _native.Engine, plan: FilePlan, body_pieces: list[PieceCrc],
               options: EngineOptions, stats: RangeStats, on_body_written: Any = None) -> None:
    if plan.cut is not None:  # the tail's checksums read storage bytes too
        for k in plan.cut.index(plan.tail_start, plan.file_size):
            plan.cut.claim(k)
    # The tail's device storages staged once, for its checksums and its write.
    staged = _stage_device_storages(plan.storages_in(plan.tail_start, plan.file_size), stats)
    try:
        if plan.manifest is not None:
            combine_piece_crcs(plan, body_pieces + tail_piece_crcs(plan))
            finish_tail(plan)
        tail_pieces = write_range(engine, plan, plan.tail_start, plan.file_size, options, stats)
        finish_header = getattr(plan, "finish_header", None)
        if finish_header is not None:
            # safetensors: the checksums go in the header, at the file's start, so its
            # blocks are written again once every tensor is (safetensors_plan)
            lo, hi = finish_header(body_pieces + tail_pieces)
            keep: list = []
            _write_rows(engine, _extents(plan, [], lo, hi, _congruence(engine), keep), lo, hi, stats)
    finally:
        _release(staged)
    if on_body_written is not None:
        on_body_written()
    engine.truncate(plan.file_size)


__all__ = ["write_single", "write_range", "prepare_rows", "PreparedRows", "write_tail", "combine_piece_crcs",
           "align_down", "RangeStats"]
