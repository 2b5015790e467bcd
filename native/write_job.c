/*
 * write_job.c -- one write of a file range: the arguments checked, the range cut into
 * items (chunks through a staging buffer, or zero-copy pieces of the caller's memory),
 * copy threads filling staging slots with the CRC fused in, and the slots written by a
 * pool of pwrite threads or by the calling thread owning the engine's io_uring; the
 * extents' CRCs assembled from the pieces' at the end.
 */
#define _GNU_SOURCE
#include "fp_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <linux/io_uring.h>

/* ---- the job: items, staging slots, copy threads ---- */

/* A piece of the range written by one request (or several, if short). */
typedef struct {
    ll off, len;
    uint64_t src; /* direct (zero-copy) source address, else 0 */
    int direct;
    int e_lo, e_hi; /* overlapping extents [e_lo, e_hi) */
    size_t piece_base;
} item_t;

typedef struct {
    fp_sbuf_t buf; /* staging buffer (lazily taken from the pool) */
    int item;
    char *ptr;  /* next byte to write */
    ll off;     /* its file offset */
    ll left;    /* bytes still to write for this item */
    ll cur_len; /* length of the request in flight */
    int first;
    int fault_errno;
    int in_ring; /* a request of it is submitted and not yet reaped */
} slot_t;

#define POLL_UD 0xFFFFFFFFFFFFFFFFull

typedef struct {
    /* engine */
    int fd, backend, efd, io_threads, qd;
    fp_ring_t *ring;
    ll align, mem_align, chunk;
    int checksum;
    /* work */
    const fp_extent_t *ext;
    int n_ext;
    item_t *items;
    int n_items;
    uint32_t *pieces;
    slot_t *slots;
    int n_slots;
    int *free_stack, n_free;
    int *rq, rq_head, rq_count; /* ready FIFO of slot indices (capacity n_slots) */
    int next_item, completed;
    int abort, err;
    int ncopy, copy_exited;
    pthread_mutex_t mu;
    pthread_cond_t cv_slot, cv_ready;
    /* stats */
    int inflight;
    double t_busy0, io_wait, copy_seconds;
    long requests, short_writes;
    int leak_slots; /* ring failed with I/O possibly in flight: never free buffers */
    int stalled_direct; /* a request given up on was writing from the caller's memory */
} job_t;

static void job_fail_locked(job_t *j, int err)
{
    if (!j->err)
        j->err = err;
    j->abort = 1;
    pthread_cond_broadcast(&j->cv_slot);
    pthread_cond_broadcast(&j->cv_ready);
}

/* A slot's write is over (err: how it ended): the slot is free again and the job counts it. */
static void slot_done_locked(job_t *j, int s, int err)
{
    j->free_stack[j->n_free++] = s;
    if (err)
        job_fail_locked(j, err);
    else
        j->completed++;
    pthread_cond_signal(&j->cv_slot);
}

static void wake_owner(job_t *j)
{
    if (j->efd >= 0) {
        uint64_t one = 1;
        ssize_t r;
        do {
            r = write(j->efd, &one, sizeof one);
        } while (r < 0 && errno == EINTR);
    }
}

static void inflight_inc_locked(job_t *j)
{
    if (j->inflight++ == 0)
        j->t_busy0 = fp_now();
}

static void inflight_dec_locked(job_t *j)
{
    if (--j->inflight == 0)
        j->io_wait += fp_now() - j->t_busy0;
}

/* Fill slot s with item k (staging copy with fused CRC, or zero-copy CRC). */
static int fill_slot(job_t *j, int s, int k)
{
    slot_t *sl = &j->slots[s];
    item_t *it = &j->items[k];
    sl->item = k;
    sl->off = it->off;
    sl->left = it->len;
    sl->first = 1;
    sl->fault_errno = 0;
    if (it->direct) {
        /* The one read of zero-copy source memory in user space: with no known CRC it is
         * checksummed here, so memory freed under the call is a SIGSEGV on this thread
         * rather than the kernel's EFAULT on the write (callers that checksummed while
         * staging pass the CRC and skip this). */
        if (j->checksum && !j->ext[it->e_lo].has_crc)
            j->pieces[it->piece_base] = fp_crc32c(0, (const void *)(uintptr_t)it->src, (size_t)it->len);
        sl->ptr = (char *)(uintptr_t)it->src;
        return 0;
    }
    if (!sl->buf.p) {
        int e = fp_pool_get(&sl->buf, (size_t)j->chunk, (size_t)j->mem_align);
        if (e)
            return e;
    }
    char *buf = sl->buf.p;
    ll cur = it->off, end = it->off + it->len;
    for (int e = it->e_lo; e < it->e_hi; e++) {
        const fp_extent_t *x = &j->ext[e];
        ll a = x->off > it->off ? x->off : it->off;
        ll b = x->off + x->len < end ? x->off + x->len : end;
        if (b <= a)
            continue;
        if (a > cur)
            memset(buf + (cur - it->off), 0, (size_t)(a - cur));
        uint32_t c = fp_copy_crc(buf + (a - it->off), (const char *)(uintptr_t)x->addr + (a - x->off),
                              (size_t)(b - a), 0, j->checksum);
        j->pieces[it->piece_base + (size_t)(e - it->e_lo)] = c;
        cur = b;
    }
    if (cur < end)
        memset(buf + (cur - it->off), 0, (size_t)(end - cur));
    sl->ptr = buf;
    return 0;
}

static void *copy_main(void *arg)
{
    job_t *j = arg;
    double busy = 0;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        while (!j->abort && j->next_item < j->n_items && j->n_free == 0)
            pthread_cond_wait(&j->cv_slot, &j->mu);
        if (j->abort || j->next_item >= j->n_items)
            break;
        int k = j->next_item++;
        int s = j->free_stack[--j->n_free];
        pthread_mutex_unlock(&j->mu);
        double t0 = fp_now();
        int err = fill_slot(j, s, k);
        busy += fp_now() - t0;
        pthread_mutex_lock(&j->mu);
        if (err) {
            j->free_stack[j->n_free++] = s;
            job_fail_locked(j, err);
            break;
        }
        j->rq[(j->rq_head + j->rq_count) % j->n_slots] = s;
        j->rq_count++;
        pthread_cond_signal(&j->cv_ready);
        if (j->efd >= 0) {
            pthread_mutex_unlock(&j->mu);
            wake_owner(j);
            pthread_mutex_lock(&j->mu);
        }
    }
    j->copy_exited++;
    j->copy_seconds += busy;
    pthread_cond_broadcast(&j->cv_ready);
    pthread_mutex_unlock(&j->mu);
    wake_owner(j);
    return NULL;
}

/* ---- threadpool / buffered: pwrite workers ---- */

static int do_pwrite(job_t *j, slot_t *sl, long *reqs, long *shorts)
{
    while (sl->left > 0) {
        ll n = sl->left;
        if (sl->first)
            n = fp_fault_first_len(n, j->align);
        sl->first = 0;
        int fe = fp_fault_write(sl->off, n);
        if (fe)
            return fe;
        (*reqs)++;
        ssize_t r = pwrite(j->fd, sl->ptr, (size_t)n, sl->off);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return errno;
        }
        if (r == 0)
            return EIO;
        if (r < sl->left)
            (*shorts)++;
        sl->ptr += r;
        sl->off += r;
        sl->left -= r;
    }
    return 0;
}

static void *io_main(void *arg)
{
    job_t *j = arg;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        while (!j->abort && j->rq_count == 0 && j->copy_exited < j->ncopy)
            pthread_cond_wait(&j->cv_ready, &j->mu);
        if (j->abort || j->rq_count == 0)
            break;
        int s = j->rq[j->rq_head];
        j->rq_head = (j->rq_head + 1) % j->n_slots;
        j->rq_count--;
        inflight_inc_locked(j);
        pthread_mutex_unlock(&j->mu);
        long reqs = 0, shorts = 0;
        int err = do_pwrite(j, &j->slots[s], &reqs, &shorts);
        pthread_mutex_lock(&j->mu);
        inflight_dec_locked(j);
        j->requests += reqs;
        j->short_writes += shorts;
        slot_done_locked(j, s, err);
    }
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

/* ---- io_uring: the calling thread owns the ring ---- */

static int uring_prep_write(job_t *j, int s)
{
    slot_t *sl = &j->slots[s];
    struct io_uring_sqe *sqe = fp_ring_sqe(j->ring);
    if (!sqe)
        return EBUSY; /* cannot happen: entries > queue depth */
    ll n = sl->left;
    if (sl->first)
        n = fp_fault_first_len(n, j->align);
    sl->first = 0;
    sl->fault_errno = fp_fault_write(sl->off, n);
    sl->cur_len = n;
    sqe->opcode = IORING_OP_WRITE;
    sqe->fd = j->fd;
    sqe->addr = (uint64_t)(uintptr_t)sl->ptr;
    sqe->len = (uint32_t)n;
    sqe->off = (uint64_t)sl->off;
    sqe->user_data = (uint64_t)s + 1;
    sl->in_ring = 1;
    j->requests++;
    return 0;
}

static void uring_prep_poll(job_t *j)
{
    struct io_uring_sqe *sqe = fp_ring_sqe(j->ring);
    sqe->opcode = IORING_OP_POLL_ADD;
    sqe->fd = j->efd;
    sqe->poll32_events = POLLIN;
    sqe->user_data = POLL_UD;
}

static void drain_efd(int efd)
{
    uint64_t v;
    while (read(efd, &v, sizeof v) > 0 || errno == EINTR) {
    }
}

/* Seconds without a single write completion, writes in flight, after which the ring is taken
 * for broken: the job fails with ETIMEDOUT instead of waiting forever for a completion the
 * kernel may never post (FASTPERSIST_URING_STALL_S; 0 turns the watchdog off). */
static double stall_limit(void)
{
    const char *v = getenv("FASTPERSIST_URING_STALL_S");
    if (!v || !*v)
        return 120.0;
    char *end;
    double s = strtod(v, &end);
    return (end != v && s >= 0) ? s : 120.0;
}

static void uring_owner(job_t *j)
{
    fp_ring_t *R = j->ring;
    int inflight = 0, poll_armed = 0, broken = 0;
    double stall = stall_limit(), progress = fp_now();
    /* wake up this often to look at the clock (never longer than the limit itself) */
    int tick_ms = stall <= 0 ? 0 : (stall < 1.0 ? (int)(stall * 1000) + 1 : 1000);
    for (;;) {
        pthread_mutex_lock(&j->mu);
        if (j->abort) {
            while (j->rq_count) {
                j->free_stack[j->n_free++] = j->rq[j->rq_head];
                j->rq_head = (j->rq_head + 1) % j->n_slots;
                j->rq_count--;
            }
            pthread_cond_broadcast(&j->cv_slot);
        } else {
            while (inflight < j->qd && j->rq_count) {
                int s = j->rq[j->rq_head];
                j->rq_head = (j->rq_head + 1) % j->n_slots;
                j->rq_count--;
                int e = uring_prep_write(j, s);
                if (e) {
                    j->free_stack[j->n_free++] = s;
                    job_fail_locked(j, e);
                    break;
                }
                if (inflight++ == 0)
                    j->t_busy0 = fp_now();
            }
        }
        int copy_done = j->copy_exited >= j->ncopy;
        int all_done = j->completed >= j->n_items;
        int ab = j->abort;
        pthread_mutex_unlock(&j->mu);
        fp_ring_publish(R);

        if (inflight == 0 && (all_done || (ab && copy_done)))
            break;
        int want_poll = !all_done && !(ab && copy_done);
        if (want_poll && !poll_armed) {
            uring_prep_poll(j);
            fp_ring_publish(R);
            poll_armed = 1;
        }
        unsigned pend = fp_ring_unsubmitted(R);
        int r = fp_ring_wait(R, pend, inflight ? tick_ms : 0);
        if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY && errno != ETIME) {
            /* the ring itself failed: nothing more can be waited for */
            pthread_mutex_lock(&j->mu);
            job_fail_locked(j, errno);
            pthread_mutex_unlock(&j->mu);
            broken = 1;
            break;
        }
        /* reap */
        unsigned head = *R->cq_head;
        unsigned tail = __atomic_load_n(R->cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail) {
            struct io_uring_cqe *cqe = &R->cqes[head & *R->cq_mask];
            uint64_t ud = cqe->user_data;
            int res = cqe->res;
            head++;
            if (ud == POLL_UD) {
                poll_armed = 0;
                drain_efd(j->efd);
                continue;
            }
            int s = (int)(ud - 1);
            slot_t *sl = &j->slots[s];
            if (fp_fault_lose_completion(sl->off))
                continue; /* test hook: as if this completion were never posted */
            progress = fp_now();
            sl->in_ring = 0;
            if (sl->fault_errno) {
                res = -sl->fault_errno;
                sl->fault_errno = 0;
            }
            int err = 0, done = 0;
            if (res == -EINTR || res == -EAGAIN) {
                /* transient: resubmit the same request */
            } else if (res < 0) {
                err = -res;
            } else if (res == 0) {
                err = EIO;
            } else {
                if (res < sl->left)
                    j->short_writes++;
                sl->ptr += res;
                sl->off += res;
                sl->left -= res;
                done = sl->left == 0;
            }
            if (!err && !done) {
                int ab2 = __atomic_load_n(&j->abort, __ATOMIC_RELAXED);
                if (!ab2) {
                    err = uring_prep_write(j, s);
                    if (!err)
                        continue; /* still in flight */
                } else {
                    pthread_mutex_lock(&j->mu);
                    j->free_stack[j->n_free++] = s;
                    pthread_cond_signal(&j->cv_slot);
                    pthread_mutex_unlock(&j->mu);
                    if (--inflight == 0)
                        j->io_wait += fp_now() - j->t_busy0;
                    continue;
                }
            }
            pthread_mutex_lock(&j->mu);
            slot_done_locked(j, s, err);
            pthread_mutex_unlock(&j->mu);
            if (--inflight == 0)
                j->io_wait += fp_now() - j->t_busy0;
        }
        __atomic_store_n(R->cq_head, head, __ATOMIC_RELEASE);
        fp_ring_publish(R);
        if (!inflight)
            progress = fp_now();
        else if (stall > 0 && fp_now() - progress > stall) {
            /* writes in flight and not one completion for that long: lost (or a device that
             * no longer answers); the caller gets an error, not a hang. Should a request
             * given up on still complete, a staged one writes the bytes it had (its buffer
             * is never reused); one writing from the caller's memory would write whatever is
             * there by then, so the caller must not commit this file (stalled_direct). */
            for (int i = 0; i < j->n_slots; i++)
                if (j->slots[i].in_ring && j->items[j->slots[i].item].direct)
                    j->stalled_direct = 1;
            pthread_mutex_lock(&j->mu);
            job_fail_locked(j, ETIMEDOUT);
            pthread_mutex_unlock(&j->mu);
            broken = 1;
            break;
        }
    }
    if (broken) {
        R->broken = 1; /* its requests may still complete: no later job may read its CQEs */
        R->stalled_direct |= j->stalled_direct;
        j->leak_slots = inflight > 0;
        return;
    }
    /* Retire the eventfd poll so nothing of this call stays in the ring. */
    while (poll_armed) {
        wake_owner(j);
        int r = fp_ring_enter(j->ring, fp_ring_unsubmitted(R), 1, IORING_ENTER_GETEVENTS);
        if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY)
            break;
        unsigned head = *R->cq_head;
        unsigned tail = __atomic_load_n(R->cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail) {
            if (R->cqes[head & *R->cq_mask].user_data == POLL_UD)
                poll_armed = 0;
            head++;
        }
        __atomic_store_n(R->cq_head, head, __ATOMIC_RELEASE);
    }
    drain_efd(j->efd);
}

/* Run the whole pipeline on the calling thread (the io_uring owner) and threads of its own. */
static void job_run(job_t *j, int ncopy_req)
{
    pthread_t copy_t[64], io_t[256];
    int nc = 0, ni = 0;
    pthread_mutex_lock(&j->mu);
    j->ncopy = ncopy_req; /* provisional: threads only compare copy_exited to it */
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < ncopy_req; i++) {
        int r = fp_spawn(&copy_t[nc], copy_main, j);
        if (r) {
            pthread_mutex_lock(&j->mu);
            job_fail_locked(j, r);
            pthread_mutex_unlock(&j->mu);
            break;
        }
        nc++;
    }
    pthread_mutex_lock(&j->mu);
    j->ncopy = nc;
    pthread_cond_broadcast(&j->cv_ready);
    pthread_mutex_unlock(&j->mu);
    wake_owner(j);
    if (j->backend == FP_BK_IO_URING) {
        uring_owner(j);
    } else {
        for (int i = 0; i < j->io_threads; i++) {
            int r = fp_spawn(&io_t[ni], io_main, j);
            if (r) {
                pthread_mutex_lock(&j->mu);
                job_fail_locked(j, r);
                pthread_mutex_unlock(&j->mu);
                break;
            }
            ni++;
        }
        if (ni == 0) {
            /* no I/O thread: the copy threads must not wait for slots forever */
            pthread_mutex_lock(&j->mu);
            job_fail_locked(j, j->err ? j->err : EAGAIN);
            pthread_mutex_unlock(&j->mu);
        }
    }
    for (int i = 0; i < nc; i++)
        pthread_join(copy_t[i], NULL);
    for (int i = 0; i < ni; i++)
        pthread_join(io_t[i], NULL);
}

/* ---- checks and cutting into items ---- */

int fp_write_check_range(const fp_engine_t *e, ll start, ll end, char *msg, size_t cap)
{
    ll A = e->alignment;
    if (start < 0 || end < start) {
        snprintf(msg, cap, "invalid range [start=%lld, end=%lld)", start, end);
        return FP_EARG;
    }
    if (start % A) {
        snprintf(msg, cap, "start=%lld is not a multiple of the alignment %lld", start, A);
        return FP_EARG;
    }
    /* The range is padded up to the alignment and cut into chunks: end + alignment +
     * chunk must still be a file offset.  No file system takes files that large anyway. */
    if (end > LLONG_MAX - e->chunk_bytes - A) {
        snprintf(msg, cap,
                 "end=%lld is too close to the largest file offset (2**63 - 1) to be written in "
                 "chunks of %lld bytes", end, e->chunk_bytes);
        return FP_EARG;
    }
    return 0;
}

static int check_extents(const fp_extent_t *ext, int n_ext, ll start, ll end, char *msg, size_t cap)
{
    if (n_ext < 0 || n_ext > INT_MAX / 2) {
        snprintf(msg, cap, "too many extents");
        return FP_EARG;
    }
    ll prev_end = start;
    for (int i = 0; i < n_ext; i++) {
        /* off >= prev_end >= start >= 0 here, so end - off cannot overflow; off + len
         * could (both from the caller) and is only formed once it is known to be <= end */
        if (ext[i].len < 0 || ext[i].off < prev_end || ext[i].off > end || ext[i].len > end - ext[i].off) {
            snprintf(msg, cap,
                     "extent %d (file_offset=%lld, length=%lld) is negative, overlaps the previous one, "
                     "is out of order or lies outside [start=%lld, end=%lld)",
                     i, ext[i].off, ext[i].len, start, end);
            return FP_EARG;
        }
        if (ext[i].len > 0 && ext[i].addr == 0) {
            snprintf(msg, cap, "extent %d has a NULL address", i);
            return FP_EARG;
        }
        if (!fp_addr_range_ok(ext[i].addr, ext[i].len)) {
            snprintf(msg, cap, "extent %d: addr=%#llx + length=%lld wraps around the address space", i,
                     (unsigned long long)ext[i].addr, ext[i].len);
            return FP_EARG;
        }
        prev_end = ext[i].off + ext[i].len;
    }
    return 0;
}

static int items_push(item_t **items, int *n, int *cap, item_t it)
{
    if (*n == *cap) {
        if (*cap > INT_MAX / 2)
            return -1; /* the caller bounds the count well below */
        int nc = *cap ? *cap * 2 : 64;
        item_t *ni = realloc(*items, sizeof(item_t) * nc);
        if (!ni)
            return -1;
        *items = ni;
        *cap = nc;
    }
    (*items)[(*n)++] = it;
    return 0;
}

/* Cut [start, endp) into items of at most a chunk: with zero_copy, each extent aligned
 * in file and memory becomes items of its own, written from its memory; the rest goes
 * through staging, an item covering the extents [e_lo, e_hi) it overlaps.  Every item
 * has one CRC piece per extent it covers (pieces[piece_base + ...]).  0 or -1 (memory). */
static int cut_items(const fp_engine_t *eng, const fp_extent_t *ext, int n_ext, ll start, ll endp,
                     int zero_copy, item_t **items_out, int *n_items_out, size_t *n_pieces_out)
{
    ll A = eng->alignment, chunk = eng->chunk_bytes;
    item_t *items = NULL;
    int n_items = 0, cap = 0, rc = -1;
    size_t n_pieces = 0;
    int *next_elig = NULL;
    char *elig = NULL;
    if (zero_copy) {
        next_elig = malloc(sizeof(int) * (n_ext + 1));
        elig = malloc(n_ext + 1);
        if (!next_elig || !elig)
            goto out;
        next_elig[n_ext] = n_ext;
        for (int i = n_ext - 1; i >= 0; i--) {
            elig[i] = ext[i].len > 0 && ext[i].off % A == 0 && ext[i].len % A == 0 &&
                      ext[i].addr % (uint64_t)eng->mem_alignment == 0;
            next_elig[i] = elig[i] ? i : next_elig[i + 1];
        }
    }
    ll pos = start;
    int e = 0;
    while (e < n_ext && ext[e].off + ext[e].len <= pos)
        e++;
    while (pos < endp) {
        if (zero_copy && e < n_ext && elig[e] && ext[e].off == pos) {
            for (ll o = 0; o < ext[e].len; o += chunk) {
                item_t it = {pos + o, ext[e].len - o < chunk ? ext[e].len - o : chunk,
                             ext[e].addr + (uint64_t)o, 1, e, e + 1, n_pieces};
                n_pieces++;
                if (items_push(&items, &n_items, &cap, it))
                    goto out;
            }
            pos += ext[e].len;
            e++;
            while (e < n_ext && ext[e].off + ext[e].len <= pos)
                e++;
            continue;
        }
        ll seg_end = endp;
        if (zero_copy && e < n_ext && next_elig[e] < n_ext)
            seg_end = ext[next_elig[e]].off;
        ll item_end = pos + chunk < seg_end ? pos + chunk : seg_end;
        int e_hi = e;
        while (e_hi < n_ext && ext[e_hi].off < item_end)
            e_hi++;
        item_t it = {pos, item_end - pos, 0, 0, e, e_hi, n_pieces};
        n_pieces += (size_t)(e_hi - e);
        if (items_push(&items, &n_items, &cap, it))
            goto out;
        pos = item_end;
        while (e < n_ext && ext[e].off + ext[e].len <= pos)
            e++;
    }
    rc = 0;
out:
    free(next_elig);
    free(elig);
    if (rc) {
        free(items);
        items = NULL;
        n_items = 0;
    }
    *items_out = items;
    *n_items_out = n_items;
    *n_pieces_out = n_pieces;
    return rc;
}

/* ---- the whole write ---- */

int fp_engine_write(fp_engine_t *eng, const fp_extent_t *ext, int n_ext, ll start, ll end, int checksum,
                    int zero_copy, uint32_t *crcs, fp_write_stats_t *stats, char *msg, size_t cap)
{
    msg[0] = 0;
    memset(stats, 0, sizeof *stats);
    if (eng->fd < 0)
        return EBADF;
    int rc = fp_write_check_range(eng, start, end, msg, cap);
    if (!rc)
        rc = check_extents(ext, n_ext, start, end, msg, cap);
    if (rc)
        return rc;
    ll A = eng->alignment, chunk = eng->chunk_bytes;
    ll endp = fp_align_up(end, A);
    /* Items are counted in an int: at most two per chunk of the range (a chunk cut by a
     * zero-copy extent's start) and two more per extent. */
    if ((endp - start) / chunk + 1 > (INT_MAX - 2 * (ll)n_ext - 2) / 2) {
        snprintf(msg, cap, "range [start=%lld, end=%lld) has too many chunks of %lld bytes", start, end, chunk);
        return FP_EARG;
    }
    for (int i = 0; i < n_ext; i++)
        crcs[i] = 0;

    item_t *items = NULL;
    int n_items = 0;
    size_t n_pieces = 0;
    job_t j;
    memset(&j, 0, sizeof j);
    if (cut_items(eng, ext, n_ext, start, endp, zero_copy, &items, &n_items, &n_pieces))
        return FP_ENOMEM;
    j.pieces = calloc(n_pieces ? n_pieces : 1, sizeof(uint32_t));
    j.n_slots = eng->queue_depth + eng->copy_threads;
    if (j.n_slots > n_items)
        j.n_slots = n_items > 0 ? n_items : 1;
    j.slots = calloc(j.n_slots, sizeof(slot_t));
    j.free_stack = malloc(sizeof(int) * j.n_slots);
    j.rq = malloc(sizeof(int) * j.n_slots);
    if (!j.pieces || !j.slots || !j.free_stack || !j.rq) {
        rc = FP_ENOMEM;
        goto out;
    }
    for (int i = 0; i < j.n_slots; i++)
        j.free_stack[i] = j.n_slots - 1 - i;
    j.n_free = j.n_slots;
    j.fd = eng->fd;
    /* a ring that failed or lost a request is not used again: its late completions would
     * be taken for this job's */
    j.backend = eng->backend == FP_BK_IO_URING && eng->ring.broken ? FP_BK_THREADPOOL : eng->backend;
    j.efd = j.backend == FP_BK_IO_URING ? eng->efd : -1;
    j.io_threads = eng->io_threads;
    j.qd = eng->queue_depth;
    j.ring = &eng->ring;
    j.align = A;
    j.mem_align = eng->mem_alignment;
    j.chunk = chunk;
    j.checksum = checksum;
    j.ext = ext;
    j.n_ext = n_ext;
    j.items = items;
    j.n_items = n_items;
    pthread_mutex_init(&j.mu, NULL);
    pthread_cond_init(&j.cv_slot, NULL);
    pthread_cond_init(&j.cv_ready, NULL);

    double t0 = fp_now();
    int ncopy = eng->copy_threads < n_items ? eng->copy_threads : n_items;
    if (n_items > 0 && eng->backend != FP_BK_BUFFERED) {
        /* Preallocate the part of the range past EOF.  O_DIRECT writes that
         * extend a file (or fill holes) need ext4's exclusive inode lock: they
         * cannot be issued inline by io_uring (punted to io-wq workers, which
         * serialize writes to one inode) and serialize pwrite threads too.
         * Writes into preallocated (unwritten) blocks run in parallel.  This
         * sets the file size to align_up(end); the caller truncates anyway.
         * Failure (EOPNOTSUPP, ENOSPC...) is left to the writes to report. */
        struct stat st;
        if (fstat(eng->fd, &st) == 0 && st.st_size < endp) {
            ll from = st.st_size > start ? fp_align_down(st.st_size, A) : start;
            (void)fallocate(eng->fd, 0, from, endp - from);
        }
    }
    if (n_items > 0)
        job_run(&j, ncopy);
    if (!j.err && checksum) {
        for (int k = 0; k < n_items; k++) {
            item_t *it = &items[k];
            for (int e = it->e_lo; e < it->e_hi; e++) {
                ll a = ext[e].off > it->off ? ext[e].off : it->off;
                ll b = ext[e].off + ext[e].len < it->off + it->len ? ext[e].off + ext[e].len : it->off + it->len;
                if (b > a)
                    crcs[e] = fp_crc32c_combine(crcs[e], j.pieces[it->piece_base + (size_t)(e - it->e_lo)],
                                                (uint64_t)(b - a));
            }
        }
        for (int e = 0; e < n_ext; e++)
            if (ext[e].has_crc)
                crcs[e] = ext[e].crc;
    }
    for (int i = 0; i < j.n_slots; i++) {
        if (j.leak_slots)
            j.slots[i].buf.p = NULL; /* the kernel may still read them */
        fp_pool_put(&j.slots[i].buf);
    }
    stats->seconds = fp_now() - t0;
    pthread_mutex_destroy(&j.mu);
    pthread_cond_destroy(&j.cv_slot);
    pthread_cond_destroy(&j.cv_ready);
    rc = j.err;
    stats->bytes = end - start;
    stats->bytes_padded = endp - end;
    for (int k = 0; k < n_items; k++)
        if (items[k].direct)
            stats->zero_copy_bytes += items[k].len;
    stats->copy_seconds = j.copy_seconds;
    stats->io_wait_seconds = j.io_wait;
    stats->requests = j.requests;
    stats->short_writes = j.short_writes;
out:
    free(items);
    free(j.pieces);
    free(j.slots);
    free(j.free_stack);
    free(j.rq);
    return rc;
}
