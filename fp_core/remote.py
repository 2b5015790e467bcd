"""Remote storage tier: fsspec URLs behind a fast local staging tier.

A checkpoint for ``s3://``, ``gs://``, ``az://``, ``hdfs://``, ``memory://`` (any fsspec
URL) is written with the native engine to a private *staging* directory on local disk,
committed there (fdatasync + rename, as any local save), then uploaded through fsspec.
``fp_core.save(url)`` uploads before it returns; ``AsyncCheckpointer.save(url)`` returns
at once and the upload runs on the background worker after the local write, so the
handle, ``wait`` and ``on_commit`` all cover the remote copy. Local paths (no protocol,
or ``file://``) never come here and keep the native fast path.

**The remote copy is complete or absent.**

* Object stores (s3, gs, az/abfs, oss, r2...): a single PUT, and a *completed* multipart
  upload, are atomic: readers see the previous object (or none) until the upload
  completes, never a prefix of the new one; s3fs aborts the multipart upload when a part
  fails, so no partial object is ever published. We rely on that and upload straight to
  the final key, then check the stored size.
* Filesystems with rename (hdfs, sftp, memory, ...): upload to a temporary name in the
  same directory (``.<name>.<host>-<pid>-<hex>.fptmp``, which no framework lists) and
  ``fs.mv`` it over the final name.
* Checkpoint *directories* (Hugging Face ``checkpoint-N``): no store renames a prefix
  atomically, so a directory is complete when it holds the marker file
  ``.fastpersist-complete``, uploaded *last* by :func:`upload_dir` (and removed *first*
  by :func:`remove`). Listing must honour it: use :func:`list_complete` /
  :func:`is_complete`, never a bare ``ls``. On rename filesystems the directory is
  also uploaded under a temporary name and moved into place.

**Staging** lives in ``$FASTPERSIST_STAGING_DIR`` (default
``<tempdir>/fastpersist-staging-<uid>``, or :func:`configure`); every save or download
gets its own slot ``pending/<host>-<pid>-<hex>/``, removed when it is done, on success
and on failure. With ``keep_local=True`` the committed file is moved into
``cache/<key>/`` with a sidecar recording the remote object's size and fingerprint (ETag
/ generation / mtime, whatever the store reports), so the next :func:`load` of that URL
reads the local copy (when size and fingerprint still match) at native speed. The cache
is bounded by ``staging_budget_bytes`` (``$FASTPERSIST_STAGING_BUDGET``, e.g. ``20G``;
default unbounded): least recently used entries are evicted to make room.

**Loading** downloads into staging with fsspec (``get_file``: s3fs fetches large
objects in concurrent ranged parts) and then uses the native fast loader, so
``verify=True`` checks every byte against the manifest as for a local file. Downloading
first beats streaming ``torch.load`` through an fsspec file object (whose ranged reads
are sequential; s3fs downloads in concurrent parts), except for ``memory://``, where the
bytes already sit in RAM: not a case worth a second code path.

**Storage options** (credentials, endpoint): pass ``storage_options={...}`` to
``fp_core.save`` / ``load`` / ``verify`` / ``AsyncCheckpointer.save`` and every function
here (forwarded to ``fsspec.core.url_to_fs``), or configure fsspec itself:
``fsspec.config.conf["s3"] = {...}`` or the env var ``FSSPEC_S3='{"client_kwargs":
{"endpoint_url": ...}}'`` (read when fsspec is imported), or the store's own environment
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL_S3``, ``GOOGLE_APPLICATION_CREDENTIALS``...).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from .errors import CorruptCheckpointError, NotAFastPersistCheckpoint
from .format.sizes import parse_size
from .io import deferred_free
from .loading import integrity, loader
from .paths import is_remote, split
from .saving import commit

log = logging.getLogger("fastpersist")

STAGING_ENV = "FASTPERSIST_STAGING_DIR"
BUDGET_ENV = "FASTPERSIST_STAGING_BUDGET"
COMPLETE_MARKER = ".fastpersist-complete"
TMP_SUFFIX = commit.TMP_SUFFIX
_SIDECAR = "fastpersist-remote.json"
_LOG_PROGRESS_BYTES = 256 << 20  # files at least this big log progress while they move

# Stores where a PUT / completed multipart upload is atomic and there is no cheap rename.
OBJECT_STORE_PROTOCOLS = frozenset({
    "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "cos", "tos", "obs",
})

_lock = threading.Lock()
_config: dict[str, Any] = {"staging_dir": None, "budget": None}
_cleaned: set[str] = set()


# ---------------------------------------------------------------- paths


def filesystem(url: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """``(fs, path_in_fs)`` for ``url`` (fsspec.core.url_to_fs with ``storage_options``)."""
    from fsspec.core import url_to_fs

    return url_to_fs(url, **(storage_options or {}))


def _protocol(fs: Any) -> str:
    p = fs.protocol
    return (p[0] if isinstance(p, (tuple, list)) else p).lower()


def _is_object_store(fs: Any) -> bool:
    return _protocol(fs) in OBJECT_STORE_PROTOCOLS


def _join(parent: str, name: str) -> str:
    return parent.rstrip("/") + "/" + name


def _remote_temp(fs: Any, rpath: str) -> str:
    parent, base = fs._parent(rpath), rpath.rstrip("/").rsplit("/", 1)[-1]
    return _join(parent, f".{base}.{commit.writer_tag()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def _url(fs: Any, rpath: str) -> str:
    return fs.unstrip_protocol(rpath)


# ---------------------------------------------------------------- staging


def configure(staging_dir: str | os.PathLike | None = None, staging_budget_bytes: int | None = None) -> None:
    """Set the staging directory and the size budget of the ``keep_local`` cache.

    Either left ``None`` falls back to ``$FASTPERSIST_STAGING_DIR`` /
    ``$FASTPERSIST_STAGING_BUDGET`` (bytes, or with a K/M/G/T suffix), then to
    ``<tempdir>/fastpersist-staging-<uid>`` / no budget.
    """
    with _lock:
        _config["staging_dir"] = None if staging_dir is None else os.path.abspath(os.fspath(staging_dir))
        _config["budget"] = staging_budget_bytes


def private_dir(path: str) -> str:
    """Create ``path`` (mode 0700) or check an existing one; return it.

    A staging area holds checkpoints on their way to or from a store, so it must be this
    user's alone: another local user who made it first, or who could write into it, could
    read every checkpoint, swap a cached one, or plant a symlink that our clean-up follows
    into the user's own files. Refused (``PermissionError`` naming the path and the
    cause) when it is a symlink, not a directory, owned by another uid, or writable by
    group or others; group/other *read* bits on our own directory are removed (only we
    could have written into it). Checked through one descriptor opened without following
    symlinks, so the directory checked is the directory changed.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            what = "a symbolic link" if os.path.islink(path) else "not a directory"
            raise PermissionError(errno.EPERM, f"FastPersist staging directory is {what}; refusing to use it "
                                  f"(remove it, or set {STAGING_ENV} to a directory of your own)", path) from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise PermissionError(errno.EPERM, f"FastPersist staging directory belongs to uid {st.st_uid}, not to "
                                  f"this user (uid {os.getuid()}); another user may have created it to read or "
                                  f"replace checkpoints. Remove it, or set {STAGING_ENV} to a directory of your own",
                                  path)
        if st.st_mode & 0o022:
            raise PermissionError(errno.EPERM, f"FastPersist staging directory is writable by group or others "
                                  f"(mode {stat.S_IMODE(st.st_mode):o}); refusing to use it (chmod 700 it, or set "
                                  f"{STAGING_ENV} to a directory of your own)", path)
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def staging_dir() -> str:
    """The staging directory (see :func:`configure`), created private on first use."""
    d = _config["staging_dir"] or os.environ.get(STAGING_ENV) or os.path.join(
        tempfile.gettempdir(), f"fastpersist-staging-{os.getuid()}")
    d = os.path.abspath(d)
    if d not in _cleaned:
        parent = os.path.dirname(d)
        if parent and not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
        private_dir(d)
        private_dir(os.path.join(d, "pending"))
        private_dir(os.path.join(d, "cache"))
        with _lock:
            _cleaned.add(d)
        clean_staging(d)
    return d


def staging_budget() -> int | None:
    if _config["budget"] is not None:
        return _config["budget"]
    env = os.environ.get(BUDGET_ENV)
    return parse_size(env) if env else None


_SLOT_RE = re.compile(r"^[A-Za-z0-9_]+-\d+-[0-9a-f]{12}$")


def _lock_dir(path: str, blocking: bool) -> int | None:
    """Open ``path`` (a directory, symlinks not followed) and take an exclusive ``flock``
    on it: the descriptor, or None when another open description holds the lock (its
    owner is alive: the lock dies with the process, whatever host or container it ran in)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def clean_staging(directory: str | None = None) -> list[str]:
    """Remove staging slots left by dead processes (crashed saves/downloads).

    Only directories named as :class:`_Slot` names them are considered, never followed
    through a symlink, and only when nobody holds their lock.
    """
    d = os.path.join(directory or staging_dir(), "pending")
    removed = []
    try:
        entries = list(os.scandir(d))
    except OSError:
        return removed
    for e in entries:
        if not _SLOT_RE.match(e.name) or not e.is_dir(follow_symlinks=False):
            continue
        try:
            fd = _lock_dir(e.path, blocking=False)
        except OSError:
            continue
        if fd is None:
            continue  # its writer is alive
        try:
            shutil.rmtree(e.path, ignore_errors=True)
        finally:
            os.close(fd)
        if not os.path.lexists(e.path):
            removed.append(e.path)
    return removed


class _Slot:
    """A private staging directory for one save or download; ``close`` removes it.

    It is locked (``flock``) for its whole life, so :func:`clean_staging` in any other
    process leaves it alone while this one lives, and removes it once this one is gone.
    """

    def __init__(self, basename: str) -> None:
        pending = os.path.join(staging_dir(), "pending")
        for _ in range(8):
            self.dir = os.path.join(pending, f"{commit.writer_tag()}-{uuid.uuid4().hex[:12]}")
            os.mkdir(self.dir, 0o700)
            try:
                fd = _lock_dir(self.dir, blocking=True)
            except FileNotFoundError:
                continue  # another process's clean-up took it for a dead slot before we held it
            try:
                if fd is not None and os.fstat(fd).st_ino == os.lstat(self.dir).st_ino:
                    self._fd: int | None = fd
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise OSError(errno.EAGAIN, "could not make a staging slot that stays", pending)
        self.path = os.path.join(self.dir, basename)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _base_name(url: str) -> str:
    """The last component of a URL as a local file name (never ``..``, ``.`` or empty)."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return name if name not in ("", ".", "..") and "\0" not in name else "checkpoint"


def _key(url: str) -> str:
    return hashlib.sha1(url.encode()).hexdigest()[:24]


def _cache_dir(url: str) -> str:
    return os.path.join(staging_dir(), "cache", _key(url))


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _make_room(nbytes: int) -> None:
    """Evict least recently used cache entries until ``nbytes`` more fit the budget."""
    budget = staging_budget()
    if budget is None:
        return
    root = staging_dir()
    used = _du(root)
    if used + nbytes <= budget:
        return
    cache = os.path.join(root, "cache")
    entries = []
    for n in os.listdir(cache):
        d = os.path.join(cache, n)
        try:
            entries.append((os.stat(os.path.join(d, _SIDECAR)).st_mtime, d))
        except OSError:
            entries.append((0.0, d))
    for _, d in sorted(entries):
        if used + nbytes <= budget:
            break
        size = _du(d)
        _drop_dir(d)
        used -= size
        log.info("fastpersist: evicted %s (%.1f MB) from the staging cache (budget %d bytes)", d, size / 1e6, budget)
    if used + nbytes > budget:
        log.warning("fastpersist: staging %s needs %d bytes beyond its budget of %d bytes "
                    "(in-flight saves are never evicted)", root, used + nbytes - budget, budget)


def _drop_dir(d: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(d, _SIDECAR))  # invalid first, then gone
    with deferred_free.pinned(d):  # a large copy's blocks freed in the background
        shutil.rmtree(d, ignore_errors=True)


def drop_cached(url: str) -> None:
    """Forget the local cached copy of ``url`` (if any)."""
    _drop_dir(_cache_dir(split(url)[1]))


def _fingerprint(info: dict) -> dict:
    fp = {"size": int(info.get("size") or 0)}
    for k in ("ETag", "etag", "md5Hash", "crc32c", "generation", "VersionId", "version_id",
              "LastModified", "last_modified", "mtime", "created", "checksum"):
        if info.get(k) is not None:
            fp[k] = str(info[k])
    return fp


def _cache_put(local: str, url: str, info: dict) -> str:
    """Move the committed file ``local`` into the cache as the copy of ``url``."""
    d = _cache_dir(url)
    _drop_dir(d)
    os.mkdir(d, 0o700)
    dest = os.path.join(d, os.path.basename(local))
    os.replace(local, dest)
    os.chmod(dest, 0o600)
    side = os.path.join(d, _SIDECAR + TMP_SUFFIX)
    with os.fdopen(os.open(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "w") as f:
        json.dump({"url": url, "file": os.path.basename(dest), "fingerprint": _fingerprint(info),
                   "time": time.time()}, f)
    os.replace(side, os.path.join(d, _SIDECAR))
    return dest


def _cache_get(url: str, info: dict) -> str | None:
    d = _cache_dir(url)
    try:
        fd = os.open(os.path.join(d, _SIDECAR), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            side = json.load(f)
        local = os.path.join(d, side["file"])
        if side["url"] != url or side["fingerprint"] != _fingerprint(info) \
                or os.path.getsize(local) != int(info.get("size") or -1):
            return None
        os.utime(os.path.join(d, _SIDECAR))  # recently used
        return local
    except (OSError, ValueError, KeyError):
        return None


# ---------------------------------------------------------------- progress


class _Progress:
    """An fsspec callback that logs every 10% of a large transfer."""

    def __new__(cls, what: str, name: str):
        from fsspec.callbacks import Callback

        class _P(Callback):
            def __init__(self) -> None:
                super().__init__()
                self._next = 0.1

            def call(self, *args: Any, **kwargs: Any) -> None:
                if self.size and self.size >= _LOG_PROGRESS_BYTES and self.value >= self._next * self.size:
                    log.info("fastpersist: %s %s: %.0f%% of %.1f MB", what, name, 100 * self.value / self.size,
                             self.size / 1e6)
                    while self._next * self.size <= self.value:
                        self._next += 0.1

        return _P()


def _log_done(what: str, url: str, nbytes: int, seconds: float) -> None:
    log.info("fastpersist: %s %s: %.1f MB in %.2f s (%.1f MB/s)", what, url, nbytes / 1e6, seconds,
             nbytes / 1e6 / seconds if seconds > 0 else float("inf"))


# ---------------------------------------------------------------- files


def upload_file(local_path: str | os.PathLike, url: str, *, storage_options: dict | None = None,
                callback: Any = None, **put_kwargs: Any) -> dict:
    """Upload one local file to ``url`` so the remote copy is complete or absent.

    Object stores: one ``put_file`` (single PUT or multipart; both atomic; the stored size
    is checked). Other filesystems: ``put_file`` to a temporary name, then ``mv``.
    ``put_kwargs`` go to ``fs.put_file`` (s3fs: ``chunksize``, ``max_concurrency``).
    Returns the remote ``fs.info`` of the uploaded object.
    """
    local_path = os.fspath(local_path)
    fs, rpath = filesystem(url, storage_options)
    size = os.path.getsize(local_path)
    t0 = time.perf_counter()
    cb = callback if callback is not None else _Progress("uploading", url)
    if _is_object_store(fs):
        fs.put_file(local_path, rpath, callback=cb, **put_kwargs)
    else:
        tmp = _remote_temp(fs, rpath)
        with contextlib.suppress(Exception):
            fs.makedirs(fs._parent(rpath), exist_ok=True)
        try:
            fs.put_file(local_path, tmp, callback=cb, **put_kwargs)
            fs.mv(tmp, rpath)
        except BaseException:
            with contextlib.suppress(Exception):
                fs.rm_file(tmp)
            raise
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)
    info = fs.info(rpath)
    if int(info.get("size") or 0) != size:
        raise OSError(f"upload of {local_path} to {url}: the store holds {info.get('size')} bytes, "
                      f"{size} were sent")
    _log_done("uploaded", url, size, time.perf_counter() - t0)
    return info


class RemoteSave:
    """A save to a remote URL (a SaveJob): a :class:`~fp_core.saving.local.LocalSave` into a
    staging slot, committed there, then uploaded; ``final`` is the URL."""

    collective = False

    def __init__(self, obj: Any, url: str, options: Any, format: str = "torch",
                 metadata: dict[str, str] | None = None, storage_options: dict | None = None,
                 keep_local: bool = False) -> None:
        from .saving.local import LocalSave

        self.final = split(url)[1]
        self.storage_options = storage_options
        self.keep_local = keep_local
        filesystem(self.final, storage_options)  # a bad protocol / missing driver fails now
        self.slot = _Slot(_base_name(self.final))
        try:
            self.local = LocalSave(obj, self.slot.path, options, format, metadata, mode=0o600)
        except BaseException:
            self.slot.close()
            raise
        self.plan = self.local.plan
        self.stats = self.local.stats
        self.stats.path = self.final
        try:
            _make_room(self.plan.file_size)
        except OSError as e:
            log.warning("fastpersist: could not check the staging budget: %s", e)

    def run(self, on_body_written: Any = None) -> Any:
        try:
            st = self.local.run(on_body_written=on_body_written)  # committed in staging
            st.path = self.final
            t0 = time.perf_counter()
            drop_cached(self.final)  # the cached copy (if any) is about to be stale
            info = upload_file(self.local.final, self.final, storage_options=self.storage_options)
            up = time.perf_counter() - t0
            st.extra["upload_seconds"] = up
            st.extra["upload_MBps"] = st.bytes / 1e6 / up if up > 0 else 0.0
            st.extra["local_seconds"] = st.seconds
            st.seconds += up
            if self.keep_local:
                st.extra["cached"] = _cache_put(self.local.final, self.final, info)
            return st
        finally:
            self.slot.close()

    def fail(self, error: BaseException) -> None:
        self.local.fail(error)

    def abort(self) -> None:
        try:
            self.local.abort()
        finally:
            self.slot.close()


@contextlib.contextmanager
def fetch(url: str, *, storage_options: dict | None = None, keep_local: bool = False) -> Iterator[str]:
    """A local path holding the remote file ``url`` for the ``with`` block.

    The cached copy when it matches the remote size and fingerprint, else a download
    into staging (removed afterwards unless ``keep_local``, which caches it).
    """
    url = split(url)[1]
    fs, rpath = filesystem(url, storage_options)
    info = fs.info(rpath)
    if info.get("type") == "directory":
        raise IsADirectoryError(f"{url} is a directory (use fp_core.remote.download_dir)")
    cached = _cache_get(url, info)
    if cached is not None:
        log.info("fastpersist: %s: using the local copy %s", url, cached)
        yield cached
        return
    size = int(info.get("size") or 0)
    with contextlib.suppress(OSError):
        _make_room(size)
    slot = _Slot(_base_name(rpath))
    try:
        t0 = time.perf_counter()
        fs.get_file(rpath, slot.path, callback=_Progress("downloading", url))
        _log_done("downloaded", url, size, time.perf_counter() - t0)
        if os.path.getsize(slot.path) != size:
            raise OSError(f"download of {url}: got {os.path.getsize(slot.path)} bytes, the store says {size}")
        yield _cache_put(slot.path, url, info) if keep_local else slot.path
    finally:
        slot.close()


def load(url: str, map_location: Any = None, weights_only: bool | None = None, verify: bool | str = False, *,
         mmap: bool = False, storage_options: dict | None = None, keep_local: bool = False) -> Any:
    """``fp_core.load`` of a remote URL: fetched into staging (or the cache), then loaded natively
    (with ``mmap``, mapped on the staged copy, whose disk space outlives its name until the
    tensors are freed)."""
    with fetch(url, storage_options=storage_options, keep_local=keep_local) as local, named_by_url(url, local):
        return loader.load(local, map_location=map_location, weights_only=weights_only, verify=verify, mmap=mmap)


def verify(url: str, *, storage_options: dict | None = None, keep_local: bool = False) -> dict:
    """``fp_core.verify`` of a remote checkpoint (checked on a staged copy)."""
    with fetch(url, storage_options=storage_options, keep_local=keep_local) as local, named_by_url(url, local):
        return integrity.verify(local)


@contextlib.contextmanager
def named_by_url(url: str, local: str) -> Iterator[None]:
    """Around the check or load of ``local``, a staged copy of ``url``: the errors that name
    the file (:class:`CorruptCheckpointError`, :class:`NotAFastPersistCheckpoint`, torch's
    weights-only refusal) name the URL the caller gave instead of the staged copy's path,
    usually gone by the time the error is read (it stays in the chained error)."""
    try:
        yield
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(url, e.record, e.detail, e.tensor) from e
    except (NotAFastPersistCheckpoint, pickle.UnpicklingError) as e:
        if local not in str(e):
            raise
        raise type(e)(str(e).replace(local, url)) from e


def exists(url: str, *, storage_options: dict | None = None) -> bool:
    """Is there a complete checkpoint at ``url``? (A directory counts only with its marker.)"""
    fs, rpath = filesystem(url, storage_options)
    if not fs.exists(rpath):
        return False
    return not fs.isdir(rpath) or fs.exists(_join(rpath, COMPLETE_MARKER))


def remove(url: str, *, recursive: bool = False, storage_options: dict | None = None,
           missing_ok: bool = True) -> None:
    """Remove the remote checkpoint file (or, with ``recursive=True``, directory) ``url``.

    A directory's completion marker goes first, so a crash mid-removal leaves an
    incomplete directory that :func:`list_complete` ignores. The local cached copy goes too.
    """
    url = split(url)[1]
    fs, rpath = filesystem(url, storage_options)
    drop_cached(url)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)
    if not fs.exists(rpath):
        if missing_ok:
            return
        raise FileNotFoundError(url)
    if fs.isdir(rpath):
        if not recursive:
            raise IsADirectoryError(f"{url} is a directory; pass recursive=True")
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(_join(rpath, COMPLETE_MARKER))
        fs.rm(rpath, recursive=True)
    else:
        fs.rm_file(rpath)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)


# ---------------------------------------------------------------- directories


def _local_files(local_dir: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(local_dir):
        dirs.sort()
        for f in sorted(files):
            if f != COMPLETE_MARKER:
                out.append(os.path.relpath(os.path.join(root, f), local_dir))
    return out


def upload_dir(local_dir: str | os.PathLike, url: str, *, storage_options: dict | None = None,
               batch_size: int | None = None) -> None:
    """Upload every file under ``local_dir`` to the directory ``url``, then mark it complete.

    Files go up with fsspec's concurrent ``fs.put`` (``batch_size`` files at once); the
    marker ``url/.fastpersist-complete`` (JSON: each file's size) is written last. An
    existing directory at ``url`` is replaced: its marker is removed first, so it is never
    complete-looking with mixed contents. On rename filesystems the upload goes to a
    temporary directory that is moved into place. On failure the partial upload is
    removed (best effort) and is never complete-looking.
    """
    local_dir = os.fspath(local_dir)
    url = split(url)[1]
    fs, rpath = filesystem(url, storage_options)
    rels = _local_files(local_dir)
    sizes = {r: os.path.getsize(os.path.join(local_dir, r)) for r in rels}
    marker = json.dumps({"format": "fastpersist-dir/1", "files": sizes, "time": time.time()}).encode()
    total = sum(sizes.values())
    t0 = time.perf_counter()
    drop_cached(url)
    obj = _is_object_store(fs)
    target = rpath if obj else _remote_temp(fs, rpath)
    try:
        if obj:
            remove(url, recursive=True, storage_options=storage_options)
        else:
            with contextlib.suppress(Exception):
                fs.makedirs(target, exist_ok=True)
        lpaths = [os.path.join(local_dir, r) for r in rels]
        rpaths = [_join(target, r.replace(os.sep, "/")) for r in rels]
        if lpaths:
            kw = {} if batch_size is None else {"batch_size": batch_size}
            fs.put(lpaths, rpaths, **kw)
        fs.pipe_file(_join(target, COMPLETE_MARKER), marker)
        if not obj:
            if fs.exists(rpath):
                remove(url, recursive=True, storage_options=storage_options)
            fs.mv(target, rpath, recursive=True)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm_file(_join(target, COMPLETE_MARKER))
        with contextlib.suppress(Exception):
            fs.rm(target, recursive=True)
        raise
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)
    _log_done(f"uploaded directory ({len(rels)} files)", url, total, time.perf_counter() - t0)


def is_complete(url: str, *, storage_options: dict | None = None) -> bool:
    """Does the remote directory ``url`` carry its completion marker?"""
    fs, rpath = filesystem(url, storage_options)
    return fs.exists(_join(rpath, COMPLETE_MARKER))


def list_complete(parent_url: str, prefix: str = "", *, storage_options: dict | None = None) -> list[str]:
    """URLs of the complete checkpoint directories directly under ``parent_url`` whose
    names start with ``prefix`` (e.g. ``"checkpoint-"``), sorted by name. Incomplete
    directories (no marker: an upload in progress, failed or being removed) and temporary
    names are left out."""
    fs, rpath = filesystem(parent_url, storage_options)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)
    out = []
    for m in fs.glob(_join(rpath, f"{prefix}*/{COMPLETE_MARKER}")):
        d = fs._parent(m)
        name = d.rstrip("/").rsplit("/", 1)[-1]
        if not name.startswith(".") and not name.endswith(TMP_SUFFIX):
            out.append(_url(fs, d))
    return sorted(out)


def marker_files(marker: bytes, url: str) -> dict[str, int]:
    """The ``{relative name: size}`` table of a directory's completion marker, validated.

    The marker comes from the store, so it is untrusted: every name must be a relative
    path that stays inside the directory (no absolute names, no ``..``, ``.`` or empty
    components, no NUL) and every size a non-negative integer. Anything else raises
    :class:`CorruptCheckpointError` naming the URL: a download never writes outside its
    target.
    """
    def bad(detail: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(url, COMPLETE_MARKER, detail)

    try:
        doc = json.loads(marker)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad(f"does not parse: {e}") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise bad("has no 'files' table")
    for name, size in files.items():
        parts = name.split("/")
        if (not name or name.startswith("/") or "\\" in name or "\0" in name
                or any(p in ("", ".", "..") for p in parts)):
            raise bad(f"names the file {name!r}, which is not a plain relative path inside the directory")
        if name == COMPLETE_MARKER:
            raise bad(f"lists the marker {name!r} itself")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise bad(f"gives {name!r} the size {size!r}")
    return files


def download_dir(url: str, local_dir: str | os.PathLike | None = None, *,
                 storage_options: dict | None = None) -> str:
    """Download the complete remote directory ``url``; return the local directory.

    Raises FileNotFoundError when ``url`` has no completion marker. ``local_dir``
    defaults to the staging cache, where an unchanged directory (same marker) is reused
    without a download. ``local_dir`` is replaced.
    """
    url = split(url)[1]
    fs, rpath = filesystem(url, storage_options)
    try:
        marker = fs.cat_file(_join(rpath, COMPLETE_MARKER))
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} is not a complete FastPersist checkpoint directory "
                                f"(no {COMPLETE_MARKER}: missing, or its upload never finished)") from None
    files = marker_files(marker, url)
    in_staging = local_dir is None
    if in_staging:
        cache = _cache_dir(url)
        local_dir = os.path.join(cache, _base_name(rpath))
        with contextlib.suppress(OSError), open(os.path.join(local_dir, COMPLETE_MARKER), "rb") as f:
            if f.read() == marker:
                return local_dir
        _drop_dir(cache)
        os.mkdir(cache, 0o700)
    local_dir = os.path.abspath(os.fspath(local_dir))
    with contextlib.suppress(OSError):
        _make_room(sum(files.values()))
    tmp = local_dir.rstrip("/") + f".{commit.writer_tag()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    os.mkdir(tmp, 0o700 if in_staging else 0o777)
    try:
        t0 = time.perf_counter()
        rels = sorted(files)
        for r in rels:
            os.makedirs(os.path.dirname(os.path.join(tmp, r)), exist_ok=True)
        if rels:
            fs.get([_join(rpath, r) for r in rels], [os.path.join(tmp, r) for r in rels])
        for r, n in files.items():
            local = os.path.join(tmp, r)
            if os.path.getsize(local) != n:
                raise OSError(f"download of {url}/{r}: size differs from the marker's {n}")
            if in_staging:
                os.chmod(local, 0o600)
        with open(os.path.join(tmp, COMPLETE_MARKER), "wb") as f:
            f.write(marker)
        if os.path.lexists(local_dir):
            shutil.rmtree(local_dir)
        os.replace(tmp, local_dir)
        _log_done(f"downloaded directory ({len(rels)} files)", url, sum(files.values()), time.perf_counter() - t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return local_dir


__all__ = [
    "STAGING_ENV", "BUDGET_ENV", "COMPLETE_MARKER", "split", "is_remote", "filesystem", "configure",
    "staging_dir", "staging_budget", "clean_staging", "drop_cached", "upload_file", "RemoteSave",
    "fetch", "load", "verify", "exists", "remove", "upload_dir", "is_complete", "list_complete", "download_dir",
]
