/*
 * engine.c -- the writer's file: open it (named, created or an unnamed O_TMPFILE),
 * turn on O_DIRECT, choose the backend (io_uring, else a pwrite pool, else buffered
 * pwrite) and the alignment; truncate, sync, close.  The writes themselves are
 * write_job.c's.
 */
#define _GNU_SOURCE
#include "fp_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

static const char *backend_names[] = {"io_uring", "threadpool", "buffered", "auto"};

const char *fp_backend_name(int backend)
{
    return backend >= 0 && backend <= FP_BK_AUTO ? backend_names[backend] : "?";
}

int fp_backend_parse(const char *name)
{
    for (int b = 0; b <= FP_BK_AUTO; b++)
        if (!strcmp(name, backend_names[b]))
            return b;
    return -1;
}

void fp_engine_options_default(fp_engine_options_t *o)
{
    o->backend = FP_BK_AUTO;
    o->create = 1;
    o->tmpfile = 0;
    o->mode = 0666;
    o->queue_depth = 16;
    o->copy_threads = 2;
    o->io_threads = 4;
    o->chunk_bytes = 4 << 20;
}

int fp_engine_options_check(const fp_engine_options_t *o, char *msg, size_t cap)
{
    if (o->backend < 0 || o->backend > FP_BK_AUTO)
        snprintf(msg, cap, "backend must be 'auto', 'io_uring', 'threadpool' or 'buffered', not %d", o->backend);
    else if (o->queue_depth < 1 || o->queue_depth > 4096)
        snprintf(msg, cap, "queue_depth must be in [1, 4096], got %d", o->queue_depth);
    else if (o->chunk_bytes < 4096 || o->chunk_bytes > (1LL << 30))
        snprintf(msg, cap, "chunk_bytes must be in [4096, 1 GiB], got %lld", o->chunk_bytes);
    else if (o->copy_threads < 1 || o->copy_threads > 64)
        snprintf(msg, cap, "copy_threads must be in [1, 64], got %d", o->copy_threads);
    else if (o->io_threads < 1 || o->io_threads > 256)
        snprintf(msg, cap, "io_threads must be in [1, 256], got %d", o->io_threads);
    else if (o->mode < 0 || o->mode > 07777) /* in octal as Python writes it: 0o10000, -0o1 */
        snprintf(msg, cap, "mode must be in [0, 0o7777], got %s0o%o", o->mode < 0 ? "-" : "",
                 o->mode < 0 ? 0u - (unsigned)o->mode : (unsigned)o->mode);
    else if (o->tmpfile && !o->create)
        snprintf(msg, cap, "tmpfile=True creates a new unnamed file: create=False does not apply");
    else
        return 0;
    return FP_EARG;
}

static ll read_sysfs_ll(const char *path)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    ll v = 0;
    if (fscanf(f, "%lld", &v) != 1)
        v = 0;
    fclose(f);
    return v;
}

/* statx(STATX_DIOALIGN), else the device's logical block size (partition, then its
 * parent), else 4096; at least 512.  mem_align = max(4096, stx_dio_mem_align). */
void fp_detect_alignment(int fd, ll *align, ll *mem_align)
{
    ll a = 0, m = 0;
    struct statx stx;
    memset(&stx, 0, sizeof(stx));
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
        (stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_offset_align) {
        a = stx.stx_dio_offset_align;
        m = stx.stx_dio_mem_align;
    }
    if (a == 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && major(st.st_dev) != 0) {
            char p[128];
            snprintf(p, sizeof p, "/sys/dev/block/%u:%u/queue/logical_block_size",
                     major(st.st_dev), minor(st.st_dev));
            a = read_sysfs_ll(p);
            if (a <= 0) {
                snprintf(p, sizeof p, "/sys/dev/block/%u:%u/../queue/logical_block_size",
                         major(st.st_dev), minor(st.st_dev));
                a = read_sysfs_ll(p);
            }
        }
    }
    if (a <= 0)
        a = 4096;
    if (a < 512)
        a = 512;
    if (m < 4096)
        m = 4096;
    *align = a;
    *mem_align = m;
}

/* Turn on O_DIRECT for an open fd (fs without direct I/O answer EINVAL).
 * Doing it with fcntl instead of open(O_DIRECT) means a failed attempt never
 * leaves a just-created file behind. */
static int enable_odirect(int fd)
{
    int e = fp_fault_o_direct();
    if (e)
        return e;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return errno;
    if (fcntl(fd, F_SETFL, fl | O_DIRECT) < 0)
        return errno;
    fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return errno;
    return (fl & O_DIRECT) ? 0 : EINVAL;
}

static const char *errname(int e)
{
    const char *n = strerrorname_np(e);
    return n ? n : "?";
}

void fp_engine_init(fp_engine_t *e)
{
    memset(e, 0, sizeof *e);
    e->fd = -1;
    e->efd = -1;
    fp_ring_init(&e->ring);
}

void fp_engine_close(fp_engine_t *e)
{
    if (e->ring.fd >= 0 || e->ring.sq_ptr)
        fp_ring_close(&e->ring);
    if (e->efd >= 0) {
        close(e->efd);
        e->efd = -1;
    }
    if (e->fd >= 0) {
        close(e->fd);
        e->fd = -1;
    }
}

/* An io_uring and the eventfd its owner loop waits on besides the ring: 0 or errno. */
static int open_ring(fp_ring_t *ring, int *efd, unsigned entries)
{
    int e = fp_fault_io_uring_setup();
    if (!e)
        e = fp_ring_setup(ring, entries);
    if (e)
        return e;
    *efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (*efd < 0) {
        e = errno;
        fp_ring_close(ring);
    }
    return e;
}

int fp_engine_open(fp_engine_t *eng, const char *path, const fp_engine_options_t *o, char *msg, size_t cap)
{
    msg[0] = 0;
    fp_engine_close(eng);
    int e = fp_engine_options_check(o, msg, cap);
    if (e)
        return e;
    /* tmpfile: path is a directory and the file an unnamed inode in it, linked into place
     * by the caller (linkat of /proc/self/fd/N) once complete; a crash before leaves
     * nothing behind.  Not O_EXCL: that would forbid the link.  Kernels or file systems
     * without it answer EISDIR (old kernels: O_TMPFILE contains O_DIRECTORY), EOPNOTSUPP
     * or EINVAL, which the caller takes as "use a named file". */
    int flags = o->tmpfile ? O_TMPFILE | O_WRONLY | O_CLOEXEC
                           : O_WRONLY | O_CLOEXEC | (o->create ? O_CREAT | O_EXCL : 0);
    int fd = open(path, flags, (mode_t)o->mode);
    if (fd < 0)
        return errno;
    char reason[FP_MSG_MAX] = "";
    int want = o->backend, bk = FP_BK_BUFFERED;
    if (want != FP_BK_BUFFERED) {
        e = enable_odirect(fd);
        if (e && !(want == FP_BK_AUTO && e == EINVAL)) {
            snprintf(msg, cap, "O_DIRECT refused by this file system: %s (%s); use backend='auto' or "
                     "'buffered' here", strerror(e), errname(e));
            goto fail;
        }
        if (e) {
            snprintf(reason, sizeof reason,
                     "O_DIRECT not supported on this file system: %s (%s); using buffered pwrite from a pthread pool",
                     strerror(e), errname(e));
            e = 0;
        } else {
            bk = want == FP_BK_THREADPOOL ? FP_BK_THREADPOOL : FP_BK_IO_URING;
        }
    }
    fp_ring_t ring;
    int efd = -1;
    fp_ring_init(&ring);
    if (bk == FP_BK_IO_URING) {
        e = open_ring(&ring, &efd, (unsigned)o->queue_depth + 1);
        if (e && want != FP_BK_AUTO) {
            snprintf(msg, cap, "io_uring unavailable: io_uring_setup failed: %s (%s)", strerror(e), errname(e));
            goto fail;
        }
        if (e) {
            bk = FP_BK_THREADPOOL;
            snprintf(reason, sizeof reason, "io_uring_setup failed: %s (%s); using a pthread pool of pwrite",
                     strerror(e), errname(e));
            e = 0;
        }
    }
    fp_detect_alignment(fd, &eng->alignment, &eng->mem_alignment);
    {
        /* Writes cover whole filesystem blocks, not only whole device blocks: a direct
         * write of part of a block (the end of a file of 6 KiB on 4 KiB blocks) is
         * "unaligned" to ext4, which takes it out of io_uring's inline path (an io-wq
         * worker, with the inode lock) and zeroes the rest of the block. A write
         * engine's range end is padded and the file truncated to its size anyway. */
        struct stat st;
        if (fstat(fd, &st) == 0 && st.st_blksize > eng->alignment && st.st_blksize <= (1 << 16) &&
            (st.st_blksize & (st.st_blksize - 1)) == 0)
            eng->alignment = st.st_blksize;
    }
    eng->fd = fd;
    eng->backend = bk;
    eng->queue_depth = o->queue_depth;
    eng->chunk_bytes = fp_align_up(o->chunk_bytes, eng->alignment);
    eng->copy_threads = o->copy_threads;
    eng->io_threads = o->io_threads;
    memcpy(eng->reason, reason, sizeof reason);
    eng->ring = ring;
    eng->efd = efd;
    return 0;
fail:
    close(fd);
    if (o->create && !o->tmpfile)
        unlink(path); /* we created it with O_EXCL; an unnamed file goes with its fd */
    return e;
}

int fp_engine_truncate(fp_engine_t *e, ll size)
{
    return ftruncate(e->fd, size) < 0 ? errno : 0;
}

int fp_engine_sync(fp_engine_t *e)
{
    return fdatasync(e->fd) < 0 ? errno : 0;
}
