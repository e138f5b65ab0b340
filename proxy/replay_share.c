/*
 * replay_share.c - one copy of a stored answer for all its replays at once
 * (see replay_share.h).
 */
#include "replay_share.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* Record keys are SHA-256 outputs: their first byte spreads them evenly. */
#define SHARE_BUCKETS 256

enum body_state {
    BODY_COPYING, /* in the table, counted; its bytes are being copied */
    BODY_READY,   /* data holds them, never to change */
    BODY_FAILED,  /* the copy could not be allocated; out of the table */
};

struct replay_body {
    struct replay_share *t;
    struct replay_body *next; /* in its bucket, while linked */
    /* under t->lock */
    unsigned long refs;
    enum body_state state;
    bool linked;
    /* the version (see replay_share.h) */
    uint8_t key[STORE_KEY_BYTES];
    uint8_t lease_id[STORE_LEASE_ID_BYTES];
    int64_t expires_ms;
    int status;
    size_t headers_len;
    bool has_raw_fingerprint;
    uint8_t fingerprint[STORE_FINGERPRINT_BYTES];
    uint8_t raw_fingerprint[STORE_FINGERPRINT_BYTES];
    /* the copy: immutable once published */
    uint8_t *data;
    size_t len;
};

struct replay_share {
    pthread_mutex_t lock;
    pthread_cond_t ready; /* a copy became BODY_READY or BODY_FAILED */
    struct replay_body *buckets[SHARE_BUCKETS];
    _Atomic uint64_t *buffered;
    uint64_t max_buffered;
};

struct replay_share *replay_share_new(_Atomic uint64_t *buffered, uint64_t max_buffered)
{
    struct replay_share *t = calloc(1, sizeof(*t));

    if (t == NULL)
        goto out;
    if (pthread_mutex_init(&t->lock, NULL) != 0) {
        free(t);
        t = NULL;
        goto out;
    }
    if (pthread_cond_init(&t->ready, NULL) != 0) {
        pthread_mutex_destroy(&t->lock);
        free(t);
        t = NULL;
        goto out;
    }
    t->buffered = buffered;
    t->max_buffered = max_buffered;
out:
    return t;
}

void replay_share_free(struct replay_share *t)
{
    if (t == NULL)
        return;
    pthread_cond_destroy(&t->ready);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

static bool same_version(const struct replay_body *b, const uint8_t key[STORE_KEY_BYTES],
                         const struct store_record *rec)
{
    return memcmp(b->key, key, STORE_KEY_BYTES) == 0 &&
           memcmp(b->lease_id, rec->lease_id, STORE_LEASE_ID_BYTES) == 0 &&
           b->expires_ms == rec->expires_ms && b->status == rec->status &&
           b->headers_len == rec->headers_len && b->len == rec->body_len &&
           b->has_raw_fingerprint == rec->has_raw_fingerprint &&
           memcmp(b->fingerprint, rec->fingerprint, STORE_FINGERPRINT_BYTES) == 0 &&
           (!rec->has_raw_fingerprint ||
            memcmp(b->raw_fingerprint, rec->raw_fingerprint, STORE_FINGERPRINT_BYTES) == 0);
}

/* The live copy of this version with one more reference, or NULL. Under
 * t->lock. */
static struct replay_body *find_ref(struct replay_share *t, const uint8_t key[STORE_KEY_BYTES],
                                    const struct store_record *rec)
{
    struct replay_body *b = t->buckets[key[0]];

    while (b != NULL && !same_version(b, key, rec))
        b = b->next;
    if (b != NULL)
        b->refs++;
    return b;
}

static void body_destroy(struct replay_body *b)
{
    atomic_fetch_sub(b->t->buffered, (uint64_t)b->len);
    free(b->data);
    free(b);
}

/* Takes the copy out of the table (under t->lock). */
static void unlink_body(struct replay_share *t, struct replay_body *b)
{
    struct replay_body **pp = &t->buckets[b->key[0]];

    while (*pp != b)
        pp = &(*pp)->next;
    *pp = b->next;
    b->linked = false;
}

/*
 * With data NULL, rec's body is copied; otherwise data (rec's body, owned by
 * the caller) becomes the copy, and *taken says so.
 *
 * The copy is in the table, counted and referenced, before its bytes are:
 * a replay of the same version on another worker meanwhile waits for them
 * (t->ready) rather than make a second copy, which might not fit next to
 * the first and be refused. The wait lasts as long as that copy takes to
 * make (milliseconds), which the waiter would otherwise spend copying.
 */
static int share(struct replay_share *t, const uint8_t key[STORE_KEY_BYTES],
                 const struct store_record *rec, uint8_t *data, bool *taken,
                 struct replay_body **out)
{
    int rc = REPLAY_SHARE_OK;
    struct replay_body *b = NULL;
    struct replay_body *put = NULL;
    uint8_t *copy = NULL;

    *out = NULL;
    pthread_mutex_lock(&t->lock);
    b = find_ref(t, key, rec);
    if (b != NULL) {
        while (b->state == BODY_COPYING)
            pthread_cond_wait(&t->ready, &t->lock);
        if (b->state == BODY_FAILED) {
            rc = REPLAY_SHARE_ENOMEM;
            put = b;
            b = NULL;
        }
        pthread_mutex_unlock(&t->lock);
        goto out;
    }
    if (atomic_fetch_add(t->buffered, (uint64_t)rec->body_len) + rec->body_len > t->max_buffered) {
        atomic_fetch_sub(t->buffered, (uint64_t)rec->body_len);
        pthread_mutex_unlock(&t->lock);
        rc = REPLAY_SHARE_FULL;
        goto out;
    }
    b = calloc(1, sizeof(*b));
    if (b == NULL) {
        atomic_fetch_sub(t->buffered, (uint64_t)rec->body_len);
        pthread_mutex_unlock(&t->lock);
        rc = REPLAY_SHARE_ENOMEM;
        goto out;
    }
    b->t = t;
    b->refs = 1;
    memcpy(b->key, key, STORE_KEY_BYTES);
    memcpy(b->lease_id, rec->lease_id, STORE_LEASE_ID_BYTES);
    b->expires_ms = rec->expires_ms;
    b->status = rec->status;
    b->headers_len = rec->headers_len;
    b->has_raw_fingerprint = rec->has_raw_fingerprint;
    memcpy(b->fingerprint, rec->fingerprint, STORE_FINGERPRINT_BYTES);
    if (rec->has_raw_fingerprint)
        memcpy(b->raw_fingerprint, rec->raw_fingerprint, STORE_FINGERPRINT_BYTES);
    b->len = rec->body_len; /* counted from here: body_destroy() gives it back */
    if (data != NULL) {
        b->data = data;
        *taken = true;
        b->state = BODY_READY;
    } else {
        b->state = BODY_COPYING;
    }
    b->next = t->buckets[key[0]];
    t->buckets[key[0]] = b;
    b->linked = true;
    pthread_mutex_unlock(&t->lock);
    if (data != NULL)
        goto out;

    /* Outside the lock: 10 MiB take milliseconds to copy. */
    copy = malloc(rec->body_len);
    if (copy != NULL)
        memcpy(copy, rec->body, rec->body_len);
    pthread_mutex_lock(&t->lock);
    b->data = copy;
    if (copy != NULL) {
        b->state = BODY_READY;
    } else {
        /* Its waiters give their references back; a later replay tries
         * again with a copy of its own. */
        b->state = BODY_FAILED;
        unlink_body(t, b);
        rc = REPLAY_SHARE_ENOMEM;
        put = b;
        b = NULL;
    }
    pthread_cond_broadcast(&t->ready);
    pthread_mutex_unlock(&t->lock);
out:
    replay_body_put(put);
    *out = b;
    return rc;
}

int replay_share_get(struct replay_share *t, const uint8_t key[STORE_KEY_BYTES],
                     const struct store_record *rec, struct replay_body **out)
{
    return share(t, key, rec, NULL, NULL, out);
}

int replay_share_adopt(struct replay_share *t, const uint8_t key[STORE_KEY_BYTES],
                       struct store_record *rec, struct replay_body **out)
{
    bool taken = false;
    int rc = share(t, key, rec, rec->body, &taken, out);

    if (taken) {
        rec->body = NULL;
        rec->body_len = 0;
    }
    return rc;
}

bool replay_body_is(const struct replay_body *b, const uint8_t key[STORE_KEY_BYTES],
                    const struct store_record *rec)
{
    return same_version(b, key, rec);
}

const void *replay_body_data(const struct replay_body *b)
{
    return b->data;
}

size_t replay_body_len(const struct replay_body *b)
{
    return b->len;
}

void replay_body_put(void *cls)
{
    struct replay_body *b = cls;
    struct replay_share *t;
    bool last;

    if (b == NULL)
        return;
    t = b->t;
    pthread_mutex_lock(&t->lock);
    last = --b->refs == 0;
    if (last && b->linked)
        unlink_body(t, b);
    pthread_mutex_unlock(&t->lock);
    if (last)
        body_destroy(b);
}
