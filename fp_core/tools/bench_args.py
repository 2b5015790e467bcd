"""The command line of ``fastpersist bench`` (both benchmarks), and nothing heavy.

``fastpersist --help``, ``fastpersist bench --help`` and the other subcommands build their
parsers from here without importing the benchmarks (torch.distributed.checkpoint, Lightning,
matplotlib...): :mod:`fp_core.tools.bench`, :mod:`fp_core.tools.bench_async` and
:mod:`fp_core.tools.bench_dcp` are imported only when a benchmark runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..format.sizes import parse_size

DEFAULT_SIZE = "1GiB"

# The sync benchmark's rows (fp_core.tools.bench).
SAVE_ROWS = ("device", "torch", "lightning", "safetensors", "dcp", "fastpersist")
LOAD_ROWS = ("load_device", "load_device_4k", "load_device_fresh", "load_torch", "load_torch_mmap", "load_safetensors",
             "load_fastpersist", "load_fastpersist_verify", "load_fastpersist_mmap", "load_fastpersist_mmap_verify",
             "load_into", "load_into_verify")
ALL_ROWS = SAVE_ROWS + LOAD_ROWS

# The training benchmark's modes (fp_core.tools.bench_async), in run order inside a round (each
# mode between two no-checkpoint runs): the fp_core modes first, the modes that leave dirty page
# cache behind (torch.save without O_DIRECT) last.
MODES = ("none", "disk", "auto", "overlap", "snapshot", "overlap_bg", "snapshot_bg", "overlap_huge", "snapshot_4k",
         "process", "torch", "lightning", "dcp")
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype: torch.<name>

# The engine options both benchmarks pass on to fp_core (--backend ... --io-threads).
ENGINE_OPTIONS = ("backend", "queue_depth", "chunk_bytes", "copy_threads", "io_threads")


def size_arg(text: str) -> int:
    """An argparse ``type``: :func:`fp_core.format.sizes.parse_size`, and more than zero bytes."""
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def sizes_arg(text: str) -> list[int]:
    """An argparse ``type``: a comma list of sizes (each as :func:`size_arg`)."""
    return [size_arg(part.strip()) for part in text.split(",") if part.strip()]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (those left out are fp_core's defaults)."""
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k, None) is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``fastpersist bench``: the sync benchmark's, ``--async`` and the training
    benchmark's."""
    parser.add_argument("--dir", default="./bench-out", help="where benchmark files go (default ./bench-out); "
                        "use the disk you checkpoint to, not tmpfs")
    parser.add_argument("--size", type=size_arg, default=size_arg(DEFAULT_SIZE),
                        help=f"checkpoint size, e.g. 512MiB, 4GiB (default {DEFAULT_SIZE})")
    parser.add_argument("--sizes", type=sizes_arg, metavar="SIZE,SIZE,...",
                        help="run the sync benchmark once per size, one table each (e.g. 16MiB,64MiB,260MiB: "
                             "small checkpoints of the same 2412 tensors, where the cost per tensor shows)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each runs every row once); medians are reported (default 3)")
    parser.add_argument("--warmup-rounds", dest="warmup_rounds", type=int, default=1,
                        help="uncounted rounds first (first writes and reads of a run are outliers; default 1)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart of GB/s")
    parser.add_argument("--only", metavar="ROWS", help=f"comma list of rows: {','.join(ALL_ROWS)}")
    parser.add_argument("--async", dest="run_async", action="store_true",
                        help="run the async training benchmark (step time, blocked time) instead")
    parser.add_argument("--dcp", dest="run_dcp", action="store_true",
                        help="run the sharded benchmark instead: torch.distributed.checkpoint's stock writer and "
                             "reader against FastPersist's on an FSDP2 model with Adam (--ranks processes under "
                             "torchrun; --width, --layers size it; --repeat rounds)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the --dcp benchmark (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the checkpoint's tensors live (default cpu); cuda: state dict / model on "
                             "the GPU, loads with map_location='cuda'")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="print what would run (sizes, rows or modes) and exit; needs no device")
    parser.add_argument("--json-out", dest="json_out", metavar="FILE.json",
                        help="also write the machine-readable result to this file")
    g = parser.add_argument_group("engine options (fp_core.save and the device row)")
    g.add_argument("--backend", choices=("auto", "io_uring", "threadpool", "buffered"))
    g.add_argument("--queue-depth", dest="queue_depth", type=int)
    g.add_argument("--chunk-bytes", dest="chunk_bytes", type=size_arg)
    g.add_argument("--copy-threads", dest="copy_threads", type=int)
    g.add_argument("--io-threads", dest="io_threads", type=int)
    add_async_arguments(parser)


def add_async_arguments(parser: argparse.ArgumentParser) -> None:
    """The training benchmark's own options (``--async``)."""
    g = parser.add_argument_group("async benchmark (--async)")
    g.add_argument("--modes", default=",".join(m for m in MODES if m != "overlap_huge"),
                   help=f"comma list of {','.join(MODES)} (default: all but overlap_huge, which runs "
                        "only beside none and disk)")
    g.add_argument("--iters", type=int, default=8, help="measured iterations per mode (default 8)")
    g.add_argument("--warmup", type=int, default=2, help="warm-up iterations per mode (default 2)")
    g.add_argument("--rounds", type=int, default=2,
                   help="rounds; each runs every mode once, slowdowns are per-round medians (default 2)")
    g.add_argument("--width", type=int, default=3072, help="MLP width (default 3072)")
    g.add_argument("--layers", type=int, default=10, help="MLP layers (default 10: ~94M params, 1.1 GB ckpt)")
    g.add_argument("--python-ops", type=int, default=0,
                   help="a Python-heavy step: also run this many small tensor ops per step, each a Python "
                        "call holding the GIL (where a writer thread in the same process competes)")
    g.add_argument("--batch", type=int, help="batch size (default: chosen so one step takes --compute-ms)")
    g.add_argument("--compute-ms", type=float, default=2000.0,
                   help="target compute per iteration, forward+backward+step (default 2000)")
    g.add_argument("--torch-threads", type=int, help="torch.set_num_threads for training (default: torch's)")
    g.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32",
                   help="parameter (and Adam state) dtype of the MLP (default float32)")
    g.add_argument("--adam", choices=("default", "fused"), default="default",
                   help="torch.optim.Adam as constructed by default (its step counters on the CPU) or with "
                        "fused=True (everything on the model's device; what GPU training often uses)")
    g.add_argument("--floor-pages", choices=("huge", "4k"), default="huge",
                   help="the pages the disk floor row writes from: huge (default; 2 MiB where the kernel "
                        "gives them, as FastPersist's own buffers) or 4k (as a plain torch.empty)")
    g.add_argument("--no-write-probe", dest="write_probe", action="store_false",
                   help="skip the 'write alone' probe (two fp_core.save and two torch.save of the checkpoint "
                        "before the rounds)")
