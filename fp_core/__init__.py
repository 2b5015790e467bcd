"""FastPersist core: fast, durable, verifiable torch checkpoints.

``save`` / ``load`` / ``verify`` / ``inspect`` work on standard torch.save zip files;
``AsyncCheckpointer`` overlaps the write with training.
"""

from .api import inspect, load, load_into, prepare, save, verify
from .commit import clean
from .engine import EngineOptions
from .errors import (
    CheckpointError,
    CheckpointSerializationError,
    CorruptCheckpointError,
    NotAFastPersistCheckpoint,
)
from .pipeline import AsyncCheckpointer, AsyncCheckpointError, Handle, SaveHandle
from .sharded_load import LoadIntoStats
from .stats import SaveStats

__all__ = [
    "save",
    "prepare",
    "AsyncCheckpointer",
    "AsyncCheckpointError",
    "Handle",
    "SaveHandle",
    "load",
    "load_into",
    "LoadIntoStats",
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
