"""SparseFile: the skeleton capture's file object must behave as a real file for every write pattern."""

from __future__ import annotations

import random

from fp_core.skeleton import SparseFile


def test_sparse_file_matches_a_real_buffer_under_random_writes():
    rng = random.Random(1)
    for trial in range(2000):
        sf, ref, written = SparseFile(), bytearray(400), [False] * 400
        for _ in range(rng.randint(1, 12)):
            off, n = rng.randint(0, 350), rng.randint(0, 40)
            data = bytes(rng.randrange(256) for _ in range(n))
            sf.seek(off)
            sf.write(data)
            ref[off : off + n] = data
            written[off : off + n] = [True] * n
        assert sf.pread(0, 400) == bytes(ref), trial
        segs = sf.segments()
        assert all(a + len(da) <= b for (a, da), (b, _) in zip(segs, segs[1:])), trial
        covered = [False] * 400
        for a, da in segs:
            covered[a : a + len(da)] = [True] * len(da)
        assert covered == written, trial  # holes stay holes: nothing is materialised


def test_seek_past_end_makes_a_hole_not_bytes():
    sf = SparseFile()
    sf.write(b"head")
    sf.seek(1 << 40, 1)  # a 1 TiB storage skipped by torch
    sf.write(b"tail")
    assert sf.size == 4 + (1 << 40) + 4
    assert [len(d) for _, d in sf.segments()] == [4, 4]
