/*
 * store.c - the backend-independent part of the store: the handle wrapping a
 * backend table (the shape of Redis's connection types), argument checks
 * shared by every backend, the single-edge conveniences, the record key and
 * the real-time clock.
 */
#include "store.h"
#include "store_internal.h"
#include "store_sha256.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct store {
    const struct store_ops *ops;
    void *impl;
    void (*on_dead)(void *ctx);
    void *on_dead_ctx;
    atomic_bool dead; /* on_dead was called */
};

/* Every backend call's result passes here: the first STORE_EDEAD calls
 * on_dead. */
static int seen(struct store *st, int rc)
{
    if (rc == STORE_EDEAD && st->on_dead != NULL && !atomic_exchange(&st->dead, true)) {
        st->on_dead(st->on_dead_ctx);
    }
    return rc;
}

const char *store_strerror(int err)
{
    const char *s = "unknown store error";
    switch (err) {
    case STORE_OK:
        s = "success";
        break;
    case STORE_EIO:
        s = "store I/O error";
        break;
    case STORE_ENOMEM:
        s = "out of memory";
        break;
    case STORE_EINVAL:
        s = "invalid argument";
        break;
    case STORE_ECORRUPT:
        s = "corrupt record";
        break;
    case STORE_EFULL:
        s = "store full";
        break;
    case STORE_ELAYOUT:
        s = "the store was upgraded by a newer idemproxy; stop this process";
        break;
    case STORE_EDEAD:
        s = "the store takes no more transactions until it is opened again";
        break;
    default:
        break;
    }
    return s;
}

const char *store_outcome_name(enum store_outcome o)
{
    const char *s = "unknown";
    switch (o) {
    case STORE_ACQUIRED:
        s = "acquired";
        break;
    case STORE_REPLAY:
        s = "replay";
        break;
    case STORE_BUSY:
        s = "busy";
        break;
    case STORE_MISMATCH:
        s = "mismatch";
        break;
    case STORE_DONE:
        s = "done";
        break;
    case STORE_FENCED:
        s = "fenced";
        break;
    case STORE_FULL:
        s = "full";
        break;
    case STORE_NOT_FOUND:
        s = "not_found";
        break;
    default:
        break;
    }
    return s;
}

void store_record_clear(struct store_record *rec)
{
    if (rec != NULL) {
        free(rec->headers);
        free(rec->body);
        memset(rec, 0, sizeof(*rec));
    }
}

static int64_t realtime_now_ms(void *ctx)
{
    struct timespec ts;
    (void)ctx;
    /* CLOCK_REALTIME rather than MONOTONIC: records outlive the process and
     * are shared with other processes, so the epoch must be common to all. */
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + (int64_t)(ts.tv_nsec / 1000000);
}

static int64_t boottime_now_ms(void *ctx)
{
    struct timespec ts;
    (void)ctx;
    /* Not stepped by NTP or by hand, counts a suspended host's time (a
     * holder asleep that long is taken as paused, as any other pause), and
     * one clock for every process of the host. */
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + (int64_t)(ts.tv_nsec / 1000000);
}

/* The kernel's boot id, read once: "" when it cannot be read (then
 * store_open refuses to write, see store_lmdb.c). */
static char boot_id[40];
static pthread_once_t boot_id_once = PTHREAD_ONCE_INIT;

static void boot_id_read(void)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (f != NULL) {
        if (fgets(boot_id, sizeof(boot_id), f) == NULL)
            boot_id[0] = '\0';
        boot_id[strcspn(boot_id, "\n")] = '\0';
        fclose(f);
    }
}

static const char *boot_epoch(void *ctx)
{
    (void)ctx;
    pthread_once(&boot_id_once, boot_id_read);
    return boot_id;
}

const struct store_clock store_clock_realtime = {realtime_now_ms, NULL, boottime_now_ms,
                                                 boot_epoch};

int64_t store_clock_lease_now(const struct store_clock *clock)
{
    if (clock == NULL)
        clock = &store_clock_realtime;
    return clock->lease_now_ms != NULL ? clock->lease_now_ms(clock->ctx) : clock->now_ms(clock->ctx);
}

static void set_err(char *err, size_t errlen, const char *msg)
{
    if (err != NULL && errlen > 0) {
        snprintf(err, errlen, "%s", msg);
    }
}

int store_open(const struct store_ops *backend, const struct store_options *opt, struct store **out,
               char *err, size_t errlen)
{
    int rc = STORE_EINVAL;
    struct store *st = NULL;

    set_err(err, errlen, "");
    if (out == NULL || opt == NULL || opt->path == NULL || opt->path[0] == '\0') {
        set_err(err, errlen, "store: no path given");
        goto out;
    }
    *out = NULL;
    st = calloc(1, sizeof(*st));
    if (st == NULL) {
        rc = STORE_ENOMEM;
        set_err(err, errlen, "store: out of memory");
        goto out;
    }
    st->ops = backend != NULL ? backend : &store_lmdb_ops;
    st->on_dead = opt->on_dead;
    st->on_dead_ctx = opt->on_dead_ctx;
    atomic_init(&st->dead, false);
    rc = st->ops->open(opt, &st->impl, err, errlen);
    if (rc != STORE_OK) {
        goto out;
    }
    *out = st;
    st = NULL;
out:
    free(st);
    return rc;
}

void store_close(struct store *st)
{
    if (st != NULL) {
        st->ops->close(st->impl);
        free(st);
    }
}

static bool span_valid(struct store_span s)
{
    return s.ptr != NULL || s.len == 0;
}

bool store_lease_is_held(const uint8_t lease_id[STORE_LEASE_ID_BYTES])
{
    uint8_t any = 0;
    for (size_t i = 0; i < STORE_LEASE_ID_BYTES; i++) {
        any |= lease_id[i];
    }
    return any == 0;
}

/* Checks what every backend would otherwise have to check, before any
 * transaction starts, so that a bad op fails the call without side effects. */
static bool op_valid(const struct store_op *op)
{
    bool ok = false;
    switch (op->kind) {
    case STORE_OP_ACQUIRE:
        ok = op->lease_ms > 0 && op->ttl_ms > 0;
        break;
    case STORE_OP_COMPLETE:
        /* RFC 9110 section 15: valid status codes are 100..599. */
        ok = op->ttl_ms > 0 && op->status >= 100 && op->status <= 599 && span_valid(op->headers) &&
             span_valid(op->body);
        break;
    case STORE_OP_RELEASE:
        ok = true;
        break;
    case STORE_OP_EXTEND:
        ok = op->lease_ms > 0;
        break;
    case STORE_OP_FORGET:
        ok = true;
        break;
    default:
        break;
    }
    return ok;
}

int store_apply(struct store *st, struct store_op *ops, size_t n)
{
    return store_apply_purge(st, ops, n, 0, NULL, NULL);
}

int store_apply_purge(struct store *st, struct store_op *ops, size_t n, size_t max_purge,
                      size_t *purged, bool *more)
{
    int rc = STORE_EINVAL;
    size_t purged_local = 0;
    bool more_local = false;

    if (st == NULL || (ops == NULL && n > 0)) {
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if (!op_valid(&ops[i])) {
            goto out;
        }
    }
    rc = STORE_OK;
    if (max_purge > 0 && st->ops->apply_purge != NULL) {
        rc = seen(st, st->ops->apply_purge(st->impl, ops, n, max_purge, &purged_local, &more_local));
    } else {
        if (n > 0) {
            rc = seen(st, st->ops->apply(st->impl, ops, n));
        }
        /* A backend without the shared form purges in a transaction of its
         * own; as there, a failing purge does not fail the ops. */
        if (rc == STORE_OK && max_purge > 0 &&
            seen(st, st->ops->purge(st->impl, max_purge, &purged_local, &more_local)) != STORE_OK) {
            purged_local = 0;
            more_local = false;
        }
    }
out:
    if (purged != NULL) {
        *purged = purged_local;
    }
    if (more != NULL) {
        *more = more_local;
    }
    return rc;
}

int store_get(struct store *st, const uint8_t key[STORE_KEY_BYTES], struct store_record *out)
{
    int rc = STORE_EINVAL;
    if (st != NULL && key != NULL && out != NULL) {
        rc = seen(st, st->ops->get(st->impl, key, out));
    }
    return rc;
}

int store_view(struct store *st, const uint8_t key[STORE_KEY_BYTES], store_view_fn fn, void *ctx)
{
    int rc = STORE_EINVAL;
    struct store_record rec;

    if (st == NULL || key == NULL || fn == NULL) {
        goto out;
    }
    if (st->ops->view != NULL) {
        rc = seen(st, st->ops->view(st->impl, key, fn, ctx));
        goto out;
    }
    rc = seen(st, st->ops->get(st->impl, key, &rec));
    if (rc == STORE_OK) {
        fn(&rec, ctx);
        store_record_clear(&rec);
    }
out:
    return rc;
}

int store_purge(struct store *st, size_t max_records, size_t *purged, bool *more)
{
    int rc = STORE_EINVAL;
    size_t purged_local = 0;
    bool more_local = false;

    if (st != NULL && max_records > 0) {
        rc = seen(st, st->ops->purge(st->impl, max_records, &purged_local, &more_local));
    }
    if (purged != NULL) {
        *purged = purged_local;
    }
    if (more != NULL) {
        *more = more_local;
    }
    return rc;
}

int store_reader_check(struct store *st, int *cleared)
{
    int rc = STORE_EINVAL;
    int cleared_local = 0;

    if (st != NULL) {
        rc = seen(st, st->ops->reader_check(st->impl, &cleared_local));
    }
    if (cleared != NULL) {
        *cleared = cleared_local;
    }
    return rc;
}

int store_stats(struct store *st, struct store_stats *out)
{
    int rc = STORE_EINVAL;
    if (st != NULL && out != NULL) {
        memset(out, 0, sizeof(*out));
        rc = seen(st, st->ops->stats(st->impl, out));
    }
    return rc;
}

int store_scan(struct store *st, store_scan_fn fn, void *ctx)
{
    int rc = STORE_EINVAL;
    if (st != NULL && fn != NULL) {
        rc = seen(st, st->ops->scan(st->impl, fn, NULL, ctx));
    }
    return rc;
}

int store_scan_all(struct store *st, store_scan_fn fn, store_scan_bad_fn bad, void *ctx)
{
    int rc = STORE_EINVAL;
    if (st != NULL && fn != NULL && bad != NULL) {
        rc = seen(st, st->ops->scan(st->impl, fn, bad, ctx));
    }
    return rc;
}

int store_sync(struct store *st)
{
    int rc = STORE_EINVAL;
    if (st != NULL) {
        rc = seen(st, st->ops->sync(st->impl));
    }
    return rc;
}

int store_acquire(struct store *st, const uint8_t key[STORE_KEY_BYTES],
                  const uint8_t fingerprint[STORE_FINGERPRINT_BYTES], int64_t lease_ms,
                  int64_t ttl_ms, struct store_op *out)
{
    int rc = STORE_EINVAL;

    if (key == NULL || fingerprint == NULL || out == NULL) {
        goto out;
    }
    /* *out is filled entirely here, so the caller need not initialise it;
     * the replay copy is always asked for, since a caller that gets
     * STORE_REPLAY from this call has nothing else to answer with. */
    memset(out, 0, sizeof(*out));
    out->kind = STORE_OP_ACQUIRE;
    memcpy(out->key, key, STORE_KEY_BYTES);
    memcpy(out->fingerprint, fingerprint, STORE_FINGERPRINT_BYTES);
    out->has_raw_fingerprint = true;
    memcpy(out->raw_fingerprint, fingerprint, STORE_FINGERPRINT_BYTES);
    out->lease_ms = lease_ms;
    out->ttl_ms = ttl_ms;
    out->want_replay = true;
    rc = store_apply(st, out, 1);
out:
    return rc;
}

/* Applies one complete/release/extend op and reports its outcome. */
static int apply_leased(struct store *st, struct store_op *op, enum store_outcome *outcome)
{
    int rc = store_apply(st, op, 1);
    if (rc == STORE_OK && outcome != NULL) {
        *outcome = op->outcome;
    }
    return rc;
}

int store_complete(struct store *st, const uint8_t key[STORE_KEY_BYTES],
                   const uint8_t lease_id[STORE_LEASE_ID_BYTES], int64_t ttl_ms, int status,
                   struct store_span headers, struct store_span body, enum store_outcome *outcome)
{
    int rc = STORE_EINVAL;
    struct store_op op;

    if (key == NULL || lease_id == NULL) {
        goto out;
    }
    memset(&op, 0, sizeof(op));
    op.kind = STORE_OP_COMPLETE;
    memcpy(op.key, key, STORE_KEY_BYTES);
    memcpy(op.lease_id, lease_id, STORE_LEASE_ID_BYTES);
    op.ttl_ms = ttl_ms;
    op.status = status;
    op.headers = headers;
    op.body = body;
    rc = apply_leased(st, &op, outcome);
out:
    return rc;
}

int store_forget(struct store *st, const uint8_t key[STORE_KEY_BYTES], bool force,
                 enum store_outcome *outcome)
{
    int rc = STORE_EINVAL;
    struct store_op op;

    if (key == NULL) {
        goto out;
    }
    memset(&op, 0, sizeof(op));
    op.kind = STORE_OP_FORGET;
    memcpy(op.key, key, STORE_KEY_BYTES);
    op.force = force;
    rc = apply_leased(st, &op, outcome);
out:
    return rc;
}

int store_release(struct store *st, const uint8_t key[STORE_KEY_BYTES],
                  const uint8_t lease_id[STORE_LEASE_ID_BYTES], enum store_outcome *outcome)
{
    int rc = STORE_EINVAL;
    struct store_op op;

    if (key == NULL || lease_id == NULL) {
        goto out;
    }
    memset(&op, 0, sizeof(op));
    op.kind = STORE_OP_RELEASE;
    memcpy(op.key, key, STORE_KEY_BYTES);
    memcpy(op.lease_id, lease_id, STORE_LEASE_ID_BYTES);
    rc = apply_leased(st, &op, outcome);
out:
    return rc;
}

int store_extend(struct store *st, const uint8_t key[STORE_KEY_BYTES],
                 const uint8_t lease_id[STORE_LEASE_ID_BYTES], int64_t lease_ms,
                 enum store_outcome *outcome)
{
    int rc = STORE_EINVAL;
    struct store_op op;

    if (key == NULL || lease_id == NULL) {
        goto out;
    }
    memset(&op, 0, sizeof(op));
    op.kind = STORE_OP_EXTEND;
    memcpy(op.key, key, STORE_KEY_BYTES);
    memcpy(op.lease_id, lease_id, STORE_LEASE_ID_BYTES);
    op.lease_ms = lease_ms;
    rc = apply_leased(st, &op, outcome);
out:
    return rc;
}

static void put_be64(uint8_t out[8], uint64_t v)
{
    for (size_t i = 0; i < 8; i++) {
        out[i] = (uint8_t)(v >> (56 - 8 * i));
    }
}

void store_key_derive(const void *scope, size_t scope_len, const void *key, size_t key_len,
                      uint8_t out[STORE_KEY_BYTES])
{
    uint8_t scope_len_be[8];
    uint8_t key_len_be[8];
    struct store_span parts[4];

    /* Length prefixes make the encoding injective: ("ab","c") and ("a","bc")
     * hash different byte strings. */
    put_be64(scope_len_be, (uint64_t)scope_len);
    put_be64(key_len_be, (uint64_t)key_len);
    parts[0] = (struct store_span){scope_len_be, sizeof(scope_len_be)};
    parts[1] = (struct store_span){scope, scope_len};
    parts[2] = (struct store_span){key_len_be, sizeof(key_len_be)};
    parts[3] = (struct store_span){key, key_len};
    if (store_sha256(parts, 4, out) != STORE_OK) {
        /* This function cannot report an error, and any key it made up
         * instead (zeros, a partial hash) would merge unrelated identities
         * and replay one client's response to another. OpenSSL fails here
         * only when out of memory; stopping is the one safe answer. */
        abort();
    }
}

const char *store_shared_fs_name(unsigned long f_type)
{
    /* Magic numbers from linux/magic.h and the file systems' own sources. */
    static const struct {
        uint32_t magic;
        const char *name;
    } shared[] = {
        {0x6969u, "NFS"},
        {0x517Bu, "SMB"},
        {0xFF534D42u, "CIFS"},
        {0xFE534D42u, "SMB2"},
        {0x00C36400u, "Ceph"},
        {0x01021997u, "9p"},
        {0x5346414Fu, "AFS"},
        {0x6B414653u, "AFS"},
        {0x73757245u, "Coda"},
        {0x0000564Cu, "NCP"},
        {0x65735546u, "FUSE"},
        {0x0BD00BD0u, "Lustre"},
        {0x01161970u, "GFS2"},
        {0x7461636Fu, "OCFS2"},
        {0x47504653u, "GPFS"},
        {0x20030528u, "OrangeFS"},
        {0x19830326u, "BeeGFS"},
    };
    uint32_t t = (uint32_t)(f_type & 0xFFFFFFFFu);

    for (size_t i = 0; i < sizeof(shared) / sizeof(shared[0]); i++) {
        if (shared[i].magic == t) {
            return shared[i].name;
        }
    }
    return NULL;
}
