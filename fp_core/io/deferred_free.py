"""Freeing the blocks of a replaced or deleted checkpoint off the caller's path.

A file's blocks are freed when the last reference to its inode goes, and on ext4 or xfs
that takes time in proportion to the file's size (more on a filesystem mounted with
``discard``, as cloud VMs' disks often are; docs/performance.md): the rename that
replaces a checkpoint, or the unlink that deletes one, blocks the caller meanwhile, as
``torch.save``'s ``O_TRUNC`` does. Here the old file is first opened with ``O_PATH`` (no
read permission needed, nothing read), its name goes as before (the rename stays the
commit point: its atomicity and durability do not change), and a background thread
closes the descriptor, which frees the blocks.

What this changes for the disk's space: the old file's blocks stay taken until that
thread has closed it. :func:`make_room`, called before a save creates its file, waits
for releases pending on the same filesystem when its free space is short of what they
hold (the next checkpoint is about the size of the one it replaced). A forked child
(DataLoader workers) closes its inherited copies at once, so it never holds a replaced
file for its lifetime. Beyond :data:`MAX_PENDING` queued releases, or :data:`MAX_LIVE`
pinned files, the caller frees inline, as without this module. Only local block
filesystems whose frees run in the kernel of this machine are pinned (ext2/3/4, xfs,
btrfs, f2fs): on NFS an unlinked file still open is silly-renamed (``.nfsXXXX``) instead,
which would leave such files in checkpoint directories.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import resource
import stat
import threading
from collections.abc import Iterator

log = logging.getLogger("fastpersist")

MIN_BYTES = 8 << 20  # smaller files free quickly: not worth a descriptor
MAX_FILES = 64  # files one pin may take (a checkpoint directory's large files)
MAX_VISITED = 4096  # directory entries one pin looks at, at most
MAX_PENDING = 4  # pins queued for the thread; one more is freed by its caller
ROOM_MARGIN = 64 << 20  # free space kept beyond the estimate of the next checkpoint
# filesystems where freeing a large file's blocks is this kernel's slow work, and where a
# descriptor held across an unlink changes nothing else
PINNED_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs"})


def _max_live() -> int:
    """Descriptors all pins together may hold: a small share of the process's limit."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(0, min(256, soft // 16))


MAX_LIVE = _max_live()

# Every pinned descriptor until it is closed, by number: its file's (st_dev, st_ino). A
# forked child closes those it inherited (see _after_fork_in_child), whoever holds them.
_live: dict[int, tuple[int, int]] = {}
_live_lock = threading.Lock()

_fs_types: dict[int, str | None] = {}


def fs_type(dev: int) -> str | None:
    """The filesystem type of the mount whose device is ``dev`` (/proc/self/mountinfo), or
    None when it is not listed (a btrfs subvolume's own device number, no /proc)."""
    if dev not in _fs_types:
        want = f"{os.major(dev)}:{os.minor(dev)}"
        kind = None
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) > 2 and fields[2] == want and "-" in fields:
                        kind = fields[fields.index("-") + 1]
                        break
        except OSError:
            pass
        _fs_types[dev] = kind
    return _fs_types[dev]


class Pinned:
    """Large regular files kept (their inodes, through O_PATH descriptors) while their
    names are removed; :meth:`free_later` hands them to the background thread."""

    __slots__ = ("files",)

    def __init__(self) -> None:
        self.files: list[tuple[int, int, int]] = []  # (fd, st_dev, allocated bytes)

    @property
    def nbytes(self) -> int:
        return sum(f[2] for f in self.files)

    def free_later(self) -> None:
        """Let the blocks go once the names are gone (also right after a failed rename:
        a file still named frees nothing on close)."""
        files, self.files = self.files, []
        if files:
            _releaser.submit(files)


def pin(path: str) -> Pinned:
    """Pin ``path`` (a file, or the large files under a directory, links not followed)
    before its name is replaced or removed. Anything that cannot be pinned (missing,
    unreadable, a link, small, with other hard links, on a filesystem not in
    :data:`PINNED_FS`, beyond the limits) is left out: its removal costs the caller what it
    did before."""
    p = Pinned()
    try:
        st = os.lstat(path)
    except OSError:
        return p
    if fs_type(st.st_dev) not in PINNED_FS:
        return p
    if stat.S_ISREG(st.st_mode):
        if st.st_blocks * 512 >= MIN_BYTES and st.st_nlink == 1:  # else nothing to open (small saves)
            _pin_file(p, path, st.st_dev)
    elif stat.S_ISDIR(st.st_mode):
        visited = 0
        # Walked by directory descriptors, links not followed: a directory that whoever can
        # write into the checkpoint's swaps for a link mid-walk is not entered (a walk by
        # path would open what the link names, outside the checkpoint).
        for _root, _dirs, names, root_fd in os.fwalk(path):
            for name in names:
                visited += 1
                if len(p.files) >= MAX_FILES or visited > MAX_VISITED:
                    return p
                _pin_file(p, name, st.st_dev, dir_fd=root_fd)
    return p


@contextlib.contextmanager
def pinned(path: str) -> Iterator[Pinned]:
    """``with pinned(final): os.replace(tmp, final)``: the replaced file freed in the background."""
    p = pin(path)
    try:
        yield p
    finally:
        p.free_later()


def _pin_file(p: Pinned, path: str, dev: int, dir_fd: int | None = None) -> None:
    with _live_lock:
        if len(_live) >= MAX_LIVE:
            return
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return
    size = st.st_blocks * 512
    # A link's other names keep its blocks anyway; a symlink (O_NOFOLLOW opens the link) has
    # none; a mount point under a directory is another filesystem.
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or size < MIN_BYTES or st.st_dev != dev:
        os.close(fd)
        return
    with _live_lock:
        _live[fd] = (st.st_dev, st.st_ino)
    p.files.append((fd, st.st_dev, size))


def _close_all(files: list[tuple[int, int, int]]) -> None:
    for fd, _, _ in files:
        try:
            os.close(fd)
        except OSError:
            pass
        # Forgotten after the close: a fork in between finds the number still listed, and
        # the child checks that it is still this file before closing it.
        with _live_lock:
            _live.pop(fd, None)


class _Releaser:
    """One daemon thread closing pinned descriptors in the order they came."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, list[tuple[int, int, int]]]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._paused = 0
        self._seq = 0  # pins ever queued

    def submit(self, files: list[tuple[int, int, int]]) -> None:
        with self._cv:
            if len(self._queue) < MAX_PENDING and self._started_locked():
                self._seq += 1
                self._queue.append((self._seq, files))
                self._cv.notify_all()
                return
        _close_all(files)  # queue full (or no thread): the caller frees, as without this module

    def _started_locked(self) -> bool:
        if self._thread is not None:
            return True
        try:
            t = threading.Thread(target=self._run, name="fastpersist-free", daemon=True)
            t.start()
        except RuntimeError:  # interpreter shutting down, or no threads left
            return False
        self._thread = t
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue or self._paused > 0:
                    self._cv.wait()
                _, files = self._queue[0]
            _close_all(files)
            with self._cv:
                self._queue.popleft()
                self._cv.notify_all()

    def pending(self, dev: int | None = None) -> list[int]:
        """The bytes of each queued pin holding files on ``dev`` (any device: None)."""
        with self._cv:
            return [sum(s for _, d, s in files if dev is None or d == dev) for _, files in self._queue
                    if any(dev is None or d == dev for _, d, _s in files)]

    def wait(self, dev: int | None = None) -> None:
        """Until the pins queued by now (on ``dev``) are freed; later ones are not waited for."""
        with self._cv:
            upto = self._seq
            while any(seq <= upto and (dev is None or d == dev)
                      for seq, files in self._queue for _, d, _s in files):
                self._cv.wait()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._cv:
            self._paused += 1
        try:
            yield
        finally:
            with self._cv:
                self._paused = max(0, self._paused - 1)  # a fork inside resets the child's count
                self._cv.notify_all()

    def after_fork_in_child(self) -> None:
        self.__init__()  # type: ignore[misc]  # the thread did not come along, nor its queue


def _after_fork_in_child() -> None:
    # The descriptors came along, queued or still held by another thread of the parent
    # (a writer publishing): a child must not keep the parent's replaced files alive for its
    # whole life. A number listed may be another file's by now (closed and reused just
    # before the fork): only a descriptor that is still O_PATH on the pinned inode is closed.
    # The lock may have been held by a thread that did not come along: not taken here.
    global _live_lock
    for fd, ident in list(_live.items()):
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == ident and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_PATH:
                os.close(fd)
        except OSError:
            pass
    _live.clear()
    _live_lock = threading.Lock()
    _releaser.after_fork_in_child()


_releaser = _Releaser()
os.register_at_fork(after_in_child=_after_fork_in_child)


def wait(dev: int | None = None) -> None:
    """Block until the pins handed over by now (on the filesystem ``dev``, or all) are freed."""
    _releaser.wait(dev)


def pending_bytes(dev: int | None = None) -> int:
    """Bytes still pinned by queued releases (on ``dev``, or on all filesystems)."""
    return sum(_releaser.pending(dev))


def live_count() -> int:
    """Descriptors pins hold right now (queued, being closed, or not yet handed over)."""
    return len(_live)


def paused() -> contextlib.AbstractContextManager[None]:
    """While entered, the thread frees nothing (tests look at a pending release with it;
    waiting for a release on the same thread meanwhile never returns)."""
    return _releaser.paused()


def must_wait(free: int, pending: list[int]) -> bool:
    """Whether a save should wait for the ``pending`` releases before it takes space, with
    ``free`` bytes available: when the next checkpoint, taken to be as large as the largest
    file being freed, would not fit beside them with a margin."""
    return bool(pending) and free < max(pending) + max(pending) // 16 + ROOM_MARGIN


def make_room(directory: str) -> None:
    """Before a save takes space in ``directory``: wait for the releases pending on its
    filesystem if its free space is short (see :func:`must_wait`)."""
    if not _releaser._queue:  # nothing pending: no system calls on the common path
        return
    try:
        dev = os.stat(directory).st_dev
        vfs = os.statvfs(directory)
    except OSError:
        return  # the save itself reports what is wrong with the directory
    pending = _releaser.pending(dev)
    if must_wait(vfs.f_bavail * vfs.f_frsize, pending):
        log.info("fastpersist: waiting for %d MiB of replaced checkpoints to be freed in %s",
                 sum(pending) >> 20, directory)
        _releaser.wait(dev)


__all__ = ["Pinned", "pin", "pinned", "wait", "pending_bytes", "live_count", "paused", "must_wait", "make_room",
           "fs_type", "PINNED_FS"]
