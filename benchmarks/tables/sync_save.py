"""Tables of docs/performance.md's "Synchronous save" part (and the disk's fio figures)."""

from __future__ import annotations

from . import Results, row, table

BENCH_4G = "bench-4GiB.txt"

# The bench's row labels, as the page names them (the bench keeps its labels short).
SAVE_ROWS = (
    ("(a)", "(a) device limit: native engine, zero-copy, + fdatasync", False),
    ("(b)", "(b) torch.save + fsync", False),
    ("(c)", "(c) Lightning default (`_atomic_save`: BytesIO, then write) + fsync", False),
    ("(d)", "(d) safetensors `save_file` + fsync", False),
    ("(e)", "(e) `torch.distributed.checkpoint.save`", False),
    ("(f)", "**(f) `fp_core.save`** (atomic, fsync'ed, CRC-32C of every byte)", True),
)


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


@table("save-4GiB", BENCH_4G)
def save_4gib(r: Results) -> list[str]:
    out = [row("Save (durable)", "GB/s", "vs device", "vs torch.save", "peak RSS added"),
           "|---|---:|---:|---:|---:|"]
    for key, label, bold in SAVE_ROWS:
        c = r.row(BENCH_4G, "Save (durable)", key)
        out.append(row(label, *(_bold(c[k], bold) for k in ("GB/s", "vs device", "vs torch", "peak RSS +"))))
    return out
