"""Byte sizes written as text: ``4GiB``, ``64M``, ``1.5G``, ``1024``."""

from __future__ import annotations

import re

_KiB, _MiB, _GiB, _TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of two; KB/MB/GB/TB are powers of ten.
_UNITS = {"": 1, "b": 1,
          "k": _KiB, "ki": _KiB, "kib": _KiB, "kb": 1000,
          "m": _MiB, "mi": _MiB, "mib": _MiB, "mb": 1000**2,
          "g": _GiB, "gi": _GiB, "gib": _GiB, "gb": 1000**3,
          "t": _TiB, "ti": _TiB, "tib": _TiB, "tb": 1000**4}

_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes of a size written as text: ``"4GiB"`` -> 4294967296, ``"64M"``, ``"1.5G"``,
    ``"1024"``, ``"512KB"`` (512000). Units are case-insensitive; KiB/MiB/GiB/TiB and K/M/G/T
    are powers of two, KB/MB/GB/TB powers of ten. Raises ``ValueError`` for anything else
    (a negative number, an unknown unit)."""
    m = _SIZE_RE.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    if unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB, 4GiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"not a size: {text!r} (too large)")
    return int(value)
