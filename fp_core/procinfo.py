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
