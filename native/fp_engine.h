/*
 * fp_engine.h -- internal C API of FastPersist's native I/O engine.
 *
 * The engine knows bytes, files and offsets only and never includes Python.h:
 * binding.c turns it into the module fp_core._native, native/tests/test_engine.c
 * drives it from plain C.  Builds with a C compiler and kernel headers: io_uring is
 * reached through raw system calls (no liburing), the CRC-32C uses SSE4.2 only inside
 * functions compiled for it and chosen at run time, with a portable fallback.
 *
 * Results: functions that can fail return 0, an errno (> 0) from the system, or one
 * of the FP_E* codes below (< 0).  Where a failure has more to say than its errno,
 * the caller passes a message buffer (msg, cap) that the engine fills; it is left
 * empty ("") when the errno says everything.
 *
 *   crc32c.c     CRC-32C (hardware, software, combine), copy with fused CRC
 *   faults.c     fault injection: a process-wide test hook
 *   staging.c    staging-buffer pool on huge pages, memory advice, populate
 *   uring.c      io_uring through raw system calls
 *   engine.c     the writer's file: open (O_TMPFILE, O_DIRECT, backend choice,
 *                alignment), truncate, sync, close
 *   write_job.c  one write: checks, items, copy threads, pwrite pool, io_uring owner
 *   read_job.c   the reader
 */
#ifndef FP_ENGINE_H
#define FP_ENGINE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef long long ll;

/* Engine results below zero (errnos are above). */
enum {
    FP_EARG = -1,   /* arguments refused before any I/O: msg says why (Python: ValueError) */
    FP_EOF = -2,    /* a read reaches past the end of the file (Python: EOFError) */
    FP_ENOMEM = -3, /* the engine's own bookkeeping could not be allocated (Python: MemoryError);
                     * a staging buffer that cannot be had is ENOMEM, an I/O error like others */
};

/* Message buffers: long enough for every message the engine writes. */
#define FP_MSG_MAX 512

/* ---------------------------------------------------------------- crc32c.c */

/* The tables are built on first use of any of these (pthread_once). */

/* 1 when the CPU has SSE4.2 and the hardware CRC-32C is in use. */
int fp_have_sse42(void);
/* The CRC-32C implementation in use: "software", "sse4.2" or "vpclmulqdq" (the best this
 * CPU has, by default). A name the CPU supports, or "best", switches every thread to it:
 * for tests and side-by-side measurements only (switch while no checksum runs). */
const char *fp_crc32c_impl(const char *want);
/* CRC-32C (Castagnoli) of n bytes continuing the CRC `crc` (0 to start). */
uint32_t fp_crc32c(uint32_t crc, const void *p, size_t n);
/* CRC-32C of A||B from crc(A), crc(B) and len(B). */
uint32_t fp_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
/* memcpy of non-overlapping ranges with the CRC of the bytes computed in the same pass,
 * continuing `crc`; returns 0 without checksum.  fp_copy_crc uses streaming stores where
 * dst is 16-byte aligned (bytes going to the disk next), fp_copy_crc_cached ordinary ones
 * (bytes the caller reads next). */
uint32_t fp_copy_crc(void *dst, const void *src, size_t n, uint32_t crc, int checksum);
uint32_t fp_copy_crc_cached(void *dst, const void *src, size_t n, uint32_t crc, int checksum);

/* ---------------------------------------------------------------- faults.c */

/* Arm a fault (a TEST HOOK, process wide):
 *   "write"          one-shot: the first write request reaching past `after` bytes fails with err
 *   "short_write"    every write request's first attempt writes only half; stays armed
 *   "io_uring_setup" io_uring_setup fails with err
 *   "o_direct"       enabling O_DIRECT fails with err
 *   "read"           one-shot: the first read reaching past `after` bytes fails with err
 *   "lose_completion" one-shot: the io_uring owner ignores the completion of the next write
 *                    request at file offset `after` or beyond, as if the kernel never posted
 *                    it (the stall watchdog's test)
 *   "rename"         one-shot: link_replace's rename over an existing name fails with err
 *   "kill_before_rename" one-shot: link_replace kills its process (SIGKILL) after the link
 *                    to the temporary name, before the rename (a crash in that window)
 *   NULL             clear every fault
 * err 0 means the kind's default: EINVAL for "o_direct", EIO for the others.
 * Returns 0, or EINVAL for an unknown kind (nothing armed). */
int fp_inject_fault(const char *kind, int err, ll after);

/* Hooks the engine calls: 0, or the errno to fail with. */
int fp_fault_write(ll off, ll len);
int fp_fault_read(ll off, ll len);
int fp_fault_io_uring_setup(void);
int fp_fault_o_direct(void);
int fp_fault_rename(void); /* 0, an errno, or -1: die by SIGKILL here */
int fp_fault_lose_completion(ll off); /* 1 once when armed, for the first request at off >= after */
/* Length of a write request's first attempt: n, or under "short_write" about half of it
 * (rounded down to the alignment, at least one block). */
ll fp_fault_first_len(ll n, ll align);

/* ---------------------------------------------------------------- staging.c */

/* A staging buffer: from the process-wide pool (gen != 0) or private (gen == 0). */
typedef struct {
    void *p;
    size_t size, align;
    unsigned gen;
} fp_sbuf_t;

/* A buffer of at least `size` bytes aligned to max(align, 4096): 0 or ENOMEM. */
int fp_pool_get(fp_sbuf_t *b, size_t size, size_t align);
/* Give it back (kept for the next call, or freed); b->p == NULL is a no-op. */
void fp_pool_put(fp_sbuf_t *b);
/* Free the pool's idle buffers; those still out are freed when they come back. */
void fp_pool_release(void);
/* Bytes the pool holds (idle and out). */
size_t fp_pool_bytes(void);

/* Transparent huge pages under the 2 MiB-aligned interior of [addr, addr + n):
 * MADV_HUGEPAGE, with collapse MADV_COLLAPSE too.  Returns the bytes covered, 0 where
 * the kernel refused or the interior is empty. */
uint64_t fp_advise_huge(uint64_t addr, uint64_t n, int collapse);
/* Fault every page of [addr, addr + n) in for writing, contents unchanged.  0, an errno
 * (ENOMEM, EFAULT, EINVAL: memory missing or not writable), or FP_EARG when the range
 * wraps around the address space.  With write 0, for reading (MADV_POPULATE_READ, Linux
 * 5.14; a file mapping's pages are read in by the kernel, a private one's not copied, then a
 * byte of each read so that a VM's host maps them now):
 * EINVAL on a kernel without it (nothing touched), EFAULT where a page lies past the end
 * of a mapped file (where a touch would raise SIGBUS). */
int fp_populate(uint64_t addr, uint64_t n, int write, char *msg, size_t cap);

/* ---------------------------------------------------------------- uring.c */

struct io_uring_sqe;
struct io_uring_cqe;

/* One io_uring, its three mappings and the submission tail not yet published. */
typedef struct {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_entries, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz, sqes_sz;
    unsigned tail;     /* local SQ tail */
    unsigned features; /* IORING_FEAT_* of the kernel */
    int broken;        /* failed, or a request was lost: later writes use a pwrite pool */
    int stalled_direct; /* a request given up on wrote from the caller's memory (zero-copy) */
} fp_ring_t;

/* A closed ring (safe to fp_ring_close). */
void fp_ring_init(fp_ring_t *R);
/* 0 or errno; on failure R is closed. */
int fp_ring_setup(fp_ring_t *R, unsigned entries);
void fp_ring_close(fp_ring_t *R);
/* The next free submission entry, zeroed; NULL when the queue is full. */
struct io_uring_sqe *fp_ring_sqe(fp_ring_t *R);
/* Make the entries taken so far visible to the kernel. */
void fp_ring_publish(fp_ring_t *R);
/* Entries published but not yet consumed by the kernel. */
unsigned fp_ring_unsubmitted(fp_ring_t *R);
/* io_uring_enter: >= 0, or -1 with errno set. */
int fp_ring_enter(fp_ring_t *R, unsigned to_submit, unsigned min_complete, unsigned flags);
/* Submit and wait for one completion, at most timeout_ms (0: no limit; also where the kernel
 * has no IORING_FEAT_EXT_ARG): >= 0, or -1 with errno set (ETIME: the time ran out). */
int fp_ring_wait(fp_ring_t *R, unsigned to_submit, int timeout_ms);

/* ---------------------------------------------------------------- engine.c */

typedef enum { FP_BK_IO_URING = 0, FP_BK_THREADPOOL = 1, FP_BK_BUFFERED = 2, FP_BK_AUTO = 3 } fp_backend_t;

/* "io_uring", "threadpool", "buffered" ("auto" for FP_BK_AUTO). */
const char *fp_backend_name(int backend);
/* The backend called `name` ("auto" included), or -1. */
int fp_backend_parse(const char *name);

typedef struct {
    int backend;      /* FP_BK_AUTO: io_uring, falling back to a pwrite pool, then to buffered */
    int create;       /* a new file (O_CREAT | O_EXCL, removed again if the engine cannot start) */
    int tmpfile;      /* path is a directory; the file an unnamed one in it (O_TMPFILE) */
    int mode;         /* permissions of a new file, less the umask */
    int queue_depth;  /* [1, 4096] */
    int copy_threads; /* [1, 64] */
    int io_threads;   /* [1, 256] */
    ll chunk_bytes;   /* [4096, 1 GiB], rounded up to the alignment */
} fp_engine_options_t;

/* The defaults of Engine(): auto, create, 16 deep, 4 MiB chunks, 2 copy and 4 I/O threads. */
void fp_engine_options_default(fp_engine_options_t *o);
/* 0, or FP_EARG with the reason in msg. */
int fp_engine_options_check(const fp_engine_options_t *o, char *msg, size_t cap);

/* A writer of byte ranges of one file, for one call at a time.  Every field is read-only
 * to callers; after fp_engine_close they keep the values of the last open (fd is -1). */
typedef struct {
    int fd;      /* -1: closed */
    int backend; /* FP_BK_IO_URING, FP_BK_THREADPOOL or FP_BK_BUFFERED */
    ll alignment, mem_alignment;
    int queue_depth, copy_threads, io_threads;
    ll chunk_bytes;
    char reason[FP_MSG_MAX]; /* why the first choice of backend was not used ("" when it was) */
    fp_ring_t ring;
    int efd;
} fp_engine_t;

/* A closed engine. */
void fp_engine_init(fp_engine_t *e);
/* Open path (closing what e had open first).  0; FP_EARG (bad options, msg); an errno with msg ""
 * when the file cannot be opened; an errno with msg when O_DIRECT or io_uring was asked
 * for and is not available (a file created for it is removed again). */
int fp_engine_open(fp_engine_t *e, const char *path, const fp_engine_options_t *o, char *msg, size_t cap);
/* Close the ring and the file; idempotent. */
void fp_engine_close(fp_engine_t *e);
/* ftruncate / fdatasync: 0 or errno. */
int fp_engine_truncate(fp_engine_t *e, ll size);
int fp_engine_sync(fp_engine_t *e);

/* O_DIRECT alignment of fd: offsets and lengths (at least 512), memory (at least 4096). */
void fp_detect_alignment(int fd, ll *align, ll *mem_align);

/* ---------------------------------------------------------------- write_job.c */

/* Bytes [off, off + len) of the file come from memory at addr. */
typedef struct {
    ll off;
    uint64_t addr;
    ll len;
    int has_crc;  /* the caller knows this extent's CRC-32C (computed while copying it) */
    uint32_t crc;
} fp_extent_t;

typedef struct {
    ll bytes, bytes_padded, zero_copy_bytes;
    double seconds, copy_seconds, io_wait_seconds;
    long requests, short_writes;
} fp_write_stats_t;

/* Whether [start, end) can be written by e: 0 or FP_EARG (msg). */
int fp_write_check_range(const fp_engine_t *e, ll start, ll end, char *msg, size_t cap);
/* Write the file range [start, end), padded with zeros up to the alignment: ext[0..n_ext)
 * sorted, non-overlapping and inside the range, bytes not covered are zeros.  With
 * zero_copy, extents aligned in memory and file are written from their memory, which
 * must stay mapped until this returns.  crcs[i] gets extent i's CRC-32C (its known CRC
 * when has_crc; all 0 without checksum).  Returns 0, FP_EARG (msg), FP_ENOMEM, or the
 * errno of the first failed request (EFAULT: zero-copy memory gone).  A write that
 * fails leaves the file's contents in the range unspecified. */
int fp_engine_write(fp_engine_t *e, const fp_extent_t *ext, int n_ext, ll start, ll end, int checksum,
                    int zero_copy, uint32_t *crcs, fp_write_stats_t *stats, char *msg, size_t cap);

/* ---------------------------------------------------------------- read_job.c */

/* A reader of one file, for one call at a time. */
typedef struct {
    int fd;     /* -1: closed */
    int direct; /* O_DIRECT in use */
    ll size;    /* at open */
    ll alignment, mem_alignment;
} fp_reader_t;

typedef struct {
    int checksum;   /* compute the CRC-32C of the bytes read */
    int threads;    /* [1, 64] */
    ll chunk_bytes; /* [4096, 1 GiB] */
    /* Optional: n_ranges (offset, length) pairs inside the read, sorted and disjoint; the
     * CRC-32C of each lands in range_crcs, computed on the read threads as each chunk
     * lands (a loader checks every record of a file read whole in one pass). */
    const ll *ranges;
    int n_ranges;
    uint32_t *range_crcs;
} fp_read_options_t;

void fp_reader_init(fp_reader_t *r);
void fp_read_options_default(fp_read_options_t *o);
/* Open path for reading (closing what r had open first), with O_DIRECT when asked and the
 * file system takes it: 0 or errno. */
int fp_reader_open(fp_reader_t *r, const char *path, int direct);
void fp_reader_close(fp_reader_t *r);
/* Read [off, off + len) into memory at addr (any alignment).  Returns 0 with *crc (0
 * without checksum) and o->range_crcs filled; FP_EARG (msg); FP_EOF with *file_size the size found (-1 if
 * unknown); FP_ENOMEM; or errno (EFAULT: the destination is gone). */
int fp_reader_read(fp_reader_t *r, ll off, uint64_t addr, ll len, const fp_read_options_t *o, uint32_t *crc,
                   ll *file_size, char *msg, size_t cap);

/* One piece of a scatter read: len bytes of the file at off into memory at addr. */
typedef struct {
    ll off;
    uint64_t addr;
    ll len;
} fp_piece_t;

/* Read n pieces (sorted by file offset, each at most o->chunk_bytes; they may overlap in
 * the file) into memory at their addresses on o->threads threads: pieces whose gaps are at
 * most gap bytes are read together in one request of up to a chunk.  crcs[i]: the CRC-32C
 * of piece i with o->checksum, else 0 (o->ranges is not used).  Returns as fp_reader_read. */
int fp_reader_scatter(fp_reader_t *r, const fp_piece_t *p, int n, const fp_read_options_t *o, ll gap,
                      uint32_t *crcs, ll *file_size, char *msg, size_t cap);

/* ---------------------------------------------------------------- small helpers */

static inline double fp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* pthread_create with a small stack (the engine's threads only copy and wait): 0 or errno. */
static inline int fp_spawn(pthread_t *t, void *(*fn)(void *), void *arg)
{
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setstacksize(&at, 256 * 1024);
    int r = pthread_create(t, &at, fn, arg);
    pthread_attr_destroy(&at);
    return r;
}

static inline ll fp_align_up(ll v, ll a) { return (v + a - 1) / a * a; }
static inline ll fp_align_down(ll v, ll a) { return v / a * a; }

/* File offsets and lengths come from parsed checkpoint files too, so they are not
 * trusted: a sum that does not fit a file offset is refused, never computed (signed
 * overflow is undefined; the -fwrapv in Python's CFLAGS would only turn it into a
 * negative end that passes every later comparison).  0 and *end = off + len, or -1. */
static inline int fp_end_of(ll off, ll len, ll *end) { return __builtin_add_overflow(off, len, end) ? -1 : 0; }

/* Whether [addr, addr + len) stays inside the address space (len >= 0). */
static inline int fp_addr_range_ok(uint64_t addr, ll len) { return (uint64_t)len <= UINT64_MAX - addr; }

#endif
