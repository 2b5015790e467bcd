"""benchmarks/resume_cost.py's first write: one byte of every page of every tensor changes,
and a mapped load's file does not (its pages are copied on that write, which the script
times)."""

from __future__ import annotations

import os
import sys

import torch
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from resume_cost import write_pages  # noqa: E402


def test_first_write_changes_a_byte_per_page_and_not_the_mapped_file(tmp_path):
    state = {"a": torch.zeros(5000, dtype=torch.float32), "b": {"c": torch.arange(3000, dtype=torch.int16)},
             "empty": torch.empty(0)}
    path = str(tmp_path / "s.pt")
    torch.save(state, path)
    with open(path, "rb") as f:
        before = f.read()
    mapped = torch.load(path, mmap=True, weights_only=True)
    write_pages(mapped)
    for got, orig in ((mapped["a"], state["a"]), (mapped["b"]["c"], state["b"]["c"])):
        g, o = got.view(torch.uint8), orig.view(torch.uint8)
        changed = (g != o).nonzero().flatten().tolist()
        assert changed == list(range(0, o.numel(), 4096))
        assert torch.equal(g[::4096], o[::4096] + 1)
    with open(path, "rb") as f:
        assert f.read() == before  # private mapping: the file is untouched
