/*
 * writer.h - the store's writer threads: group commit.
 *
 * Every store write of the process goes through one of two threads
 * ("lanes"), one per environment of the store (layout 4, store.h): the
 * in-flight lane ("idem-inflight": acquires, releases, heartbeats; never
 * flushed) and the records lane ("idem-writer": completes, holds, forgets,
 * purges; durable as configured). Each takes the jobs queued since its
 * last transaction (up to max_batch; under load the in-flight lane waits
 * a moment for more, writer.c) and applies them in ONE write transaction (store_apply),
 * so durability "sync" costs one fsync per batch rather than one per
 * request: while a batch syncs, the next one queues. The records lane also
 * purges expired records: every purge_interval (and at once when the store
 * reports full, to either lane) purge work becomes due, and while the store
 * says more is due, each batch's transaction carries a share of it
 * (store_apply_purge) and an empty queue is used for a purge chunk of its
 * own; both sizes follow a time budget (writer.c), so a backlog drains
 * without waiting an interval per chunk and a batch never waits behind
 * more than a few milliseconds of purging, or about as much as its own
 * writes (so purging keeps pace with them). It also clears stale reader
 * slots and, with durability "interval", syncs every sync_interval.
 *
 * Threads: writer_submit() is thread-safe and never blocks on I/O. The
 * deliver callback runs on a lane's thread, once per batch, after commit:
 * it may be called from both lanes at once.
 */
#ifndef IDEM_WRITER_H
#define IDEM_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"

struct writer_job {
    struct store_op op;      /* in/out; see store.h */
    void *owner;             /* the submitter's context; untouched */
    int error;               /* out: 0, or a negative store error */
    struct writer_job *next; /* internal */
};

/* Called on the writer thread with every job of a committed (or failed)
 * batch. The jobs belong to their submitters again once it is called. */
typedef void (*writer_deliver_fn)(struct writer_job **jobs, size_t n, void *ctx);

struct writer_options {
    struct store *store; /* borrowed; outlives the writer */
    writer_deliver_fn deliver;
    void *ctx;
    size_t max_batch;         /* ops per transaction; 0 = 1024 */
    int64_t purge_interval_ms;
    int64_t sync_interval_ms; /* 0: the store syncs each commit itself */
};

struct writer;

int writer_start(const struct writer_options *opt, struct writer **out);
/* Queues a job; it is delivered exactly once. Never blocks on the store. */
void writer_submit(struct writer *w, struct writer_job *job);
/* Applies whatever is queued, then stops the thread and frees it.
 * writer_stop(NULL) is a no-op. */
void writer_stop(struct writer *w);

/* writer_stop(), bounded: waits until deadline_ms (idem_mono_ms()) at most.
 * Returns 0 when the thread stopped (the writer is freed), or -1 when it is
 * still inside a store call at the deadline (a commit stuck in a stalled
 * disk): then nothing is freed, the thread keeps running and may still call
 * deliver, and the store must not be closed (LMDB forbids mdb_env_close
 * while a transaction is live). The caller then waits again (writer_stop()
 * or writer_stop_by() once more) or ends the process (_exit) without
 * closing the store, which LMDB takes as a crash mid-commit and survives.
 * writer_stop_by(NULL, ...) returns 0. */
int writer_stop_by(struct writer *w, int64_t deadline_ms);

struct writer_stats {
    uint64_t batches;
    uint64_t ops;
    uint64_t max_batch;
    uint64_t purged;
};
void writer_get_stats(struct writer *w, struct writer_stats *out);

/* The writer remembers every lease an acquire of this process took, until
 * the submitter forgets it here (when its request is gone, settled or not),
 * and no acquire of this process steals one of them (store.h,
 * has_live_lease): the holder is alive, its heartbeat only late. Any
 * thread; writer_forget_lease(NULL, ...) is a no-op. */
void writer_forget_lease(struct writer *w, const uint8_t key[STORE_KEY_BYTES],
                         const uint8_t lease_id[STORE_LEASE_ID_BYTES]);

#endif
