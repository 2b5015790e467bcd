"""Page-locked arenas of the size asked for (fp_core.io.pinned_host), checked without a GPU.

The CUDA driver's registration is the one part that needs a device (tests/core/test_cuda.py
runs it on one); here it is replaced by a recorder, and what is ours is checked for real:
the buffer's size and alignment, that it is registered once and unregistered once, after
the last view of it is gone and while its pages are still mapped, never when registering
failed, and a snapshot pipeline that takes and drops such arenas.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from conftest import MiB, assert_identical

import fp_core
import fp_core.io.arena
import fp_core.pipeline.checkpointer
from fp_core.io import pinned_host
from fp_core.io.arena import ARENA_ALIGN, Arena


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


class Driver:
    """Stands in for cudaHostRegister / cudaHostUnregister: records each call, and whether
    the pages were still mapped when unregistered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[tuple[int, bool]] = []
        self.fail = fail
        monkeypatch.setattr(pinned_host, "_register", self.register)
        monkeypatch.setattr(pinned_host, "_unregister", self.unregister)

    def register(self, addr: int, nbytes: int) -> None:
        if self.fail:
            raise OSError(f"cudaHostRegister of {nbytes} bytes failed (cudaError 2)")
        assert addr not in self.registered
        self.registered[addr] = nbytes

    def unregister(self, addr: int) -> None:
        assert addr in self.registered, "unregistered memory that was never registered"
        self.unregistered.append((addr, _mapped(addr)))

    @property
    def live(self) -> int:
        return len(self.registered) - len(self.unregistered)


@pytest.mark.parametrize("nbytes", [1, 4096, 3 * MiB + 123, 48 * MiB + 4096])
def test_buffer_is_the_size_asked_for_and_unregistered_after_its_last_view(monkeypatch, nbytes):
    drv = Driver(monkeypatch)
    buf, _ = pinned_host.pinned_buffer(nbytes, ARENA_ALIGN)
    assert buf.numel() == nbytes and buf.dtype == torch.uint8
    assert buf.data_ptr() % ARENA_ALIGN == 0
    (addr, size), = drv.registered.items()
    assert addr <= buf.data_ptr() and buf.data_ptr() + nbytes <= addr + size
    assert size < nbytes + 2 * ARENA_ALIGN  # no rounding up to a power of two
    buf.fill_(7)  # the memory is ours to write
    view = buf[nbytes // 2:]
    del buf
    gc.collect()
    assert drv.unregistered == []  # a view still holds it
    assert int(view[-1]) == 7
    del view
    gc.collect()
    assert drv.unregistered == [(addr, True)]  # once, while still mapped
    assert not _mapped(addr)  # and then unmapped


def test_huge_pinned_buffer_is_advised_and_huge_page_aligned(monkeypatch):
    Driver(monkeypatch)
    buf, huge = pinned_host.pinned_buffer(6 * MiB, ARENA_ALIGN, huge=True)
    assert buf.data_ptr() % (2 * MiB) == 0
    assert huge in (0, 6 * MiB)  # 0 where this kernel has no transparent huge pages


def test_a_failed_registration_unmaps_and_never_unregisters(monkeypatch):
    drv = Driver(monkeypatch, fail=True)
    before = open("/proc/self/maps").read().count("\n")
    with pytest.raises(OSError, match="cudaHostRegister of .* bytes failed"):
        pinned_host.pinned_buffer(8 * MiB, ARENA_ALIGN)
    gc.collect()
    assert drv.unregistered == []
    assert open("/proc/self/maps").read().count("\n") <= before + 1


def test_pinned_arena_uses_the_registered_buffer(monkeypatch):
    drv = Driver(monkeypatch)
    arena = Arena(10 * MiB + 5, pin=True, huge=False)
    assert arena.pin and arena.buf.numel() == 10 * MiB + 5 and drv.live == 1
    del arena
    gc.collect()
    assert drv.live == 0


def test_snapshot_saves_through_pinned_arenas_release_them_all(monkeypatch, disk_dir):
    """The pipeline's snapshot copies go through registered arenas (the arena asked for as a
    device state's would be: pinned), the files hold the state at each save, and once the
    checkpointer is closed every arena it registered is unregistered."""
    drv = Driver(monkeypatch)
    need = fp_core.pipeline.checkpointer.arena_need
    monkeypatch.setattr(fp_core.pipeline.checkpointer, "arena_need", lambda extents: (need(extents)[0], True))
    state = {"a": torch.randn(6 * MiB // 4), "b": torch.randn(3 * MiB // 4), "step": torch.tensor(0)}
    want = []
    with fp_core.AsyncCheckpointer(policy="snapshot", max_in_flight=2) as ckpt:
        for i in range(4):
            want.append({k: v.clone() for k, v in state.items()})
            ckpt.save(state, os.path.join(disk_dir, f"{i}.pt"))
            ckpt.fence()
            with torch.no_grad():
                state["a"].add_(1.0)
                state["step"] += 1
        ckpt.wait()
        assert drv.registered and all(mapped for _, mapped in drv.unregistered)
    del ckpt
    gc.collect()
    assert drv.live == 0, f"{drv.live} arenas still registered after close"
    for i in range(4):
        assert_identical(want[i], fp_core.load(os.path.join(disk_dir, f"{i}.pt"), verify=True))
