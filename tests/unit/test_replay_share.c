/*
 * test_replay_share.c - one copy of a stored answer for its concurrent
 * replays (replay_share.h): one copy per record version, counted once
 * against the budget and given back with the last reference; another
 * version (a new lease, expiry or length) never gets an older copy; a copy
 * that does not fit is refused; and threads replaying one version at once
 * end up with one copy between them.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "replay_share.h"

static uint8_t body_a[1000];
static uint8_t body_b[1000];

static struct store_record record(uint8_t lease, uint8_t *body, size_t len)
{
    struct store_record rec;
    memset(&rec, 0, sizeof(rec));
    rec.state = STORE_STATE_COMPLETE;
    memset(rec.lease_id, lease, sizeof(rec.lease_id));
    rec.expires_ms = 1000;
    rec.status = 201;
    rec.has_raw_fingerprint = true;
    rec.body = body;
    rec.body_len = len;
    return rec;
}

static void test_one_copy_per_version(void **state)
{
    _Atomic uint64_t buffered = 0;
    struct replay_share *t = replay_share_new(&buffered, 10000);
    uint8_t key[STORE_KEY_BYTES] = {7};
    struct store_record rec = record(1, body_a, sizeof(body_a));
    struct replay_body *b1 = NULL, *b2 = NULL, *b3 = NULL;
    (void)state;

    memset(body_a, 'a', sizeof(body_a));
    memset(body_b, 'b', sizeof(body_b));
    assert_non_null(t);
    assert_int_equal(replay_share_get(t, key, &rec, &b1), REPLAY_SHARE_OK);
    assert_int_equal(replay_share_get(t, key, &rec, &b2), REPLAY_SHARE_OK);
    assert_ptr_equal(b1, b2);
    assert_ptr_not_equal(replay_body_data(b1), body_a); /* a copy, not the store's bytes */
    assert_memory_equal(replay_body_data(b1), body_a, sizeof(body_a));
    assert_int_equal(replay_body_len(b1), sizeof(body_a));
    assert_int_equal(atomic_load(&buffered), sizeof(body_a)); /* counted once */

    /* The key forgotten and run again: a new lease, same length, other
     * bytes. Never the old copy. */
    rec = record(2, body_b, sizeof(body_b));
    assert_int_equal(replay_share_get(t, key, &rec, &b3), REPLAY_SHARE_OK);
    assert_ptr_not_equal(b3, b1);
    assert_memory_equal(replay_body_data(b3), body_b, sizeof(body_b));
    assert_int_equal(atomic_load(&buffered), 2 * sizeof(body_a));
    replay_body_put(b3);
    /* Only the expiry differs (a record past its TTL acquired and completed
     * again within one lease id would not happen; the expiry tells anyway). */
    rec = record(1, body_b, sizeof(body_b));
    rec.expires_ms = 2000;
    assert_int_equal(replay_share_get(t, key, &rec, &b3), REPLAY_SHARE_OK);
    assert_ptr_not_equal(b3, b1);
    replay_body_put(b3);
    /* Another key with the same record: its own copy. */
    key[0] = 8;
    rec = record(1, body_b, sizeof(body_b));
    assert_int_equal(replay_share_get(t, key, &rec, &b3), REPLAY_SHARE_OK);
    assert_ptr_not_equal(b3, b1);
    replay_body_put(b3);
    assert_int_equal(atomic_load(&buffered), sizeof(body_a));

    replay_body_put(b1);
    assert_int_equal(atomic_load(&buffered), sizeof(body_a)); /* b2 still holds it */
    replay_body_put(b2);
    assert_int_equal(atomic_load(&buffered), 0);
    /* Nothing kept past the last reference: the next replay copies again. */
    key[0] = 7;
    rec = record(1, body_a, sizeof(body_a));
    assert_int_equal(replay_share_get(t, key, &rec, &b1), REPLAY_SHARE_OK);
    assert_int_equal(atomic_load(&buffered), sizeof(body_a));
    replay_body_put(b1);
    replay_body_put(NULL);
    replay_share_free(t);
    replay_share_free(NULL);
}

static void test_budget(void **state)
{
    _Atomic uint64_t buffered = 9500;
    struct replay_share *t = replay_share_new(&buffered, 10000);
    uint8_t key[STORE_KEY_BYTES] = {1};
    struct store_record rec = record(1, body_a, sizeof(body_a));
    struct store_record own;
    struct replay_body *b1 = NULL, *b2 = NULL;
    (void)state;

    /* A copy that would pass the bound is refused, and nothing counted. */
    assert_int_equal(replay_share_get(t, key, &rec, &b1), REPLAY_SHARE_FULL);
    assert_null(b1);
    assert_int_equal(atomic_load(&buffered), 9500);
    atomic_store(&buffered, 8500);
    assert_int_equal(replay_share_get(t, key, &rec, &b1), REPLAY_SHARE_OK);
    assert_int_equal(atomic_load(&buffered), 9500);
    /* Over the bound now (other requests' bodies), a replay of the held
     * version still shares it: it adds nothing. */
    atomic_fetch_add(&buffered, 1000);
    assert_int_equal(replay_share_get(t, key, &rec, &b2), REPLAY_SHARE_OK);
    assert_ptr_equal(b1, b2);
    atomic_fetch_sub(&buffered, 1000);
    replay_body_put(b2);

    /* A writer's copy of the same version is dropped for the held one... */
    own = record(1, malloc(sizeof(body_a)), sizeof(body_a));
    assert_non_null(own.body);
    memcpy(own.body, body_a, sizeof(body_a));
    assert_int_equal(replay_share_adopt(t, key, &own, &b2), REPLAY_SHARE_OK);
    assert_ptr_equal(b1, b2);
    assert_non_null(own.body); /* still the caller's */
    replay_body_put(b2);
    replay_body_put(b1);
    assert_int_equal(atomic_load(&buffered), 8500);
    /* ...and becomes the copy when none is held: taken, not copied. */
    {
        uint8_t *mine = own.body;
        assert_int_equal(replay_share_adopt(t, key, &own, &b1), REPLAY_SHARE_OK);
        assert_null(own.body);
        assert_ptr_equal(replay_body_data(b1), mine);
        assert_int_equal(atomic_load(&buffered), 9500);
        replay_body_put(b1);
    }
    assert_int_equal(atomic_load(&buffered), 8500);
    replay_share_free(t);
}

#define THREADS 8
#define ROUNDS 2000

struct racer {
    struct replay_share *t;
    struct store_record rec;
    const struct replay_body *seen[ROUNDS];
};

static void *race(void *arg)
{
    struct racer *r = arg;
    uint8_t key[STORE_KEY_BYTES] = {3};
    struct replay_body *b = NULL;
    struct replay_body *held = NULL;

    /* Each thread keeps one reference across the rounds, so the version is
     * held throughout once the first copy is made. */
    for (int i = 0; i < ROUNDS; i++) {
        if (replay_share_get(r->t, key, &r->rec, &b) != REPLAY_SHARE_OK)
            return "get failed";
        if (memcmp(replay_body_data(b), body_a, sizeof(body_a)) != 0)
            return "bytes differ";
        r->seen[i] = b;
        if (held == NULL)
            held = b;
        else
            replay_body_put(b);
    }
    replay_body_put(held);
    return NULL;
}

static void test_threads_share(void **state)
{
    _Atomic uint64_t buffered = 0;
    /* Room for a single copy: a second one made at the same time would be
     * refused. */
    struct replay_share *t = replay_share_new(&buffered, sizeof(body_a));
    struct racer *r = calloc(THREADS, sizeof(*r));
    pthread_t th[THREADS];
    (void)state;

    assert_non_null(r);
    memset(body_a, 'a', sizeof(body_a));
    for (int i = 0; i < THREADS; i++) {
        r[i].t = t;
        r[i].rec = record(5, body_a, sizeof(body_a));
        assert_int_equal(pthread_create(&th[i], NULL, race, &r[i]), 0);
    }
    for (int i = 0; i < THREADS; i++) {
        void *res = NULL;
        pthread_join(th[i], &res);
        assert_null(res);
    }
    assert_int_equal(atomic_load(&buffered), 0);
    free(r);
    replay_share_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_copy_per_version),
        cmocka_unit_test(test_budget),
        cmocka_unit_test(test_threads_share),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
