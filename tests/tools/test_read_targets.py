"""benchmarks/read_targets.py's targets aligned like the file: every tensor at the file's
offset of its bytes modulo a page (what lets the reader go straight in), and load_into
fills them with the file's values."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from read_targets import file_offsets, placed_like_the_file  # noqa: E402

import fp_core  # noqa: E402
from fp_core.tools.bench import _aligned_buffer, flatten_tensors, make_state_dict  # noqa: E402


def test_tensors_placed_like_the_file_are_filled_by_load_into(disk_dir):
    state = make_state_dict(8 << 20, seed=2)
    path = os.path.join(disk_dir, "s.pt")
    fp_core.save(state, path)
    target = make_state_dict(8 << 20, seed=3)
    offsets = file_offsets(target, path)
    # flattened once each (the same tensor objects every call; flattening the 2412-tensor
    # state again for every tensor took most of this test's time)
    want, flat_target = flatten_tensors(state), flatten_tensors(target)
    assert all(torch.equal(t, want[name]) for name, t in flat_target.items())
    arena = _aligned_buffer(os.path.getsize(path), 4096)
    arena[:] = 0
    placed = placed_like_the_file(target, offsets, arena)
    moved = 0
    for name, t in flatten_tensors(placed).items():
        if t.numel():
            assert (t.data_ptr() - arena.ctypes.data) == offsets[id(flat_target[name])], name
            moved += 1
    assert moved == len(offsets)
    fp_core.load_into(placed, path, verify=True)
    assert all(torch.equal(t, want[name]) for name, t in flatten_tensors(placed).items())
    assert np.count_nonzero(arena) > 0.9 * sum(t.numel() * t.element_size() for t in want.values())
