/*
 * read_job.c -- the reader: reads of a file range into memory at any address, split
 * into chunks over a few threads.  With O_DIRECT, chunks go straight into the caller's
 * memory where it is aligned like the file, else through a staging buffer; the CRC of
 * each chunk is combined into the range's at the end.
 */
#define _GNU_SOURCE
#include "fp_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define READ_INLINE_MAX (256 * 1024)
#define BUFFERED_READ_PIECE (256 * 1024)

typedef struct {
    int fd, direct, checksum;
    ll align, mem_align, chunk;
    ll off, len, base, aend;
    char *dst;
    int nchunks, next;
    uint32_t *crcs;
    /* checksummed ranges cut at chunk boundaries: piece i is [pstart[i], pstart[i] +
     * plen[i]) of range prange[i]; chunk k owns pieces [pfirst[k], pfirst[k + 1]) */
    ll *pstart, *plen;
    int *prange, *pfirst;
    uint32_t *pcrc;
    int err; /* errno, or FP_EOF */
    pthread_mutex_t mu;
} rjob_t;

/* pread until [0, need) of the chunk is there; returns 0, errno or FP_EOF */
static int pread_full(int fd, int direct, ll align, char *buf, ll file_off, ll need, ll cap)
{
    ll got = 0;
    while (got < need) {
        ll pos = direct ? fp_align_down(got, align) : got;
        ll want = cap - pos;
        int fe = fp_fault_read(file_off + pos, want);
        if (fe)
            return fe;
        ssize_t r = pread(fd, buf + pos, (size_t)want, file_off + pos);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return errno;
        }
        if (r == 0 || pos + r <= got)
            return FP_EOF;
        got = pos + r;
    }
    return 0;
}

/* The next item of a work queue shared by threads (*next of n, under mu): its index, or
 * -1 when none is left or a thread has failed (*err). */
static int take_item(pthread_mutex_t *mu, const int *err, int *next, int n)
{
    pthread_mutex_lock(mu);
    int k = (*err || *next >= n) ? -1 : (*next)++;
    pthread_mutex_unlock(mu);
    return k;
}

/* The first failure of the threads wins. */
static void record_error(pthread_mutex_t *mu, int *err, int e)
{
    pthread_mutex_lock(mu);
    if (!*err)
        *err = e;
    pthread_mutex_unlock(mu);
}

/* fn(arg) on this thread and nthr - 1 more (fewer when a spawn fails: fn takes work
 * from a shared queue, so any number of threads finishes it); returns when all are done. */
static void run_on_threads(void *(*fn)(void *), void *arg, int nthr)
{
    pthread_t t[64];
    int n = 0;
    for (int i = 1; i < nthr && i < 64; i++) {
        if (fp_spawn(&t[n], fn, arg) != 0)
            break;
        n++;
    }
    fn(arg);
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
}

static void *read_main(void *arg)
{
    rjob_t *rj = arg;
    fp_sbuf_t buf = {NULL, 0, 0, 0};
    for (;;) {
        int k = take_item(&rj->mu, &rj->err, &rj->next, rj->nchunks);
        if (k < 0)
            break;
        ll cs = rj->base + (ll)k * rj->chunk;
        ll ce = cs + rj->chunk < rj->aend ? cs + rj->chunk : rj->aend;
        ll ws = rj->off > cs ? rj->off : cs;
        ll we = rj->off + rj->len < ce ? rj->off + rj->len : ce;
        int err = 0;
        /* where chunk k's start lands in the caller's memory; an address (not a pointer)
         * since it may lie before the destination when the chunk starts before off */
        uintptr_t chunk_addr = (uintptr_t)rj->dst + (uintptr_t)(cs - rj->off);
        if (rj->direct && ws == cs && we == ce && (chunk_addr % (uintptr_t)rj->mem_align) == 0) {
            /* the caller's memory is aligned like the file here: no staging copy */
            char *dst_chunk = rj->dst + (cs - rj->off);
            err = pread_full(rj->fd, rj->direct, rj->align, dst_chunk, cs, ce - cs, ce - cs);
            if (!err && rj->checksum)
                rj->crcs[k] = fp_crc32c(0, dst_chunk, (size_t)(ce - cs));
        } else if (rj->direct) {
            if (!buf.p) {
                ll span = rj->aend - rj->base;
                ll sz = span < rj->chunk ? span : rj->chunk;
                err = fp_pool_get(&buf, (size_t)sz, (size_t)rj->mem_align);
            }
            if (!err)
                err = pread_full(rj->fd, rj->direct, rj->align, buf.p, cs, we - cs, ce - cs);
            if (!err)
                rj->crcs[k] = fp_copy_crc_cached(rj->dst + (ws - rj->off), (char *)buf.p + (ws - cs),
                                       (size_t)(we - ws), 0, rj->checksum);
        } else {
            uint32_t c = 0;
            for (ll p = ws; p < we && !err; p += BUFFERED_READ_PIECE) {
                ll n = we - p < BUFFERED_READ_PIECE ? we - p : BUFFERED_READ_PIECE;
                char *d = rj->dst + (p - rj->off);
                err = pread_full(rj->fd, rj->direct, rj->align, d, p, n, n);
                if (!err && rj->checksum)
                    c = fp_crc32c(c, d, (size_t)n);
            }
            rj->crcs[k] = c;
        }
        if (!err && rj->pfirst) {
            for (int i = rj->pfirst[k]; i < rj->pfirst[k + 1]; i++)
                rj->pcrc[i] = fp_crc32c(0, rj->dst + (rj->pstart[i] - rj->off), (size_t)rj->plen[i]);
        }
        if (err) {
            record_error(&rj->mu, &rj->err, err);
            break;
        }
    }
    fp_pool_put(&buf);
    return NULL;
}

static void free_pieces(rjob_t *rj)
{
    free(rj->pstart);
    free(rj->plen);
    free(rj->prange);
    free(rj->pfirst);
    free(rj->pcrc);
    rj->pstart = rj->plen = NULL;
    rj->prange = rj->pfirst = NULL;
    rj->pcrc = NULL;
}

/* Cut the checksummed ranges at chunk boundaries (both are sorted, so one merge walk). */
static int cut_ranges(rjob_t *rj, const fp_read_options_t *o, ll end, char *msg, size_t cap)
{
    ll prev_end = rj->off;
    for (int r = 0; r < o->n_ranges; r++) {
        ll s = o->ranges[2 * r], n = o->ranges[2 * r + 1];
        if (n < 0 || s < prev_end || s > end || n > end - s) {
            snprintf(msg, cap, "checksum range %d (offset %lld, length %lld) is not inside the read "
                     "[%lld, %lld) after the previous range", r, s, n, rj->off, end);
            return FP_EARG;
        }
        prev_end = s + n;
    }
    /* a range gives at most one piece per chunk it touches: pieces <= ranges + chunks */
    ll cap_pieces = (ll)o->n_ranges + rj->nchunks;
    rj->pstart = malloc((size_t)cap_pieces * sizeof(ll));
    rj->plen = malloc((size_t)cap_pieces * sizeof(ll));
    rj->prange = malloc((size_t)cap_pieces * sizeof(int));
    rj->pcrc = calloc((size_t)cap_pieces, sizeof(uint32_t));
    rj->pfirst = malloc(((size_t)rj->nchunks + 1) * sizeof(int));
    if (!rj->pstart || !rj->plen || !rj->prange || !rj->pcrc || !rj->pfirst) {
        free_pieces(rj);
        return FP_ENOMEM;
    }
    int np = 0, r = 0;
    ll pos = o->n_ranges ? o->ranges[0] : 0; /* next unassigned byte of range r */
    for (int k = 0; k < rj->nchunks; k++) {
        ll cs = rj->base + (ll)k * rj->chunk;
        ll ce = cs + rj->chunk < rj->aend ? cs + rj->chunk : rj->aend;
        rj->pfirst[k] = np;
        while (r < o->n_ranges) {
            ll rs = o->ranges[2 * r], re = rs + o->ranges[2 * r + 1];
            if (pos < rs)
                pos = rs;
            if (re == rs) { /* empty: its CRC is 0 */
                r++;
                continue;
            }
            if (pos >= ce)
                break;
            ll pe = re < ce ? re : ce;
            if (pe > pos) {
                rj->pstart[np] = pos;
                rj->plen[np] = pe - pos;
                rj->prange[np] = r;
                np++;
            }
            if (re <= ce) {
                r++;
                pos = r < o->n_ranges ? o->ranges[2 * r] : 0;
            } else {
                pos = ce;
                break;
            }
        }
    }
    rj->pfirst[rj->nchunks] = np;
    return 0;
}

void fp_reader_init(fp_reader_t *r)
{
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

void fp_read_options_default(fp_read_options_t *o)
{
    o->checksum = 0;
    o->threads = 2;
    o->chunk_bytes = 4 << 20;
    o->ranges = NULL;
    o->n_ranges = 0;
    o->range_crcs = NULL;
}

int fp_reader_open(fp_reader_t *r, const char *path, int direct)
{
    fp_reader_close(r);
    int fd = -1, e = 0, used_direct = 0;
    struct stat st;
    if (direct) {
        e = fp_fault_o_direct();
        if (!e) {
            fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
            e = fd < 0 ? errno : 0;
        }
        if (fd >= 0)
            used_direct = 1;
    }
    if (fd < 0 && (!direct || e == EINVAL)) {
        fd = open(path, O_RDONLY | O_CLOEXEC);
        e = fd < 0 ? errno : 0;
    }
    if (fd >= 0 && fstat(fd, &st) < 0) {
        e = errno;
        close(fd);
        fd = -1;
    }
    if (fd < 0)
        return e;
    r->fd = fd;
    r->direct = used_direct;
    r->size = st.st_size;
    fp_detect_alignment(fd, &r->alignment, &r->mem_alignment);
    return 0;
}

void fp_reader_close(fp_reader_t *r)
{
    if (r->fd >= 0) {
        close(r->fd);
        r->fd = -1;
    }
}

static int check_read(ll off, uint64_t addr, ll len, const fp_read_options_t *o, ll *end, char *msg, size_t cap)
{
    if (off < 0 || len < 0)
        snprintf(msg, cap, "invalid read (file_offset=%lld, length=%lld)", off, len);
    else if (fp_end_of(off, len, end))
        snprintf(msg, cap, "invalid read: file_offset=%lld + length=%lld overflows a 64-bit file offset", off, len);
    else if (len > 0 && addr == 0)
        snprintf(msg, cap, "addr is NULL");
    else if (!fp_addr_range_ok(addr, len))
        snprintf(msg, cap, "invalid read: addr=%#llx + length=%lld wraps around the address space",
                 (unsigned long long)addr, len);
    else if (o->threads < 1 || o->threads > 64)
        snprintf(msg, cap, "threads must be in [1, 64], got %d", o->threads);
    else if (o->chunk_bytes < 4096 || o->chunk_bytes > (1LL << 30))
        snprintf(msg, cap, "chunk_bytes must be in [4096, 1 GiB], got %lld", o->chunk_bytes);
    else
        return 0;
    return FP_EARG;
}

int fp_reader_read(fp_reader_t *r, ll off, uint64_t addr, ll len, const fp_read_options_t *o, uint32_t *crc,
                   ll *file_size, char *msg, size_t cap)
{
    msg[0] = 0;
    *crc = 0;
    *file_size = -1;
    if (r->fd < 0)
        return EBADF;
    ll end;
    int rc = check_read(off, addr, len, o, &end, msg, cap);
    if (rc)
        return rc;
    if (len == 0) {
        for (int i = 0; i < o->n_ranges; i++)
            if (o->ranges[2 * i + 1] != 0 || o->ranges[2 * i] != off) {
                snprintf(msg, cap, "checksum range %d (offset %lld, length %lld) is not inside the empty read at %lld",
                         i, o->ranges[2 * i], o->ranges[2 * i + 1], off);
                return FP_EARG;
            }
        return 0;
    }
    /* The end of file first: a length from a damaged or hostile file is an EOF
     * before anything is sized by it. */
    struct stat st;
    if (fstat(r->fd, &st) < 0)
        return errno;
    if (end > st.st_size) {
        *file_size = st.st_size;
        return FP_EOF;
    }
    rjob_t rj;
    memset(&rj, 0, sizeof rj);
    rj.fd = r->fd;
    rj.direct = r->direct;
    rj.checksum = o->checksum;
    rj.align = r->direct ? r->alignment : 1;
    rj.mem_align = r->mem_alignment;
    rj.chunk = r->direct ? fp_align_up(o->chunk_bytes, r->alignment) : o->chunk_bytes;
    /* chunks are aligned and walked past the end by up to a chunk: only a file within
     * that distance of 2**63 - 1 (none on a real file system) could get here */
    if (end > LLONG_MAX - rj.chunk - rj.align) {
        snprintf(msg, cap,
                 "invalid read: file_offset=%lld + length=%lld is too close to the largest file offset "
                 "(2**63 - 1)", off, len);
        return FP_EARG;
    }
    rj.off = off;
    rj.len = len;
    rj.dst = (char *)(uintptr_t)addr;
    rj.base = fp_align_down(off, rj.align);
    rj.aend = fp_align_up(end, rj.align);
    ll nch = (rj.aend - rj.base + rj.chunk - 1) / rj.chunk;
    if (nch > INT_MAX) {
        snprintf(msg, cap, "read too large for chunk_bytes");
        return FP_EARG;
    }
    rj.nchunks = (int)nch;
    if (o->n_ranges > 0) {
        rc = cut_ranges(&rj, o, end, msg, cap);
        if (rc)
            return rc;
    }
    rj.crcs = calloc(rj.nchunks, sizeof(uint32_t));
    if (!rj.crcs) {
        free_pieces(&rj);
        return FP_ENOMEM;
    }
    pthread_mutex_init(&rj.mu, NULL);
    int nthr = (len < READ_INLINE_MAX) ? 1 : o->threads;
    if (nthr > rj.nchunks)
        nthr = rj.nchunks;
    run_on_threads(read_main, &rj, nthr);
    uint32_t c = 0;
    if (!rj.err && o->checksum) {
        for (int k = 0; k < rj.nchunks; k++) {
            ll cs = rj.base + (ll)k * rj.chunk;
            ll ce = cs + rj.chunk < rj.aend ? cs + rj.chunk : rj.aend;
            ll ws = off > cs ? off : cs;
            ll we = end < ce ? end : ce;
            c = fp_crc32c_combine(c, rj.crcs[k], (uint64_t)(we - ws));
        }
    }
    if (!rj.err && rj.pfirst) {
        int npieces = rj.pfirst[rj.nchunks];
        for (int i = 0; i < npieces; i++) {
            uint32_t *rc_ = &o->range_crcs[rj.prange[i]];
            *rc_ = fp_crc32c_combine(*rc_, rj.pcrc[i], (uint64_t)rj.plen[i]);
        }
    }
    if (rj.err == FP_EOF && fstat(rj.fd, &st) == 0) /* the file shrank meanwhile */
        *file_size = st.st_size;
    pthread_mutex_destroy(&rj.mu);
    free(rj.crcs);
    free_pieces(&rj);
    *crc = rj.err ? 0 : c;
    return rj.err;
}

/* ---------------------------------------------------------------- scatter reads */

/* Many small pieces of a file into memory at their own addresses: pieces near each other
 * in the file are read together, one aligned read per group into a staging buffer, and
 * copied out to their addresses; a group of one aligned piece goes straight in.  Where
 * a read per piece pays a device round trip each (thousands of small tensors), a group
 * pays one per few MiB. */
typedef struct {
    int fd, direct, checksum;
    ll align, mem_align, cap;
    const fp_piece_t *p;
    const int *gfirst; /* group g: pieces [gfirst[g], gfirst[g + 1]) */
    int ngroups, next;
    uint32_t *crcs;
    int err;
    pthread_mutex_t mu;
} sjob_t;

static int scatter_group(sjob_t *sj, fp_sbuf_t *buf, int first, int last)
{
    const fp_piece_t *p = sj->p;
    ll lo = fp_align_down(p[first].off, sj->align), hi = 0;
    int filled = 0;
    for (int i = first; i < last; i++)
        if (p[i].len > 0) { /* empty pieces after the group's own read nothing */
            filled++;
            if (p[i].off + p[i].len > hi)
                hi = p[i].off + p[i].len;
        }
    if (filled == 1 && sj->direct && p[first].off % sj->align == 0 && p[first].len % sj->align == 0 &&
        (p[first].addr - (uint64_t)p[first].off) % (uint64_t)sj->mem_align == 0) {
        /* aligned like the file: no staging copy */
        char *dst = (char *)(uintptr_t)p[first].addr;
        int err = pread_full(sj->fd, 1, sj->align, dst, p[first].off, p[first].len, p[first].len);
        if (!err && sj->checksum)
            sj->crcs[first] = fp_crc32c(0, dst, (size_t)p[first].len);
        return err;
    }
    if (!buf->p) {
        int err = fp_pool_get(buf, (size_t)sj->cap, (size_t)sj->mem_align);
        if (err)
            return err;
    }
    int err = pread_full(sj->fd, sj->direct, sj->align, buf->p, lo, hi - lo, fp_align_up(hi, sj->align) - lo);
    for (int i = first; i < last && !err; i++)
        if (p[i].len > 0)
            sj->crcs[i] = fp_copy_crc_cached((char *)(uintptr_t)p[i].addr, (char *)buf->p + (p[i].off - lo),
                                         (size_t)p[i].len, 0, sj->checksum);
    return err;
}

static void *scatter_main(void *arg)
{
    sjob_t *sj = arg;
    fp_sbuf_t buf = {NULL, 0, 0, 0};
    for (;;) {
        int g = take_item(&sj->mu, &sj->err, &sj->next, sj->ngroups);
        if (g < 0)
            break;
        int err = scatter_group(sj, &buf, sj->gfirst[g], sj->gfirst[g + 1]);
        if (err) {
            record_error(&sj->mu, &sj->err, err);
            break;
        }
    }
    fp_pool_put(&buf);
    return NULL;
}

int fp_reader_scatter(fp_reader_t *r, const fp_piece_t *p, int n, const fp_read_options_t *o, ll gap,
                      uint32_t *crcs, ll *file_size, char *msg, size_t cap)
{
    msg[0] = 0;
    *file_size = -1;
    for (int i = 0; i < n; i++)
        crcs[i] = 0;
    if (r->fd < 0)
        return EBADF;
    ll align = r->direct ? r->alignment : 1;
    ll chunk = r->direct ? fp_align_up(o->chunk_bytes, r->alignment) : o->chunk_bytes;
    if (o->threads < 1 || o->threads > 64) {
        snprintf(msg, cap, "threads must be in [1, 64], got %d", o->threads);
        return FP_EARG;
    }
    if (o->chunk_bytes < 4096 || o->chunk_bytes > (1LL << 30)) {
        snprintf(msg, cap, "chunk_bytes must be in [4096, 1 GiB], got %lld", o->chunk_bytes);
        return FP_EARG;
    }
    if (gap < 0) {
        snprintf(msg, cap, "gap must be >= 0, got %lld", gap);
        return FP_EARG;
    }
    ll max_end = 0;
    for (int i = 0; i < n; i++) {
        ll end;
        if (p[i].off < 0 || p[i].len < 0 || fp_end_of(p[i].off, p[i].len, &end) ||
            end > LLONG_MAX - 2 * align) {
            snprintf(msg, cap, "piece %d: invalid read (file_offset=%lld, length=%lld)", i, p[i].off, p[i].len);
            return FP_EARG;
        }
        if (p[i].len > chunk) {
            snprintf(msg, cap, "piece %d: length %lld is over chunk_bytes (%lld)", i, p[i].len, chunk);
            return FP_EARG;
        }
        if (p[i].len > 0 && (p[i].addr == 0 || !fp_addr_range_ok(p[i].addr, p[i].len))) {
            snprintf(msg, cap, "piece %d: invalid destination addr=%#llx for %lld bytes", i,
                     (unsigned long long)p[i].addr, p[i].len);
            return FP_EARG;
        }
        if (i && p[i].off < p[i - 1].off) {
            snprintf(msg, cap, "piece %d (file_offset %lld) comes before piece %d (%lld): pieces must be sorted "
                     "by file offset", i, p[i].off, i - 1, p[i - 1].off);
            return FP_EARG;
        }
        if (end > max_end)
            max_end = end;
    }
    /* The end of file first: a length from a damaged or hostile file is an EOF before
     * anything is sized by it. */
    struct stat st;
    if (fstat(r->fd, &st) < 0)
        return errno;
    if (max_end > st.st_size) {
        *file_size = st.st_size;
        return FP_EOF;
    }
    /* Groups: a piece joins the group before it while the group's aligned span stays
     * within chunk + 2 blocks (what one piece of chunk bytes can span) and the bytes read
     * for nothing between them stay within gap.  Empty pieces belong to no group. */
    int *gfirst = malloc(((size_t)n + 1) * sizeof(int));
    if (!gfirst)
        return FP_ENOMEM;
    ll span_max = chunk + 2 * align;
    int ng = 0;
    ll glo = 0, ghi = 0;
    for (int i = 0; i < n; i++) {
        if (p[i].len == 0)
            continue;
        ll end = p[i].off + p[i].len;
        ll nhi = end > ghi ? end : ghi;
        if (ng && p[i].off - ghi <= gap && fp_align_up(nhi, align) - glo <= span_max) {
            ghi = nhi;
            continue;
        }
        gfirst[ng++] = i;
        glo = fp_align_down(p[i].off, align);
        ghi = end;
    }
    /* a group runs to the next group's first piece (empty pieces inside it copy nothing) */
    gfirst[ng] = n;
    sjob_t sj;
    memset(&sj, 0, sizeof sj);
    sj.fd = r->fd;
    sj.direct = r->direct;
    sj.checksum = o->checksum;
    sj.align = align;
    sj.mem_align = r->mem_alignment;
    sj.cap = span_max;
    sj.p = p;
    sj.gfirst = gfirst;
    sj.ngroups = ng;
    sj.crcs = crcs;
    pthread_mutex_init(&sj.mu, NULL);
    run_on_threads(scatter_main, &sj, o->threads < ng ? o->threads : ng);
    if (sj.err == FP_EOF && fstat(r->fd, &st) == 0) /* the file shrank meanwhile */
        *file_size = st.st_size;
    pthread_mutex_destroy(&sj.mu);
    free(gfirst);
    if (sj.err)
        for (int i = 0; i < n; i++)
            crcs[i] = 0;
    return sj.err;
}
