"""Page-locked host memory of the size asked for: the snapshot arena of device tensors.

torch's pinned allocator (``torch.empty(..., pin_memory=True)``, its caching host
allocator) rounds every block up to a power of two and keeps a freed block cached for the
rest of the process: an arena for an 11.3 GB checkpoint locked 16 GiB of host memory, and
kept it locked after the arena was dropped. Here an anonymous mapping of the size asked
for is registered with the CUDA driver (``cudaHostRegister``, portable to every device,
as ``torch.distributed.checkpoint``'s state-dict stager does) and unregistered just before
it is unmapped, once the last tensor viewing it is gone: ``is_pinned()`` is true of its
tensors, and copies from the device into them run asynchronously.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable

import torch

from .. import _native

log = logging.getLogger("fastpersist")

HUGE_PAGE = 2 << 20
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not one


def _register(addr: int, nbytes: int) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, _PORTABLE))
    if err != 0:
        raise OSError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {err})")


def _unregister(addr: int) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(addr))
    if err != 0:  # at exit the CUDA runtime may be gone first: nothing left to release then
        log.debug("fastpersist: cudaHostUnregister(%#x) returned cudaError %d", addr, err)


class _Mapping(mmap.mmap):
    """An anonymous mapping that calls ``release`` before it is unmapped: ``__del__`` runs
    when the last reference goes (torch's storage holds one through the buffer it views),
    before ``mmap``'s own deallocation unmaps the pages."""

    release: Callable[[], None] | None = None

    def __del__(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            try:
                release()
            except Exception as e:  # noqa: BLE001 - a destructor must not raise; the pages go anyway
                log.debug("fastpersist: releasing pinned host memory failed: %s", e)


def pinned_buffer(nbytes: int, align: int, huge: bool = False) -> tuple[torch.Tensor, int]:
    """A uint8 tensor of ``nbytes`` page-locked bytes starting ``align``-aligned (a power of
    two up to a huge page), and how many of its bytes were advised onto transparent huge
    pages (``huge``: advised before registering pins the pages in, so they are faulted in
    as huge pages). Raises ``OSError`` when the driver will not register it."""
    pad = max(align, HUGE_PAGE if huge else 0)
    m = _Mapping(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)
    skip = -raw.data_ptr() % pad
    buf = raw[skip: skip + nbytes]
    huge_bytes = _native.advise_huge(buf.data_ptr(), nbytes) if huge else 0
    addr = raw.data_ptr()
    _register(addr, raw.numel())
    m.release = lambda: _unregister(addr)  # registered: from here the mapping unregisters itself
    del m, raw  # buf's storage holds the mapping
    return buf, huge_bytes
