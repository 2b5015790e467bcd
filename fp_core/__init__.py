"""FastPersist core: fast, durable, verifiable torch checkpoints.

``save`` / ``load`` / ``verify`` / ``inspect`` work on standard torch.save zip files;
``AsyncCheckpointer`` overlaps the write with training.
"""

from .api import save
from .commit import clean
from .engine import EngineOptions
from .errors import (
    CheckpointError,
    CheckpointSerializationError,
    CorruptCheckpointError,
    NotAFastPersistCheckpoint,
)
from .integrity import inspect, verify
from .loader import load
from .pipeline import AsyncCheckpointer, AsyncCheckpointError, Handle, SaveHandle
from .stats import SaveStats

__all__ = [
    "save",
    "AsyncCheckpointer",
    "AsyncCheckpointError",
    "Handle",
    "SaveHandle",
    "load",
    "verify",
    "inspect",
    "clean",
    "EngineOptions",
    "SaveStats",
    "CheckpointError",
    "CheckpointSerializationError",
    "CorruptCheckpointError",
    "NotAFastPersistCheckpoint",
]
