"""Tables of docs/performance.md: TODO."""

from __future__ import annotations
