"""How many reads FastPersist keeps in flight, and how large: one setting for every read of
a checkpoint (loads, load_into, DCP loads, verify) and for the bench's device row; and the
scatter read of many spans into their own memory at that depth.

The disk reads faster with many smaller reads in flight than with a few large ones, into
memory faulted in before and into fresh memory alike (``benchmarks/read_depth.py`` sweeps
the settings; figures in docs/performance.md, "Load, 2 GiB"). A chunk of 2 MiB less two pages keeps a
staged group's buffer (chunk + 2 blocks of up to 4 KiB) within one 2 MiB huge page of the
staging pool. Read at call time (``read_depth.THREADS``), so a benchmark can sweep them.
"""

from __future__ import annotations

from typing import Any

from .. import _native

THREADS = 32
CHUNK = (2 << 20) - (8 << 10)


def scatter(reader: Any, spans: list[tuple[int, int, int]], checksum: bool) -> list[int]:
    """Read each ``(file offset, address, length)`` span into memory at its address, all in
    one native scatter read; the CRC-32C of each span's bytes (0s without ``checksum``), in
    the order of ``spans``.

    Spans are cut at multiples of :data:`CHUNK` in the file, so memory aligned like the file
    gets whole aligned chunks the kernel reads straight into it; small spans (thousands of
    small tensors, each large one's ends) are read a chunk of file at a time, not one
    request each. Spans may repeat or interleave: the pieces are read in file order, each
    span's own in order (the sort is stable)."""
    chunk = CHUNK
    pieces: list[tuple[int, int, int]] = []
    owner: list[int] = []
    for i, (pos, addr, n) in enumerate(spans):
        end = pos + n
        while pos < end:
            k = min(end, (pos // chunk + 1) * chunk) - pos
            pieces.append((pos, addr, k))
            owner.append(i)
            pos, addr = pos + k, addr + k
    crcs = [0] * len(spans)
    if not pieces:
        return crcs
    order = sorted(range(len(pieces)), key=lambda j: pieces[j][0])
    pieces, owner = [pieces[j] for j in order], [owner[j] for j in order]
    got = reader.read_scatter(pieces, checksum=checksum, threads=THREADS, chunk_bytes=chunk)
    if checksum:
        for (_, _, k), i, crc in zip(pieces, owner, got):
            crcs[i] = _native.crc32c_combine(crcs[i], crc, k)
    return crcs
