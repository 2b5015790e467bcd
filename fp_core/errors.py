"""Exceptions FastPersist raises. I/O failures stay ``OSError`` (with errno and path)."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of FastPersist's own errors."""


class CheckpointSerializationError(CheckpointError, TypeError):
    """The object could not be serialised (an unpicklable member, mixed dtypes on a storage...)."""


class CorruptCheckpointError(CheckpointError, RuntimeError):
    """A checkpoint's bytes do not match the checksums recorded when it was saved, or its
    structure does not read. A ``RuntimeError`` too, as ``torch.load``'s error for a
    damaged zip is: code that falls back to an older checkpoint on that keeps working."""

    def __init__(self, path: str, record: str, detail: str, tensor: str | None = None) -> None:
        self.path = path
        self.record = record
        self.tensor = tensor
        self.detail = detail
        what = f"record {record}" + (f" (tensor {tensor})" if tensor else "")
        super().__init__(f"corrupt checkpoint {path}: {what}: {detail}")

    def __reduce__(self) -> tuple:
        # pickled whole: DCP sends each rank's exception to every rank (the default would
        # call __init__ with the message alone and raise a TypeError instead)
        return (type(self), (self.path, self.record, self.detail, self.tensor))


class NotAFastPersistCheckpoint(CheckpointError):
    """The file has no FastPersist manifest (it was written by something else)."""
