/*
 * staging.c -- the process-wide staging-buffer pool (mutex protected, one buffer
 * size), staging on huge pages, and advice about callers' memory (huge pages,
 * populate).
 *
 * Buffers of `pool.size` bytes aligned to `pool.align` are kept between calls
 * so that per-iteration checkpoints do not pay page faults again.  A request
 * for at most pool.size bytes (and at most pool.align alignment) is served
 * from it; a larger request switches the pool to the new size when no pooled
 * buffer is out, otherwise it gets a private buffer freed on return.
 * fp_pool_release() frees the free list and bumps a generation so buffers
 * still out are freed (not kept) when they come back.
 */
#define _GNU_SOURCE
#include "fp_engine.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

static struct {
    pthread_mutex_t mu;
    size_t size, align;
    void **free_list;
    size_t nfree, cap;
    size_t total; /* pooled buffers of the current generation, free + out */
    unsigned gen;
} pool = {PTHREAD_MUTEX_INITIALIZER, 0, 0, NULL, 0, 0, 0, 1};

/* A child forked while one of the parent's threads held the pool (a copy thread of a
 * write in flight) would wait on that lock forever, and could find the free list half
 * updated: the child starts with an empty pool of its own.  The parent's buffers stay
 * mapped in the child (copy-on-write) and are never handed out there. */
static void pool_after_fork_in_child(void)
{
    pthread_mutex_init(&pool.mu, NULL);
    pool.free_list = NULL;
    pool.nfree = pool.cap = pool.total = 0;
    pool.size = pool.align = 0;
    if (++pool.gen == 0) /* 0 marks a private buffer */
        pool.gen = 1;
}

__attribute__((constructor)) static void pool_register_fork_handler(void)
{
    pthread_atfork(NULL, NULL, pool_after_fork_in_child);
}

/* Staging buffers of 2 MiB and more are mapped 2 MiB-aligned and advised as
 * transparent huge pages.  O_DIRECT pins the buffer's pages for every request
 * and a virtual disk copies them out of guest memory: with 4 KiB pages that is
 * 512x the page walks, and writes from huge pages run faster on a virtual disk
 * (benchmarks/page_effects.py; figures in docs/performance.md).  Where THP
 * is off the advice is ignored and the buffer is an ordinary mapping. */
#define HUGE_SZ (2u << 20)
static int stage_huge = -1;

static size_t stage_map_len(size_t size) { return (size + HUGE_SZ - 1) / HUGE_SZ * HUGE_SZ; }

static void *stage_alloc(size_t size, size_t align)
{
    if (stage_huge < 0) {
        const char *e = getenv("FASTPERSIST_HUGE_STAGING");
        stage_huge = !(e && e[0] == '0');
    }
    if (!stage_huge || size < HUGE_SZ || align > HUGE_SZ) {
        void *p = NULL;
        return posix_memalign(&p, align, size) == 0 ? p : NULL;
    }
    size_t len = stage_map_len(size);
    char *raw = mmap(NULL, len + HUGE_SZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    char *p = (char *)(((uintptr_t)raw + HUGE_SZ - 1) & ~(uintptr_t)(HUGE_SZ - 1));
    if (p > raw)
        munmap(raw, (size_t)(p - raw));
    if (raw + len + HUGE_SZ > p + len)
        munmap(p + len, (size_t)(raw + len + HUGE_SZ - (p + len)));
#ifdef MADV_HUGEPAGE
    (void)madvise(p, len, MADV_HUGEPAGE);
#endif
    return p;
}

static void stage_free(void *p, size_t size, size_t align)
{
    if (!p)
        return;
    if (!stage_huge || size < HUGE_SZ || align > HUGE_SZ)
        free(p);
    else
        munmap(p, stage_map_len(size));
}

static void pool_drop_free_locked(void)
{
    for (size_t i = 0; i < pool.nfree; i++)
        stage_free(pool.free_list[i], pool.size, pool.align);
    pool.total -= pool.nfree;
    pool.nfree = 0;
}

int fp_pool_get(fp_sbuf_t *b, size_t size, size_t align)
{
    if (align < 4096)
        align = 4096;
    b->p = NULL;
    b->gen = 0;
    b->size = size;
    b->align = align;
    pthread_mutex_lock(&pool.mu);
    if (pool.total == pool.nfree && (pool.total == 0 || size > pool.size || align > pool.align)) {
        /* nothing is out: (re)shape the pool for this request */
        pool_drop_free_locked();
        if (size > pool.size || pool.total == 0)
            pool.size = size;
        if (align > pool.align || pool.total == 0)
            pool.align = align;
    }
    if (size <= pool.size && align <= pool.align) {
        if (pool.nfree) {
            b->p = pool.free_list[--pool.nfree];
        } else {
            b->p = stage_alloc(pool.size, pool.align);
            if (b->p)
                pool.total++;
        }
        if (b->p) {
            b->gen = pool.gen;
            b->size = pool.size;
            b->align = pool.align;
        }
        pthread_mutex_unlock(&pool.mu);
        return b->p ? 0 : ENOMEM;
    }
    pthread_mutex_unlock(&pool.mu);
    b->p = stage_alloc(size, align);
    b->align = align;
    return b->p ? 0 : ENOMEM;
}

void fp_pool_put(fp_sbuf_t *b)
{
    if (!b->p)
        return;
    if (b->gen) {
        pthread_mutex_lock(&pool.mu);
        if (b->gen == pool.gen && b->size == pool.size) {
            if (pool.nfree == pool.cap) {
                size_t nc = pool.cap ? pool.cap * 2 : 64;
                void **nl = realloc(pool.free_list, nc * sizeof(void *));
                if (nl) {
                    pool.free_list = nl;
                    pool.cap = nc;
                }
            }
            if (pool.nfree < pool.cap) {
                pool.free_list[pool.nfree++] = b->p;
                b->p = NULL;
            } else {
                pool.total--;
            }
        } else if (b->gen == pool.gen) {
            pool.total--;
        }
        pthread_mutex_unlock(&pool.mu);
    }
    stage_free(b->p, b->size, b->align);
    b->p = NULL;
}

void fp_pool_release(void)
{
    pthread_mutex_lock(&pool.mu);
    pool_drop_free_locked();
    pool.gen++;
    if (pool.gen == 0)
        pool.gen = 1;
    pool.total = 0;
    free(pool.free_list);
    pool.free_list = NULL;
    pool.cap = 0;
    pthread_mutex_unlock(&pool.mu);
}

size_t fp_pool_bytes(void)
{
    pthread_mutex_lock(&pool.mu);
    size_t r = pool.total * pool.size;
    pthread_mutex_unlock(&pool.mu);
    return r;
}

/* Transparent huge pages under a caller's memory (the 2 MiB-aligned interior of
 * [addr, addr+n)).  The bytes written from that memory with O_DIRECT are pinned and
 * mapped page by page for every request; on a virtual disk the host's share of that
 * work slows the guest's own cores while the write runs, less from huge pages than
 * from 4 KiB ones (benchmarks/disk_interference.py --pages; docs/performance.md).
 * advise: MADV_HUGEPAGE, so pages faulted in later are huge (a fresh buffer);
 * collapse: also MADV_COLLAPSE (Linux 6.1+), which moves memory already in use onto
 * huge pages now, copying it (slow on memory fresh to a VM).
 * Both are hints that leave the contents as they are.  Returns the bytes the calls
 * covered, 0 where the kernel refused (no THP, old kernel, memory pinned). */
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
uint64_t fp_advise_huge(uint64_t addr, uint64_t n, int collapse)
{
    uintptr_t lo = ((uintptr_t)addr + HUGE_SZ - 1) & ~(uintptr_t)(HUGE_SZ - 1);
    uintptr_t hi = ((uintptr_t)addr + (uintptr_t)n) & ~(uintptr_t)(HUGE_SZ - 1);
    if (hi <= lo)
        return 0;
#ifdef MADV_HUGEPAGE
    int rc = madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
    if (rc == 0 && collapse)
        rc = madvise((void *)lo, hi - lo, MADV_COLLAPSE);
    return rc == 0 ? (uint64_t)(hi - lo) : 0;
#else
    (void)collapse;
    return 0;
#endif
}

/* Fault in every page of a caller's memory for writing, on this one thread, before the
 * memory is needed (a snapshot arena warmed on the writer while training runs).  A page's
 * first touch is slow where the memory is fresh to the machine: a VM whose host reclaims
 * free 2 MiB blocks (free page reporting) backs them again on the next fault, an order of
 * magnitude slower than memory it still backs, and the whole guest slows meanwhile
 * (benchmarks/fresh_memory.py; figures in docs/performance.md).  So one thread: the same wall time as torch's strided
 * zero_() on its intra-op threads, less CPU.  MADV_POPULATE_WRITE (Linux 5.14) faults the
 * range in one call without changing the contents; older kernels get a touch per 4 KiB page
 * (a read-modify-write of one byte, which keeps the contents too, and is not racing anyone:
 * the caller owns the memory).  Memory it cannot fault in for writing (none left, not
 * mapped, read-only) is reported as its errno, never touched into a fault. */
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
/* Whether this kernel knows MADV_POPULATE_WRITE, asked once on a page of our own: its
 * EINVAL means both "unknown advice" and "memory not writable", and only the first may
 * fall back to touching (the second would fault). */
static int populate_supported(void)
{
    static int known = -1;
    if (known < 0) {
        void *pg = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        known = pg != MAP_FAILED && madvise(pg, 4096, MADV_POPULATE_WRITE) == 0;
        if (pg != MAP_FAILED)
            munmap(pg, 4096);
    }
    return known;
}

/* MADV_POPULATE_* holds the process's mmap lock (for reading) for as long as the call
 * runs: every mmap, munmap or mprotect of every other thread waits for it (a training
 * step's large allocations, io_uring setting up a ring), and faulting in fresh memory on
 * this VM takes seconds per GB.  So it goes a piece at a time, the lock free in between. */
#define POPULATE_PIECE (2u << 20)

static int populate_pieces(uintptr_t lo, uintptr_t hi, int advice)
{
    while (lo < hi) {
        uintptr_t next = (lo + POPULATE_PIECE) & ~(uintptr_t)(HUGE_SZ - 1); /* ends on a huge page */
        if (next <= lo || next > hi)
            next = hi;
        if (madvise((void *)lo, next - lo, advice))
            return errno;
        lo = next;
    }
    return 0;
}

int fp_populate(uint64_t addr, uint64_t n, int write, char *msg, size_t cap)
{
    if (addr > UINT64_MAX - 4096 || n > UINT64_MAX - 4096 - addr) { /* hi below must not wrap */
        snprintf(msg, cap, "invalid address or length: the range wraps around the address space");
        return FP_EARG;
    }
    const uintptr_t page = 4096;
    uintptr_t lo = (uintptr_t)addr & ~(page - 1);
    uintptr_t hi = ((uintptr_t)addr + (uintptr_t)n + page - 1) & ~(page - 1);
    if (n == 0)
        return 0;
    if (!write) { /* no touching fallback: a touch past a file's end is a SIGBUS, the advice an EFAULT */
        int rc = populate_pieces(lo, hi, MADV_POPULATE_READ);
        if (rc)
            return rc;
        /* Then read a byte of every page: on a VM, the first access of a page the disk
         * filled still waits for the host to map it for this guest (docs/performance.md),
         * and paid here it runs on the populating threads, beside the reads of other ranges,
         * instead of at the tensors' first use. */
        volatile const unsigned char *q = (volatile const unsigned char *)lo;
        unsigned char sink = 0;
        for (uintptr_t off = 0; off < hi - lo; off += page)
            sink ^= q[off];
        (void)sink;
        return 0;
    }
    if (populate_supported())
        return populate_pieces(lo, hi, MADV_POPULATE_WRITE);
    /* a kernel without it: touch instead */
    volatile unsigned char *p = (volatile unsigned char *)(uintptr_t)addr;
    for (uint64_t off = 0; off < n; off += page - ((uintptr_t)(p + off) & (page - 1)))
        p[off] = p[off];
    return 0;
}
