/*
 * binding.c -- the CPython module fp_core._native over the engine (fp_engine.h).
 *
 * Only what is about Python lives here: arguments parsed and checked into the
 * engine's structs, the GIL released around the engine's calls, and the engine's
 * results and errnos turned into Python objects and exceptions.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fp_engine.h"

/* ---------------------------- errors ---------------------------- */

static PyObject *raise_errno_path(int e, PyObject *path)
{
    errno = e;
    return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
}

/* OSError(e, msg, path): errno, subclass and filename as PyErr_SetFromErrno gives them,
 * with our own message. */
static PyObject *raise_errno_msg_path(int e, const char *msg, PyObject *path)
{
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "isO", e, msg, path);
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* An engine result other than 0 and FP_EOF: refused arguments are a ValueError with
 * the engine's message, its own memory a MemoryError, an errno an OSError naming path
 * (with the engine's message where it gave one). */
static PyObject *raise_engine(int rc, const char *msg, PyObject *path)
{
    if (rc == FP_EARG) {
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    if (rc == FP_ENOMEM || rc < 0)
        return PyErr_NoMemory();
    if (msg[0])
        return raise_errno_msg_path(rc, msg, path);
    return raise_errno_path(rc, path);
}

/* The error of a write (writing) or of a read into the caller's memory.  EFAULT there
 * is about memory, not the file: zero-copy writes and direct reads hand the caller's
 * own pages to the kernel, and the kernel found them gone (freed or unmapped while the
 * call ran; staging buffers are ours and stay mapped).  "Bad address" next to a file
 * name reads like a problem with the file, so it is said in words. */
static PyObject *raise_io_error(int e, PyObject *path, int writing)
{
    char msg[384];
    if (e == ETIMEDOUT && writing) {
        snprintf(msg, sizeof msg,
                 "ETIMEDOUT: writes submitted to io_uring got no completion for longer than "
                 "FASTPERSIST_URING_STALL_S (default 120 s); nothing was committed, and later writes "
                 "of this engine use a pwrite pool");
        return raise_errno_msg_path(ETIMEDOUT, msg, path);
    }
    if (e != EFAULT)
        return raise_errno_path(e, path);
    if (writing)
        snprintf(msg, sizeof msg,
                 "EFAULT (%s): the source memory of the checkpoint was freed or unmapped while it was "
                 "being written (zero-copy writes read it in the kernel: it must stay alive until write() "
                 "returns)", strerror(EFAULT));
    else
        snprintf(msg, sizeof msg,
                 "EFAULT (%s): the destination memory was freed or unmapped while the file was being "
                 "read into it", strerror(EFAULT));
    return raise_errno_msg_path(EFAULT, msg, path);
}

/* ---------------------------- Engine ---------------------------- */

typedef struct {
    PyObject_HEAD
    fp_engine_t eng; /* eng.fd < 0: closed */
    int busy;
    PyObject *path;
    PyObject *backend_str;
    PyObject *reason;
    int ring_reported; /* 0; 1 or 2 (see ring_stalled) once backend_str says the pool writes */
} EngineObject;

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    EngineObject *self = (EngineObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    fp_engine_init(&self->eng);
    self->path = PyUnicode_FromString("");
    self->backend_str = PyUnicode_FromString("");
    self->reason = PyUnicode_FromString("");
    if (!self->path || !self->backend_str || !self->reason) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void Engine_dealloc(EngineObject *self)
{
    fp_engine_close(&self->eng);
    Py_XDECREF(self->path);
    Py_XDECREF(self->backend_str);
    Py_XDECREF(self->reason);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"path", "backend", "create", "queue_depth", "chunk_bytes",
                             "copy_threads", "io_threads", "tmpfile", "mode", NULL};
    PyObject *path = NULL;
    const char *backend = "auto";
    fp_engine_options_t o;
    fp_engine_options_default(&o);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|$spiLiipi", kwlist, PyUnicode_FSDecoder, &path, &backend,
                                     &o.create, &o.queue_depth, &o.chunk_bytes, &o.copy_threads, &o.io_threads,
                                     &o.tmpfile, &o.mode))
        return -1;
    if (self->busy) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_RuntimeError, "Engine is in use by another thread");
        return -1;
    }
    fp_engine_close(&self->eng);
    Py_XSETREF(self->path, path);
    o.backend = fp_backend_parse(backend);
    if (o.backend < 0) {
        PyErr_Format(PyExc_ValueError, "backend must be 'auto', 'io_uring', 'threadpool' or 'buffered', not '%s'", backend);
        return -1;
    }
    char msg[FP_MSG_MAX];
    if (fp_engine_options_check(&o, msg, sizeof msg)) {
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    PyObject *pbytes = PyUnicode_EncodeFSDefault(path);
    if (!pbytes)
        return -1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fp_engine_open(&self->eng, PyBytes_AS_STRING(pbytes), &o, msg, sizeof msg);
    Py_END_ALLOW_THREADS
    Py_DECREF(pbytes);
    if (rc) {
        raise_engine(rc, msg, path);
        return -1;
    }
    Py_XSETREF(self->backend_str, PyUnicode_FromString(fp_backend_name(self->eng.backend)));
    Py_XSETREF(self->reason, PyUnicode_FromString(self->eng.reason));
    if (!self->backend_str || !self->reason)
        return -1;
    return 0;
}

/* After a ring stopped answering (the stall watchdog), the engine's later writes go through
 * its pwrite pool: say so in `backend`, `backend_reason` and every later write's stats. */
static int sync_backend(EngineObject *self)
{
    if (self->eng.backend != FP_BK_IO_URING || !self->eng.ring.broken || self->ring_reported)
        return 0;
    self->ring_reported = self->eng.ring.stalled_direct ? 2 : 1;
    Py_XSETREF(self->backend_str, PyUnicode_FromString(fp_backend_name(FP_BK_THREADPOOL)));
    Py_XSETREF(self->reason, PyUnicode_FromString("io_uring stopped answering (a write got no completion "
                                                  "within FASTPERSIST_URING_STALL_S): later writes use the pwrite pool"));
    return self->backend_str && self->reason ? 0 : -1;
}

static int engine_check(EngineObject *self)
{
    if (self->eng.fd < 0) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Engine");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is in use by another thread");
        return -1;
    }
    return 0;
}

static int parse_extents(PyObject *obj, fp_extent_t **out, int *nout)
{
    PyObject *seq = PySequence_Fast(obj, "extents must be a sequence of (file_offset, addr, length) tuples");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > INT_MAX / 2) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many extents");
        return -1;
    }
    fp_extent_t *ext = PyMem_Malloc(sizeof(fp_extent_t) * (n ? n : 1));
    if (!ext) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *ts = PySequence_Fast(t, "each extent must be a (file_offset, addr, length) tuple");
        if (!ts)
            goto fail;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(ts);
        if (k != 3 && k != 4) {
            Py_DECREF(ts);
            PyErr_Format(PyExc_ValueError,
                         "extent %zd must have 3 or 4 items (file_offset, addr, length[, known_crc32c])", i);
            goto fail;
        }
        ext[i].off = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ts, 0));
        ext[i].addr = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(ts, 1));
        ext[i].len = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ts, 2));
        ext[i].has_crc = 0;
        ext[i].crc = 0;
        if (k == 4 && PySequence_Fast_GET_ITEM(ts, 3) != Py_None) {
            unsigned long long c = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(ts, 3));
            if (!PyErr_Occurred() && c > 0xFFFFFFFFull)
                PyErr_Format(PyExc_ValueError, "extent %zd: known_crc32c does not fit 32 bits", i);
            ext[i].has_crc = 1;
            ext[i].crc = (uint32_t)c;
        }
        Py_DECREF(ts);
        if (PyErr_Occurred())
            goto fail;
    }
    Py_DECREF(seq);
    *out = ext;
    *nout = (int)n;
    return 0;
fail:
    Py_DECREF(seq);
    PyMem_Free(ext);
    return -1;
}

static PyObject *Engine_write(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"extents", "start", "end", "checksum", "zero_copy", NULL};
    PyObject *ext_obj;
    ll start, end;
    int checksum = 1, zero_copy = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OLL|$pp", kwlist, &ext_obj, &start, &end, &checksum, &zero_copy))
        return NULL;
    if (engine_check(self))
        return NULL;
    /* the range before the extents, so that a bad range is reported as such whatever the extents */
    char msg[FP_MSG_MAX];
    if (fp_write_check_range(&self->eng, start, end, msg, sizeof msg)) {
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    fp_extent_t *ext = NULL;
    int n_ext = 0;
    if (parse_extents(ext_obj, &ext, &n_ext))
        return NULL;
    PyObject *result = NULL;
    uint32_t *crcs = PyMem_Calloc(n_ext ? n_ext : 1, sizeof(uint32_t));
    if (!crcs) {
        PyErr_NoMemory();
        goto out;
    }
    fp_write_stats_t st;
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = fp_engine_write(&self->eng, ext, n_ext, start, end, checksum, zero_copy, crcs, &st, msg, sizeof msg);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (sync_backend(self))
        goto out;
    if (rc > 0) {
        raise_io_error(rc, self->path, 1);
        goto out;
    }
    if (rc) {
        raise_engine(rc, msg, self->path);
        goto out;
    }
    PyObject *lst = PyList_New(n_ext);
    if (!lst)
        goto out;
    for (int i = 0; i < n_ext; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (!v) {
            Py_DECREF(lst);
            goto out;
        }
        PyList_SET_ITEM(lst, i, v);
    }
    PyObject *stats = Py_BuildValue("{s:L,s:L,s:L,s:d,s:d,s:d,s:l,s:l,s:O}", "bytes", st.bytes, "bytes_padded",
                                    st.bytes_padded, "zero_copy_bytes", st.zero_copy_bytes, "seconds", st.seconds,
                                    "copy_seconds", st.copy_seconds, "io_wait_seconds", st.io_wait_seconds,
                                    "requests", st.requests, "short_writes", st.short_writes, "backend",
                                    self->backend_str);
    if (!stats) {
        Py_DECREF(lst);
        goto out;
    }
    result = Py_BuildValue("(NN)", lst, stats);
out:
    PyMem_Free(ext);
    PyMem_Free(crcs);
    return result;
}

static PyObject *Engine_truncate(EngineObject *self, PyObject *arg)
{
    ll size = PyLong_AsLongLong(arg);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    if (engine_check(self))
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "size must be >= 0");
        return NULL;
    }
    int e;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    e = fp_engine_truncate(&self->eng, size);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (e)
        return raise_errno_path(e, self->path);
    Py_RETURN_NONE;
}

static PyObject *Engine_sync(EngineObject *self, PyObject *unused)
{
    if (engine_check(self))
        return NULL;
    int e;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    e = fp_engine_sync(&self->eng);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (e)
        return raise_errno_path(e, self->path);
    Py_RETURN_NONE;
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is in use by another thread");
        return NULL;
    }
    fp_engine_close(&self->eng);
    Py_RETURN_NONE;
}

static PyObject *Engine_fileno(EngineObject *self, PyObject *unused)
{
    if (self->eng.fd < 0) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Engine");
        return NULL;
    }
    return PyLong_FromLong(self->eng.fd);
}

static PyObject *Engine_enter(EngineObject *self, PyObject *unused)
{
    if (self->eng.fd < 0) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Engine");
        return NULL;
    }
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Engine_exit(EngineObject *self, PyObject *args)
{
    return Engine_close(self, NULL);
}

static PyObject *Engine_get_closed(EngineObject *self, void *c) { return PyBool_FromLong(self->eng.fd < 0); }

static PyMethodDef Engine_methods[] = {
    {"write", (PyCFunction)(void (*)(void))Engine_write, METH_VARARGS | METH_KEYWORDS,
     "write(extents, start, end, *, checksum=True, zero_copy=False) -> (crcs, stats)\n\n"
     "Write the file range [start, end) (padded with zeros up to a multiple of alignment).\n"
     "extents: sorted, non-overlapping (file_offset, addr, length[, known_crc32c]) tuples inside\n"
     "[start, end); bytes not covered are zeros.  crcs[i] is the CRC-32C of extent i (0 without\n"
     "checksum); a known_crc32c (not None) is returned as is and not recomputed for bytes written\n"
     "zero-copy.  zero_copy: extents aligned in memory and file are written from their memory.\n"
     "stats['zero_copy_bytes'] counts those bytes.  That memory must stay mapped until write()\n"
     "returns: the kernel reports memory gone under a zero-copy write as OSError(EFAULT) (an\n"
     "extent without known CRC is also read here to checksum it, which would crash instead).\n"
     "Offsets, lengths and the range are checked: off + length past 2**63 - 1 is a ValueError."},
    {"truncate", (PyCFunction)Engine_truncate, METH_O, "truncate(size): ftruncate the file."},
    {"sync", (PyCFunction)Engine_sync, METH_NOARGS, "sync(): fdatasync the file (GIL released)."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "close(): close the ring and the file; idempotent."},
    {"fileno", (PyCFunction)Engine_fileno, METH_NOARGS, "fileno() -> int"},
    {"__enter__", (PyCFunction)Engine_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Engine_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Engine_members[] = {
    {"path", T_OBJECT_EX, offsetof(EngineObject, path), READONLY, "file path"},
    {"backend", T_OBJECT_EX, offsetof(EngineObject, backend_str), READONLY,
     "'io_uring', 'threadpool' or 'buffered'"},
    {"backend_reason", T_OBJECT_EX, offsetof(EngineObject, reason), READONLY,
     "why the first choice of backend was not used ('' when it was)"},
    {"ring_stalled", T_INT, offsetof(EngineObject, ring_reported), READONLY,
     "0; 1 once a write's io_uring requests got no completion within FASTPERSIST_URING_STALL_S "
     "(later writes go through the pwrite pool; a request given up on may still complete into "
     "this file, and past its end: write the checkpoint anew in another file); 2 when one of "
     "them was writing straight from the caller's memory (zero-copy), which it would write "
     "as that memory is by then"},
    {"alignment", T_LONGLONG, offsetof(EngineObject, eng.alignment), READONLY, "O_DIRECT offset/length alignment"},
    {"mem_alignment", T_LONGLONG, offsetof(EngineObject, eng.mem_alignment), READONLY, "staging buffer alignment"},
    {"queue_depth", T_INT, offsetof(EngineObject, eng.queue_depth), READONLY, NULL},
    {"chunk_bytes", T_LONGLONG, offsetof(EngineObject, eng.chunk_bytes), READONLY, "chunk size (rounded up to alignment)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"closed", (getter)Engine_get_closed, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fp_core._native.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Engine(path, *, backend='auto', create=True, queue_depth=16, chunk_bytes=4<<20,\n"
              "       copy_threads=2, io_threads=4, tmpfile=False, mode=0o666)\n\n"
              "Writer of byte ranges of one file through aligned staging buffers with\n"
              "io_uring, a pwrite thread pool (O_DIRECT) or buffered pwrite.\n"
              "create: a new file (O_CREAT | O_EXCL; removed again if the engine cannot start),\n"
              "else an existing one.  tmpfile: path is a directory and the file an unnamed one in\n"
              "it (O_TMPFILE), to be linked into place by linkat(AT_SYMLINK_FOLLOW) of\n"
              "/proc/self/fd/N: os.link(str(N), name, src_dir_fd=<fd of /proc/self/fd>,\n"
              "follow_symlinks=True) (without a dir_fd, CPython calls link(2), which ignores\n"
              "follow_symlinks: EXDEV).  Its errors name the directory (EOPNOTSUPP, EISDIR,\n"
              "EINVAL: not supported there).  mode: permissions of the new file, less the umask.",
    .tp_new = Engine_new,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_members = Engine_members,
    .tp_getset = Engine_getset,
};
/* ---------------------------- Reader ---------------------------- */

typedef struct {
    PyObject_HEAD
    fp_reader_t rd; /* rd.fd < 0: closed */
    int busy;
    char direct; /* rd.direct as a T_BOOL member */
    PyObject *path;
} ReaderObject;

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    ReaderObject *self = (ReaderObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    fp_reader_init(&self->rd);
    self->path = PyUnicode_FromString("");
    if (!self->path) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void Reader_dealloc(ReaderObject *self)
{
    fp_reader_close(&self->rd);
    Py_XDECREF(self->path);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Reader_init(ReaderObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"path", "direct", NULL};
    PyObject *path = NULL;
    int direct = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|$p", kwlist, PyUnicode_FSDecoder, &path, &direct))
        return -1;
    if (self->busy) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_RuntimeError, "Reader is in use by another thread");
        return -1;
    }
    fp_reader_close(&self->rd);
    Py_XSETREF(self->path, path);
    PyObject *pbytes = PyUnicode_EncodeFSDefault(path);
    if (!pbytes)
        return -1;
    int e;
    Py_BEGIN_ALLOW_THREADS
    e = fp_reader_open(&self->rd, PyBytes_AS_STRING(pbytes), direct);
    Py_END_ALLOW_THREADS
    Py_DECREF(pbytes);
    if (e) {
        raise_errno_path(e, path);
        return -1;
    }
    self->direct = (char)self->rd.direct;
    return 0;
}

/* 0, or -1 with an exception set when the reader is closed or in use by another thread */
static int reader_unusable(ReaderObject *self)
{
    if (self->rd.fd >= 0 && !self->busy)
        return 0;
    PyErr_SetString(self->rd.fd < 0 ? PyExc_ValueError : PyExc_RuntimeError,
                    self->rd.fd < 0 ? "I/O operation on closed Reader" : "Reader is in use by another thread");
    return -1;
}

/* seq_in as a fast sequence of at most INT_MAX / 2 items (*n), with *out a PyMem array of
 * *n items of item_size bytes for the caller to fill; NULL with an exception set */
static PyObject *fast_sequence(PyObject *seq_in, const char *type_msg, const char *what, size_t item_size,
                               Py_ssize_t *n, void **out)
{
    PyObject *seq = PySequence_Fast(seq_in, type_msg);
    if (!seq)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    if (*n > INT_MAX / 2) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "too many %s", what);
        return NULL;
    }
    *out = PyMem_Malloc((size_t)(*n ? *n : 1) * item_size);
    if (!*out) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    return seq;
}

/* ranges: a sequence of (offset, length) pairs -> a malloc'ed array of 2n ll, or NULL
 * with an exception set */
static ll *parse_ranges(PyObject *seq_in, int *n_out)
{
    Py_ssize_t n;
    ll *out;
    PyObject *seq = fast_sequence(seq_in, "ranges must be a sequence of (offset, length) pairs", "ranges",
                                  2 * sizeof(ll), &n, (void **)&out);
    if (!seq)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_Format(PyExc_TypeError, "range %zd must be an (offset, length) tuple", i);
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
        if (!PyArg_ParseTuple(item, "LL;each range must be an (offset, length) pair of ints", &out[2 * i],
                              &out[2 * i + 1])) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    *n_out = (int)n;
    return out;
}

static PyObject *Reader_read_into(ReaderObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"file_offset", "addr", "length", "checksum", "threads", "chunk_bytes", "ranges", NULL};
    ll off, len;
    unsigned long long addr;
    PyObject *ranges_obj = Py_None;
    fp_read_options_t o;
    fp_read_options_default(&o);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LKL|$piLO", kwlist, &off, &addr, &len, &o.checksum, &o.threads,
                                     &o.chunk_bytes, &ranges_obj))
        return NULL;
    ll *ranges = NULL;
    uint32_t *range_crcs = NULL;
    /* parsed before the busy check: parsing may run Python code (and let another thread in) */
    if (ranges_obj != Py_None) {
        ranges = parse_ranges(ranges_obj, &o.n_ranges);
        if (!ranges)
            return NULL;
        range_crcs = PyMem_Calloc((size_t)(o.n_ranges ? o.n_ranges : 1), sizeof(uint32_t));
        if (!range_crcs) {
            PyMem_Free(ranges);
            return PyErr_NoMemory();
        }
        o.ranges = ranges;
        o.range_crcs = range_crcs;
    }
    if (reader_unusable(self)) {
        PyMem_Free(ranges);
        PyMem_Free(range_crcs);
        return NULL;
    }
    char msg[FP_MSG_MAX];
    uint32_t crc;
    ll fsize;
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = fp_reader_read(&self->rd, off, addr, len, &o, &crc, &fsize, msg, sizeof msg);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyObject *result = NULL;
    if (rc == FP_EOF)
        PyErr_Format(PyExc_EOFError, "%R: read of %lld bytes at offset %lld reaches past end of file (size %lld)",
                     self->path, len, off, fsize);
    else if (rc > 0)
        raise_io_error(rc, self->path, 0);
    else if (rc)
        raise_engine(rc, msg, self->path);
    else if (!ranges)
        result = PyLong_FromUnsignedLong(crc);
    else {
        PyObject *lst = PyList_New(o.n_ranges);
        for (int i = 0; lst && i < o.n_ranges; i++) {
            PyObject *v = PyLong_FromUnsignedLong(range_crcs[i]);
            if (!v) {
                Py_CLEAR(lst);
                break;
            }
            PyList_SET_ITEM(lst, i, v);
        }
        if (lst)
            result = Py_BuildValue("(kN)", (unsigned long)crc, lst);
    }
    PyMem_Free(ranges);
    PyMem_Free(range_crcs);
    return result;
}

/* pieces: a sequence of (file_offset, addr, length) -> a PyMem array, or NULL with an
 * exception set */
static fp_piece_t *parse_pieces(PyObject *seq_in, int *n_out)
{
    Py_ssize_t n;
    fp_piece_t *out;
    PyObject *seq = fast_sequence(seq_in, "pieces must be a sequence of (file_offset, addr, length) tuples",
                                  "pieces", sizeof(fp_piece_t), &n, (void **)&out);
    if (!seq)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        unsigned long long addr;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_Format(PyExc_TypeError, "piece %zd must be a (file_offset, addr, length) tuple", i);
            goto fail;
        }
        if (!PyArg_ParseTuple(item, "LKL;each piece must be a (file_offset, addr, length) tuple of ints",
                              &out[i].off, &addr, &out[i].len))
            goto fail;
        out[i].addr = addr;
    }
    Py_DECREF(seq);
    *n_out = (int)n;
    return out;
fail:
    PyMem_Free(out);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Reader_read_scatter(ReaderObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"pieces", "checksum", "threads", "chunk_bytes", "gap", NULL};
    PyObject *pieces_obj;
    ll gap = 256 * 1024;
    fp_read_options_t o;
    fp_read_options_default(&o);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$piLL", kwlist, &pieces_obj, &o.checksum, &o.threads,
                                     &o.chunk_bytes, &gap))
        return NULL;
    int n = 0;
    /* parsed before the busy check: parsing may run Python code (and let another thread in) */
    fp_piece_t *pieces = parse_pieces(pieces_obj, &n);
    if (!pieces)
        return NULL;
    uint32_t *crcs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint32_t));
    if (!crcs) {
        PyMem_Free(pieces);
        return PyErr_NoMemory();
    }
    if (reader_unusable(self)) {
        PyMem_Free(pieces);
        PyMem_Free(crcs);
        return NULL;
    }
    char msg[FP_MSG_MAX];
    ll fsize;
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = fp_reader_scatter(&self->rd, pieces, n, &o, gap, crcs, &fsize, msg, sizeof msg);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyObject *result = NULL;
    if (rc == FP_EOF)
        PyErr_Format(PyExc_EOFError, "%R: a scatter read reaches past end of file (size %lld)", self->path, fsize);
    else if (rc > 0)
        raise_io_error(rc, self->path, 0);
    else if (rc)
        raise_engine(rc, msg, self->path);
    else {
        result = PyList_New(n);
        for (int i = 0; result && i < n; i++) {
            PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
            if (!v) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, i, v);
        }
    }
    PyMem_Free(pieces);
    PyMem_Free(crcs);
    return result;
}

static PyObject *Reader_close(ReaderObject *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Reader is in use by another thread");
        return NULL;
    }
    fp_reader_close(&self->rd);
    Py_RETURN_NONE;
}

static PyObject *Reader_fileno(ReaderObject *self, PyObject *unused)
{
    if (self->rd.fd < 0) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Reader");
        return NULL;
    }
    return PyLong_FromLong(self->rd.fd);
}

static PyObject *Reader_enter(ReaderObject *self, PyObject *unused)
{
    if (self->rd.fd < 0) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Reader");
        return NULL;
    }
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Reader_exit(ReaderObject *self, PyObject *args) { return Reader_close(self, NULL); }

static PyObject *Reader_get_closed(ReaderObject *self, void *c) { return PyBool_FromLong(self->rd.fd < 0); }

static PyMethodDef Reader_methods[] = {
    {"read_into", (PyCFunction)(void (*)(void))Reader_read_into, METH_VARARGS | METH_KEYWORDS,
     "read_into(file_offset, addr, length, *, checksum=False, threads=2, chunk_bytes=4<<20, ranges=None) -> crc\n\n"
     "Read [file_offset, file_offset+length) into memory at addr (any alignment).\n"
     "Returns the CRC-32C of the bytes read when checksum, else 0.  EOFError past the end;\n"
     "ValueError when file_offset + length overflows a file offset; OSError(EFAULT) when the\n"
     "destination is unmapped under a read the kernel makes into it.\n"
     "ranges: (offset, length) pairs inside the read, sorted and disjoint; then the result\n"
     "is (crc, [CRC-32C of each range]), each computed on the read threads as its bytes land."},
    {"read_scatter", (PyCFunction)(void (*)(void))Reader_read_scatter, METH_VARARGS | METH_KEYWORDS,
     "read_scatter(pieces, *, checksum=False, threads=2, chunk_bytes=4<<20, gap=256<<10) -> [crc]\n\n"
     "Read each (file_offset, addr, length) piece (sorted by file_offset, each at most chunk_bytes)\n"
     "into memory at addr.  Pieces at most gap bytes apart are read together, one request of up\n"
     "to a chunk through a staging buffer, and copied out: thousands of small tensors cost a few\n"
     "requests, not one each.  Returns each piece's CRC-32C (0s without checksum).  EOFError\n"
     "when a piece reaches past the end; OSError(EFAULT) when a destination is unmapped."},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "close(); idempotent"},
    {"fileno", (PyCFunction)Reader_fileno, METH_NOARGS, NULL},
    {"__enter__", (PyCFunction)Reader_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Reader_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Reader_members[] = {
    {"path", T_OBJECT_EX, offsetof(ReaderObject, path), READONLY, NULL},
    {"size", T_LONGLONG, offsetof(ReaderObject, rd.size), READONLY, "file size at open"},
    {"direct", T_BOOL, offsetof(ReaderObject, direct), READONLY, "whether O_DIRECT is in use"},
    {"alignment", T_LONGLONG, offsetof(ReaderObject, rd.alignment), READONLY, NULL},
    {"mem_alignment", T_LONGLONG, offsetof(ReaderObject, rd.mem_alignment), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Reader_getset[] = {
    {"closed", (getter)Reader_get_closed, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fp_core._native.Reader",
    .tp_basicsize = sizeof(ReaderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(path, *, direct=True): parallel reads into memory at any address.",
    .tp_new = Reader_new,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_members = Reader_members,
    .tp_getset = Reader_getset,
};

/* ---------------------------- module functions ---------------------------- */

static PyObject *mod_crc32c(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"data", "crc", NULL};
    Py_buffer view;
    unsigned long crc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|k", kwlist, &view, &crc))
        return NULL;
    uint32_t r;
    if (view.len >= (1 << 20)) {
        Py_BEGIN_ALLOW_THREADS
        r = fp_crc32c((uint32_t)crc, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        r = fp_crc32c((uint32_t)crc, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *mod_crc32c_addr(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"addr", "length", "crc", NULL};
    unsigned long long addr;
    ll len;
    unsigned long crc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KL|k", kwlist, &addr, &len, &crc))
        return NULL;
    if (len < 0 || (len > 0 && addr == 0) || !fp_addr_range_ok(addr, len)) {
        PyErr_SetString(PyExc_ValueError, "invalid address or length");
        return NULL;
    }
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = fp_crc32c((uint32_t)crc, (const void *)(uintptr_t)addr, (size_t)len);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(r);
}

static PyObject *mod_copy_crc32c(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dst", "src", "length", "checksum", NULL};
    unsigned long long dst, src;
    ll len;
    int checksum = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKL|$p", kwlist, &dst, &src, &len, &checksum))
        return NULL;
    if (len < 0 || (len > 0 && (dst == 0 || src == 0)) || !fp_addr_range_ok(dst, len) ||
        !fp_addr_range_ok(src, len)) {
        PyErr_SetString(PyExc_ValueError, "invalid address or length");
        return NULL;
    }
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = fp_copy_crc((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)len, 0, checksum);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(r);
}

static PyObject *mod_crc32c_combine(PyObject *m, PyObject *args)
{
    unsigned long c1, c2;
    ll len2;
    if (!PyArg_ParseTuple(args, "kkL", &c1, &c2, &len2))
        return NULL;
    if (len2 < 0) {
        PyErr_SetString(PyExc_ValueError, "len2 must be >= 0");
        return NULL;
    }
    return PyLong_FromUnsignedLong(fp_crc32c_combine((uint32_t)c1, (uint32_t)c2, (uint64_t)len2));
}

static PyObject *mod_advise_huge(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"addr", "length", "collapse", NULL};
    unsigned long long addr, n;
    int collapse = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|$p", kwlist, &addr, &n, &collapse))
        return NULL;
    uint64_t covered;
    Py_BEGIN_ALLOW_THREADS
    covered = fp_advise_huge(addr, n, collapse);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(covered);
}

static PyObject *mod_crc32c_impl(PyObject *m, PyObject *args)
{
    const char *want = NULL;
    if (!PyArg_ParseTuple(args, "|z", &want))
        return NULL;
    return PyUnicode_FromString(fp_crc32c_impl(want));
}

static PyObject *mod_populate(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"addr", "length", "write", NULL};
    unsigned long long addr, n;
    int write = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|$p", kwlist, &addr, &n, &write))
        return NULL;
    char msg[FP_MSG_MAX];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fp_populate(addr, n, write, msg, sizeof msg);
    Py_END_ALLOW_THREADS
    if (rc == FP_EARG) {
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    if (rc) { /* ENOMEM, EFAULT, EINVAL (not writable) */
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *mod_release_staging(PyObject *m, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    fp_pool_release();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *mod_staging_bytes(PyObject *m, PyObject *unused)
{
    return PyLong_FromSize_t(fp_pool_bytes());
}

static PyObject *mod_inject_fault(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"kind", "errno", "after_bytes", NULL};
    PyObject *kind;
    PyObject *err_obj = Py_None;
    ll after = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OL", kwlist, &kind, &err_obj, &after))
        return NULL;
    const char *k = NULL;
    if (kind != Py_None) {
        k = PyUnicode_AsUTF8(kind);
        if (!k)
            return NULL;
    }
    int e = 0; /* the kind's default */
    if (err_obj != Py_None) {
        e = (int)PyLong_AsLong(err_obj);
        if (e == -1 && PyErr_Occurred())
            return NULL;
        if (e <= 0) {
            PyErr_SetString(PyExc_ValueError, "errno must be > 0");
            return NULL;
        }
    }
    if (fp_inject_fault(k, e, after)) {
        PyErr_Format(PyExc_ValueError,
                     "unknown fault kind %R (expected 'write', 'short_write', 'io_uring_setup', 'o_direct', 'read', 'rename', 'kill_before_rename' or None)",
                     kind);
        return NULL;
    }
    Py_RETURN_NONE;
}


/* link_replace(fd, tmp, final): give the unnamed file open as fd (O_TMPFILE) the name final.
 * First linkat() straight to final: a new name needs no temporary name at all.  When final
 * exists (EEXIST) the file is linked as tmp and renamed over final with no Python in between,
 * so a process killed between the two leaves the whole file under tmp only for the few
 * microseconds of one system call.  OSError names the path that failed. */
static PyObject *mod_link_replace(PyObject *m, PyObject *args)
{
    int fd;
    PyObject *tmp_b = NULL, *final_b = NULL;
    if (!PyArg_ParseTuple(args, "iO&O&", &fd, PyUnicode_FSConverter, &tmp_b, PyUnicode_FSConverter, &final_b)) {
        Py_XDECREF(tmp_b);
        return NULL;
    }
    char src[64];
    snprintf(src, sizeof src, "/proc/self/fd/%d", fd);
    const char *tmp = PyBytes_AS_STRING(tmp_b), *final = PyBytes_AS_STRING(final_b);
    int rc, err = 0, direct = 0, fault = 0;
    PyObject *failed = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = linkat(AT_FDCWD, src, AT_FDCWD, final, AT_SYMLINK_FOLLOW);
    if (rc == 0) {
        direct = 1;
    } else if (errno != EEXIST) {
        err = errno;
    } else if (linkat(AT_FDCWD, src, AT_FDCWD, tmp, AT_SYMLINK_FOLLOW) != 0) {
        err = errno;
        rc = 1;
    } else if ((fault = fp_fault_rename()) < 0) {
        raise(SIGKILL);
    } else if (fault > 0 || renameat(AT_FDCWD, tmp, AT_FDCWD, final) != 0) {
        err = fault > 0 ? fault : errno;
        rc = 2;
        unlinkat(AT_FDCWD, tmp, 0);
    } else {
        rc = 0;
    }
    Py_END_ALLOW_THREADS
    if (err) {
        failed = rc == 1 ? tmp_b : final_b;
        PyObject *name = PyUnicode_DecodeFSDefault(PyBytes_AS_STRING(failed));
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
        Py_XDECREF(name);
        Py_DECREF(tmp_b);
        Py_DECREF(final_b);
        return NULL;
    }
    Py_DECREF(tmp_b);
    Py_DECREF(final_b);
    return PyBool_FromLong(direct);
}

static PyMethodDef module_methods[] = {
    {"link_replace", (PyCFunction)mod_link_replace, METH_VARARGS,
     "link_replace(fd, tmp, final) -> bool: name the unnamed file open as fd (O_TMPFILE) final:\n"
     "linked straight to final when that name is free (True), else linked as tmp and renamed over\n"
     "final in one call, no Python in between (False). OSError names the path that failed\n"
     "(tmp is removed when the rename fails)."},
    {"crc32c", (PyCFunction)(void (*)(void))mod_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, crc=0) -> int: CRC-32C (Castagnoli) of a buffer, continuing crc."},
    {"crc32c_addr", (PyCFunction)(void (*)(void))mod_crc32c_addr, METH_VARARGS | METH_KEYWORDS,
     "crc32c_addr(addr, length, crc=0) -> int: CRC-32C of raw memory (GIL released)."},
    {"copy_crc32c", (PyCFunction)(void (*)(void))mod_copy_crc32c, METH_VARARGS | METH_KEYWORDS,
     "copy_crc32c(dst, src, length, *, checksum=True) -> int: copy raw memory (streaming stores)\n"
     "and return the CRC-32C of the bytes, in one pass (GIL released; 0 and a copy alone without\n"
     "checksum). The ranges must not overlap."},
    {"crc32c_combine", (PyCFunction)mod_crc32c_combine, METH_VARARGS,
     "crc32c_combine(crc1, crc2, len2) -> int: CRC-32C of A||B from crc(A), crc(B) and len(B)."},
    {"advise_huge", (PyCFunction)(void (*)(void))mod_advise_huge, METH_VARARGS | METH_KEYWORDS,
     "advise_huge(addr, length, *, collapse=False) -> int: transparent huge pages under the\n"
     "2 MiB-aligned interior of raw memory (MADV_HUGEPAGE; with collapse, MADV_COLLAPSE too,\n"
     "GIL released). Returns the bytes covered, 0 where the kernel refused."},
    {"crc32c_impl", (PyCFunction)mod_crc32c_impl, METH_VARARGS,
     "crc32c_impl(want=None) -> str: the CRC-32C implementation in use ('software', 'sse4.2',\n"
     "'vpclmulqdq'); a name this CPU supports, or 'best', switches the process to it (tests and\n"
     "side-by-side measurements only: switch while no checksum runs)."},
    {"populate", (PyCFunction)(void (*)(void))mod_populate, METH_VARARGS | METH_KEYWORDS,
     "populate(addr, length, *, write=True) -> int: fault every page of the range in for writing on\n"
     "this thread (MADV_POPULATE_WRITE, else a touch per page; contents unchanged, GIL released).\n"
     "write=False: for reading (MADV_POPULATE_READ: a file mapping's pages read in, a private one's\n"
     "not copied); OSError EINVAL where the kernel lacks it, EFAULT past a mapped file's end."},
    {"release_staging", (PyCFunction)mod_release_staging, METH_NOARGS,
     "release_staging(): free the process-wide staging-buffer pool (buffers in use are freed when returned)."},
    {"staging_bytes", (PyCFunction)mod_staging_bytes, METH_NOARGS,
     "staging_bytes() -> int: bytes held by the process-wide staging pool."},
    {"inject_fault", (PyCFunction)(void (*)(void))mod_inject_fault, METH_VARARGS | METH_KEYWORDS,
     "inject_fault(kind, *, errno=5, after_bytes=0)  -- PROCESS-WIDE TEST HOOK, not for production.\n\n"
     "kind: 'write' (one-shot: the first write request reaching past after_bytes fails with errno),\n"
     "'short_write' (every write request's first attempt writes only half; stays armed),\n"
     "'io_uring_setup' (io_uring_setup fails with errno), 'o_direct' (enabling O_DIRECT fails with\n"
     "errno, default EINVAL), 'read' (one-shot: first read reaching past after_bytes fails),\n"
     "'rename' (one-shot: link_replace's rename over an existing name fails with errno),\n"
     "'kill_before_rename' (one-shot: link_replace dies by SIGKILL between its link and its\n"
     "rename), or None to clear every fault."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "fp_core._native",
    "FastPersist native I/O engine: io_uring / pwrite-pool writes through aligned staging buffers,\n"
    "fused CRC-32C, parallel reads.",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&ReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(&ReaderType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "HAVE_SSE42", fp_have_sse42());
    return m;
}
