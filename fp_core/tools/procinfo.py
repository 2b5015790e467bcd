"""This process's resources (/proc, getrusage): what the leak tests, the soak and the benches read."""

from __future__ import annotations

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


def _smaps_bytes(addr: int, length: int, field: str) -> int:
    end, total = addr + length, 0
    lo = hi = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = head.split("-")
                    lo, hi = int(a, 16), int(b, 16)
                elif head == field and lo < end and hi > addr:
                    kb = int(line.split()[1])
                    total += kb * 1024 * (min(hi, end) - max(lo, addr)) // (hi - lo)
    except OSError:
        return 0
    return total


def thp_mode() -> str:
    """The system's transparent huge page mode: always, madvise, never (or unknown)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"
