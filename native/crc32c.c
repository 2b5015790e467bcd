/*
 * crc32c.c -- CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), its combination,
 * and copies with the CRC fused in.
 *
 * Internally the "raw" CRC register is used (no pre/post inversion); the
 * public value is ~raw.  For raw registers:
 *     raw(init, A||B) = shift(raw(init, A), |B|) ^ raw(0, B)
 * where shift(c, n) multiplies c by x^(8n) modulo P.  That identity gives
 * both crc32c_combine and the 3-lane interleaved hardware loop.
 */
#define _GNU_SOURCE
#include "fp_engine.h"

#include <emmintrin.h>
#include <immintrin.h>
#include <nmmintrin.h>
#include <pthread.h>
#include <string.h>
#include <wmmintrin.h>

#define CRC32C_POLY 0x82F63B78u

static uint32_t crc_tab[8][256];
static uint32_t x2n_table[32];
static int have_sse42;
#define HW_LANE 4096 /* bytes per lane in the 3-lane interleaved loop */
static uint32_t hw_lane_shift; /* x^(8*HW_LANE) mod P */
/* Long inputs use longer lanes with software prefetch: checksumming from memory
 * (not cache) is limited by how many lines are in flight, and three 4 KiB lanes end
 * every 12 KiB, each time a new page the hardware prefetcher has to find again
 * (the gain, for the snapshot copy and the overlap checksums: docs/performance.md). */
#define HW_BIG_LANE (64 * 1024)
#define HW_PREFETCH 2048 /* bytes ahead of each lane */
static uint32_t hw_big_lane_shift; /* x^(8*HW_BIG_LANE) mod P */

/* Long inputs on CPUs with VPCLMULQDQ and AVX-512 fold 64 bytes per carry-less multiply
 * pair instead: crc32 retires 8 bytes a cycle at best, which makes a copy with its CRC
 * fused take as long as the copy plus the checksum (docs/performance.md). */
enum { IMPL_SW, IMPL_HW, IMPL_FOLD };
static int impl_best, impl_used;
#define FOLD_MIN 256 /* four 64-byte accumulators to start the folding loop */
/* Folding constants, one 128-bit lane each: (x^(63+D) mod P, x^(D-1) mod P), laid out for
 * a 64-bit reflected operand (see fold_consts). */
static uint64_t k_fold_2048[2], k_fold_512[2], k_fold_128[2], k_lanes[8];

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

/* A 128-bit block X of the message (bytes in memory order; bit k of the register is the
 * coefficient of x^(127-k), as the reflected CRC reads it) stands for X(x) * x^L, L the
 * bits after it. Moving it D bits later: X = H * x^64 + Lo, and
 *     X * x^D = H * x^(64+D) + Lo * x^D == H * (x^(64+D) mod P) + Lo * (x^D mod P)   (mod P),
 * two 64 x 32-bit carry-less products, each below x^95. PCLMULQDQ on two operands whose
 * bit i is the coefficient of x^(63-i) yields bit k for x^(126-k), which the 128-bit
 * layout reads as x^(127-k): the product times x, so each constant is stored divided by
 * x (x^(63+D) and x^(D-1)). A 32-bit reflected value (x^0 at bit 31) as such an operand
 * is the value << 32. */
static void fold_consts(uint64_t out[2], unsigned d)
{
    out[0] = (uint64_t)x2nmodp(64 + d - 1, 0) << 32; /* multiplies H, the low quadword */
    out[1] = (uint64_t)x2nmodp(d - 1, 0) << 32;      /* multiplies Lo, the high quadword */
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
    fold_consts(k_fold_2048, 2048);
    fold_consts(k_fold_512, 512);
    fold_consts(k_fold_128, 128);
    fold_consts(k_lanes, 384); /* the last 64 bytes' lanes 0..2, folded onto lane 3 */
    fold_consts(k_lanes + 2, 256);
    fold_consts(k_lanes + 4, 128);
    k_lanes[6] = k_lanes[7] = 0;
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    impl_best = !have_sse42 ? IMPL_SW
                : (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
                   __builtin_cpu_supports("pclmul")) ? IMPL_FOLD : IMPL_HW;
    impl_used = impl_best;
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

#define FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

FOLD_TARGET static inline __m512i fold512(__m512i x, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     next, 0x96); /* a ^ b ^ c */
}

FOLD_TARGET static inline __m128i fold128(__m128i x, __m128i k, __m128i next)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

/* 64 bytes from p, also stored at d (mode 0: not; 1: streaming, d 64-byte aligned;
 * 2: cached stores) */
FOLD_TARGET static inline __m512i load_copy(const unsigned char *p, unsigned char *d, int mode)
{
    __m512i v = _mm512_loadu_si512(p);
    if (mode == 1)
        _mm512_stream_si512((void *)d, v);
    else if (mode == 2)
        _mm512_storeu_si512(d, v);
    return v;
}

/* The raw CRC of n >= FOLD_MIN bytes from c, copying them to d on the way (mode: see
 * load_copy) in the same pass: each 64 bytes are loaded once for both.  The raw register c
 * is XORed into the first four bytes (a raw CRC from c over M is the raw CRC from 0 over M
 * with c XORed into its start), 256 bytes a round go into four accumulators, which fold
 * into one block of 16 congruent to everything read; its raw CRC from 0 is the CRC of all
 * of it, and crc32 finishes the tail. */
FOLD_TARGET __attribute__((always_inline))
static inline uint32_t crc_fold_copy(uint32_t c, const unsigned char *p, unsigned char *d, size_t n, int mode)
{
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k_fold_2048));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k_fold_512));
    __m512i a0 = _mm512_xor_si512(load_copy(p, d, mode), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    __m512i a1 = load_copy(p + 64, d + 64, mode), a2 = load_copy(p + 128, d + 128, mode);
    __m512i a3 = load_copy(p + 192, d + 192, mode);
    p += 256;
    d += 256;
    n -= 256;
    while (n >= 256) {
        a0 = fold512(a0, k2048, load_copy(p, d, mode));
        a1 = fold512(a1, k2048, load_copy(p + 64, d + 64, mode));
        a2 = fold512(a2, k2048, load_copy(p + 128, d + 128, mode));
        a3 = fold512(a3, k2048, load_copy(p + 192, d + 192, mode));
        p += 256;
        d += 256;
        n -= 256;
    }
    a1 = fold512(a0, k512, a1);
    a2 = fold512(a1, k512, a2);
    a3 = fold512(a2, k512, a3);
    while (n >= 64) {
        a3 = fold512(a3, k512, load_copy(p, d, mode));
        p += 64;
        d += 64;
        n -= 64;
    }
    if (mode && n)
        memcpy(d, p, n);
    /* lanes 0..2 of the last 64 bytes folded 48, 32 and 16 bytes on, onto lane 3 */
    __m512i f = fold512(a3, _mm512_loadu_si512(k_lanes), _mm512_setzero_si512());
    __m128i x = _mm_xor_si128(_mm_xor_si128(_mm512_extracti32x4_epi32(f, 0), _mm512_extracti32x4_epi32(f, 1)),
                              _mm_xor_si128(_mm512_extracti32x4_epi32(f, 2), _mm512_extracti32x4_epi32(a3, 3)));
    const __m128i k128 = _mm_loadu_si128((const __m128i *)k_fold_128);
    while (n >= 16) {
        x = fold128(x, k128, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(x, 1));
    return crc_raw_hw((uint32_t)r, p, n);
}

FOLD_TARGET static uint32_t crc_raw_fold(uint32_t c, const unsigned char *p, size_t n)
{
    return crc_fold_copy(c, p, (unsigned char *)(uintptr_t)p, n, 0); /* mode 0 stores nothing: d only advances */
}

FOLD_TARGET static uint32_t copy_crc_fold(void *dst, const void *src, size_t n, uint32_t c, int stream)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (stream) { /* streaming stores want 64-byte aligned destinations: the head goes cached */
        size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        if (head) {
            if (head > n)
                head = n;
            memcpy(d, s, head);
            c = crc_raw_hw(c, s, head);
            d += head;
            s += head;
            n -= head;
        }
    }
    if (n >= FOLD_MIN)
        c = stream ? crc_fold_copy(c, s, d, n, 1) : crc_fold_copy(c, s, d, n, 2);
    else {
        memcpy(d, s, n);
        c = crc_raw_hw(c, s, n);
    }
    if (stream)
        _mm_sfence();
    return c;
}

static inline uint32_t crc_raw(uint32_t c, const void *p, size_t n)
{
    int impl = __atomic_load_n(&impl_used, __ATOMIC_RELAXED);
    if (impl == IMPL_FOLD && n >= FOLD_MIN)
        return crc_raw_fold(c, p, n);
    return impl != IMPL_SW ? crc_raw_hw(c, p, n) : crc_raw_sw(c, p, n);
}

static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static inline void crc_ready(void) { pthread_once(&crc_once, crc_init); }

int fp_have_sse42(void)
{
    crc_ready();
    return have_sse42;
}

static const char *const impl_names[] = {"software", "sse4.2", "vpclmulqdq"};

const char *fp_crc32c_impl(const char *want)
{
    crc_ready();
    if (want) {
        for (int i = 0; i <= impl_best; i++)
            if (strcmp(want, impl_names[i]) == 0)
                __atomic_store_n(&impl_used, i, __ATOMIC_RELAXED);
        if (strcmp(want, "best") == 0)
            __atomic_store_n(&impl_used, impl_best, __ATOMIC_RELAXED);
    }
    return impl_names[__atomic_load_n(&impl_used, __ATOMIC_RELAXED)];
}

/* Public CRC-32C: continue the public value `crc` over n bytes. */
uint32_t fp_crc32c(uint32_t crc, const void *p, size_t n)
{
    crc_ready();
    return ~crc_raw(~crc, p, n);
}

uint32_t fp_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    crc_ready();
    return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

#define FUSE_PIECE (3 * HW_BIG_LANE)

/* Copy with non-temporal stores when the destination is 16-byte aligned (staging
 * buffers always are). The staged bytes are next read by the device's DMA, not by
 * this CPU, so caching them only costs a read-for-ownership of every destination
 * line and evicts the source we are about to checksum, which a memory-bound machine
 * feels in the copy. The caller fences (sfence) before handing the buffer
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

/* memcpy with the CRC fused: CRC over a 192 KiB source piece (three long lanes), then
 * copy it while it is still in cache.  Returns the public CRC continued from crc (or 0
 * without checksum). */
static uint32_t copy_crc_impl(void *dst, const void *src, size_t n, uint32_t crc, int checksum, int stream)
{
    if (checksum && __atomic_load_n(&impl_used, __ATOMIC_RELAXED) == IMPL_FOLD && n >= FOLD_MIN)
        return ~copy_crc_fold(dst, src, n, ~crc, stream);
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
uint32_t fp_copy_crc(void *dst, const void *src, size_t n, uint32_t crc, int checksum)
{
    crc_ready();
    return copy_crc_impl(dst, src, n, crc, checksum, 1);
}

/* Out of staging into the caller's memory (read next by the caller): cached stores. */
uint32_t fp_copy_crc_cached(void *dst, const void *src, size_t n, uint32_t crc, int checksum)
{
    crc_ready();
    return copy_crc_impl(dst, src, n, crc, checksum, 0);
}

