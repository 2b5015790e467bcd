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
#include <nmmintrin.h>
#include <pthread.h>
#include <string.h>

#define CRC32C_POLY 0x82F63B78u

static uint32_t crc_tab[8][256];
static uint32_t x2n_table[32];
static int have_sse42;
#define HW_LANE 4096 /* bytes per lane in the 3-lane interleaved loop */
static uint32_t hw_lane_shift; /* x^(8*HW_LANE) mod P */
/* Long inputs use longer lanes with software prefetch: checksumming from memory
 * (not cache) is limited by how many lines are in flight, and three 4 KiB lanes end
 * every 12 KiB, each time a new page the hardware prefetcher has to find again
 * (the gain, for the snapshot copy and the overlap checksums: benchmarks/README.md). */
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

static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static inline void crc_ready(void) { pthread_once(&crc_once, crc_init); }

int fp_have_sse42(void)
{
    crc_ready();
    return have_sse42;
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

