/*
 * uring.c -- io_uring through raw system calls (no liburing): set up a ring, map it,
 * take submission entries, publish them, enter.  The write job (write_job.c) owns the
 * loop that uses it.
 */
#define _GNU_SOURCE
#include "fp_engine.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <linux/io_uring.h>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif

void fp_ring_init(fp_ring_t *R)
{
    memset(R, 0, sizeof *R);
    R->fd = -1;
}

void fp_ring_close(fp_ring_t *R)
{
    if (R->sqes)
        munmap(R->sqes, R->sqes_sz);
    if (R->cq_ptr && R->cq_ptr != R->sq_ptr)
        munmap(R->cq_ptr, R->cq_sz);
    if (R->sq_ptr)
        munmap(R->sq_ptr, R->sq_sz);
    if (R->fd >= 0)
        close(R->fd);
    fp_ring_init(R);
}

int fp_ring_setup(fp_ring_t *R, unsigned entries)
{
    fp_ring_init(R);
    int e;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = IORING_SETUP_COOP_TASKRUN;
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0 && errno == EINVAL) {
        memset(&p, 0, sizeof p);
        fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    }
    if (fd < 0)
        return errno;
    R->fd = fd;
    R->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    R->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        if (R->cq_sz > R->sq_sz)
            R->sq_sz = R->cq_sz;
        R->cq_sz = R->sq_sz;
    }
    void *sq = mmap(NULL, R->sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED)
        goto fail;
    R->sq_ptr = sq;
    if (single) {
        R->cq_ptr = sq;
    } else {
        void *cq = mmap(NULL, R->cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (cq == MAP_FAILED)
            goto fail;
        R->cq_ptr = cq;
    }
    R->sqes_sz = p.sq_entries * sizeof(struct io_uring_sqe);
    void *sqes = mmap(NULL, R->sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (sqes == MAP_FAILED)
        goto fail;
    R->sqes = sqes;
    char *s = R->sq_ptr, *c = R->cq_ptr;
    R->sq_head = (unsigned *)(s + p.sq_off.head);
    R->sq_tail = (unsigned *)(s + p.sq_off.tail);
    R->sq_mask = (unsigned *)(s + p.sq_off.ring_mask);
    R->sq_entries = (unsigned *)(s + p.sq_off.ring_entries);
    R->sq_array = (unsigned *)(s + p.sq_off.array);
    R->cq_head = (unsigned *)(c + p.cq_off.head);
    R->cq_tail = (unsigned *)(c + p.cq_off.tail);
    R->cq_mask = (unsigned *)(c + p.cq_off.ring_mask);
    R->cqes = (struct io_uring_cqe *)(c + p.cq_off.cqes);
    R->tail = *R->sq_tail;
    R->features = p.features;
    return 0;
fail:
    e = errno;
    fp_ring_close(R);
    return e ? e : ENOMEM;
}

struct io_uring_sqe *fp_ring_sqe(fp_ring_t *R)
{
    unsigned head = __atomic_load_n(R->sq_head, __ATOMIC_ACQUIRE);
    if (R->tail - head >= *R->sq_entries)
        return NULL;
    unsigned idx = R->tail & *R->sq_mask;
    struct io_uring_sqe *sqe = &R->sqes[idx];
    memset(sqe, 0, sizeof *sqe);
    R->sq_array[idx] = idx;
    R->tail++;
    return sqe;
}

void fp_ring_publish(fp_ring_t *R)
{
    __atomic_store_n(R->sq_tail, R->tail, __ATOMIC_RELEASE);
}

unsigned fp_ring_unsubmitted(fp_ring_t *R)
{
    return R->tail - __atomic_load_n(R->sq_head, __ATOMIC_ACQUIRE);
}

int fp_ring_enter(fp_ring_t *R, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, R->fd, to_submit, min_complete, flags, NULL, 0);
}

int fp_ring_wait(fp_ring_t *R, unsigned to_submit, int timeout_ms)
{
    if (timeout_ms <= 0 || !(R->features & IORING_FEAT_EXT_ARG))
        return fp_ring_enter(R, to_submit, 1, IORING_ENTER_GETEVENTS);
    struct __kernel_timespec ts = {.tv_sec = timeout_ms / 1000, .tv_nsec = (long long)(timeout_ms % 1000) * 1000000};
    struct io_uring_getevents_arg arg;
    memset(&arg, 0, sizeof arg);
    arg.ts = (uint64_t)(uintptr_t)&ts;
    return (int)syscall(__NR_io_uring_enter, R->fd, to_submit, 1, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG,
                        &arg, sizeof arg);
}
