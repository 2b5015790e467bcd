"""FastPersist core: fast, durable, verifiable torch checkpoints.

``save`` / ``load`` / ``verify`` / ``inspect`` work on standard torch.save zip files;
``AsyncCheckpointer`` overlaps the write with training.
"""

from .api import inspect, load, load_into, prepare, save, verify
from .errors import (
    CheckpointError,
    CheckpointSerializationError,
    CorruptCheckpointError,
    NotAFastPersistCheckpoint,
)
from .format.flat_shard import FlatShard
from .io.engine import EngineOptions
from .loading.sharded_load import LoadIntoStats
from .pipeline.checkpointer import AsyncCheckpointer, AsyncCheckpointError, Handle, SaveHandle
from .saving.commit import clean
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
    "FlatShard",
    "SaveStats",
    "CheckpointError",
    "CheckpointSerializationError",
    "CorruptCheckpointError",
    "NotAFastPersistCheckpoint",
]
