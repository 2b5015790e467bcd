"""What both benchmarks (:mod:`fp_core.tools.bench`, :mod:`fp_core.tools.bench_async`) use:
tensor byte counts, the device's name, removing a benchmark file, the targets' report lines."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch


def payload_bytes(obj: Any) -> int:
    """Bytes of every tensor's storage in ``obj`` (nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return str(device)


def remove(path: str) -> None:
    """Remove a benchmark file or directory (DCP writes one), if it is there."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def format_targets(targets: list[dict[str, Any]], unit: str = "") -> list[str]:
    """The PASS/FAIL lines that close a bench report."""
    if not targets:
        return []
    return ["", "Targets"] + [f"  [{'PASS' if t['pass'] else 'FAIL'}] {t['target']}: {t['value']}{unit}"
                              + (f" ({t['note']})" if t.get("note") else "") for t in targets]
