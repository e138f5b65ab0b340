/*
 * test_writer.c - the store writer's purging (proxy/writer.h): a backlog of
 * expired records is purged to the end once purge work is due, in bounded
 * chunks, without waiting a purge_interval per chunk, both on an idle writer
 * and between (and inside) request batches; live records stay; the writer's
 * `purged` count is exact; every job is delivered. A record that does not
 * decode fails only the op that touched it, not the batch it came in. A
 * bounded stop returns at its deadline from a writer held in a batch. An
 * acquire that finds the store full (in the in-flight lane, which does not
 * purge) has the records' lane purge at once, not at its next
 * purge_interval, so that a later acquire fits. A request batch purges at
 * least as many records as it has ops (up to 256), whatever its time says.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <lmdb.h>

#include "store.h"
#include "writer.h"

#define T0 1700000000000LL
#define EXPIRED 20000 /* five times what the old 8 x 512 per interval could purge */
#define LIVE 50
#define INTERVAL_MS 1000
#define TINY_MAP (1u << 20)
#define HOUR_MS 3600000

struct fake_clock {
    _Atomic int64_t now;
};

static int64_t fake_now(void *ctx)
{
    struct fake_clock *c = ctx;
    return atomic_load(&c->now);
}

struct fixture {
    char dir[64];
    char path[128];
    struct fake_clock clock;
    struct store_clock store_clock;
    struct store *st;

    pthread_mutex_t lock;
    pthread_cond_t cond;
    size_t delivered;
    size_t acquired;
    /* With gate_armed, the next delivery waits in deliver() while
     * gate_closed, so that the jobs submitted meanwhile make one batch. */
    bool gate_armed;
    bool gate_closed;
    bool in_gate;
    uint64_t full_records; /* setup_full_of_expired: the records it made */
    /* With stats_of set, each delivery of one job or of big_n jobs notes
     * the writer's purged count after it. */
    struct writer *stats_of;
    size_t big_n;
    uint64_t purged_after_one;
    uint64_t purged_after_big;
};

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void remove_tree(const char *path)
{
    struct stat sb;
    DIR *d = NULL;

    if (lstat(path, &sb) != 0) {
        goto out;
    }
    if (!S_ISDIR(sb.st_mode)) {
        unlink(path);
        goto out;
    }
    d = opendir(path);
    for (struct dirent *e = d != NULL ? readdir(d) : NULL; e != NULL; e = readdir(d)) {
        char sub[512];
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
            snprintf(sub, sizeof(sub), "%s/%s", path, e->d_name);
            remove_tree(sub);
        }
    }
    if (d != NULL) {
        closedir(d);
    }
    rmdir(path);
out:
    return;
}

static void prep_acquire(struct store_op *op, const char *name, int64_t ttl_ms)
{
    memset(op, 0, sizeof(*op));
    op->kind = STORE_OP_ACQUIRE;
    store_key_derive("test", 4, name, strlen(name), op->key);
    memset(op->fingerprint, 'a', STORE_FINGERPRINT_BYTES);
    op->lease_ms = 1000;
    op->ttl_ms = ttl_ms;
}

/* n COMPLETE records named prefix<i>, in big transactions. */
static void fill(struct store *st, const char *prefix, size_t n, int64_t ttl_ms)
{
    enum { BATCH = 5000 };
    struct store_op *ops = calloc(BATCH, sizeof(*ops));

    assert_non_null(ops);
    for (size_t done = 0; done < n;) {
        size_t k = n - done < BATCH ? n - done : BATCH;
        for (size_t i = 0; i < k; i++) {
            char name[64];
            snprintf(name, sizeof(name), "%s%zu", prefix, done + i);
            prep_acquire(&ops[i], name, ttl_ms);
        }
        assert_int_equal(store_apply(st, ops, k), 0);
        for (size_t i = 0; i < k; i++) {
            assert_int_equal(ops[i].outcome, STORE_ACQUIRED);
            ops[i].kind = STORE_OP_COMPLETE;
            ops[i].status = 200;
            ops[i].body.ptr = "x";
            ops[i].body.len = 1;
        }
        assert_int_equal(store_apply(st, ops, k), 0);
        done += k;
    }
    free(ops);
}

static uint64_t records_in(struct store *st)
{
    struct store_stats stats;
    assert_int_equal(store_stats(st, &stats), 0);
    return stats.records;
}

/* A fixture with an empty store of map_size_bytes (0: the default), the
 * fake clock at T0. */
static int setup_store(void **state, uint64_t map_size_bytes)
{
    struct fixture *f = calloc(1, sizeof(*f));
    struct store_options opt;
    char err[256];
    int rc = -1;

    if (f == NULL) {
        goto out;
    }
    snprintf(f->dir, sizeof(f->dir), "/tmp/idem-writer-XXXXXX");
    if (mkdtemp(f->dir) == NULL) {
        free(f);
        goto out;
    }
    snprintf(f->path, sizeof(f->path), "%s/data", f->dir);
    atomic_store(&f->clock.now, T0);
    f->store_clock.now_ms = fake_now;
    f->store_clock.ctx = &f->clock;
    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    opt.map_size_bytes = map_size_bytes;
    opt.sync = false;
    opt.clock = &f->store_clock;
    rc = store_open(NULL, &opt, &f->st, err, sizeof(err));
    if (rc != 0) {
        print_error("store_open: %s\n", err);
        remove_tree(f->dir);
        free(f);
        goto out;
    }
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->cond, NULL);
    *state = f;
out:
    return rc;
}

static int setup(void **state)
{
    struct fixture *f;
    int rc = setup_store(state, 0);

    if (rc == 0) {
        f = *state;
        /* A backlog: EXPIRED records past their TTL, LIVE ones for a day. */
        fill(f->st, "old", EXPIRED, 1000);
        fill(f->st, "live", LIVE, 86400000);
        atomic_store(&f->clock.now, T0 + 2000);
    }
    return rc;
}

/* A store of TINY_MAP filled with answers that expire 1 s after T0 (their
 * leases too), acquires then their completes, until a new key no longer
 * fits even with no other key in flight (an acquire keeps room for the
 * answers of every key in flight: batches of them are refused earlier,
 * so the last keys go one at a time); the fake clock then past them all.
 * Nothing is purged: the store refuses a new key until a purge of the
 * records' environment. */
static int setup_full_of_expired(void **state)
{
    enum { BATCH = 64, MAX_KEYS = 100000 };
    static const char body[512];
    struct fixture *f;
    struct store_op ops[BATCH];
    size_t keys = 0;
    size_t batch = BATCH;
    bool full = false;
    int rc = setup_store(state, TINY_MAP);

    if (rc != 0) {
        return rc;
    }
    f = *state;
    while (!full) {
        size_t k = 0;
        bool refused = false;
        assert_true(keys < MAX_KEYS);
        for (size_t i = 0; i < batch; i++) {
            char name[32];
            snprintf(name, sizeof(name), "old%zu", keys + i);
            prep_acquire(&ops[i], name, 1000);
        }
        assert_int_equal(store_apply(f->st, ops, batch), 0);
        for (size_t i = 0; i < batch; i++) {
            if (ops[i].outcome == STORE_FULL) {
                refused = true;
                continue;
            }
            assert_int_equal(ops[i].outcome, STORE_ACQUIRED);
            ops[k] = ops[i];
            ops[k].kind = STORE_OP_COMPLETE;
            ops[k].status = 200;
            ops[k].body.ptr = body;
            ops[k].body.len = sizeof(body);
            k++;
        }
        if (k > 0) {
            /* The acquires left room for their answers. */
            assert_int_equal(store_apply(f->st, ops, k), 0);
            for (size_t i = 0; i < k; i++) {
                assert_int_equal(ops[i].outcome, STORE_DONE);
            }
        }
        keys += batch;
        full = refused && batch == 1;
        if (refused) {
            batch = 1;
        }
    }
    f->full_records = records_in(f->st);
    assert_true(f->full_records > 100);
    atomic_store(&f->clock.now, T0 + 2000);
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    store_close(f->st);
    pthread_cond_destroy(&f->cond);
    pthread_mutex_destroy(&f->lock);
    remove_tree(f->dir);
    free(f);
    return 0;
}

static void deliver(struct writer_job **jobs, size_t n, void *ctx)
{
    struct fixture *f = ctx;
    pthread_mutex_lock(&f->lock);
    if (f->gate_armed) {
        f->gate_armed = false;
        f->in_gate = true;
        pthread_cond_broadcast(&f->cond);
        while (f->gate_closed) {
            pthread_cond_wait(&f->cond, &f->lock);
        }
    }
    if (f->stats_of != NULL && (n == 1 || n == f->big_n)) {
        struct writer_stats ws;
        writer_get_stats(f->stats_of, &ws);
        *(n == 1 ? &f->purged_after_one : &f->purged_after_big) = ws.purged;
    }
    for (size_t i = 0; i < n; i++) {
        f->delivered++;
        if (jobs[i]->error == 0 && jobs[i]->op.outcome == STORE_ACQUIRED) {
            f->acquired++;
        }
    }
    pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&f->lock);
}

static struct writer *start_every(struct fixture *f, int64_t purge_interval_ms)
{
    struct writer *w = NULL;
    struct writer_options opt;

    memset(&opt, 0, sizeof(opt));
    opt.store = f->st;
    opt.deliver = deliver;
    opt.ctx = f;
    opt.purge_interval_ms = purge_interval_ms;
    assert_int_equal(writer_start(&opt, &w), 0);
    return w;
}

static struct writer *start(struct fixture *f)
{
    return start_every(f, INTERVAL_MS);
}

/* Submits job and waits until the writer has delivered it. */
static void submit_and_wait(struct fixture *f, struct writer *w, struct writer_job *job)
{
    size_t want;

    pthread_mutex_lock(&f->lock);
    want = f->delivered + 1;
    pthread_mutex_unlock(&f->lock);
    writer_submit(w, job);
    pthread_mutex_lock(&f->lock);
    while (f->delivered < want) {
        pthread_cond_wait(&f->cond, &f->lock);
    }
    pthread_mutex_unlock(&f->lock);
}

/* Submits gate, its op ready, and returns once its lane (the in-flight
 * one for an acquire, the records' for a complete) is waiting in the
 * delivery, the gate closed: jobs for that lane submitted now queue
 * behind it. */
static void hold_lane_in_gate(struct fixture *f, struct writer *w, struct writer_job *gate)
{
    pthread_mutex_lock(&f->lock);
    f->gate_armed = true;
    f->gate_closed = true;
    pthread_mutex_unlock(&f->lock);
    writer_submit(w, gate);
    pthread_mutex_lock(&f->lock);
    while (!f->in_gate) {
        pthread_cond_wait(&f->cond, &f->lock);
    }
    pthread_mutex_unlock(&f->lock);
}

/* hold_lane_in_gate with an acquire: the in-flight lane. */
static void hold_writer_in_gate(struct fixture *f, struct writer *w, struct writer_job *gate)
{
    prep_acquire(&gate->op, "gate", 86400000);
    hold_lane_in_gate(f, w, gate);
}

/* Waits until the writer has purged want records or the deadline passes. */
static uint64_t wait_purged(struct writer *w, uint64_t want, int64_t deadline_ms)
{
    struct writer_stats ws;

    for (;;) {
        writer_get_stats(w, &ws);
        if (ws.purged >= want || mono_ms() >= deadline_ms) {
            break;
        }
        usleep(10000);
    }
    return ws.purged;
}

/* Idle writer: the first interval makes purge work due, and the backlog
 * goes in chunks back to back, not one bounded chunk per interval: all of
 * it before the third interval (the old 8 x 512 per interval would have
 * purged at most 12,288 by then). */
static void test_idle_backlog_drains_without_waiting_interval(void **state)
{
    struct fixture *f = *state;
    int64_t started = mono_ms();
    struct writer *w = start(f);
    uint64_t purged = wait_purged(w, EXPIRED, started + 3 * INTERVAL_MS - 200);

    writer_stop(w);
    assert_int_equal(purged, EXPIRED);
    assert_int_equal(records_in(f->st), LIVE);
}

/* A steady stream of request batches: the purge rides along in them (and
 * in whatever idle moments there are) until the backlog is gone; every job
 * is delivered with its own outcome, and the new and live records stay. */
static void test_backlog_drains_between_request_batches(void **state)
{
    enum { JOBS = 400 };
    struct fixture *f = *state;
    struct writer_job *jobs = calloc(JOBS, sizeof(*jobs));
    int64_t started = mono_ms();
    struct writer *w = start(f);
    uint64_t purged;

    assert_non_null(jobs);
    for (size_t i = 0; i < JOBS; i++) {
        char name[32];
        snprintf(name, sizeof(name), "new%zu", i);
        prep_acquire(&jobs[i].op, name, 86400000);
        writer_submit(w, &jobs[i]);
        if (i % 4 == 3) {
            usleep(1000);
        }
    }
    purged = wait_purged(w, EXPIRED, started + 3 * INTERVAL_MS - 200);
    pthread_mutex_lock(&f->lock);
    while (f->delivered < JOBS) {
        pthread_cond_wait(&f->cond, &f->lock);
    }
    assert_int_equal(f->acquired, JOBS);
    pthread_mutex_unlock(&f->lock);
    writer_stop(w);
    assert_int_equal(purged, EXPIRED);
    assert_int_equal(records_in(f->st), LIVE + JOBS);
    free(jobs);
}

/* writer_stop() still applies what is queued, backlog or not, and stops. */
static void test_stop_with_backlog_delivers_queued_jobs(void **state)
{
    enum { JOBS = 64 };
    struct fixture *f = *state;
    struct writer_job *jobs = calloc(JOBS, sizeof(*jobs));
    struct writer *w = start(f);

    assert_non_null(jobs);
    usleep(INTERVAL_MS * 1000 + 50000); /* purge work is due now */
    for (size_t i = 0; i < JOBS; i++) {
        char name[32];
        snprintf(name, sizeof(name), "new%zu", i);
        prep_acquire(&jobs[i].op, name, 86400000);
        writer_submit(w, &jobs[i]);
    }
    writer_stop(w);
    assert_int_equal(f->delivered, JOBS);
    assert_int_equal(f->acquired, JOBS);
    free(jobs);
}

/* One record whose bytes do not decode (a damaged page, a bad write): the
 * batch that touches it fails as a whole, but the writer runs it again op
 * by op, so the other requests of the batch get their own outcomes: a
 * complete and a release next to it are applied. Before, every job of the
 * batch got STORE_ECORRUPT: the complete's request was held as unstored
 * (409 for its whole TTL), the release left undone. */
static void test_damaged_record_fails_only_its_own_op(void **state)
{
    struct fixture *f = *state;
    struct writer_job gate;
    struct writer_job jobs[3];
    struct store_op a[2];
    uint8_t bad_key[STORE_KEY_BYTES];
    struct store_options opt;
    char err[256];
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    struct writer *w;

    /* Two keys in flight, and a damaged record behind the store's back. */
    prep_acquire(&a[0], "to-complete", 86400000);
    prep_acquire(&a[1], "to-release", 86400000);
    assert_int_equal(store_apply(f->st, a, 2), 0);
    assert_int_equal(a[0].outcome, STORE_ACQUIRED);
    assert_int_equal(a[1].outcome, STORE_ACQUIRED);
    store_close(f->st);
    f->st = NULL;
    store_key_derive("test", 4, "damaged", 7, bad_key);
    assert_int_equal(mdb_env_create(&env), 0);
    assert_int_equal(mdb_env_set_maxdbs(env, 4), 0);
    assert_int_equal(mdb_env_open(env, f->path, 0, 0600), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, "records", 0, &dbi), 0);
    {
        MDB_val k = {STORE_KEY_BYTES, bad_key};
        MDB_val v = {5, "junk!"};
        assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    }
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    opt.clock = &f->store_clock;
    assert_int_equal(store_open(NULL, &opt, &f->st, err, sizeof(err)), 0);

    /* The three jobs queue while the writer waits in a delivery. */
    w = start(f);
    hold_writer_in_gate(f, w, &gate);

    memset(jobs, 0, sizeof(jobs));
    jobs[0].op = a[0];
    jobs[0].op.kind = STORE_OP_COMPLETE;
    jobs[0].op.status = 201;
    jobs[0].op.body.ptr = "ok";
    jobs[0].op.body.len = 2;
    jobs[1].op = a[1];
    jobs[1].op.kind = STORE_OP_RELEASE;
    prep_acquire(&jobs[2].op, "damaged", 86400000);
    for (size_t i = 0; i < 3; i++) {
        writer_submit(w, &jobs[i]);
    }
    pthread_mutex_lock(&f->lock);
    f->gate_closed = false;
    pthread_cond_broadcast(&f->cond);
    while (f->delivered < 4) {
        pthread_cond_wait(&f->cond, &f->lock);
    }
    pthread_mutex_unlock(&f->lock);
    writer_stop(w);

    assert_int_equal(jobs[0].error, 0);
    assert_int_equal(jobs[0].op.outcome, STORE_DONE);
    assert_int_equal(jobs[1].error, 0);
    assert_int_equal(jobs[1].op.outcome, STORE_DONE);
    assert_int_equal(jobs[2].error, STORE_ECORRUPT);
    {
        struct store_record rec;
        assert_int_equal(store_get(f->st, a[0].key, &rec), 0);
        assert_int_equal(rec.state, STORE_STATE_COMPLETE);
        store_record_clear(&rec);
        assert_int_equal(store_get(f->st, a[1].key, &rec), 0);
        assert_int_equal(rec.state, STORE_STATE_ABSENT);
        store_record_clear(&rec);
    }
}

/* Runs a batch of jobs completes through the records lane, the first batch
 * with purge work due (the lane waits in the delivery of one other
 * complete while they queue and the purge interval passes), and returns
 * what that batch purged, and in *left the expired records it could. */
static uint64_t purged_by_one_batch(struct fixture *f, size_t jobs_n, uint64_t *left)
{
    struct store_op *acq = calloc(jobs_n + 1, sizeof(*acq));
    struct writer_job *jobs = calloc(jobs_n + 1, sizeof(*jobs));
    struct writer *w;

    assert_non_null(acq);
    assert_non_null(jobs);
    for (size_t i = 0; i <= jobs_n; i++) {
        char name[32];
        snprintf(name, sizeof(name), "busy%zu", i);
        prep_acquire(&acq[i], name, 86400000);
    }
    assert_int_equal(store_apply(f->st, acq, jobs_n + 1), 0);
    for (size_t i = 0; i <= jobs_n; i++) {
        assert_int_equal(acq[i].outcome, STORE_ACQUIRED);
        jobs[i].op = acq[i];
        jobs[i].op.kind = STORE_OP_COMPLETE;
        jobs[i].op.status = 201;
        jobs[i].op.body.ptr = "ok";
        jobs[i].op.body.len = 2;
    }
    w = start_every(f, 50);
    pthread_mutex_lock(&f->lock);
    f->stats_of = w;
    f->big_n = jobs_n;
    pthread_mutex_unlock(&f->lock);
    hold_lane_in_gate(f, w, &jobs[jobs_n]);
    for (size_t i = 0; i < jobs_n; i++) {
        writer_submit(w, &jobs[i]);
    }
    usleep(150000);
    pthread_mutex_lock(&f->lock);
    f->gate_closed = false;
    pthread_cond_broadcast(&f->cond);
    while (f->delivered < jobs_n + 1) {
        pthread_cond_wait(&f->cond, &f->lock);
    }
    pthread_mutex_unlock(&f->lock);
    writer_stop(w);
    for (size_t i = 0; i <= jobs_n; i++) {
        assert_int_equal(jobs[i].error, 0);
        assert_int_equal(jobs[i].op.outcome, STORE_DONE);
    }
    free(jobs);
    free(acq);
    /* (Should the test's thread have been held up past the interval
     * before the gate, idle purges may have taken some of the backlog.) */
    *left = EXPIRED - f->purged_after_one;
    return f->purged_after_big - f->purged_after_one;
}

/* A busy records lane is never idle, and its batches' durable commits may
 * take its whole time budget, which keeps the time-sized purge share at
 * its minimum: a batch still purges at least as many records as it has
 * ops, so that purging keeps pace with the records the batches write
 * instead of letting the store fill. Here a batch of 100 completes, the
 * first with purge work due, purges at least 100 of the backlog (the time
 * rule alone starts the share at 32). */
static void test_batch_purges_at_least_its_own_ops(void **state)
{
    uint64_t left = 0;
    uint64_t purged = purged_by_one_batch(*state, 100, &left);

    assert_true(purged >= (left < 100 ? left : 100));
}

/* ... up to 256: a batch of 300 (a queue that grew while a commit waited
 * for the disk) purges 256, not 300, on top of its own writes. */
static void test_batch_purge_floor_is_capped(void **state)
{
    uint64_t left = 0;
    uint64_t purged = purged_by_one_batch(*state, 300, &left);

    assert_true(purged <= 256);
    assert_true(purged >= (left < 256 ? left : 256));
}

/* writer_stop_by() with the writer held inside a batch (as by a commit
 * waiting for a stalled disk): it returns -1 at its deadline, not when the
 * batch ends, and leaves the writer running; once the batch ends, a later
 * stop still applies what is queued and frees it. */
static void test_stop_by_gives_up_on_a_held_writer(void **state)
{
    struct fixture *f = *state;
    struct writer_job gate;
    struct writer_job late;
    struct writer *w = start(f);
    int64_t t0;
    int64_t took;

    memset(&gate, 0, sizeof(gate));
    hold_writer_in_gate(f, w, &gate);
    memset(&late, 0, sizeof(late));
    prep_acquire(&late.op, "late", 86400000);
    writer_submit(w, &late);

    t0 = mono_ms();
    assert_int_equal(writer_stop_by(w, t0 + 200), -1);
    took = mono_ms() - t0;
    assert_true(took >= 190);
    assert_true(took < 5000);

    pthread_mutex_lock(&f->lock);
    f->gate_closed = false;
    pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&f->lock);
    assert_int_equal(writer_stop_by(w, mono_ms() + 10000), 0);
    assert_int_equal(f->delivered, 2);
    assert_int_equal(f->acquired, 2);
}

/* A store full of expired answers, a purge_interval an hour away: an
 * acquire, in the in-flight lane, gets STORE_FULL (that lane never purges,
 * store_lmdb.c apply_after_full), and the records' lane, asked by it
 * (purge_full_asked), purges at once; the interval purge cannot be what
 * frees the room. A later acquire then fits. */
static void test_full_store_is_purged_at_once_for_the_in_flight_lane(void **state)
{
    struct fixture *f = *state;
    struct writer_job first;
    struct writer_job again;
    struct writer *w = start_every(f, HOUR_MS);
    uint64_t purged;

    memset(&first, 0, sizeof(first));
    prep_acquire(&first.op, "new", 86400000);
    submit_and_wait(f, w, &first);
    assert_int_equal(first.error, 0);
    assert_int_equal(first.op.outcome, STORE_FULL);

    purged = wait_purged(w, 1, mono_ms() + 3000);
    assert_true(purged > 0);

    memset(&again, 0, sizeof(again));
    prep_acquire(&again.op, "new", 86400000);
    submit_and_wait(f, w, &again);
    writer_stop(w);
    assert_int_equal(again.error, 0);
    assert_int_equal(again.op.outcome, STORE_ACQUIRED);
    assert_true(records_in(f->st) < f->full_records);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_idle_backlog_drains_without_waiting_interval, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_backlog_drains_between_request_batches, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_batch_purges_at_least_its_own_ops, setup, teardown),
        cmocka_unit_test_setup_teardown(test_batch_purge_floor_is_capped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_damaged_record_fails_only_its_own_op, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stop_with_backlog_delivers_queued_jobs, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_stop_by_gives_up_on_a_held_writer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_full_store_is_purged_at_once_for_the_in_flight_lane,
                                        setup_full_of_expired, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
