/*
 * writer.c - group commit of store writes, one thread per lane (see writer.h).
 */
/* pthread_setname_np is a GNU extension. */
#define _GNU_SOURCE 1
#include "writer.h"
#include "clock.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "diag.h"
/*
 * Purging is spread thin so that a request batch never waits behind more
 * than a little of it. Once purge work is due (every purge_interval, or at
 * once when the store is full) and for as long as the store says more is
 * due (a backlog), every request batch's transaction also purges a share
 * (store_apply_purge: one commit, one fsync for both), and when no request
 * is queued the writer purges one chunk in a transaction of its own, then
 * looks at the queue again. Both sizes follow a time budget: a share is
 * halved when its batch took longer than PURGE_BATCH_BUDGET_US and doubled
 * when it took less than half of it (so a busy writer purges less per
 * batch, an idle one more), and likewise an idle chunk with
 * PURGE_IDLE_BUDGET_US. Time rather than a count, because what a deleted
 * record costs depends on the store: mostly one 4 KiB leaf page written at
 * commit, ~18 us of writer time with durability "sync" on a store of
 * 1,000,000 records, ~3 us without the fsync (docs/benchmarks.md, Purge).
 * A share is never less than its batch's op count (up to
 * PURGE_FLOOR_MAX), though: a busy lane is never idle, and when its
 * batch's own durable commit takes the whole budget the time rule pins
 * the share at its minimum, where purging fell behind the records the
 * batches write (3,600 a second against 12,000 under `unique`) and the
 * store would fill. A batch then waits for about as much purging as its
 * own writes.
 * After STORE_FULL the writer purges PURGE_FULL_BATCH x PURGE_FULL_ROUNDS
 * records at once, as the store needs room right away.
 */
#define PURGE_BATCH_BUDGET_US 3000
#define PURGE_FLOOR_MAX 256
#define PURGE_IDLE_BUDGET_US 2000
#define PURGE_CHUNK_MIN 8
#define PURGE_CHUNK_MAX 1024
#define PURGE_FULL_BATCH 512
#define PURGE_FULL_ROUNDS 8
#define READER_CHECK_EVERY_MS 10000
/*
 * The in-flight lane commits without a flush, so it commits as soon as it
 * has a job: under `unique` 2,900 commits a second of 4-5 acquires each,
 * every one rewriting the same few pages of a small tree. Under load (its
 * last batch had LINGER_AFTER_JOBS jobs or more and ended less than
 * LINGER_BUSY_US ago) it waits up to LINGER_US (plus the timer's slack)
 * for LINGER_JOBS jobs before it commits: there, a third of the commits,
 * twice the records per commit, a little less of the lane's CPU, and no
 * change in throughput or latency that the benchmark can tell from its
 * noise (docs/benchmarks.md, "The in-flight lane waits for company").
 * A few clients at a time, whose batches are one to three jobs, never make
 * it wait (they could not fill a batch in time anyway). The records lane
 * never lingers: with durability "sync" its commits wait for a flush,
 * during which the next batch gathers anyway.
 */
#define LINGER_JOBS 16
#define LINGER_AFTER_JOBS 4
#define LINGER_US 150
#define LINGER_BUSY_US 2000
/* A failing store is said on stderr at once, then at most this often while
 * it keeps failing the same way. A store that flaps (fails, recovers, fails
 * again: a full store whose purges free a little room at a time) says each
 * condition, and its recovery, at most once per FLAP_LOG_EVERY_MS. A
 * condition is a store error with its cause (store_last_cause()). */
#define FAILURE_LOG_EVERY_MS 10000
#define FLAP_LOG_EVERY_MS 1000
#define LOG_CONDITIONS 4
/* Buckets of the live leases' table (writer_forget_lease), by key hash. */
#define LIVE_BUCKETS 1024

struct live_lease {
    uint8_t key[STORE_KEY_BYTES];
    uint8_t lease_id[STORE_LEASE_ID_BYTES];
    struct live_lease *next;
};

/*
 * Two lanes, each a thread with its own queue and its own group commit,
 * because the store keeps two environments (layout 4, store.h): the
 * records in flight, never flushed (acquires, releases, heartbeats), and
 * the records, durable (completes, holds, forgets; purges, syncs and the
 * reader check run there too). An acquire then never queues behind a
 * durable commit. Ops of one key may go to both lanes; the store keeps
 * their edges atomic across the two (store_lmdb.c).
 */
enum { LANE_IN_FLIGHT = 0, LANE_RECORDS = 1, LANES = 2 };

struct lane {
    struct writer *parent;
    bool records; /* the records' lane: purging, syncing, the reader check */
    const char *name;
    struct writer_options opt; /* the writer's, copied */
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct writer_job *head; /* FIFO under lock */
    struct writer_job *tail;
    size_t queued;  /* jobs in the FIFO */
    bool lingering; /* waiting for more jobs to join a commit: wake it at linger_jobs only */
    size_t linger_jobs; /* LINGER_JOBS, or max_batch if smaller */
    bool stopping;
    /* The records' lane: the other lane's acquires found the store full,
     * and this one purges at once (under lock): the store does not purge
     * in the lane that carries the heartbeats, which would wait for the
     * records' writer lock (store_lmdb.c, apply_after_full). */
    bool purge_full_asked;
    bool stopped;                /* writer_main has returned (under lock) */
    pthread_cond_t stopped_cond; /* signalled when it is set */

    /* writer-thread only */
    struct writer_job **jobs;
    struct store_op *ops;
    int *errors; /* per job of the batch under way */
    bool purge_due;     /* purge work is due: an interval tick, STORE_FULL or "more" */
    size_t batch_share; /* purge budget per request batch, adapted to its time budget */
    size_t idle_chunk;  /* records per idle purge transaction, likewise */
    struct {
        int rc;       /* store error */
        int cause;    /* its LMDB or errno code */
        int64_t said; /* when it was last said on stderr; 0: never */
    } said[LOG_CONDITIONS];
    bool failing; /* the last write failed (said or not) */
    int fail_rc;  /* how, while failing */
    int fail_cause;
    int64_t recovered_said;     /* when a recovery was last said; 0: never */
    uint64_t failures_unlogged; /* failed writes since the last line, not said */
};

struct writer {
    struct writer_options opt;
    struct lane lanes[LANES];
    bool started[LANES];

    pthread_mutex_t stats_lock;
    struct writer_stats stats;

    /* The leases this process's acquires took and whose requests are still
     * there: added by the writer before it delivers the acquire, removed by
     * writer_forget_lease(). Newest first in a bucket. */
    pthread_mutex_t live_lock;
    struct live_lease *live[LIVE_BUCKETS];
};

static int64_t mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* CLOCK_MONOTONIC now + us, for the lanes' conds (monotonic). */
static struct timespec deadline_in_us(int64_t us)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (long)(us % 1000000) * 1000L;
    ts.tv_sec += (time_t)(us / 1000000) + ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    return ts;
}

/* Halves or doubles a purge size so that the transaction it rides in takes
 * about budget_us; called only while a backlog remains (more), since a
 * transaction that ran out of due records says nothing about the size. */
static void adapt_chunk(size_t *chunk, int64_t took_us, int64_t budget_us)
{
    if (took_us > budget_us && *chunk > PURGE_CHUNK_MIN)
        *chunk /= 2;
    else if (took_us < budget_us / 2 && *chunk < PURGE_CHUNK_MAX)
        *chunk *= 2;
}

/* When the condition (rc, cause) was last said, in a slot of w->said (the
 * oldest one is reused for a new condition). */
static int64_t *said_slot(struct lane *w, int rc, int cause)
{
    size_t oldest = 0;
    for (size_t i = 0; i < LOG_CONDITIONS; i++) {
        if (w->said[i].said != 0 && w->said[i].rc == rc && w->said[i].cause == cause)
            return &w->said[i].said;
        if (w->said[i].said < w->said[oldest].said)
            oldest = i;
    }
    w->said[oldest].rc = rc;
    w->said[oldest].cause = cause;
    w->said[oldest].said = 0;
    return &w->said[oldest].said;
}

/* Says on stderr that a store write failed, or that the store is full
 * (full: ops were refused STORE_FULL), and why, naming the cause (the map or
 * the file system, with its errno): the clients only see 503, the operator
 * needs the reason. Throttled as said above FAILURE_LOG_EVERY_MS. */
static void log_failure(struct lane *w, const char *what, int rc, bool full)
{
    char cause[192];
    int code = store_last_cause(cause, sizeof(cause));
    int64_t now = idem_mono_ms();
    int64_t *said = said_slot(w, rc, code);
    bool same = w->failing && w->fail_rc == rc && w->fail_cause == code;
    int64_t every = same ? FAILURE_LOG_EVERY_MS : FLAP_LOG_EVERY_MS;
    char more[96] = "";

    w->failing = true;
    w->fail_rc = rc;
    w->fail_cause = code;
    if (*said != 0 && now - *said < every) {
        w->failures_unlogged++;
        return;
    }
    if (code == 0)
        snprintf(cause, sizeof(cause), "%s", store_strerror(rc));
    if (w->failures_unlogged > 0)
        snprintf(more, sizeof(more), " (and %llu failed transactions since the last such line)",
                 (unsigned long long)w->failures_unlogged);
    if (full)
        idem_diag("idemproxy: store: full, new keys get 503 until purging frees room: %s%s", cause,
                  more);
    else
        idem_diag("idemproxy: store: %s failed: %s%s", what, cause, more);
    *said = now;
    w->failures_unlogged = 0;
}

/* After a failure, the first request batch committed is said too (a purge
 * that found nothing commits nothing, so it proves nothing), at most once
 * per FLAP_LOG_EVERY_MS: a recovery not said yet is said by a later batch. */
static void log_recovered(struct lane *w)
{
    int64_t now = idem_mono_ms();

    if (!w->failing)
        return;
    if (w->recovered_said != 0 && now - w->recovered_said < FLAP_LOG_EVERY_MS)
        return;
    idem_diag("idemproxy: store: writes succeed again (%llu failed transactions since the last "
              "failure line)",
              (unsigned long long)w->failures_unlogged);
    w->failing = false;
    w->recovered_said = now;
    w->failures_unlogged = 0;
}

static void count_purged(struct lane *w, size_t purged)
{
    pthread_mutex_lock(&w->parent->stats_lock);
    w->parent->stats.purged += purged;
    pthread_mutex_unlock(&w->parent->stats_lock);
}

/* The store reported STORE_FULL: make room now, in bigger batches. */
static void purge_full(struct lane *w)
{
    size_t total = 0;
    bool more = false;

    for (int round = 0; round < PURGE_FULL_ROUNDS; round++) {
        size_t purged = 0;
        int rc = store_purge(w->opt.store, PURGE_FULL_BATCH, &purged, &more);
        if (rc != 0) {
            log_failure(w, "purging a full store", rc, false);
            more = false;
            break;
        }
        total += purged;
        if (!more)
            break;
    }
    w->purge_due = w->records && more;
    count_purged(w, total);
}

/* No request is queued: one purge transaction of its own, sized so that a
 * request arriving meanwhile waits about PURGE_IDLE_BUDGET_US at most, on a
 * small store or a large one. A failed purge (the disk, say) waits for the
 * next interval. */
static void purge_idle(struct lane *w)
{
    size_t purged = 0;
    bool more = false;
    int64_t start_us = mono_us();
    int64_t took_us;
    int rc = store_purge(w->opt.store, w->idle_chunk, &purged, &more);

    if (rc != 0) {
        log_failure(w, "purging", rc, false);
        more = false;
    }
    took_us = mono_us() - start_us;
    if (more)
        adapt_chunk(&w->idle_chunk, took_us, PURGE_IDLE_BUDGET_US);
    w->purge_due = more;
    count_purged(w, purged);
}

static size_t live_bucket(const uint8_t key[STORE_KEY_BYTES])
{
    /* The key is a SHA-256: any of its bytes are as good as a hash. */
    return ((size_t)key[0] | (size_t)key[1] << 8) % LIVE_BUCKETS;
}

/* Remembers a lease just acquired. Without memory it is not remembered, and
 * the lease is as stealable once expired as it was before this table. */
static void live_add(struct writer *w, const struct store_op *op)
{
    struct live_lease *l = malloc(sizeof(*l));
    size_t b = live_bucket(op->key);

    if (l == NULL)
        return;
    memcpy(l->key, op->key, STORE_KEY_BYTES);
    memcpy(l->lease_id, op->lease_id, STORE_LEASE_ID_BYTES);
    pthread_mutex_lock(&w->live_lock);
    l->next = w->live[b];
    w->live[b] = l;
    pthread_mutex_unlock(&w->live_lock);
}

/* Marks an acquire with this process's newest live lease on its key, if
 * any: only that one can still be the record's (a later acquire of the key
 * replaced any earlier one). */
static void live_mark(struct writer *w, struct store_op *op)
{
    op->has_live_lease = false;
    pthread_mutex_lock(&w->live_lock);
    for (struct live_lease *l = w->live[live_bucket(op->key)]; l != NULL; l = l->next) {
        if (memcmp(l->key, op->key, STORE_KEY_BYTES) == 0) {
            op->has_live_lease = true;
            memcpy(op->live_lease_id, l->lease_id, STORE_LEASE_ID_BYTES);
            break;
        }
    }
    pthread_mutex_unlock(&w->live_lock);
}

void writer_forget_lease(struct writer *w, const uint8_t key[STORE_KEY_BYTES],
                         const uint8_t lease_id[STORE_LEASE_ID_BYTES])
{
    struct live_lease **p;

    if (w == NULL)
        return;
    pthread_mutex_lock(&w->live_lock);
    for (p = &w->live[live_bucket(key)]; *p != NULL; p = &(*p)->next) {
        if (memcmp((*p)->key, key, STORE_KEY_BYTES) == 0 &&
            memcmp((*p)->lease_id, lease_id, STORE_LEASE_ID_BYTES) == 0) {
            struct live_lease *gone = *p;
            *p = gone->next;
            free(gone);
            break;
        }
    }
    pthread_mutex_unlock(&w->live_lock);
}

static void apply_batch(struct lane *w, struct writer_job *list)
{
    size_t n = 0;
    size_t share;
    size_t purged = 0;
    bool more = false;
    int64_t start_us;
    int rc;
    bool full = false;
    bool room = false;

    for (struct writer_job *j = list; j != NULL && n < w->opt.max_batch; j = j->next)
        w->jobs[n++] = j;
    for (size_t i = 0; i < n; i++) {
        /* On the job's op, so that an op-by-op rerun (below) keeps it. */
        if (w->jobs[i]->op.kind == STORE_OP_ACQUIRE)
            live_mark(w->parent, &w->jobs[i]->op);
        w->ops[i] = w->jobs[i]->op;
    }
    /* While purge work is due, a bounded share of it rides along in this
     * transaction; it never changes what the ops get (store.h). It is at
     * least the batch's op count (up to PURGE_FLOOR_MAX): purging keeps
     * pace with the records the batches write, even when the batch's own
     * durable commit takes the whole time budget (see the top). */
    share = n < PURGE_FLOOR_MAX ? n : PURGE_FLOOR_MAX;
    if (w->batch_share > share)
        share = w->batch_share;
    start_us = mono_us();
    rc = store_apply_purge(w->opt.store, w->ops, n, w->purge_due ? share : 0, &purged, &more);
    if (rc != 0)
        log_failure(w, "a write transaction", rc, false);
    if (w->purge_due) {
        w->purge_due = rc == 0 && more;
        if (w->purge_due)
            adapt_chunk(&w->batch_share, mono_us() - start_us, PURGE_BATCH_BUDGET_US);
    }
    if (rc == STORE_ECORRUPT && n > 1) {
        /* A record that does not decode fails the whole transaction, and
         * every request in it with it: a complete would be held as
         * unstored, a release left undone. Only the op that touched it
         * should fail, so the batch runs again op by op, in its order (ops
         * of one key still see each other, a commit apart). Rare: the
         * proxy reads a key before acquiring it, and refuses a damaged
         * one. */
        int failed = 0;
        for (size_t i = 0; i < n; i++) {
            w->ops[i] = w->jobs[i]->op;
            w->errors[i] = store_apply(w->opt.store, &w->ops[i], 1);
            if (w->errors[i] != 0)
                failed = w->errors[i];
        }
        rc = failed; /* (0: the damaged record is gone, say writes work) */
    } else {
        for (size_t i = 0; i < n; i++)
            w->errors[i] = rc;
    }
    for (size_t i = 0; i < n; i++) {
        /* The op array is a copy; hand the outcome back, including any
         * replay record the store allocated (now owned by the job). */
        w->jobs[i]->op = w->ops[i];
        w->jobs[i]->error = w->errors[i];
        if (w->errors[i] != 0)
            continue;
        if (w->ops[i].outcome == STORE_FULL) {
            full = true;
        } else if (w->ops[i].outcome == STORE_ACQUIRED) {
            room = true;
            /* Before the job goes back: its request forgets the lease
             * when it is freed, which may be as soon as it has the job. */
            live_add(w->parent, &w->ops[i]);
        }
    }
    /* Said before the jobs go back (the store's cause is this thread's).
     * Only a new key acquired shows that a full store takes new keys
     * again; completes, releases and heartbeats fit in the room kept for
     * them while it is full. */
    if (full)
        log_failure(w, "a write", STORE_EFULL, true);
    else if (rc == 0 && (room || w->fail_rc != STORE_EFULL))
        log_recovered(w);
    pthread_mutex_lock(&w->parent->stats_lock);
    w->parent->stats.batches++;
    w->parent->stats.ops += n;
    if (n > w->parent->stats.max_batch)
        w->parent->stats.max_batch = n;
    w->parent->stats.purged += purged;
    pthread_mutex_unlock(&w->parent->stats_lock);
    w->opt.deliver(w->jobs, n, w->opt.ctx);
    if (full && w->records) {
        purge_full(w);
    } else if (full) {
        struct lane *r = &w->parent->lanes[LANE_RECORDS];
        pthread_mutex_lock(&r->lock);
        r->purge_full_asked = true;
        pthread_cond_signal(&r->cond);
        pthread_mutex_unlock(&r->lock);
    }
}

/* The in-flight lane, under load, holds a commit back for at most
 * LINGER_US until linger_jobs jobs are queued (see LINGER_JOBS). Called
 * and returns with w->lock held; submitters wake it only at linger_jobs. */
static void linger(struct lane *w)
{
    int64_t until = mono_us() + LINGER_US;

    w->lingering = true;
    while (w->queued < w->linger_jobs && !w->stopping) {
        int64_t left = until - mono_us();
        struct timespec ts;
        if (left <= 0)
            break;
        ts = deadline_in_us(left);
        pthread_cond_timedwait(&w->cond, &w->lock, &ts);
    }
    w->lingering = false;
}

static void *writer_main(void *arg)
{
    struct lane *w = arg;
    /* Only the records' lane purges, syncs and checks readers: the other
     * never waits for them (its times are never reached). */
    int64_t never = INT64_MAX;
    int64_t next_purge = w->records ? idem_mono_ms() + w->opt.purge_interval_ms : never;
    int64_t next_sync = w->records && w->opt.sync_interval_ms > 0
                            ? idem_mono_ms() + w->opt.sync_interval_ms
                            : 0;
    int64_t next_reader_check = w->records ? idem_mono_ms() + READER_CHECK_EVERY_MS : never;
    int64_t last_batch_end_us = INT64_MIN / 2; /* its commit and delivery */
    size_t last_batch = 0;

    pthread_setname_np(pthread_self(), w->name);

    for (;;) {
        struct writer_job *list = NULL;
        struct writer_job *rest = NULL;
        bool stop;
        bool full_asked;
        int64_t now;

        pthread_mutex_lock(&w->lock);
        /* With purge work due, an empty queue is time to purge: no wait. */
        while (w->head == NULL && !w->stopping && !w->purge_due && !w->purge_full_asked) {
            int64_t wake = next_purge;
            struct timespec ts;
            if (next_sync != 0 && next_sync < wake)
                wake = next_sync;
            if (next_reader_check < wake)
                wake = next_reader_check;
            now = idem_mono_ms();
            if (wake <= now)
                break;
            ts = idem_deadline_in_ms(wake - now);
            pthread_cond_timedwait(&w->cond, &w->lock, &ts);
            if (idem_mono_ms() >= wake)
                break;
        }
        if (!w->records && w->head != NULL && w->queued < w->linger_jobs && !w->stopping &&
            last_batch >= LINGER_AFTER_JOBS && mono_us() - last_batch_end_us < LINGER_BUSY_US)
            linger(w);
        /* Take at most max_batch jobs; the rest stay queued for the next
         * transaction so one burst cannot grow a transaction unboundedly. */
        list = w->head;
        if (list != NULL) {
            struct writer_job *last = list;
            size_t n = 1;
            while (last->next != NULL && n < w->opt.max_batch) {
                last = last->next;
                n++;
            }
            rest = last->next;
            last->next = NULL;
            w->head = rest;
            if (rest == NULL)
                w->tail = NULL;
            w->queued -= n;
            last_batch = n;
        }
        stop = w->stopping && w->head == NULL && list == NULL;
        full_asked = w->purge_full_asked;
        w->purge_full_asked = false;
        pthread_mutex_unlock(&w->lock);

        now = idem_mono_ms();
        if (w->records && now >= next_purge) {
            w->purge_due = true;
            next_purge = now + w->opt.purge_interval_ms;
        }
        if (full_asked)
            purge_full(w);
        if (list != NULL) {
            apply_batch(w, list);
            last_batch_end_us = mono_us();
        } else if (w->purge_due && !stop)
            purge_idle(w);
        now = idem_mono_ms();
        if (next_sync != 0 && now >= next_sync) {
            int rc = store_sync(w->opt.store);
            if (rc != 0)
                log_failure(w, "syncing the store to disk", rc, false);
            next_sync = now + w->opt.sync_interval_ms;
        }
        if (now >= next_reader_check) {
            int cleared = 0;
            store_reader_check(w->opt.store, &cleared);
            next_reader_check = now + READER_CHECK_EVERY_MS;
        }
        if (stop)
            break;
    }
    if (w->records && w->opt.sync_interval_ms > 0) {
        int rc = store_sync(w->opt.store);
        if (rc != 0)
            log_failure(w, "syncing the store to disk", rc, false);
    }
    pthread_mutex_lock(&w->lock);
    w->stopped = true;
    pthread_cond_broadcast(&w->stopped_cond);
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static void lane_free(struct lane *l)
{
    free(l->jobs);
    free(l->ops);
    free(l->errors);
}

static void lane_destroy(struct lane *l)
{
    pthread_cond_destroy(&l->cond);
    pthread_cond_destroy(&l->stopped_cond);
    pthread_mutex_destroy(&l->lock);
}

static int lane_start(struct writer *w, size_t i)
{
    struct lane *l = &w->lanes[i];

    l->parent = w;
    l->records = i == LANE_RECORDS;
    l->name = l->records ? "idem-writer" : "idem-inflight";
    l->opt = w->opt;
    l->batch_share = 32;
    l->linger_jobs = w->opt.max_batch < LINGER_JOBS ? w->opt.max_batch : LINGER_JOBS;
    l->idle_chunk = 32;
    l->jobs = calloc(w->opt.max_batch, sizeof(*l->jobs));
    l->ops = calloc(w->opt.max_batch, sizeof(*l->ops));
    l->errors = calloc(w->opt.max_batch, sizeof(*l->errors));
    if (l->jobs == NULL || l->ops == NULL || l->errors == NULL)
        return -1;
    pthread_mutex_init(&l->lock, NULL);
    idem_cond_init_monotonic(&l->cond);
    idem_cond_init_monotonic(&l->stopped_cond);
    if (pthread_create(&l->thread, NULL, writer_main, l) != 0) {
        lane_destroy(l);
        return -1;
    }
    w->started[i] = true;
    return 0;
}

/* Asks a lane to stop and waits until deadline_ms at most; whether it has. */
static bool lane_stop_by(struct lane *l, int64_t deadline_ms)
{
    bool stopped;

    pthread_mutex_lock(&l->lock);
    l->stopping = true;
    pthread_cond_signal(&l->cond);
    while (!l->stopped) {
        int64_t now = idem_mono_ms();
        struct timespec ts;
        if (deadline_ms == INT64_MAX) {
            pthread_cond_wait(&l->stopped_cond, &l->lock);
            continue;
        }
        if (now >= deadline_ms)
            break;
        ts = idem_deadline_in_ms(deadline_ms - now);
        pthread_cond_timedwait(&l->stopped_cond, &l->lock, &ts);
    }
    stopped = l->stopped;
    pthread_mutex_unlock(&l->lock);
    return stopped;
}

int writer_start(const struct writer_options *opt, struct writer **out)
{
    int rc = -1;
    struct writer *w = calloc(1, sizeof(*w));

    if (w == NULL)
        goto out;
    w->opt = *opt;
    if (w->opt.max_batch == 0)
        w->opt.max_batch = 1024;
    if (w->opt.purge_interval_ms <= 0)
        w->opt.purge_interval_ms = 60000;
    pthread_mutex_init(&w->stats_lock, NULL);
    pthread_mutex_init(&w->live_lock, NULL);
    for (size_t i = 0; i < LANES; i++) {
        if (lane_start(w, i) != 0)
            goto out;
    }
    *out = w;
    w = NULL;
    rc = 0;
out:
    if (w != NULL) {
        for (size_t i = 0; i < LANES; i++) {
            if (w->started[i]) {
                (void)lane_stop_by(&w->lanes[i], INT64_MAX);
                pthread_join(w->lanes[i].thread, NULL);
                lane_destroy(&w->lanes[i]);
            }
            lane_free(&w->lanes[i]);
        }
        pthread_mutex_destroy(&w->stats_lock);
        pthread_mutex_destroy(&w->live_lock);
        free(w);
    }
    return rc;
}

/* Which lane an op goes to: the store's environment it writes. */
static struct lane *lane_of(struct writer *w, const struct store_op *op)
{
    bool in_flight = op->kind == STORE_OP_ACQUIRE || op->kind == STORE_OP_RELEASE ||
                     (op->kind == STORE_OP_EXTEND && !op->hold);
    return &w->lanes[in_flight ? LANE_IN_FLIGHT : LANE_RECORDS];
}

void writer_submit(struct writer *w, struct writer_job *job)
{
    struct lane *l = lane_of(w, &job->op);

    job->next = NULL;
    job->error = 0;
    pthread_mutex_lock(&l->lock);
    if (l->tail != NULL)
        l->tail->next = job;
    else
        l->head = job;
    l->tail = job;
    l->queued++;
    if (!l->lingering || l->queued >= l->linger_jobs)
        pthread_cond_signal(&l->cond);
    pthread_mutex_unlock(&l->lock);
}

void writer_stop(struct writer *w)
{
    (void)writer_stop_by(w, INT64_MAX);
}

int writer_stop_by(struct writer *w, int64_t deadline_ms)
{
    bool stopped = true;

    if (w == NULL)
        return 0;
    /* Both lanes are asked first, so they drain side by side. */
    for (size_t i = 0; i < LANES; i++) {
        pthread_mutex_lock(&w->lanes[i].lock);
        w->lanes[i].stopping = true;
        pthread_cond_signal(&w->lanes[i].cond);
        pthread_mutex_unlock(&w->lanes[i].lock);
    }
    for (size_t i = 0; i < LANES; i++)
        stopped = lane_stop_by(&w->lanes[i], deadline_ms) && stopped;
    /* A lane still in a store call (a commit waiting for the disk): both
     * threads, the queues and every job in them stay as they are; see
     * writer.h. */
    if (!stopped)
        return -1;
    for (size_t i = 0; i < LANES; i++) {
        pthread_join(w->lanes[i].thread, NULL);
        lane_destroy(&w->lanes[i]);
        lane_free(&w->lanes[i]);
    }
    pthread_mutex_destroy(&w->stats_lock);
    pthread_mutex_destroy(&w->live_lock);
    for (size_t b = 0; b < LIVE_BUCKETS; b++) {
        while (w->live[b] != NULL) {
            struct live_lease *next = w->live[b]->next;
            free(w->live[b]);
            w->live[b] = next;
        }
    }
    free(w);
    return 0;
}

void writer_get_stats(struct writer *w, struct writer_stats *out)
{
    pthread_mutex_lock(&w->stats_lock);
    *out = w->stats;
    pthread_mutex_unlock(&w->stats_lock);
}
