"""The ``fastpersist`` command: verify, inspect, clean, bench.

``python -m fp_core.tools.cli`` is the same command. ``verify``, ``inspect`` and ``clean``
import only the runtime; the benchmarks are imported when ``bench`` runs (its options come
from :mod:`fp_core.tools.bench_args`).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..api import inspect, verify
from ..commit import clean
from ..errors import CheckpointError
from . import bench_args


def _cmd_verify(args: argparse.Namespace) -> int:
    status = 0
    for path in args.paths:
        try:
            report = verify(path)
        except CheckpointError as e:
            print(f"FAIL {e}", file=sys.stderr)
            status = 1
        except OSError as e:
            print(f"FAIL {path}: {e}", file=sys.stderr)
            status = 2
        except Exception as e:  # noqa: BLE001 - one file's surprise must not stop the others' checks
            print(f"FAIL {path}: unexpected {type(e).__name__}: {e}", file=sys.stderr)
            status = 2
        else:
            print(f"OK   {path}: {report['records']} records, {report['bytes']} bytes verified "
                  f"in {report['seconds'] * 1e3:.0f} ms")
    return status


def _cmd_inspect(args: argparse.Namespace) -> int:
    try:
        rows = inspect(args.path)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'record':<40} {'tensor':<40} {'dtype':<14} {'bytes':>14} {'crc32c':>8}")
    for r in rows:
        print(f"{r['name']:<40} {r.get('tensor') or '':<40} {r.get('dtype') or '':<14} "
              f"{r['size']:>14} {r.get('crc32c', ''):>8}")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    removed = clean(args.dir, recursive=args.recursive)
    for p in removed:
        print(f"removed {p}")
    print(f"{len(removed)} orphaned temporary file(s) removed")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.run_dcp:
        from .bench_dcp import run_dcp

        return run_dcp(args, lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.run_async:
        from .bench_async import run_async

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)
        return run_async(args, log)
    from .bench import run
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastpersist", description="Fast, durable, verifiable torch checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="check every byte of checkpoints against their recorded CRC-32C")
    v.add_argument("paths", nargs="+")
    v.set_defaults(func=_cmd_verify)

    i = sub.add_parser("inspect", help="list a checkpoint's records, tensors, dtypes and sizes")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)

    c = sub.add_parser("clean", help="remove temporary files left by crashed saves")
    c.add_argument("dir")
    c.add_argument("-r", "--recursive", action="store_true")
    c.set_defaults(func=_cmd_clean)

    b = sub.add_parser("bench", help="benchmark against torch.save, Lightning, safetensors, DCP")
    bench_args.add_arguments(b)
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
