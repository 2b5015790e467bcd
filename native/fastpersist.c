/*
 * fastpersist.c -- native I/O engine of FastPersist (module fp_core._native).
 *
 * Knows bytes, files and offsets only.  Builds with a C compiler and kernel
 * headers: io_uring is reached through raw system calls (no liburing), the
 * CRC-32C uses SSE4.2 only inside functions compiled for it and chosen at run
 * time, with a portable slice-by-8 fallback.
 *
 * Layout of this file:
 *   1. CRC-32C (hardware, software, combine, fused copy)
 *   2. fault injection (process-wide test hook)
 *   3. process-wide staging-buffer pool
 *   4. small helpers (time, alignment detection, O_DIRECT)
 *   5. io_uring through raw syscalls
 *   6. the write pipeline (copy threads -> io_uring owner or pwrite pool)
 *   7. the read path
 *   8. Python types Engine and Reader, module functions
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <emmintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include <linux/io_uring.h>
#include <nmmintrin.h>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif

typedef long long ll;

/* ======================================================================
 * 1. CRC-32C (Castagnoli, reflected polynomial 0x82F63B78)
 *
 * Internally the "raw" CRC register is used (no pre/post inversion); the
 * public value is ~raw.  For raw registers:
 *     raw(init, A||B) = shift(raw(init, A), |B|) ^ raw(0, B)
 * where shift(c, n) multiplies c by x^(8n) modulo P.  That identity gives
 * both crc32c_combine and the 3-lane interleaved hardware loop.
 * ==================================================================== */

#define CRC32C_POLY 0x82F63B78u

static uint32_t crc_tab[8][256];
static uint32_t x2n_table[32];
static int have_sse42;
#define HW_LANE 4096 /* bytes per lane in the 3-lane interleaved loop */
static uint32_t hw_lane_shift; /* x^(8*HW_LANE) mod P */
/* Long inputs use longer lanes with software prefetch: checksumming from memory
 * (not cache) is limited by how many lines are in flight, and three 4 KiB lanes end
 * every 12 KiB, each time a new page the hardware prefetcher has to find again.
 * Measured on the 2-core VM this project runs on: 9.9 -> 13.9 GB/s on one thread,
 * 18.3 -> 25.7 GB/s on two (the snapshot copy and the overlap checksums of a save). */
#define HW_BIG_LANE (64 * 1024)
#define HW_PREFETCH 2048 /* bytes ahead of each lane */
static uint32_t hw_big_lane_shift; /* x^(8*HW_BIG_LANE) mod P */

/* a(x) * b(x) modulo P(x), reflected representation (x^0 is bit 31). */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) modulo P(x). */
static uint32_t x2nmodp(uint64_t n, unsigned k)
{
    uint32_t p = 1u << 31; /* x^0 */
    while (n) {
        if (n & 1)
            p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static void crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_tab[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_tab[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_tab[0][c & 0xff] ^ (c >> 8);
            crc_tab[k][n] = c;
        }
    }
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++)
        x2n_table[n] = p = multmodp(p, p);
    hw_lane_shift = x2nmodp(HW_LANE, 3);
    hw_big_lane_shift = x2nmodp(HW_BIG_LANE, 3);
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
}

/* Portable slice-by-8 on the raw register. */
static uint32_t crc_raw_sw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = crc_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c; /* little endian: low 4 bytes meet the register */
        c = crc_tab[7][w & 0xff] ^ crc_tab[6][(w >> 8) & 0xff] ^
            crc_tab[5][(w >> 16) & 0xff] ^ crc_tab[4][(w >> 24) & 0xff] ^
            crc_tab[3][(w >> 32) & 0xff] ^ crc_tab[2][(w >> 40) & 0xff] ^
            crc_tab[1][(w >> 48) & 0xff] ^ crc_tab[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = crc_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

/* Whole groups of three lanes of `lane` bytes from *pp, as three independent dependency
 * chains (they hide the 3-cycle latency of crc32) joined by multiplying with `shift`
 * (x^(8*lane) mod P).  With `prefetch`, each lane's line HW_PREFETCH bytes ahead is
 * requested; past a lane's end that touches the next lane's start: harmless (a
 * prefetch never faults) and those lines are read next anyway.  Inlined with constant
 * arguments, so each caller gets its own specialised loop. */
__attribute__((target("sse4.2"), always_inline))
static inline uint32_t crc_lanes_hw(uint32_t c, const unsigned char **pp, size_t *np, size_t lane,
                                    uint32_t shift, int prefetch)
{
    const unsigned char *p = *pp;
    size_t n = *np;
    while (n >= 3 * lane) {
        uint64_t c0 = c, c1 = 0, c2 = 0;
        const unsigned char *p1 = p + lane, *p2 = p + 2 * lane;
        for (size_t i = 0; i < lane; i += 64) {
            if (prefetch) {
                _mm_prefetch((const char *)p + i + HW_PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)p1 + i + HW_PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)p2 + i + HW_PREFETCH, _MM_HINT_T0);
            }
            for (size_t j = i; j < i + 64; j += 8) {
                uint64_t w0, w1, w2;
                memcpy(&w0, p + j, 8);
                memcpy(&w1, p1 + j, 8);
                memcpy(&w2, p2 + j, 8);
                c0 = _mm_crc32_u64(c0, w0);
                c1 = _mm_crc32_u64(c1, w1);
                c2 = _mm_crc32_u64(c2, w2);
            }
        }
        c = multmodp(shift, (uint32_t)c0) ^ (uint32_t)c1;
        c = multmodp(shift, c) ^ (uint32_t)c2;
        p += 3 * lane;
        n -= 3 * lane;
    }
    *pp = p;
    *np = n;
    return c;
}

__attribute__((target("sse4.2")))
static uint32_t crc_raw_hw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8(c, *p++);
        n--;
    }
    c = crc_lanes_hw(c, &p, &n, HW_BIG_LANE, hw_big_lane_shift, 1);
    c = crc_lanes_hw(c, &p, &n, HW_LANE, hw_lane_shift, 0);
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = _mm_crc32_u8(c, *p++);
    return c;
}

static inline uint32_t crc_raw(uint32_t c, const void *p, size_t n)
{
    return have_sse42 ? crc_raw_hw(c, p, n) : crc_raw_sw(c, p, n);
}

/* Public CRC-32C: continue the public value `crc` over n bytes. */
static uint32_t crc32c_update(uint32_t crc, const void *p, size_t n)
{
    return ~crc_raw(~crc, p, n);
}

static uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

#define FUSE_PIECE (3 * HW_BIG_LANE)

/* memcpy with the CRC fused: CRC over a 192 KiB source piece (three long lanes),
 * then copy it
 * while it is still in cache.  Returns the public CRC continued from crc
 * (or 0 without checksum). */
/* Copy with non-temporal stores when the destination is 16-byte aligned (staging
 * buffers always are). The staged bytes are next read by the device's DMA, not by
 * this CPU, so caching them only costs a read-for-ownership of every destination
 * line and evicts the source we are about to checksum: on a memory-bound machine this
 * is worth 10-35% of the copy. The caller fences (sfence) before handing the buffer
 * to the kernel. */
static void stream_copy(char *d, const char *s, size_t n)
{
    if (((uintptr_t)d & 15) || n < 256) {
        memcpy(d, s, n);
        return;
    }
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        s += 64;
        d += 64;
        n -= 64;
    }
    memcpy(d, s, n);
}

static uint32_t copy_crc_impl(void *dst, const void *src, size_t n, uint32_t crc, int checksum, int stream)
{
    uint32_t c = ~crc;
    const char *s = src;
    char *d = dst;
    while (n) {
        size_t k = n < FUSE_PIECE ? n : FUSE_PIECE;
        if (checksum)
            c = crc_raw(c, s, k);
        if (stream)
            stream_copy(d, s, k);
        else
            memcpy(d, s, k);
        s += k;
        d += k;
        n -= k;
    }
    if (stream)
        _mm_sfence();
    return checksum ? ~c : 0;
}

/* Into staging (written to disk next): streaming stores. */
static uint32_t copy_crc(void *dst, const void *src, size_t n, uint32_t crc, int checksum)
{
    return copy_crc_impl(dst, src, n, crc, checksum, 1);
}

/* Out of staging into the caller's memory (read next by the caller): cached stores. */
static uint32_t copy_crc_cached(void *dst, const void *src, size_t n, uint32_t crc, int checksum)
{
    return copy_crc_impl(dst, src, n, crc, checksum, 0);
}

/* ======================================================================
 * 2. Fault injection: a process-wide TEST HOOK (see inject_fault doc).
 * ==================================================================== */

static pthread_mutex_t fault_mu = PTHREAD_MUTEX_INITIALIZER;
static int fault_any;            /* fast-path flag, read atomically */
static int fault_write_errno;    /* one-shot; 0 = disarmed */
static ll fault_write_after;
static int fault_short_write;    /* stays armed */
static int fault_setup_errno;    /* io_uring_setup */
static int fault_odirect_errno;  /* O_DIRECT open */
static int fault_read_errno;     /* one-shot */
static ll fault_read_after;

static void fault_update_any(void)
{
    int any = fault_write_errno || fault_short_write || fault_setup_errno ||
              fault_odirect_errno || fault_read_errno;
    __atomic_store_n(&fault_any, any, __ATOMIC_RELEASE);
}

static int fault_check_range(int *armed_errno, ll after, ll off, ll len)
{
    if (!__atomic_load_n(&fault_any, __ATOMIC_ACQUIRE))
        return 0;
    int e = 0;
    pthread_mutex_lock(&fault_mu);
    if (*armed_errno && off + len > after) {
        e = *armed_errno;
        *armed_errno = 0;
        fault_update_any();
    }
    pthread_mutex_unlock(&fault_mu);
    return e;
}

static int fault_write(ll off, ll len) { return fault_check_range(&fault_write_errno, fault_write_after, off, len); }
static int fault_read(ll off, ll len) { return fault_check_range(&fault_read_errno, fault_read_after, off, len); }

static int fault_get(int *v)
{
    if (!__atomic_load_n(&fault_any, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&fault_mu);
    int e = *v;
    pthread_mutex_unlock(&fault_mu);
    return e;
}

/* First-attempt length under the "short_write" fault: half, rounded down to
 * the alignment, at least one block. */
static ll short_len(ll n, ll align)
{
    ll h = (n / 2) / align * align;
    if (h < align)
        h = align;
    return h < n ? h : n;
}

/* ======================================================================
 * 3. Staging-buffer pool (process wide, mutex protected, one buffer size).
 *
 * Buffers of `pool.size` bytes aligned to `pool.align` are kept between calls
 * so that per-iteration checkpoints do not pay page faults again.  A request
 * for at most pool.size bytes (and at most pool.align alignment) is served
 * from it; a larger request switches the pool to the new size when no pooled
 * buffer is out, otherwise it gets a private buffer freed on return.
 * release_staging() frees the free list and bumps a generation so buffers
 * still out are freed (not kept) when they come back.
 * ==================================================================== */

static struct {
    pthread_mutex_t mu;
    size_t size, align;
    void **free_list;
    size_t nfree, cap;
    size_t total; /* pooled buffers of the current generation, free + out */
    unsigned gen;
} pool = {PTHREAD_MUTEX_INITIALIZER, 0, 0, NULL, 0, 0, 0, 1};

typedef struct {
    void *p;
    size_t size, align;
    unsigned gen; /* 0 = private */
} sbuf_t;


/* Staging buffers of 2 MiB and more are mapped 2 MiB-aligned and advised as
 * transparent huge pages.  O_DIRECT pins the buffer's pages for every request
 * and a virtual disk copies them out of guest memory: with 4 KiB pages that is
 * 512x the page walks.  Measured on a firecracker VM: 2.22 GB/s zero-copy from
 * huge pages vs 1.92 GB/s from 4 KiB pages (benchmarks/README.md).  Where THP
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

static int pool_get(sbuf_t *b, size_t size, size_t align)
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

static void pool_put(sbuf_t *b)
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

static void pool_release(void)
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

static size_t pool_bytes(void)
{
    pthread_mutex_lock(&pool.mu);
    size_t r = pool.total * pool.size;
    pthread_mutex_unlock(&pool.mu);
    return r;
}

/* ======================================================================
 * 4. Helpers
 * ==================================================================== */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static ll align_up(ll v, ll a) { return (v + a - 1) / a * a; }
static ll align_down(ll v, ll a) { return v / a * a; }

/* File offsets and lengths handed in from Python come from parsed checkpoint files
 * too, so they are not trusted: a sum that does not fit a file offset is refused, never
 * computed (signed overflow is undefined; the -fwrapv in Python's CFLAGS would only
 * turn it into a negative end that passes every later comparison).  Returns 0 and
 * *end = off + len, or -1. */
static int end_of(ll off, ll len, ll *end) { return __builtin_add_overflow(off, len, end) ? -1 : 0; }

/* Whether [addr, addr + len) stays inside the address space (len >= 0). */
static int addr_range_ok(uint64_t addr, ll len) { return (uint64_t)len <= UINT64_MAX - addr; }

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

/* O_DIRECT alignment of fd: statx(STATX_DIOALIGN), else the device's logical
 * block size (partition, then its parent), else 4096; at least 512.
 * mem_align = max(4096, stx_dio_mem_align). */
static void detect_alignment(int fd, ll *align, ll *mem_align)
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
    int e = fault_get(&fault_odirect_errno);
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

static int spawn(pthread_t *t, void *(*fn)(void *), void *arg)
{
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setstacksize(&at, 256 * 1024);
    int r = pthread_create(t, &at, fn, arg);
    pthread_attr_destroy(&at);
    return r;
}

/* ======================================================================
 * 5. io_uring through raw system calls
 * ==================================================================== */

typedef struct {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_entries, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz, sqes_sz;
    unsigned tail; /* local SQ tail */
} ring_t;

static void ring_close(ring_t *R)
{
    if (R->sqes)
        munmap(R->sqes, R->sqes_sz);
    if (R->cq_ptr && R->cq_ptr != R->sq_ptr)
        munmap(R->cq_ptr, R->cq_sz);
    if (R->sq_ptr)
        munmap(R->sq_ptr, R->sq_sz);
    if (R->fd >= 0)
        close(R->fd);
    memset(R, 0, sizeof *R);
    R->fd = -1;
}

static int ring_setup(ring_t *R, unsigned entries)
{
    memset(R, 0, sizeof *R);
    R->fd = -1;
    int e = fault_get(&fault_setup_errno);
    if (e)
        return e;
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
    return 0;
fail:
    e = errno;
    ring_close(R);
    return e ? e : ENOMEM;
}

static struct io_uring_sqe *ring_sqe(ring_t *R)
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

static void ring_publish(ring_t *R)
{
    __atomic_store_n(R->sq_tail, R->tail, __ATOMIC_RELEASE);
}

static unsigned ring_unsubmitted(ring_t *R)
{
    return R->tail - __atomic_load_n(R->sq_head, __ATOMIC_ACQUIRE);
}

static int ring_enter(ring_t *R, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, R->fd, to_submit, min_complete, flags, NULL, 0);
}

/* ======================================================================
 * 6. The write pipeline
 * ==================================================================== */

enum { BK_URING = 0, BK_THREADPOOL = 1, BK_BUFFERED = 2 };
static const char *backend_names[] = {"io_uring", "threadpool", "buffered"};

typedef struct {
    ll off;
    uint64_t addr;
    ll len;
    int has_crc;  /* the caller knows this extent's CRC-32C (computed while copying it) */
    uint32_t crc;
} extent_t;

typedef struct {
    ll off, len;
    uint64_t src; /* direct (zero-copy) source address, else 0 */
    int direct;
    int e_lo, e_hi; /* overlapping extents [e_lo, e_hi) */
    size_t piece_base;
} item_t;

typedef struct {
    sbuf_t buf; /* staging buffer (lazily taken from the pool) */
    int item;
    char *ptr;  /* next byte to write */
    ll off;     /* its file offset */
    ll left;    /* bytes still to write for this item */
    ll cur_len; /* length of the request in flight */
    int first;
    int fault_errno;
} slot_t;

#define POLL_UD 0xFFFFFFFFFFFFFFFFull

typedef struct {
    /* engine */
    int fd, backend, efd, io_threads, qd;
    ring_t *ring;
    ll align, mem_align, chunk;
    int checksum;
    /* work */
    extent_t *ext;
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
} job_t;

static void job_fail_locked(job_t *j, int err)
{
    if (!j->err)
        j->err = err;
    j->abort = 1;
    pthread_cond_broadcast(&j->cv_slot);
    pthread_cond_broadcast(&j->cv_ready);
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
        j->t_busy0 = now_s();
}

static void inflight_dec_locked(job_t *j)
{
    if (--j->inflight == 0)
        j->io_wait += now_s() - j->t_busy0;
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
            j->pieces[it->piece_base] = crc32c_update(0, (const void *)(uintptr_t)it->src, (size_t)it->len);
        sl->ptr = (char *)(uintptr_t)it->src;
        return 0;
    }
    if (!sl->buf.p) {
        int e = pool_get(&sl->buf, (size_t)j->chunk, (size_t)j->mem_align);
        if (e)
            return e;
    }
    char *buf = sl->buf.p;
    ll cur = it->off, end = it->off + it->len;
    for (int e = it->e_lo; e < it->e_hi; e++) {
        extent_t *x = &j->ext[e];
        ll a = x->off > it->off ? x->off : it->off;
        ll b = x->off + x->len < end ? x->off + x->len : end;
        if (b <= a)
            continue;
        if (a > cur)
            memset(buf + (cur - it->off), 0, (size_t)(a - cur));
        uint32_t c = copy_crc(buf + (a - it->off), (const char *)(uintptr_t)x->addr + (a - x->off),
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
        double t0 = now_s();
        int err = fill_slot(j, s, k);
        busy += now_s() - t0;
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
        if (sl->first && fault_get(&fault_short_write))
            n = short_len(n, j->align);
        sl->first = 0;
        int fe = fault_write(sl->off, n);
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
        j->free_stack[j->n_free++] = s;
        if (err)
            job_fail_locked(j, err);
        else
            j->completed++;
        pthread_cond_signal(&j->cv_slot);
    }
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

/* ---- io_uring: the calling thread owns the ring ---- */

static int uring_prep_write(job_t *j, int s)
{
    slot_t *sl = &j->slots[s];
    struct io_uring_sqe *sqe = ring_sqe(j->ring);
    if (!sqe)
        return EBUSY; /* cannot happen: entries > queue depth */
    ll n = sl->left;
    if (sl->first && fault_get(&fault_short_write))
        n = short_len(n, j->align);
    sl->first = 0;
    sl->fault_errno = fault_write(sl->off, n);
    sl->cur_len = n;
    sqe->opcode = IORING_OP_WRITE;
    sqe->fd = j->fd;
    sqe->addr = (uint64_t)(uintptr_t)sl->ptr;
    sqe->len = (uint32_t)n;
    sqe->off = (uint64_t)sl->off;
    sqe->user_data = (uint64_t)s + 1;
    j->requests++;
    return 0;
}

static void uring_prep_poll(job_t *j)
{
    struct io_uring_sqe *sqe = ring_sqe(j->ring);
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

static void uring_owner(job_t *j)
{
    ring_t *R = j->ring;
    int inflight = 0, poll_armed = 0, broken = 0;
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
                    j->t_busy0 = now_s();
            }
        }
        int copy_done = j->copy_exited >= j->ncopy;
        int all_done = j->completed >= j->n_items;
        int ab = j->abort;
        pthread_mutex_unlock(&j->mu);
        ring_publish(R);

        if (inflight == 0 && (all_done || (ab && copy_done)))
            break;
        int want_poll = !all_done && !(ab && copy_done);
        if (want_poll && !poll_armed) {
            uring_prep_poll(j);
            ring_publish(R);
            poll_armed = 1;
        }
        unsigned pend = ring_unsubmitted(R);
        int r = ring_enter(R, pend, 1, IORING_ENTER_GETEVENTS);
        if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
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
                        j->io_wait += now_s() - j->t_busy0;
                    continue;
                }
            }
            pthread_mutex_lock(&j->mu);
            j->free_stack[j->n_free++] = s;
            if (err)
                job_fail_locked(j, err);
            else
                j->completed++;
            pthread_cond_signal(&j->cv_slot);
            pthread_mutex_unlock(&j->mu);
            if (--inflight == 0)
                j->io_wait += now_s() - j->t_busy0;
        }
        __atomic_store_n(R->cq_head, head, __ATOMIC_RELEASE);
        ring_publish(R);
    }
    if (broken) {
        j->leak_slots = inflight > 0;
        return;
    }
    /* Retire the eventfd poll so nothing of this call stays in the ring. */
    while (poll_armed) {
        wake_owner(j);
        int r = ring_enter(j->ring, ring_unsubmitted(R), 1, IORING_ENTER_GETEVENTS);
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

/* Run the whole pipeline (GIL released by the caller). */
static void job_run(job_t *j, int ncopy_req)
{
    pthread_t copy_t[64], io_t[256];
    int nc = 0, ni = 0;
    pthread_mutex_lock(&j->mu);
    j->ncopy = ncopy_req; /* provisional: threads only compare copy_exited to it */
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < ncopy_req; i++) {
        int r = spawn(&copy_t[nc], copy_main, j);
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
    if (j->backend == BK_URING) {
        uring_owner(j);
    } else {
        for (int i = 0; i < j->io_threads; i++) {
            int r = spawn(&io_t[ni], io_main, j);
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

/* ======================================================================
 * 7. Read path
 * ==================================================================== */

#define READ_INLINE_MAX (256 * 1024)
#define BUFFERED_READ_PIECE (256 * 1024)

typedef struct {
    int fd, direct, checksum;
    ll align, mem_align, chunk;
    ll off, len, base, aend;
    char *dst;
    int nchunks, next;
    uint32_t *crcs;
    int err; /* errno, or -1 for end of file */
    pthread_mutex_t mu;
} rjob_t;

/* pread until [pos, need) of the chunk is there; returns 0, errno or -1 (EOF) */
static int pread_full(rjob_t *rj, char *buf, ll file_off, ll need, ll cap)
{
    ll got = 0;
    while (got < need) {
        ll pos = rj->direct ? align_down(got, rj->align) : got;
        ll want = cap - pos;
        int fe = fault_read(file_off + pos, want);
        if (fe)
            return fe;
        ssize_t r = pread(rj->fd, buf + pos, (size_t)want, file_off + pos);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return errno;
        }
        if (r == 0 || pos + r <= got)
            return -1;
        got = pos + r;
    }
    return 0;
}

static void *read_main(void *arg)
{
    rjob_t *rj = arg;
    sbuf_t buf = {NULL, 0, 0, 0};
    for (;;) {
        pthread_mutex_lock(&rj->mu);
        if (rj->err || rj->next >= rj->nchunks) {
            pthread_mutex_unlock(&rj->mu);
            break;
        }
        int k = rj->next++;
        pthread_mutex_unlock(&rj->mu);
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
            err = pread_full(rj, dst_chunk, cs, ce - cs, ce - cs);
            if (!err && rj->checksum)
                rj->crcs[k] = crc32c_update(0, dst_chunk, (size_t)(ce - cs));
        } else if (rj->direct) {
            if (!buf.p) {
                ll span = rj->aend - rj->base;
                ll sz = span < rj->chunk ? span : rj->chunk;
                err = pool_get(&buf, (size_t)sz, (size_t)rj->mem_align);
            }
            if (!err)
                err = pread_full(rj, buf.p, cs, we - cs, ce - cs);
            if (!err)
                rj->crcs[k] = copy_crc_cached(rj->dst + (ws - rj->off), (char *)buf.p + (ws - cs),
                                       (size_t)(we - ws), 0, rj->checksum);
        } else {
            uint32_t c = 0;
            for (ll p = ws; p < we && !err; p += BUFFERED_READ_PIECE) {
                ll n = we - p < BUFFERED_READ_PIECE ? we - p : BUFFERED_READ_PIECE;
                char *d = rj->dst + (p - rj->off);
                err = pread_full(rj, d, p, n, n);
                if (!err && rj->checksum)
                    c = crc32c_update(c, d, (size_t)n);
            }
            rj->crcs[k] = c;
        }
        if (err) {
            pthread_mutex_lock(&rj->mu);
            if (!rj->err)
                rj->err = err;
            pthread_mutex_unlock(&rj->mu);
            break;
        }
    }
    pool_put(&buf);
    return NULL;
}

/* ======================================================================
 * 8. Python types
 * ==================================================================== */

typedef struct {
    PyObject_HEAD
    int fd;
    int closed;
    int busy;
    int backend;
    PyObject *path;
    PyObject *backend_str;
    PyObject *reason;
    ll alignment, mem_alignment;
    int qd, copy_threads, io_threads;
    ll chunk;
    ring_t ring;
    int efd;
} EngineObject;

static void engine_release(EngineObject *self)
{
    if (self->ring.fd >= 0 || self->ring.sq_ptr)
        ring_close(&self->ring);
    if (self->efd >= 0) {
        close(self->efd);
        self->efd = -1;
    }
    if (self->fd >= 0) {
        close(self->fd);
        self->fd = -1;
    }
    self->closed = 1;
}

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    EngineObject *self = (EngineObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->fd = -1;
    self->efd = -1;
    self->ring.fd = -1;
    self->closed = 1;
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
    engine_release(self);
    Py_XDECREF(self->path);
    Py_XDECREF(self->backend_str);
    Py_XDECREF(self->reason);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

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

/* The error of a write (writing) or of a read into the caller's memory.  EFAULT there
 * is about memory, not the file: zero-copy writes and direct reads hand the caller's
 * own pages to the kernel, and the kernel found them gone (freed or unmapped while the
 * call ran; staging buffers are ours and stay mapped).  "Bad address" next to a file
 * name reads like a problem with the file, so it is said in words. */
static PyObject *raise_io_error(int e, PyObject *path, int writing)
{
    if (e != EFAULT)
        return raise_errno_path(e, path);
    char msg[384];
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

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"path", "backend", "create", "queue_depth", "chunk_bytes",
                             "copy_threads", "io_threads", "tmpfile", "mode", NULL};
    PyObject *path = NULL;
    const char *backend = "auto";
    int create = 1, qd = 16, ct = 2, iot = 4, tmpfile = 0, mode = 0666;
    ll chunk = 4 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|$spiLiipi", kwlist, PyUnicode_FSDecoder, &path,
                                     &backend, &create, &qd, &chunk, &ct, &iot, &tmpfile, &mode))
        return -1;
    if (self->busy) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_RuntimeError, "Engine is in use by another thread");
        return -1;
    }
    engine_release(self);
    Py_XSETREF(self->path, path);
    int want; /* 0 auto, 1 io_uring, 2 threadpool, 3 buffered */
    if (!strcmp(backend, "auto"))
        want = 0;
    else if (!strcmp(backend, "io_uring"))
        want = 1;
    else if (!strcmp(backend, "threadpool"))
        want = 2;
    else if (!strcmp(backend, "buffered"))
        want = 3;
    else {
        PyErr_Format(PyExc_ValueError, "backend must be 'auto', 'io_uring', 'threadpool' or 'buffered', not '%s'", backend);
        return -1;
    }
    if (qd < 1 || qd > 4096) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be in [1, 4096], got %d", qd);
        return -1;
    }
    if (chunk < 4096 || chunk > (1LL << 30)) {
        PyErr_Format(PyExc_ValueError, "chunk_bytes must be in [4096, 1 GiB], got %lld", chunk);
        return -1;
    }
    if (ct < 1 || ct > 64) {
        PyErr_Format(PyExc_ValueError, "copy_threads must be in [1, 64], got %d", ct);
        return -1;
    }
    if (iot < 1 || iot > 256) {
        PyErr_Format(PyExc_ValueError, "io_threads must be in [1, 256], got %d", iot);
        return -1;
    }
    if (mode < 0 || mode > 07777) {
        PyErr_Format(PyExc_ValueError, "mode must be in [0, 0o7777], got %#o", mode);
        return -1;
    }
    if (tmpfile && !create) {
        PyErr_SetString(PyExc_ValueError, "tmpfile=True creates a new unnamed file: create=False does not apply");
        return -1;
    }
    PyObject *pbytes = PyUnicode_EncodeFSDefault(path);
    if (!pbytes)
        return -1;
    const char *cpath = PyBytes_AS_STRING(pbytes);
    /* tmpfile: path is a directory and the file an unnamed inode in it, linked into place
     * by the caller (linkat of /proc/self/fd/N) once complete; a crash before leaves
     * nothing behind.  Not O_EXCL: that would forbid the link.  Kernels or file systems
     * without it answer EISDIR (old kernels: O_TMPFILE contains O_DIRECTORY), EOPNOTSUPP
     * or EINVAL, which the caller takes as "use a named file". */
    int flags = tmpfile ? O_TMPFILE | O_WRONLY | O_CLOEXEC
                        : O_WRONLY | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
    int fd, oerr = 0;
    Py_BEGIN_ALLOW_THREADS
    fd = open(cpath, flags, (mode_t)mode);
    if (fd < 0)
        oerr = errno;
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        Py_DECREF(pbytes);
        raise_errno_path(oerr, path);
        return -1;
    }
    char reason[512] = "";
    int bk = BK_BUFFERED;
    int e = 0, ring_fail = 0, odirect_fail = 0;
    if (want == 3) {
        bk = BK_BUFFERED;
    } else {
        e = enable_odirect(fd);
        if (e) {
            if (want == 0 && e == EINVAL) {
                bk = BK_BUFFERED;
                snprintf(reason, sizeof reason,
                         "O_DIRECT not supported on this file system: %s (%s); using buffered pwrite from a pthread pool",
                         strerror(e), errname(e));
                e = 0;
            } else {
                odirect_fail = 1;
                goto fail;
            }
        } else {
            bk = want == 2 ? BK_THREADPOOL : BK_URING;
        }
    }
    if (bk == BK_URING) {
        e = ring_setup(&self->ring, (unsigned)qd + 1);
        if (!e) {
            self->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
            if (self->efd < 0) {
                e = errno;
                ring_close(&self->ring);
            }
        }
        if (e) {
            ring_fail = 1;
            if (want == 0) {
                bk = BK_THREADPOOL;
                snprintf(reason, sizeof reason, "io_uring_setup failed: %s (%s); using a pthread pool of pwrite",
                         strerror(e), errname(e));
                e = 0;
            } else {
                goto fail;
            }
        }
    }
    detect_alignment(fd, &self->alignment, &self->mem_alignment);
    Py_DECREF(pbytes);
    self->fd = fd;
    self->closed = 0;
    self->backend = bk;
    self->qd = qd;
    self->chunk = align_up(chunk, self->alignment);
    self->copy_threads = ct;
    self->io_threads = iot;
    Py_XSETREF(self->backend_str, PyUnicode_FromString(backend_names[bk]));
    Py_XSETREF(self->reason, PyUnicode_FromString(reason));
    if (!self->backend_str || !self->reason)
        return -1;
    return 0;
fail:
    close(fd);
    if (create && !tmpfile)
        unlink(cpath); /* we created it with O_EXCL; an unnamed file goes with its fd */
    Py_DECREF(pbytes);
    if (ring_fail || odirect_fail) {
        char msg[256];
        if (odirect_fail)
            snprintf(msg, sizeof msg, "O_DIRECT refused by this file system: %s (%s); use backend='auto' or "
                     "'buffered' here", strerror(e), errname(e));
        else
            snprintf(msg, sizeof msg, "io_uring unavailable: io_uring_setup failed: %s (%s)", strerror(e), errname(e));
        raise_errno_msg_path(e, msg, path);
        return -1;
    }
    raise_errno_path(e, path);
    return -1;
}

static int engine_check(EngineObject *self)
{
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Engine");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is in use by another thread");
        return -1;
    }
    return 0;
}

static int parse_extents(PyObject *obj, extent_t **out, int *nout)
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
    extent_t *ext = PyMem_Malloc(sizeof(extent_t) * (n ? n : 1));
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

static int items_push(item_t **items, int *n, int *cap, item_t it)
{
    if (*n == *cap) {
        if (*cap > INT_MAX / 2)
            return -1; /* the caller bounds the count well below */
        int nc = *cap ? *cap * 2 : 64;
        item_t *ni = PyMem_Realloc(*items, sizeof(item_t) * nc);
        if (!ni)
            return -1;
        *items = ni;
        *cap = nc;
    }
    (*items)[(*n)++] = it;
    return 0;
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
    ll A = self->alignment;
    if (start < 0 || end < start) {
        PyErr_Format(PyExc_ValueError, "invalid range [start=%lld, end=%lld)", start, end);
        return NULL;
    }
    if (start % A) {
        PyErr_Format(PyExc_ValueError, "start=%lld is not a multiple of the alignment %lld", start, A);
        return NULL;
    }
    /* The range is padded up to the alignment and cut into chunks: end + alignment +
     * chunk must still be a file offset.  No file system takes files that large anyway. */
    ll chunk = self->chunk;
    if (end > LLONG_MAX - chunk - A) {
        PyErr_Format(PyExc_ValueError,
                     "end=%lld is too close to the largest file offset (2**63 - 1) to be written in "
                     "chunks of %lld bytes", end, chunk);
        return NULL;
    }
    extent_t *ext = NULL;
    int n_ext = 0;
    if (parse_extents(ext_obj, &ext, &n_ext))
        return NULL;
    ll prev_end = start;
    for (int i = 0; i < n_ext; i++) {
        /* off >= prev_end >= start >= 0 here, so end - off cannot overflow; off + len
         * could (both from the caller) and is only formed once it is known to be <= end */
        if (ext[i].len < 0 || ext[i].off < prev_end || ext[i].off > end || ext[i].len > end - ext[i].off) {
            PyErr_Format(PyExc_ValueError,
                         "extent %d (file_offset=%lld, length=%lld) is negative, overlaps the previous one, "
                         "is out of order or lies outside [start=%lld, end=%lld)",
                         i, ext[i].off, ext[i].len, start, end);
            PyMem_Free(ext);
            return NULL;
        }
        if (ext[i].len > 0 && ext[i].addr == 0) {
            PyErr_Format(PyExc_ValueError, "extent %d has a NULL address", i);
            PyMem_Free(ext);
            return NULL;
        }
        if (!addr_range_ok(ext[i].addr, ext[i].len)) {
            PyErr_Format(PyExc_ValueError, "extent %d: addr=%#llx + length=%lld wraps around the address space",
                         i, (unsigned long long)ext[i].addr, ext[i].len);
            PyMem_Free(ext);
            return NULL;
        }
        prev_end = ext[i].off + ext[i].len;
    }
    ll endp = align_up(end, A);
    /* Items are counted in an int: at most two per chunk of the range (a chunk cut by a
     * zero-copy extent's start) and two more per extent. */
    if ((endp - start) / chunk + 1 > (INT_MAX - 2 * (ll)n_ext - 2) / 2) {
        PyErr_Format(PyExc_ValueError, "range [start=%lld, end=%lld) has too many chunks of %lld bytes", start,
                     end, chunk);
        PyMem_Free(ext);
        return NULL;
    }

    /* ---- cut the range into items ---- */
    item_t *items = NULL;
    int n_items = 0, cap = 0;
    size_t n_pieces = 0;
    int *next_elig = NULL;
    char *elig = NULL;
    job_t j;
    memset(&j, 0, sizeof j);
    PyObject *result = NULL;
    uint32_t *crcs = NULL;
    if (zero_copy) {
        next_elig = PyMem_Malloc(sizeof(int) * (n_ext + 1));
        elig = PyMem_Malloc(n_ext + 1);
        if (!next_elig || !elig) {
            PyErr_NoMemory();
            goto out;
        }
        next_elig[n_ext] = n_ext;
        for (int i = n_ext - 1; i >= 0; i--) {
            elig[i] = ext[i].len > 0 && ext[i].off % A == 0 && ext[i].len % A == 0 &&
                      ext[i].addr % (uint64_t)self->mem_alignment == 0;
            next_elig[i] = elig[i] ? i : next_elig[i + 1];
        }
    }
    {
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
                    if (items_push(&items, &n_items, &cap, it)) {
                        PyErr_NoMemory();
                        goto out;
                    }
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
            if (items_push(&items, &n_items, &cap, it)) {
                PyErr_NoMemory();
                goto out;
            }
            pos = item_end;
            while (e < n_ext && ext[e].off + ext[e].len <= pos)
                e++;
        }
    }

    crcs = PyMem_Calloc(n_ext ? n_ext : 1, sizeof(uint32_t));
    j.pieces = PyMem_Calloc(n_pieces ? n_pieces : 1, sizeof(uint32_t));
    j.n_slots = self->qd + self->copy_threads;
    if (j.n_slots > n_items)
        j.n_slots = n_items > 0 ? n_items : 1;
    j.slots = PyMem_Calloc(j.n_slots, sizeof(slot_t));
    j.free_stack = PyMem_Malloc(sizeof(int) * j.n_slots);
    j.rq = PyMem_Malloc(sizeof(int) * j.n_slots);
    if (!crcs || !j.pieces || !j.slots || !j.free_stack || !j.rq) {
        PyErr_NoMemory();
        goto out;
    }
    for (int i = 0; i < j.n_slots; i++)
        j.free_stack[i] = j.n_slots - 1 - i;
    j.n_free = j.n_slots;
    j.fd = self->fd;
    j.backend = self->backend;
    j.efd = self->backend == BK_URING ? self->efd : -1;
    j.io_threads = self->io_threads;
    j.qd = self->qd;
    j.ring = &self->ring;
    j.align = A;
    j.mem_align = self->mem_alignment;
    j.chunk = chunk;
    j.checksum = checksum;
    j.ext = ext;
    j.n_ext = n_ext;
    j.items = items;
    j.n_items = n_items;
    pthread_mutex_init(&j.mu, NULL);
    pthread_cond_init(&j.cv_slot, NULL);
    pthread_cond_init(&j.cv_ready, NULL);

    double t0 = now_s(), wall;
    int ncopy = self->copy_threads < n_items ? self->copy_threads : n_items;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (n_items > 0 && self->backend != BK_BUFFERED) {
        /* Preallocate the part of the range past EOF.  O_DIRECT writes that
         * extend a file (or fill holes) need ext4's exclusive inode lock: they
         * cannot be issued inline by io_uring (punted to io-wq workers, which
         * serialize writes to one inode) and serialize pwrite threads too.
         * Writes into preallocated (unwritten) blocks run in parallel.  This
         * sets the file size to align_up(end); the caller truncates anyway.
         * Failure (EOPNOTSUPP, ENOSPC...) is left to the writes to report. */
        struct stat st;
        if (fstat(self->fd, &st) == 0 && st.st_size < endp) {
            ll from = st.st_size > start ? align_down(st.st_size, A) : start;
            (void)fallocate(self->fd, 0, from, endp - from);
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
                    crcs[e] = crc32c_combine(crcs[e], j.pieces[it->piece_base + (size_t)(e - it->e_lo)],
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
        pool_put(&j.slots[i].buf);
    }
    wall = now_s() - t0;
    Py_END_ALLOW_THREADS
    self->busy = 0;
    pthread_mutex_destroy(&j.mu);
    pthread_cond_destroy(&j.cv_slot);
    pthread_cond_destroy(&j.cv_ready);
    if (j.err) {
        raise_io_error(j.err, self->path, 1);
        goto out;
    }
    {
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
        ll direct_bytes = 0;
        for (int k = 0; k < n_items; k++)
            if (items[k].direct)
                direct_bytes += items[k].len;
        PyObject *stats = Py_BuildValue("{s:L,s:L,s:L,s:d,s:d,s:d,s:l,s:l,s:O}", "bytes", end - start, "bytes_padded",
                                        endp - end, "zero_copy_bytes", direct_bytes, "seconds", wall,
                                        "copy_seconds", j.copy_seconds,
                                        "io_wait_seconds", j.io_wait, "requests", j.requests, "short_writes",
                                        j.short_writes, "backend", self->backend_str);
        if (!stats) {
            Py_DECREF(lst);
            goto out;
        }
        result = Py_BuildValue("(NN)", lst, stats);
    }
out:
    PyMem_Free(ext);
    PyMem_Free(items);
    PyMem_Free(next_elig);
    PyMem_Free(elig);
    PyMem_Free(crcs);
    PyMem_Free(j.pieces);
    PyMem_Free(j.slots);
    PyMem_Free(j.free_stack);
    PyMem_Free(j.rq);
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
    int r, e = 0;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    r = ftruncate(self->fd, size);
    if (r < 0)
        e = errno;
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (r < 0)
        return raise_errno_path(e, self->path);
    Py_RETURN_NONE;
}

static PyObject *Engine_sync(EngineObject *self, PyObject *unused)
{
    if (engine_check(self))
        return NULL;
    int r, e = 0;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    r = fdatasync(self->fd);
    if (r < 0)
        e = errno;
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (r < 0)
        return raise_errno_path(e, self->path);
    Py_RETURN_NONE;
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is in use by another thread");
        return NULL;
    }
    engine_release(self);
    Py_RETURN_NONE;
}

static PyObject *Engine_fileno(EngineObject *self, PyObject *unused)
{
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Engine");
        return NULL;
    }
    return PyLong_FromLong(self->fd);
}

static PyObject *Engine_enter(EngineObject *self, PyObject *unused)
{
    if (self->closed) {
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

static PyObject *Engine_get_closed(EngineObject *self, void *c) { return PyBool_FromLong(self->closed); }

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
    {"alignment", T_LONGLONG, offsetof(EngineObject, alignment), READONLY, "O_DIRECT offset/length alignment"},
    {"mem_alignment", T_LONGLONG, offsetof(EngineObject, mem_alignment), READONLY, "staging buffer alignment"},
    {"queue_depth", T_INT, offsetof(EngineObject, qd), READONLY, NULL},
    {"chunk_bytes", T_LONGLONG, offsetof(EngineObject, chunk), READONLY, "chunk size (rounded up to alignment)"},
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
    int fd;
    int closed, busy;
    char direct; /* T_BOOL member */
    ll size, alignment, mem_alignment;
    PyObject *path;
} ReaderObject;

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    ReaderObject *self = (ReaderObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->fd = -1;
    self->closed = 1;
    self->path = PyUnicode_FromString("");
    if (!self->path) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void reader_release(ReaderObject *self)
{
    if (self->fd >= 0) {
        close(self->fd);
        self->fd = -1;
    }
    self->closed = 1;
}

static void Reader_dealloc(ReaderObject *self)
{
    reader_release(self);
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
    reader_release(self);
    Py_XSETREF(self->path, path);
    PyObject *pbytes = PyUnicode_EncodeFSDefault(path);
    if (!pbytes)
        return -1;
    const char *cpath = PyBytes_AS_STRING(pbytes);
    int fd = -1, e = 0, used_direct = 0;
    struct stat st;
    Py_BEGIN_ALLOW_THREADS
    if (direct) {
        e = fault_get(&fault_odirect_errno);
        if (!e) {
            fd = open(cpath, O_RDONLY | O_CLOEXEC | O_DIRECT);
            e = fd < 0 ? errno : 0;
        }
        if (fd >= 0)
            used_direct = 1;
    }
    if (fd < 0 && (!direct || e == EINVAL)) {
        fd = open(cpath, O_RDONLY | O_CLOEXEC);
        e = fd < 0 ? errno : 0;
    }
    if (fd >= 0 && fstat(fd, &st) < 0) {
        e = errno;
        close(fd);
        fd = -1;
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(pbytes);
    if (fd < 0) {
        raise_errno_path(e, path);
        return -1;
    }
    self->fd = fd;
    self->closed = 0;
    self->direct = used_direct;
    self->size = st.st_size;
    detect_alignment(fd, &self->alignment, &self->mem_alignment);
    return 0;
}

static PyObject *Reader_read_into(ReaderObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"file_offset", "addr", "length", "checksum", "threads", "chunk_bytes", NULL};
    ll off, len, chunk = 4 << 20;
    unsigned long long addr;
    int checksum = 0, threads = 2;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LKL|$piL", kwlist, &off, &addr, &len, &checksum, &threads, &chunk))
        return NULL;
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Reader");
        return NULL;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Reader is in use by another thread");
        return NULL;
    }
    if (off < 0 || len < 0) {
        PyErr_Format(PyExc_ValueError, "invalid read (file_offset=%lld, length=%lld)", off, len);
        return NULL;
    }
    ll end;
    if (end_of(off, len, &end)) {
        PyErr_Format(PyExc_ValueError, "invalid read: file_offset=%lld + length=%lld overflows a 64-bit file offset",
                     off, len);
        return NULL;
    }
    if (len > 0 && addr == 0) {
        PyErr_SetString(PyExc_ValueError, "addr is NULL");
        return NULL;
    }
    if (!addr_range_ok(addr, len)) {
        PyErr_Format(PyExc_ValueError, "invalid read: addr=%#llx + length=%lld wraps around the address space", addr,
                     len);
        return NULL;
    }
    if (threads < 1 || threads > 64) {
        PyErr_Format(PyExc_ValueError, "threads must be in [1, 64], got %d", threads);
        return NULL;
    }
    if (chunk < 4096 || chunk > (1LL << 30)) {
        PyErr_Format(PyExc_ValueError, "chunk_bytes must be in [4096, 1 GiB], got %lld", chunk);
        return NULL;
    }
    if (len == 0)
        return PyLong_FromLong(0);
    /* The end of file first: a length from a damaged or hostile file is an EOFError
     * before anything is sized by it. */
    struct stat st;
    int serr = 0;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (fstat(self->fd, &st) < 0)
        serr = errno;
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (serr)
        return raise_errno_path(serr, self->path);
    if (end > st.st_size) {
        PyErr_Format(PyExc_EOFError, "%R: read of %lld bytes at offset %lld reaches past end of file (size %lld)",
                     self->path, len, off, (ll)st.st_size);
        return NULL;
    }
    rjob_t rj;
    memset(&rj, 0, sizeof rj);
    rj.fd = self->fd;
    rj.direct = self->direct;
    rj.checksum = checksum;
    rj.align = self->direct ? self->alignment : 1;
    rj.mem_align = self->mem_alignment;
    rj.chunk = self->direct ? align_up(chunk, self->alignment) : chunk;
    /* chunks are aligned and walked past the end by up to a chunk: only a file within
     * that distance of 2**63 - 1 (none on a real file system) could get here */
    if (end > LLONG_MAX - rj.chunk - rj.align) {
        PyErr_Format(PyExc_ValueError,
                     "invalid read: file_offset=%lld + length=%lld is too close to the largest file offset "
                     "(2**63 - 1)", off, len);
        return NULL;
    }
    rj.off = off;
    rj.len = len;
    rj.dst = (char *)(uintptr_t)addr;
    rj.base = align_down(off, rj.align);
    rj.aend = align_up(end, rj.align);
    ll nch = (rj.aend - rj.base + rj.chunk - 1) / rj.chunk;
    if (nch > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "read too large for chunk_bytes");
        return NULL;
    }
    rj.nchunks = (int)nch;
    rj.crcs = PyMem_Calloc(rj.nchunks, sizeof(uint32_t));
    if (!rj.crcs)
        return PyErr_NoMemory();
    pthread_mutex_init(&rj.mu, NULL);
    int nthr = (len < READ_INLINE_MAX) ? 1 : threads;
    if (nthr > rj.nchunks)
        nthr = rj.nchunks;
    uint32_t crc = 0;
    ll fsize = -1;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_t t[64];
    int n = 0;
    for (int i = 1; i < nthr; i++) {
        if (spawn(&t[n], read_main, &rj) != 0)
            break; /* fewer threads is fine */
        n++;
    }
    read_main(&rj);
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
    if (!rj.err && checksum) {
        for (int k = 0; k < rj.nchunks; k++) {
            ll cs = rj.base + (ll)k * rj.chunk;
            ll ce = cs + rj.chunk < rj.aend ? cs + rj.chunk : rj.aend;
            ll ws = off > cs ? off : cs;
            ll we = end < ce ? end : ce;
            crc = crc32c_combine(crc, rj.crcs[k], (uint64_t)(we - ws));
        }
    }
    if (rj.err == -1 && fstat(rj.fd, &st) == 0) /* the file shrank meanwhile */
        fsize = st.st_size;
    Py_END_ALLOW_THREADS
    self->busy = 0;
    pthread_mutex_destroy(&rj.mu);
    PyMem_Free(rj.crcs);
    if (rj.err == -1) {
        PyErr_Format(PyExc_EOFError, "%R: read of %lld bytes at offset %lld reaches past end of file (size %lld)",
                     self->path, len, off, fsize);
        return NULL;
    }
    if (rj.err)
        return raise_io_error(rj.err, self->path, 0);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *Reader_close(ReaderObject *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Reader is in use by another thread");
        return NULL;
    }
    reader_release(self);
    Py_RETURN_NONE;
}

static PyObject *Reader_fileno(ReaderObject *self, PyObject *unused)
{
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Reader");
        return NULL;
    }
    return PyLong_FromLong(self->fd);
}

static PyObject *Reader_enter(ReaderObject *self, PyObject *unused)
{
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed Reader");
        return NULL;
    }
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Reader_exit(ReaderObject *self, PyObject *args) { return Reader_close(self, NULL); }

static PyObject *Reader_get_closed(ReaderObject *self, void *c) { return PyBool_FromLong(self->closed); }

static PyMethodDef Reader_methods[] = {
    {"read_into", (PyCFunction)(void (*)(void))Reader_read_into, METH_VARARGS | METH_KEYWORDS,
     "read_into(file_offset, addr, length, *, checksum=False, threads=2, chunk_bytes=4<<20) -> crc\n\n"
     "Read [file_offset, file_offset+length) into memory at addr (any alignment).\n"
     "Returns the CRC-32C of the bytes read when checksum, else 0.  EOFError past the end;\n"
     "ValueError when file_offset + length overflows a file offset; OSError(EFAULT) when the\n"
     "destination is unmapped under a read the kernel makes into it."},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "close(); idempotent"},
    {"fileno", (PyCFunction)Reader_fileno, METH_NOARGS, NULL},
    {"__enter__", (PyCFunction)Reader_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Reader_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Reader_members[] = {
    {"path", T_OBJECT_EX, offsetof(ReaderObject, path), READONLY, NULL},
    {"size", T_LONGLONG, offsetof(ReaderObject, size), READONLY, "file size at open"},
    {"direct", T_BOOL, offsetof(ReaderObject, direct), READONLY, "whether O_DIRECT is in use"},
    {"alignment", T_LONGLONG, offsetof(ReaderObject, alignment), READONLY, NULL},
    {"mem_alignment", T_LONGLONG, offsetof(ReaderObject, mem_alignment), READONLY, NULL},
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
        r = crc32c_update((uint32_t)crc, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c_update((uint32_t)crc, view.buf, (size_t)view.len);
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
    if (len < 0 || (len > 0 && addr == 0) || !addr_range_ok(addr, len)) {
        PyErr_SetString(PyExc_ValueError, "invalid address or length");
        return NULL;
    }
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = crc32c_update((uint32_t)crc, (const void *)(uintptr_t)addr, (size_t)len);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(r);
}

static PyObject *mod_copy_crc32c(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dst", "src", "length", NULL};
    unsigned long long dst, src;
    ll len;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKL", kwlist, &dst, &src, &len))
        return NULL;
    if (len < 0 || (len > 0 && (dst == 0 || src == 0)) || !addr_range_ok(dst, len) || !addr_range_ok(src, len)) {
        PyErr_SetString(PyExc_ValueError, "invalid address or length");
        return NULL;
    }
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = copy_crc((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)len, 0, 1);
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
    return PyLong_FromUnsignedLong(crc32c_combine((uint32_t)c1, (uint32_t)c2, (uint64_t)len2));
}

/* Transparent huge pages under a caller's memory (the 2 MiB-aligned interior of
 * [addr, addr+n)).  The bytes written from that memory with O_DIRECT are pinned and
 * mapped page by page for every request; on a virtual disk the host's share of that
 * work slows the guest's own cores while the write runs.  Measured on this project's
 * 2-core VM, alternating runs: a write from 4 KiB pages cost a CPU-bound training step
 * 0.02-0.09 s per GB written, from huge pages -0.01-0.03 s, lower in every pair (and it
 * wrote 2.0-3.0 GB/s against 1.7-2.6; benchmarks/disk_interference.py --pages).
 * advise: MADV_HUGEPAGE, so pages faulted in later are huge (a fresh buffer);
 * collapse: also MADV_COLLAPSE (Linux 6.1+), which moves memory already in use onto
 * huge pages now, copying it (slow: ~0.3 GB/s on first use of guest memory here).
 * Both are hints that leave the contents as they are.  Returns the bytes the calls
 * covered, 0 where the kernel refused (no THP, old kernel, memory pinned). */
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
static PyObject *mod_advise_huge(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"addr", "length", "collapse", NULL};
    unsigned long long addr, n;
    int collapse = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|$p", kwlist, &addr, &n, &collapse))
        return NULL;
    uintptr_t lo = ((uintptr_t)addr + HUGE_SZ - 1) & ~(uintptr_t)(HUGE_SZ - 1);
    uintptr_t hi = ((uintptr_t)addr + (uintptr_t)n) & ~(uintptr_t)(HUGE_SZ - 1);
    if (hi <= lo)
        return PyLong_FromLong(0);
    int rc = 0;
#ifdef MADV_HUGEPAGE
    Py_BEGIN_ALLOW_THREADS
    rc = madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
    if (rc == 0 && collapse)
        rc = madvise((void *)lo, hi - lo, MADV_COLLAPSE);
    Py_END_ALLOW_THREADS
#else
    rc = -1;
#endif
    return PyLong_FromUnsignedLongLong(rc == 0 ? (unsigned long long)(hi - lo) : 0);
}

/* Fault in every page of a caller's memory for writing, on this one thread, before the
 * memory is needed (a snapshot arena warmed on the writer while training runs).  A page's
 * first touch is slow where the memory is fresh to the machine: on this project's VM the
 * host reclaims free 2 MiB blocks (free page reporting) and backs them again on the next
 * fault, ~2.3 s per GB against ~0.13 s for memory it still backs, and the whole guest
 * slows meanwhile (benchmarks/fresh_memory.py: training lost about the warm-up's time at
 * any thread count or nice level).  So one thread: the same wall time as torch's strided
 * zero_() on its intra-op threads, less CPU.  MADV_POPULATE_WRITE (Linux 5.14) faults the range in one call
 * without changing the contents; older kernels get a touch per 4 KiB page (a read-modify-
 * write of one byte, which keeps the contents too, and is not racing anyone: the caller
 * owns the memory).  Returns the bytes covered; memory it cannot fault in for writing (none
 * left, not mapped, read-only) raises OSError. */
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

static PyObject *mod_populate(PyObject *m, PyObject *args)
{
    unsigned long long addr, n;
    if (!PyArg_ParseTuple(args, "KK", &addr, &n))
        return NULL;
    if (addr > UINT64_MAX - 4096 || n > UINT64_MAX - 4096 - addr) { /* hi below must not wrap */
        PyErr_SetString(PyExc_ValueError, "invalid address or length: the range wraps around the address space");
        return NULL;
    }
    const uintptr_t page = 4096;
    uintptr_t lo = (uintptr_t)addr & ~(page - 1);
    uintptr_t hi = ((uintptr_t)addr + (uintptr_t)n + page - 1) & ~(page - 1);
    if (n == 0)
        return PyLong_FromLong(0);
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    if (populate_supported()) {
        err = madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE) ? errno : 0;
    } else {  /* a kernel without it: touch instead */
        volatile unsigned char *p = (volatile unsigned char *)(uintptr_t)addr;
        for (unsigned long long off = 0; off < n; off += page - ((uintptr_t)(p + off) & (page - 1)))
            p[off] = p[off];
    }
    Py_END_ALLOW_THREADS
    if (err) {  /* ENOMEM, EFAULT, EINVAL (not writable): say so, never touch into a fault */
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *mod_release_staging(PyObject *m, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    pool_release();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *mod_staging_bytes(PyObject *m, PyObject *unused)
{
    return PyLong_FromSize_t(pool_bytes());
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
    int e = 5;
    int explicit_errno = err_obj != Py_None;
    if (explicit_errno) {
        e = (int)PyLong_AsLong(err_obj);
        if (e == -1 && PyErr_Occurred())
            return NULL;
        if (e <= 0) {
            PyErr_SetString(PyExc_ValueError, "errno must be > 0");
            return NULL;
        }
    }
    pthread_mutex_lock(&fault_mu);
    int bad = 0;
    if (!k) {
        fault_write_errno = fault_short_write = fault_setup_errno = fault_odirect_errno = fault_read_errno = 0;
    } else if (!strcmp(k, "write")) {
        fault_write_errno = e;
        fault_write_after = after;
    } else if (!strcmp(k, "short_write")) {
        fault_short_write = 1;
    } else if (!strcmp(k, "io_uring_setup")) {
        fault_setup_errno = e;
    } else if (!strcmp(k, "o_direct")) {
        fault_odirect_errno = explicit_errno ? e : EINVAL;
    } else if (!strcmp(k, "read")) {
        fault_read_errno = e;
        fault_read_after = after;
    } else {
        bad = 1;
    }
    fault_update_any();
    pthread_mutex_unlock(&fault_mu);
    if (bad) {
        PyErr_Format(PyExc_ValueError,
                     "unknown fault kind %R (expected 'write', 'short_write', 'io_uring_setup', 'o_direct', 'read' or None)",
                     kind);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))mod_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, crc=0) -> int: CRC-32C (Castagnoli) of a buffer, continuing crc."},
    {"crc32c_addr", (PyCFunction)(void (*)(void))mod_crc32c_addr, METH_VARARGS | METH_KEYWORDS,
     "crc32c_addr(addr, length, crc=0) -> int: CRC-32C of raw memory (GIL released)."},
    {"copy_crc32c", (PyCFunction)(void (*)(void))mod_copy_crc32c, METH_VARARGS | METH_KEYWORDS,
     "copy_crc32c(dst, src, length) -> int: copy raw memory (streaming stores) and return the\n"
     "CRC-32C of the bytes, in one pass (GIL released). The ranges must not overlap."},
    {"crc32c_combine", (PyCFunction)mod_crc32c_combine, METH_VARARGS,
     "crc32c_combine(crc1, crc2, len2) -> int: CRC-32C of A||B from crc(A), crc(B) and len(B)."},
    {"advise_huge", (PyCFunction)(void (*)(void))mod_advise_huge, METH_VARARGS | METH_KEYWORDS,
     "advise_huge(addr, length, *, collapse=False) -> int: transparent huge pages under the\n"
     "2 MiB-aligned interior of raw memory (MADV_HUGEPAGE; with collapse, MADV_COLLAPSE too,\n"
     "GIL released). Returns the bytes covered, 0 where the kernel refused."},
    {"populate", (PyCFunction)mod_populate, METH_VARARGS,
     "populate(addr, length) -> int: fault every page of the range in for writing on this thread\n"
     "(MADV_POPULATE_WRITE, else a touch per page; contents unchanged, GIL released)."},
    {"release_staging", (PyCFunction)mod_release_staging, METH_NOARGS,
     "release_staging(): free the process-wide staging-buffer pool (buffers in use are freed when returned)."},
    {"staging_bytes", (PyCFunction)mod_staging_bytes, METH_NOARGS,
     "staging_bytes() -> int: bytes held by the process-wide staging pool."},
    {"inject_fault", (PyCFunction)(void (*)(void))mod_inject_fault, METH_VARARGS | METH_KEYWORDS,
     "inject_fault(kind, *, errno=5, after_bytes=0)  -- PROCESS-WIDE TEST HOOK, not for production.\n\n"
     "kind: 'write' (one-shot: the first write request reaching past after_bytes fails with errno),\n"
     "'short_write' (every write request's first attempt writes only half; stays armed),\n"
     "'io_uring_setup' (io_uring_setup fails with errno), 'o_direct' (enabling O_DIRECT fails with\n"
     "errno, default EINVAL), 'read' (one-shot: first read reaching past after_bytes fails), or None\n"
     "to clear every fault."},
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
    crc_init();
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
    PyModule_AddIntConstant(m, "HAVE_SSE42", have_sse42);
    return m;
}
