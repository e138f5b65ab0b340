/*
 * writer.c - group commit of store writes on one thread (see writer.h).
 */
/* pthread_setname_np is a GNU extension. */
#define _GNU_SOURCE 1
#include "writer.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PURGE_BATCH 512
#define PURGE_ROUNDS_PER_TICK 8
#define READER_CHECK_EVERY_MS 10000

struct writer {
    struct writer_options opt;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct writer_job *head; /* FIFO under lock */
    struct writer_job *tail;
    bool stopping;
    bool purge_now;

    /* writer-thread only */
    struct writer_job **jobs;
    struct store_op *ops;

    pthread_mutex_t stats_lock;
    struct writer_stats stats;
};

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void deadline_ts(int64_t delay_ms, struct timespec *ts)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += delay_ms / 1000;
    ts->tv_nsec += (long)(delay_ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static void run_purge(struct writer *w)
{
    size_t total = 0;
    for (int round = 0; round < PURGE_ROUNDS_PER_TICK; round++) {
        size_t purged = 0;
        bool more = false;
        if (store_purge(w->opt.store, PURGE_BATCH, &purged, &more) != 0)
            break;
        total += purged;
        if (!more)
            break;
    }
    pthread_mutex_lock(&w->stats_lock);
    w->stats.purged += total;
    pthread_mutex_unlock(&w->stats_lock);
}

static void apply_batch(struct writer *w, struct writer_job *list)
{
    size_t n = 0;
    int rc;
    bool full = false;

    for (struct writer_job *j = list; j != NULL && n < w->opt.max_batch; j = j->next)
        w->jobs[n++] = j;
    for (size_t i = 0; i < n; i++)
        w->ops[i] = w->jobs[i]->op;
    rc = store_apply(w->opt.store, w->ops, n);
    for (size_t i = 0; i < n; i++) {
        /* The op array is a copy; hand the outcome back, including any
         * replay record the store allocated (now owned by the job). */
        w->jobs[i]->op = w->ops[i];
        w->jobs[i]->error = rc;
        if (rc == 0 && w->ops[i].outcome == STORE_FULL)
            full = true;
    }
    pthread_mutex_lock(&w->stats_lock);
    w->stats.batches++;
    w->stats.ops += n;
    if (n > w->stats.max_batch)
        w->stats.max_batch = n;
    pthread_mutex_unlock(&w->stats_lock);
    w->opt.deliver(w->jobs, n, w->opt.ctx);
    if (full)
        run_purge(w);
}

static void *writer_main(void *arg)
{
    struct writer *w = arg;
    int64_t next_purge = mono_ms() + w->opt.purge_interval_ms;
    int64_t next_sync = w->opt.sync_interval_ms > 0 ? mono_ms() + w->opt.sync_interval_ms : 0;
    int64_t next_reader_check = mono_ms() + READER_CHECK_EVERY_MS;

    pthread_setname_np(pthread_self(), "idem-writer");

    for (;;) {
        struct writer_job *list = NULL;
        struct writer_job *rest = NULL;
        bool stop;
        bool purge_now;
        int64_t now;

        pthread_mutex_lock(&w->lock);
        while (w->head == NULL && !w->stopping && !w->purge_now) {
            int64_t wake = next_purge;
            struct timespec ts;
            if (next_sync != 0 && next_sync < wake)
                wake = next_sync;
            if (next_reader_check < wake)
                wake = next_reader_check;
            now = mono_ms();
            if (wake <= now)
                break;
            deadline_ts(wake - now, &ts);
            pthread_cond_timedwait(&w->cond, &w->lock, &ts);
            if (mono_ms() >= wake)
                break;
        }
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
        }
        stop = w->stopping && w->head == NULL && list == NULL;
        purge_now = w->purge_now;
        w->purge_now = false;
        pthread_mutex_unlock(&w->lock);

        if (list != NULL)
            apply_batch(w, list);
        now = mono_ms();
        if (purge_now || now >= next_purge) {
            run_purge(w);
            next_purge = now + w->opt.purge_interval_ms;
        }
        if (next_sync != 0 && now >= next_sync) {
            store_sync(w->opt.store);
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
    if (w->opt.sync_interval_ms > 0)
        store_sync(w->opt.store);
    return NULL;
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
    w->jobs = calloc(w->opt.max_batch, sizeof(*w->jobs));
    w->ops = calloc(w->opt.max_batch, sizeof(*w->ops));
    if (w->jobs == NULL || w->ops == NULL)
        goto out;
    pthread_mutex_init(&w->lock, NULL);
    pthread_mutex_init(&w->stats_lock, NULL);
    {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&w->cond, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (pthread_create(&w->thread, NULL, writer_main, w) != 0) {
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->lock);
        pthread_mutex_destroy(&w->stats_lock);
        goto out;
    }
    *out = w;
    w = NULL;
    rc = 0;
out:
    if (w != NULL) {
        free(w->jobs);
        free(w->ops);
        free(w);
    }
    return rc;
}

void writer_submit(struct writer *w, struct writer_job *job)
{
    job->next = NULL;
    job->error = 0;
    pthread_mutex_lock(&w->lock);
    if (w->tail != NULL)
        w->tail->next = job;
    else
        w->head = job;
    w->tail = job;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
}

void writer_stop(struct writer *w)
{
    if (w == NULL)
        return;
    pthread_mutex_lock(&w->lock);
    w->stopping = true;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    pthread_mutex_destroy(&w->stats_lock);
    free(w->jobs);
    free(w->ops);
    free(w);
}

void writer_get_stats(struct writer *w, struct writer_stats *out)
{
    pthread_mutex_lock(&w->stats_lock);
    *out = w->stats;
    pthread_mutex_unlock(&w->stats_lock);
}
