"""Exercise a sanitizer build of the native engine (run by tests/test_native_sanitizers.py).

    python native_sanitizer_driver.py /path/to/_native<EXT_SUFFIX> WORK_DIR

Loads the extension from that file as the top-level module ``_native`` (no fp_core, no
torch: the process runs under LD_PRELOAD=libasan.so) and drives every entry point with
numpy, ctypes and mmap buffers: CRC-32C, writes on each backend (staged, zero-copy,
unaligned tails, short files), reads, fault injection, the refusals of untrusted offsets,
EFAULT from unmapped memory, O_TMPFILE.  Any sanitizer report aborts the process; a clean
run prints DRIVER-OK last.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.machinery
import importlib.util
import mmap
import os
import sys

import numpy as np

KiB = 1024
MiB = 1024 * KiB
BIG = 2**63 - 1
PAGE = mmap.PAGESIZE


def load(path: str):
    loader = importlib.machinery.ExtensionFileLoader("_native", path)
    spec = importlib.util.spec_from_file_location("_native", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


N = load(sys.argv[1])
WORK = sys.argv[2]
rng = np.random.default_rng(1234)
_counter = [0]


def fresh(name: str) -> str:
    _counter[0] += 1
    return os.path.join(WORK, f"{_counter[0]:03d}-{name}")


def raises(exc, fn, *a, **kw):
    try:
        fn(*a, **kw)
    except exc as e:
        return e
    raise AssertionError(f"{fn!r}{a} did not raise {exc.__name__}")


def py_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def aligned(n: int, align: int = 4096, pad: int = 0) -> np.ndarray:
    raw = np.zeros(n + align + pad, dtype=np.uint8)
    return raw[(-raw.ctypes.data) % align :][: n + pad]


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def layout(total: int, n: int, src_pad: int = 64):
    """Random non-overlapping extents with gaps in [0, total), unaligned sources."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=2 * n, replace=False))
    extents, keep = [], []
    expected = np.zeros(total, dtype=np.uint8)
    for i in range(n):
        a, b = int(cuts[2 * i]), int(cuts[2 * i + 1])
        shift = int(rng.integers(0, src_pad))
        buf = rng.integers(0, 256, size=b - a + src_pad, dtype=np.uint8)
        src = buf[shift : shift + b - a]
        keep.append(buf)
        extents.append((a, src.ctypes.data, b - a))
        expected[a:b] = src
    return extents, keep, expected


# ---------------------------------------------------------------- CRC-32C


def check_crc() -> None:
    assert N.crc32c(b"123456789") == 0xE3069283
    assert N.crc32c(b"") == 0 and N.crc32c_addr(0, 0) == 0
    for size in [1, 7, 8, 9, 63, 4095, 4097]:
        data = rng.integers(0, 256, size=size, dtype=np.uint8)
        assert N.crc32c(data) == py_crc32c(data.tobytes())
    # around both lane lengths of the hardware loop and the fused-copy piece
    for size in [12287, 12288, 12289, 196607, 196608, 196609, 2 * 196608 + 4099, 1 * MiB + 3]:
        arr = rng.integers(0, 256, size=size + 8, dtype=np.uint8)
        for lo in (0, 1, 5):
            v = arr[lo : lo + size]
            whole = N.crc32c(v)
            assert N.crc32c_addr(v.ctypes.data, size) == whole
            cut = size // 3
            head = N.crc32c(v[:cut])
            assert N.crc32c(v[cut:], head) == whole
            assert N.crc32c_addr(v.ctypes.data + cut, size - cut, head) == whole
            assert N.crc32c_combine(head, N.crc32c(v[cut:]), size - cut) == whole
    assert N.crc32c_combine(0x12345678, 0, 0) == 0x12345678
    assert N.crc32c_combine(1, 2, BIG) == N.crc32c_combine(1, 2, BIG)  # every bit of len2
    raises(ValueError, N.crc32c_combine, 1, 2, -1)
    raises(ValueError, N.crc32c_addr, 0, 10)
    raises(ValueError, N.crc32c_addr, 4096, -1)
    raises(ValueError, N.crc32c_addr, 2**64 - 4096, 8192)
    # fused copy: cached and streaming (16-byte aligned destination) stores
    src = rng.integers(0, 256, size=3 * 196608 + 777, dtype=np.uint8)
    for dst_off, src_off, n in [(0, 0, src.size - 8), (16, 3, 5000), (5, 0, 255), (16, 1, 256), (1, 2, 0),
                                (32, 7, 196608 + 63)]:
        dst = aligned(n + 64)
        crc = N.copy_crc32c(dst.ctypes.data + dst_off, src.ctypes.data + src_off, n)
        assert crc == N.crc32c(src[src_off : src_off + n])
        assert np.array_equal(dst[dst_off : dst_off + n], src[src_off : src_off + n])
        assert not dst[:dst_off].any() and not dst[dst_off + n :].any()
    raises(ValueError, N.copy_crc32c, 0, src.ctypes.data, 1)
    raises(ValueError, N.copy_crc32c, src.ctypes.data, 2**64 - 10, 100)
    raises(ValueError, N.copy_crc32c, 2**64 - 10, src.ctypes.data, 100)


# ---------------------------------------------------------------- writes

BACKENDS = ["io_uring", "threadpool", "buffered"]


def write_file(path, extents, start, end, **kw):
    w = {k: kw.pop(k) for k in ("zero_copy", "checksum") if k in kw}
    with N.Engine(path, **kw) as eng:
        crcs, stats = eng.write(extents, start, end, **w)
        eng.truncate(end)
        eng.sync()
        return eng, crcs, stats


def check_writes() -> None:
    for backend in BACKENDS:
        # staged extents with gaps, unaligned end, chunks smaller than extents
        total = 1 * MiB + 12345
        extents, keep, expected = layout(total, 17)
        path = fresh(f"w-{backend}.bin")
        _, crcs, stats = write_file(path, extents, 0, total, backend=backend, chunk_bytes=64 * KiB,
                                    queue_depth=3, copy_threads=2, io_threads=2)
        assert stats["backend"] == backend
        assert read(path) == expected.tobytes()
        for (off, _, n), crc in zip(extents, crcs):
            assert crc == N.crc32c(expected[off : off + n])
        # short files: less than one block, exactly one, one byte more; an empty range
        for total in [1, 100, 511, 512, 4096, 4097]:
            data = rng.integers(0, 256, size=total, dtype=np.uint8)
            path = fresh(f"short-{backend}-{total}.bin")
            _, crcs, _ = write_file(path, [(0, data.ctypes.data, total)], 0, total, backend=backend)
            assert read(path) == data.tobytes() and crcs == [N.crc32c(data)]
        path = fresh(f"empty-{backend}.bin")
        _, crcs, stats = write_file(path, [], 0, 0, backend=backend)
        assert crcs == [] and stats["bytes"] == 0 and read(path) == b""
        # zero-copy: aligned middles straight from memory, known CRCs, staged heads and tails
        path = fresh(f"zc-{backend}.bin")
        with N.Engine(path, backend=backend, chunk_bytes=128 * KiB) as eng:
            A = eng.alignment
            body = aligned(640 * KiB)
            body[:] = rng.integers(0, 256, size=body.size, dtype=np.uint8)
            tail = rng.integers(0, 256, size=1001, dtype=np.uint8)
            start = 2 * A
            ext = [
                (start, body.ctypes.data, 256 * KiB, None),
                (start + 256 * KiB, body.ctypes.data + 256 * KiB, 128 * KiB, 0xDEADBEEF),
                (start + 384 * KiB + 3, tail.ctypes.data, 1001),
                (start + 512 * KiB, body.ctypes.data + 512 * KiB, 128 * KiB - 5),
            ]
            end = start + 640 * KiB
            crcs, stats = eng.write(ext, start, end, zero_copy=True)
            eng.truncate(end)
            assert crcs[1] == 0xDEADBEEF and crcs[0] == N.crc32c(body[: 256 * KiB])
            assert crcs[2] == N.crc32c(tail) and crcs[3] == N.crc32c(body[512 * KiB : 640 * KiB - 5])
            if eng.mem_alignment <= 4096:
                assert stats["zero_copy_bytes"] == 384 * KiB
            crcs, _ = eng.write(ext, start, end, zero_copy=True, checksum=False)
            assert crcs == [0, 0, 0, 0]  # no checksums asked for, known ones included
        img = read(path)
        assert img[:start] == bytes(start)
        assert img[start : start + 384 * KiB] == body[: 384 * KiB].tobytes()
        assert img[start + 384 * KiB + 3 : start + 384 * KiB + 1004] == tail.tobytes()
        assert img[start + 512 * KiB : end - 5] == body[512 * KiB : 640 * KiB - 5].tobytes()
    # two engines on one file, from two threads
    import threading

    total = 1 * MiB + 99
    extents, keep, expected = layout(total, 12)
    split = 512 * KiB
    first = [e for e in extents if e[0] + e[2] <= split]
    second = [e for e in extents if e[0] >= split]
    for off, addr, n in extents:
        if off < split < off + n:
            first.append((off, addr, split - off))
            second.insert(0, (split, addr + split - off, off + n - split))
    first.sort()
    second.sort()
    path = fresh("shared.bin")
    with N.Engine(path, backend="io_uring") as a, N.Engine(path, create=False, backend="threadpool") as b:
        t = threading.Thread(target=b.write, args=(second, split, total))
        t.start()
        a.write(first, 0, split)
        t.join()
        a.truncate(total)
    assert read(path) == expected.tobytes()
    # huge-page staging (buffers of 2 MiB and more are mapped), then the pool released
    big = rng.integers(0, 256, size=5 * MiB + 3, dtype=np.uint8)
    path = fresh("huge.bin")
    write_file(path, [(7, big.ctypes.data, big.size)], 0, big.size + 7, chunk_bytes=2 * MiB, queue_depth=2)
    assert read(path) == bytes(7) + big.tobytes()
    assert N.staging_bytes() > 0
    N.release_staging()
    assert N.staging_bytes() == 0


def check_bad_arguments() -> None:
    path = fresh("args.bin")
    buf = np.arange(8192, dtype=np.uint8)
    a = buf.ctypes.data
    raises(ValueError, N.Engine, fresh("x"), backend="nope")
    raises(ValueError, N.Engine, fresh("x"), queue_depth=0)
    raises(ValueError, N.Engine, fresh("x"), chunk_bytes=100)
    raises(ValueError, N.Engine, fresh("x"), mode=0o10000)
    raises(FileNotFoundError, N.Engine, os.path.join(WORK, "missing"), create=False)
    with N.Engine(path) as eng:
        A = eng.alignment
        top = BIG // A * A
        raises(ValueError, eng.write, [], 1, 100)
        raises(ValueError, eng.write, [], 100, 0)
        raises(ValueError, eng.write, [], top, BIG)
        raises(ValueError, eng.write, [], 0, 2**62)
        raises(ValueError, eng.write, [(2**40, a, BIG)], 2**40, 2**40 + A)
        raises(ValueError, eng.write, [(2**40 + 10, a, BIG - 2**40)], 2**40, 2**40 + A)
        raises(ValueError, eng.write, [(0, a, 10), (5, a, 10)], 0, A)
        raises(ValueError, eng.write, [(0, 0, 10)], 0, A)
        raises(ValueError, eng.write, [(0, 2**64 - 100, 200)], 0, A)
        raises(ValueError, eng.write, [(0, a)], 0, A)
        raises(ValueError, eng.write, [(0, a, 10, 2**40)], 0, A)
        raises(OverflowError, eng.write, [(2**63, a, 1)], 0, A)
        raises(TypeError, eng.write, 5, 0, A)
        raises(ValueError, eng.truncate, -1)
        e = raises(OSError, eng.truncate, BIG)
        assert e.errno in (errno.EFBIG, errno.EINVAL)
    raises(ValueError, eng.write, [], 0, 0)
    raises(ValueError, eng.fileno)


# ---------------------------------------------------------------- reads


def check_reads() -> None:
    total = 2 * MiB + 4321
    data = rng.integers(0, 256, size=total, dtype=np.uint8)
    path = fresh("r.bin")
    with open(path, "wb") as f:
        f.write(data.tobytes())
    for direct in (True, False):
        with N.Reader(path, direct=direct) as r:
            assert r.size == total
            for off, n, chunk in [(0, total, 4 * MiB), (1, total - 1, 256 * KiB), (12345, MiB + 3, 64 * KiB),
                                  (total - 10, 10, 4 * MiB), (777, 1, 4096), (4096, 100 * KiB, 4 * MiB)]:
                out = np.zeros(n + 8, dtype=np.uint8)
                dst = out[3 : 3 + n]
                crc = r.read_into(off, dst.ctypes.data, n, checksum=True, threads=3, chunk_bytes=chunk)
                assert np.array_equal(dst, data[off : off + n]) and crc == N.crc32c(data[off : off + n])
                assert not out[:3].any() and not out[3 + n :].any()
            # destination aligned like the file: chunks read straight into it
            A = max(r.alignment, r.mem_alignment)
            for off in (0, A, 3 * A + 5):
                n = total - off
                dst = aligned(n + A)[(off % A) :][:n]
                crc = r.read_into(off, dst.ctypes.data, n, checksum=True, threads=2, chunk_bytes=256 * KiB)
                assert np.array_equal(dst, data[off:]) and crc == N.crc32c(data[off:])
            out = np.zeros(8192, dtype=np.uint8)
            raises(EOFError, r.read_into, total - 5, out.ctypes.data, 10)
            raises(EOFError, r.read_into, BIG - 100, out.ctypes.data, 100)
            raises(EOFError, r.read_into, 5, out.ctypes.data, 2**62, chunk_bytes=4096)
            for off, n in [(BIG, 1), (1, BIG), (BIG - 4095, 8192), (2**62, 2**62)]:
                raises(ValueError, r.read_into, off, out.ctypes.data, n)
            raises(ValueError, r.read_into, -1, out.ctypes.data, 1)
            raises(ValueError, r.read_into, 0, 0, 1)
            raises(ValueError, r.read_into, 0, 2**64 - 4096, 8192)
            raises(ValueError, r.read_into, 0, out.ctypes.data, 1, threads=0)
            raises(ValueError, r.read_into, 0, out.ctypes.data, 1, chunk_bytes=1)
            assert r.read_into(BIG, out.ctypes.data, 0) == 0
            # scatter reads: grouped, overlapping, empty, aligned-alone pieces; refusals
            offs = sorted(int(x) for x in rng.integers(0, total - 64 * KiB, size=60)) + [total - 3, total]
            lens = [int(rng.choice([0, 1, 4096, 5000, 64 * KiB])) for _ in offs[:-2]] + [3, 0]
            outs = [np.zeros(n + 8, dtype=np.uint8) for n in lens]
            al = aligned(2 * A)[:A]
            pieces = [(o, out.ctypes.data + 3, n) for o, n, out in zip(offs, lens, outs)]
            pieces.insert(0, (0, al.ctypes.data, A))
            outs.insert(0, None)
            for gap in (0, 64 * KiB):
                crcs = r.read_scatter(pieces, checksum=True, threads=3, chunk_bytes=64 * KiB, gap=gap)
                for (o, _, n), out, crc in zip(pieces, outs, crcs):
                    got = al if out is None else out[3 : 3 + n]
                    assert np.array_equal(got, data[o : o + n]) and crc == N.crc32c(data[o : o + n])
            raises(EOFError, r.read_scatter, [(total - 5, out.ctypes.data, 10)])
            for bad in ([(BIG, out.ctypes.data, 1)], [(BIG - 100, out.ctypes.data, 100)], [(-1, out.ctypes.data, 1)], [(0, 0, 1)],
                        [(0, 2**64 - 4096, 8192)], [(5, out.ctypes.data, 1), (4, out.ctypes.data, 1)]):
                raises(ValueError, r.read_scatter, bad)
            raises(ValueError, r.read_scatter, [(0, out.ctypes.data, 8192)], chunk_bytes=4096)
            raises(ValueError, r.read_scatter, [], threads=0)
    raises(FileNotFoundError, N.Reader, os.path.join(WORK, "missing"))


# ---------------------------------------------------------------- faults


def check_faults() -> None:
    total = 1 * MiB + 17
    extents, keep, expected = layout(total, 6)
    for backend in BACKENDS:
        path = fresh(f"f-{backend}.bin")
        N.inject_fault("write", errno=errno.ENOSPC, after_bytes=256 * KiB)
        with N.Engine(path, backend=backend, chunk_bytes=64 * KiB) as eng:
            e = raises(OSError, eng.write, extents, 0, total)
            assert e.errno == errno.ENOSPC and e.filename == path
            eng.write(extents, 0, total)  # one-shot
            eng.truncate(total)
        assert read(path) == expected.tobytes()
        N.inject_fault("short_write")
        path = fresh(f"s-{backend}.bin")
        _, crcs, stats = write_file(path, extents, 0, total, backend=backend, chunk_bytes=64 * KiB)
        N.inject_fault(None)
        assert stats["short_writes"] > 0 and read(path) == expected.tobytes()
    N.inject_fault("io_uring_setup", errno=errno.EPERM)
    with N.Engine(fresh("u.bin")) as eng:
        assert eng.backend == "threadpool" and "EPERM" in eng.backend_reason
    path = fresh("u2.bin")
    e = raises(OSError, N.Engine, path, backend="io_uring")
    assert e.errno == errno.EPERM and not os.path.exists(path)
    N.inject_fault(None)
    N.inject_fault("o_direct")
    with N.Engine(fresh("d.bin")) as eng:
        assert eng.backend == "buffered"
    raises(OSError, N.Engine, fresh("d2.bin"), backend="threadpool")
    N.inject_fault(None)
    path = fresh("rf.bin")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 64)
    out = np.zeros(16384, dtype=np.uint8)
    with N.Reader(path) as r:
        N.inject_fault("read", errno=errno.EIO, after_bytes=4096)
        e = raises(OSError, r.read_into, 0, out.ctypes.data, 16384)
        assert e.errno == errno.EIO
        r.read_into(0, out.ctypes.data, 16384)
    raises(ValueError, N.inject_fault, "nope")
    raises(ValueError, N.inject_fault, "write", errno=0)
    N.inject_fault(None)


# ---------------------------------------------------------------- memory gone (EFAULT), mmap helpers


def anonymous_map(n: int):
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def unmapped_hole(n: int):
    """n bytes at an address that was mapped and is not accessible any more (guard pages
    around it). PROT_NONE rather than munmap: an unmapped range can be handed to another
    allocation of this process (ASan's, a thread's) before the engine touches it, and the
    write then succeeds; a PROT_NONE range stays reserved and faults (EFAULT) all the same."""
    m, base = anonymous_map(n + 2 * PAGE)
    m[PAGE : PAGE + n] = b"\x5a" * n
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + PAGE, n, 0) == 0  # PROT_NONE
    return m, base + PAGE


def check_efault_and_memory() -> None:
    n = 64 * KiB
    for backend in BACKENDS:
        path = fresh(f"efault-{backend}.bin")
        with N.Engine(path, backend=backend, chunk_bytes=32 * KiB) as eng:
            if eng.mem_alignment > PAGE or n % eng.alignment:
                continue
            m, hole = unmapped_hole(n)
            try:
                for ext, kw in [([(0, hole, n, 1)], {}), ([(0, hole, n)], {"checksum": False})]:
                    e = raises(OSError, eng.write, ext, 0, n, zero_copy=True, **kw)
                    assert e.errno == errno.EFAULT and "freed or unmapped" in str(e), str(e)
            finally:
                m.close()
    path = fresh("efault-r.bin")
    with open(path, "wb") as f:
        f.write(bytes(n))
    for direct in (True, False):
        with N.Reader(path, direct=direct) as r:
            m, hole = unmapped_hole(n)
            try:
                if direct and (r.mem_alignment > PAGE or n % r.alignment):
                    continue
                e = raises(OSError, r.read_into, 0, hole, n, chunk_bytes=n)
                assert e.errno == errno.EFAULT and "freed or unmapped" in str(e), str(e)
            finally:
                m.close()
    m, addr = anonymous_map(4 * MiB)
    try:
        assert N.populate(addr + 5, 4 * MiB - 5) == 4 * MiB - 5
        assert N.populate(addr, 0) == 0
        N.advise_huge(addr, 4 * MiB)
        N.advise_huge(addr, 100)
        raises(ValueError, N.populate, 2**64 - 4096, 8192)
    finally:
        m.close()


# ---------------------------------------------------------------- O_TMPFILE


def check_tmpfile() -> None:
    d = fresh("tmpdir")
    os.mkdir(d)
    data = rng.integers(0, 256, size=300 * KiB + 5, dtype=np.uint8)
    for backend in BACKENDS:
        try:
            eng = N.Engine(d, tmpfile=True, mode=0o600, backend=backend, chunk_bytes=64 * KiB)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                return  # not supported on this file system
            raise
        with eng:
            eng.write([(0, data.ctypes.data, data.size)], 0, data.size)
            eng.truncate(data.size)
            proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.link(str(eng.fileno()), os.path.join(d, backend), src_dir_fd=proc, follow_symlinks=True)
            finally:
                os.close(proc)
        assert read(os.path.join(d, backend)) == data.tobytes()
    raises(FileNotFoundError, N.Engine, os.path.join(d, "missing"), tmpfile=True)
    raises(ValueError, N.Engine, d, tmpfile=True, create=False)
    N.inject_fault("io_uring_setup", errno=errno.EPERM)
    raises(PermissionError, N.Engine, d, tmpfile=True, backend="io_uring")
    N.inject_fault(None)
    assert sorted(os.listdir(d)) == sorted(BACKENDS)
    # link_replace: a free name is linked straight to; a taken one linked aside and renamed over.
    final, tmp = os.path.join(d, "final"), os.path.join(d, ".final.tmp")
    for want_direct, body in ((True, b"one"), (False, b"two")):
        with N.Engine(d, tmpfile=True, mode=0o600, backend="buffered") as eng:
            os.pwrite(eng.fileno(), body, 0)
            assert N.link_replace(eng.fileno(), tmp, final) is want_direct
        assert read(final) == body and not os.path.exists(tmp)
    with N.Engine(d, tmpfile=True, mode=0o600, backend="buffered") as eng:
        N.inject_fault("rename", errno=errno.EXDEV)
        e = raises(OSError, N.link_replace, eng.fileno(), tmp, final)
        assert e.errno == errno.EXDEV and e.filename == final and not os.path.exists(tmp)
        e = raises(OSError, N.link_replace, eng.fileno(), os.path.join(d, "no", "t"), final)
        assert e.errno == errno.ENOENT and e.filename == os.path.join(d, "no", "t")
        raises(TypeError, N.link_replace, eng.fileno(), None, final)
    assert read(final) == b"two"


def main() -> None:
    check_crc()
    check_writes()
    check_bad_arguments()
    check_reads()
    check_faults()
    check_efault_and_memory()
    check_tmpfile()
    print("DRIVER-OK", flush=True)


if __name__ == "__main__":
    main()
