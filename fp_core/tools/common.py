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


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (nested dicts, lists, tuples), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def describe_pages(obj: Any) -> tuple[float | None, str]:
    """Which pages the CPU tensors in ``obj`` (nested dicts, lists, tuples) sit on: the
    share of their storages' bytes on transparent huge pages, and a line saying so.
    Staging and writing from 4 KiB pages cost a save more than from 2 MiB ones on some
    machines (benchmarks/sync_gap.py), and torch allocates 4 KiB pages unless
    ``THP_MEM_ALLOC_ENABLE=1`` is set, so a table's figures depend on it."""
    from .procinfo import huge_page_share, thp_mode

    seen: dict[int, int] = {}
    for t in tensors_in(obj):
        if t.device.type == "cpu":
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr():
                seen[st.data_ptr()] = st.nbytes()
    env = os.environ.get("THP_MEM_ALLOC_ENABLE")
    how = f"THP {thp_mode()}, THP_MEM_ALLOC_ENABLE={env if env is not None else 'unset'}"
    if not seen:
        return None, f"pages: no tensor bytes in CPU memory ({how})"
    share = huge_page_share(sorted(seen.items()))
    if share is None:
        return None, f"pages: not known ({how})"
    return share, f"pages: {share:.0%} of the tensors' bytes on transparent huge pages ({how})"


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
