/*
 * test_store.c - the store's record model (CONTRACT.md section 2, seed 000)
 * against the LMDB backend, with an injected clock and a fresh store
 * directory per test.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <lmdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "store.h"
#include "store_internal.h"
#include "store_sha256.h"
#ifdef IDEM_FAULT_INJECTION
#include "store_fault.h"
#endif

#define T0 1700000000000LL /* any epoch works; this one looks like real time */

struct fake_clock {
    _Atomic int64_t now;
    _Atomic int64_t lease_now; /* with use_lease_clock() */
    const char *epoch;
};

static int64_t fake_now(void *ctx)
{
    struct fake_clock *c = ctx;
    return atomic_load(&c->now);
}

static int64_t fake_lease_now(void *ctx)
{
    struct fake_clock *c = ctx;
    return atomic_load(&c->lease_now);
}

static const char *fake_epoch(void *ctx)
{
    struct fake_clock *c = ctx;
    return c->epoch;
}

struct fixture {
    char dir[64];   /* the mkdtemp directory, removed after the test */
    char path[128]; /* the store path inside it */
    struct fake_clock clock;
    struct store_clock store_clock;
    struct store *st;
};

static void advance(struct fixture *f, int64_t ms)
{
    atomic_fetch_add(&f->clock.now, ms);
    atomic_fetch_add(&f->clock.lease_now, ms);
}

/* The wall clock alone jumps (an NTP step): the lease clock does not. */
static void step_wall(struct fixture *f, int64_t ms)
{
    atomic_fetch_add(&f->clock.now, ms);
}

static void set_now(struct fixture *f, int64_t t)
{
    atomic_store(&f->clock.now, t);
}

static int open_at(struct fixture *f, const char *path, uint64_t map_size, struct store **out)
{
    struct store_options opt;
    char err[256];
    int rc;

    memset(&opt, 0, sizeof(opt));
    opt.path = path;
    opt.map_size_bytes = map_size;
    opt.sync = false; /* durability is LMDB's business; keeps the tests fast */
    opt.clock = &f->store_clock;
    rc = store_open(NULL, &opt, out, err, sizeof(err));
    if (rc != 0) {
        print_error("store_open(%s): %s\n", path, err);
    }
    return rc;
}

/* rm -rf of the test's own temporary directory. */
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

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof(*f));
    int rc = -1;

    if (f == NULL) {
        goto out;
    }
    snprintf(f->dir, sizeof(f->dir), "/tmp/idem-store-XXXXXX");
    if (mkdtemp(f->dir) == NULL) {
        free(f);
        goto out;
    }
    snprintf(f->path, sizeof(f->path), "%s/data", f->dir);
    atomic_store(&f->clock.now, T0);
    f->store_clock.now_ms = fake_now;
    f->store_clock.ctx = &f->clock;
    rc = open_at(f, f->path, 0, &f->st);
    if (rc != 0) {
        /* cmocka runs no teardown after a failed setup. */
        remove_tree(f->dir);
        free(f);
        goto out;
    }
    *state = f;
out:
    return rc;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    store_close(f->st);
    remove_tree(f->dir);
    free(f);
    return 0;
}

/* ---- helpers ---------------------------------------------------------- */

static void key_of(const char *name, uint8_t key[STORE_KEY_BYTES])
{
    store_key_derive("test", 4, name, strlen(name), key);
}

static void fp_of(uint8_t c, uint8_t fp[STORE_FINGERPRINT_BYTES])
{
    memset(fp, c, STORE_FINGERPRINT_BYTES);
}

/* Acquires and returns the outcome; the op (lease id etc.) goes to *op. */
static enum store_outcome acquire(struct store *st, const char *name, uint8_t fpc, int64_t lease_ms,
                                  int64_t ttl_ms, struct store_op *op)
{
    uint8_t key[STORE_KEY_BYTES];
    uint8_t fp[STORE_FINGERPRINT_BYTES];

    key_of(name, key);
    fp_of(fpc, fp);
    assert_int_equal(store_acquire(st, key, fp, lease_ms, ttl_ms, op), 0);
    return op->outcome;
}

static enum store_outcome complete(struct store *st, const char *name,
                                   const uint8_t lease[STORE_LEASE_ID_BYTES], int64_t ttl_ms,
                                   const char *body)
{
    uint8_t key[STORE_KEY_BYTES];
    enum store_outcome o = 0;
    struct store_span h = {"h: v\r\n", 6};
    struct store_span b = {body, strlen(body)};

    key_of(name, key);
    assert_int_equal(store_complete(st, key, lease, ttl_ms, 201, h, b, &o), 0);
    return o;
}

/* A complete op of name's hold (lease), for store_apply_purge(). */
static void prep_complete(struct store_op *c, const char *name,
                          const uint8_t lease[STORE_LEASE_ID_BYTES], const char *body)
{
    memset(c, 0, sizeof(*c));
    c->kind = STORE_OP_COMPLETE;
    key_of(name, c->key);
    memcpy(c->lease_id, lease, STORE_LEASE_ID_BYTES);
    c->ttl_ms = 60000;
    c->status = 200;
    c->body.ptr = body;
    c->body.len = strlen(body);
}

static enum store_outcome release(struct store *st, const char *name,
                                  const uint8_t lease[STORE_LEASE_ID_BYTES])
{
    uint8_t key[STORE_KEY_BYTES];
    enum store_outcome o = 0;

    key_of(name, key);
    assert_int_equal(store_release(st, key, lease, &o), 0);
    return o;
}

static enum store_outcome extend(struct store *st, const char *name,
                                 const uint8_t lease[STORE_LEASE_ID_BYTES], int64_t lease_ms)
{
    uint8_t key[STORE_KEY_BYTES];
    enum store_outcome o = 0;

    key_of(name, key);
    assert_int_equal(store_extend(st, key, lease, lease_ms, &o), 0);
    return o;
}

/* Holds a record (an extend with hold: its action ran, its result could
 * not be stored) for lease_ms. */
static enum store_outcome hold(struct store *st, const char *name,
                               const uint8_t lease[STORE_LEASE_ID_BYTES], int64_t lease_ms)
{
    struct store_op h;

    memset(&h, 0, sizeof(h));
    h.kind = STORE_OP_EXTEND;
    key_of(name, h.key);
    memcpy(h.lease_id, lease, STORE_LEASE_ID_BYTES);
    h.lease_ms = lease_ms;
    h.hold = true;
    assert_int_equal(store_apply(st, &h, 1), 0);
    return h.outcome;
}

/* Reads a record; the caller clears it. */
static void get(struct store *st, const char *name, struct store_record *rec)
{
    uint8_t key[STORE_KEY_BYTES];
    key_of(name, key);
    assert_int_equal(store_get(st, key, rec), 0);
}

static enum store_state state_of(struct store *st, const char *name)
{
    struct store_record rec;
    enum store_state s;
    get(st, name, &rec);
    s = rec.state;
    store_record_clear(&rec);
    return s;
}

static uint64_t records_in(struct store *st)
{
    struct store_stats stats;
    assert_int_equal(store_stats(st, &stats), 0);
    return stats.records;
}

static void assert_body(const struct store_record *rec, const char *body)
{
    assert_int_equal(rec->body_len, strlen(body));
    assert_memory_equal(rec->body, body, strlen(body));
}

/* ---- the edges --------------------------------------------------------- */

static void test_acquire_creates_in_progress(void **state)
{
    struct fixture *f = *state;
    struct store_op op;
    struct store_record rec;
    uint8_t fp[STORE_FINGERPRINT_BYTES];
    static const uint8_t zero[STORE_LEASE_ID_BYTES];

    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &op), STORE_ACQUIRED);
    assert_false(op.stolen);
    assert_int_equal(op.lease_expires_ms, T0 + 1000);
    assert_memory_not_equal(op.lease_id, zero, sizeof(zero));

    get(f->st, "k", &rec);
    fp_of('a', fp);
    assert_int_equal(rec.state, STORE_STATE_IN_PROGRESS);
    assert_memory_equal(rec.lease_id, op.lease_id, STORE_LEASE_ID_BYTES);
    assert_memory_equal(rec.fingerprint, fp, sizeof(fp));
    assert_int_equal(rec.lease_expires_ms, T0 + 1000);
    assert_int_equal(rec.expires_ms, T0 + 60000);
    assert_null(rec.body);
    store_record_clear(&rec);
}

static void test_lease_ids_differ(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;

    assert_int_equal(acquire(f->st, "a", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "b", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    assert_memory_not_equal(a.lease_id, b.lease_id, STORE_LEASE_ID_BYTES);
}

static void test_live_in_progress_is_busy(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    advance(f, 999);
    assert_int_equal(acquire(f->st, "k", 'a', 5000, 60000, &b), STORE_BUSY);
    assert_int_equal(b.lease_expires_ms, T0 + 1000); /* the holder's, not ours */
    assert_false(b.stolen);
    /* The holder's lease was not disturbed. */
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "ok"), STORE_DONE);
}

static void test_other_fingerprint_is_mismatch(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "k", 'b', 1000, 60000, &b), STORE_MISMATCH);
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "ok"), STORE_DONE);
    assert_int_equal(acquire(f->st, "k", 'b', 1000, 60000, &b), STORE_MISMATCH);
    assert_int_equal(b.replay.state, STORE_STATE_ABSENT); /* no payload for a mismatch */
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_REPLAY);
    store_record_clear(&b.replay);
}

static void test_replay_copies_payload_byte_for_byte(void **state)
{
    struct fixture *f = *state;
    static const uint8_t headers[] = "Content-Type: application/octet-stream\r\nX-Z: \0\r\n";
    static const uint8_t body[] = {0, 1, 2, 0, 0, 255, 'a', 0, '\r', '\n', 0};
    uint8_t key[STORE_KEY_BYTES];
    uint8_t fp[STORE_FINGERPRINT_BYTES];
    struct store_op op;
    struct store_span h = {headers, sizeof(headers)};
    struct store_span b = {body, sizeof(body)};
    enum store_outcome o = 0;

    key_of("k", key);
    fp_of('a', fp);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &op), STORE_ACQUIRED);
    assert_int_equal(store_complete(f->st, key, op.lease_id, 60000, 418, h, b, &o), 0);
    assert_int_equal(o, STORE_DONE);

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &op), STORE_REPLAY);
    assert_int_equal(op.replay.state, STORE_STATE_COMPLETE);
    assert_int_equal(op.replay.status, 418);
    assert_int_equal(op.replay.headers_len, sizeof(headers));
    assert_memory_equal(op.replay.headers, headers, sizeof(headers));
    assert_int_equal(op.replay.body_len, sizeof(body));
    assert_memory_equal(op.replay.body, body, sizeof(body));
    store_record_clear(&op.replay);
    assert_null(op.replay.body);

    /* Through store_apply without want_replay: the outcome, and no copy. */
    memset(&op, 0, sizeof(op));
    op.kind = STORE_OP_ACQUIRE;
    memcpy(op.key, key, sizeof(key));
    memcpy(op.fingerprint, fp, sizeof(fp));
    op.lease_ms = 1000;
    op.ttl_ms = 60000;
    assert_int_equal(store_apply(f->st, &op, 1), 0);
    assert_int_equal(op.outcome, STORE_REPLAY);
    assert_null(op.replay.body);
    assert_int_equal(op.replay.state, STORE_STATE_ABSENT);
}

static void test_double_complete_refused(void **state)
{
    struct fixture *f = *state;
    struct store_op op;
    struct store_record rec;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &op), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "k", op.lease_id, 60000, "first"), STORE_DONE);
    assert_int_equal(complete(f->st, "k", op.lease_id, 60000, "second"), STORE_FENCED);
    /* Release of a COMPLETE record is refused too: the result stays. */
    assert_int_equal(release(f->st, "k", op.lease_id), STORE_FENCED);
    get(f->st, "k", &rec);
    assert_int_equal(rec.state, STORE_STATE_COMPLETE);
    assert_body(&rec, "first");
    store_record_clear(&rec);
}

static void test_release_deletes_record(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(records_in(f->st), 1);
    assert_int_equal(release(f->st, "k", a.lease_id), STORE_DONE);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);
    assert_int_equal(records_in(f->st), 0);
    /* As if the key had never been used: a new acquire, not a steal, and a
     * different fingerprint is no mismatch. */
    assert_int_equal(acquire(f->st, "k", 'b', 1000, 60000, &b), STORE_ACQUIRED);
    assert_false(b.stolen);
}

static void test_complete_after_release_refused(void **state)
{
    struct fixture *f = *state;
    struct store_op op;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &op), STORE_ACQUIRED);
    assert_int_equal(release(f->st, "k", op.lease_id), STORE_DONE);
    assert_int_equal(complete(f->st, "k", op.lease_id, 60000, "late"), STORE_FENCED);
    assert_int_equal(release(f->st, "k", op.lease_id), STORE_FENCED);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);
}

static void test_release_after_steal_refused(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    struct store_record rec;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    advance(f, 1000); /* lease_expires <= now: expired */
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    assert_true(b.stolen);
    assert_int_equal(release(f->st, "k", a.lease_id), STORE_FENCED);
    get(f->st, "k", &rec);
    assert_int_equal(rec.state, STORE_STATE_IN_PROGRESS);
    assert_memory_equal(rec.lease_id, b.lease_id, STORE_LEASE_ID_BYTES);
    store_record_clear(&rec);
    assert_int_equal(release(f->st, "k", b.lease_id), STORE_DONE);
}

static void test_stale_owner_fenced_after_steal(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    struct store_record rec;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    advance(f, 1500);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    assert_true(b.stolen);
    assert_memory_not_equal(a.lease_id, b.lease_id, STORE_LEASE_ID_BYTES);
    assert_int_equal(b.lease_expires_ms, T0 + 2500);

    /* The stale owner wakes up: everything it tries is refused. */
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "stale"), STORE_FENCED);
    assert_int_equal(release(f->st, "k", a.lease_id), STORE_FENCED);
    assert_int_equal(extend(f->st, "k", a.lease_id, 100000), STORE_FENCED);
    get(f->st, "k", &rec);
    assert_int_equal(rec.state, STORE_STATE_IN_PROGRESS);
    assert_memory_equal(rec.lease_id, b.lease_id, STORE_LEASE_ID_BYTES);
    assert_int_equal(rec.lease_expires_ms, T0 + 2500);
    store_record_clear(&rec);

    /* The new owner's complete wins and stays. */
    assert_int_equal(complete(f->st, "k", b.lease_id, 60000, "fresh"), STORE_DONE);
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "stale"), STORE_FENCED);
    get(f->st, "k", &rec);
    assert_int_equal(rec.state, STORE_STATE_COMPLETE);
    assert_body(&rec, "fresh");
    store_record_clear(&rec);
}

static void test_expired_lease_holder_may_still_complete(void **state)
{
    struct fixture *f = *state;
    struct store_op a;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    advance(f, 5000); /* expired, but nobody stole it */
    assert_int_equal(extend(f->st, "k", a.lease_id, 1000), STORE_DONE);
    advance(f, 5000);
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "late"), STORE_DONE);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_COMPLETE);
}

static void test_extend_is_silent_noop_otherwise(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op c;
    struct store_record before;
    struct store_record after;
    uint8_t foreign[STORE_LEASE_ID_BYTES];

    /* Missing record: nothing is created. */
    memset(foreign, 0x5a, sizeof(foreign));
    assert_int_equal(extend(f->st, "missing", foreign, 1000), STORE_FENCED);
    assert_int_equal(state_of(f->st, "missing"), STORE_STATE_ABSENT);
    assert_int_equal(records_in(f->st), 0);

    /* Completed record, even with its own lease: unchanged. */
    assert_int_equal(acquire(f->st, "done", 'a', 1000, 60000, &c), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "done", c.lease_id, 60000, "body"), STORE_DONE);
    get(f->st, "done", &before);
    advance(f, 10);
    assert_int_equal(extend(f->st, "done", c.lease_id, 99999), STORE_FENCED);
    get(f->st, "done", &after);
    assert_int_equal(after.state, STORE_STATE_COMPLETE);
    assert_int_equal(after.lease_expires_ms, before.lease_expires_ms);
    assert_int_equal(after.expires_ms, before.expires_ms);
    assert_body(&after, "body");
    store_record_clear(&before);
    store_record_clear(&after);

    /* Someone else's lease on an IN_PROGRESS record: the lease is unmoved. */
    assert_int_equal(acquire(f->st, "held", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(extend(f->st, "held", foreign, 99999), STORE_FENCED);
    get(f->st, "held", &after);
    assert_int_equal(after.lease_expires_ms, a.lease_expires_ms);
    store_record_clear(&after);
}

static void test_extend_prevents_steal(void **state)
{
    struct fixture *f = *state;
    struct store_op x;
    struct store_op y;
    struct store_op o;
    uint8_t key[STORE_KEY_BYTES];
    enum store_outcome out = 0;

    assert_int_equal(acquire(f->st, "x", 'a', 1000, 60000, &x), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "y", 'a', 1000, 60000, &y), STORE_ACQUIRED);
    advance(f, 800);
    key_of("x", key);
    memset(&o, 0, sizeof(o));
    assert_int_equal(store_extend(f->st, key, x.lease_id, 1000, &out), 0);
    assert_int_equal(out, STORE_DONE);
    advance(f, 400); /* past the original lease of both */
    assert_int_equal(acquire(f->st, "x", 'a', 1000, 60000, &o), STORE_BUSY);
    assert_int_equal(o.lease_expires_ms, T0 + 1800);
    /* The control: the key that was not extended is stolen. */
    assert_int_equal(acquire(f->st, "y", 'a', 1000, 60000, &o), STORE_ACQUIRED);
    assert_true(o.stolen);
}

/* Hold: an owner whose action ran but whose result cannot be stored keeps
 * the key taken until its TTL, under a lease nobody has. */
static void test_hold_takes_the_lease_from_everyone(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    struct store_op h;
    struct store_op other;
    struct store_record rec;
    static const uint8_t zero[STORE_LEASE_ID_BYTES];

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "busy", 'a', 1000, 60000, &other), STORE_ACQUIRED);
    advance(f, 100);
    memset(&h, 0, sizeof(h));
    h.kind = STORE_OP_EXTEND;
    key_of("k", h.key);
    memcpy(h.lease_id, a.lease_id, STORE_LEASE_ID_BYTES);
    h.lease_ms = 60000;
    h.hold = true;
    assert_int_equal(store_apply(f->st, &h, 1), 0);
    assert_int_equal(h.outcome, STORE_DONE);

    get(f->st, "k", &rec);
    assert_int_equal(rec.state, STORE_STATE_IN_PROGRESS);
    assert_memory_equal(rec.lease_id, zero, STORE_LEASE_ID_BYTES);
    assert_true(store_lease_is_held(rec.lease_id));
    assert_int_equal(rec.lease_expires_ms, T0 + 100 + 60000);
    store_record_clear(&rec);

    /* A duplicate is told it is held; a live owner's key is not. */
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_BUSY);
    assert_true(b.held);
    assert_int_equal(b.lease_expires_ms, T0 + 100 + 60000);
    assert_int_equal(acquire(f->st, "busy", 'a', 1000, 60000, &b), STORE_BUSY);
    assert_false(b.held);
    assert_int_equal(acquire(f->st, "k", 'b', 1000, 60000, &b), STORE_MISMATCH);

    /* Neither the former owner nor the all-zero id settles it. */
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "late"), STORE_FENCED);
    assert_int_equal(release(f->st, "k", a.lease_id), STORE_FENCED);
    assert_int_equal(extend(f->st, "k", a.lease_id, 1000), STORE_FENCED);
    assert_int_equal(complete(f->st, "k", zero, 60000, "forged"), STORE_FENCED);
    assert_int_equal(release(f->st, "k", zero), STORE_FENCED);
    assert_int_equal(extend(f->st, "k", zero, 1000), STORE_FENCED);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_IN_PROGRESS);

    /* When the hold ends the key is an expired lease like any other. */
    advance(f, 60000);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    assert_true(b.stolen);
    assert_false(store_lease_is_held(b.lease_id));
}

static void test_ttl_counts_from_completion(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op o;
    struct store_record rec;

    assert_int_equal(acquire(f->st, "k", 'a', 10000, 10000, &a), STORE_ACQUIRED);
    advance(f, 8000);
    assert_int_equal(complete(f->st, "k", a.lease_id, 10000, "r"), STORE_DONE);
    get(f->st, "k", &rec);
    assert_int_equal(rec.expires_ms, T0 + 18000);
    store_record_clear(&rec);

    set_now(f, T0 + 17999); /* past acquire + ttl, before complete + ttl */
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 10000, &o), STORE_REPLAY);
    store_record_clear(&o.replay);
    set_now(f, T0 + 18000);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 10000, &o), STORE_ACQUIRED);
    assert_false(o.stolen);
}

static int count_records(const uint8_t key[STORE_KEY_BYTES], const struct store_record *rec,
                         void *ctx)
{
    (void)key;
    (void)rec;
    (*(int *)ctx)++;
    return 0;
}

static void test_expired_complete_is_absent_before_purge(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    int n = 0;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 5000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "k", a.lease_id, 5000, "old"), STORE_DONE);
    advance(f, 5000);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);
    /* Still stored: no purge has run. */
    assert_int_equal(records_in(f->st), 1);
    assert_int_equal(store_scan(f->st, count_records, &n), 0);
    assert_int_equal(n, 1);
    /* Another fingerprint is no mismatch against an expired record. */
    assert_int_equal(acquire(f->st, "k", 'b', 1000, 5000, &b), STORE_ACQUIRED);
    assert_false(b.stolen);
    assert_memory_not_equal(a.lease_id, b.lease_id, STORE_LEASE_ID_BYTES);
    /* The new record is in flight; the expired one stays in the records
     * environment until purge deletes it or the complete replaces it. */
    assert_int_equal(records_in(f->st), 2);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(complete(f->st, "k", b.lease_id, 5000, "new"), STORE_DONE);
    assert_int_equal(records_in(f->st), 1);
}

/* store_view() sees what store_get() copies, without the copy: the same
 * fields, headers and body (borrowed for the call), and ABSENT for a
 * missing key or an expired record. */
struct viewed {
    int calls;
    struct store_record rec;
    char body[16];
    char headers[16];
};

static void view_fn(const struct store_record *rec, void *ctx)
{
    struct viewed *v = ctx;
    v->calls++;
    v->rec = *rec;
    v->rec.headers = NULL;
    v->rec.body = NULL;
    if (rec->body_len > 0 && rec->body_len < sizeof(v->body)) {
        memcpy(v->body, rec->body, rec->body_len);
    }
    if (rec->headers_len > 0 && rec->headers_len < sizeof(v->headers)) {
        memcpy(v->headers, rec->headers, rec->headers_len);
    }
}

static void test_view_is_get_without_the_copy(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_record rec;
    struct viewed v;
    uint8_t key[STORE_KEY_BYTES];

    key_of("k", key);
    memset(&v, 0, sizeof(v));
    assert_int_equal(store_view(f->st, key, view_fn, &v), 0);
    assert_int_equal(v.calls, 1);
    assert_int_equal(v.rec.state, STORE_STATE_ABSENT);

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 5000, &a), STORE_ACQUIRED);
    memset(&v, 0, sizeof(v));
    assert_int_equal(store_view(f->st, key, view_fn, &v), 0);
    assert_int_equal(v.rec.state, STORE_STATE_IN_PROGRESS);
    assert_memory_equal(v.rec.lease_id, a.lease_id, STORE_LEASE_ID_BYTES);

    assert_int_equal(complete(f->st, "k", a.lease_id, 5000, "body"), STORE_DONE);
    get(f->st, "k", &rec);
    memset(&v, 0, sizeof(v));
    assert_int_equal(store_view(f->st, key, view_fn, &v), 0);
    assert_int_equal(v.calls, 1);
    assert_int_equal(v.rec.state, STORE_STATE_COMPLETE);
    assert_int_equal(v.rec.status, rec.status);
    assert_memory_equal(v.rec.lease_id, rec.lease_id, STORE_LEASE_ID_BYTES);
    assert_int_equal(v.rec.expires_ms, rec.expires_ms);
    assert_memory_equal(v.rec.fingerprint, rec.fingerprint, STORE_FINGERPRINT_BYTES);
    assert_int_equal(v.rec.has_raw_fingerprint, rec.has_raw_fingerprint);
    assert_memory_equal(v.rec.raw_fingerprint, rec.raw_fingerprint, STORE_FINGERPRINT_BYTES);
    assert_int_equal(v.rec.body_len, rec.body_len);
    assert_memory_equal(v.body, rec.body, rec.body_len);
    assert_int_equal(v.rec.headers_len, rec.headers_len);
    assert_memory_equal(v.headers, rec.headers, rec.headers_len);
    store_record_clear(&rec);

    advance(f, 5000);
    memset(&v, 0, sizeof(v));
    assert_int_equal(store_view(f->st, key, view_fn, &v), 0);
    assert_int_equal(v.calls, 1);
    assert_int_equal(v.rec.state, STORE_STATE_ABSENT);
    assert_int_equal(store_view(f->st, key, NULL, &v), STORE_EINVAL);
}

/* ---- purge --------------------------------------------------------------- */

static void test_purge_deletes_expired_complete(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    size_t purged = 99;
    bool more = true;

    assert_int_equal(acquire(f->st, "short", 'a', 1000, 1000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "short", a.lease_id, 1000, "s"), STORE_DONE);
    assert_int_equal(acquire(f->st, "long", 'a', 1000, 100000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "long", a.lease_id, 100000, "l"), STORE_DONE);

    advance(f, 999);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 0);
    assert_int_equal(records_in(f->st), 2);

    advance(f, 1);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 1);
    assert_false(more);
    assert_int_equal(records_in(f->st), 1);
    assert_int_equal(state_of(f->st, "long"), STORE_STATE_COMPLETE);
}

static void test_purge_in_progress_rules(void **state)
{
    struct fixture *f = *state;
    struct store_op a; /* TTL live, lease expired: kept (stealable) */
    struct store_op b; /* TTL elapsed, lease kept live by heartbeats: kept */
    struct store_op c; /* both elapsed: purged */
    size_t purged = 0;
    bool more = true;

    assert_int_equal(acquire(f->st, "a", 'a', 1000, 10000, &a), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "b", 'a', 1000, 2000, &b), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "c", 'a', 1000, 2000, &c), STORE_ACQUIRED);
    set_now(f, T0 + 900);
    assert_int_equal(extend(f->st, "b", b.lease_id, 1000), STORE_DONE);
    set_now(f, T0 + 1800);
    assert_int_equal(extend(f->st, "b", b.lease_id, 1000), STORE_DONE); /* to T0+2800 */

    set_now(f, T0 + 2500);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(state_of(f->st, "a"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(state_of(f->st, "b"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(state_of(f->st, "c"), STORE_STATE_ABSENT);

    /* b keeps its heartbeat going: purge comes back to it and keeps it. */
    set_now(f, T0 + 2700);
    assert_int_equal(extend(f->st, "b", b.lease_id, 1000), STORE_DONE); /* to T0+3700 */
    set_now(f, T0 + 2900);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 0);
    assert_int_equal(state_of(f->st, "b"), STORE_STATE_IN_PROGRESS);
    /* ... and it still holds its lease. */
    set_now(f, T0 + 3000);
    assert_int_equal(extend(f->st, "b", b.lease_id, 1000), STORE_DONE); /* to T0+4000 */

    /* The heartbeat stops: once the lease expires, purge takes it. */
    set_now(f, T0 + 3900);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 0);
    set_now(f, T0 + 4000);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(state_of(f->st, "b"), STORE_STATE_ABSENT);

    /* a goes once its TTL elapses. */
    assert_int_equal(state_of(f->st, "a"), STORE_STATE_IN_PROGRESS);
    set_now(f, T0 + 10000);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(records_in(f->st), 0);
}

static void test_purge_keeps_completed_after_move(void **state)
{
    /* A record whose index entry purge moved (TTL elapsed, lease live) and
     * that is then completed gets the full TTL from completion. */
    struct fixture *f = *state;
    struct store_op a;
    struct store_op o;
    size_t purged = 0;
    bool more = false;

    assert_int_equal(acquire(f->st, "k", 'a', 5000, 1000, &a), STORE_ACQUIRED);
    set_now(f, T0 + 2000);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 0);
    assert_int_equal(complete(f->st, "k", a.lease_id, 10000, "done"), STORE_DONE);
    set_now(f, T0 + 11999);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 0);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 1000, &o), STORE_REPLAY);
    store_record_clear(&o.replay);
    set_now(f, T0 + 12000);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(records_in(f->st), 0);
}

/* n acquires then n completes, each batch one store_apply(). */
static void fill_completed(struct store *st, const char *prefix, size_t n, int64_t ttl_ms)
{
    struct store_op *ops = calloc(n, sizeof(*ops));
    assert_non_null(ops);
    for (size_t i = 0; i < n; i++) {
        char name[64];
        snprintf(name, sizeof(name), "%s%zu", prefix, i);
        ops[i].kind = STORE_OP_ACQUIRE;
        key_of(name, ops[i].key);
        fp_of('a', ops[i].fingerprint);
        ops[i].lease_ms = 1000;
        ops[i].ttl_ms = ttl_ms;
    }
    assert_int_equal(store_apply(st, ops, n), 0);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(ops[i].outcome, STORE_ACQUIRED);
        ops[i].kind = STORE_OP_COMPLETE;
        ops[i].status = 200;
        ops[i].body.ptr = "x";
        ops[i].body.len = 1;
    }
    assert_int_equal(store_apply(st, ops, n), 0);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(ops[i].outcome, STORE_DONE);
    }
    free(ops);
}

static void test_purge_in_bounded_batches(void **state)
{
    struct fixture *f = *state;
    struct store_stats before;
    struct store_stats after;
    size_t purged = 0;
    bool more = false;

    fill_completed(f->st, "short", 100, 1000);
    fill_completed(f->st, "long", 5, 100000);
    advance(f, 1000);
    assert_int_equal(store_purge(f->st, 30, &purged, &more), 0);
    assert_int_equal(purged, 30);
    assert_true(more);
    assert_int_equal(store_purge(f->st, 30, &purged, &more), 0);
    assert_int_equal(purged, 30);
    assert_true(more);
    assert_int_equal(store_purge(f->st, 30, &purged, &more), 0);
    assert_int_equal(purged, 30);
    assert_true(more);
    assert_int_equal(store_purge(f->st, 30, &purged, &more), 0);
    assert_int_equal(purged, 10);
    assert_false(more);
    assert_int_equal(records_in(f->st), 5);

    /* Nothing due: no write transaction at all. */
    assert_int_equal(store_stats(f->st, &before), 0);
    assert_int_equal(store_purge(f->st, 30, &purged, &more), 0);
    assert_int_equal(purged, 0);
    assert_false(more);
    assert_int_equal(store_stats(f->st, &after), 0);
    assert_int_equal(after.commits, before.commits);
}

/* store_apply_purge(): the ops, then up to max_purge purge steps, all in one
 * transaction; the same purge rules as store_purge(). */
static void test_apply_purge_shares_the_transaction(void **state)
{
    struct fixture *f = *state;
    struct store_stats before;
    struct store_stats after;
    struct store_op held;
    struct store_op op;
    size_t purged = 0;
    bool more = false;

    fill_completed(f->st, "short", 100, 1000);
    fill_completed(f->st, "long", 5, 100000);
    /* TTL elapses first, lease stays live: handled (moved), never deleted. */
    assert_int_equal(acquire(f->st, "held", 'a', 100000, 500, &held), STORE_ACQUIRED);
    advance(f, 1000);

    memset(&op, 0, sizeof(op));
    op.kind = STORE_OP_ACQUIRE;
    key_of("new", op.key);
    fp_of('a', op.fingerprint);
    op.lease_ms = 1000;
    op.ttl_ms = 1000;
    assert_int_equal(store_stats(f->st, &before), 0);
    assert_int_equal(store_apply_purge(f->st, &op, 1, 40, &purged, &more), 0);
    assert_int_equal(op.outcome, STORE_ACQUIRED);
    /* The acquire commits in the environment of the records in flight, the
     * purge share in the records one: 40 expired records deleted there. */
    assert_int_equal(purged, 40);
    assert_true(more);
    assert_int_equal(store_stats(f->st, &after), 0);
    assert_int_equal(after.inflight_commits, before.inflight_commits + 1);
    assert_int_equal(after.records, 1 + 100 + 5 + 1 - 40);

    /* No ops: a purge of its own, one transaction each. */
    assert_int_equal(store_apply_purge(f->st, NULL, 0, 40, &purged, &more), 0);
    assert_int_equal(purged, 40);
    assert_true(more);
    assert_int_equal(store_stats(f->st, &before), 0);
    /* The last 20, then the records in flight with what is left of the
     * share: "held" is due (TTL over) under a live lease, so it is moved,
     * not deleted. */
    assert_int_equal(store_apply_purge(f->st, NULL, 0, 40, &purged, &more), 0);
    assert_int_equal(purged, 20);
    assert_false(more);
    assert_int_equal(store_stats(f->st, &after), 0);
    assert_int_equal(after.inflight_commits, before.inflight_commits + 1);
    assert_int_equal(records_in(f->st), 7);
    assert_int_equal(state_of(f->st, "held"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(state_of(f->st, "new"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(state_of(f->st, "long0"), STORE_STATE_COMPLETE);

    /* Nothing due: no write transaction at all; max_purge 0 is store_apply. */
    assert_int_equal(store_stats(f->st, &before), 0);
    assert_int_equal(store_apply_purge(f->st, NULL, 0, 40, &purged, &more), 0);
    assert_int_equal(purged, 0);
    assert_false(more);
    assert_int_equal(store_stats(f->st, &after), 0);
    assert_int_equal(after.commits, before.commits);
    assert_int_equal(after.inflight_commits, before.inflight_commits);
    op.kind = STORE_OP_RELEASE; /* lease_id is the one the acquire drew */
    assert_int_equal(store_apply_purge(f->st, &op, 1, 0, &purged, &more), 0);
    assert_int_equal(op.outcome, STORE_DONE);
    assert_int_equal(purged, 0);
    assert_int_equal(state_of(f->st, "new"), STORE_STATE_ABSENT);

    /* Bad ops fail the call before anything, purge included, is done. */
    advance(f, 1000000);
    op.kind = STORE_OP_ACQUIRE;
    op.ttl_ms = 0;
    assert_int_equal(store_apply_purge(f->st, &op, 1, 40, &purged, &more), STORE_EINVAL);
    assert_int_equal(purged, 0);
    assert_int_equal(records_in(f->st), 6);
    assert_int_equal(store_apply_purge(NULL, NULL, 0, 40, &purged, &more), STORE_EINVAL);
}

#ifdef IDEM_FAULT_INJECTION
/* One complete plus a purge of 10 over a fresh store holding 20 expired
 * answers (a complete: since layout 4 an acquire commits in the
 * environment of the records in flight, and a purge share rides in the
 * records' transactions), with the Nth LMDB call (mode "eio") or
 * put/delete ("full") failing; nth 0 fails none. Reports the calls
 * counted. */
static int faulty_apply_purge(struct fixture *f, const char *mode, uint64_t nth, size_t max_purge,
                              struct store_op *op, size_t *purged, uint64_t *records,
                              uint64_t *calls)
{
    char path[256];
    char nth_text[32];
    struct store *st = NULL;
    bool more = false;
    int rc;

    snprintf(path, sizeof(path), "%s/fault-%s-%llu-%zu", f->dir, mode, (unsigned long long)nth,
             max_purge);
    set_now(f, T0);
    assert_int_equal(open_at(f, path, 0, &st), 0);
    fill_completed(st, "old", 20, 1000);
    set_now(f, T0 + 1000);
    memset(op, 0, sizeof(*op));
    assert_int_equal(acquire(st, "new", 'a', 1000, 1000, op), STORE_ACQUIRED);
    op->kind = STORE_OP_COMPLETE;
    op->status = 200;
    op->body.ptr = "new";
    op->body.len = 3;

    snprintf(nth_text, sizeof(nth_text), "%llu", (unsigned long long)nth);
    setenv("IDEM_FAULT_LMDB_NTH", nth_text, 1);
    setenv("IDEM_FAULT_LMDB_ERR", mode, 1);
    store_fault_arm();
    rc = store_apply_purge(st, op, 1, max_purge, purged, &more);
    *calls = strcmp(mode, "full") == 0 ? store_fault_lmdb_write_calls() : store_fault_lmdb_calls();
    setenv("IDEM_FAULT_LMDB_NTH", "0", 1);
    store_fault_arm(); /* disarmed: counts, never fails */
    (void)more;
    *records = records_in(st);
    store_close(st);
    return rc;
}

/* Whatever fails in the purge part (a read, a delete, MDB_MAP_FULL), the
 * ops commit exactly as store_apply() would commit them, and none of the
 * purge does; a failure in the ops part or the commit fails them as before. */
static void test_apply_purge_failure_leaves_ops_alone(void **state)
{
    static const char *const modes[] = {"eio", "full"};
    struct fixture *f = *state;

    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        const char *mode = modes[m];
        bool full = strcmp(mode, "full") == 0;
        struct store_op op;
        size_t purged = 0;
        uint64_t records = 0;
        uint64_t ops_calls = 0;
        uint64_t all_calls = 0;

        /* Fault-free: how many calls the ops alone make, and with the purge. */
        assert_int_equal(faulty_apply_purge(f, mode, 0, 0, &op, &purged, &records, &ops_calls), 0);
        assert_int_equal(records, 21);
        assert_int_equal(faulty_apply_purge(f, mode, 0, 10, &op, &purged, &records, &all_calls), 0);
        assert_int_equal(purged, 10);
        assert_int_equal(records, 11);
        assert_true(all_calls > ops_calls + 10);

        for (uint64_t nth = 1; nth <= all_calls; nth++) {
            uint64_t calls = 0;
            int rc = faulty_apply_purge(f, mode, nth, 10, &op, &purged, &records, &calls);
            /* eio: calls 1..ops_calls-1 are the ops' (begin, reads, puts),
             * the last one is the commit. full: puts and deletes only, the
             * ops' first (a full map there purges on its own, as before). */
            bool in_ops = full ? nth <= ops_calls : nth < ops_calls;
            bool commit = !full && nth == all_calls;
            if (in_ops && full) {
                continue; /* store_apply's own purge-on-full: its tests */
            }
            if (in_ops && rc == 0) {
                /* Only a fault the store has a way around: a pooled read
                 * transaction (of the records in flight, read by the
                 * complete) that does not renew is replaced by a new one. */
                const char *func = NULL;
                const char *call = NULL;
                store_fault_lmdb_failed(&func, &call);
                assert_non_null(call);
                assert_non_null(strstr(call, "mdb_txn_renew"));
                assert_int_equal(op.outcome, STORE_DONE);
                continue;
            }
            if (in_ops || commit) {
                assert_true(rc < 0);
                assert_int_equal(records, 21); /* "new" still in flight */
                assert_int_equal(purged, 0);
                continue;
            }
            assert_int_equal(rc, 0);
            assert_int_equal(op.outcome, STORE_DONE);
            assert_int_equal(purged, 0);
            assert_int_equal(records, 21);
        }
    }
}
#endif

/* ---- concurrency, scopes, batches --------------------------------------- */

struct racer {
    struct store *st;
    pthread_barrier_t *barrier;
    const char *name;
    struct store_op op;
    int rc;
    int reads_ok;
};

static void *race_acquire(void *arg)
{
    struct racer *r = arg;
    uint8_t key[STORE_KEY_BYTES];
    uint8_t fp[STORE_FINGERPRINT_BYTES];

    key_of(r->name, key);
    fp_of('a', fp);
    pthread_barrier_wait(r->barrier);
    r->rc = store_acquire(r->st, key, fp, 60000, 600000, &r->op);
    /* Readers on many threads at once, sharing the pooled transactions. */
    for (int i = 0; i < 50; i++) {
        struct store_record rec;
        if (store_get(r->st, key, &rec) == 0 && rec.state == STORE_STATE_IN_PROGRESS) {
            r->reads_ok++;
        }
        store_record_clear(&rec);
    }
    return NULL;
}

static void test_concurrent_acquire_one_winner(void **state)
{
    enum { THREADS = 20, ROUNDS = 5 };
    struct fixture *f = *state;

    for (int round = 0; round < ROUNDS; round++) {
        struct racer r[THREADS];
        pthread_t t[THREADS];
        pthread_barrier_t barrier;
        char name[32];
        int acquired = 0;
        int busy = 0;
        int64_t winner_lease = 0;

        snprintf(name, sizeof(name), "race%d", round);
        assert_int_equal(pthread_barrier_init(&barrier, NULL, THREADS), 0);
        for (int i = 0; i < THREADS; i++) {
            memset(&r[i], 0, sizeof(r[i]));
            r[i].st = f->st;
            r[i].barrier = &barrier;
            r[i].name = name;
            assert_int_equal(pthread_create(&t[i], NULL, race_acquire, &r[i]), 0);
        }
        for (int i = 0; i < THREADS; i++) {
            assert_int_equal(pthread_join(t[i], NULL), 0);
        }
        pthread_barrier_destroy(&barrier);
        for (int i = 0; i < THREADS; i++) {
            assert_int_equal(r[i].rc, 0);
            assert_int_equal(r[i].reads_ok, 50);
            if (r[i].op.outcome == STORE_ACQUIRED) {
                acquired++;
                winner_lease = r[i].op.lease_expires_ms;
            } else if (r[i].op.outcome == STORE_BUSY) {
                busy++;
            }
        }
        assert_int_equal(acquired, 1);
        assert_int_equal(busy, THREADS - 1);
        for (int i = 0; i < THREADS; i++) {
            assert_int_equal(r[i].op.lease_expires_ms, winner_lease);
        }
    }
}

static void test_key_derive(void **state)
{
    /* Vectors computed independently: SHA-256 of be64(len) scope be64(len)
     * key (Python hashlib). */
    static const uint8_t payments_abc[STORE_KEY_BYTES] = {
        0x7b, 0xed, 0x95, 0xb8, 0xcf, 0x71, 0xdd, 0x9d, 0xad, 0xb3, 0x60,
        0x9c, 0x6f, 0x84, 0x4a, 0x8c, 0x0a, 0x8b, 0xa8, 0x8d, 0xa5, 0xd4,
        0xa3, 0x68, 0xb8, 0xab, 0x91, 0xa0, 0xa8, 0x48, 0x27, 0x3a};
    static const uint8_t empty[STORE_KEY_BYTES] = {0x37, 0x47, 0x08, 0xff, 0xf7, 0x71, 0x9d, 0xd5,
                                                   0x97, 0x9e, 0xc8, 0x75, 0xd5, 0x6c, 0xd2, 0x28,
                                                   0x6f, 0x6d, 0x3c, 0xf7, 0xec, 0x31, 0x7a, 0x3b,
                                                   0x25, 0x63, 0x2a, 0xab, 0x28, 0xec, 0x37, 0xbb};
    uint8_t k1[STORE_KEY_BYTES];
    uint8_t k2[STORE_KEY_BYTES];

    (void)state;
    store_key_derive("payments", 8, "abc", 3, k1);
    assert_memory_equal(k1, payments_abc, STORE_KEY_BYTES);
    store_key_derive(NULL, 0, NULL, 0, k1);
    assert_memory_equal(k1, empty, STORE_KEY_BYTES);
    /* The length prefixes keep the split between scope and key. */
    store_key_derive("ab", 2, "c", 1, k1);
    store_key_derive("a", 1, "bc", 2, k2);
    assert_memory_not_equal(k1, k2, STORE_KEY_BYTES);
}

/* FIPS 180-2 vectors, split across parts in every way the callers do. */
static void test_sha256_known_answers(void **state)
{
    static const uint8_t abc[STORE_SHA256_BYTES] = {0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea,
                                                    0x41, 0x41, 0x40, 0xde, 0x5d, 0xae, 0x22, 0x23,
                                                    0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c,
                                                    0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};
    static const uint8_t empty[STORE_SHA256_BYTES] = {
        0xe3, 0xb0, 0xc4, 0x42, 0x98, 0xfc, 0x1c, 0x14, 0x9a, 0xfb, 0xf4,
        0xc8, 0x99, 0x6f, 0xb9, 0x24, 0x27, 0xae, 0x41, 0xe4, 0x64, 0x9b,
        0x93, 0x4c, 0xa4, 0x95, 0x99, 0x1b, 0x78, 0x52, 0xb8, 0x55};
    const struct store_span one[] = {{"abc", 3}};
    const struct store_span split[] = {{"a", 1}, {NULL, 0}, {"bc", 2}, {"", 0}};
    uint8_t out[STORE_SHA256_BYTES];

    (void)state;
    assert_int_equal(store_sha256(one, 1, out), STORE_OK);
    assert_memory_equal(out, abc, sizeof(out));
    assert_int_equal(store_sha256(split, 4, out), STORE_OK);
    assert_memory_equal(out, abc, sizeof(out));
    assert_int_equal(store_sha256(NULL, 0, out), STORE_OK);
    assert_memory_equal(out, empty, sizeof(out));
    /* Nothing of the digest before carries over into this one. */
    assert_int_equal(store_sha256(one, 1, out), STORE_OK);
    assert_memory_equal(out, abc, sizeof(out));
}

/* FIPS 180-2's two-block and million-"a" vectors, the input cut at places
 * that do not fall on the 64-byte blocks (a request body arrives in parts). */
static void test_sha256_long_inputs(void **state)
{
    static const char two[] = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    static const uint8_t two_want[STORE_SHA256_BYTES] = {
        0x24, 0x8d, 0x6a, 0x61, 0xd2, 0x06, 0x38, 0xb8, 0xe5, 0xc0, 0x26,
        0x93, 0x0c, 0x3e, 0x60, 0x39, 0xa3, 0x3c, 0xe4, 0x59, 0x64, 0xff,
        0x21, 0x67, 0xf6, 0xec, 0xed, 0xd4, 0x19, 0xdb, 0x06, 0xc1};
    static const uint8_t million_want[STORE_SHA256_BYTES] = {
        0xcd, 0xc7, 0x6e, 0x5c, 0x99, 0x14, 0xfb, 0x92, 0x81, 0xa1, 0xc7,
        0xe2, 0x84, 0xd7, 0x3e, 0x67, 0xf1, 0x80, 0x9a, 0x48, 0xa4, 0x97,
        0x20, 0x0e, 0x04, 0x6d, 0x39, 0xcc, 0xc7, 0x11, 0x2c, 0xd0};
    const struct store_span two_parts[] = {{two, 7}, {two + 7, 49}, {two + 56, 0}};
    struct store_span million_parts[3];
    uint8_t out[STORE_SHA256_BYTES];
    char *a = malloc(1000000);

    (void)state;
    assert_non_null(a);
    memset(a, 'a', 1000000);
    assert_int_equal(store_sha256(two_parts, 3, out), STORE_OK);
    assert_memory_equal(out, two_want, sizeof(out));
    million_parts[0] = (struct store_span){a, 1};
    million_parts[1] = (struct store_span){a + 1, 999998};
    million_parts[2] = (struct store_span){a + 999999, 1};
    assert_int_equal(store_sha256(million_parts, 3, out), STORE_OK);
    assert_memory_equal(out, million_want, sizeof(out));
    free(a);
}

#define SHA_THREADS 8
#define SHA_ROUNDS 2000

static void *sha256_thread(void *arg)
{
    uint8_t *ok = arg;
    uint8_t want[STORE_KEY_BYTES];
    uint8_t got[STORE_KEY_BYTES];

    /* Interleaved with the other threads' digests: no state is shared, so
     * every result is the same. */
    store_key_derive("payments", 8, "abc", 3, want);
    *ok = 1;
    for (int i = 0; i < SHA_ROUNDS; i++) {
        store_key_derive("payments", 8, "abc", 3, got);
        if (memcmp(want, got, sizeof(got)) != 0) {
            *ok = 0;
        }
    }
    return NULL;
}

static void test_sha256_threads(void **state)
{
    pthread_t th[SHA_THREADS];
    uint8_t ok[SHA_THREADS];
    uint8_t k[STORE_KEY_BYTES];
    static const uint8_t payments_abc[STORE_KEY_BYTES] = {
        0x7b, 0xed, 0x95, 0xb8, 0xcf, 0x71, 0xdd, 0x9d, 0xad, 0xb3, 0x60,
        0x9c, 0x6f, 0x84, 0x4a, 0x8c, 0x0a, 0x8b, 0xa8, 0x8d, 0xa5, 0xd4,
        0xa3, 0x68, 0xb8, 0xab, 0x91, 0xa0, 0xa8, 0x48, 0x27, 0x3a};

    (void)state;
    for (int i = 0; i < SHA_THREADS; i++) {
        assert_int_equal(pthread_create(&th[i], NULL, sha256_thread, &ok[i]), 0);
    }
    for (int i = 0; i < SHA_THREADS; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(ok[i], 1);
    }
    store_key_derive("payments", 8, "abc", 3, k);
    assert_memory_equal(k, payments_abc, sizeof(k));
}

/* An acquire carrying both fingerprints of its request, raw 'r...' and
 * canonical 'c...' bytes. */
static enum store_outcome acquire2(struct store *st, const char *name, uint8_t raw, uint8_t canon,
                                   struct store_op *op)
{
    memset(op, 0, sizeof(*op));
    op->kind = STORE_OP_ACQUIRE;
    key_of(name, op->key);
    fp_of(canon, op->fingerprint);
    op->has_raw_fingerprint = true;
    fp_of(raw, op->raw_fingerprint);
    op->lease_ms = 1000;
    op->ttl_ms = 60000;
    op->want_replay = true;
    assert_int_equal(store_apply(st, op, 1), 0);
    return op->outcome;
}

/* The fingerprint rule inside the write transaction (store.h, struct
 * store_op): raw fingerprints first, then the canonical ones. */
static void test_acquire_raw_then_canonical(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op o;
    struct store_record rec;
    uint8_t key[STORE_KEY_BYTES];

    assert_int_equal(acquire2(f->st, "k", 'r', 'c', &a), STORE_ACQUIRED);
    key_of("k", key);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    assert_true(rec.has_raw_fingerprint);
    assert_int_equal(rec.raw_fingerprint[0], 'r');
    assert_int_equal(rec.fingerprint[0], 'c');
    store_record_clear(&rec);

    /* IN_PROGRESS: busy for the same request either way, else mismatch. */
    assert_int_equal(acquire2(f->st, "k", 'r', 'x', &o), STORE_BUSY);
    assert_int_equal(acquire2(f->st, "k", 's', 'c', &o), STORE_BUSY);
    assert_int_equal(acquire2(f->st, "k", 's', 'x', &o), STORE_MISMATCH);

    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "done"), STORE_DONE);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    assert_true(rec.has_raw_fingerprint); /* kept by complete */
    assert_int_equal(rec.raw_fingerprint[0], 'r');
    store_record_clear(&rec);

    /* COMPLETE: a byte-identical retry (raw equal), one formatted otherwise
     * (raw differs, canonical equal), and another request (both differ). */
    assert_int_equal(acquire2(f->st, "k", 'r', 'x', &o), STORE_REPLAY);
    assert_int_equal(o.replay.body_len, 4);
    store_record_clear(&o.replay);
    assert_int_equal(acquire2(f->st, "k", 's', 'c', &o), STORE_REPLAY);
    store_record_clear(&o.replay);
    assert_int_equal(acquire2(f->st, "k", 's', 'x', &o), STORE_MISMATCH);
    assert_null(o.replay.body);

    /* An acquire without a raw fingerprint is compared on the canonical
     * one alone, even when its (unset) raw bytes would match. */
    memset(&o, 0, sizeof(o));
    o.kind = STORE_OP_ACQUIRE;
    memcpy(o.key, key, sizeof(key));
    fp_of('x', o.fingerprint);
    fp_of('r', o.raw_fingerprint);
    o.lease_ms = 1000;
    o.ttl_ms = 60000;
    assert_int_equal(store_apply(f->st, &o, 1), 0);
    assert_int_equal(o.outcome, STORE_MISMATCH);
}

/* Opens the store at path with LMDB itself, behind the store's back (it
 * must be closed meanwhile, or the open be in another process), and begins
 * a transaction; raw_end() commits it (aborts a read-only one) and closes. */
/* The layout this code writes (store_lmdb.c, STORE_LAYOUT). */
#define STORE_LAYOUT_NOW 4u

static uint32_t set_layout(const char *path, uint32_t layout);

static MDB_txn *raw_begin(const char *path, bool rdonly, MDB_env **env)
{
    unsigned int flags = rdonly ? MDB_RDONLY : 0;
    MDB_txn *txn = NULL;

    assert_int_equal(mdb_env_create(env), 0);
    assert_int_equal(mdb_env_set_mapsize(*env, (size_t)64 << 20), 0);
    assert_int_equal(mdb_env_set_maxdbs(*env, 4), 0);
    assert_int_equal(mdb_env_open(*env, path, flags, 0600), 0);
    assert_int_equal(mdb_txn_begin(*env, NULL, flags, &txn), 0);
    return txn;
}

static void raw_end(MDB_env *env, MDB_txn *txn, bool rdonly)
{
    if (rdonly)
        mdb_txn_abort(txn);
    else
        assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
}

/* Writes a version-1 IN_PROGRESS record behind the store's back, as a
 * store written before version 2 holds it (record.c layout). */
static void put_v1_in_progress(const char *path, const char *name, uint8_t canon,
                               const uint8_t lease[STORE_LEASE_ID_BYTES], int64_t lease_expires_ms,
                               int64_t expires_ms)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi records;
    MDB_dbi expiry;
    uint8_t key[STORE_KEY_BYTES];
    uint8_t rec[66];
    uint8_t idx[8 + STORE_KEY_BYTES];
    uint64_t t = (uint64_t)expires_ms ^ ((uint64_t)1 << 63);
    MDB_val k = {sizeof(key), key};
    MDB_val v = {sizeof(rec), rec};
    MDB_val ik = {sizeof(idx), idx};
    MDB_val iv = {0, NULL};

    key_of(name, key);
    memset(rec, 0, sizeof(rec));
    rec[0] = 1;
    rec[1] = STORE_STATE_IN_PROGRESS;
    memcpy(rec + 2, lease, STORE_LEASE_ID_BYTES);
    for (int i = 0; i < 8; i++) {
        rec[18 + i] = (uint8_t)((uint64_t)lease_expires_ms >> (8 * i));
        rec[26 + i] = (uint8_t)((uint64_t)expires_ms >> (8 * i));
        idx[i] = (uint8_t)(t >> (56 - 8 * i)); /* the expiry index entry */
    }
    memset(rec + 34, canon, STORE_FINGERPRINT_BYTES);
    memcpy(idx + 8, key, STORE_KEY_BYTES);
    txn = raw_begin(path, false, &env);
    assert_int_equal(mdb_dbi_open(txn, "records", 0, &records), 0);
    assert_int_equal(mdb_dbi_open(txn, "expiry", 0, &expiry), 0);
    assert_int_equal(mdb_put(txn, records, &k, &v, 0), 0);
    assert_int_equal(mdb_put(txn, expiry, &ik, &iv, 0), 0);
    raw_end(env, txn, false);
}

/* A store written before version 2 survives the upgrade: its records are
 * read, compared on the canonical fingerprint, completed (staying version
 * 1, since their raw fingerprint is unknown) and replayed. */
static void test_v1_record_in_store(void **state)
{
    struct fixture *f = *state;
    uint8_t lease[STORE_LEASE_ID_BYTES];
    uint8_t key[STORE_KEY_BYTES];
    struct store_record rec;
    struct store_op o;
    size_t purged = 0;

    store_close(f->st);
    f->st = NULL;
    memset(lease, 0x42, sizeof(lease));
    put_v1_in_progress(f->path, "old", 'c', lease, T0 + 1000, T0 + 60000);
    /* Of a layout that had IN_PROGRESS records in records (the upgrade
     * moves it to the records in flight). */
    assert_int_equal(set_layout(f->path, 2), STORE_LAYOUT_NOW);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);

    key_of("old", key);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    assert_int_equal(rec.state, STORE_STATE_IN_PROGRESS);
    assert_false(rec.has_raw_fingerprint);
    store_record_clear(&rec);
    /* Any raw fingerprint: the canonical one decides. */
    assert_int_equal(acquire2(f->st, "old", 'c', 'x', &o), STORE_MISMATCH);
    assert_int_equal(acquire2(f->st, "old", 's', 'c', &o), STORE_BUSY);

    assert_int_equal(complete(f->st, "old", lease, 60000, "done"), STORE_DONE);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    assert_int_equal(rec.state, STORE_STATE_COMPLETE);
    assert_false(rec.has_raw_fingerprint);
    store_record_clear(&rec);
    assert_int_equal(acquire2(f->st, "old", 's', 'c', &o), STORE_REPLAY);
    store_record_clear(&o.replay);
    assert_int_equal(acquire2(f->st, "old", 'c', 'x', &o), STORE_MISMATCH);

    /* Expired, it is purged like any record. */
    advance(f, 120000);
    assert_int_equal(store_purge(f->st, 10, &purged, NULL), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(records_in(f->st), 0);
}

/* Which of the store's record tables hold a key, read with LMDB itself (the
 * store closed meanwhile): IN_RECORDS and IN_INFLIGHT of the records
 * environment (held records, and IN_PROGRESS ones before layout 4), and
 * IN_FLIGHT_ENV, the environment of the records in flight (layout 4). */
#define IN_RECORDS 1
#define IN_INFLIGHT 2
#define IN_FLIGHT_ENV 4
static int tables_holding(const char *path, const char *name)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    uint8_t key[STORE_KEY_BYTES];
    MDB_val k = {sizeof(key), key};
    MDB_val v;
    char fpath[4200];
    struct stat sb;
    int in = 0;

    key_of(name, key);
    txn = raw_begin(path, true, &env);
    assert_int_equal(mdb_dbi_open(txn, "records", 0, &dbi), 0);
    if (mdb_get(txn, dbi, &k, &v) == 0)
        in |= IN_RECORDS;
    assert_int_equal(mdb_dbi_open(txn, "inflight", 0, &dbi), 0);
    if (mdb_get(txn, dbi, &k, &v) == 0)
        in |= IN_INFLIGHT;
    raw_end(env, txn, true);
    snprintf(fpath, sizeof(fpath), "%s/inflight", path);
    if (stat(fpath, &sb) == 0) {
        txn = raw_begin(fpath, true, &env);
        assert_int_equal(mdb_dbi_open(txn, "inflight", 0, &dbi), 0);
        if (mdb_get(txn, dbi, &k, &v) == 0)
            in |= IN_FLIGHT_ENV;
        assert_int_equal(mdb_dbi_open(txn, "records", 0, &dbi), 0);
        assert_int_not_equal(mdb_get(txn, dbi, &k, &v), 0); /* never written */
        raw_end(env, txn, true);
    }
    return in;
}

/* Closes the fixture's store, returns which tables hold name, reopens. */
static int closed_tables_holding(struct fixture *f, const char *name)
{
    int in;
    store_close(f->st);
    f->st = NULL;
    in = tables_holding(f->path, name);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
    return in;
}

/* IN_PROGRESS records live in the environment of the records in flight,
 * COMPLETE ones in records: a complete moves the key (its entry in flight
 * deleted once the COMPLETE is committed), a hold moves it to the records
 * environment's inflight table. */
static void test_in_progress_and_complete_live_apart(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    struct store_op c;
    struct store_op h;
    size_t purged = 0;

    assert_int_equal(acquire(f->st, "a", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(closed_tables_holding(f, "a"), IN_FLIGHT_ENV);
    assert_int_equal(extend(f->st, "a", a.lease_id, 5000), STORE_DONE);
    assert_int_equal(closed_tables_holding(f, "a"), IN_FLIGHT_ENV);
    assert_int_equal(complete(f->st, "a", a.lease_id, 60000, "done"), STORE_DONE);
    assert_int_equal(closed_tables_holding(f, "a"), IN_RECORDS);
    assert_int_equal(state_of(f->st, "a"), STORE_STATE_COMPLETE);

    assert_int_equal(acquire(f->st, "b", 'b', 1000, 60000, &b), STORE_ACQUIRED);
    assert_int_equal(release(f->st, "b", b.lease_id), STORE_DONE);
    assert_int_equal(closed_tables_holding(f, "b"), 0);

    assert_int_equal(acquire(f->st, "h", 'h', 1000, 60000, &h), STORE_ACQUIRED);
    assert_int_equal(hold(f->st, "h", h.lease_id, 1000), STORE_DONE);
    assert_int_equal(closed_tables_holding(f, "h"), IN_INFLIGHT);

    /* A steal stays in flight; an expired COMPLETE acquired afresh is
     * in flight too, beside the expired one (gone with purge, or replaced
     * by the complete). */
    assert_int_equal(acquire(f->st, "c", 'c', 1000, 60000, &c), STORE_ACQUIRED);
    advance(f, 2000);
    assert_int_equal(acquire(f->st, "c", 'c', 1000, 60000, &c), STORE_ACQUIRED);
    assert_true(c.stolen);
    assert_int_equal(closed_tables_holding(f, "c"), IN_FLIGHT_ENV);
    assert_int_equal(acquire(f->st, "h", 'h', 1000, 60000, &h), STORE_ACQUIRED);
    assert_true(h.stolen); /* the hold ended: taken over, as before */
    assert_int_equal(closed_tables_holding(f, "h"), IN_INFLIGHT | IN_FLIGHT_ENV);
    advance(f, 60000);
    assert_int_equal(acquire(f->st, "a", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(closed_tables_holding(f, "a"), IN_RECORDS | IN_FLIGHT_ENV);
    assert_int_equal(records_in(f->st), 5);
    assert_int_equal(state_of(f->st, "a"), STORE_STATE_IN_PROGRESS);

    /* Purge finds IN_PROGRESS records in flight too. */
    advance(f, 120000);
    assert_int_equal(store_purge(f->st, 10, &purged, NULL), 0);
    assert_int_equal(purged, 5);
    assert_int_equal(records_in(f->st), 0);
    assert_int_equal(closed_tables_holding(f, "a"), 0);
    assert_int_equal(closed_tables_holding(f, "c"), 0);
}

/* Moves a record in flight (and its index entry) from the environment of
 * the records in flight to the records environment's inflight table, where
 * a store of layout 2 or 3 kept it (the store closed meanwhile). */
static void in_flight_back_to_records_env(const char *path, const char *name)
{
    MDB_env *fenv = NULL;
    MDB_env *renv = NULL;
    MDB_txn *ftxn;
    MDB_txn *rtxn;
    MDB_dbi fin, fexp, rin, rexp;
    MDB_cursor *cur;
    uint8_t key[STORE_KEY_BYTES];
    uint8_t rec[512];
    uint8_t idx[8 + STORE_KEY_BYTES];
    MDB_val k = {sizeof(key), key};
    MDB_val v;
    MDB_val ik;
    MDB_val iv = {0, NULL};
    char fpath[4200];
    bool moved_index = false;

    key_of(name, key);
    snprintf(fpath, sizeof(fpath), "%s/inflight", path);
    ftxn = raw_begin(fpath, false, &fenv);
    assert_int_equal(mdb_dbi_open(ftxn, "inflight", 0, &fin), 0);
    assert_int_equal(mdb_dbi_open(ftxn, "expiry", 0, &fexp), 0);
    assert_int_equal(mdb_get(ftxn, fin, &k, &v), 0);
    assert_true(v.mv_size <= sizeof(rec));
    memcpy(rec, v.mv_data, v.mv_size);
    v.mv_data = rec;
    assert_int_equal(mdb_del(ftxn, fin, &k, NULL), 0);
    assert_int_equal(mdb_cursor_open(ftxn, fexp, &cur), 0);
    for (MDB_cursor_op op = MDB_FIRST; mdb_cursor_get(cur, &ik, &iv, op) == 0; op = MDB_NEXT) {
        if (ik.mv_size == sizeof(idx) && memcmp((uint8_t *)ik.mv_data + 8, key, sizeof(key)) == 0) {
            memcpy(idx, ik.mv_data, sizeof(idx));
            assert_int_equal(mdb_cursor_del(cur, 0), 0);
            moved_index = true;
            break;
        }
    }
    mdb_cursor_close(cur);
    assert_true(moved_index);
    ik.mv_data = idx;
    ik.mv_size = sizeof(idx);
    iv.mv_size = 0;
    iv.mv_data = NULL;
    rtxn = raw_begin(path, false, &renv);
    assert_int_equal(mdb_dbi_open(rtxn, "inflight", 0, &rin), 0);
    assert_int_equal(mdb_dbi_open(rtxn, "expiry", 0, &rexp), 0);
    assert_int_equal(mdb_put(rtxn, rin, &k, &v, 0), 0);
    assert_int_equal(mdb_put(rtxn, rexp, &ik, &iv, 0), 0);
    raw_end(renv, rtxn, false);
    raw_end(fenv, ftxn, false);
}

/* Drops the inflight and meta tables, as a store written before they
 * existed (layout 1) lacks them. */
static void drop_layout_2_tables(const char *path)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;

    txn = raw_begin(path, false, &env);
    assert_int_equal(mdb_dbi_open(txn, "inflight", 0, &dbi), 0);
    assert_int_equal(mdb_drop(txn, dbi, 1), 0);
    assert_int_equal(mdb_dbi_open(txn, "meta", 0, &dbi), 0);
    assert_int_equal(mdb_drop(txn, dbi, 1), 0);
    raw_end(env, txn, false);
}

/* Writes the store's layout record behind its back; returns the old one. */
static uint32_t set_layout(const char *path, uint32_t layout)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    uint8_t b[4] = {(uint8_t)layout, (uint8_t)(layout >> 8), (uint8_t)(layout >> 16),
                    (uint8_t)(layout >> 24)};
    MDB_val k = {6, "layout"};
    MDB_val v = {sizeof(b), b};
    MDB_val old;
    uint32_t was = 0;

    txn = raw_begin(path, false, &env);
    assert_int_equal(mdb_dbi_open(txn, "meta", 0, &dbi), 0);
    assert_int_equal(mdb_get(txn, dbi, &k, &old), 0);
    assert_int_equal(old.mv_size, 4);
    for (int i = 0; i < 4; i++)
        was |= (uint32_t)((const uint8_t *)old.mv_data)[i] << (8 * i);
    assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    raw_end(env, txn, false);
    return was;
}

/* Writes one record of the meta table behind the store's back (the store
 * must be closed). */
static void meta_put(const char *path, const char *key, const void *value, size_t len)
{
    MDB_env *env = NULL;
    MDB_txn *txn = raw_begin(path, false, &env);
    MDB_dbi dbi;
    MDB_val k = {strlen(key), (void *)key};
    MDB_val v = {len, (void *)value};

    assert_int_equal(mdb_dbi_open(txn, "meta", 0, &dbi), 0);
    assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    raw_end(env, txn, false);
}

/* Closes the fixture's store and writes one meta record behind its back;
 * *opt (when given) is set to reopen it as the fixture does. */
static void closed_meta_put(struct fixture *f, const char *key, const void *value, size_t len,
                            struct store_options *opt)
{
    store_close(f->st);
    f->st = NULL;
    meta_put(f->path, key, value, len);
    if (opt != NULL) {
        memset(opt, 0, sizeof(*opt));
        opt->path = f->path;
        opt->clock = &f->store_clock;
    }
}

/* A stall's end as the store keeps it in meta: 8 bytes, little endian. */
static void le64(int64_t v, uint8_t b[8])
{
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)v >> (8 * i));
}

/* A layout record that is not 4 bytes is reported as such at open, not
 * read as some layout. */
static void test_malformed_layout_refused(void **state)
{
    struct fixture *f = *state;
    struct store *st = NULL;
    struct store_options opt;
    char err[256] = "";

    closed_meta_put(f, "layout", "\x02\x00\x00", 3, &opt);
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_ECORRUPT);
    assert_null(st);
    assert_non_null(strstr(err, "layout record is malformed"));
}

/* Writes the end of a stall of the write path into meta, as another
 * process that saw one would (store_lmdb.c, stall_stamp), and reopens. */
static void stall_end_put(struct fixture *f, int64_t end)
{
    uint8_t b[8];
    char fpath[4200];

    /* Layout 4: in the meta of the records in flight, whose writes carry
     * the heartbeats. */
    le64(end, b);
    store_close(f->st);
    f->st = NULL;
    snprintf(fpath, sizeof(fpath), "%s/inflight", f->path);
    meta_put(fpath, "stall_end", b, sizeof(b));
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
}

/* After a stall of the store's write path, which held every holder's
 * heartbeat up, an expired lease of another process's request counts as
 * live until one lease (the taker's) after the stall ended: a duplicate
 * gets STORE_BUSY with that time, and the key is taken only then. */
static void test_stall_holds_steal_off_for_a_lease(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    int64_t end;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    advance(f, 5000); /* the lease ran out 4 s ago */
    end = atomic_load(&f->clock.now) - 200;
    stall_end_put(f, end);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_BUSY);
    assert_int_equal(b.lease_expires_ms, end + 1000);
    assert_int_equal(acquire(f->st, "k", 'b', 1000, 60000, &b), STORE_MISMATCH);
    advance(f, 799);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_BUSY);
    advance(f, 1);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    assert_true(b.stolen);
    assert_int_equal(release(f->st, "k", a.lease_id), STORE_FENCED);
}

/* A stall's end later than now is of another boot of the lease clock (or
 * garbage): ignored, and a stall long past gives no credit. */
static void test_stall_end_in_future_or_past_ignored(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "j", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    advance(f, 5000);
    stall_end_put(f, atomic_load(&f->clock.now) + 600000);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    assert_true(b.stolen);
    stall_end_put(f, atomic_load(&f->clock.now) - 1000);
    assert_int_equal(acquire(f->st, "j", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    assert_true(b.stolen);
}

/* The log salt only keys the access log's hash: one of the wrong size (a
 * stray write, another version) must not make the whole store unopenable,
 * least of all as "the layout record is malformed". A read-only open goes
 * without it; a writable one replaces it with a good one. */
static void test_malformed_log_salt_replaced(void **state)
{
    struct fixture *f = *state;
    struct store *st = NULL;
    struct store_options opt;
    struct store_stats stats;
    char err[256] = "";

    closed_meta_put(f, "log_salt", "abcde", 5, &opt);

    opt.read_only = true;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_OK);
    assert_int_equal(store_stats(st, &stats), 0);
    assert_false(stats.has_log_salt);
    store_close(st);
    st = NULL;

    opt.read_only = false;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_OK);
    assert_int_equal(store_stats(st, &stats), 0);
    assert_true(stats.has_log_salt);
    store_close(st);
    st = NULL;

    {
        /* The good one is the store's now. */
        MDB_env *env = NULL;
        MDB_txn *txn = raw_begin(f->path, true, &env);
        MDB_dbi dbi;
        MDB_val k = {8, "log_salt"};
        MDB_val v;
        assert_int_equal(mdb_dbi_open(txn, "meta", 0, &dbi), 0);
        assert_int_equal(mdb_get(txn, dbi, &k, &v), 0);
        assert_int_equal(v.mv_size, STORE_LOG_SALT_BYTES);
        assert_memory_equal(v.mv_data, stats.log_salt, STORE_LOG_SALT_BYTES);
        raw_end(env, txn, true);
    }
}

/* keep_layout (forget-key's open): a store of an older layout is refused,
 * not upgraded under the older proxies serving it, and a missing one is
 * not created; one of this layout opens for writing. */
static void test_keep_layout_upgrades_and_creates_nothing(void **state)
{
    struct fixture *f = *state;
    struct store *st = NULL;
    struct store_options opt;
    struct store_op a;
    char missing[4200];
    char err[512] = "";
    struct stat sb;

    assert_int_equal(acquire(f->st, "a", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    store_close(f->st);
    f->st = NULL;
    assert_int_equal(set_layout(f->path, 3), STORE_LAYOUT_NOW);
    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    opt.clock = &f->store_clock;
    opt.keep_layout = true;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_EINVAL);
    assert_null(st);
    assert_non_null(strstr(err, "of an older layout (3; this idemproxy's is 4)"));
    /* still 3: nothing raised it */
    assert_int_equal(set_layout(f->path, STORE_LAYOUT_NOW), 3);

    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_OK);
    store_close(st);
    st = NULL;

    snprintf(missing, sizeof(missing), "%s/not-here", f->path);
    opt.path = missing;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_EINVAL);
    assert_null(st);
    assert_non_null(strstr(err, "no store here"));
    assert_int_equal(stat(missing, &sb), -1);
}

/* A store of a newer layout is refused at open; and once a newer process
 * raises the layout under a running one, that one's writes fail (nothing
 * applied) instead of acquiring keys whose records it may not see. */
static void test_newer_layout_refused(void **state)
{
    struct fixture *f = *state;
    struct store *st = NULL;
    struct store_options opt;
    struct store_op a;
    uint8_t key[STORE_KEY_BYTES];
    uint8_t fp[STORE_FINGERPRINT_BYTES];
    char err[256] = "";
    size_t purged = 0;
    pid_t pid;
    int status = 0;

    assert_int_equal(acquire(f->st, "a", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    store_close(f->st);
    f->st = NULL;
    assert_int_equal(set_layout(f->path, STORE_LAYOUT_NOW + 1), STORE_LAYOUT_NOW);
    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    opt.clock = &f->store_clock;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_EINVAL);
    assert_null(st);
    assert_non_null(strstr(err, "newer idemproxy (store layout 5"));

    assert_int_equal(set_layout(f->path, STORE_LAYOUT_NOW), STORE_LAYOUT_NOW + 1);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
    /* Another process (this one may not open the path twice) raises it. */
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        _exit(set_layout(f->path, STORE_LAYOUT_NOW + 1) == STORE_LAYOUT_NOW ? 0 : 1);
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    key_of("b", key);
    fp_of('b', fp);
    memset(&a, 0, sizeof(a));
    assert_int_equal(store_acquire(f->st, key, fp, 1000, 60000, &a), STORE_ELAYOUT);
    assert_int_equal(a.outcome, 0);
    advance(f, 120000);
    assert_int_equal(store_purge(f->st, 10, &purged, NULL), STORE_ELAYOUT);
    assert_int_equal(records_in(f->st), 1); /* reads still work */
}

/* A store written before the split holds IN_PROGRESS records in records and
 * has no inflight table: it opens, its IN_PROGRESS records move to inflight
 * (the upgrade to layout 3, leases_settle), and every edge finds such a
 * record and leaves it in the table its new state belongs in. */
static void test_in_progress_from_before_the_split(void **state)
{
    struct fixture *f = *state;
    uint8_t lease[STORE_LEASE_ID_BYTES];
    struct store_op o;
    size_t purged = 0;
    const char *names[] = {"ext", "rel", "steal", "done", "purged"};

    store_close(f->st);
    f->st = NULL;
    memset(lease, 0x42, sizeof(lease));
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        int64_t expires = strcmp(names[i], "purged") == 0 ? T0 + 500 : T0 + 60000;
        put_v1_in_progress(f->path, names[i], 'c', lease, T0 + 1000, expires);
    }
    drop_layout_2_tables(f->path);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
    assert_int_equal(records_in(f->st), 5);
    assert_int_equal(closed_tables_holding(f, "ext"), IN_FLIGHT_ENV);

    assert_int_equal(acquire(f->st, "rel", 'c', 1000, 60000, &o), STORE_BUSY);
    assert_int_equal(extend(f->st, "ext", lease, 30000), STORE_DONE);
    assert_int_equal(closed_tables_holding(f, "ext"), IN_FLIGHT_ENV);
    assert_int_equal(release(f->st, "rel", lease), STORE_DONE);
    assert_int_equal(closed_tables_holding(f, "rel"), 0);
    assert_int_equal(complete(f->st, "done", lease, 60000, "ok"), STORE_DONE);
    assert_int_equal(closed_tables_holding(f, "done"), IN_RECORDS);

    advance(f, 2000); /* the leases of "steal" and "purged" expire */
    assert_int_equal(acquire(f->st, "steal", 'c', 1000, 60000, &o), STORE_ACQUIRED);
    assert_true(o.stolen);
    assert_int_equal(closed_tables_holding(f, "steal"), IN_FLIGHT_ENV);
    assert_int_equal(store_purge(f->st, 10, &purged, NULL), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(closed_tables_holding(f, "purged"), 0);
    assert_int_equal(records_in(f->st), 3);
}

/* Puts the fixture's store on a lease clock of its own, apart from the
 * wall clock, under epoch (a boot id), and opens it again. */
static void use_lease_clock(struct fixture *f, int64_t lease_now, const char *epoch)
{
    store_close(f->st);
    f->st = NULL;
    atomic_store(&f->clock.lease_now, lease_now);
    f->clock.epoch = epoch;
    f->store_clock.lease_now_ms = fake_lease_now;
    f->store_clock.lease_epoch = fake_epoch;
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
}

/* A lease clock for one handle whose write path stalls: from the
 * stall_read_at-th read on, every read is stall_jump ms later than the one
 * before (both clocks move). 0 reads: no stall. */
static _Atomic int64_t stall_jump;
static _Atomic int stall_reads_left;
/* With stall_once, only the stall_read_at-th read jumps (one stalled
 * commit, and nothing after it). */
static _Atomic bool stall_once;

static int64_t stalling_lease_now(void *ctx)
{
    struct fake_clock *c = ctx;

    if (atomic_load(&stall_jump) != 0 && atomic_fetch_sub(&stall_reads_left, 1) <= 1) {
        atomic_fetch_add(&c->lease_now, atomic_load(&stall_jump));
        atomic_fetch_add(&c->now, atomic_load(&stall_jump));
        if (atomic_load(&stall_once))
            atomic_store(&stall_jump, 0);
    }
    return atomic_load(&c->lease_now);
}

/* Reopens the store as another process would: stall_ms set, on the
 * stalling clock or the plain one. */
static void reopen_watching(struct fixture *f, bool stalling)
{
    struct store_options opt;
    char err[256];

    store_close(f->st);
    f->st = NULL;
    f->store_clock.lease_now_ms = stalling ? stalling_lease_now : fake_lease_now;
    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    opt.clock = &f->store_clock;
    opt.stall_ms = 500;
    assert_int_equal(store_open(NULL, &opt, &f->st, err, sizeof(err)), 0);
}

/* Process A holds a key; process B's write path stalls 2 s a clock read,
 * past A's lease, and B commits once more; process C, which saw no stall,
 * must take A's lease as live (B wrote the stall to meta). With stale, meta
 * already holds a stall of the previous boot, larger than this boot's
 * clock, left by an older release that switched the epoch without deleting
 * it: B once took it for a later stall of its own and wrote nothing. */
static void stall_reaches_another_process(void **state, bool stale)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    uint8_t v[8];

    use_lease_clock(f, 900000000, "boot-1");
    if (stale) {
        le64(899999000, v);
        closed_meta_put(f, "stall_end", v, sizeof(v), NULL);
        meta_put(f->path, "lease_epoch", "boot-2", strlen("boot-2"));
    }
    use_lease_clock(f, 100000, "boot-2");
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    reopen_watching(f, true);
    atomic_store(&stall_reads_left, 1);
    atomic_store(&stall_jump, 2000);
    assert_int_equal(acquire(f->st, "other", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    atomic_store(&stall_jump, 0);
    assert_int_equal(acquire(f->st, "other2", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    reopen_watching(f, false);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_BUSY);
}

static void test_stall_reaches_another_process_through_meta(void **state)
{
    stall_reaches_another_process(state, false);
}

static void test_stall_of_another_boot_in_meta_overwritten(void **state)
{
    stall_reaches_another_process(state, true);
}

/* B's commit is the stall (its clock jumps between the lock's taking and
 * the commit's end), and B commits nothing after it, so meta never gets it:
 * C learns of the hold through durability.lock (held_check) the moment it
 * takes the writer lock, and takes A's lease as live. */
static void test_stalled_hold_seen_by_the_next_taker(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;

    use_lease_clock(f, 100000, "boot-1");
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    reopen_watching(f, true);
    /* Reads: the wait's start, the lock's taking, the batch's now, the
     * commit's end: the jump comes at the fourth. */
    atomic_store(&stall_reads_left, 4);
    atomic_store(&stall_jump, 3000);
    assert_int_equal(acquire(f->st, "other", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    atomic_store(&stall_jump, 0);
    reopen_watching(f, false);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_BUSY);
    assert_true(b.lease_expires_ms >= atomic_load(&f->clock.lease_now) + 1000 - 1);
}

/* Layout 4: a complete's commit stalls (the records environment is
 * flushed; the records in flight are not), so the holder's lease runs out
 * while its complete waits, here behind another complete's stalled commit
 * in its writer. The steal that then takes the records' writer lock first
 * must take that long hold for a stall (held_check, through
 * durability.lock, since it waited for the lock less than a stall itself)
 * and the lease as live, or the key runs twice. Without the records'
 * holds counted in the steal, the duplicate here took the key. */
static void test_stalled_complete_seen_by_a_steal(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    struct store_op other;

    use_lease_clock(f, 100000, "boot-1");
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "other", 'a', 1000, 60000, &other), STORE_ACQUIRED);
    reopen_watching(f, true);
    /* Reads: the wait's start, the lock's taking, the batch's now, the
     * commit's end: the jump comes at the fourth, inside the records
     * environment's commit of the other key's complete. */
    atomic_store(&stall_reads_left, 4);
    atomic_store(&stall_once, true);
    atomic_store(&stall_jump, 3000);
    assert_int_equal(complete(f->st, "other", other.lease_id, 60000, "ok"), STORE_DONE);
    assert_int_equal(atomic_load(&stall_jump), 0); /* the jump came, once */
    atomic_store(&stall_once, false);
    reopen_watching(f, false); /* another process: it saw nothing itself */
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_BUSY);
    assert_true(b.lease_expires_ms >= atomic_load(&f->clock.lease_now) + 1000 - 1);
    /* The holder's complete lands, and the duplicate replays it. */
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "once"), STORE_DONE);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_REPLAY);
    store_record_clear(&b.replay);
}

/* Layout 4: a complete is committed in the records environment, then its
 * entry in flight is deleted; a process that dies between the two leaves
 * that entry (put back here behind the store's back, as it was). The
 * COMPLETE wins everywhere: an acquire replays it, reads and a scan show
 * it once, the stale lease settles nothing, and purge takes both. */
static void test_entry_left_in_flight_after_a_complete(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    struct store_record rec;
    MDB_env *env = NULL;
    MDB_txn *txn;
    MDB_dbi dbi;
    MDB_dbi edbi;
    MDB_cursor *cur;
    uint8_t key[STORE_KEY_BYTES];
    uint8_t copy[512];
    uint8_t idx[8 + STORE_KEY_BYTES];
    MDB_val k = {sizeof(key), key};
    MDB_val v;
    MDB_val ik;
    MDB_val iv;
    char fpath[4200];
    size_t purged = 0;
    int n = 0;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    key_of("k", key);
    store_close(f->st);
    f->st = NULL;
    snprintf(fpath, sizeof(fpath), "%s/inflight", f->path);
    txn = raw_begin(fpath, true, &env);
    assert_int_equal(mdb_dbi_open(txn, "inflight", 0, &dbi), 0);
    assert_int_equal(mdb_get(txn, dbi, &k, &v), 0);
    assert_true(v.mv_size <= sizeof(copy));
    memcpy(copy, v.mv_data, v.mv_size);
    v.mv_data = copy;
    assert_int_equal(mdb_dbi_open(txn, "expiry", 0, &edbi), 0);
    assert_int_equal(mdb_cursor_open(txn, edbi, &cur), 0);
    assert_int_equal(mdb_cursor_get(cur, &ik, &iv, MDB_FIRST), 0); /* its one entry */
    assert_int_equal(ik.mv_size, sizeof(idx));
    memcpy(idx, ik.mv_data, sizeof(idx));
    mdb_cursor_close(cur);
    raw_end(env, txn, true);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "once"), STORE_DONE);
    store_close(f->st);
    f->st = NULL;
    txn = raw_begin(fpath, false, &env);
    assert_int_equal(mdb_dbi_open(txn, "inflight", 0, &dbi), 0);
    assert_int_equal(mdb_put(txn, dbi, &k, &v, MDB_NOOVERWRITE), 0); /* it was deleted */
    assert_int_equal(mdb_dbi_open(txn, "expiry", 0, &edbi), 0);
    ik.mv_data = idx;
    ik.mv_size = sizeof(idx);
    iv.mv_size = 0;
    iv.mv_data = NULL;
    assert_int_equal(mdb_put(txn, edbi, &ik, &iv, MDB_NOOVERWRITE), 0); /* so was this */
    raw_end(env, txn, false);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);

    assert_int_equal(closed_tables_holding(f, "k"), IN_RECORDS | IN_FLIGHT_ENV);
    get(f->st, "k", &rec);
    assert_int_equal(rec.state, STORE_STATE_COMPLETE);
    store_record_clear(&rec);
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_REPLAY);
    assert_body(&b.replay, "once");
    store_record_clear(&b.replay);
    assert_int_equal(acquire(f->st, "k", 'b', 1000, 60000, &b), STORE_MISMATCH);
    assert_int_equal(store_scan(f->st, count_records, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "twice"), STORE_FENCED);
    advance(f, 2000); /* the entry's lease is over: still the COMPLETE */
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_REPLAY);
    store_record_clear(&b.replay);

    /* Past the COMPLETE's TTL the key is absent: the entry, under the
     * COMPLETE's lease, is nobody's, and a new acquire replaces it (no
     * steal). */
    advance(f, 60000);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);
    assert_int_equal(acquire(f->st, "k", 'b', 1000, 60000, &b), STORE_ACQUIRED);
    assert_false(b.stolen);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(release(f->st, "k", b.lease_id), STORE_DONE);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);

    advance(f, 120000);
    assert_int_equal(store_purge(f->st, 10, &purged, NULL), 0);
    assert_int_equal(purged, 1); /* R's COMPLETE; the entry went with the release */
    assert_int_equal(records_in(f->st), 0);
    assert_int_equal(closed_tables_holding(f, "k"), 0);
}

/* Layout 4: a batch of R's writer purges F with what is left of its
 * share, committing F before R. An entry whose complete is in that batch
 * (its TTL and lease both over, a slow action) must not go in that purge:
 * between the two commits an acquire would find neither the entry nor the
 * COMPLETE, and run the key again. Spared, it is moved, not deleted; the
 * complete's queued delete takes it. */
static void test_purge_share_spares_the_batch_completes(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op c;
    size_t purged = 0;
    bool more = false;

    assert_int_equal(acquire(f->st, "slow", 'a', 1000, 500, &a), STORE_ACQUIRED);
    advance(f, 2000); /* its TTL and its lease are over; nobody stole it */
    prep_complete(&c, "slow", a.lease_id, "ran once");
    assert_int_equal(store_apply_purge(f->st, &c, 1, 10, &purged, &more), 0);
    assert_int_equal(c.outcome, STORE_DONE);
    assert_int_equal(purged, 0);
    assert_int_equal(state_of(f->st, "slow"), STORE_STATE_COMPLETE);
    assert_int_equal(records_in(f->st), 1);
}

/* Layout 4: a batch of R's writer whose purge share R does not use purges
 * F's due entries with what is left, in F's transaction, holding F's
 * writer lock, which every acquire and heartbeat of the in-flight lane
 * waits for: at most 32 of them a batch, however large the share. */
static void test_inflight_purge_share_is_capped(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op c;
    size_t purged = 0;
    bool more = false;

    for (int i = 0; i < 50; i++) {
        char name[16];
        snprintf(name, sizeof(name), "dead%d", i);
        assert_int_equal(acquire(f->st, name, 'a', 1000, 500, &a), STORE_ACQUIRED);
    }
    assert_int_equal(acquire(f->st, "live", 'a', 60000, 60000, &a), STORE_ACQUIRED);
    advance(f, 2000); /* the 50 holders are gone: their TTLs and leases over */
    prep_complete(&c, "live", a.lease_id, "ok");
    assert_int_equal(store_apply_purge(f->st, &c, 1, 100, &purged, &more), 0);
    assert_int_equal(c.outcome, STORE_DONE);
    assert_int_equal(purged, 32);
    assert_true(more);
    assert_int_equal(store_purge(f->st, 100, &purged, &more), 0);
    assert_int_equal(purged, 18);
}

#ifdef IDEM_FAULT_INJECTION
struct snapshot_race {
    struct store *st;
    uint8_t lease_id[STORE_LEASE_ID_BYTES];
    const char *point; /* the store's point (store_fault.h) the complete runs at */
    bool armed;
    enum store_outcome completed;
};

static void *race_complete(void *p)
{
    struct snapshot_race *r = p;
    uint8_t key[STORE_KEY_BYTES];
    struct store_span h = {"h: v\r\n", 6};
    struct store_span b = {"once", 4};

    /* No cmocka asserts off the test's thread: the result says it. */
    key_of("k", key);
    if (store_complete(r->st, key, r->lease_id, 60000, 201, h, b, &r->completed) != 0) {
        r->completed = STORE_FULL; /* any outcome the test refuses */
    }
    return NULL;
}

/* At r->point, once: a complete of the key runs to its end (R's durable
 * commit, its entry's delete queued) on another thread. */
static void complete_in_the_window(const char *point, void *ctx)
{
    struct snapshot_race *r = ctx;
    pthread_t t;

    if (!r->armed || strcmp(point, r->point) != 0) {
        return;
    }
    r->armed = false;
    if (pthread_create(&t, NULL, race_complete, r) == 0) {
        pthread_join(t, NULL);
    }
}

/* Layout 4: F's writer applies the deletes queued by completes before it
 * begins its read of R. A complete that commits once that read has begun is
 * not in it, and its delete must wait for the next batch: an acquire of
 * the key in this one then finds the entry (BUSY). Taking the delete after
 * the read began would leave that acquire neither the entry nor the
 * COMPLETE, and it would run the key a second time. */
static void test_complete_during_an_inflight_batch(void **state)
{
    struct fixture *f = *state;
    struct snapshot_race race;
    struct store_op a;
    struct store_op b;
    enum store_outcome raced;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    memset(&race, 0, sizeof(race));
    race.st = f->st;
    memcpy(race.lease_id, a.lease_id, STORE_LEASE_ID_BYTES);
    race.point = "inflight-batch-records-snapshot";
    race.armed = true;
    store_fault_set_hook(complete_in_the_window, &race);
    raced = acquire(f->st, "k", 'a', 1000, 60000, &b);
    store_fault_set_hook(NULL, NULL);
    assert_false(race.armed); /* the batch went through the window */
    assert_int_equal(race.completed, STORE_DONE);
    assert_int_equal(raced, STORE_BUSY);
    store_record_clear(&b.replay);

    /* The next batch takes the delete, with a read of R that has the
     * COMPLETE: a replay, and the key is in R alone. */
    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &b), STORE_REPLAY);
    store_record_clear(&b.replay);
    assert_int_equal(closed_tables_holding(f, "k"), IN_RECORDS);
}

/* Layout 4: a lookup of a key that R does not have takes F's snapshot and
 * then R's again, and searches R again only when R committed in between
 * (its snapshot's transaction id moved). A complete that commits in that
 * window must be seen: the lookup answers the COMPLETE, not F's entry in
 * flight (which a lookup that trusted its first miss would return). */
static void test_lookup_sees_a_complete_after_its_miss(void **state)
{
    struct fixture *f = *state;
    struct snapshot_race race;
    struct store_op a;
    struct store_record rec;
    uint8_t key[STORE_KEY_BYTES];

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    memset(&race, 0, sizeof(race));
    race.st = f->st;
    memcpy(race.lease_id, a.lease_id, STORE_LEASE_ID_BYTES);
    race.point = "read-key-records-missed";
    race.armed = true;
    key_of("k", key);
    store_fault_set_hook(complete_in_the_window, &race);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    store_fault_set_hook(NULL, NULL);
    assert_false(race.armed); /* the lookup went through the window */
    assert_int_equal(race.completed, STORE_DONE);
    assert_int_equal(rec.state, STORE_STATE_COMPLETE);
    assert_int_equal(rec.status, 201);
    assert_int_equal(rec.body_len, 4);
    assert_memory_equal(rec.body, "once", 4);
    store_record_clear(&rec);

    /* A lookup with no commit in its window: F's entry of a new acquire. */
    assert_int_equal(acquire(f->st, "k2", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    key_of("k2", key);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    assert_int_equal(rec.state, STORE_STATE_IN_PROGRESS);
    assert_memory_equal(rec.lease_id, a.lease_id, STORE_LEASE_ID_BYTES);
    store_record_clear(&rec);
}

struct counted_window {
    struct snapshot_race race;
    uint64_t hook_calls; /* the LMDB calls the complete in the window made */
};

/* At the lookup's point, once: a complete of "k" commits to R, and the
 * LMDB calls it makes are counted apart. */
static void count_a_complete_in_the_window(const char *point, void *ctx)
{
    struct counted_window *w = ctx;
    uint64_t before;

    if (!w->race.armed || strcmp(point, w->race.point) != 0) {
        return;
    }
    before = store_fault_lmdb_calls();
    complete_in_the_window(point, &w->race);
    w->hook_calls = store_fault_lmdb_calls() - before;
}

/* The skip itself, counted: a lookup of a key that is nowhere makes
 * exactly one search of R fewer (its two tables, two mdb_get calls) when
 * nothing was committed to R between its two snapshots of R than when a
 * complete was. Without the skip both would make the same calls; without
 * the re-search when R moved, the first test above fails. */
static void test_lookup_searches_records_once_when_nothing_committed(void **state)
{
    struct fixture *f = *state;
    struct counted_window w;
    struct store_op a;
    struct store_record rec;
    uint8_t missing[STORE_KEY_BYTES];
    uint64_t c0;
    uint64_t quiet;
    uint64_t moved;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    key_of("nowhere", missing);
    setenv("IDEM_FAULT_LMDB_NTH", "0", 1);
    store_fault_arm(); /* counts, never fails */

    c0 = store_fault_lmdb_calls();
    assert_int_equal(store_get(f->st, missing, &rec), 0);
    quiet = store_fault_lmdb_calls() - c0;
    assert_int_equal(rec.state, STORE_STATE_ABSENT);

    memset(&w, 0, sizeof(w));
    w.race.st = f->st;
    memcpy(w.race.lease_id, a.lease_id, STORE_LEASE_ID_BYTES);
    w.race.point = "read-key-records-missed";
    w.race.armed = true;
    store_fault_set_hook(count_a_complete_in_the_window, &w);
    c0 = store_fault_lmdb_calls();
    assert_int_equal(store_get(f->st, missing, &rec), 0);
    moved = store_fault_lmdb_calls() - c0;
    store_fault_set_hook(NULL, NULL);
    assert_false(w.race.armed);
    assert_int_equal(w.race.completed, STORE_DONE);
    assert_true(w.hook_calls > 0);
    assert_int_equal(rec.state, STORE_STATE_ABSENT);
    assert_int_equal(moved - w.hook_calls, quiet + 2);
}
#endif

struct steal_arg {
    struct store *st;
    struct store_op op;
    atomic_bool done;
};

static void *steal_thread(void *p)
{
    struct steal_arg *a = p;
    assert_int_equal(store_apply(a->st, &a->op, 1), 0);
    atomic_store(&a->done, true);
    return NULL;
}

/* Layout 4's lock order, across processes: while another process holds the
 * records environment's writer lock (as a complete does from its lease
 * check until its commit is durable), an acquire of a new key goes through
 * (it writes the records in flight only), and a steal waits for the lock:
 * it comes after that complete, never between its check and its commit. */
static void test_steal_waits_for_the_records_lock(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op n;
    struct steal_arg steal;
    pthread_t t;
    int locked[2];
    int release[2];
    char c = 0;
    pid_t pid;
    int status = 0;

    assert_int_equal(acquire(f->st, "k", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    advance(f, 2000); /* its lease is over */
    assert_int_equal(pipe(locked), 0);
    assert_int_equal(pipe(release), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        MDB_env *env = NULL;
        MDB_txn *txn = NULL;
        int code = 1;
        if (mdb_env_create(&env) == 0 && mdb_env_set_maxdbs(env, 4) == 0 &&
            mdb_env_open(env, f->path, 0, 0600) == 0 &&
            mdb_txn_begin(env, NULL, 0, &txn) == 0) {
            code = write(locked[1], "l", 1) == 1 && read(release[0], &c, 1) == 1 ? 0 : 1;
            mdb_txn_abort(txn);
        }
        _exit(code);
    }
    assert_int_equal(read(locked[0], &c, 1), 1); /* the child holds the lock */

    assert_int_equal(acquire(f->st, "new", 'a', 1000, 60000, &n), STORE_ACQUIRED);
    memset(&steal, 0, sizeof(steal));
    steal.st = f->st;
    steal.op.kind = STORE_OP_ACQUIRE;
    key_of("k", steal.op.key);
    fp_of('a', steal.op.fingerprint);
    steal.op.lease_ms = 1000;
    steal.op.ttl_ms = 60000;
    assert_int_equal(pthread_create(&t, NULL, steal_thread, &steal), 0);
    usleep(200000);
    assert_false(atomic_load(&steal.done)); /* waiting for the child's lock */
    assert_int_equal(write(release[1], "r", 1), 1);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_true(atomic_load(&steal.done));
    assert_int_equal(steal.op.outcome, STORE_ACQUIRED);
    assert_true(steal.op.stolen);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    for (int i = 0; i < 2; i++) {
        close(locked[i]);
        close(release[i]);
    }
    assert_int_equal(complete(f->st, "k", a.lease_id, 60000, "late"), STORE_FENCED);
}

/* Leases are on the lease clock: a step of the wall clock past a live
 * lease (an NTP step) does not make it stealable, nor its record
 * purgeable; only the lease clock's time does. On the wall clock, the
 * duplicate after the step stole the key and ran it again. */
static void test_wall_clock_step_leaves_leases_alone(void **state)
{
    struct fixture *f = *state;
    struct store_op o;
    size_t purged = 0;

    use_lease_clock(f, 5000, "boot-1");
    assert_int_equal(acquire(f->st, "held", 'a', 1000, 60000, &o), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "short-ttl", 'a', 1000, 500, &o), STORE_ACQUIRED);
    step_wall(f, 120000); /* past both leases and both TTLs, on the wall clock */
    assert_int_equal(acquire(f->st, "held", 'a', 1000, 60000, &o), STORE_BUSY);
    assert_int_equal(store_purge(f->st, 10, &purged, NULL), 0);
    assert_int_equal(purged, 0); /* "short-ttl": TTL over, lease live */
    assert_int_equal(records_in(f->st), 2);

    advance(f, 1500); /* the leases end on their own clock */
    assert_int_equal(acquire(f->st, "held", 'a', 1000, 60000, &o), STORE_ACQUIRED);
    assert_true(o.stolen);
    assert_int_equal(store_purge(f->st, 10, &purged, NULL), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(records_in(f->st), 1);
}

/* Under another epoch (the host rebooted), every lease in the store is
 * over: the processes that held them are gone, and the new boot's lease
 * clock starts again near zero, where the old leases' times would look
 * live for as long as the last boot lasted. COMPLETE records are as they
 * were; the same epoch leaves leases alone. */
static void test_leases_end_with_the_boot(void **state)
{
    struct fixture *f = *state;
    struct store_op o;
    uint8_t lease[STORE_LEASE_ID_BYTES];

    use_lease_clock(f, 9000000, "boot-1"); /* a boot of 2.5 hours */
    assert_int_equal(acquire(f->st, "in-flight", 'a', 60000, 600000, &o), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "done", 'a', 60000, 600000, &o), STORE_ACQUIRED);
    memcpy(lease, o.lease_id, sizeof(lease));
    assert_int_equal(complete(f->st, "done", lease, 600000, "ok"), STORE_DONE);

    use_lease_clock(f, 9000100, "boot-1"); /* a restart, same boot */
    assert_int_equal(acquire(f->st, "in-flight", 'a', 60000, 600000, &o), STORE_BUSY);

    advance(f, 30000);
    use_lease_clock(f, 20000, "boot-2"); /* rebooted, 20 s ago */
    /* The records in flight were of the other boot: gone with it (their
     * environment is made again), so the key is absent, not stolen. */
    assert_int_equal(acquire(f->st, "in-flight", 'a', 60000, 600000, &o), STORE_ACQUIRED);
    assert_false(o.stolen);
    assert_int_equal(acquire(f->st, "done", 'a', 60000, 600000, &o), STORE_REPLAY);
    store_record_clear(&o.replay);

    /* The new lease is on the new boot's clock, and a restart keeps it. */
    use_lease_clock(f, 20100, "boot-2");
    assert_int_equal(acquire(f->st, "in-flight", 'a', 60000, 600000, &o), STORE_BUSY);
}

/* A held record (its action ran, its result could not be stored) stays
 * held across a reboot until its TTL, as across a restart: its duplicates
 * get BUSY (held), never a second run. */
static void test_held_record_outlives_the_boot(void **state)
{
    struct fixture *f = *state;
    struct store_op o;
    uint8_t lease[STORE_LEASE_ID_BYTES];
    uint8_t key[STORE_KEY_BYTES];
    struct store_op h;

    use_lease_clock(f, 9000000, "boot-1");
    assert_int_equal(acquire(f->st, "ran", 'a', 60000, 600000, &o), STORE_ACQUIRED);
    memcpy(lease, o.lease_id, sizeof(lease));
    key_of("ran", key);
    memset(&h, 0, sizeof(h));
    h.kind = STORE_OP_EXTEND;
    memcpy(h.key, key, sizeof(key));
    memcpy(h.lease_id, lease, sizeof(lease));
    h.lease_ms = 600000; /* held for its TTL */
    h.hold = true;
    assert_int_equal(store_apply(f->st, &h, 1), 0);
    assert_int_equal(h.outcome, STORE_DONE);

    advance(f, 60000);
    use_lease_clock(f, 20000, "boot-2");
    assert_int_equal(acquire(f->st, "ran", 'a', 60000, 600000, &o), STORE_BUSY);
    assert_true(o.held);
    advance(f, 530000); /* 10 s before its TTL (from the acquire) ends */
    assert_int_equal(acquire(f->st, "ran", 'a', 60000, 600000, &o), STORE_BUSY);
    advance(f, 11000);
    assert_int_equal(acquire(f->st, "ran", 'a', 60000, 600000, &o), STORE_ACQUIRED);
}

/* A store of layout 2 has its leases on the wall clock: opening it moves
 * each to the lease clock with the time it had left, and writes layout 3. */
static void test_wall_clock_leases_upgraded(void **state)
{
    struct fixture *f = *state;
    struct store_op o;

    assert_int_equal(acquire(f->st, "mid-action", 'a', 10000, 600000, &o), STORE_ACQUIRED);
    advance(f, 4000); /* 6 s left */
    store_close(f->st);
    f->st = NULL;
    /* Where a layout-2 store kept it. */
    in_flight_back_to_records_env(f->path, "mid-action");
    assert_int_equal(set_layout(f->path, 2), STORE_LAYOUT_NOW);

    use_lease_clock(f, 777, "boot-1"); /* a clock far from the wall clock */
    /* raised at open */
    assert_int_equal(set_layout(f->path, STORE_LAYOUT_NOW), STORE_LAYOUT_NOW);
    assert_int_equal(acquire(f->st, "mid-action", 'a', 10000, 600000, &o), STORE_BUSY);
    advance(f, 5500);
    assert_int_equal(acquire(f->st, "mid-action", 'a', 10000, 600000, &o), STORE_BUSY);
    advance(f, 1000);
    assert_int_equal(acquire(f->st, "mid-action", 'a', 10000, 600000, &o), STORE_ACQUIRED);
    assert_true(o.stolen);
}

/* A clock whose epoch cannot be told ("": the boot id unreadable) cannot
 * tell a lease left before a reboot from a live one: the store is not
 * opened for writing. */
static void test_unknown_epoch_refused(void **state)
{
    struct fixture *f = *state;
    struct store_options opt;
    struct store *st = NULL;
    char err[256] = "";

    store_close(f->st);
    f->st = NULL;
    f->clock.epoch = "";
    f->store_clock.lease_now_ms = fake_lease_now;
    f->store_clock.lease_epoch = fake_epoch;
    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    opt.clock = &f->store_clock;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_EINVAL);
    assert_null(st);
    assert_non_null(strstr(err, "boot_id"));
}

static void test_same_key_two_scopes_two_records(void **state)
{
    struct fixture *f = *state;
    uint8_t k1[STORE_KEY_BYTES];
    uint8_t k2[STORE_KEY_BYTES];
    uint8_t fp1[STORE_FINGERPRINT_BYTES];
    uint8_t fp2[STORE_FINGERPRINT_BYTES];
    struct store_op a;
    struct store_op b;

    store_key_derive("payments", 8, "key-1", 5, k1);
    store_key_derive("refunds", 7, "key-1", 5, k2);
    fp_of('a', fp1);
    fp_of('b', fp2); /* a mismatch if they were one record */
    assert_int_equal(store_acquire(f->st, k1, fp1, 1000, 60000, &a), 0);
    assert_int_equal(a.outcome, STORE_ACQUIRED);
    assert_int_equal(store_acquire(f->st, k2, fp2, 1000, 60000, &b), 0);
    assert_int_equal(b.outcome, STORE_ACQUIRED);
    assert_int_equal(records_in(f->st), 2);
}

static void prep(struct store_op *op, enum store_op_kind kind, const char *name, uint8_t fpc)
{
    memset(op, 0, sizeof(*op));
    op->kind = kind;
    key_of(name, op->key);
    fp_of(fpc, op->fingerprint);
    op->lease_ms = 1000;
    op->ttl_ms = 60000;
    op->status = 200;
}

static int cmp_lease(const void *a, const void *b)
{
    return memcmp(a, b, STORE_LEASE_ID_BYTES);
}

/* Lease ids come from a buffer of random bytes refilled 4 KiB (256 ids) at
 * a time: across several refills, in batches and one by one, every id is
 * new, and none is all zeros (an unfilled buffer). */
#define LEASE_KEYS 1000

static void test_lease_ids_unique_across_refills(void **state)
{
    struct fixture *f = *state;
    static uint8_t ids[LEASE_KEYS][STORE_LEASE_ID_BYTES];
    static const uint8_t zero[STORE_LEASE_ID_BYTES];
    struct store_op ops[100];
    int n = 0;

    while (n < LEASE_KEYS) {
        size_t batch = n < LEASE_KEYS / 2 ? 1 : 100;
        for (size_t i = 0; i < batch; i++) {
            char name[32];
            snprintf(name, sizeof(name), "lease-%d", n + (int)i);
            prep(&ops[i], STORE_OP_ACQUIRE, name, 'a');
        }
        assert_int_equal(store_apply(f->st, ops, batch), 0);
        for (size_t i = 0; i < batch; i++) {
            assert_int_equal(ops[i].outcome, STORE_ACQUIRED);
            assert_memory_not_equal(ops[i].lease_id, zero, STORE_LEASE_ID_BYTES);
            memcpy(ids[n++], ops[i].lease_id, STORE_LEASE_ID_BYTES);
        }
    }
    qsort(ids, LEASE_KEYS, STORE_LEASE_ID_BYTES, cmp_lease);
    for (int i = 1; i < LEASE_KEYS; i++) {
        assert_memory_not_equal(ids[i - 1], ids[i], STORE_LEASE_ID_BYTES);
    }
}

static void test_group_apply_one_txn_in_order(void **state)
{
    enum { N = 50 };
    struct fixture *f = *state;
    struct store_op ops[N];
    struct store_op g[8];
    struct store_stats s0;
    struct store_stats s1;
    uint8_t lease0[STORE_LEASE_ID_BYTES];
    uint8_t lease1[STORE_LEASE_ID_BYTES];
    uint8_t lease2[STORE_LEASE_ID_BYTES];

    assert_int_equal(store_stats(f->st, &s0), 0);
    for (int i = 0; i < N; i++) {
        char name[16];
        snprintf(name, sizeof(name), "k%d", i);
        prep(&ops[i], STORE_OP_ACQUIRE, name, 'a');
    }
    assert_int_equal(store_apply(f->st, ops, N), 0);
    assert_int_equal(store_stats(f->st, &s1), 0);
    /* Acquires: one commit of the records in flight, none of the records. */
    assert_int_equal(s1.inflight_commits - s0.inflight_commits, 1);
    assert_int_equal(s1.inflight_ops_committed - s0.inflight_ops_committed, N);
    assert_int_equal(s1.commits - s0.commits, 0);
    assert_int_equal(s1.records, N);
    for (int i = 0; i < N; i++) {
        assert_int_equal(ops[i].outcome, STORE_ACQUIRED);
    }
    memcpy(lease0, ops[0].lease_id, sizeof(lease0));
    memcpy(lease1, ops[1].lease_id, sizeof(lease1));
    memcpy(lease2, ops[2].lease_id, sizeof(lease2));

    /* Later ops see earlier ones, in the same transaction. */
    prep(&g[0], STORE_OP_COMPLETE, "k0", 'a');
    memcpy(g[0].lease_id, lease0, sizeof(lease0));
    g[0].body.ptr = "zero";
    g[0].body.len = 4;
    prep(&g[1], STORE_OP_ACQUIRE, "k0", 'a'); /* sees the completion */
    g[1].want_replay = true;
    prep(&g[2], STORE_OP_RELEASE, "k1", 'a');
    memcpy(g[2].lease_id, lease1, sizeof(lease1));
    prep(&g[3], STORE_OP_ACQUIRE, "k1", 'b'); /* sees the release */
    prep(&g[4], STORE_OP_EXTEND, "k2", 'a');
    memcpy(g[4].lease_id, lease2, sizeof(lease2));
    g[4].lease_ms = 7000;
    prep(&g[5], STORE_OP_ACQUIRE, "k3", 'b');
    prep(&g[6], STORE_OP_ACQUIRE, "new", 'a');
    prep(&g[7], STORE_OP_ACQUIRE, "new", 'a'); /* sees g[6] */
    assert_int_equal(store_apply(f->st, g, 8), 0);
    assert_int_equal(store_stats(f->st, &s0), 0);
    /* A batch of both environments' ops with a key in both (k0: a
     * complete, then an acquire that sees it) runs as runs of one
     * environment's ops in the order given: the complete (one commit of the
     * records), then the rest (one commit of the records in flight, which
     * also deletes the complete's entry there). */
    assert_int_equal(s0.commits - s1.commits, 1);
    assert_int_equal(s0.ops_committed - s1.ops_committed, 1);
    assert_int_equal(s0.inflight_commits - s1.inflight_commits, 1);
    assert_int_equal(s0.inflight_ops_committed - s1.inflight_ops_committed, 7);

    assert_int_equal(g[0].outcome, STORE_DONE);
    assert_int_equal(g[1].outcome, STORE_REPLAY);
    assert_int_equal(g[1].replay.body_len, 4);
    assert_memory_equal(g[1].replay.body, "zero", 4);
    store_record_clear(&g[1].replay);
    assert_int_equal(g[2].outcome, STORE_DONE);
    assert_int_equal(g[3].outcome, STORE_ACQUIRED);
    assert_false(g[3].stolen);
    assert_int_equal(g[4].outcome, STORE_DONE);
    assert_int_equal(g[4].lease_expires_ms, T0 + 7000);
    assert_int_equal(g[5].outcome, STORE_MISMATCH);
    assert_int_equal(g[6].outcome, STORE_ACQUIRED);
    assert_int_equal(g[7].outcome, STORE_BUSY);
    assert_int_equal(g[7].lease_expires_ms, g[6].lease_expires_ms);
}

static void test_apply_rejects_bad_ops_untouched(void **state)
{
    struct fixture *f = *state;
    struct store_op g[2];

    prep(&g[0], STORE_OP_ACQUIRE, "k", 'a');
    g[0].outcome = STORE_FULL; /* sentinels */
    prep(&g[1], STORE_OP_ACQUIRE, "j", 'a');
    g[1].ttl_ms = 0;
    assert_int_equal(store_apply(f->st, g, 2), STORE_EINVAL);
    assert_int_equal(g[0].outcome, STORE_FULL);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);

    g[1].ttl_ms = 1000;
    g[1].kind = 99;
    assert_int_equal(store_apply(f->st, g, 2), STORE_EINVAL);
    prep(&g[1], STORE_OP_COMPLETE, "j", 'a');
    g[1].status = 600;
    assert_int_equal(store_apply(f->st, g, 2), STORE_EINVAL);
    g[1].status = 200;
    g[1].body.len = 3; /* ptr NULL */
    assert_int_equal(store_apply(f->st, g, 2), STORE_EINVAL);
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);
    assert_int_equal(records_in(f->st), 0);
    assert_int_equal(store_apply(f->st, NULL, 0), 0);
}

/* ---- persistence and sharing -------------------------------------------- */

static void test_records_survive_reopen(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op b;
    struct store_record rec;

    assert_int_equal(acquire(f->st, "done", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "done", a.lease_id, 60000, "kept"), STORE_DONE);
    assert_int_equal(acquire(f->st, "held", 'a', 1000, 60000, &b), STORE_ACQUIRED);
    store_close(f->st);
    f->st = NULL;
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);

    get(f->st, "done", &rec);
    assert_int_equal(rec.state, STORE_STATE_COMPLETE);
    assert_int_equal(rec.status, 201);
    assert_body(&rec, "kept");
    store_record_clear(&rec);
    /* The lease survives too: its holder can still complete. */
    assert_int_equal(complete(f->st, "held", b.lease_id, 60000, "after"), STORE_DONE);
}

static void test_second_open_in_process_refused(void **state)
{
    struct fixture *f = *state;
    struct store *st2 = NULL;
    struct store_options opt;
    char err[256];

    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    assert_int_equal(store_open(NULL, &opt, &st2, err, sizeof(err)), STORE_EINVAL);
    assert_null(st2);
    assert_non_null(strstr(err, "already open"));
    /* The first handle is unharmed. */
    assert_int_equal(state_of(f->st, "k"), STORE_STATE_ABSENT);
}

/* The child side of the two-process test. It reports through its exit
 * status and uses no cmocka assert: a failed one would unwind into the
 * child's copy of the test runner. */
static int child_side(struct fixture *f, int to_parent, int from_parent)
{
    struct store *st = NULL;
    struct store_record rec;
    struct store_op op;
    uint8_t key[STORE_KEY_BYTES];
    uint8_t fp[STORE_FINGERPRINT_BYTES];
    char c = 0;
    int code = 0;

    memset(&rec, 0, sizeof(rec));
    memset(&op, 0, sizeof(op));
    if (open_at(f, f->path, 0, &st) != 0) {
        code = 10;
        goto out;
    }
    key_of("parent", key);
    if (store_get(st, key, &rec) != 0 || rec.state != STORE_STATE_COMPLETE || rec.body_len != 4 ||
        memcmp(rec.body, "from", 4) != 0) {
        code = 11;
        goto out;
    }
    fp_of('a', fp);
    if (store_acquire(st, key, fp, 1000, 60000, &op) != 0 || op.outcome != STORE_REPLAY) {
        code = 12;
        goto out;
    }
    key_of("child", key);
    fp_of('c', fp);
    if (store_acquire(st, key, fp, 60000, 60000, &op) != 0 || op.outcome != STORE_ACQUIRED) {
        code = 13;
        goto out;
    }
    /* Tell the parent, then wait for its write made after we opened. */
    if (write(to_parent, "x", 1) != 1 || read(from_parent, &c, 1) != 1) {
        code = 14;
        goto out;
    }
    store_record_clear(&rec);
    key_of("later", key);
    if (store_get(st, key, &rec) != 0 || rec.state != STORE_STATE_IN_PROGRESS) {
        code = 15;
    }
out:
    store_record_clear(&rec);
    store_record_clear(&op.replay);
    store_close(st);
    return code;
}

static void test_two_processes_share_store(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op o;
    int up[2];
    int down[2];
    char c = 0;
    int status = 0;
    pid_t pid;

    assert_int_equal(acquire(f->st, "parent", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "parent", a.lease_id, 60000, "from"), STORE_DONE);
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* The parent's handle is never used here (no env across fork). The
         * unused pipe ends are closed so that a parent that fails its
         * asserts and exits gives the child EOF instead of a hang. */
        close(up[0]);
        close(down[1]);
        _exit(child_side(f, up[1], down[0]));
    }
    close(up[1]);
    close(down[0]);
    assert_int_equal(read(up[0], &c, 1), 1);
    /* The child holds "child" now; our open handle sees it. */
    assert_int_equal(acquire(f->st, "child", 'c', 1000, 60000, &o), STORE_BUSY);
    assert_int_equal(o.lease_expires_ms, T0 + 60000);
    assert_int_equal(acquire(f->st, "later", 'a', 1000, 60000, &o), STORE_ACQUIRED);
    assert_int_equal(write(down[1], "x", 1), 1);
    close(up[0]);
    close(down[1]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

static void test_reader_check_clears_dead_reader(void **state)
{
    struct fixture *f = *state;
    int status = 0;
    int cleared = -1;
    pid_t pid;

    assert_int_equal(store_reader_check(f->st, &cleared), 0);
    assert_int_equal(cleared, 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct store *st = NULL;
        struct store_record rec;
        int code = 1;
        /* A read leaves a pooled transaction holding a reader slot; exiting
         * without store_close() leaves the slot to a dead pid. */
        if (open_at(f, f->path, 0, &st) == 0 && store_get(st, (uint8_t[32]){0}, &rec) == 0) {
            code = 0;
        }
        _exit(code);
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* One slot in each environment (the read looked at both). */
    assert_int_equal(store_reader_check(f->st, &cleared), 0);
    assert_int_equal(cleared, 2);
}

static void test_open_creates_directories(void **state)
{
    struct fixture *f = *state;
    struct store *st = NULL;
    struct store_options opt;
    char nested[256];
    char file[256];
    char err[256];
    struct stat sb;
    int fd;

    snprintf(nested, sizeof(nested), "%s/a/b/c", f->dir);
    assert_int_equal(open_at(f, nested, 0, &st), 0);
    assert_int_equal(stat(nested, &sb), 0);
    assert_true(S_ISDIR(sb.st_mode));
    assert_int_equal(sb.st_mode & 077, 0); /* nobody else's business */
    store_close(st);

    snprintf(file, sizeof(file), "%s/plain", f->dir);
    fd = open(file, O_CREAT | O_WRONLY, 0600);
    assert_true(fd >= 0);
    close(fd);
    memset(&opt, 0, sizeof(opt));
    opt.path = file;
    err[0] = '\0';
    st = NULL;
    assert_true(store_open(NULL, &opt, &st, err, sizeof(err)) < 0);
    assert_null(st);
    assert_true(strlen(err) > 0);

    opt.path = NULL;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), STORE_EINVAL);
}

static void test_stats_scan_sync(void **state)
{
    struct fixture *f = *state;
    struct store_stats s;
    struct store_op a;
    int n = 0;

    fill_completed(f->st, "r", 10, 60000);
    assert_int_equal(acquire(f->st, "held", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(store_stats(f->st, &s), 0);
    assert_int_equal(s.records, 11);
    /* The completes in the records environment; the acquires in that of
     * the records in flight, the second one also deleting the entries the
     * completes left there. */
    assert_int_equal(s.commits, 1);
    assert_int_equal(s.ops_committed, 10);
    assert_true(s.has_inflight);
    assert_int_equal(s.inflight_commits, 2);
    assert_int_equal(s.inflight_ops_committed, 11);
    assert_int_equal(s.inflight_records, 1);
    assert_int_equal(s.map_size_bytes, (uint64_t)1 << 30);
    assert_true(s.map_used_bytes > 0 && s.map_used_bytes < s.map_size_bytes);
    assert_int_equal(store_scan(f->st, count_records, &n), 0);
    assert_int_equal(n, 11);
    assert_int_equal(store_sync(f->st), 0);
}

static int stop_at_first(const uint8_t key[STORE_KEY_BYTES], const struct store_record *rec,
                         void *ctx)
{
    (void)key;
    (void)rec;
    (*(int *)ctx)++;
    return 1;
}

static void test_scan_stops_when_asked(void **state)
{
    struct fixture *f = *state;
    int n = 0;

    fill_completed(f->st, "r", 3, 60000);
    assert_int_equal(store_scan(f->st, stop_at_first, &n), 0);
    assert_int_equal(n, 1);
}

struct order_ctx {
    int n, in_progress, descending, repeats;
    uint8_t prev[STORE_KEY_BYTES];
};

static int note_order(const uint8_t key[STORE_KEY_BYTES], const struct store_record *rec, void *ctx)
{
    struct order_ctx *o = ctx;
    if (o->n > 0) {
        int c = memcmp(key, o->prev, STORE_KEY_BYTES);
        o->descending += c < 0;
        o->repeats += c == 0;
    }
    memcpy(o->prev, key, STORE_KEY_BYTES);
    o->n++;
    o->in_progress += rec->state == STORE_STATE_IN_PROGRESS;
    return 0;
}

/* The scan merges records and inflight into one key order, so a key stored
 * in both (never written by the store; check-store reports it) is visited
 * twice in a row. */
static void test_scan_merges_both_tables_in_key_order(void **state)
{
    struct fixture *f = *state;
    struct order_ctx o = {0};
    struct store_op a;
    char name[8];
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi records;
    MDB_dbi inflight;
    uint8_t key[STORE_KEY_BYTES];
    MDB_val k = {sizeof(key), key};
    MDB_val v;

    fill_completed(f->st, "r", 20, 60000);
    for (int i = 0; i < 20; i++) {
        snprintf(name, sizeof(name), "p%d", i);
        assert_int_equal(acquire(f->st, name, 'a', 1000, 60000, &a), STORE_ACQUIRED);
    }
    assert_int_equal(store_scan(f->st, note_order, &o), 0);
    assert_int_equal(o.n, 40);
    assert_int_equal(o.in_progress, 20);
    assert_int_equal(o.descending, 0);
    assert_int_equal(o.repeats, 0);

    /* A COMPLETE record copied into inflight behind the store's back. */
    store_close(f->st);
    f->st = NULL;
    key_of("r3", key);
    txn = raw_begin(f->path, false, &env);
    assert_int_equal(mdb_dbi_open(txn, "records", 0, &records), 0);
    assert_int_equal(mdb_dbi_open(txn, "inflight", 0, &inflight), 0);
    assert_int_equal(mdb_get(txn, records, &k, &v), 0);
    assert_int_equal(mdb_put(txn, inflight, &k, &v, 0), 0);
    raw_end(env, txn, false);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
    memset(&o, 0, sizeof(o));
    assert_int_equal(store_scan(f->st, note_order, &o), 0);
    assert_int_equal(o.n, 41);
    assert_int_equal(o.descending, 0);
    assert_int_equal(o.repeats, 1);
}

/* ---- corruption ---------------------------------------------------------- */

/* Overwrites a record's stored value behind the store's back. */
static void corrupt_record(const char *path, const char *name)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    uint8_t key[STORE_KEY_BYTES];
    MDB_val k = {sizeof(key), key};
    MDB_val v = {5, "\x01\x07junk"};

    key_of(name, key);
    txn = raw_begin(path, false, &env);
    assert_int_equal(mdb_dbi_open(txn, "records", 0, &dbi), 0);
    assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    raw_end(env, txn, false);
}

struct bad_ctx {
    int good, bad;
    uint8_t bad_keys[4][STORE_KEY_BYTES];
};

static int count_good(const uint8_t key[STORE_KEY_BYTES], const struct store_record *rec, void *ctx)
{
    (void)key;
    (void)rec;
    ((struct bad_ctx *)ctx)->good++;
    return 0;
}

static void count_bad(const uint8_t *key, size_t key_len, const char *table, size_t value_len,
                      const char *detail, void *ctx)
{
    struct bad_ctx *b = ctx;

    assert_int_equal(key_len, STORE_KEY_BYTES);
    assert_string_equal(table, "records");
    assert_int_equal(value_len, 5);
    assert_non_null(detail);
    if (b->bad < 4) {
        memcpy(b->bad_keys[b->bad], key, STORE_KEY_BYTES);
    }
    b->bad++;
}

/* store_scan() stops at the first record that does not decode; a check
 * tool needs them all: store_scan_all() counts every one and goes on. */
static void test_scan_all_goes_past_corrupt_records(void **state)
{
    struct fixture *f = *state;
    struct bad_ctx b = {0};
    uint8_t k1[STORE_KEY_BYTES], k3[STORE_KEY_BYTES];
    int n = 0;

    fill_completed(f->st, "r", 6, 60000);
    store_close(f->st);
    f->st = NULL;
    corrupt_record(f->path, "r1");
    corrupt_record(f->path, "r3");
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);

    assert_int_equal(store_scan(f->st, count_records, &n), STORE_ECORRUPT);
    assert_int_equal(store_scan_all(f->st, count_good, count_bad, &b), 0);
    assert_int_equal(b.good, 4);
    assert_int_equal(b.bad, 2);
    key_of("r1", k1);
    key_of("r3", k3);
    assert_true((memcmp(b.bad_keys[0], k1, STORE_KEY_BYTES) == 0 &&
                 memcmp(b.bad_keys[1], k3, STORE_KEY_BYTES) == 0) ||
                (memcmp(b.bad_keys[0], k3, STORE_KEY_BYTES) == 0 &&
                 memcmp(b.bad_keys[1], k1, STORE_KEY_BYTES) == 0));
    assert_int_equal(store_scan_all(f->st, count_good, NULL, &b), STORE_EINVAL);
}

static void test_corrupt_record_reported_then_purged(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_op g[2];
    struct store_record rec;
    uint8_t key[STORE_KEY_BYTES];
    size_t purged = 0;
    bool more = false;

    assert_int_equal(acquire(f->st, "bad", 'a', 1000, 5000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "bad", a.lease_id, 5000, "x"), STORE_DONE);
    store_close(f->st);
    f->st = NULL;
    corrupt_record(f->path, "bad");
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);

    key_of("bad", key);
    assert_int_equal(store_get(f->st, key, &rec), STORE_ECORRUPT);
    assert_null(rec.body);

    /* A batch touching it fails as a whole and leaves the ops alone. */
    prep(&g[0], STORE_OP_ACQUIRE, "good", 'a');
    g[0].outcome = STORE_FULL; /* sentinel */
    prep(&g[1], STORE_OP_ACQUIRE, "bad", 'a');
    assert_int_equal(store_apply(f->st, g, 2), STORE_ECORRUPT);
    assert_int_equal(g[0].outcome, STORE_FULL);
    assert_int_equal(state_of(f->st, "good"), STORE_STATE_ABSENT);

    /* When its index entry comes due, purge drops it. */
    assert_int_equal(store_purge(f->st, 10, &purged, &more), 0);
    assert_int_equal(purged, 0);
    advance(f, 5000);
    assert_int_equal(store_purge(f->st, 10, &purged, &more), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(state_of(f->st, "bad"), STORE_STATE_ABSENT);
    assert_int_equal(acquire(f->st, "bad", 'a', 1000, 5000, &a), STORE_ACQUIRED);
}

/* A key-order pass (the purge of a large backlog) walks `records` and
 * deletes what is due. A record that does not decode is not its to judge:
 * it might hide a COMPLETE result whose TTL has not elapsed, so it stays
 * until its own index entry is due. */
static void test_key_order_pass_keeps_a_damaged_record(void **state)
{
    struct fixture *f = *state;
    struct store_record rec;
    struct store_stats stats;
    struct store_op a;
    uint8_t key[STORE_KEY_BYTES];
    size_t purged = 0, calls = 0;
    bool more = true;

    fill_completed(f->st, "old", 24000, 1000);
    fill_completed(f->st, "live", 2000, 3600000);
    store_close(f->st);
    f->st = NULL;
    corrupt_record(f->path, "live5");
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
    key_of("live5", key);
    advance(f, 1000);
    while (more) {
        assert_int_equal(store_purge(f->st, 64, &purged, &more), 0);
        assert_true(++calls < 5000);
    }
    assert_int_equal(store_stats(f->st, &stats), 0);
    assert_true(stats.purge_sweeps >= 1); /* the pass ran */
    assert_int_equal(stats.records, 2000); /* every old record gone, every live one kept */
    assert_int_equal(store_get(f->st, key, &rec), STORE_ECORRUPT);
    assert_int_equal(store_acquire(f->st, key, (uint8_t[32]){0}, 1000, 5000, &a), STORE_ECORRUPT);
    /* Its own entry, an hour on, purges it. */
    advance(f, 3600000);
    more = true;
    while (more) {
        assert_int_equal(store_purge(f->st, 4096, &purged, &more), 0);
        assert_true(++calls < 10000);
    }
    assert_int_equal(state_of(f->st, "live5"), STORE_STATE_ABSENT);
}

/* A due index entry whose time is not the damaged record's own (a key-order
 * pass leaves the entries of the records it deleted; the key may have been
 * used again since) drops the entry only. The record's header still gives
 * its expiry, which decides. */
static void test_stale_entry_keeps_a_damaged_record(void **state)
{
    struct fixture *f = *state;
    struct store_record rec;
    struct store_op a;
    uint8_t key[STORE_KEY_BYTES];
    uint8_t ik[8 + STORE_KEY_BYTES];
    uint8_t cut[100];
    MDB_env *env = NULL;
    MDB_txn *txn;
    MDB_dbi records, expiry;
    MDB_val k = {STORE_KEY_BYTES, key}, v, ikv = {sizeof(ik), ik}, empty = {0, ""};
    uint64_t stale = (uint64_t)(atomic_load(&f->clock.now) + 1000) ^ ((uint64_t)1 << 63);
    size_t purged = 0;
    bool more = false;

    assert_int_equal(acquire(f->st, "again", 'a', 1000, 3600000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "again", a.lease_id, 3600000, "charge-1"), STORE_DONE);
    store_close(f->st);
    f->st = NULL;
    key_of("again", key);
    txn = raw_begin(f->path, false, &env);
    assert_int_equal(mdb_dbi_open(txn, "records", 0, &records), 0);
    assert_int_equal(mdb_dbi_open(txn, "expiry", 0, &expiry), 0);
    assert_int_equal(mdb_get(txn, records, &k, &v), 0);
    assert_true(v.mv_size > sizeof(cut));
    memcpy(cut, v.mv_data, sizeof(cut)); /* the header whole, the rest cut off */
    v.mv_data = cut;
    v.mv_size = sizeof(cut);
    assert_int_equal(mdb_put(txn, records, &k, &v, 0), 0);
    for (size_t i = 0; i < 8; i++)
        ik[i] = (uint8_t)(stale >> (56 - 8 * i));
    memcpy(ik + 8, key, STORE_KEY_BYTES);
    assert_int_equal(mdb_put(txn, expiry, &ikv, &empty, 0), 0);
    raw_end(env, txn, false);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);

    advance(f, 2000);
    assert_int_equal(store_purge(f->st, 10, &purged, &more), 0);
    assert_int_equal(purged, 0);
    assert_int_equal(store_get(f->st, key, &rec), STORE_ECORRUPT);
    advance(f, 3600000);
    assert_int_equal(store_purge(f->st, 10, &purged, &more), 0);
    assert_int_equal(purged, 1);
    assert_int_equal(state_of(f->st, "again"), STORE_STATE_ABSENT);
}

/* TTLs are added saturating, on any clock: a negative one too (the index
 * sorts negative times first). */
static void test_ttl_on_a_negative_clock(void **state)
{
    struct fixture *f = *state;
    struct store_op a;
    struct store_record rec;
    uint8_t key[STORE_KEY_BYTES];

    set_now(f, -5);
    assert_int_equal(acquire(f->st, "neg", 'a', 1000, INT64_MAX, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "neg", a.lease_id, INT64_MAX, "x"), STORE_DONE);
    key_of("neg", key);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    assert_int_equal(rec.expires_ms, INT64_MAX - 5);
    store_record_clear(&rec);
}

static size_t index_entries(const char *path);

/* forget (idemproxy forget-key): an operator's delete, outside the edges.
 * A record goes with its index entry whatever its state, except a live
 * IN_PROGRESS one, which needs force: its holder may still complete. */
static void test_forget(void **state)
{
    struct fixture *f = *state;
    struct store_op a, live, held, gone, h;
    uint8_t key[STORE_KEY_BYTES];
    enum store_outcome o = 0;

    assert_int_equal(acquire(f->st, "done", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "done", a.lease_id, 60000, "charge-1"), STORE_DONE);
    assert_int_equal(acquire(f->st, "live", 'a', 5000, 60000, &live), STORE_ACQUIRED);
    assert_int_equal(acquire(f->st, "held", 'a', 5000, 60000, &held), STORE_ACQUIRED);
    prep(&h, STORE_OP_EXTEND, "held", 'a');
    memcpy(h.lease_id, held.lease_id, STORE_LEASE_ID_BYTES);
    h.hold = true;
    assert_int_equal(store_apply(f->st, &h, 1), 0);
    assert_int_equal(acquire(f->st, "gone", 'a', 1000, 60000, &gone), STORE_ACQUIRED);
    advance(f, 2000); /* gone's lease has ended: stealable */

    key_of("done", key);
    assert_int_equal(store_forget(f->st, key, false, &o), 0);
    assert_int_equal(o, STORE_DONE);
    assert_int_equal(state_of(f->st, "done"), STORE_STATE_ABSENT);
    assert_int_equal(store_forget(f->st, key, false, &o), 0);
    assert_int_equal(o, STORE_NOT_FOUND);
    /* As if never used: a new acquire takes it. */
    assert_int_equal(acquire(f->st, "done", 'b', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(store_forget(f->st, key, true, &o), 0);

    key_of("held", key); /* held: nobody's to complete, so no force needed */
    assert_int_equal(store_forget(f->st, key, false, &o), 0);
    assert_int_equal(o, STORE_DONE);
    key_of("gone", key);
    assert_int_equal(store_forget(f->st, key, false, &o), 0);
    assert_int_equal(o, STORE_DONE);

    key_of("live", key);
    assert_int_equal(store_forget(f->st, key, false, &o), 0);
    assert_int_equal(o, STORE_BUSY);
    assert_int_equal(state_of(f->st, "live"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(store_forget(f->st, key, true, &o), 0);
    assert_int_equal(o, STORE_DONE);
    /* Its holder is fenced out. */
    assert_int_equal(complete(f->st, "live", live.lease_id, 60000, "late"), STORE_FENCED);
    assert_int_equal(state_of(f->st, "live"), STORE_STATE_ABSENT);

    /* A damaged record goes too. */
    assert_int_equal(acquire(f->st, "bad", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(f->st, "bad", a.lease_id, 60000, "x"), STORE_DONE);
    store_close(f->st);
    f->st = NULL;
    corrupt_record(f->path, "bad");
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
    key_of("bad", key);
    assert_int_equal(store_forget(f->st, key, false, &o), 0);
    assert_int_equal(o, STORE_DONE);
    assert_int_equal(state_of(f->st, "bad"), STORE_STATE_ABSENT);
    store_close(f->st);
    f->st = NULL;
    /* Nothing left in the index but bad's, whose time the damage hid
     * (purge drops it as stale). */
    assert_int_equal(index_entries(f->path), 1);
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
}

/* ---- store full ---------------------------------------------------------- */

static void test_store_full_then_purge_on_full(void **state)
{
    struct fixture *f = *state;
    struct store *st = NULL;
    char path[256];
    static uint8_t big[16384];
    uint8_t *huge = calloc(1, 2u << 20);
    struct store_op g[3];
    struct store_op x;
    struct store_op o;
    struct store_op held;
    struct store_stats s;
    enum store_outcome out = 0;
    uint8_t key[STORE_KEY_BYTES];
    int i;
    bool full = false;
    uint64_t before;

    assert_non_null(huge);
    snprintf(path, sizeof(path), "%s/tiny", f->dir);
    assert_int_equal(open_at(f, path, 1u << 20, &st), 0);

    /* One op that can never fit is refused alone; the others apply. */
    assert_int_equal(acquire(st, "x", 'a', 1000, 1000, &x), STORE_ACQUIRED);
    prep(&g[0], STORE_OP_ACQUIRE, "a", 'a');
    prep(&g[1], STORE_OP_COMPLETE, "x", 'a');
    memcpy(g[1].lease_id, x.lease_id, STORE_LEASE_ID_BYTES);
    g[1].body.ptr = huge;
    g[1].body.len = 2u << 20;
    prep(&g[2], STORE_OP_ACQUIRE, "b", 'a');
    assert_int_equal(store_apply(st, g, 3), 0);
    assert_int_equal(g[0].outcome, STORE_ACQUIRED);
    assert_int_equal(g[1].outcome, STORE_FULL);
    assert_int_equal(g[2].outcome, STORE_ACQUIRED);
    assert_int_equal(state_of(st, "x"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(state_of(st, "a"), STORE_STATE_IN_PROGRESS);

    /* A request in flight while the store fills up. */
    assert_int_equal(acquire(st, "held", 'a', 1000000, 1000000, &held), STORE_ACQUIRED);

    /* Fill with live records until even a small acquire does not fit. */
    memset(big, 0xab, sizeof(big));
    for (i = 0; i < 200000 && !full; i++) {
        char name[32];
        snprintf(name, sizeof(name), "fill%d", i);
        acquire(st, name, 'a', 500, 1000, &o);
        if (o.outcome == STORE_FULL) {
            assert_int_equal(state_of(st, name), STORE_STATE_ABSENT); /* not applied */
            full = true;
        } else {
            assert_int_equal(o.outcome, STORE_ACQUIRED);
            key_of(name, key);
            /* Big bodies while they fit, then only small records. */
            assert_int_equal(store_complete(st, key, o.lease_id, 1000, 200,
                                            (struct store_span){NULL, 0},
                                            (struct store_span){big, sizeof(big)}, &out),
                             0);
            assert_true(out == STORE_DONE || out == STORE_FULL);
        }
    }
    assert_true(full);
    before = records_in(st);
    assert_true(before > 10);

    /* Everything there is live: still full. */
    assert_int_equal(acquire(st, "more", 'a', 500, 1000, &o), STORE_FULL);
    /* New keys are refused while there is still room to store the answer
     * of a request already running: the store fails closed for new work
     * before it fails the work it admitted. */
    key_of("held", key);
    assert_int_equal(store_complete(st, key, held.lease_id, 1000000, 200,
                                    (struct store_span){NULL, 0}, (struct store_span){big, 8192},
                                    &out),
                     0);
    assert_int_equal(out, STORE_DONE);

    /* Once their TTL is past, a purge makes room: the records' writer's
     * (store_purge(); since layout 4 an acquire, in the writer of the
     * records in flight, refuses rather than purge, which would take the
     * records' writer lock; proxy/writer.c then asks the records' lane). */
    advance(f, 2000);
    {
        bool more = true;
        size_t purged = 0;
        while (more) {
            assert_int_equal(store_purge(st, 512, &purged, &more), 0);
        }
    }
    assert_int_equal(acquire(st, "more", 'a', 500, 1000, &o), STORE_ACQUIRED);
    assert_int_equal(store_stats(st, &s), 0);
    assert_true(s.records < before);
    assert_int_equal(s.map_size_bytes, 1u << 20);
    store_close(st);
    free(huge);
}

/* Fills a fresh 1 MiB store at dir/tiny with requests in flight, then with
 * their answers, as large as fit, until answers are refused too. Every
 * record expires 1 s later and every lease 5 s later, or with mixed, only
 * every other one (the others live for days). */
static struct store *open_full_of_answers(struct fixture *f, bool mixed)
{
    enum { MAX_KEYS = 100000 };
    struct store *st = NULL;
    char path[256];
    static uint8_t body[16384];
    struct store_op *held = calloc(MAX_KEYS, sizeof(*held));
    struct store_op o;
    int n = 0;
    int refused = 0;

    assert_non_null(held);
    snprintf(path, sizeof(path), "%s/tiny", f->dir);
    assert_int_equal(open_at(f, path, 1u << 20, &st), 0);
    for (n = 0; n < MAX_KEYS; n++) {
        char name[32];
        snprintf(name, sizeof(name), "k%d", n);
        int64_t ttl_ms = mixed && n % 2 == 1 ? 1000000000 : 1000;
        if (acquire(st, name, 'a', 5000, ttl_ms, &held[n]) != STORE_ACQUIRED) {
            assert_int_equal(held[n].outcome, STORE_FULL);
            break;
        }
    }
    assert_true(n > 100 && n < MAX_KEYS);
    for (int i = 0; i < n; i++) {
        enum store_outcome out = 0;
        int64_t ttl_ms = mixed && i % 2 == 1 ? 1000000000 : 1000;
        for (size_t len = sizeof(body); len > 0; len /= 2) {
            assert_int_equal(store_complete(st, held[i].key, held[i].lease_id, ttl_ms, 200,
                                            (struct store_span){NULL, 0},
                                            (struct store_span){body, len}, &out),
                             0);
            if (out == STORE_DONE) {
                break;
            }
            assert_int_equal(out, STORE_FULL);
        }
        refused += out == STORE_FULL;
    }
    assert_true(refused > 0); /* the answers did fill the store */
    assert_int_equal(acquire(st, "new", 'a', 1000, 1000, &o), STORE_FULL);
    free(held);
    return st;
}

/* Completions may use the headroom acquires leave, but not the last reserve:
 * LMDB copies pages even to delete, so a map full to the last page could
 * never be purged again. */
static void test_store_full_of_answers_still_purges(void **state)
{
    struct fixture *f = *state;
    struct store *st = open_full_of_answers(f, false);
    struct store_op o;

    /* Everything expires (TTLs and leases): a purge of the full store must
     * still run (the records' writer's, asked when an acquire finds the
     * store full). */
    advance(f, 10000);
    assert_int_equal(acquire(st, "new", 'a', 1000, 1000, &o), STORE_FULL);
    {
        bool more = true;
        size_t purged = 0;
        size_t total = 0;
        while (more) {
            assert_int_equal(store_purge(st, 512, &purged, &more), 0);
            total += purged;
        }
        assert_true(total > 100);
    }
    assert_int_equal(acquire(st, "new", 'a', 1000, 1000, &o), STORE_ACQUIRED);
    store_close(st);
}

/* Deleting copies pages too: a purge that thins out every leaf of a full
 * map cannot copy them all in one transaction, so purge takes smaller
 * batches instead of failing. */
static void test_purge_shrinks_its_batch_when_full(void **state)
{
    struct fixture *f = *state;
    struct store *st = open_full_of_answers(f, true);
    uint64_t before = records_in(st);
    uint64_t total = 0;
    size_t purged = 0;
    bool more = true;

    advance(f, 10000);
    for (int calls = 0; more && calls < 1000; calls++) {
        assert_int_equal(store_purge(st, 1000000, &purged, &more), 0);
        total += purged;
    }
    assert_false(more);
    assert_int_equal(total, before / 2 + before % 2); /* the even keys */
    assert_int_equal(records_in(st), before / 2);
    store_close(st);
}

/* The writer purges a backlog in small chunks (its idle chunk starts at 32)
 * and stops when the store says nothing more is due: in a full map, where a
 * purge has few free pages to copy into, chunk after chunk must still drain
 * every expired record, reporting "more" until then. */
static void test_small_purges_in_a_full_map_report_more(void **state)
{
    struct fixture *f = *state;
    struct store *st = open_full_of_answers(f, false);
    uint64_t before = records_in(st);
    uint64_t total = 0;
    size_t purged = 0;
    bool more = true;
    int calls = 0;

    advance(f, 10000);
    for (; more && calls < 100000; calls++) {
        int rc = store_purge(st, 32, &purged, &more);
        if (rc != 0) {
            break;
        }
        total += purged;
    }
    assert_false(more);
    assert_int_equal(total, before); /* every record expired */
    assert_int_equal(records_in(st), 0);
    store_close(st);
}

/* What the proxy does to a 1 MiB store (tests/adversarial, store full): 16
 * requests at a time, each acquired and then completed with a small answer,
 * 5 ms apart, until new keys are refused; then, idle, the periodic purge
 * every second in chunks of 32. The records are small, so the tree is deep
 * and every purge commit frees more pages than it copies - into pages LMDB
 * lets only the second transaction after it reuse. Before the fix the first
 * purge left too few reusable pages for even one delete, and with nothing
 * else committing every later purge failed the same way: the store kept
 * ~990 expired records and stayed full. */
static void test_idle_purges_drain_a_store_full_of_small_records(void **state)
{
    enum { BATCH = 16, TTL_MS = 15000 };
    struct fixture *f = *state;
    struct store *st = NULL;
    char path[256];
    static char body[300];
    static const char headers[] = "content-type: application/json\r\nlocation: /v1/p/123456\r\n";
    struct store_op ops[BATCH];
    bool full = false;
    int n = 0;
    uint64_t stored;

    memset(body, 'b', sizeof(body));
    snprintf(path, sizeof(path), "%s/small", f->dir);
    assert_int_equal(open_at(f, path, 1u << 20, &st), 0);
    while (!full) {
        size_t k = 0;
        for (int i = 0; i < BATCH; i++) {
            char name[32];
            snprintf(name, sizeof(name), "fill-%d", n++);
            prep(&ops[i], STORE_OP_ACQUIRE, name, 'a');
            ops[i].lease_ms = 30000;
            ops[i].ttl_ms = TTL_MS;
        }
        assert_int_equal(store_apply(st, ops, BATCH), 0);
        for (int i = 0; i < BATCH; i++) {
            if (ops[i].outcome != STORE_ACQUIRED) {
                assert_int_equal(ops[i].outcome, STORE_FULL);
                full = true;
                continue;
            }
            ops[k] = ops[i];
            ops[k].kind = STORE_OP_COMPLETE;
            ops[k].status = 201;
            ops[k].headers = (struct store_span){headers, sizeof(headers) - 1};
            ops[k].body = (struct store_span){body, sizeof(body)};
            k++;
        }
        if (k > 0) {
            assert_int_equal(store_apply(st, ops, k), 0);
        }
        advance(f, 5);
        assert_true(n < 100000);
    }
    stored = records_in(st);
    assert_true(stored > 500);

    for (int tick = 0; tick < 30 && records_in(st) > 0; tick++) {
        bool more = true;
        advance(f, 1000);
        while (more) {
            size_t purged = 0;
            assert_int_equal(store_purge(st, 32, &purged, &more), 0);
        }
    }
    assert_int_equal(records_in(st), 0);
    store_close(st);
}

/* The store's expiry index as LMDB sees it, read with LMDB itself (the
 * store closed meanwhile). */
static MDB_stat index_stat(const char *path)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    MDB_stat st;

    txn = raw_begin(path, true, &env);
    assert_int_equal(mdb_dbi_open(txn, "expiry", 0, &dbi), 0);
    assert_int_equal(mdb_stat(txn, dbi, &st), 0);
    raw_end(env, txn, true);
    return st;
}

static size_t index_entries(const char *path)
{
    return index_stat(path).ms_entries;
}

/* A backlog of 24,000 due records among 2,000 live ones is purged by a pass
 * in key order (a sweep), which leaves the live records, an IN_PROGRESS
 * record past its TTL under a live lease, and a key acquired again after
 * the sweep deleted it; the index entries the sweep left behind are dropped
 * afterwards, so the index ends with one entry per record. */
static void test_large_backlog_is_purged_in_key_order(void **state)
{
    struct fixture *f = *state;
    struct store_stats stats;
    struct store_op held;
    struct store_op again;
    size_t calls = 0;
    bool more = true;
    bool reacquired = false;
    struct store_record rec;

    fill_completed(f->st, "old", 24000, 1000);
    fill_completed(f->st, "live", 2000, 100000);
    assert_int_equal(acquire(f->st, "held", 'a', 100000, 1000, &held), STORE_ACQUIRED);
    advance(f, 1000);
    while (more) {
        size_t purged = 0;
        assert_int_equal(store_purge(f->st, 64, &purged, &more), 0);
        calls++;
        assert_true(calls < 5000);
        assert_int_equal(store_stats(f->st, &stats), 0);
        if (!reacquired && stats.purge_sweeps == 1 && stats.records == 2001) {
            /* The pass is over: every old record is gone, their index
             * entries are not yet. old7 comes back with a new TTL. */
            assert_int_equal(acquire(f->st, "old7", 'a', 1000, 100000, &again), STORE_ACQUIRED);
            assert_int_equal(complete(f->st, "old7", again.lease_id, 100000, "again"),
                             STORE_DONE);
            reacquired = true;
        }
    }
    assert_true(reacquired);
    assert_int_equal(store_stats(f->st, &stats), 0);
    assert_int_equal(stats.purge_sweeps, 1);
    assert_int_equal(stats.records, 2002);
    assert_int_equal(state_of(f->st, "held"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(state_of(f->st, "live0"), STORE_STATE_COMPLETE);
    assert_int_equal(state_of(f->st, "live1999"), STORE_STATE_COMPLETE);
    assert_int_equal(state_of(f->st, "old0"), STORE_STATE_ABSENT);
    assert_int_equal(state_of(f->st, "old23999"), STORE_STATE_ABSENT);
    get(f->st, "old7", &rec);
    assert_body(&rec, "again");
    store_record_clear(&rec);
    store_close(f->st);
    f->st = NULL;
    /* The records environment's index has the COMPLETE ones, that of the
     * records in flight "held"'s. */
    {
        char fpath[4200];
        snprintf(fpath, sizeof(fpath), "%s/inflight", f->path);
        assert_int_equal(index_entries(f->path), 2001);
        assert_int_equal(index_entries(fpath), 1);
    }
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);

    /* Everything expires: index order takes the rest, no second sweep. */
    advance(f, 200000);
    more = true;
    while (more) {
        size_t purged = 0;
        assert_int_equal(store_purge(f->st, 4096, &purged, &more), 0);
    }
    assert_int_equal(store_stats(f->st, &stats), 0);
    assert_int_equal(stats.records, 0);
    assert_int_equal(stats.purge_sweeps, 0);
}

/* A batch's ops may run in another order than they came (by the index
 * entry they write, see batch_order in store_lmdb.c), but the ops of one
 * key keep theirs, whatever their TTLs: a duplicate's ACQUIRE before the
 * owner's RELEASE is BUSY, and of two ACQUIREs of a new key the first wins
 * even when the second has the shorter TTL. */
static void test_batch_keeps_each_keys_ops_in_order(void **state)
{
    struct fixture *f = *state;
    struct store_op owner;
    struct store_op g[4];

    assert_int_equal(acquire(f->st, "r", 'a', 1000, 60000, &owner), STORE_ACQUIRED);
    prep(&g[0], STORE_OP_ACQUIRE, "r", 'a');
    g[0].ttl_ms = 1000;
    prep(&g[1], STORE_OP_RELEASE, "r", 'a');
    memcpy(g[1].lease_id, owner.lease_id, STORE_LEASE_ID_BYTES);
    prep(&g[2], STORE_OP_ACQUIRE, "s", 'a');
    g[2].ttl_ms = 90000;
    prep(&g[3], STORE_OP_ACQUIRE, "s", 'b');
    g[3].ttl_ms = 5;
    assert_int_equal(store_apply(f->st, g, 4), 0);
    assert_int_equal(g[0].outcome, STORE_BUSY);
    assert_int_equal(g[1].outcome, STORE_DONE);
    assert_int_equal(g[2].outcome, STORE_ACQUIRED);
    assert_int_equal(g[3].outcome, STORE_MISMATCH);
    assert_int_equal(state_of(f->st, "r"), STORE_STATE_ABSENT);
    assert_int_equal(state_of(f->st, "s"), STORE_STATE_IN_PROGRESS);
}

/* The proxy's write pattern: every batch acquires new keys and completes
 * keys acquired a few batches before, all random keys under one TTL. The
 * expiry index keeps at least 40 entries per 4 KiB leaf page (a full one
 * holds 81; run in arrival order this pattern leaves 24.7, in index order
 * 40.2). The layout is deterministic: the keys come from fixed names and
 * the clock is the fixture's. */
static void test_index_pages_stay_full_under_batches(void **state)
{
    enum { ROUNDS = 300, PER = 32, LAG = 4 };
    struct fixture *f = *state;
    static uint8_t leases[ROUNDS][PER][STORE_LEASE_ID_BYTES];
    struct store_op ops[2 * PER];
    MDB_stat st;

    for (int r = 0; r < ROUNDS + LAG; r++) {
        size_t n = 0;
        for (int i = 0; i < PER && r < ROUNDS; i++) {
            char name[32];
            snprintf(name, sizeof(name), "k%d.%d", r, i);
            prep(&ops[n++], STORE_OP_ACQUIRE, name, 'a');
        }
        for (int i = 0; i < PER && r >= LAG; i++) {
            char name[32];
            snprintf(name, sizeof(name), "k%d.%d", r - LAG, i);
            prep(&ops[n], STORE_OP_COMPLETE, name, 'a');
            memcpy(ops[n].lease_id, leases[r - LAG][i], STORE_LEASE_ID_BYTES);
            n++;
        }
        assert_int_equal(store_apply(f->st, ops, n), 0);
        for (size_t j = 0; j < n; j++) {
            if (ops[j].kind == STORE_OP_ACQUIRE) {
                assert_int_equal(ops[j].outcome, STORE_ACQUIRED);
                memcpy(leases[r][j], ops[j].lease_id, STORE_LEASE_ID_BYTES);
            } else {
                assert_int_equal(ops[j].outcome, STORE_DONE);
            }
        }
        advance(f, 1);
    }
    store_close(f->st);
    f->st = NULL;
    st = index_stat(f->path);
    assert_int_equal(st.ms_entries, ROUNDS * PER);
    print_message("index: %zu entries in %zu leaf pages\n", (size_t)st.ms_entries,
                  (size_t)st.ms_leaf_pages);
    assert_true(st.ms_entries >= 40 * st.ms_leaf_pages);
}

/* ---- record encoding ----------------------------------------------------- */

static void sample_complete(struct store_record *rec, uint8_t *headers, size_t hl, uint8_t *body,
                            size_t bl)
{
    memset(rec, 0, sizeof(*rec));
    rec->state = STORE_STATE_COMPLETE;
    for (int i = 0; i < STORE_LEASE_ID_BYTES; i++) {
        rec->lease_id[i] = (uint8_t)(i * 7 + 1);
    }
    rec->lease_expires_ms = -5;
    rec->expires_ms = INT64_MAX;
    fp_of(0xfe, rec->fingerprint);
    rec->status = 599;
    rec->headers = headers;
    rec->headers_len = hl;
    rec->body = body;
    rec->body_len = bl;
}

static void assert_records_equal(const struct store_record *a, const struct store_record *b)
{
    assert_int_equal(a->state, b->state);
    assert_memory_equal(a->lease_id, b->lease_id, STORE_LEASE_ID_BYTES);
    assert_int_equal(a->lease_expires_ms, b->lease_expires_ms);
    assert_int_equal(a->expires_ms, b->expires_ms);
    assert_memory_equal(a->fingerprint, b->fingerprint, STORE_FINGERPRINT_BYTES);
    assert_int_equal(a->has_raw_fingerprint, b->has_raw_fingerprint);
    if (a->has_raw_fingerprint) {
        assert_memory_equal(a->raw_fingerprint, b->raw_fingerprint, STORE_FINGERPRINT_BYTES);
    }
    assert_int_equal(a->status, b->status);
    assert_int_equal(a->headers_len, b->headers_len);
    assert_int_equal(a->body_len, b->body_len);
    if (a->headers_len > 0) {
        assert_memory_equal(a->headers, b->headers, a->headers_len);
    }
    if (a->body_len > 0) {
        assert_memory_equal(a->body, b->body, a->body_len);
    }
}

static void test_record_round_trip(void **state)
{
    uint8_t headers[] = {'a', 0, 'b', '\r', '\n'};
    uint8_t body[] = {0, 0, 0, 1, 0xff, 0};
    struct store_record in;
    struct store_record back;
    uint8_t *buf = NULL;
    size_t len = 0;

    (void)state;
    /* COMPLETE with binary payload. */
    sample_complete(&in, headers, sizeof(headers), body, sizeof(body));
    assert_int_equal(store_record_encode(&in, &buf, &len), 0);
    assert_int_equal(len, 66 + 4 + 8 + sizeof(headers) + 8 + sizeof(body));
    assert_int_equal(buf[0], 1);                    /* version first */
    assert_int_equal(buf[1], STORE_STATE_COMPLETE); /* then state */
    assert_int_equal(buf[66], 599 & 0xff);          /* status, little-endian */
    assert_int_equal(buf[67], 599 >> 8);
    assert_int_equal(store_record_decode(buf, len, &back), 0);
    assert_records_equal(&in, &back);
    store_record_clear(&back);
    free(buf);

    /* COMPLETE with an empty payload. */
    sample_complete(&in, NULL, 0, NULL, 0);
    assert_int_equal(store_record_encode(&in, &buf, &len), 0);
    assert_int_equal(store_record_decode(buf, len, &back), 0);
    assert_records_equal(&in, &back);
    assert_null(back.body);
    store_record_clear(&back);
    free(buf);

    /* IN_PROGRESS: the fixed part only; payload fields are not encoded. */
    sample_complete(&in, headers, sizeof(headers), body, sizeof(body));
    in.state = STORE_STATE_IN_PROGRESS;
    in.lease_expires_ms = INT64_MIN;
    in.expires_ms = 0x0102030405060708;
    assert_int_equal(store_record_encode(&in, &buf, &len), 0);
    assert_int_equal(len, 66);
    assert_int_equal(buf[26], 0x08); /* expires_ms, little-endian */
    assert_int_equal(buf[33], 0x01);
    assert_int_equal(store_record_decode(buf, len, &back), 0);
    assert_int_equal(back.state, STORE_STATE_IN_PROGRESS);
    assert_int_equal(back.lease_expires_ms, INT64_MIN);
    assert_int_equal(back.expires_ms, in.expires_ms);
    assert_int_equal(back.status, 0);
    assert_null(back.headers);
    assert_null(back.body);
    free(buf);

    /* What cannot be encoded is refused. */
    in.state = STORE_STATE_ABSENT;
    assert_int_equal(store_record_encode(&in, &buf, &len), STORE_EINVAL);
    sample_complete(&in, NULL, 3, NULL, 0);
    assert_int_equal(store_record_encode(&in, &buf, &len), STORE_EINVAL);
    sample_complete(&in, NULL, 0, NULL, 0);
    in.status = 99;
    assert_int_equal(store_record_encode(&in, &buf, &len), STORE_EINVAL);
}

static void assert_corrupt(const uint8_t *buf, size_t len)
{
    struct store_record rec;
    memset(&rec, 0x77, sizeof(rec));
    assert_int_equal(store_record_decode(buf, len, &rec), STORE_ECORRUPT);
    /* The output is left empty, so clearing it is safe. */
    assert_int_equal(rec.state, STORE_STATE_ABSENT);
    assert_null(rec.headers);
    assert_null(rec.body);
}

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

/* Version 2: the raw fingerprint follows the canonical one, and the rest
 * moves down by its 32 bytes. */
static void test_record_v2_round_trip(void **state)
{
    uint8_t headers[] = {'a', 0, 'b'};
    uint8_t body[] = {0, 1, 0xff};
    struct store_record in;
    struct store_record back;
    uint8_t *buf = NULL;
    size_t len = 0;

    (void)state;
    sample_complete(&in, headers, sizeof(headers), body, sizeof(body));
    in.has_raw_fingerprint = true;
    fp_of(0x5a, in.raw_fingerprint);
    assert_int_equal(store_record_encode(&in, &buf, &len), 0);
    assert_int_equal(len, 98 + 4 + 8 + sizeof(headers) + 8 + sizeof(body));
    assert_int_equal(buf[0], 2);
    assert_int_equal(buf[34], 0xfe); /* canonical fingerprint */
    assert_int_equal(buf[65], 0xfe);
    assert_int_equal(buf[66], 0x5a); /* raw fingerprint */
    assert_int_equal(buf[97], 0x5a);
    assert_int_equal(buf[98], 599 & 0xff); /* status */
    assert_int_equal(store_record_decode(buf, len, &back), 0);
    assert_true(back.has_raw_fingerprint);
    assert_records_equal(&in, &back);
    store_record_clear(&back);
    free(buf);

    /* IN_PROGRESS: the fixed part only. */
    in.state = STORE_STATE_IN_PROGRESS;
    assert_int_equal(store_record_encode(&in, &buf, &len), 0);
    assert_int_equal(len, 98);
    assert_int_equal(store_record_decode(buf, len, &back), 0);
    assert_true(back.has_raw_fingerprint);
    assert_memory_equal(back.raw_fingerprint, in.raw_fingerprint, STORE_FINGERPRINT_BYTES);
    store_record_clear(&back);
    /* A version-2 record cut to version 1's size does not decode. */
    buf[0] = 2;
    assert_int_equal(store_record_decode(buf, 66, &back), STORE_ECORRUPT);
    free(buf);
}

/* A version-1 record, byte by byte as the code before version 2 wrote it:
 * it decodes, without a raw fingerprint, and re-encodes to the same bytes. */
static void test_record_v1_still_decodes(void **state)
{
    uint8_t v1[66 + 4 + 8 + 2 + 8 + 3];
    struct store_record rec;
    uint8_t *buf = NULL;
    size_t len = 0;

    (void)state;
    memset(v1, 0, sizeof(v1));
    v1[0] = 1;
    v1[1] = STORE_STATE_COMPLETE;
    memset(v1 + 2, 0x07, STORE_LEASE_ID_BYTES);
    put_le64(v1 + 18, 1000);
    put_le64(v1 + 26, 2000);
    memset(v1 + 34, 0xcc, STORE_FINGERPRINT_BYTES);
    v1[66] = 201;
    put_le64(v1 + 70, 2);
    memcpy(v1 + 78, "hh", 2);
    put_le64(v1 + 80, 3);
    memcpy(v1 + 88, "bbb", 3);
    assert_int_equal(store_record_decode(v1, sizeof(v1), &rec), 0);
    assert_int_equal(rec.state, STORE_STATE_COMPLETE);
    assert_false(rec.has_raw_fingerprint);
    assert_int_equal(rec.fingerprint[0], 0xcc);
    assert_int_equal(rec.lease_expires_ms, 1000);
    assert_int_equal(rec.expires_ms, 2000);
    assert_int_equal(rec.status, 201);
    assert_int_equal(rec.headers_len, 2);
    assert_int_equal(rec.body_len, 3);
    assert_memory_equal(rec.body, "bbb", 3);
    assert_int_equal(store_record_encode(&rec, &buf, &len), 0);
    assert_int_equal(len, sizeof(v1));
    assert_memory_equal(buf, v1, sizeof(v1));
    free(buf);
    store_record_clear(&rec);
}

static void test_record_decode_rejects_malformed(void **state)
{
    uint8_t headers[] = "h";
    uint8_t body[] = "body";
    struct store_record in;
    struct store_record ok;
    uint8_t *buf = NULL;
    uint8_t *copy;
    size_t len = 0;
    const size_t hoff = 66 + 4; /* headers length */
    size_t boff;

    (void)state;
    sample_complete(&in, headers, sizeof(headers), body, sizeof(body));
    assert_int_equal(store_record_encode(&in, &buf, &len), 0);
    boff = hoff + 8 + sizeof(headers);
    copy = malloc(len + 1);
    assert_non_null(copy);

    assert_corrupt(NULL, 0);
    /* Every truncation, copied to an exact-size buffer so ASan sees any
     * read past the end. */
    for (size_t n = 0; n < len; n++) {
        uint8_t *t = malloc(n > 0 ? n : 1);
        assert_non_null(t);
        memcpy(t, buf, n);
        assert_corrupt(t, n);
        free(t);
    }
    /* Trailing bytes. */
    memcpy(copy, buf, len);
    copy[len] = 0;
    assert_corrupt(copy, len + 1);
    /* Unknown versions and states. */
    for (int v = 0; v < 256; v++) {
        memcpy(copy, buf, len);
        copy[0] = (uint8_t)v;
        if (v != 1) {
            assert_corrupt(copy, len);
        }
        memcpy(copy, buf, len);
        copy[1] = (uint8_t)v;
        if (v != STORE_STATE_COMPLETE) {
            assert_corrupt(copy, len); /* IN_PROGRESS: trailing payload */
        }
    }
    /* Status outside 100..599. */
    memcpy(copy, buf, len);
    copy[66] = 99;
    copy[67] = 0;
    assert_corrupt(copy, len);
    memcpy(copy, buf, len);
    copy[66] = 600 & 0xff;
    copy[67] = 600 >> 8;
    assert_corrupt(copy, len);
    /* Lengths that overflow, point past the end, or disagree. */
    const uint64_t bad_lengths[] = {UINT64_MAX, UINT64_MAX - 7, (uint64_t)1 << 63, len,
                                    sizeof(headers) + 1};
    for (size_t i = 0; i < sizeof(bad_lengths) / sizeof(bad_lengths[0]); i++) {
        memcpy(copy, buf, len);
        put_le64(copy + hoff, bad_lengths[i]);
        assert_corrupt(copy, len);
        memcpy(copy, buf, len);
        put_le64(copy + boff, bad_lengths[i]);
        assert_corrupt(copy, len);
    }
    memcpy(copy, buf, len);
    put_le64(copy + boff, sizeof(body) - 1);
    assert_corrupt(copy, len);
    /* The unmodified copy still decodes: the cases above can fail. */
    memcpy(copy, buf, len);
    assert_int_equal(store_record_decode(copy, len, &ok), 0);
    store_record_clear(&ok);
    free(copy);
    free(buf);
}

/* A small deterministic mutation fuzz: every mutant either is rejected or
 * decodes to a record that re-encodes to exactly the same bytes. */
static void test_record_decode_mutants(void **state)
{
    uint8_t headers[] = "k: v\r\n";
    uint8_t body[] = "{\"ok\":true}";
    struct store_record in;
    uint8_t *buf = NULL;
    size_t len = 0;
    uint64_t x = 88172645463325252ull;
    int accepted = 0;

    (void)state;
    sample_complete(&in, headers, sizeof(headers), body, sizeof(body));
    for (int iter = 0; iter < 40000; iter++) {
        if (iter == 0 || iter == 20000) {
            /* version 1 first, then version 2 (with a raw fingerprint) */
            in.has_raw_fingerprint = iter != 0;
            fp_of(0x5a, in.raw_fingerprint);
            free(buf);
            assert_int_equal(store_record_encode(&in, &buf, &len), 0);
        }
        uint8_t *m = malloc(len);
        struct store_record rec;
        size_t mlen = len;
        assert_non_null(m);
        memcpy(m, buf, len);
        for (int k = 0; k < 1 + iter % 4; k++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            m[x % len] = (uint8_t)(x >> 32);
        }
        if (iter % 5 == 0) {
            mlen = (size_t)(x >> 40) % (len + 1); /* truncate too */
        }
        if (store_record_decode(m, mlen, &rec) == 0) {
            uint8_t *again = NULL;
            size_t again_len = 0;
            assert_int_equal(store_record_encode(&rec, &again, &again_len), 0);
            assert_int_equal(again_len, mlen);
            assert_memory_equal(again, m, mlen);
            free(again);
            store_record_clear(&rec);
            accepted++;
        }
        free(m);
    }
    free(buf);
    assert_true(accepted > 0); /* payload-byte mutants stay valid */
}

static void test_names(void **state)
{
    (void)state;
    assert_string_equal(store_outcome_name(STORE_ACQUIRED), "acquired");
    assert_string_equal(store_outcome_name(STORE_FENCED), "fenced");
    assert_string_equal(store_outcome_name((enum store_outcome)0), "unknown");
    assert_string_equal(store_strerror(STORE_EFULL), "store full");
    assert_string_equal(store_strerror(STORE_ELAYOUT),
                        "the store was upgraded by a newer idemproxy; stop this process");
    assert_string_equal(store_strerror(-99), "unknown store error");
}

/* A backend whose every call after open answers STORE_EDEAD, as LMDB's does
 * after MDB_PANIC: on_dead must be called once, from whichever call sees it
 * first, and the calls still return the error. */
static int dead_open(const struct store_options *opt, void **impl, char *err, size_t errlen)
{
    (void)opt;
    (void)err;
    (void)errlen;
    *impl = NULL;
    return STORE_OK;
}
static void dead_close(void *impl)
{
    (void)impl;
}
static int dead_apply(void *impl, struct store_op *ops, size_t n)
{
    (void)impl;
    (void)ops;
    (void)n;
    return STORE_EDEAD;
}
static int dead_get(void *impl, const uint8_t key[STORE_KEY_BYTES], struct store_record *out)
{
    (void)impl;
    (void)key;
    (void)out;
    return STORE_EDEAD;
}
static int dead_purge(void *impl, size_t max, size_t *purged, bool *more)
{
    (void)impl;
    (void)max;
    *purged = 0;
    *more = false;
    return STORE_EDEAD;
}
static int dead_sync(void *impl)
{
    (void)impl;
    return STORE_EDEAD;
}

static void count_dead(void *ctx)
{
    (*(int *)ctx)++;
}

/* LMDB's writes go through the process's pwrite(): this one fails the next
 * write into the first two pages (the meta pages: LMDB's last write of a
 * commit) with the errno set here, as a full or failing disk would. */
static _Atomic int fail_meta_write_errno;

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off);
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
    if (off < 8192 && n < 4096 && atomic_load(&fail_meta_write_errno) != 0) {
        errno = atomic_exchange(&fail_meta_write_errno, 0);
        return -1;
    }
    return syscall(SYS_pwrite64, fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off);
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off)
{
    return pwrite(fd, buf, n, off);
}

/* A meta page write that fails with ENOSPC leaves LMDB refusing every
 * transaction (MDB_PANIC), like EIO does, but looks like a full store. The
 * full-store retry used to mark the batch "full, not applied" and return
 * success, so the process kept running on a dead store until some later
 * call. The call itself now reports STORE_EDEAD and on_dead runs. */
static void test_meta_write_enospc_is_a_dead_store(void **state)
{
    struct fixture *f = *state;
    struct store_options opt;
    struct store_op a;
    struct store *st = NULL;
    uint8_t key[STORE_KEY_BYTES];
    uint8_t fp[STORE_FINGERPRINT_BYTES] = {1};
    int calls = 0;
    char err[256];

    store_close(f->st);
    f->st = NULL;
    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    opt.sync = true;
    opt.clock = &f->store_clock;
    opt.on_dead = count_dead;
    opt.on_dead_ctx = &calls;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), 0);
    assert_int_equal(acquire(st, "before", 'a', 1000, 60000, &a), STORE_ACQUIRED);
    key_of("dies", key);
    atomic_store(&fail_meta_write_errno, ENOSPC);
    assert_int_equal(store_acquire(st, key, fp, 1000, 60000, &a), STORE_EDEAD);
    assert_int_equal(atomic_load(&fail_meta_write_errno), 0); /* the write was tried */
    assert_int_equal(calls, 1);
    store_close(st);
    /* Opened again, the store is as the last good commit left it. */
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0);
    assert_int_equal(state_of(f->st, "before"), STORE_STATE_IN_PROGRESS);
    assert_int_equal(state_of(f->st, "dies"), STORE_STATE_ABSENT);
}

/* Another process with a larger map_size writes past this process's map:
 * LMDB then refuses this process's transactions (MDB_MAP_RESIZED) until it
 * maps the new size, which needs every transaction in the process closed.
 * The store used to report STORE_EIO for every call, replays included, for
 * good; it now reports STORE_EDEAD and calls on_dead, so the proxy stops and
 * a new process maps the store as it is. */
static void test_a_larger_map_elsewhere_is_a_dead_store(void **state)
{
    struct fixture *f = *state;
    struct store_options opt;
    struct store_record rec;
    struct store_op a;
    struct store *st = NULL;
    uint8_t key[STORE_KEY_BYTES];
    char err[256], cause[256];
    int calls = 0, status = 0;
    pid_t child;

    store_close(f->st);
    f->st = NULL;
    memset(&opt, 0, sizeof(opt));
    opt.path = f->path;
    opt.map_size_bytes = 4u << 20;
    opt.clock = &f->store_clock;
    opt.on_dead = count_dead;
    opt.on_dead_ctx = &calls;
    assert_int_equal(store_open(NULL, &opt, &st, err, sizeof(err)), 0);
    assert_int_equal(acquire(st, "small", 'a', 1000, 600000, &a), STORE_ACQUIRED);
    assert_int_equal(complete(st, "small", a.lease_id, 600000, "kept"), STORE_DONE);

    child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        /* Its own environment (never the parent's across fork()). */
        static char body[200000];
        struct store_options big = opt;
        struct store *bst = NULL;
        big.map_size_bytes = 64u << 20;
        big.on_dead = NULL;
        if (store_open(NULL, &big, &bst, err, sizeof(err)) != 0)
            _exit(2);
        for (int i = 0; i < 60; i++) {
            char name[16];
            snprintf(name, sizeof(name), "big%d", i);
            key_of(name, key);
            if (store_acquire(bst, key, (uint8_t[32]){1}, 1000, 600000, &a) != 0 ||
                store_complete(bst, key, a.lease_id, 600000, 200, (struct store_span){NULL, 0},
                               (struct store_span){body, sizeof(body)}, NULL) != 0)
                _exit(3);
        }
        store_close(bst);
        _exit(0);
    }
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);

    key_of("small", key);
    assert_int_equal(store_get(st, key, &rec), STORE_EDEAD);
    assert_int_equal(calls, 1);
    store_last_cause(cause, sizeof(cause));
    assert_non_null(strstr(cause, "another process grew the store past this process's map"));
    store_close(st);
    /* A new open with the same small map_size maps what is there. */
    assert_int_equal(open_at(f, f->path, 4u << 20, &f->st), 0);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    assert_int_equal(rec.body_len, 4);
    assert_memory_equal(rec.body, "kept", 4);
    store_record_clear(&rec);
}

/* A process that died holding reader slots (SIGKILL) leaves them taken
 * until someone clears them. With every slot so taken, a read that needs a
 * new transaction clears the dead ones and goes on, rather than failing
 * (and failing the write batch whose room check needed it). */
static void test_reader_slots_of_dead_processes_are_cleared_when_full(void **state)
{
    struct fixture *f = *state;
    struct store_record rec;
    struct store_op a;
    uint8_t key[STORE_KEY_BYTES];
    int pipefd[2], status = 0;
    char c = 0;
    pid_t child;

    assert_int_equal(acquire(f->st, "r", 'a', 1000, 600000, &a), STORE_ACQUIRED);
    store_close(f->st);
    f->st = NULL;
    assert_int_equal(open_at(f, f->path, 0, &f->st), 0); /* no read transaction yet */
    assert_int_equal(pipe(pipefd), 0);
    child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        /* Its own environment; every slot it can get, then killed. */
        MDB_env *env = NULL;
        MDB_txn *txn = NULL;
        int n = 0;
        if (mdb_env_create(&env) != 0 || mdb_env_set_maxdbs(env, 4) != 0 ||
            mdb_env_open(env, f->path, MDB_RDONLY | MDB_NOTLS, 0600) != 0)
            _exit(2);
        while (mdb_txn_begin(env, NULL, MDB_RDONLY, &txn) == 0)
            n++;
        c = n >= 100 ? 'y' : 'n';
        (void)!write(pipefd[1], &c, 1);
        raise(SIGKILL);
    }
    close(pipefd[1]);
    assert_int_equal(read(pipefd[0], &c, 1), 1);
    close(pipefd[0]);
    assert_int_equal(c, 'y');
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFSIGNALED(status));
    key_of("r", key);
    assert_int_equal(store_get(f->st, key, &rec), 0);
    assert_int_equal(rec.state, STORE_STATE_IN_PROGRESS);
    store_record_clear(&rec);
}

static void test_on_dead_called_once(void **state)
{
    static const struct store_ops dead_ops = {
        .name = "dead",
        .open = dead_open,
        .close = dead_close,
        .apply = dead_apply,
        .get = dead_get,
        .purge = dead_purge,
        .sync = dead_sync,
    };
    int calls = 0;
    struct store_options opt = {.path = "unused", .on_dead = count_dead, .on_dead_ctx = &calls};
    struct store *st = NULL;
    struct store_record rec;
    uint8_t key[STORE_KEY_BYTES] = {1};
    uint8_t fp[STORE_FINGERPRINT_BYTES] = {2};
    struct store_op op = {.kind = STORE_OP_ACQUIRE, .lease_ms = 1000, .ttl_ms = 1000};
    char err[256];

    (void)state;
    memcpy(op.key, key, sizeof(key));
    memcpy(op.fingerprint, fp, sizeof(fp));
    assert_int_equal(store_open(&dead_ops, &opt, &st, err, sizeof(err)), STORE_OK);
    assert_int_equal(calls, 0);
    assert_int_equal(store_get(st, key, &rec), STORE_EDEAD);
    assert_int_equal(calls, 1);
    assert_int_equal(store_apply(st, &op, 1), STORE_EDEAD);
    assert_int_equal(store_sync(st), STORE_EDEAD);
    assert_int_equal(calls, 1);
    assert_string_equal(store_strerror(STORE_EDEAD),
                        "the store takes no more transactions until it is opened again");
    store_close(st);
}

/* The file systems a store is refused on (check_file_system in
 * store_lmdb.c), by statfs()'s f_type, and the local ones it is not. */
static void test_shared_fs_names(void **state)
{
    (void)state;
    assert_string_equal(store_shared_fs_name(0x6969ul), "NFS");
    assert_string_equal(store_shared_fs_name(0xFF534D42ul), "CIFS");
    assert_string_equal(store_shared_fs_name(0xFE534D42ul), "SMB2");
    assert_string_equal(store_shared_fs_name(0x65735546ul), "FUSE");
    assert_string_equal(store_shared_fs_name(0x00C36400ul), "Ceph");
    assert_string_equal(store_shared_fs_name(0x01021997ul), "9p");
    /* Only the low 32 bits: a sign-extended f_type reads the same. */
    assert_string_equal(store_shared_fs_name((unsigned long)(long)(int32_t)0xFF534D42u), "CIFS");
    /* ext4, XFS, Btrfs, tmpfs, overlayfs, ZFS: local. */
    assert_null(store_shared_fs_name(0xEF53ul));
    assert_null(store_shared_fs_name(0x58465342ul));
    assert_null(store_shared_fs_name(0x9123683Eul));
    assert_null(store_shared_fs_name(0x01021994ul));
    assert_null(store_shared_fs_name(0x794C7630ul));
    assert_null(store_shared_fs_name(0x2FC12FC1ul));
    assert_null(store_shared_fs_name(0));
}

#define STORE_TEST(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        STORE_TEST(test_acquire_creates_in_progress),
        STORE_TEST(test_lease_ids_differ),
        STORE_TEST(test_live_in_progress_is_busy),
        STORE_TEST(test_other_fingerprint_is_mismatch),
        STORE_TEST(test_replay_copies_payload_byte_for_byte),
        STORE_TEST(test_double_complete_refused),
        STORE_TEST(test_release_deletes_record),
        STORE_TEST(test_complete_after_release_refused),
        STORE_TEST(test_release_after_steal_refused),
        STORE_TEST(test_stale_owner_fenced_after_steal),
        STORE_TEST(test_expired_lease_holder_may_still_complete),
        STORE_TEST(test_extend_is_silent_noop_otherwise),
        STORE_TEST(test_extend_prevents_steal),
        STORE_TEST(test_hold_takes_the_lease_from_everyone),
        STORE_TEST(test_ttl_counts_from_completion),
        STORE_TEST(test_expired_complete_is_absent_before_purge),
        STORE_TEST(test_view_is_get_without_the_copy),
        STORE_TEST(test_purge_deletes_expired_complete),
        STORE_TEST(test_purge_in_progress_rules),
        STORE_TEST(test_purge_keeps_completed_after_move),
        STORE_TEST(test_purge_in_bounded_batches),
        STORE_TEST(test_apply_purge_shares_the_transaction),
#ifdef IDEM_FAULT_INJECTION
        STORE_TEST(test_apply_purge_failure_leaves_ops_alone),
#endif
        STORE_TEST(test_concurrent_acquire_one_winner),
        STORE_TEST(test_acquire_raw_then_canonical),
        STORE_TEST(test_lease_ids_unique_across_refills),
        STORE_TEST(test_v1_record_in_store),
        STORE_TEST(test_in_progress_and_complete_live_apart),
        STORE_TEST(test_in_progress_from_before_the_split),
        STORE_TEST(test_newer_layout_refused),
        STORE_TEST(test_malformed_log_salt_replaced),
        STORE_TEST(test_stall_holds_steal_off_for_a_lease),
        STORE_TEST(test_stall_end_in_future_or_past_ignored),
        STORE_TEST(test_stall_reaches_another_process_through_meta),
        STORE_TEST(test_stall_of_another_boot_in_meta_overwritten),
        STORE_TEST(test_stalled_hold_seen_by_the_next_taker),
        STORE_TEST(test_stalled_complete_seen_by_a_steal),
        STORE_TEST(test_entry_left_in_flight_after_a_complete),
        STORE_TEST(test_steal_waits_for_the_records_lock),
        STORE_TEST(test_purge_share_spares_the_batch_completes),
        STORE_TEST(test_inflight_purge_share_is_capped),
#ifdef IDEM_FAULT_INJECTION
        STORE_TEST(test_complete_during_an_inflight_batch),
        STORE_TEST(test_lookup_sees_a_complete_after_its_miss),
        STORE_TEST(test_lookup_searches_records_once_when_nothing_committed),
#endif
        STORE_TEST(test_keep_layout_upgrades_and_creates_nothing),
        STORE_TEST(test_wall_clock_step_leaves_leases_alone),
        STORE_TEST(test_leases_end_with_the_boot),
        STORE_TEST(test_held_record_outlives_the_boot),
        STORE_TEST(test_wall_clock_leases_upgraded),
        STORE_TEST(test_unknown_epoch_refused),
        STORE_TEST(test_malformed_layout_refused),
        STORE_TEST(test_same_key_two_scopes_two_records),
        STORE_TEST(test_group_apply_one_txn_in_order),
        STORE_TEST(test_apply_rejects_bad_ops_untouched),
        STORE_TEST(test_records_survive_reopen),
        STORE_TEST(test_second_open_in_process_refused),
        STORE_TEST(test_two_processes_share_store),
        STORE_TEST(test_reader_check_clears_dead_reader),
        STORE_TEST(test_open_creates_directories),
        STORE_TEST(test_stats_scan_sync),
        STORE_TEST(test_scan_stops_when_asked),
        STORE_TEST(test_scan_merges_both_tables_in_key_order),
        STORE_TEST(test_corrupt_record_reported_then_purged),
        STORE_TEST(test_scan_all_goes_past_corrupt_records),
        STORE_TEST(test_store_full_then_purge_on_full),
        STORE_TEST(test_store_full_of_answers_still_purges),
        STORE_TEST(test_purge_shrinks_its_batch_when_full),
        STORE_TEST(test_small_purges_in_a_full_map_report_more),
        STORE_TEST(test_idle_purges_drain_a_store_full_of_small_records),
        STORE_TEST(test_large_backlog_is_purged_in_key_order),
        STORE_TEST(test_batch_keeps_each_keys_ops_in_order),
        STORE_TEST(test_index_pages_stay_full_under_batches),
        cmocka_unit_test(test_key_derive),
        cmocka_unit_test(test_sha256_known_answers),
        cmocka_unit_test(test_sha256_long_inputs),
        cmocka_unit_test(test_sha256_threads),
        cmocka_unit_test(test_record_round_trip),
        cmocka_unit_test(test_record_v2_round_trip),
        cmocka_unit_test(test_record_v1_still_decodes),
        cmocka_unit_test(test_record_decode_rejects_malformed),
        cmocka_unit_test(test_record_decode_mutants),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_shared_fs_names),
        cmocka_unit_test(test_on_dead_called_once),
        STORE_TEST(test_key_order_pass_keeps_a_damaged_record),
        STORE_TEST(test_stale_entry_keeps_a_damaged_record),
        STORE_TEST(test_ttl_on_a_negative_clock),
        STORE_TEST(test_meta_write_enospc_is_a_dead_store),
        STORE_TEST(test_a_larger_map_elsewhere_is_a_dead_store),
        STORE_TEST(test_reader_slots_of_dead_processes_are_cleared_when_full),
        STORE_TEST(test_forget),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
