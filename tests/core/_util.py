"""Helpers shared by several files of tests/core (a module, not a test file).

* the save / load round trip of test_round_trip.py and test_backends.py;
* the small training state and checkpoint objects of the async pipeline tests (test_pipeline_*.py,
  test_huge_pages.py).
"""

from __future__ import annotations

import os

import torch
from conftest import MiB, assert_identical, assert_no_temps

import fp_core

# ====================================================================== save / load round trip


def load_both(path: str, weights_only: bool = False):
    """The checkpoint read by torch.load and by fp_core.load (plain and verifying)."""
    return (
        torch.load(path, weights_only=weights_only),
        fp_core.load(path, weights_only=weights_only),
        fp_core.load(path, weights_only=weights_only, verify=True),
    )


def roundtrip(obj, path: str, weights_only: bool = False, **opts):
    stats = fp_core.save(obj, path, **opts)
    assert os.path.getsize(path) == stats.bytes
    fp_core.verify(path)
    for got in load_both(path, weights_only=weights_only):
        assert_identical(obj, got)
    assert_no_temps(os.path.dirname(path))
    return stats


# ====================================================================== async pipeline


class Net(torch.nn.Module):
    """Embedding (the bulk of the bytes, cheap to run) + Linear + BatchNorm."""

    def __init__(self, width: int = 256, vocab: int = 1000) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.fc = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.head = torch.nn.Linear(width, 8)

    def forward(self, ids):
        return self.head(torch.relu(self.bn(self.fc(self.emb(ids)))))


def train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.emb.num_embeddings, (16,), generator=g)
    y = torch.randint(0, 8, (16,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(ids), y)
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()


def make_state(vocab: int = 1000):
    """Embedding + Linear + BatchNorm with Adam, one step taken."""
    torch.manual_seed(0)
    model = Net(256, vocab)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, opt, 0)
    return model, opt


def big_obj(mib: int = 64, value: float = 1.0) -> dict:
    return {"big": torch.full((mib * MiB // 4,), value), "meta": {"v": value}}
