/*
 * faults.c -- fault injection: a process-wide TEST HOOK (Python: inject_fault).
 *
 * Armed faults are read on the engine's hot paths, so a flag read without the lock
 * says whether any is armed at all; only then is the mutex taken.
 */
#define _GNU_SOURCE
#include "fp_engine.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

static pthread_mutex_t fault_mu = PTHREAD_MUTEX_INITIALIZER;

/* a child forked while another thread held it would never get it */
static void faults_after_fork_in_child(void) { pthread_mutex_init(&fault_mu, NULL); }

__attribute__((constructor)) static void faults_register_fork_handler(void)
{
    pthread_atfork(NULL, NULL, faults_after_fork_in_child);
}
static int fault_any;            /* fast-path flag, read atomically */
static int fault_write_errno;    /* one-shot; 0 = disarmed */
static ll fault_write_after;
static int fault_short_write;    /* stays armed */
static int fault_setup_errno;    /* io_uring_setup */
static int fault_odirect_errno;  /* O_DIRECT open */
static int fault_read_errno;     /* one-shot */
static ll fault_read_after;
static int fault_lose_completion; /* one-shot */
static ll fault_lose_after;
static int fault_rename;          /* one-shot: errno, or -1 for SIGKILL */

static void fault_update_any(void)
{
    int any = fault_write_errno || fault_short_write || fault_setup_errno ||
              fault_odirect_errno || fault_read_errno || fault_lose_completion ||
              fault_rename;
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

static int fault_get(int *v)
{
    if (!__atomic_load_n(&fault_any, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&fault_mu);
    int e = *v;
    pthread_mutex_unlock(&fault_mu);
    return e;
}

int fp_fault_write(ll off, ll len) { return fault_check_range(&fault_write_errno, fault_write_after, off, len); }
int fp_fault_read(ll off, ll len) { return fault_check_range(&fault_read_errno, fault_read_after, off, len); }
int fp_fault_io_uring_setup(void) { return fault_get(&fault_setup_errno); }
int fp_fault_o_direct(void) { return fault_get(&fault_odirect_errno); }

int fp_fault_rename(void)
{
    if (!__atomic_load_n(&fault_any, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&fault_mu);
    int e = fault_rename;
    fault_rename = 0;
    fault_update_any();
    pthread_mutex_unlock(&fault_mu);
    return e;
}

int fp_fault_lose_completion(ll off)
{
    if (!__atomic_load_n(&fault_any, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&fault_mu);
    int lose = fault_lose_completion && off >= fault_lose_after;
    if (lose)
        fault_lose_completion = 0;
    fault_update_any();
    pthread_mutex_unlock(&fault_mu);
    return lose;
}

/* Under "short_write": half, rounded down to the alignment, at least one block. */
ll fp_fault_first_len(ll n, ll align)
{
    if (!fault_get(&fault_short_write))
        return n;
    ll h = (n / 2) / align * align;
    if (h < align)
        h = align;
    return h < n ? h : n;
}

int fp_inject_fault(const char *kind, int err, ll after)
{
    int e = err > 0 ? err : EIO;
    int bad = 0;
    pthread_mutex_lock(&fault_mu);
    if (!kind) {
        fault_write_errno = fault_short_write = fault_setup_errno = fault_odirect_errno = fault_read_errno = 0;
        fault_lose_completion = fault_rename = 0;
    } else if (!strcmp(kind, "write")) {
        fault_write_errno = e;
        fault_write_after = after;
    } else if (!strcmp(kind, "short_write")) {
        fault_short_write = 1;
    } else if (!strcmp(kind, "io_uring_setup")) {
        fault_setup_errno = e;
    } else if (!strcmp(kind, "o_direct")) {
        fault_odirect_errno = err > 0 ? err : EINVAL;
    } else if (!strcmp(kind, "lose_completion")) {
        fault_lose_completion = 1;
        fault_lose_after = after;
    } else if (!strcmp(kind, "rename")) {
        fault_rename = e;
    } else if (!strcmp(kind, "kill_before_rename")) {
        fault_rename = -1;
    } else if (!strcmp(kind, "read")) {
        fault_read_errno = e;
        fault_read_after = after;
    } else {
        bad = 1;
    }
    fault_update_any();
    pthread_mutex_unlock(&fault_mu);
    return bad ? EINVAL : 0;
}
