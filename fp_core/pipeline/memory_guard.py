"""Memory a background write still reads is never freed under it.

Under the overlap policy the writer reads live tensors until the fence. Parameters only
change at ``optimizer.step()``, but a storage can also be *freed* in place: FSDP releases
parameter memory with ``storage.resize_(0)`` during forward and backward, and any code may
``resize_`` a tensor. Freed memory under a zero-copy write is an ``EFAULT`` at best and a
crash of the process at worst (a copy thread reading an unmapped page).

So while such a write is pending, ``UntypedStorage.resize_`` and ``Tensor.resize_`` wait
for the writer to let go of the storage they resize (the same wait as the fence, for that
storage only) before they run. The wrappers are installed while there is something to
guard and removed afterwards; a resize of any other storage pays one dictionary lookup.
Resizes that bypass Python (an operator's ``out=`` tensor resized in C++) are not seen
here; the pipeline checks after each write that no storage it read changed its address or
size, and fails that save instead of storing what was read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

_lock = threading.Lock()
_guarded: dict[int, list[threading.Event]] = {}  # storage key -> "writer let go" events
_orig_storage_resize = torch.UntypedStorage.resize_  # inherited (torch._C.StorageBase)
_orig_tensor_resize = torch.Tensor.resize_  # inherited (torch._C.TensorBase)


def storage_key(storage: torch.UntypedStorage) -> int:
    """Identity of the memory a storage object stands for (shared by every Python wrapper
    of the same storage)."""
    return storage._cdata


def _wait_for(key: int) -> None:
    with _lock:
        events = list(_guarded.get(key, ()))
    for ev in events:
        ev.wait()


def _storage_resize(self: Any, *args: Any, **kwargs: Any) -> Any:
    _wait_for(storage_key(self))
    return _orig_storage_resize(self, *args, **kwargs)


def _tensor_resize(self: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        key = storage_key(self.untyped_storage())
    except (RuntimeError, NotImplementedError):  # tensors without a storage of their own
        key = None
    if key is not None:
        _wait_for(key)
    return _orig_tensor_resize(self, *args, **kwargs)


class Guard:
    """Resizes of some storages wait until ``released`` is set; :meth:`close` ends it."""

    def __init__(self, storages: Iterable[torch.UntypedStorage], released: threading.Event) -> None:
        self.keys = {storage_key(s) for s in storages}
        self.released = released
        if not self.keys:
            return
        with _lock:
            if not _guarded:  # the first guard puts the wrappers on (class attributes shadow the C methods)
                _saved.update(storage=torch.UntypedStorage.__dict__.get("resize_"),
                              tensor=torch.Tensor.__dict__.get("resize_"))
                torch.UntypedStorage.resize_ = _storage_resize
                torch.Tensor.resize_ = _tensor_resize
            for k in self.keys:
                _guarded.setdefault(k, []).append(released)

    def close(self) -> None:
        """Stop guarding (the writer has let go, or the save never started)."""
        with _lock:
            for k in self.keys:
                events = _guarded.get(k)
                if events is not None:
                    events[:] = [e for e in events if e is not self.released]
                    if not events:
                        del _guarded[k]
            if self.keys and not _guarded:  # the last guard takes the wrappers off again
                _restore(torch.UntypedStorage, _saved.get("storage"), _storage_resize)
                _restore(torch.Tensor, _saved.get("tensor"), _tensor_resize)
            self.keys = set()


_saved: dict[str, Any] = {}  # what the classes held under resize_ before the wrappers went on


def _restore(cls: type, before: Any, ours: Any) -> None:
    """Put back what ``cls.resize_`` was, unless someone replaced our wrapper meanwhile."""
    if cls.__dict__.get("resize_") is not ours:
        return
    if before is None:
        del cls.resize_
    else:
        cls.resize_ = before


def active() -> bool:
    """Is any storage guarded now (tests)?"""
    with _lock:
        return bool(_guarded)
