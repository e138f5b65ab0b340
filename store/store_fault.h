/*
 * store_fault.h - LMDB fault injection, for tests/faults only.
 *
 * Compiled only when the build sets IDEM_FAULT_INJECTION (CMake option of
 * the same name, default OFF); without it this header declares nothing and
 * store_lmdb.c calls LMDB directly. With it, store_lmdb.c routes the LMDB
 * calls that can fail once a store is open (transaction begin and commit,
 * get, put, del, cursor calls, env sync, reader check) through
 * store_fault_lmdb(), which counts them and, SQLite-style, makes the Nth one
 * fail instead of running:
 *
 *   IDEM_FAULT_LMDB_NTH=N    fail the Nth counted call (0 or unset: never)
 *   IDEM_FAULT_LMDB_ERR=eio  every counted call fails with EIO (default)
 *                      full  only puts and deletes count, and fail with
 *                            MDB_MAP_FULL (what a full map gives them)
 *
 * A failed commit aborts its transaction first, as LMDB's own failing
 * commit does. Nothing counts until store_fault_arm() is called (the proxy
 * calls it once it is serving), so the count covers only what follows. The
 * store still never logs: the caller reads store_fault_lmdb_failed() and
 * says what was failed.
 *
 * Thread-safe: the counters are atomic; store_fault_arm() reads the
 * environment and must be called before the threads that use the store
 * rely on it (any time is safe, but calls racing it may go uncounted).
 */
#ifndef IDEM_STORE_FAULT_H
#define IDEM_STORE_FAULT_H

#ifdef IDEM_FAULT_INJECTION

#include <stdbool.h>
#include <stdint.h>

/* Reads IDEM_FAULT_LMDB_NTH and IDEM_FAULT_LMDB_ERR and starts counting. */
void store_fault_arm(void);

/* Called by store_lmdb.c's wrappers before each call. is_write: a put or a
 * delete (the calls that meet MDB_MAP_FULL). Returns true when this call is
 * the one to fail; it then returns store_fault_lmdb_err(is_write) instead of
 * running. func and call are string literals (kept, not copied). */
bool store_fault_lmdb(const char *func, const char *call, bool is_write);
int store_fault_lmdb_err(bool is_write);

/* Counted calls since arming: all of them, and puts/deletes only. */
uint64_t store_fault_lmdb_calls(void);
uint64_t store_fault_lmdb_write_calls(void);

/* The call that was failed, "function: mdb_call(...)" split in two; both
 * NULL while none was. Static strings. */
void store_fault_lmdb_failed(const char **func, const char **call);

/* A test's hook at a named point of the store (unit tests only: they step
 * another thread through the point's window). store_lmdb.c calls
 * store_fault_point() there; with a hook set it calls fn(point, ctx) on the
 * store's thread, holding whatever the store holds at that point. Points:
 *   "inflight-batch-records-snapshot"  F's writer (layout 4) has F's writer
 *       lock, has taken the queued deletes of completed entries, and has
 *       just begun its read of R; no op of the batch has run yet.
 *   "read-key-records-missed"  a lookup (get, view; layout 4) has searched
 *       R without finding what an acquire goes by, and is about to begin
 *       F's snapshot and then renew R's.
 * NULL fn removes the hook. Not thread-safe against store calls running
 * while it is set or removed. */
typedef void (*store_fault_hook_fn)(const char *point, void *ctx);
void store_fault_set_hook(store_fault_hook_fn fn, void *ctx);
void store_fault_point(const char *point);

#endif

#endif
