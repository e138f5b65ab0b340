/*
 * store_fault.c - LMDB fault injection (see store_fault.h). Compiled only
 * with IDEM_FAULT_INJECTION.
 */
#include "store_fault.h"

#include <errno.h>
#include <lmdb.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static atomic_bool armed;
static bool fail_as_full;
static uint64_t nth;
static atomic_uint_fast64_t calls;
static atomic_uint_fast64_t write_calls;
static const char *_Atomic failed_func;
static const char *_Atomic failed_call;

void store_fault_arm(void)
{
    const char *n = getenv("IDEM_FAULT_LMDB_NTH");
    const char *e = getenv("IDEM_FAULT_LMDB_ERR");

    nth = n != NULL ? strtoull(n, NULL, 10) : 0;
    fail_as_full = e != NULL && strcmp(e, "full") == 0;
    atomic_store(&calls, 0);
    atomic_store(&write_calls, 0);
    atomic_store_explicit(&armed, true, memory_order_release);
}

bool store_fault_lmdb(const char *func, const char *call, bool is_write)
{
    uint64_t k;
    bool fail = false;

    if (!atomic_load_explicit(&armed, memory_order_acquire)) {
        goto out;
    }
    k = atomic_fetch_add(&calls, 1) + 1;
    if (is_write) {
        uint64_t kw = atomic_fetch_add(&write_calls, 1) + 1;
        if (fail_as_full) {
            k = kw;
        }
    } else if (fail_as_full) {
        goto out; /* only puts and deletes meet a full map */
    }
    if (nth != 0 && k == nth) {
        atomic_store(&failed_func, func);
        atomic_store(&failed_call, call);
        fail = true;
    }
out:
    return fail;
}

/* EIO is what a failing disk gives a commit or a sync; reads of a bad disk
 * give MDB_CORRUPTED or MDB_PAGE_NOTFOUND, which the store maps to the same
 * STORE_EIO, so one hard error stands for all of them. */
int store_fault_lmdb_err(bool is_write)
{
    return is_write && fail_as_full ? MDB_MAP_FULL : EIO;
}

uint64_t store_fault_lmdb_calls(void)
{
    return atomic_load(&calls);
}

uint64_t store_fault_lmdb_write_calls(void)
{
    return atomic_load(&write_calls);
}

void store_fault_lmdb_failed(const char **func, const char **call)
{
    *func = atomic_load(&failed_func);
    *call = atomic_load(&failed_call);
}

static store_fault_hook_fn hook_fn;
static void *hook_ctx;

void store_fault_set_hook(store_fault_hook_fn fn, void *ctx)
{
    hook_ctx = ctx;
    hook_fn = fn;
}

void store_fault_point(const char *point)
{
    if (hook_fn != NULL)
        hook_fn(point, hook_ctx);
}
