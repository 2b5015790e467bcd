"""Which checkpoints a keep-N rotation deletes: one rule for every adapter and store."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def to_delete(ordered: Sequence[str], keep: int | None, protected: Iterable[str] = ()) -> list[str]:
    """The checkpoints to delete so that ``keep`` remain, oldest first.

    ``ordered``: the complete checkpoints, oldest first. ``protected`` ones (the newest, the
    best) are never deleted, and at least as many remain as are protected even when
    ``keep`` is smaller (the Hugging Face Trainer's ``rotate_checkpoints`` rule, kept exactly).
    ``keep`` None or <= 0: delete nothing.
    """
    if keep is None or keep <= 0 or len(ordered) <= keep:
        return []
    protected = set(protected)
    floor = max(keep, len(protected))
    out, remaining = [], len(ordered)
    for name in ordered:
        if remaining <= floor:
            break
        if name not in protected:
            out.append(name)
            remaining -= 1
    return out
