"""What one save reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SaveStats:
    path: str
    bytes: int = 0  # file size
    seconds: float = 0.0  # wall time of the whole save, from call to durable rename
    backend: str = ""  # io_uring | threadpool | buffered
    backend_reason: str = ""  # why a fallback backend runs ("" when the first choice did)
    alignment: int = 0
    serialize_seconds: float = 0.0  # torch.save skeleton capture + layout
    copy_seconds: float = 0.0  # staging copies (+ checksums), summed over copy threads
    device_copy_seconds: float = 0.0  # device -> pinned host copies
    write_seconds: float = 0.0  # wall time of the native write calls
    sync_seconds: float = 0.0  # fdatasync + rename + directory fsync
    requests: int = 0
    short_writes: int = 0
    writers: int = 1  # processes x ranges that wrote this file
    policy: str = "sync"  # sync | overlap | snapshot (async pipeline)
    blocked_seconds: float = 0.0  # time the caller's thread was held (async saves)
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = self.gbps
        return d

    def __str__(self) -> str:
        return (
            f"{self.path}: {self.bytes / 2**20:.1f} MiB in {self.seconds * 1e3:.1f} ms "
            f"({self.gbps:.2f} GB/s, {self.backend}, align {self.alignment}; serialize "
            f"{self.serialize_seconds * 1e3:.1f} ms, write {self.write_seconds * 1e3:.1f} ms, "
            f"sync {self.sync_seconds * 1e3:.1f} ms)"
        )
