/*
 * test_engine.c -- the native engine tested from C, without Python.
 *
 *     cc -std=gnu11 -O2 -Wall -Wextra native/tests/test_engine.c ENGINE_SOURCES -lpthread
 *     ./a.out [WORK_DIR]
 *
 * ENGINE_SOURCES: every native/NAME.c but binding.c.
 *
 * Writes files in a temporary directory under WORK_DIR ($TMPDIR or /tmp by default) and
 * reads them back through the engine on each backend (io_uring, threadpool, buffered),
 * with unaligned tails and zero-copy extents; CRC-32C against known vectors and a bitwise
 * reference, combine, copy with fused CRC; the refusals of offsets that overflow; fault
 * injection; EFAULT from memory unmapped under a zero-copy write or a read.  A backend
 * this machine cannot run (no O_DIRECT on WORK_DIR's file system, io_uring disabled) is
 * skipped and named.  Prints a summary; exits 0 when every check passed, else 1.
 * tests/native/test_native_engine_c.py builds and runs it twice: plain, and under ASan + UBSan.
 */
#define _GNU_SOURCE
#include "../fp_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define KiB 1024LL
#define MiB (1024 * KiB)
#define BIG LLONG_MAX

static int n_checks, n_failures;
static char skipped[2048];

#define CHECK(cond, ...) check_((cond) != 0, __FILE__, __LINE__, #cond, __VA_ARGS__)

__attribute__((format(printf, 5, 6)))
static int check_(int ok, const char *file, int line, const char *expr, const char *fmt, ...)
{
    n_checks++;
    if (!ok) {
        n_failures++;
        fprintf(stderr, "FAIL %s:%d: %s: ", file, line, expr);
        va_list ap;
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
    }
    return ok;
}

static void skip(const char *what)
{
    printf("skip: %s\n", what);
    if (strlen(skipped) + strlen(what) + 3 < sizeof skipped)
        strcat(strcat(skipped, skipped[0] ? "; " : ""), what);
}

/* ---------------------------------------------------------------- helpers */

static char work[PATH_MAX];
static int counter;

static const char *fresh(char *buf, size_t cap, const char *name)
{
    if (snprintf(buf, cap, "%s/%03d-%s", work, ++counter, name) >= (int)cap) {
        fprintf(stderr, "path too long: %s\n", work);
        exit(2);
    }
    return buf;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void fill_random(unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(rnd() >> 56);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        perror("malloc");
        exit(2);
    }
    return p;
}

static void *aligned_buf(size_t n, size_t align)
{
    void *p = NULL;
    if (posix_memalign(&p, align, n ? n : 1)) {
        perror("posix_memalign");
        exit(2);
    }
    memset(p, 0, n);
    return p;
}

/* The CRC-32C bit by bit: the definition, nothing shared with the engine. */
static uint32_t ref_crc32c(const unsigned char *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    while (n--) {
        c ^= *p++;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
}

/* Whole file into memory (caller frees); size in *n, NULL when it cannot be read. */
static unsigned char *read_file(const char *path, size_t *n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        close(fd);
        return NULL;
    }
    unsigned char *buf = xmalloc((size_t)st.st_size);
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    *n = got;
    return buf;
}

static int file_equals(const char *path, const unsigned char *want, size_t n)
{
    size_t got = 0;
    unsigned char *buf = read_file(path, &got);
    int ok = buf && got == n && (n == 0 || memcmp(buf, want, n) == 0);
    free(buf);
    return ok;
}

static void write_whole_file(const char *path, const unsigned char *p, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, p, n) != (ssize_t)n || close(fd) < 0) {
        perror(path);
        exit(2);
    }
}

static int open_engine(fp_engine_t *e, const char *path, int backend, ll chunk, int qd, char *msg)
{
    fp_engine_options_t o;
    fp_engine_options_default(&o);
    o.backend = backend;
    if (chunk)
        o.chunk_bytes = chunk;
    if (qd)
        o.queue_depth = qd;
    o.copy_threads = 2;
    o.io_threads = 2;
    fp_engine_init(e);
    return fp_engine_open(e, path, &o, msg, FP_MSG_MAX);
}

/* Random non-overlapping extents with gaps in [0, total) from unaligned sources; the
 * file's expected image in *image.  Sources are kept in *src (caller frees). */
typedef struct {
    fp_extent_t ext[32];
    int n;
    unsigned char *src, *image;
} layout_t;

static void make_layout(layout_t *L, ll total, int n)
{
    ll cuts[64];
    for (int i = 0; i < 2 * n; i++) {
        ll c;
        int dup;
        do {
            c = 1 + (ll)(rnd() % (uint64_t)(total - 1));
            dup = 0;
            for (int k = 0; k < i; k++)
                dup |= cuts[k] == c;
        } while (dup);
        int k = i;
        while (k > 0 && cuts[k - 1] > c) {
            cuts[k] = cuts[k - 1];
            k--;
        }
        cuts[k] = c;
    }
    L->n = n;
    L->src = xmalloc((size_t)total + 64 * (size_t)n);
    L->image = xmalloc((size_t)total);
    memset(L->image, 0, (size_t)total);
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        ll a = cuts[2 * i], b = cuts[2 * i + 1];
        unsigned char *s = L->src + used + rnd() % 61;
        used += (size_t)(b - a) + 64;
        fill_random(s, (size_t)(b - a));
        memcpy(L->image + a, s, (size_t)(b - a));
        L->ext[i] = (fp_extent_t){a, (uint64_t)(uintptr_t)s, b - a, 0, 0};
    }
}

static void free_layout(layout_t *L)
{
    free(L->src);
    free(L->image);
}

/* ---------------------------------------------------------------- CRC-32C */

static void test_crc(void)
{
    static const unsigned char digits[] = "123456789";
    unsigned char v[32];
    CHECK(fp_crc32c(0, digits, 9) == 0xE3069283u, "crc32c(\"123456789\") = %#x", fp_crc32c(0, digits, 9));
    CHECK(fp_crc32c(0, digits, 0) == 0, "empty");
    /* RFC 3720 (iSCSI), appendix B.4 */
    memset(v, 0, sizeof v);
    CHECK(fp_crc32c(0, v, 32) == 0x8A9136AAu, "32 zeros: %#x", fp_crc32c(0, v, 32));
    memset(v, 0xFF, sizeof v);
    CHECK(fp_crc32c(0, v, 32) == 0x62A8AB43u, "32 x 0xff: %#x", fp_crc32c(0, v, 32));
    for (int i = 0; i < 32; i++)
        v[i] = (unsigned char)i;
    CHECK(fp_crc32c(0, v, 32) == 0x46DD794Eu, "0..31: %#x", fp_crc32c(0, v, 32));
    for (int i = 0; i < 32; i++)
        v[i] = (unsigned char)(31 - i);
    CHECK(fp_crc32c(0, v, 32) == 0x113FDB5Cu, "31..0: %#x", fp_crc32c(0, v, 32));

    /* around both lane lengths of the hardware loop and the fused-copy piece, from
     * unaligned starts; continuation and combine at a third of the way */
    static const size_t sizes[] = {1, 7, 8, 9, 63, 255, 256, 257, 271, 319, 320, 335, 511, 512, 513, 4095,
                                   4097, 12287, 12288, 12289, 196607, 196608, 196609, 2 * 196608 + 4099};
    unsigned char *buf = xmalloc(2 * 196608 + 4099 + 8);
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        size_t n = sizes[s];
        fill_random(buf, n + 8);
        for (int lo = 0; lo < 6; lo += 5) {
            const unsigned char *p = buf + lo;
            uint32_t whole = fp_crc32c(0, p, n), ref = ref_crc32c(p, n);
            CHECK(whole == ref, "size %zu at +%d: %#x, reference %#x", n, lo, whole, ref);
            size_t cut = n / 3;
            uint32_t head = fp_crc32c(0, p, cut), tail = fp_crc32c(0, p + cut, n - cut);
            CHECK(fp_crc32c(head, p + cut, n - cut) == whole, "continued, size %zu", n);
            CHECK(fp_crc32c_combine(head, tail, n - cut) == whole, "combined, size %zu", n);
        }
    }
    free(buf);
    CHECK(fp_crc32c_combine(0x12345678u, 0, 0) == 0x12345678u, "combine with nothing");
    /* every bit of len2 is used: zeros appended to A are A's CRC advanced by len2 bytes */
    unsigned char zeros[1000];
    memset(zeros, 0, sizeof zeros);
    uint32_t a = fp_crc32c(0, digits, 9);
    CHECK(fp_crc32c_combine(a, fp_crc32c(0, zeros, 1000), 1000) == fp_crc32c(a, zeros, 1000), "combine zeros");
    (void)fp_crc32c_combine(1, 2, (uint64_t)BIG);
}

static void test_copy_crc(void)
{
    size_t total = 3 * 196608 + 777;
    unsigned char *src = xmalloc(total);
    fill_random(src, total);
    static const size_t cases[][3] = {{0, 0, 3 * 196608 + 769}, {16, 3, 5000}, {5, 0, 255}, {16, 1, 256},
                                      {1, 2, 0}, {32, 7, 196608 + 63}, {63, 0, 256 + 62}, {63, 1, 256 + 63},
                                      {0, 5, 256 + 64 + 15}, {48, 0, 1000}, {1, 0, 30}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t doff = cases[i][0], soff = cases[i][1], n = cases[i][2];
        for (int cached = 0; cached < 2; cached++) {
            unsigned char *dst = aligned_buf(n + 64, 4096);
            uint32_t want = ref_crc32c(src + soff, n);
            uint32_t c = cached ? fp_copy_crc_cached(dst + doff, src + soff, n, 0, 1)
                                : fp_copy_crc(dst + doff, src + soff, n, 0, 1);
            CHECK(c == want, "copy+crc case %zu cached=%d: %#x, want %#x", i, cached, c, want);
            CHECK(memcmp(dst + doff, src + soff, n) == 0, "copy+crc case %zu: bytes", i);
            int clean = 1;
            for (size_t k = 0; k < doff; k++)
                clean &= dst[k] == 0;
            for (size_t k = doff + n; k < n + 64; k++)
                clean &= dst[k] == 0;
            CHECK(clean, "copy+crc case %zu wrote outside its range", i);
            free(dst);
        }
    }
    unsigned char *dst = aligned_buf(5000, 4096);
    CHECK(fp_copy_crc(dst, src, 5000, 0, 0) == 0 && memcmp(dst, src, 5000) == 0, "copy without checksum");
    uint32_t head = fp_crc32c(0, src, 100);
    CHECK(fp_copy_crc(dst, src + 100, 4900, head, 1) == fp_crc32c(0, src, 5000), "copy continuing a CRC");
    free(dst);
    free(src);
}

/* ---------------------------------------------------------------- backends */

static int available[3];

static void probe_backends(void)
{
    for (int b = FP_BK_IO_URING; b <= FP_BK_BUFFERED; b++) {
        char path[PATH_MAX], msg[FP_MSG_MAX], why[FP_MSG_MAX + 64];
        fp_engine_t e;
        int rc = open_engine(&e, fresh(path, sizeof path, "probe"), b, 0, 0, msg);
        available[b] = rc == 0;
        if (rc == 0) {
            CHECK(e.backend == b && e.reason[0] == 0, "backend %s: got %s (%s)", fp_backend_name(b),
                  fp_backend_name(e.backend), e.reason);
            fp_engine_close(&e);
        } else if (b == FP_BK_BUFFERED) {
            CHECK(0, "buffered engine cannot open: %s (%s)", strerror(rc), msg);
        } else {
            snprintf(why, sizeof why, "backend %s: %s", fp_backend_name(b), msg[0] ? msg : strerror(rc));
            skip(why);
        }
    }
}

/* Write L's extents as [0, total) through a new engine; 0 or the engine's result. */
static int write_layout(const char *path, int backend, const layout_t *L, ll total, ll chunk, uint32_t *crcs,
                        fp_write_stats_t *st)
{
    fp_engine_t e;
    char msg[FP_MSG_MAX];
    int rc = open_engine(&e, path, backend, chunk, 3, msg);
    if (!CHECK(rc == 0, "open %s: %d %s", path, rc, msg))
        return rc;
    rc = fp_engine_write(&e, L->ext, L->n, 0, total, 1, 0, crcs, st, msg, sizeof msg);
    if (rc == 0)
        rc = fp_engine_truncate(&e, total);
    if (rc == 0)
        rc = fp_engine_sync(&e);
    fp_engine_close(&e);
    return rc;
}

static void test_reads(const char *path, const unsigned char *data, ll total)
{
    for (int direct = 1; direct >= 0; direct--) {
        fp_reader_t r;
        fp_reader_init(&r);
        int rc = fp_reader_open(&r, path, direct);
        if (!CHECK(rc == 0, "reader open: %s", strerror(rc)))
            return;
        CHECK(r.size == total, "reader size %lld", r.size);
        static const ll cases[][3] = {{0, -1, 4 * MiB}, {1, -2, 256 * KiB}, {12345, 512 * KiB + 3, 64 * KiB},
                                      {-10, 10, 4 * MiB}, {777, 1, 4096}, {4096, 100 * KiB, 4 * MiB}};
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            ll off = cases[i][0] >= 0 ? cases[i][0] : total + cases[i][0];
            ll n = cases[i][1] > 0 ? cases[i][1] : total + 1 + cases[i][1];
            unsigned char *out = xmalloc((size_t)n + 8);
            memset(out, 0, (size_t)n + 8);
            /* two checksummed ranges: a third at the start, the second half */
            ll ranges[4] = {off, n / 3, off + n / 2, n - n / 2};
            uint32_t range_crcs[2] = {0, 0};
            fp_read_options_t o = {.checksum = 1, .threads = 3, .chunk_bytes = cases[i][2],
                                   .ranges = ranges, .n_ranges = 2, .range_crcs = range_crcs};
            uint32_t crc;
            ll fsize;
            char msg[FP_MSG_MAX];
            rc = fp_reader_read(&r, off, (uint64_t)(uintptr_t)(out + 3), n, &o, &crc, &fsize, msg, sizeof msg);
            CHECK(rc == 0, "read (%lld, %lld) direct=%d: %d %s", off, n, direct, rc, msg);
            CHECK(memcmp(out + 3, data + off, (size_t)n) == 0, "read (%lld, %lld) direct=%d: bytes", off, n,
                  direct);
            CHECK(crc == fp_crc32c(0, data + off, (size_t)n), "read (%lld, %lld): crc", off, n);
            for (int k = 0; k < 2; k++)
                CHECK(range_crcs[k] == fp_crc32c(0, data + ranges[2 * k], (size_t)ranges[2 * k + 1]),
                      "read (%lld, %lld): crc of range %d", off, n, k);
            CHECK(out[0] == 0 && out[1] == 0 && out[2] == 0 && out[n + 3] == 0, "read wrote outside");
            free(out);
        }
        /* destination aligned like the file: chunks read straight into it */
        ll A = r.alignment > r.mem_alignment ? r.alignment : r.mem_alignment;
        const ll offs[] = {0, A, 3 * A + 5};
        for (size_t i = 0; i < 3; i++) {
            ll off = offs[i], n = total - off;
            unsigned char *buf = aligned_buf((size_t)(n + 2 * A), (size_t)A);
            fp_read_options_t o = {.checksum = 1, .threads = 2, .chunk_bytes = 256 * KiB};
            uint32_t crc;
            ll fsize;
            char msg[FP_MSG_MAX];
            unsigned char *dst = buf + off % A;
            rc = fp_reader_read(&r, off, (uint64_t)(uintptr_t)dst, n, &o, &crc, &fsize, msg, sizeof msg);
            CHECK(rc == 0 && memcmp(dst, data + off, (size_t)n) == 0 && crc == fp_crc32c(0, data + off, (size_t)n),
                  "aligned read at %lld direct=%d: %d %s", off, direct, rc, msg);
            free(buf);
        }
        /* past the end of the file */
        unsigned char out[64];
        fp_read_options_t o;
        fp_read_options_default(&o);
        uint32_t crc;
        ll fsize;
        char msg[FP_MSG_MAX];
        rc = fp_reader_read(&r, total - 5, (uint64_t)(uintptr_t)out, 10, &o, &crc, &fsize, msg, sizeof msg);
        CHECK(rc == FP_EOF && fsize == total, "read past the end: %d, size %lld", rc, fsize);
        rc = fp_reader_read(&r, BIG - 100, (uint64_t)(uintptr_t)out, 100, &o, &crc, &fsize, msg, sizeof msg);
        CHECK(rc == FP_EOF, "read far past the end: %d", rc);
        rc = fp_reader_read(&r, BIG, (uint64_t)(uintptr_t)out, 0, &o, &crc, &fsize, msg, sizeof msg);
        CHECK(rc == 0 && crc == 0, "empty read at 2**63 - 1: %d", rc);
        fp_reader_close(&r);
        fp_reader_close(&r);
        rc = fp_reader_read(&r, 0, (uint64_t)(uintptr_t)out, 1, &o, &crc, &fsize, msg, sizeof msg);
        CHECK(rc == EBADF, "read on a closed reader: %d", rc);
    }
}

static void test_backend(int b)
{
    const char *name = fp_backend_name(b);
    char path[PATH_MAX], msg[FP_MSG_MAX];
    /* staged extents with gaps, an unaligned end, chunks smaller than extents */
    ll total = 1 * MiB + 12345;
    layout_t L;
    make_layout(&L, total, 17);
    uint32_t crcs[32];
    fp_write_stats_t st;
    fresh(path, sizeof path, "staged");
    int rc = write_layout(path, b, &L, total, 64 * KiB, crcs, &st);
    CHECK(rc == 0, "%s: write: %s", name, strerror(rc));
    CHECK(file_equals(path, L.image, (size_t)total), "%s: file contents", name);
    for (int i = 0; i < L.n; i++)
        CHECK(crcs[i] == ref_crc32c(L.image + L.ext[i].off, (size_t)L.ext[i].len), "%s: crc of extent %d", name,
              i);
    CHECK(st.bytes == total && st.bytes_padded >= 0 && st.zero_copy_bytes == 0 && st.requests > 0,
          "%s: stats bytes=%lld padded=%lld zc=%lld requests=%ld", name, st.bytes, st.bytes_padded,
          st.zero_copy_bytes, st.requests);
    if (b == FP_BK_BUFFERED) /* the reader on every backend's file would read the same bytes */
        test_reads(path, L.image, total);
    free_layout(&L);

    /* short files: less than a block, one block, one byte more; then an empty range */
    static const ll shorts[] = {1, 100, 511, 512, 4096, 4097};
    for (size_t i = 0; i < sizeof shorts / sizeof shorts[0]; i++) {
        ll n = shorts[i];
        unsigned char data[4097];
        fill_random(data, (size_t)n);
        layout_t one = {.n = 1};
        one.ext[0] = (fp_extent_t){0, (uint64_t)(uintptr_t)data, n, 0, 0};
        fresh(path, sizeof path, "short");
        rc = write_layout(path, b, &one, n, 0, crcs, &st);
        CHECK(rc == 0 && file_equals(path, data, (size_t)n) && crcs[0] == ref_crc32c(data, (size_t)n),
              "%s: short file of %lld bytes: %s", name, n, strerror(rc));
    }
    layout_t none = {.n = 0};
    fresh(path, sizeof path, "empty");
    rc = write_layout(path, b, &none, 0, 0, crcs, &st);
    CHECK(rc == 0 && st.bytes == 0 && file_equals(path, NULL, 0), "%s: empty range: %s", name, strerror(rc));

    /* zero-copy: aligned middles straight from memory, a known CRC, staged heads and tails */
    fp_engine_t e;
    rc = open_engine(&e, fresh(path, sizeof path, "zero-copy"), b, 128 * KiB, 0, msg);
    if (!CHECK(rc == 0, "%s: open: %s", name, msg))
        return;
    ll A = e.alignment;
    unsigned char *body = aligned_buf(640 * KiB, (size_t)e.mem_alignment);
    unsigned char tail[1001];
    fill_random(body, 640 * KiB);
    fill_random(tail, sizeof tail);
    ll start = 2 * A, end = start + 640 * KiB;
    uint64_t base = (uint64_t)(uintptr_t)body;
    fp_extent_t ext[] = {
        {start, base, 256 * KiB, 0, 0},
        {start + 256 * KiB, base + 256 * KiB, 128 * KiB, 1, 0xDEADBEEFu},
        {start + 384 * KiB + 3, (uint64_t)(uintptr_t)tail, 1001, 0, 0},
        {start + 512 * KiB, base + 512 * KiB, 128 * KiB - 5, 0, 0},
    };
    rc = fp_engine_write(&e, ext, 4, start, end, 1, 1, crcs, &st, msg, sizeof msg);
    CHECK(rc == 0, "%s: zero-copy write: %d %s", name, rc, msg);
    CHECK(fp_engine_truncate(&e, end) == 0, "%s: truncate", name);
    CHECK(crcs[0] == ref_crc32c(body, 256 * KiB) && crcs[1] == 0xDEADBEEFu && crcs[2] == ref_crc32c(tail, 1001) &&
              crcs[3] == ref_crc32c(body + 512 * KiB, 128 * KiB - 5),
          "%s: zero-copy crcs", name);
    if (e.mem_alignment <= 4096 && (128 * KiB) % A == 0)
        CHECK(st.zero_copy_bytes == 384 * KiB, "%s: zero_copy_bytes %lld", name, st.zero_copy_bytes);
    rc = fp_engine_write(&e, ext, 4, start, end, 0, 1, crcs, &st, msg, sizeof msg);
    CHECK(rc == 0 && crcs[0] == 0 && crcs[1] == 0 && crcs[2] == 0 && crcs[3] == 0,
          "%s: no checksums asked for, known ones included: %d", name, rc);
    fp_engine_close(&e);
    unsigned char *want = xmalloc((size_t)end);
    memset(want, 0, (size_t)end);
    memcpy(want + start, body, 384 * KiB);
    memcpy(want + start + 384 * KiB + 3, tail, 1001);
    memcpy(want + start + 512 * KiB, body + 512 * KiB, 128 * KiB - 5);
    CHECK(file_equals(path, want, (size_t)end), "%s: zero-copy file contents", name);
    free(want);
    free(body);
    fp_engine_close(&e); /* idempotent */
    rc = fp_engine_write(&e, ext, 4, start, end, 1, 0, crcs, &st, msg, sizeof msg);
    CHECK(rc == EBADF, "%s: write on a closed engine: %d", name, rc);
}

static void test_huge_staging(void)
{
    ll n = 5 * MiB + 3;
    unsigned char *big = xmalloc((size_t)n);
    fill_random(big, (size_t)n);
    layout_t L = {.n = 1};
    L.ext[0] = (fp_extent_t){7, (uint64_t)(uintptr_t)big, n, 0, 0};
    char path[PATH_MAX];
    uint32_t crc;
    fp_write_stats_t st;
    int b = available[FP_BK_IO_URING] ? FP_BK_IO_URING : FP_BK_BUFFERED;
    int rc = write_layout(fresh(path, sizeof path, "huge"), b, &L, n + 7, 2 * MiB, &crc, &st);
    unsigned char *want = xmalloc((size_t)n + 7);
    memset(want, 0, 7);
    memcpy(want + 7, big, (size_t)n);
    CHECK(rc == 0 && file_equals(path, want, (size_t)n + 7), "2 MiB staging: %s", strerror(rc));
    CHECK(fp_pool_bytes() > 0, "the pool keeps its buffers");
    fp_pool_release();
    CHECK(fp_pool_bytes() == 0, "release_staging: %zu bytes left", fp_pool_bytes());
    free(want);
    free(big);
}

static void test_tmpfile(void)
{
    char dir[PATH_MAX], link[PATH_MAX + 32], proc[64], msg[FP_MSG_MAX];
    fresh(dir, sizeof dir, "tmpdir");
    if (mkdir(dir, 0700) < 0) {
        CHECK(0, "mkdir %s: %s", dir, strerror(errno));
        return;
    }
    fp_engine_options_t o;
    fp_engine_options_default(&o);
    o.tmpfile = 1;
    o.mode = 0600;
    fp_engine_t e;
    fp_engine_init(&e);
    int rc = fp_engine_open(&e, dir, &o, msg, sizeof msg);
    if (rc == EOPNOTSUPP || rc == EISDIR || rc == EINVAL) {
        skip("O_TMPFILE: not supported on this file system");
        return;
    }
    if (!CHECK(rc == 0, "O_TMPFILE open: %s %s", strerror(rc), msg))
        return;
    unsigned char data[10000];
    fill_random(data, sizeof data);
    fp_extent_t x = {0, (uint64_t)(uintptr_t)data, sizeof data, 0, 0};
    uint32_t crc;
    fp_write_stats_t st;
    rc = fp_engine_write(&e, &x, 1, 0, sizeof data, 1, 0, &crc, &st, msg, sizeof msg);
    CHECK(rc == 0 && fp_engine_truncate(&e, sizeof data) == 0, "O_TMPFILE write: %d %s", rc, msg);
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", e.fd);
    snprintf(link, sizeof link, "%s/linked", dir);
    CHECK(linkat(AT_FDCWD, proc, AT_FDCWD, link, AT_SYMLINK_FOLLOW) == 0, "linkat: %s", strerror(errno));
    fp_engine_close(&e);
    CHECK(file_equals(link, data, sizeof data), "O_TMPFILE contents");
    o.create = 0;
    rc = fp_engine_open(&e, dir, &o, msg, sizeof msg);
    CHECK(rc == FP_EARG && strstr(msg, "create=False"), "tmpfile without create: %d %s", rc, msg);
}

/* ---------------------------------------------------------------- refusals */

static void test_refusals(void)
{
    char path[PATH_MAX], msg[FP_MSG_MAX];
    fp_engine_options_t o;
    fp_engine_t e;
    fp_engine_init(&e);
    static const struct {
        int field, value;
        const char *says;
    } bad[] = {{0, 0, "queue_depth"}, {0, 4097, "queue_depth"}, {1, 0, "copy_threads"}, {1, 65, "copy_threads"},
               {2, 0, "io_threads"}, {3, 010000, "got 0o10000"}, {3, -1, "got -0o1"}, {4, 100, "chunk_bytes"},
               {5, 7, "backend"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fp_engine_options_default(&o);
        int *f[] = {&o.queue_depth, &o.copy_threads, &o.io_threads, &o.mode, NULL, &o.backend};
        if (f[bad[i].field])
            *f[bad[i].field] = bad[i].value;
        else
            o.chunk_bytes = bad[i].value;
        int rc = fp_engine_open(&e, fresh(path, sizeof path, "bad-options"), &o, msg, sizeof msg);
        CHECK(rc == FP_EARG && strstr(msg, bad[i].says), "options case %zu: %d '%s'", i, rc, msg);
        CHECK(access(path, F_OK) != 0, "options case %zu: a refused engine created its file", i);
    }
    CHECK(fp_backend_parse("auto") == FP_BK_AUTO && fp_backend_parse("threadpool") == FP_BK_THREADPOOL &&
              fp_backend_parse("nope") == -1,
          "backend names");
    fp_engine_options_default(&o);
    o.create = 0;
    char missing[PATH_MAX + 16];
    snprintf(missing, sizeof missing, "%s/missing", work);
    int rc = fp_engine_open(&e, missing, &o, msg, sizeof msg);
    CHECK(rc == ENOENT && msg[0] == 0, "open of a missing file: %d '%s'", rc, msg);

    /* write: offsets and lengths that do not fit, extents that wrap the address space */
    rc = open_engine(&e, fresh(path, sizeof path, "refusals"), FP_BK_BUFFERED, 0, 0, msg);
    if (!CHECK(rc == 0, "open: %s", msg))
        return;
    ll A = e.alignment, top = BIG / A * A;
    unsigned char buf[8192];
    uint64_t a = (uint64_t)(uintptr_t)buf;
    uint32_t crcs[4];
    fp_write_stats_t st;
    static const struct {
        ll start, end;
        const char *says;
    } ranges[] = {{1, 100, "start=1"}, {100, 0, "invalid range"}, {-4096, 0, "invalid range"},
                  {0, BIG, "too close to the largest file offset"}, {0, 1LL << 62, "too many chunks"}};
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        rc = fp_engine_write(&e, NULL, 0, ranges[i].start, ranges[i].end, 1, 0, crcs, &st, msg, sizeof msg);
        CHECK(rc == FP_EARG && strstr(msg, ranges[i].says), "range case %zu: %d '%s'", i, rc, msg);
    }
    rc = fp_engine_write(&e, NULL, 0, top, BIG, 1, 0, crcs, &st, msg, sizeof msg);
    CHECK(rc == FP_EARG && strstr(msg, "too close"), "range at the top: %d '%s'", rc, msg);
    ll t = 1LL << 40;
    const struct {
        fp_extent_t x[2];
        int n;
        ll start, end;
        const char *says;
    } exts[] = {
        {{{t, a, BIG, 0, 0}}, 1, t, t + A, "extent 0"},               /* off + len overflows */
        {{{t + 10, a, BIG - t, 0, 0}}, 1, t, t + A, "extent 0"},      /* ends at 2**63 */
        {{{0, a, 10, 0, 0}, {5, a, 10, 0, 0}}, 2, 0, A, "extent 1"}, /* overlap */
        {{{0, a, -1, 0, 0}}, 1, 0, A, "extent 0"},                    /* negative */
        {{{0, 0, 10, 0, 0}}, 1, 0, A, "NULL address"},
        {{{0, UINT64_MAX - 99, 200, 0, 0}}, 1, 0, A, "wraps around the address space"},
    };
    for (size_t i = 0; i < sizeof exts / sizeof exts[0]; i++) {
        rc = fp_engine_write(&e, exts[i].x, exts[i].n, exts[i].start, exts[i].end, 1, 0, crcs, &st, msg,
                             sizeof msg);
        CHECK(rc == FP_EARG && strstr(msg, exts[i].says), "extent case %zu: %d '%s'", i, rc, msg);
    }
    rc = fp_engine_write(&e, exts[0].x, -1, 0, A, 1, 0, crcs, &st, msg, sizeof msg);
    CHECK(rc == FP_EARG, "negative extent count: %d", rc);
    struct stat sb;
    CHECK(fstat(e.fd, &sb) == 0 && sb.st_size == 0, "refused writes left the file alone (size %lld)",
          (ll)sb.st_size);
    rc = fp_engine_truncate(&e, BIG);
    CHECK(rc == EFBIG || rc == EINVAL, "truncate to 2**63 - 1: %d", rc);
    fp_engine_close(&e);

    /* read */
    fp_reader_t r;
    fp_reader_init(&r);
    fresh(path, sizeof path, "r-refusals");
    write_whole_file(path, buf, sizeof buf);
    rc = fp_reader_open(&r, path, 1);
    if (!CHECK(rc == 0, "reader open: %s", strerror(rc)))
        return;
    fp_read_options_t ro;
    fp_read_options_default(&ro);
    uint32_t crc;
    ll fsize;
    const struct {
        ll off;
        uint64_t addr;
        ll len;
        const char *says;
    } reads[] = {
        {BIG, a, 1, "overflows a 64-bit file offset"},         {1, a, BIG, "overflows a 64-bit file offset"},
        {BIG - 4095, a, 8192, "overflows"},                    {1LL << 62, a, 1LL << 62, "overflows"},
        {-1, a, 1, "invalid read"},                            {0, a, -1, "invalid read"},
        {0, 0, 1, "addr is NULL"},                             {0, UINT64_MAX - 4095, 8192, "wraps around"},
    };
    for (size_t i = 0; i < sizeof reads / sizeof reads[0]; i++) {
        rc = fp_reader_read(&r, reads[i].off, reads[i].addr, reads[i].len, &ro, &crc, &fsize, msg, sizeof msg);
        CHECK(rc == FP_EARG && strstr(msg, reads[i].says), "read case %zu: %d '%s'", i, rc, msg);
    }
    ro.threads = 0;
    rc = fp_reader_read(&r, 0, a, 1, &ro, &crc, &fsize, msg, sizeof msg);
    CHECK(rc == FP_EARG && strstr(msg, "threads"), "threads=0: %d '%s'", rc, msg);
    ro.threads = 2;
    ro.chunk_bytes = 1;
    rc = fp_reader_read(&r, 0, a, 1, &ro, &crc, &fsize, msg, sizeof msg);
    CHECK(rc == FP_EARG && strstr(msg, "chunk_bytes"), "chunk_bytes=1: %d '%s'", rc, msg);
    fp_reader_close(&r);
    snprintf(missing, sizeof missing, "%s/missing", work);
    CHECK(fp_reader_open(&r, missing, 1) == ENOENT, "reader of a missing file");

    /* memory helpers */
    rc = fp_populate(UINT64_MAX - 4096, 8192, 1, msg, sizeof msg);
    CHECK(rc == FP_EARG && strstr(msg, "wraps around"), "populate past the address space: %d '%s'", rc, msg);
}

/* ---------------------------------------------------------------- faults */

static void test_faults(void)
{
    char path[PATH_MAX], msg[FP_MSG_MAX];
    ll total = 1 * MiB + 17;
    layout_t L;
    make_layout(&L, total, 6);
    uint32_t crcs[32];
    fp_write_stats_t st;
    for (int b = FP_BK_IO_URING; b <= FP_BK_BUFFERED; b++) {
        if (!available[b])
            continue;
        const char *name = fp_backend_name(b);
        fp_engine_t e;
        CHECK(fp_inject_fault("write", ENOSPC, 256 * KiB) == 0, "arm write");
        int rc = open_engine(&e, fresh(path, sizeof path, "fault-write"), b, 64 * KiB, 0, msg);
        if (!CHECK(rc == 0, "%s: open: %s", name, msg))
            continue;
        rc = fp_engine_write(&e, L.ext, L.n, 0, total, 1, 0, crcs, &st, msg, sizeof msg);
        CHECK(rc == ENOSPC, "%s: injected write error: %d", name, rc);
        rc = fp_engine_write(&e, L.ext, L.n, 0, total, 1, 0, crcs, &st, msg, sizeof msg); /* one-shot */
        CHECK(rc == 0 && fp_engine_truncate(&e, total) == 0, "%s: write after the fault: %d", name, rc);
        fp_engine_close(&e);
        CHECK(file_equals(path, L.image, (size_t)total), "%s: contents after the fault", name);

        fp_inject_fault("short_write", 0, 0);
        rc = write_layout(fresh(path, sizeof path, "fault-short"), b, &L, total, 64 * KiB, crcs, &st);
        fp_inject_fault(NULL, 0, 0);
        CHECK(rc == 0 && st.short_writes > 0 && file_equals(path, L.image, (size_t)total),
              "%s: short writes: %d, %ld short", name, rc, st.short_writes);
    }
    free_layout(&L);

    if (available[FP_BK_THREADPOOL]) {
        fp_engine_t e;
        fp_inject_fault("io_uring_setup", EPERM, 0);
        int rc = open_engine(&e, fresh(path, sizeof path, "fault-setup"), FP_BK_AUTO, 0, 0, msg);
        CHECK(rc == 0 && e.backend == FP_BK_THREADPOOL && strstr(e.reason, "EPERM"),
              "auto without io_uring: %d %s '%s'", rc, fp_backend_name(e.backend), e.reason);
        fp_engine_close(&e);
        rc = open_engine(&e, fresh(path, sizeof path, "fault-setup2"), FP_BK_IO_URING, 0, 0, msg);
        CHECK(rc == EPERM && strstr(msg, "io_uring unavailable") && access(path, F_OK) != 0,
              "io_uring asked for and refused: %d '%s'", rc, msg);
        fp_inject_fault(NULL, 0, 0);

        fp_inject_fault("o_direct", 0, 0);
        rc = open_engine(&e, fresh(path, sizeof path, "fault-odirect"), FP_BK_AUTO, 0, 0, msg);
        CHECK(rc == 0 && e.backend == FP_BK_BUFFERED && strstr(e.reason, "O_DIRECT not supported"),
              "auto without O_DIRECT: %d '%s'", rc, e.reason);
        fp_engine_close(&e);
        rc = open_engine(&e, fresh(path, sizeof path, "fault-odirect2"), FP_BK_THREADPOOL, 0, 0, msg);
        CHECK(rc == EINVAL && strstr(msg, "O_DIRECT refused") && access(path, F_OK) != 0,
              "O_DIRECT asked for and refused: %d '%s'", rc, msg);
        fp_inject_fault(NULL, 0, 0);
    }

    unsigned char data[16384], out[16384];
    for (int i = 0; i < 16384; i++)
        data[i] = (unsigned char)i;
    write_whole_file(fresh(path, sizeof path, "fault-read"), data, sizeof data);
    fp_reader_t r;
    fp_reader_init(&r);
    if (CHECK(fp_reader_open(&r, path, 1) == 0, "reader open")) {
        fp_read_options_t o;
        fp_read_options_default(&o);
        uint32_t crc;
        ll fsize;
        fp_inject_fault("read", EIO, 4096);
        int rc = fp_reader_read(&r, 0, (uint64_t)(uintptr_t)out, sizeof out, &o, &crc, &fsize, msg, sizeof msg);
        CHECK(rc == EIO, "injected read error: %d", rc);
        rc = fp_reader_read(&r, 0, (uint64_t)(uintptr_t)out, sizeof out, &o, &crc, &fsize, msg, sizeof msg);
        CHECK(rc == 0 && memcmp(out, data, sizeof out) == 0, "read after the fault: %d", rc);
        fp_reader_close(&r);
    }
    CHECK(fp_inject_fault("nope", 0, 0) == EINVAL, "unknown fault kind");
    fp_inject_fault(NULL, 0, 0);
}

/* ---------------------------------------------------------------- memory gone */

/* n bytes at an address the process may not touch any more, as memory freed under a
 * write is; what to munmap afterwards in map and map_len.  The bytes are made
 * inaccessible (PROT_NONE) rather than unmapped: an unmapped hole can be handed out
 * again by the next mmap (a staging buffer, an ASan arena) before the write reads it,
 * and the kernel's answer is EFAULT either way. */
static uint64_t unmapped_hole(size_t n, char **map, size_t *map_len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    *map_len = n + 2 * page;
    *map = mmap(NULL, *map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (*map == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    memset(*map + page, 0x5a, n);
    if (mprotect(*map + page, n, PROT_NONE) < 0) {
        perror("mprotect");
        exit(2);
    }
    return (uint64_t)(uintptr_t)(*map + page);
}

static void test_efault(void)
{
    size_t n = 64 * KiB, page = (size_t)sysconf(_SC_PAGESIZE);
    char path[PATH_MAX], msg[FP_MSG_MAX];
    for (int b = FP_BK_IO_URING; b <= FP_BK_BUFFERED; b++) {
        if (!available[b])
            continue;
        fp_engine_t e;
        int rc = open_engine(&e, fresh(path, sizeof path, "efault"), b, 32 * KiB, 0, msg);
        if (!CHECK(rc == 0, "open: %s", msg))
            continue;
        if (e.mem_alignment <= (ll)page && n % (size_t)e.alignment == 0) {
            char *map;
            size_t map_len;
            uint64_t hole = unmapped_hole(n, &map, &map_len);
            /* a known CRC (or none asked for): nothing reads the memory but the kernel */
            fp_extent_t x = {0, hole, (ll)n, 1, 1};
            uint32_t crc;
            fp_write_stats_t st;
            rc = fp_engine_write(&e, &x, 1, 0, (ll)n, 1, 1, &crc, &st, msg, sizeof msg);
            CHECK(rc == EFAULT, "%s: zero-copy write from unmapped memory: %d", fp_backend_name(b), rc);
            x.has_crc = 0;
            rc = fp_engine_write(&e, &x, 1, 0, (ll)n, 0, 1, &crc, &st, msg, sizeof msg);
            CHECK(rc == EFAULT, "%s: same without checksum: %d", fp_backend_name(b), rc);
            munmap(map, map_len);
        } else {
            skip("EFAULT on a zero-copy write: memory alignment above a page here");
        }
        fp_engine_close(&e);
    }
    unsigned char *zeros = xmalloc(n);
    memset(zeros, 0, n);
    write_whole_file(fresh(path, sizeof path, "efault-r"), zeros, n);
    free(zeros);
    for (int direct = 1; direct >= 0; direct--) {
        fp_reader_t r;
        fp_reader_init(&r);
        if (!CHECK(fp_reader_open(&r, path, direct) == 0, "reader open"))
            continue;
        if (r.direct && (r.mem_alignment > (ll)page || n % (size_t)r.alignment)) {
            fp_reader_close(&r);
            continue;
        }
        char *map;
        size_t map_len;
        uint64_t hole = unmapped_hole(n, &map, &map_len);
        fp_read_options_t o = {.checksum = 0, .threads = 2, .chunk_bytes = (ll)n};
        uint32_t crc;
        ll fsize;
        int rc = fp_reader_read(&r, 0, hole, (ll)n, &o, &crc, &fsize, msg, sizeof msg);
        CHECK(rc == EFAULT, "read into unmapped memory (direct=%d): %d", r.direct, rc);
        munmap(map, map_len);
        fp_reader_close(&r);
    }

    /* populate and huge-page advice on memory of our own */
    size_t len = 4 * MiB;
    char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
        m[5] = 42;
        CHECK(fp_populate((uint64_t)(uintptr_t)m + 5, len - 5, 1, msg, sizeof msg) == 0 && m[5] == 42,
              "populate keeps the bytes");
        CHECK(fp_populate((uint64_t)(uintptr_t)m, 0, 1, msg, sizeof msg) == 0, "populate nothing");
        CHECK(fp_advise_huge((uint64_t)(uintptr_t)m, len, 0) <= len, "advise_huge covers at most the range");
        CHECK(fp_advise_huge((uint64_t)(uintptr_t)m, 100, 0) == 0, "advise_huge below 2 MiB");
        munmap(m, len);
    }

    /* populate for reading a private file mapping: the file's bytes, an EFAULT (never a
     * SIGBUS) for the page past its end, EINVAL on a kernel without MADV_POPULATE_READ */
    unsigned char page1[4096];
    for (size_t i = 0; i < sizeof page1; i++)
        page1[i] = (unsigned char)(i * 7 + 3);
    write_whole_file(fresh(path, sizeof path, "populate-r"), page1, sizeof page1);
    int fd = open(path, O_RDONLY);
    char *fm = fd >= 0 ? mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    if (fd >= 0)
        close(fd);
    if (CHECK(fm != MAP_FAILED, "map the file")) {
        int r1 = fp_populate((uint64_t)(uintptr_t)fm, 4096, 0, msg, sizeof msg);
        if (r1 == EINVAL) {
            skip("MADV_POPULATE_READ: this kernel lacks it");
        } else {
            CHECK(r1 == 0 && memcmp(fm, page1, sizeof page1) == 0, "populate for reading: the file's bytes (%d)", r1);
            int r2 = fp_populate((uint64_t)(uintptr_t)fm, 8192, 0, msg, sizeof msg);
            CHECK(r2 == EFAULT, "populate past the file's end: EFAULT, not SIGBUS (%d)", r2);
        }
        munmap(fm, 8192);
    }
}

/* ---------------------------------------------------------------- main */

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

int main(int argc, char **argv)
{
    const char *parent = argc > 1 ? argv[1] : getenv("TMPDIR");
    snprintf(work, sizeof work, "%s/fp-engine-test-XXXXXX", parent && parent[0] ? parent : "/tmp");
    if (!mkdtemp(work)) {
        perror(work);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* every CRC-32C implementation this CPU has, against the bit-by-bit definition */
    static const char *const impls[] = {"software", "sse4.2", "vpclmulqdq"};
    printf("crc32c: %s\n", fp_crc32c_impl(NULL));
    for (size_t i = 0; i < sizeof impls / sizeof impls[0]; i++) {
        if (strcmp(fp_crc32c_impl(impls[i]), impls[i]) != 0) {
            char why[64];
            snprintf(why, sizeof why, "crc32c %s: not on this CPU", impls[i]);
            skip(why);
            continue;
        }
        test_crc();
        test_copy_crc();
    }
    fp_crc32c_impl("best");
    probe_backends();
    for (int b = FP_BK_IO_URING; b <= FP_BK_BUFFERED; b++)
        if (available[b])
            test_backend(b);
    test_huge_staging();
    test_tmpfile();
    test_refusals();
    test_faults();
    test_efault();
    fp_pool_release();
    nftw(work, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    printf("test_engine: %d checks, %d failed; backends:%s%s%s%s%s\n", n_checks, n_failures,
           available[0] ? " io_uring" : "", available[1] ? " threadpool" : "", available[2] ? " buffered" : "",
           skipped[0] ? "; skipped: " : "", skipped);
    puts(n_failures ? "FAILED" : "OK");
    return n_failures ? 1 : 0;
}
