"""Atomic, durable commit: write aside, fdatasync, rename over the final name, fsync(dir).

A crash at any instant leaves the previous checkpoint under the final name: the file is
written as an unnamed inode (``O_TMPFILE``) and linked into the directory only just before
the rename, so a save in progress never shows in a listing and a killed one leaves no file
behind. A new name is linked straight to the file; an existing one is replaced by a link to
a temporary name and a rename (there is no atomic "link over" for an unnamed file), both in
one native call: a process killed in the microseconds between them leaves the whole new
file under its temporary name, which the next save into the directory removes
(:func:`clean`). Where the filesystem refuses ``O_TMPFILE`` the file is
written under a temporary name instead: it starts with a dot and ends in ``.fptmp`` so
neither Lightning (``*.ckpt``) nor the HF Trainer (``checkpoint-*``) lists it, and carries
the writer's host.

Whether a temporary file (or a pending-save placeholder) still has a writer is told by a
lock, not by a process id: the writer holds an ``flock`` on it for as long as it lives,
and the kernel drops it when the process dies, whatever container or pid namespace it ran
in. :func:`clean` removes only files named exactly as we name them, regular files, that
nobody holds; files of another host are not ours to judge. It runs once per directory per
process, off the caller's thread (:func:`clean_in_background`), so a directory of many
files costs the training loop nothing.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import struct
import threading
import uuid
from pathlib import Path
from typing import Any

from .. import _native
from ..io import deferred_free

log = logging.getLogger("fastpersist")

TMP_SUFFIX = ".fptmp"
_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"
# .<final name>.<host>-<pid>-<8 hex>.fptmp, exactly as temp_path() makes them
_TEMP_RE = re.compile(r"^\.(?P<base>.+)\.(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-[0-9a-f]{8}\.fptmp$")


def temp_path(final: str) -> str:
    d, base = os.path.split(os.path.abspath(final))
    return os.path.join(d, f".{base}.{writer_tag()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def writer_tag() -> str:
    """``host-pid``: who is writing, as embedded in temp names, placeholders, staging dirs."""
    return f"{_HOST}-{os.getpid()}"


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes) -> None:
    """Write ``data`` as the whole of the file ``path`` (created 0666 less the umask, never
    through a symlink) and fsync it: a small file of a checkpoint directory being staged."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def hold(fd: int) -> int:
    """A duplicate of ``fd`` holding an exclusive ``flock`` on its file: while it is open,
    :func:`clean` in any process leaves the file alone. Close it to let go."""
    dup = os.dup(fd)
    try:
        fcntl.flock(dup, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(dup)
        raise
    return dup


def _held(path: str) -> bool:
    """Does a live process hold ``path`` (see :func:`hold`)? Not followed through a symlink."""
    fd = _lock_unheld(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def _lock_unheld(path: str) -> int | None:
    """A descriptor of ``path`` holding its lock, or None when a live writer holds it (or it
    cannot be told: a symlink, no locks on this filesystem)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_unheld(path: str, inode: int) -> bool:
    """Remove ``path`` if it is still the file judged stale (``inode``: a temporary file, or a
    placeholder still empty and marked) and nobody holds it, *while* holding its lock: a
    writer that takes it meanwhile finds it locked or unlinked (TempFile starts over), and a
    checkpoint renamed over the name since is a different inode, never removed."""
    fd = _lock_unheld(path)
    if fd is None:
        return False
    try:
        st = os.fstat(fd)
        if st.st_ino != inode or os.lstat(path).st_ino != inode:
            return False  # the name holds another file now (a finished checkpoint, a new save)
        if not _TEMP_RE.match(os.path.basename(path)):
            if _placeholder_tag(fd) is None:
                return False  # not a marked placeholder any more
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def link_fd(fd: int, name: str) -> None:
    """Give the unnamed file open as ``fd`` (``O_TMPFILE``) the name ``name``.

    ``linkat(AT_SYMLINK_FOLLOW)`` of ``/proc/self/fd/N``: CPython calls ``linkat`` only with
    a ``dir_fd`` (plain ``link(2)`` does not follow the magic link and fails with EXDEV).
    """
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), name, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def publish(tmp: str, final: str) -> None:
    """Rename the finished temp file over ``final`` and make the rename durable. The file
    it replaces is freed in the background (:mod:`fp_core.io.deferred_free`)."""
    with deferred_free.pinned(final):
        os.replace(tmp, final)
        fsync_dir(os.path.dirname(os.path.abspath(final)))


def remove(path: str) -> None:
    """Remove a checkpoint file, link or directory (silent if missing), as
    ``TorchCheckpointIO.remove_checkpoint``; its large files' blocks are freed in the
    background (:mod:`fp_core.io.deferred_free`)."""
    try:
        with deferred_free.pinned(path):
            if os.path.islink(path) or os.path.isfile(path):
                os.remove(path)
            elif os.path.isdir(path):
                shutil.rmtree(path)
    except FileNotFoundError:
        pass


def discard(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as e:  # never mask the error that made us discard
        log.warning("fastpersist: could not remove temporary file %s: %s", tmp, e)


# O_TMPFILE support by device, probed once per device (an open and a close).
_TMPFILE_OK: dict[int, bool] = {}
_TMPFILE_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)


def tmpfile_supported(directory: str) -> bool:
    """Can unnamed files (``O_TMPFILE``) be made in ``directory``'s filesystem?"""
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return False  # the named path says what is wrong with the directory
    if dev not in _TMPFILE_OK:
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno not in _TMPFILE_UNSUPPORTED:
                return False  # not a verdict on the filesystem (permissions...): ask again next time
            _TMPFILE_OK[dev] = False
            return False
        # The commit links it through /proc/self/fd: a sandbox without /proc, or a filesystem
        # that refuses the link, must get named files, not a failure after the write.
        probe = temp_path(os.path.join(directory, "probe"))
        try:
            link_fd(fd, probe)
            os.unlink(probe)
            _TMPFILE_OK[dev] = True
        except OSError:
            _TMPFILE_OK[dev] = False
        finally:
            os.close(fd)
    return _TMPFILE_OK[dev]


class TempFile:
    """Where one checkpoint is written before :meth:`publish` puts it under its final name.

    ``open_engine(path, tmpfile)`` opens the native engine on it: an unnamed file in the
    final name's directory where the filesystem allows, else the named file :attr:`name`.
    Either way this object holds it (``flock``) until published or aborted.
    """

    def __init__(self, final: str, open_engine: Any, named: bool = False) -> None:
        """``named``: a named file even where unnamed ones work (other processes open it by
        name: a collective save's ranks)."""
        self.final = final
        deferred_free.make_room(os.path.dirname(final))
        self.unnamed = not named and tmpfile_supported(os.path.dirname(final))
        for _ in range(8):
            self.name = temp_path(final)
            self.engine = open_engine(os.path.dirname(final) if self.unnamed else self.name, self.unnamed)
            try:
                self._held: int | None = hold(self.engine.fileno())
                # A named file is visible before it is held: a clean-up elsewhere may have
                # taken it for an orphan in between and removed it. Then start over.
                if self.unnamed or os.fstat(self._held).st_nlink > 0:
                    return
                os.close(self._held)
            except BlockingIOError:  # a clean-up holds it right now, about to remove it
                pass
            except BaseException:
                self.engine.close()
                if not self.unnamed:
                    discard(self.name)
                raise
            self.engine.close()
        raise OSError(errno.EAGAIN, "could not create a temporary file that stays (something keeps removing "
                      "them)", os.path.dirname(final))

    def fileno(self) -> int:
        """A descriptor of the file being written (valid until published or aborted)."""
        if self._held is None:
            raise ValueError(f"temporary file of {self.final} is closed")
        return self._held

    @property
    def engine_path(self) -> str:
        """The path the engine's errors name (the directory of an unnamed file)."""
        return os.path.dirname(self.final) if self.unnamed else self.name

    def publish(self) -> None:
        """Link (unnamed) and rename the finished file over the final name, durably; it
        keeps what the file it replaces had (:func:`adopt_attributes`)."""
        try:
            if self._held is None:
                raise ValueError(f"temporary file of {self.final} is closed")
            adopt_attributes(self._held, self.final)
            if self.unnamed:
                # Linked and renamed in one native call (straight to the final name when it
                # is free): a kill between the two leaves the file under its temporary name,
                # and Python between them (a GIL wait) would widen that window.
                with deferred_free.pinned(self.final):
                    _native.link_replace(self._held, self.name, self.final)
                fsync_dir(os.path.dirname(os.path.abspath(self.final)))
            else:
                publish(self.name, self.final)
        except BaseException:
            discard(self.name)
            raise
        finally:
            self._release()

    def abort(self) -> None:
        self.engine.close()
        if not self.unnamed or os.path.lexists(self.name):
            discard(self.name)
        self._release()

    def _release(self) -> None:
        if self._held is not None:
            os.close(self._held)
            self._held = None


def check_target(final: str | os.PathLike) -> str:
    """Validate a checkpoint path before any work; return the file to replace, absolute,
    with every symlink resolved.

    ``torch.save`` is the reference for what happens at the path (docs/reliability.md, "The
    user's files"): a symlink, absolute, relative or a chain, is written through (the file it
    names is replaced, created where it dangles), so the temporary file, the rename and the
    directory fsync all happen in that file's directory and the link still names the new
    checkpoint. What is refused, before anything is written, with the path and the cause: a
    path ending in ``/``, a directory, anything else that is not a regular file (a device,
    a FIFO, a socket: renaming over one would replace it, see :func:`refuse_non_regular`),
    a link loop, a missing or non-directory parent, a parent we cannot write to, and a file
    the caller could not open for writing (``torch.save`` gets ``EACCES`` there).
    """
    raw = os.fspath(final)
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    if raw.endswith(os.sep) or os.path.basename(raw) in (".", ".."):
        raise IsADirectoryError(errno.EISDIR, "checkpoint path ends in '/' (or '.', '..'), which names a directory "
                                "(torch.save refuses it too); name the file without it", raw)
    _refuse_protected_links(raw)
    path = os.path.realpath(raw)
    parent = os.path.dirname(path)
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise NotADirectoryError(errno.ENOTDIR, "checkpoint directory is not a directory", parent) from None
    except PermissionError:
        raise PermissionError(errno.EACCES, "checkpoint directory cannot be reached (permission denied)",
                              parent) from None
    if st is not None and stat.S_ISLNK(st.st_mode):  # realpath stops at a loop
        raise OSError(errno.ELOOP, "checkpoint path is a symlink loop (too many levels of symbolic links)", raw)
    try:
        pst = os.stat(parent)  # not os.path.exists: it says "missing" for an unsearchable parent
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "checkpoint directory does not exist", parent) from None
    except PermissionError:
        raise PermissionError(errno.EACCES, "checkpoint directory cannot be reached (permission denied)",
                              parent) from None
    if not stat.S_ISDIR(pst.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "checkpoint directory is not a directory", parent)
    if st is not None:
        refuse_non_regular(path, st)
        if st.st_nlink > 1:
            log.warning("fastpersist: %s has %d hard links: the new checkpoint replaces this name only, the other "
                        "names keep the old file (torch.save would write into the shared file)", path, st.st_nlink)
        if st.st_size in (0, len(PLACEHOLDER_TEXT)):
            _report_lost(path)
    if os.statvfs(parent).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, "checkpoint directory is on a read-only file system", parent)
    if not _access(parent, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "checkpoint directory is not writable", parent)
    euid = os.geteuid()
    if st is not None and euid != 0 and pst.st_mode & stat.S_ISVTX and euid not in (st.st_uid, pst.st_uid):
        # the sticky bit lets only the file's or the directory's owner rename over it:
        # refused now, not after the whole checkpoint is written
        raise PermissionError(errno.EACCES, "checkpoint file belongs to another user in a sticky directory, where "
                              "only its owner may replace it; FastPersist replaces a checkpoint by a rename (torch.save "
                              "would write into it, without atomicity)", path)
    if st is not None and not _access(path, os.W_OK):
        # the directory lets us rename over it, but torch.save opens the file itself: never
        # replace a file the caller could not have written
        raise PermissionError(errno.EACCES, "checkpoint file exists and is not writable by this user (torch.save "
                              "fails the same way); it is left as it is", path)
    return path


def _refuse_protected_links(raw: str) -> None:
    """Where the kernel protects symlinks (``fs.protected_symlinks``, on by default on most
    distributions), ``open`` refuses to follow a link another user planted in a sticky
    world-writable directory such as ``/tmp``: ``torch.save`` fails with ``EACCES``. We
    resolve links ourselves (:func:`check_target`), so the same rule is applied here to
    every link the path leads through, walked component by component as the kernel does
    (``..`` taken after the link before it is followed, never as text)."""
    try:
        with open("/proc/sys/fs/protected_symlinks") as f:
            if f.read().strip() != "1":
                return
    except OSError:
        return
    euid = os.geteuid()
    todo = collections.deque(os.path.join(os.getcwd(), raw).split("/"))
    path, followed = "/", 0
    while todo:
        name = todo.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            path = os.path.dirname(path)  # ``path`` is physical: no link in it
            continue
        here = os.path.join(path, name)
        try:
            st = os.lstat(here)
            if not stat.S_ISLNK(st.st_mode):
                path = here
                continue
            pst = os.lstat(path)
            target = os.readlink(here)
        except OSError:
            return  # what is wrong with the path is check_target's to say
        followed += 1
        if followed > 40:  # the kernel's limit: check_target reports the loop
            return
        if pst.st_mode & stat.S_ISVTX and pst.st_mode & stat.S_IWOTH and st.st_uid not in (euid, pst.st_uid):
            raise PermissionError(errno.EACCES, "checkpoint path leads through a symlink another user owns in a "
                                  "sticky world-writable directory, which the kernel refuses to follow "
                                  "(fs.protected_symlinks; torch.save fails the same way)", here)
        if target.startswith("/"):
            path = "/"
        todo.extendleft(reversed(target.split("/")))


def _report_lost(path: str) -> None:
    """A save about to replace a placeholder nobody holds says that the save which made it
    never completed (its process ended without running anything of ours: ``os._exit``,
    SIGKILL), so the loss is not silent."""
    owner = placeholder_owner(path)
    if owner is not None and not _held(path):
        log.warning("fastpersist: the earlier save of %s never completed (its writer, %s, ended before committing "
                    "it); this save replaces its placeholder", path, owner.rsplit("-", 1)[0])


def _access(path: str, mode: int) -> bool:
    """``access(2)`` with the effective ids (what ``open`` checks; root passes the mode bits)."""
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True, follow_symlinks=False)
    return os.access(path, mode)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def refuse_non_regular(path: str, st: os.stat_result) -> None:
    """Raise unless ``st`` (of ``path``, not followed) is a regular file.

    A checkpoint is written aside and renamed over its name; renaming over a device node
    or a FIFO would replace it (``/dev/null`` would become a regular file every process
    then writes into), so FastPersist refuses every path that is not a regular file.
    ``torch.save`` writes *into* a character device or a FIFO; a caller who wants that
    (a stream, no atomicity) uses ``torch.save``.
    """
    if stat.S_ISREG(st.st_mode):
        return
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
    raise OSError(errno.EOPNOTSUPP, f"checkpoint path is {kind}, not a regular file: FastPersist replaces a "
                  "checkpoint atomically by a rename, which would replace it, so it refuses (torch.save writes "
                  "into a device or FIFO without atomicity; use it for that)", path)


# ---------------------------------------------------------------- what a replaced file keeps

ACL_XATTR = "system.posix_acl_access"
_ACL_GROUP_OBJ, _ACL_MASK = 0x04, 0x10


def adopt_attributes(fd: int, final: str) -> None:
    """Give the finished file open as ``fd`` what the file it replaces at ``final`` has: its
    mode, and where the caller may, its owner, group and ACL. Access is never widened: where
    the group cannot be kept, the group's bits narrow to what others had; where the ACL
    cannot be copied, the group's bits narrow to the ACL's owning-group entry. A new name
    keeps what ``open`` gave the file (0666 less the umask, or the directory's default ACL),
    as ``torch.save``'s file gets. Raises if ``final`` became something that is not a
    regular file since the save began (:func:`refuse_non_regular`)."""
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return
    refuse_non_regular(final, st)
    _copy_attributes(fd, final, st)


def _copy_attributes(fd: int, final: str, st: os.stat_result) -> None:
    """What :func:`adopt_attributes` gives the file (or directory) open as ``fd`` from
    ``final``, whose ``lstat`` is ``st``."""
    cur = os.fstat(fd)
    if (cur.st_uid, cur.st_gid) != (st.st_uid, st.st_gid):
        for uid in (st.st_uid, -1):  # root keeps both; a member of the file's group keeps that
            try:
                os.fchown(fd, uid, st.st_gid)
                break
            except PermissionError:
                continue
        cur = os.fstat(fd)
    # as a write by another user clears them; a directory's setgid bit (new files take its group) stays
    mode = stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | (0 if stat.S_ISDIR(st.st_mode) else stat.S_ISGID))
    if cur.st_gid != st.st_gid:  # other users in our group had the other bits, not the group's
        mode &= ~0o070 | ((mode & 0o007) << 3)
    acl = _xattr_of(final, ACL_XATTR)
    if acl is not None and cur.st_gid != st.st_gid:
        # the old group's ACL entry would apply to our group now: not copied (named users
        # lose their access; the mode, narrowed above, holds the rest)
        group_obj = _acl_perm(acl, _ACL_GROUP_OBJ)
        if group_obj is not None:
            mode &= ~0o070 | (group_obj << 3)
        acl = None
    if acl is None:
        with contextlib.suppress(OSError):  # a default ACL of the directory gave it one: not the old file's
            os.removexattr(fd, ACL_XATTR)
        os.fchmod(fd, mode)
        return
    os.fchmod(fd, mode)
    try:
        os.setxattr(fd, ACL_XATTR, acl)  # sets the permission bits from the ACL too
    except OSError:
        group_obj = _acl_perm(acl, _ACL_GROUP_OBJ)
        if group_obj is not None:
            os.fchmod(fd, (mode & ~0o070) | ((mode & 0o070) & (group_obj << 3)))


def _xattr_of(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def _acl_perm(acl: bytes, tag: int) -> int | None:
    """The permission bits of the entry ``tag`` of a POSIX ACL xattr (version 2: a 4-byte
    header, then 8-byte entries ``tag:u16 perm:u16 id:u32``)."""
    for off in range(4, len(acl) - 7, 8):
        t, perm = struct.unpack_from("<HH", acl, off)
        if t == tag:
            return perm & 0o7
    return None


def check_room(final: str, need: int, fd: int) -> None:
    """Before writing ``need`` bytes into the temporary file ``fd`` of ``final``: raise
    ``ENOSPC`` now, naming why, when its filesystem cannot hold them. An atomic replace
    needs room for the new file beside the old one until the rename (``torch.save``,
    truncating first, needs none); replaced checkpoints still being freed count as free."""
    try:
        vfs = os.fstatvfs(fd)
        st = os.fstat(fd)
    except OSError:
        return
    free = (vfs.f_bfree if os.geteuid() == 0 else vfs.f_bavail) * vfs.f_frsize
    free += deferred_free.pending_bytes(st.st_dev)
    if need - st.st_blocks * 512 > free:
        raise no_room(final, need, free)


def no_room(final: str, need: int, free: int | None = None) -> OSError:
    """The ``ENOSPC`` of a save of ``need`` bytes to ``final``, saying what an atomic replace
    needs where a checkpoint is there already."""
    if free is None:
        try:
            vfs = os.statvfs(os.path.dirname(final))
            free = (vfs.f_bfree if os.geteuid() == 0 else vfs.f_bavail) * vfs.f_frsize
        except OSError:
            free = 0
    try:
        old = os.stat(final).st_size
    except OSError:
        old = 0
    if old and need <= free + old:  # torch.save, truncating first, would have fit
        why = (f"No space left on device: an atomic replace needs {need} bytes free beside the existing checkpoint "
               f"({old} bytes, kept until the new one is complete); {free} are free")
    else:
        why = f"No space left on device: the checkpoint needs {need} bytes; {free} are free"
    return OSError(errno.ENOSPC, why, final)


# ---------------------------------------------------------------- pending-save placeholders

PLACEHOLDER_XATTR = "user.fastpersist.pending"
# What a placeholder holds: text, so that a placeholder its writer never replaced (a process
# ended by os._exit or SIGKILL, where nothing of ours runs) is not an empty file that reads
# like a truncated checkpoint. Placeholders of earlier versions are empty.
PLACEHOLDER_TEXT = (b"FastPersist: a checkpoint is being saved under this name. A file still holding this text after "
                    b"its writer ended is a save that never completed; `fastpersist clean` removes it.\n")


def claim(final: str) -> int | None:
    """Make a pending checkpoint's final name exist now, as a marked placeholder (a line of
    text, :data:`PLACEHOLDER_TEXT`).

    Frameworks decide names by asking whether a file exists (Lightning's ``-v1`` counter),
    so a save still in flight must be visible. The placeholder carries an extended
    attribute naming its writer and is held (``flock``) through the returned descriptor:
    close it (:func:`settle`) once the save is over. :func:`clean` removes a placeholder
    nobody holds (its writer died); loaders can tell it from a checkpoint. Returns None,
    and creates nothing, when the name exists or the filesystem has no user xattrs.
    """
    try:
        # 0666 less the umask, as torch.save's open(): the checkpoint renamed over it keeps it
        fd = os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        return None
    try:  # held before it is marked: a clean-up never sees a marked placeholder nobody holds
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, PLACEHOLDER_TEXT)
        os.setxattr(fd, PLACEHOLDER_XATTR, f"{writer_tag()}-0".encode())
    except OSError:
        os.close(fd)
        os.unlink(final)
        return None
    return fd


def settle(fd: int | None) -> None:
    """Let go of a placeholder's lock (its save is over, committed or released)."""
    if fd is not None:
        os.close(fd)


def placeholder_owner(path: str) -> str | None:
    """The writer tag of a placeholder made by :func:`claim` (or an empty one of an earlier
    version), or None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _placeholder_tag(fd)
    finally:
        os.close(fd)


def _placeholder_tag(fd: int) -> str | None:
    """The writer tag of the placeholder open as ``fd``: a regular file marked by
    :func:`claim`, holding :data:`PLACEHOLDER_TEXT` or nothing; None for anything else."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size not in (0, len(PLACEHOLDER_TEXT)):
            return None
        if st.st_size and os.pread(fd, st.st_size, 0) != PLACEHOLDER_TEXT:
            return None
        return os.getxattr(fd, PLACEHOLDER_XATTR).decode(errors="replace")
    except OSError:
        return None


def is_placeholder(path: str) -> bool:
    return placeholder_owner(path) is not None


def release(final: str, fd: int | None = None) -> None:
    """Remove our own placeholder (the save failed); a finished file is left alone."""
    try:
        if placeholder_owner(final) is not None:
            discard(final)
    finally:
        settle(fd)


# ---------------------------------------------------------------- clean-up of crashed saves


def _ours_to_judge(host: str) -> bool:
    return host == _HOST  # another node's writer on a shared filesystem: not ours to judge


def _writer_host(entry: os.DirEntry) -> str | None:
    """The host of the writer of a temporary file or placeholder (regular files only, as
    FastPersist names or marks them), or None for anything else."""
    if not entry.is_file(follow_symlinks=False):
        return None
    m = _TEMP_RE.match(entry.name)
    if m is not None:
        return m.group("host")
    if entry.stat(follow_symlinks=False).st_size in (0, len(PLACEHOLDER_TEXT)):
        owner = placeholder_owner(entry.path)
        if owner is not None:
            return owner.split("-", 1)[0]
    return None


def stale_files(directory: str) -> list[str]:
    """Temporary files (exactly as :func:`temp_path` names them) and pending-save
    placeholders in ``directory``, regular files of this host, that no live writer holds."""
    return [p for p, _ in _candidates(directory) if not _held(p)]


def _candidates(directory: str) -> list[tuple[str, int]]:
    """``(path, inode)`` of this host's temporary files and placeholders in ``directory``."""
    out = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for e in entries:
        try:
            host = _writer_host(e)
            if host is not None and _ours_to_judge(host):
                out.append((e.path, e.inode()))
        except OSError:
            continue
    return out


def _remove_stale(directory: str) -> list[str]:
    removed = []
    for p, ino in _candidates(directory):
        try:
            owner = None if _TEMP_RE.match(os.path.basename(p)) else placeholder_owner(p)
            if _remove_unheld(p, ino):
                removed.append(p)
                if owner is not None:  # a name the caller was told was being saved: say it was lost
                    log.warning("fastpersist: the save of %s never completed (its writer, %s, ended before "
                                "committing it); removed its placeholder", p, owner.rsplit("-", 1)[0])
        except OSError as e:
            log.warning("fastpersist: could not remove %s left by a crashed save: %s", p, e)
    return removed


def clean(directory: str | Path, recursive: bool = False) -> list[str]:
    """Remove temp files and placeholders of crashed saves. Returns what was removed."""
    removed = []
    dirs = [str(directory)]
    if recursive:
        dirs = [root for root, _, _ in os.walk(directory)]
    for d in dirs:
        removed += _remove_stale(d)
    return removed


_cleaning: dict[str, threading.Thread] = {}
_cleaning_lock = threading.Lock()


def clean_in_background(directory: str) -> None:
    """:func:`clean` ``directory`` once per process, on a thread of its own."""
    d = os.path.abspath(directory)
    with _cleaning_lock:
        if d in _cleaning:
            return
        t = threading.Thread(target=_clean_quietly, args=(d,), name="fastpersist-clean", daemon=True)
        _cleaning[d] = t
    t.start()


def _clean_quietly(directory: str) -> None:
    try:
        for p in clean(directory):
            log.info("fastpersist: removed %s, left by a crashed save", p)
    except Exception as e:  # noqa: BLE001 - housekeeping: never the save's failure
        log.warning("fastpersist: cleaning %s failed: %s", directory, e)


def wait_for_clean(directory: str | None = None) -> None:
    """Block until the background clean-up of ``directory`` (or of every directory) ended."""
    with _cleaning_lock:
        threads = list(_cleaning.values()) if directory is None else \
            [t for t in [_cleaning.get(os.path.abspath(directory))] if t is not None]
    for t in threads:
        t.join()


# ---------------------------------------------------------------- checkpoint directories
#
# A checkpoint that is a directory (the HF Trainer's checkpoint-N) is committed the same way
# as a file: written complete under a name nobody lists, made durable, renamed into place.
# No filesystem renames over a non-empty directory, so a directory being replaced is first
# moved aside, and one being deleted is first renamed out of its namespace: a kill at any
# instant leaves either the old or the new directory under the name, never a mix or a
# half-deleted one, and what is left aside is put back or removed by recover_dirs().

REPLACED_PREFIX = ".fastpersist-replaced-"
RETIRED_PREFIX = ".fastpersist-deleting-"


def resolve_dir(final: str | os.PathLike) -> str:
    """The checkpoint directory ``final`` names, absolute: a symlink (or a chain) is followed,
    so its target is replaced and the link still names the new checkpoint, as for files
    (:func:`check_target`). Refuses, naming the path, what exists there and is not a
    directory: a checkpoint directory is never renamed over a user's file or device."""
    path = os.path.realpath(os.fspath(final))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "checkpoint directory is a symlink loop", os.fspath(final))
    if not stat.S_ISDIR(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "a regular file")
        raise NotADirectoryError(errno.ENOTDIR, f"checkpoint directory path exists and is {kind}, not a "
                                 "directory; it is left as it is", path)
    return path


def publish_dir(staging: str, final: str) -> None:
    """Rename the complete, synced directory ``staging`` to ``final`` (replacing one there),
    durably. A symlink at ``final`` is written through (:func:`resolve_dir`): ``staging``
    first moves beside the directory it names."""
    final = resolve_dir(final)
    parent = os.path.dirname(final)
    src = os.path.realpath(staging)
    if os.path.dirname(src) == parent:
        _publish_dir(staging, final)
    else:
        moved = os.path.join(parent, os.path.basename(staging))
        os.rename(staging, moved)  # same filesystem as the link's own directory, or EXDEV: a clear error
        try:
            _publish_dir(moved, final)
        except BaseException:
            shutil.rmtree(moved, ignore_errors=True)  # where the caller's clean-up of its staging cannot see it
            raise
    from ..io import memory_image

    try:  # the images of its files in shared memory (resume from memory) follow it
        memory_image.moved(src, os.path.realpath(final))
    except OSError as e:  # the directory is committed; only the resume from memory is lost
        log.warning("fastpersist: the shared-memory images of %s do not follow it to %s: %s", staging, final, e)


def _publish_dir(staging: str, final: str) -> None:
    """:func:`publish_dir` of a ``staging`` directory beside ``final`` (resolved)."""
    parent = os.path.dirname(final)
    if os.path.isdir(final):  # the directory it replaces keeps its mode, owner, group and ACL
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _copy_attributes(fd, final, os.lstat(final))
        finally:
            os.close(fd)
    fsync_dir(staging)
    replaced = None
    if os.path.lexists(final):
        replaced = os.path.join(parent, REPLACED_PREFIX + os.path.basename(final))
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    try:
        os.rename(staging, final)
    except BaseException:
        if replaced is not None:
            os.rename(replaced, final)  # the previous checkpoint back under its name
        raise
    fsync_dir(parent)
    if replaced is not None:
        try:
            retire_dirs([replaced])
        except OSError as e:  # committed already: what is left aside goes at the next recover_dirs
            log.warning("fastpersist: could not remove the replaced checkpoint %s: %s", replaced, e)


def retire_dirs(paths: list[str]) -> None:
    """Delete checkpoint directories: each renamed out of its namespace first (one directory
    fsync for all), then removed, so a kill mid-delete leaves nothing that looks complete."""
    gone = []
    for p in paths:
        aside = os.path.join(os.path.dirname(p), RETIRED_PREFIX + os.path.basename(p))
        shutil.rmtree(aside, ignore_errors=True)  # a leftover of an earlier, interrupted delete
        os.rename(p, aside)
        gone.append(aside)
    for parent in {os.path.dirname(g) for g in gone}:
        fsync_dir(parent)
    for g in gone:
        with deferred_free.pinned(g):  # its large files freed in the background
            shutil.rmtree(g, ignore_errors=True)


def recover_dir(final: str) -> None:
    """Put the checkpoint directory ``final`` back if a crash fell between
    :func:`publish_dir`'s two renames (it is aside, and nothing replaced it)."""
    final = os.path.realpath(final)  # a link: the directory it names is what was set aside
    parent, base = os.path.split(final)
    aside = os.path.join(parent, REPLACED_PREFIX + base)
    if os.path.isdir(aside) and not os.path.islink(aside) and not os.path.lexists(final):
        os.rename(aside, final)
        fsync_dir(parent)


def recover_dirs(parent: str, staging_prefixes: tuple[str, ...] = ()) -> None:
    """Undo what a crash left half done in ``parent``: a directory moved aside to be replaced
    goes back if its replacement never arrived; directories being deleted, leftovers of
    replacements and staging directories (``staging_prefixes``) are removed."""
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith(REPLACED_PREFIX):
            final = os.path.join(parent, name[len(REPLACED_PREFIX):])
            if not os.path.lexists(final):
                os.rename(path, final)  # the crash fell between publish_dir's two renames
                continue
        if name.startswith((REPLACED_PREFIX, RETIRED_PREFIX, *staging_prefixes)):
            shutil.rmtree(path, ignore_errors=True)
    fsync_dir(parent)
