"""Transparent huge pages: the engine's advise_huge, live tensors moved onto huge pages under the
overlap policy, snapshot arenas on huge pages (skipped where THP is off)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from _util import big_obj
from conftest import MiB, assert_identical

from fp_core import AsyncCheckpointer


def _needs_thp() -> None:
    from fp_core.tools.procinfo import thp_mode
    if thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {thp_mode()!r} on this machine")


def _isolated(nbytes: int, keep: list) -> torch.Tensor:
    """A uint8 tensor on a private mapping of its own, starting off a 2 MiB boundary, so
    its advised interior is one mapping whose AnonHugePages in smaps are exactly its own
    (heap memory shares mappings with earlier tests' huge pages)."""
    import mmap
    mm = mmap.mmap(-1, nbytes + 8 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    keep.append(mm)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = -whole.data_ptr() % (2 * MiB) + 2 * MiB + 4096
    return whole[start:start + nbytes]


def _interior(t: torch.Tensor) -> int:
    a, n = t.data_ptr(), t.numel() * t.element_size()
    return max(0, (a + n) // (2 * MiB) * 2 * MiB - -(-a // (2 * MiB)) * 2 * MiB)


def test_advise_huge_collapses_memory_in_use_and_keeps_its_bytes():
    from fp_core import _native
    from fp_core.tools.procinfo import huge_page_bytes
    _needs_thp()
    keep: list = []
    t = _isolated(16 * MiB + 12345, keep)
    t.random_()
    before = t.clone()
    inner = _interior(t)
    assert _native.advise_huge(t.data_ptr(), 100) == 0  # no whole 2 MiB page inside
    covered = _native.advise_huge(t.data_ptr(), t.numel(), collapse=True)
    if covered == 0:
        pytest.skip("the kernel declined MADV_COLLAPSE (Linux < 6.1?)")
    assert covered == inner >= 14 * MiB
    assert huge_page_bytes(t.data_ptr(), t.numel()) >= 0.9 * inner
    assert torch.equal(t, before)


@pytest.mark.parametrize("huge", [True, False], ids=["collapse", "default"])
def test_overlap_moves_live_tensors_onto_huge_pages_once_when_asked(disk_dir, huge):
    from fp_core.tools.procinfo import huge_page_bytes
    _needs_thp()
    keep: list = []
    model = torch.nn.Linear(2048, 2048)  # a 16 MiB weight, written in place under overlap
    with torch.no_grad():
        model.weight.data = _isolated(16 * MiB, keep).view(torch.float32).view(2048, 2048).copy_(model.weight)
    w = model.weight
    path = os.path.join(disk_dir, "live.pt")
    with AsyncCheckpointer(policy="overlap", collapse_live_tensors=huge) as ckpt:
        expected = copy.deepcopy(model.state_dict())
        ckpt.save(model.state_dict(), path).result()
        ckpt.wait_huge_pages()
        moved = ckpt.huge_page_bytes
        ckpt.save(model.state_dict(), path).result()  # the same storages: not asked again
        ckpt.wait_huge_pages()
        assert ckpt.huge_page_bytes == moved
    assert_identical(expected, torch.load(path, weights_only=True))
    assert_identical(expected, model.state_dict())  # contents untouched by the move
    inner = _interior(w)
    if huge:
        if moved == 0:
            pytest.skip("the kernel declined MADV_COLLAPSE (Linux < 6.1?)")
        assert moved >= inner
        assert huge_page_bytes(w.data_ptr(), w.numel() * 4) >= 0.9 * inner
    else:
        # nothing asked (the pages may still be huge: reused heap memory keeps its backing)
        assert moved == 0


@pytest.mark.parametrize("huge", [True, False])
def test_snapshot_arena_is_on_huge_pages(disk_dir, huge):
    from fp_core.tools.procinfo import huge_page_bytes
    _needs_thp()
    obj = big_obj(32)
    path = os.path.join(disk_dir, "snap.pt")
    with AsyncCheckpointer(policy="snapshot", huge_pages=huge) as ckpt:
        for _ in range(2):  # the first fill (background) and a reuse (inside save())
            ckpt.save(obj, path).result()
        arena = ckpt._arenas[0]
        if huge:
            assert arena.buf.data_ptr() % (2 * MiB) == 0
            assert arena.huge_bytes >= 30 * MiB
            assert huge_page_bytes(arena.buf.data_ptr(), arena.buf.numel()) >= 0.9 * arena.huge_bytes
        else:
            assert arena.huge_bytes == 0  # not advised (THP "always" may still back it)
        assert ckpt.huge_page_bytes == 0  # the live tensor was copied, not moved
    assert_identical(obj, torch.load(path, weights_only=True))


def test_huge_page_share_reads_which_pages_back_tensors(monkeypatch):
    """What the bench prints under its state dict: the share of the tensors' bytes on huge
    pages, from one read of smaps, the same as the per-range reader finds."""
    from fp_core import _native
    from fp_core.tools.common import describe_pages
    from fp_core.tools.procinfo import huge_page_bytes, huge_page_share, thp_mode
    _needs_thp()
    keep: list = []
    small_pages = _isolated(8 * MiB, keep)
    small_pages.fill_(1)  # faulted in without advice
    huge = _isolated(16 * MiB + 4096, keep)
    huge.fill_(2)
    if _native.advise_huge(huge.data_ptr(), huge.numel(), collapse=True) == 0:
        pytest.skip("the kernel declined MADV_COLLAPSE (Linux < 6.1?)")
    ranges = [(t.data_ptr(), t.numel()) for t in (small_pages, huge)]
    on_huge = huge_page_bytes(huge.data_ptr(), huge.numel())
    assert on_huge >= 0.9 * _interior(huge)
    expected = (huge_page_bytes(small_pages.data_ptr(), small_pages.numel()) + on_huge) / (24 * MiB + 4096)
    assert huge_page_share(ranges) == pytest.approx(expected, abs=1e-6)
    assert huge_page_share([ranges[1]]) == pytest.approx(on_huge / huge.numel(), abs=1e-6)
    assert huge_page_share([]) is None
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    share, line = describe_pages([huge, torch.empty(0)])  # an empty tensor counts for nothing
    whole = huge.untyped_storage()  # the storage counts, not the view of it
    assert share == pytest.approx(huge_page_bytes(whole.data_ptr(), whole.nbytes()) / whole.nbytes(), abs=1e-6)
    assert 0 < share <= 1
    assert f"{share:.0%} of the tensors' bytes on transparent huge pages" in line
    assert "THP_MEM_ALLOC_ENABLE=1" in line
    assert describe_pages([]) == (None, "pages: no tensor bytes in CPU memory (THP "
                                        f"{thp_mode()}, THP_MEM_ALLOC_ENABLE=1)")
