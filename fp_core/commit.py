"""Atomic, durable commit: temp name in the same directory, fdatasync, rename, fsync(dir).

A crash at any instant leaves the previous checkpoint under the final name and, at most,
a temporary file. Temporary names start with a dot and end in ``.fptmp`` so neither
Lightning (``*.ckpt``) nor the HF Trainer (``checkpoint-*``) ever lists one, and they
carry the writer's host and pid so that the next save into the directory (or
``fastpersist clean DIR``) can tell an orphan from a save still in progress.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import uuid
from pathlib import Path

log = logging.getLogger("fastpersist")

TMP_SUFFIX = ".fptmp"
_HOST = socket.gethostname().replace(".", "_").replace("-", "_")


def temp_path(final: str) -> str:
    d, base = os.path.split(os.path.abspath(final))
    return os.path.join(d, f".{base}.{writer_tag()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, final: str) -> None:
    """Rename the finished temp file over ``final`` and make the rename durable."""
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def discard(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as e:  # never mask the error that made us discard
        log.warning("fastpersist: could not remove temporary file %s: %s", tmp, e)


def check_target(final: str) -> str:
    """Validate a checkpoint path before any work; return its absolute form.

    Raises with the path and the cause: a missing or non-directory parent, a path that
    is a directory, a parent we cannot write to.
    """
    path = os.path.abspath(os.fspath(final))
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
    try:
        st = os.stat(parent)  # not os.path.exists: it says "missing" for an unsearchable parent
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "checkpoint directory does not exist", parent) from None
    except PermissionError:
        raise PermissionError(errno.EACCES, "checkpoint directory cannot be reached (permission denied)",
                              parent) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "checkpoint directory is not a directory", parent)
    if os.statvfs(parent).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, "checkpoint directory is on a read-only file system", parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "checkpoint directory is not writable", parent)
    return path


def writer_tag() -> str:
    """``host-pid``: who is writing, as embedded in temp names, placeholders, staging dirs."""
    return f"{_HOST}-{os.getpid()}"


def tag_alive(tag: str) -> bool:
    """Is the writer named by a ``host-pid-...`` tag alive? Unparsable tags count as dead."""
    try:
        host, pid, _ = tag.rsplit("-", 2)
        pid_i = int(pid)
    except ValueError:
        return False
    if host != _HOST:
        return True  # another node's writer on a shared filesystem: not ours to judge
    if pid_i == os.getpid():
        return True
    try:
        os.kill(pid_i, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_alive(name: str) -> bool:
    """Is the process that owns this temp name (``.<base>.<host>-<pid>-<hex>.fptmp``) alive?"""
    try:
        return tag_alive(name[: -len(TMP_SUFFIX)].rsplit(".", 1)[1])
    except IndexError:
        return False


PLACEHOLDER_XATTR = "user.fastpersist.pending"


def claim(final: str) -> bool:
    """Make a pending checkpoint's final name exist now, as a marked empty placeholder.

    Frameworks decide names by asking whether a file exists (Lightning's ``-v1`` counter),
    so a save still in flight must be visible. The placeholder carries an extended
    attribute naming its writer: ``clean`` (run by every save into the directory) removes
    it if that writer died, and loaders can tell it from a checkpoint. Returns False, and
    creates nothing, when the name exists or the filesystem has no user xattrs.
    """
    try:
        fd = os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    try:
        os.setxattr(fd, PLACEHOLDER_XATTR, f"{writer_tag()}-0".encode())
    except OSError:
        os.close(fd)
        os.unlink(final)
        return False
    os.close(fd)
    return True


def placeholder_owner(path: str) -> str | None:
    """The writer tag of a placeholder made by :func:`claim`, or None for anything else."""
    try:
        if os.path.islink(path) or os.path.getsize(path) != 0:
            return None
        return os.getxattr(path, PLACEHOLDER_XATTR).decode()
    except OSError:
        return None


def is_placeholder(path: str) -> bool:
    return placeholder_owner(path) is not None


def release(final: str) -> None:
    """Remove our own placeholder (the save failed); a finished file is left alone."""
    if placeholder_owner(final) is not None:
        discard(final)


def _stale_placeholders(directory: str) -> list[str]:
    out = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for e in entries:
        try:
            if not e.is_file(follow_symlinks=False) or e.stat(follow_symlinks=False).st_size != 0:
                continue
        except OSError:
            continue
        owner = placeholder_owner(e.path)
        if owner is not None and not tag_alive(owner):
            out.append(e.path)
    return out


def stale_temps(directory: str) -> list[str]:
    """Temp files in ``directory`` whose writer is gone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [
        os.path.join(directory, n)
        for n in names
        if n.startswith(".") and n.endswith(TMP_SUFFIX) and not _owner_alive(n)
    ]


def clean(directory: str | Path, recursive: bool = False) -> list[str]:
    """Remove orphaned temp files and placeholders of crashed saves. Returns what was removed."""
    removed = []
    dirs = [str(directory)]
    if recursive:
        dirs = [root for root, _, _ in os.walk(directory)]
    for d in dirs:
        for p in stale_temps(d) + _stale_placeholders(d):
            discard(p)
            removed.append(p)
    return removed
