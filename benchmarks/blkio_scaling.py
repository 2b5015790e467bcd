"""The FastPersist paper's scaling claim, simulated on one disk: every rank gets its own write
bandwidth B (one cgroup v1 blkio group per rank, ``blkio.throttle.write_bps_device``), and
a one-file save whose ranks write their own rows (``layout="file"``) should then write at
about W * B, while a gather-to-rank-0 save (rank 0 writes the whole file alone) stays at B.

Run as root on a machine with cgroup v1 blkio mounted::

    .venv/bin/python benchmarks/blkio_scaling.py --dir DIR > benchmarks/results/blkio-scaling.txt

Steps: find the block device the output directory's bios are submitted to; measure the
disk's own O_DIRECT write rate; check that a throttled group really writes at B; then for
W = 1, 2, 4 ranks (torchrun, gloo, CPU), each rank moved into its own group before it
writes, rows alternated in every round:

* ``file``: ``fp_core.save(state, path, layout="file")`` of a ``Shard(0)`` DTensor state,
  every rank writing its own rows of one torch.save file;
* ``gather``: rank 0 saves the full state (gathered before the clock starts) with
  ``fp_core.save``: the same writer, one rank;
* ``raw``: every rank writes its share of the bytes to its own file with plain O_DIRECT
  writes and fdatasync: what the throttle lets W ranks write, the simulation's ceiling.

Every row writes with O_DIRECT (buffered writeback is submitted by the kernel's flusher,
outside the rank's group, and escapes the throttle); the engine's backend is printed.
The groups are removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BLKIO = "/sys/fs/cgroup/blkio"
MiB = 1 << 20

METHOD = """Method and limits. Each rank is a process in its own cgroup v1 blkio group whose
blkio.throttle.write_bps_device caps the bytes it submits to the disk at B per second, so
W ranks on one disk stand for W nodes with a disk (or a link) of B each. The caps count
bios the rank's own threads submit: O_DIRECT writes, which every row uses. What it shows:
whether the one-file layout spreads the bytes evenly enough, and coordinates cheaply
enough, for W ranks' bandwidths to add up, and that a gather-to-rank-0 save is held to one
rank's B however many ranks there are. What it does not show: a shared file system's own
costs (locks, metadata servers, striping of one file over servers), network transfer
between nodes, or the gather's cost on a real interconnect (the gather row's full state
is gathered before its clock starts, so the row is the best case for gathering). All
ranks share the machine's CPUs and one disk, whose own limit is printed above, and the
few blocks where two ranks' rows meet are written through the page cache (a few KiB per
file: whether their writeback counts against a group does not show in these figures)."""


# --------------------------------------------------------------------------- the disk


def block_device(path: str) -> tuple[str, str]:
    """(MAJ:MIN, sysfs name) of the device the file system at ``path`` submits bios to.

    A partition's bios are throttled on its whole disk (a partition has no queue of its
    own); a device-mapper or md device is where the file system submits them, so its own
    number is the one to throttle."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sysdev = os.path.realpath(f"/sys/dev/block/{dev}")
    if not os.path.exists(sysdev):
        raise RuntimeError(f"{path}: its file system's device {dev} is no block device (tmpfs, overlay, "
                           "network file system?): choose a --dir on a local disk")
    if os.path.exists(os.path.join(sysdev, "partition")):
        sysdev = os.path.dirname(sysdev)
        with open(os.path.join(sysdev, "dev")) as f:
            dev = f.read().strip()
    return dev, os.path.basename(sysdev)


def direct_write(path: str, nbytes: int, chunk: int = 4 * MiB) -> float:
    """Write ``nbytes`` with O_DIRECT and fdatasync; seconds taken."""
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(4096) * (chunk // 4096))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            n = os.write(fd, memoryview(buf)[:min(chunk, left)])
            left -= n
        os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()


class Groups:
    """blkio groups, one per rank, each capped at ``bps`` on ``dev``; removed on close."""

    def __init__(self, tag: str, n: int, dev: str, bps: int) -> None:
        self.paths: list[str] = []
        try:
            for i in range(n):
                p = os.path.join(BLKIO, f"{tag}_r{i}")
                os.mkdir(p)
                self.paths.append(p)
                with open(os.path.join(p, "blkio.throttle.write_bps_device"), "w") as f:
                    f.write(f"{dev} {bps}\n")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.paths:
            # a process still in the group (a rank that did not exit) goes back to the root first
            try:
                with open(os.path.join(p, "cgroup.procs")) as f:
                    pids = f.read().split()
                for pid in pids:
                    try:
                        with open(os.path.join(BLKIO, "cgroup.procs"), "w") as f:
                            f.write(pid)
                    except OSError:
                        pass
                os.rmdir(p)
            except OSError as e:
                print(f"warning: could not remove blkio group {p}: {e}", file=sys.stderr)
        self.paths = []


def throttled_writes(group: str, dev: str) -> int:
    """Bytes written to ``dev`` that went through ``group``'s throttle so far."""
    with open(os.path.join(group, "blkio.throttle.io_service_bytes")) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[0] == dev and parts[1] == "Write":
                return int(parts[2])
    return 0


def join_group(path: str) -> None:
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def throttle_check(tag: str, dev: str, bps: int, d: str, nbytes: int) -> float:
    """Bytes per second a process in a group capped at ``bps`` writes with O_DIRECT."""
    g = Groups(tag + "_check", 1, dev, bps)
    try:
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import blkio_scaling as b; "
                f"b.join_group({g.paths[0]!r}); print(b.direct_write({os.path.join(d, 'check.bin')!r}, {nbytes}))")
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        return nbytes / float(out.strip())
    finally:
        g.close()
        _unlink(os.path.join(d, "check.bin"))


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- the launcher


def launch(args: argparse.Namespace) -> int:
    if os.geteuid() != 0 or not os.path.isdir(BLKIO):
        print(f"needs root and cgroup v1 blkio at {BLKIO}", file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    dev, name = block_device(args.dir)
    bps = int(args.bps_mib * MiB)
    tag = f"fp_blkio_{os.getpid()}"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the groups are removed on a kill too
    lines = [f"output dir {args.dir} on /dev/{name} ({dev}); throttled there"]
    disk = [len_ / t for len_, t in [(args.disk_mib * MiB, direct_write(os.path.join(args.dir, "disk.bin"),
                                                                        args.disk_mib * MiB)) for _ in range(2)]]
    _unlink(os.path.join(args.dir, "disk.bin"))
    disk_bps = max(disk)
    lines.append(f"disk's own O_DIRECT write rate, one writer, {args.disk_mib} MiB x 2: "
                 f"{' '.join(f'{x / MiB:.0f}' for x in disk)} MiB/s")
    got = throttle_check(tag, dev, bps, args.dir, min(bps * 2, 512 * MiB))
    lines.append(f"throttle check: one group capped at B = {args.bps_mib:.0f} MiB/s wrote {got / MiB:.1f} MiB/s "
                 f"({got / bps:.2f} B) with O_DIRECT")
    if not 0.8 <= got / bps <= 1.2:
        print("\n".join(lines), flush=True)
        print("the throttle does not hold: no scaling figures", file=sys.stderr)
        return 1
    if max(args.ranks) * bps > 0.5 * disk_bps:
        lines.append(f"warning: {max(args.ranks)} * B is over half the disk's rate: the disk, not B, may limit")
    print("\n".join(lines), flush=True)
    results = []
    for w in args.ranks:
        g = Groups(f"{tag}_w{w}", w, dev, bps)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(w), "--master-port",
                   str(port), os.path.abspath(__file__), "--worker", "--dir", args.dir, "--size-mib",
                   str(args.size_mib), "--rounds", str(args.rounds), "--groups", ",".join(g.paths), "--dev", dev, "--out", out,
                   "--engine-options", args.engine_options]
            done = subprocess.run(cmd, stdout=None if args.verbose else subprocess.DEVNULL,
                                  stderr=None if args.verbose else subprocess.PIPE, text=True)
            if done.returncode != 0:
                tail = (done.stderr or "")[-4000:]
                print(f"W={w}: the ranks failed (exit {done.returncode}); their stderr's end:\n{tail}",
                      file=sys.stderr)
                _unlink(out)
                return 1
            with open(out) as f:
                res = json.load(f)
            os.unlink(out)
        finally:
            g.close()
        results.append(res)
        print(f"  W={w}: done ({res['backend']})", flush=True)
    table = ["", f"B = {args.bps_mib:.0f} MiB/s per rank, state {args.size_mib} MiB (Shard(0) DTensors on W ranks), "
             f"engine options {args.engine_options}, "
             f"{args.rounds} rounds, rows alternated, medians; MiB/s = file bytes / (barrier to barrier)",
             f"  {'W':>2} {'W*B':>6} {'file':>7} {'/W*B':>6} {'gather':>7} {'/B':>5} {'raw':>7} {'/W*B':>6}   "
             f"per round file MiB/s"]
    for res in results:
        w = res["world"]
        med = {k: statistics.median(v) for k, v in res["mibps"].items()}
        table.append(f"  {w:>2} {w * args.bps_mib:6.0f} {med['file']:7.1f} {med['file'] / (w * args.bps_mib):6.2f} "
                     f"{med['gather']:7.1f} {med['gather'] / args.bps_mib:5.2f} {med['raw']:7.1f} "
                     f"{med['raw'] / (w * args.bps_mib):6.2f} {med['file'] / med['raw']:8.2f}   {' '.join(f'{x:.0f}' for x in res['mibps']['file'])}")
    table.append("")
    for res in results:
        w = res["world"]
        f = statistics.median(res["mibps"]["file"]) / (w * args.bps_mib)
        gth = statistics.median(res["mibps"]["gather"]) / args.bps_mib
        table.append(f"  [{'PASS' if f >= 0.8 else 'FAIL'}] W={w}: file at {f:.2f} W*B (target >= 0.80); "
                     f"gather at {gth:.2f} B (stays at B: {'yes' if gth <= 1.2 else 'no'})")
    table.append(f"  engine backend of the gather row's save: {sorted({r['backend'] for r in results})}")
    table.append("  bytes through the ranks' throttles / bytes written (O_DIRECT reaches the groups; buffered "
                 "writeback does not), median per row:")
    for res in results:
        table.append(f"    W={res['world']}: " + ", ".join(f"{k} {statistics.median(v):.3f}"
                                                         for k, v in res["throttled"].items()))
    table.append("  file row, each rank's own stats (medians over rounds; s): save call, of it write, sync, "
                 "layout; MiB it wrote")
    for res in results:
        per = []
        for r, rounds in enumerate(res["file_parts"]):
            med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
            per.append(f"r{r} {med['seconds']:.2f}/{med['write']:.2f}/{med['sync']:.2f}/{med['serialize']:.2f}/"
                       f"{med['rank_mib']:.0f}")
        table.append(f"    W={res['world']}: " + "  ".join(per))
    table += ["", METHOD]
    print("\n".join(table), flush=True)
    return 0


# --------------------------------------------------------------------------- a rank


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    group = args.groups.split(",")[rank]
    join_group(group)  # before anything is written

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fp_core

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    n = max(1, args.size_mib // 64)
    torch.manual_seed(0)
    # 64 MiB tensors of float32 rows: row counts divisible by no world size, so shards are uneven
    full = {f"w{i}": torch.randn(4099, 4093) for i in range(n)}
    state = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, "step": 7}
    full_state = {"model": full, "step": 7}
    d = args.dir
    files = {"file": os.path.join(d, "file.pt"), "gather": os.path.join(d, "gather.pt"),
             "raw": os.path.join(d, f"raw{rank}.bin")}
    raw_bytes = (sum(t.nbytes for t in full.values()) // world) // 4096 * 4096
    backends: set[str] = set()
    engine_options = json.loads(args.engine_options)

    # the file row's own accounting on each rank: where a round's time goes besides the write
    file_parts: list[dict[str, float]] = []

    def file_row() -> None:
        st = fp_core.save(state, files["file"], layout="file", **engine_options)
        file_parts.append({"seconds": st.seconds, "write": st.write_seconds, "sync": st.sync_seconds,
                           "serialize": st.serialize_seconds,
                           "rank_mib": st.extra.get("rank_bytes", 0) / MiB})

    def gather_row() -> None:
        if rank == 0:
            st = fp_core.save(full_state, files["gather"], **engine_options)
            backends.add(str(getattr(st, "backend", "?")))

    def raw_row() -> None:
        direct_write(files["raw"], raw_bytes)

    rows = {"file": file_row, "gather": gather_row, "raw": raw_row}
    # a small save of each kind first: imports and first-call costs are not timed
    tiny = {"model": {"t": distribute_tensor(torch.randn(64, 1024), mesh, [Shard(0)])}}
    fp_core.save(tiny, os.path.join(d, "warm.pt"), layout="file")
    if rank == 0:
        fp_core.save({"t": torch.randn(64, 1024)}, os.path.join(d, "warm0.pt"))
    sizes: dict[str, int] = {}
    mibps: dict[str, list[float]] = {k: [] for k in rows}
    throttled: dict[str, list[float]] = {k: [] for k in rows}
    names = list(rows)
    for rnd in range(args.rounds):
        for k in names[rnd % 3:] + names[:rnd % 3]:
            dist.barrier()
            if rank == 0:
                os.sync()
            dist.barrier()
            before = throttled_writes(group, args.dev)
            t0 = time.perf_counter()
            rows[k]()
            dist.barrier()
            t = time.perf_counter() - t0
            through = torch.tensor([throttled_writes(group, args.dev) - before], dtype=torch.int64)
            dist.all_reduce(through)
            if k == "raw":
                nbytes = raw_bytes * world
            else:
                nbytes = os.path.getsize(files[k])
            sizes[k] = nbytes
            mibps[k].append(nbytes / MiB / t)
            throttled[k].append(int(through.item()) / nbytes)
            dist.barrier()
            if rank == 0 or k == "raw":
                _unlink(files[k])
    all_backends: list[Any] = [None] * world
    dist.all_gather_object(all_backends, sorted(backends))
    all_parts: list[Any] = [None] * world
    dist.all_gather_object(all_parts, file_parts)
    if rank == 0:
        for p in ("warm.pt", "warm0.pt"):
            _unlink(os.path.join(d, p))
        with open(args.out, "w") as f:
            json.dump({"world": world, "mibps": mibps, "sizes": sizes, "throttled": throttled, "file_parts": all_parts,
                       "backend": "/".join(sorted({b for bs in all_backends for b in bs}))}, f)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="output directory, on a local disk")
    ap.add_argument("--bps-mib", type=float, default=100.0, help="B, each rank's write cap, MiB/s")
    ap.add_argument("--size-mib", type=int, default=1024, help="state size (64 MiB tensors)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--disk-mib", type=int, default=1024, help="bytes for the disk's own rate")
    ap.add_argument("--engine-options", default="{}",
                    help='JSON of fp_core.save engine options for the file and gather rows, e.g. {"queue_depth": 4}')
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--groups", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--dev", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
