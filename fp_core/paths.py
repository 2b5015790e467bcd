"""Where a checkpoint goes: a local path or a remote fsspec URL, decided in one place."""

from __future__ import annotations

import os
import re
from typing import Any

_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(://|::)")


def _text(path: Any) -> str:
    if isinstance(path, str):
        return path
    try:
        return os.fspath(path)
    except TypeError:
        return str(path)  # e.g. a universal_pathlib UPath of a remote store


def split(path: Any) -> tuple[bool, str]:
    """``(True, url)`` for a remote fsspec URL; ``(False, local_path)`` otherwise.

    A path is remote only when it *starts* with ``proto://`` or with ``proto::`` (a chained
    URL, ``simplecache::s3://...``) where ``proto`` is a protocol fsspec knows. Anything
    else is a local path, however many ``::`` it holds (``/d/exp::v2/ckpt.pt`` is a file in
    the directory ``/d/exp::v2``). ``file://`` and ``local://`` URLs are local: the prefix
    is stripped so they keep the native fast path.
    """
    p = _text(path)
    m = _URL_RE.match(p)
    if m is None:
        return False, p
    proto = m.group(1).lower()
    if m.group(2) == "::":
        return (proto in _chain_protocols()), p
    if proto in ("file", "local"):
        return False, p[m.end():] if p[m.end():].startswith("/") else "/" + p[m.end():]
    return True, p


def _chain_protocols() -> frozenset[str]:
    from fsspec.registry import known_implementations, registry

    return frozenset(known_implementations) | frozenset(registry)


def is_remote(path: Any) -> bool:
    """Does ``path`` name a remote fsspec location (anything but a local path / file://)?"""
    return split(path)[0]


def key(path: Any) -> str:
    """The name a checkpoint is known by while it is pending: the URL of a remote one, the
    absolute path of a local one (``file://`` stripped)."""
    remote, p = split(path)
    return p if remote else os.path.abspath(p)
