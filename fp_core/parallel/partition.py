"""Cut a file's byte range into near-equal, block-aligned ranges and pick who writes them.

Partitioning cuts bytes, not tensors: a writer's range may start or end in
the middle of a tensor. Every range but the last starts and ends on a block boundary, so
each writer's O_DIRECT writes never touch another writer's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_range(start: int, end: int, writers: int, alignment: int) -> list[tuple[int, int]]:
    """``writers`` contiguous ranges covering [start, end), each within one block of the mean.

    ``start`` must be aligned. Ranges may be empty when there are more writers than blocks.
    """
    if writers < 1:
        raise ValueError("writers must be >= 1")
    if start % alignment:
        raise ValueError(f"range start {start} is not a multiple of the alignment {alignment}")
    n = end - start
    # Each cut is the exact share boundary rounded to the nearest block, so every share
    # is within one block of n / writers.
    cuts = [start] + [start + min(n, round(i * n / writers / alignment) * alignment)
                      for i in range(1, writers)] + [end]
    return list(zip(cuts[:-1], cuts[1:]))


def split_extents(extents: Sequence[tuple[int, int]], parts: int,
                  alignment: int) -> list[list[tuple[int, int]]]:
    """The bytes of ``extents`` (sorted, disjoint ``(offset, length)`` stretches of a file)
    cut into ``parts`` shares of near-equal size, in file order, as ``(offset, length)``
    lists.

    As :func:`split_range` over their concatenation: each cut is the exact share boundary,
    moved to the nearest block boundary of the file inside the extent it falls in, so
    that neighbouring shares meet in few blocks (a block two writers share cannot be
    written with O_DIRECT by either).
    """
    if parts < 1:
        raise ValueError("parts must be >= 1")
    total = sum(n for _, n in extents)
    cuts: list[int] = []
    j, before = 0, 0  # the extent a cut falls in, the bytes of the extents before it
    for i in range(1, parts):
        target = round(i * total / parts)
        while j < len(extents) - 1 and before + extents[j][1] < target:
            before += extents[j][1]
            j += 1
        if not extents:
            cuts.append(0)
            continue
        off, n = extents[j]
        pos = round((off + min(n, max(0, target - before))) / alignment) * alignment
        cuts.append(min(max(pos, off), off + n))
    shares: list[list[tuple[int, int]]] = []
    bounds = [None, *cuts, None]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        share = []
        for off, n in extents:
            a = off if lo is None else max(off, lo)
            b = off + n if hi is None else min(off + n, hi)
            if b > a:
                share.append((a, b - a))
        shares.append(share)
    return shares


def select_writers(topology: str | int | Sequence[int], world: int, hosts: Sequence[str]) -> list[int]:
    """Which ranks (of ``world``, whose hostnames are ``hosts``) write.

    ``"replica"``: every rank (the default: data-parallel ranks hold identical state);
    ``"node"``: the first rank on each host; an int ``k``: the first k ranks on each host;
    a sequence of ranks: exactly those.
    """
    if topology == "replica":
        return list(range(world))
    if isinstance(topology, str) and topology != "node":
        raise ValueError(f"topology must be 'replica', 'node', an int or a list of ranks, not {topology!r}")
    if topology == "node" or isinstance(topology, int):
        k = 1 if topology == "node" else int(topology)
        if k < 1:
            raise ValueError("writers per node must be >= 1")
        per_host: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            per_host.setdefault(h, []).append(r)
        return sorted(r for ranks in per_host.values() for r in ranks[:k])
    ranks = sorted(set(int(r) for r in topology))
    if not ranks or ranks[0] < 0 or ranks[-1] >= world:
        raise ValueError(f"writer ranks {list(topology)} are not within 0..{world - 1}")
    return ranks
