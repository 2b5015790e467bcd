"""Checkpoint images in shared memory: the process writer's arenas, and resume from them.

The process writer (:mod:`fp_core.pipeline.process_writer`) snapshots a checkpoint into a file in
``/dev/shm`` that the trainer and the writer both map, each tensor's copy at its offset in
the checkpoint file. Once committed, the writer fills in the rest (zip headers, pickle,
manifest), so the arena holds the checkpoint file byte for byte: an *image*. With
``resume_from_memory`` the writer records, beside the image, which file it is an image of
(device, inode, size, modification time). A trainer restarted on the same machine then
loads from the image instead of the disk while that record still matches the file, and
checks every byte against the checksums the file carries (:func:`find`).

The images live in a directory of this user's own (``/dev/shm/fastpersist-<uid>``,
mode 0700): ``/dev/shm`` is shared by every local user, so the directory is refused
unless it is a real directory owned by us that nobody else can write, and every file in
it is opened without following symlinks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import stat
from typing import Any

import torch

log = logging.getLogger("fastpersist")

SHM_ROOT = "/dev/shm"
IMAGE_SUFFIX = ".img"
INDEX_SUFFIX = ".json"
hits = 0  # loads served from an image in this process (tests and benchmarks read it)
loaded: set[str] = set()  # images loaded in this process (removed at a clean close, their owner gone)


def directory(create: bool = True) -> str | None:
    """This user's image directory (created 0700 when ``create``), or None where there is
    none, or it is not safe to use (not ours, open to others, a symlink): logged once."""
    root = os.environ.get("FASTPERSIST_SHM_DIR", SHM_ROOT)
    path = os.path.join(root, f"fastpersist-{os.geteuid()}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return None
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise OSError(e.errno, f"cannot create the shared-memory directory for checkpoint snapshots: "
                          f"{e.strerror}", path) from e
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user (a symlink, another user's, "
                              f"or open to others: mode {stat.S_IMODE(st.st_mode):o}); the process writer "
                              "will not put checkpoint snapshots there. Remove it, or set FASTPERSIST_SHM_DIR")
    return path


def _open_private(path: str, flags: int) -> int:
    """Open a file in our directory: never through a symlink, and only a regular file of ours."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{path} is not a regular file of this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedArena:
    """A snapshot arena in a shared-memory file: each copy at its offset in the checkpoint
    file (the arena is the file's image). The same interface as :class:`fp_core.io.arena.Arena`."""

    def __init__(self, path: str, nbytes: int, pin: bool, allocate: bool = True) -> None:
        """``allocate``: take every page of the file now (a snapshot fills it all)."""
        self.path = path
        self.pin = pin
        self.huge_bytes = 0
        self.slots: dict[int, torch.Tensor] = {}
        self.fresh = True
        fd = _open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        self.allocated = False
        try:
            os.ftruncate(fd, nbytes)
            if allocate:
                self._allocate(fd)
            self._map = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        self.buf = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes] if nbytes else torch.empty(0, dtype=torch.uint8)
        self._pinned_addr = None
        if pin:
            from .pinned_host import _register

            _register(self.buf.data_ptr(), nbytes)
            self._pinned_addr = self.buf.data_ptr()

    def _allocate(self, fd: int) -> None:
        """Every page of the file now: a shared-memory file system that runs out of room later,
        under a copy into the mapping, kills the process with SIGBUS instead."""
        self._fallocate(fd, 0, self.nbytes if hasattr(self, "buf") else os.fstat(fd).st_size)
        self.allocated = True

    def _fallocate(self, fd: int, off: int, n: int) -> None:
        """posix_fallocate, its ENOSPC saying how much room there is."""
        if not n:
            return
        try:
            os.posix_fallocate(fd, off, n)
        except OSError as e:
            raise OSError(e.errno, f"no room for {n >> 20} MiB of a snapshot arena ({e.strerror}); free "
                          f"{free_bytes(os.path.dirname(self.path)) >> 20} MiB", self.path) from e

    def allocate(self) -> None:
        """See :meth:`_allocate` (an arena made for an overlap save, now taken by a snapshot)."""
        if self.allocated:
            return
        fd = _open_private(self.path, os.O_RDWR)
        try:
            self._allocate(fd)
        finally:
            os.close(fd)

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def carve(self, extents: list[Any]) -> list[torch.Tensor]:
        return [self.buf[s.offset: s.offset + s.length] for s in extents]

    def holds(self, t: torch.Tensor, offset: int) -> bool:
        """Is ``t`` this arena's bytes at ``offset``?"""
        return t.device.type == "cpu" and t.data_ptr() == self.buf.data_ptr() + offset

    def forget_image(self) -> None:
        """The arena is about to be overwritten: it no longer holds a committed checkpoint."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(index_path(self.path))

    def destroy(self) -> None:
        """Unmap (once no tensor views it) and remove the file and its record."""
        self.forget_image()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.unmap()

    def allocate_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Take the pages of these ``(offset, length)`` ranges now (an overlap save copies
        only its small tensors into the arena): no SIGBUS from a full file system later."""
        if self.allocated or not ranges:
            return
        fd = _open_private(self.path, os.O_RDWR)
        try:
            for off, n in ranges:
                self._fallocate(fd, off, n)
        finally:
            os.close(fd)

    def unmap(self) -> None:
        """Let go of the mapping (once no tensor views it); the file stays."""
        if self._pinned_addr is not None:
            from .pinned_host import _unregister

            _unregister(self._pinned_addr)
            self._pinned_addr = None
        self.buf = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):  # a tensor still views it: unmapped when that goes
            self._map.close()


def free_bytes(d: str) -> int:
    try:
        v = os.statvfs(d)
    except OSError:
        return 0
    return v.f_bavail * v.f_frsize


def index_path(image: str) -> str:
    return image[: -len(IMAGE_SUFFIX)] + INDEX_SUFFIX if image.endswith(IMAGE_SUFFIX) else image + INDEX_SUFFIX


def map_image(path: str, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """The writer's view of an arena: ``size`` bytes of it, shared."""
    fd = _open_private(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"snapshot arena {path} is shorter than the {size} bytes of its checkpoint")
        m = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return m, torch.frombuffer(m, dtype=torch.uint8)[:size]


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def record(image: str, final: str, target: str) -> None:
    """After a commit: the arena ``image`` now holds the file ``target`` (saved as ``final``)."""
    info = {"final": final, "target": target, "identity": _identity(os.stat(target)),
            "image": os.path.basename(image)}
    _write_index(index_path(image), info)


def _write_index(idx: str, info: dict) -> None:
    """Replace the record ``idx`` whole (a reader sees the old one or the new one)."""
    tmp = idx + ".tmp"
    fd = _open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, json.dumps(info).encode())
    finally:
        os.close(fd)
    os.replace(tmp, idx)


def moved(src_dir: str, dst_dir: str) -> None:
    """The directory ``src_dir`` is now ``dst_dir`` (renamed whole: its files keep their
    inodes and times; a directory commit, :func:`fp_core.saving.commit.publish_dir`): the records
    of the images of its files name them there, so a load of the new name finds its image
    and a clean-up does not take the image for one of a removed file. Both real paths."""
    try:
        d = directory(create=False)
    except PermissionError:
        return
    if d is None:
        return
    for name in os.listdir(d):
        if not name.endswith(INDEX_SUFFIX) or owner_of(name) is None:
            continue
        full = os.path.join(d, name)
        info = _read_index(full)
        if info is None or os.path.dirname(info["target"]) != src_dir:
            continue
        for k in ("target", "final"):
            info[k] = os.path.join(dst_dir, os.path.basename(info[k]))
        _write_index(full, info)


def _read_index(path: str) -> dict | None:
    try:
        fd = _open_private(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        info = json.loads(data)
    except ValueError:
        return None
    ok = (isinstance(info, dict) and isinstance(info.get("final"), str) and isinstance(info.get("target"), str)
          and isinstance(info.get("image"), str) and "/" not in info["image"]
          and info["image"].endswith(IMAGE_SUFFIX) and isinstance(info.get("identity"), list)
          and len(info["identity"]) == 5 and all(isinstance(x, int) for x in info["identity"]))
    return info if ok else None


def wait_for_writers_under(path: str | os.PathLike, timeout: float = 120.0) -> None:
    """Wait for the writer processes whose trainer is gone and that still commit a
    checkpoint at or under the directory ``path`` (a restart about to list its checkpoints)."""
    try:
        d = directory(create=False)
    except PermissionError:
        return
    if d is not None:
        wait_for_orphans(d, timeout=timeout, under=os.path.realpath(os.fspath(path)))


def find(path: str | os.PathLike) -> str | None:
    """The image in shared memory of the checkpoint file at ``path``, while it holds that
    file (same device, inode, size, modification and change times), else None."""
    try:
        d = directory(create=False)
    except PermissionError as e:
        log.warning("fastpersist: %s", e)
        return None
    if d is None:
        return None
    try:
        target = os.path.realpath(os.fspath(path))
    except OSError:
        return None
    wait_for_orphans(d, target)
    try:
        ident = _identity(os.stat(target))
        names = os.listdir(d)
    except OSError:
        return None
    for name in names:
        if not name.endswith(INDEX_SUFFIX):
            continue
        info = _read_index(os.path.join(d, name))
        if info is None or info["target"] != target or info["identity"] != ident:
            continue
        image = os.path.join(d, info["image"])
        try:
            st = os.lstat(image)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_size == ident[2]:
            return image
    return None


LOCK_SUFFIX = ".lock"  # held by the trainer and its writer (the writer inherits it)
TRAINER_SUFFIX = ".live"  # held by the trainer alone: free once it is gone, at once
JOB_SUFFIX = ".job"  # a job handed to the writer and not yet done: the checkpoint it commits


def owner_of(name: str) -> str | None:
    """The owner key ``fp-<pid>-<token>`` in a file's name (``fp-<pid>-<token>-<n>.img``,
    its ``.json``, or the owner's ``fp-<pid>-<token>.lock``). The token is new at every
    start: a restart that gets the same pid (a container's) is another owner."""
    parts = name.split(".")[0].split("-")
    if len(parts) >= 3 and parts[0] == "fp" and parts[1].isdigit() and parts[2].isalnum():
        return "-".join(parts[:3])
    return None


class OwnerLock:
    """``fp-<pid>-<token>.lock``, flock'ed for as long as the trainer *or* its writer lives:
    the writer inherits the descriptor (the same open file, so the same lock). Nobody
    touches an owner's arenas while its lock is held. Beside it ``fp-<pid>-<token>.live``,
    flock'ed by the trainer alone: the kernel frees it the moment the trainer dies, before
    its writer can notice, so a restart knows at once which writers are orphans."""

    def __init__(self, d: str) -> None:
        import fcntl
        import secrets

        self.key = f"fp-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(d, self.key + LOCK_SUFFIX)
        # locked under a name no clean-up takes for an owner's, then renamed: a clean-up
        # between the creation and the flock would find it unlocked and remove it
        hidden = os.path.join(d, f".creating-{secrets.token_hex(8)}")
        self.fd = _open_private(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            os.rename(hidden, self.path)
        except BaseException:
            os.close(self.fd)
            with contextlib.suppress(OSError):
                os.unlink(hidden)
            raise
        self.trainer_path = os.path.join(d, self.key + TRAINER_SUFFIX)
        self.trainer_fd = -1
        try:
            self.trainer_fd = _open_private(self.trainer_path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            fcntl.flock(self.trainer_fd, fcntl.LOCK_EX)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self.trainer_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.trainer_path)
            os.close(self.trainer_fd)
            self.trainer_fd = -1
        if self.fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = -1

    def forget_after_fork(self) -> None:
        """In a forked child: our copies only (the locks stay the parent's)."""
        for fd in (self.fd, self.trainer_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self.trainer_fd = -1


def job_mark(image: str) -> str:
    """The mark of the job an arena is handed over with (``fp-<pid>-<token>-<n>.job``)."""
    return image[: -len(IMAGE_SUFFIX)] + JOB_SUFFIX


def mark_job(image: str, target: str, mark: str | None = None) -> None:
    """Say, before the hand-over, which checkpoint the arena's job commits (``mark``: the
    mark of a job without an arena, a directory commit): a restart's load of that
    checkpoint waits for it if the trainer dies (the writer removes the mark when done)."""
    fd = _open_private(mark or job_mark(image), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, os.path.realpath(target).encode())
    finally:
        os.close(fd)


def unmark_job(image: str | None = None, mark: str | None = None) -> None:
    with contextlib.suppress(OSError):
        os.unlink(mark or job_mark(image or ""))


def _held(d: str, owner: str) -> bool:
    """Is ``owner``'s lock held (its trainer or its writer still runs)?"""
    return _locked(os.path.join(d, owner + LOCK_SUFFIX))


def _locked(path: str) -> bool:
    import fcntl

    try:
        fd = _open_private(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def frozen(image: str) -> bool:
    """Nobody writes into this image again: its trainer and its writer are both gone."""
    owner = owner_of(os.path.basename(image))
    return owner is not None and not _held(os.path.dirname(image), owner)


def _job_target(path: str) -> str | None:
    try:
        fd = _open_private(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)


def wait_for_orphans(d: str, target: str | None = None, timeout: float = 120.0, under: str | None = None) -> None:
    """Wait until no writer whose trainer is gone still has a job for ``target`` (for any
    file when None; for any checkpoint at or under the directory ``under``), at most
    ``timeout`` s: a restart looks for the newest checkpoint. An
    orphan is a writer whose owner lock is held while its trainer's ``.live`` lock is not
    (free the moment the trainer dies); its jobs are the ``.job`` marks the trainer wrote
    before each hand-over. No guess from pids, which another PID namespace sharing
    ``/dev/shm`` would not show."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            marks = [n for n in os.listdir(d) if n.endswith(JOB_SUFFIX) and owner_of(n)]
        except OSError:
            return
        busy = set()
        for n in marks:
            owner = owner_of(n)
            if owner in busy or not _held(d, owner) or _locked(os.path.join(d, owner + TRAINER_SUFFIX)):
                continue
            job = _job_target(os.path.join(d, n))
            if job is None:
                continue
            if under is not None:
                hit = job == under or job.startswith(under.rstrip(os.sep) + os.sep)
            else:
                hit = target is None or job == target
            if hit:
                busy.add(owner)
        if not busy or time.monotonic() > deadline:
            if busy:
                log.warning("fastpersist: the writer processes of %s still run after %.0f s; not waiting longer",
                            sorted(busy), timeout)
            return
        time.sleep(0.05)


def drop_loaded() -> None:
    """Remove the images this process loaded whose owner is gone (a clean end of the run
    that resumed from them: nobody needs them any more)."""
    for image in list(loaded):
        loaded.discard(image)
        if frozen(image):
            for p in (index_path(image), image):
                with contextlib.suppress(OSError):
                    os.unlink(p)


def kept_images(d: str) -> list[dict]:
    """The committed images in ``d``: each one's file, the checkpoint it holds, its size,
    whether that file is still the one it is an image of (``current``), and whether its
    owner (a trainer or its writer) still runs (``live``)."""
    out = []
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return out
    for name in names:
        if not name.endswith(INDEX_SUFFIX) or owner_of(name) is None:
            continue
        info = _read_index(os.path.join(d, name))
        if info is None:
            continue
        image = os.path.join(d, info["image"])
        try:
            size = os.stat(image).st_size
        except OSError:
            continue
        try:
            current = _identity(os.stat(info["target"])) == info["identity"]
        except OSError:
            current = False
        out.append({"image": image, "checkpoint": info["final"], "bytes": size, "current": current,
                    "live": _held(d, owner_of(name))})
    return out


def remove_kept(d: str) -> list[str]:
    """Remove the images kept for a restart whose owner is gone (never a running one's),
    with every other leftover of gone owners; returns the images removed."""
    removed = []
    for info in kept_images(d):
        if info["live"]:
            continue
        for p in (index_path(info["image"]), info["image"]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        removed.append(info["image"])
    clean_stale(d)
    return removed


def clean_stale(d: str, superseded_dir: str | None = None, superseded_final: str | None = None,
                committed_before_ns: int | None = None) -> None:
    """Remove the files of owners whose trainer and writer are both gone (lock not held),
    but for committed images kept for a restart; those images too where their checkpoint
    is ``superseded_final``, or is in ``superseded_dir`` (a newer one has been committed),
    and was committed before ``committed_before_ns`` (the caller's start, by the file
    system's clock): an image a peer of the caller's own run left (a rank killed while
    this one lives on) is what that peer's restart resumes from, never superseded."""
    try:
        names = os.listdir(d)
    except OSError:
        return
    gone: dict[str, bool] = {}
    for name in names:
        if name.startswith(".creating-") and not _locked(os.path.join(d, name)):
            with contextlib.suppress(OSError):  # an owner lock whose creator died before naming it
                os.unlink(os.path.join(d, name))
            continue
        owner = owner_of(name)
        if owner is None:
            continue
        if owner not in gone:
            gone[owner] = not _held(d, owner)
        if not gone[owner]:
            continue
        full = os.path.join(d, name)
        if name.endswith(INDEX_SUFFIX):
            info = _read_index(full)
            image = os.path.join(d, info["image"]) if info else None
            superseded = info is not None and (
                (superseded_dir is not None and os.path.dirname(info["final"]) == superseded_dir)
                or info["final"] == superseded_final) and (
                committed_before_ns is None or info["identity"][4] < committed_before_ns)
            stale = info is None or not os.path.exists(image) or superseded
            if not stale:
                try:
                    stale = _identity(os.stat(info["target"])) != info["identity"]
                except OSError:
                    stale = True
            if stale:
                for p in (full, image):
                    if p:
                        with contextlib.suppress(OSError):
                            os.unlink(p)
        elif name.endswith(IMAGE_SUFFIX) and not os.path.exists(index_path(full)):
            with contextlib.suppress(OSError):
                os.unlink(full)
        elif name.endswith((".tmp", LOCK_SUFFIX, TRAINER_SUFFIX, JOB_SUFFIX)):
            with contextlib.suppress(OSError):
                os.unlink(full)
