"""This process's resources (/proc, getrusage): what the leak tests, the soak and the benches read."""

from __future__ import annotations

import bisect
import os
import resource


def fd_count() -> int:
    """Open file descriptors."""
    return len(os.listdir("/proc/self/fd"))


def status_field(name: str, default: int | None = None) -> int:
    """A numeric field of /proc/self/status (``Threads``, ``VmRSS`` and ``VmHWM`` in KiB...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    if default is None:
        raise KeyError(name)
    return default


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_seconds() -> float:
    """CPU time this process has used, every thread's, user + system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def huge_page_bytes(addr: int, length: int) -> int:
    """Bytes of [addr, addr+length) backed by transparent huge pages, from
    /proc/self/smaps (each mapping's AnonHugePages, prorated to the part of it in the
    range: exact when the range is whole mappings, as advised ranges become)."""
    return _smaps_bytes(addr, length, "AnonHugePages:")


def resident_bytes(addr: int, length: int) -> int:
    """Bytes of [addr, addr+length) in memory (each mapping's Rss, prorated the same way)."""
    return _smaps_bytes(addr, length, "Rss:")


def huge_page_share(ranges: list[tuple[int, int]]) -> float | None:
    """The fraction of the bytes of these ``(addr, length)`` ranges (disjoint) backed by
    transparent huge pages, from one read of /proc/self/smaps (prorated per mapping, as
    :func:`huge_page_bytes`); None when there are no bytes or smaps cannot be read."""
    total = sum(n for _, n in ranges)
    maps = _smaps_field("AnonHugePages:")
    if total <= 0 or maps is None:
        return None
    starts = [m[0] for m in maps]
    huge = 0
    for addr, n in ranges:
        end = addr + n
        i = max(0, bisect.bisect_right(starts, addr) - 1)
        while i < len(maps) and maps[i][0] < end:
            a, b, h = maps[i]
            if b > addr and h:
                huge += h * (min(b, end) - max(a, addr)) // (b - a)
            i += 1
    return min(1.0, huge / total)


def _smaps_bytes(addr: int, length: int, field: str) -> int:
    end, total = addr + length, 0
    for lo, hi, n in _smaps_field(field) or []:
        if lo < end and hi > addr:
            total += n * (min(hi, end) - max(lo, addr)) // (hi - lo)
    return total


def _smaps_field(field: str) -> list[tuple[int, int, int]] | None:
    """Every mapping of this process as ``(start, end, bytes)`` of one smaps field
    (``Rss:``, ``AnonHugePages:``...), in address order; None if smaps cannot be read."""
    out: list[tuple[int, int, int]] = []
    lo = hi = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = head.split("-")
                    lo, hi = int(a, 16), int(b, 16)
                elif head == field:
                    out.append((lo, hi, int(line.split()[1]) * 1024))
    except OSError:
        return None
    return out


def thp_mode() -> str:
    """The system's transparent huge page mode: always, madvise, never (or unknown)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"
