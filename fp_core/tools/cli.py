"""The ``fastpersist`` command: verify, inspect, clean, images, bench.

``python -m fp_core.tools.cli`` is the same command. ``verify``, ``inspect`` and ``clean``
import only the runtime; the benchmarks are imported when ``bench`` runs (its options come
from :mod:`fp_core.tools.bench_args`).

Exit status: 0 success; 1 a checkpoint is damaged (corrupt); 2 an I/O error or a path that
is missing or of the wrong kind; 3 a file FastPersist did not write (``verify`` of a
``torch.save`` zip: nothing recorded to check it against); 141 the reader of the output
went away (``| head``), as for any Unix tool killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..api import inspect, verify
from ..errors import CheckpointError, NotAFastPersistCheckpoint
from ..saving.commit import clean
from . import bench_args

EXIT_CORRUPT = 1
EXIT_IO = 2
EXIT_NOT_OURS = 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
# Several paths: the most telling status wins (damage over I/O over "not ours").
_SEVERITY = {0: 0, EXIT_NOT_OURS: 1, EXIT_IO: 2, EXIT_CORRUPT: 3}


def _worse(a: int, b: int) -> int:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def _cmd_verify(args: argparse.Namespace) -> int:
    status = 0
    for path in args.paths:
        try:
            report = verify(path)
        except NotAFastPersistCheckpoint as e:
            print(f"NOT  {path}: not a FastPersist checkpoint: {e}", file=sys.stderr)
            status = _worse(status, EXIT_NOT_OURS)
        except CheckpointError as e:
            print(f"FAIL {e}", file=sys.stderr)
            status = _worse(status, EXIT_CORRUPT)
        except OSError as e:
            print(f"FAIL {path}: {e}", file=sys.stderr)
            status = _worse(status, EXIT_IO)
        except Exception as e:  # noqa: BLE001 - one file's surprise must not stop the others' checks
            print(f"FAIL {path}: unexpected {type(e).__name__}: {e}", file=sys.stderr)
            status = _worse(status, EXIT_IO)
        else:
            print(f"OK   {path}: {_describe(report)} in {report['seconds'] * 1e3:.0f} ms")
    return status


def _describe(report: dict) -> str:
    """What a verify report says was checked."""
    kind = report.get("kind", "torch")
    if kind == "directory":
        unchecked = report.get("unchecked", [])
        return (f"directory, {report['files']} files checked ({report['bytes']} bytes)"
                + (f"; not FastPersist's, not checked: {', '.join(unchecked)}" if unchecked else ""))
    if kind == "safetensors":
        what = "verified" if report.get("checksums") else "no checksums, structure checked"
        return f"safetensors, {report['records']} tensors, {report['bytes']} bytes: {what}"
    if kind == "json":
        return f"JSON, {report['bytes']} bytes: no checksums, parses"
    return f"{report['records']} records, {report['bytes']} bytes verified"


def _cmd_inspect(args: argparse.Namespace) -> int:
    try:
        rows = inspect(args.path)
    except NotAFastPersistCheckpoint as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NOT_OURS
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    except OSError as e:
        print(f"error: {args.path}: {e}", file=sys.stderr)
        return EXIT_IO
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'record':<40} {'tensor':<40} {'dtype':<14} {'bytes':>14} {'crc32c':>8}")
    for r in rows:
        print(f"{r['name']:<40} {r.get('tensor') or '':<40} {r.get('dtype') or '':<14} "
              f"{r['size']:>14} {r.get('crc32c', ''):>8}")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        why = "no such directory" if not os.path.lexists(args.dir) else "not a directory"
        print(f"error: {args.dir}: {why}", file=sys.stderr)
        return EXIT_IO
    try:
        removed = clean(args.dir, recursive=args.recursive)
    except OSError as e:
        print(f"error: {args.dir}: {e}", file=sys.stderr)
        return EXIT_IO
    for p in removed:
        print(f"removed {p}")
    print(f"{len(removed)} orphaned temporary file(s) removed")
    return 0


def _cmd_images(args: argparse.Namespace) -> int:
    from ..io import memory_image

    try:
        d = memory_image.directory(create=False)
    except PermissionError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_IO
    if d is None:
        print("no shared-memory images (no directory for this user)")
        return 0
    if args.remove:
        removed = memory_image.remove_kept(d)
        for p in removed:
            print(f"removed {p}")
        print(f"{len(removed)} image(s) removed; those of running trainers are kept")
        return 0
    images = memory_image.kept_images(d)
    if args.json:
        print(json.dumps(images, indent=1))
        return 0
    for info in images:
        state = ("holds " if info["current"] else "stale: no longer ") + info["checkpoint"]
        owner = "running" if info["live"] else "owner gone"
        print(f"{info['image']}  {info['bytes'] / 2**20:.1f} MiB  {state}  ({owner})")
    total = sum(i["bytes"] for i in images)
    print(f"{len(images)} image(s), {total / 2**20:.1f} MiB in {d}")
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
    p = argparse.ArgumentParser(
        prog="fastpersist", description="Fast, durable, verifiable torch checkpoints.",
        epilog="exit status: 0 ok; 1 a checkpoint is damaged; 2 I/O error, or a missing path or one of the "
               "wrong kind; 3 not a FastPersist checkpoint (written by another tool: nothing to check it against); "
               "141 output pipe closed")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="check every byte of checkpoints (files, sharded or HF checkpoint "
                       "directories) against their recorded CRC-32C",
                       epilog="exit status: 0 every path checked out (a safetensors file without checksums: "
                              "its structure; JSON: it parses); 1 one is damaged; 2 I/O error; 3 one was not "
                              "written by FastPersist (a stock torch.save file: nothing to check it against)")
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

    m = sub.add_parser("images", help="list the checkpoint images kept in shared memory for a restart "
                       "(writer='process', resume_from_memory=True); --remove frees those whose run is gone")
    m.add_argument("--remove", action="store_true", help="remove the images of runs that are gone")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_cmd_images)

    b = sub.add_parser("bench", help="benchmark against torch.save, Lightning, safetensors, DCP")
    bench_args.add_arguments(b)
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught, not at exit
    except BrokenPipeError:
        # The reader went away (``| head``): quiet, as Unix tools are. Python would flush
        # stdout again at exit and print a second error, so stdout goes to /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
