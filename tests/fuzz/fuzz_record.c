/*
 * fuzz_record.c - the store's record decoder on arbitrary bytes: what LMDB
 * hands back is never trusted (record.c), and records outlive the code that
 * wrote them.
 *
 * Invariants:
 *   - store_record_decode() either fails with STORE_ECORRUPT (or ENOMEM)
 *     leaving a record that store_record_clear() accepts, or succeeds;
 *   - a decoded record re-encodes to exactly the input (the layout has one
 *     encoding per record: version 2 with a raw fingerprint, version 1
 *     without), and decoding that gives the same record;
 *   - the headers blob of a COMPLETE record goes through the proxy's
 *     idem_headers_decode() (as a replay would) without harm, and when it
 *     decodes it re-encodes to the same bytes.
 */
#include "fuzz.h"

#include <string.h>

#include "policy.h"
#include "store.h"

static void check_same(const struct store_record *a, const struct store_record *b)
{
    FUZZ_CHECK(a->state == b->state);
    FUZZ_CHECK(memcmp(a->lease_id, b->lease_id, STORE_LEASE_ID_BYTES) == 0);
    FUZZ_CHECK(a->lease_expires_ms == b->lease_expires_ms);
    FUZZ_CHECK(a->expires_ms == b->expires_ms);
    FUZZ_CHECK(memcmp(a->fingerprint, b->fingerprint, STORE_FINGERPRINT_BYTES) == 0);
    FUZZ_CHECK(a->has_raw_fingerprint == b->has_raw_fingerprint);
    FUZZ_CHECK(memcmp(a->raw_fingerprint, b->raw_fingerprint, STORE_FINGERPRINT_BYTES) == 0);
    FUZZ_CHECK(a->status == b->status);
    FUZZ_CHECK(a->headers_len == b->headers_len && a->body_len == b->body_len);
    FUZZ_CHECK(a->headers_len == 0 || memcmp(a->headers, b->headers, a->headers_len) == 0);
    FUZZ_CHECK(a->body_len == 0 || memcmp(a->body, b->body, a->body_len) == 0);
}

static void check_headers_blob(const struct store_record *rec)
{
    struct idem_headers h = {0};
    uint8_t *buf = NULL;
    size_t len = 0;

    if (idem_headers_decode(rec->headers, rec->headers_len, &h) == 0) {
        FUZZ_CHECK(idem_headers_encode(&h, &buf, &len) == 0);
        FUZZ_CHECK(len == rec->headers_len);
        FUZZ_CHECK(len == 0 || memcmp(buf, rec->headers, len) == 0);
        free(buf);
    }
    idem_headers_clear(&h);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct store_record rec;
    struct store_record again;
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc;

    memset(&again, 0, sizeof(again));
    rc = store_record_decode(data, size, &rec);
    if (rc != STORE_OK) {
        FUZZ_CHECK(rc == STORE_ECORRUPT || rc == STORE_ENOMEM);
        store_record_clear(&rec);
        return 0;
    }
    FUZZ_CHECK(rec.state == STORE_STATE_IN_PROGRESS || rec.state == STORE_STATE_COMPLETE);
    if (rec.state == STORE_STATE_COMPLETE) {
        FUZZ_CHECK(rec.status >= 100 && rec.status <= 599);
        FUZZ_CHECK(rec.headers_len + rec.body_len <= size);
        check_headers_blob(&rec);
    } else {
        FUZZ_CHECK(rec.headers_len == 0 && rec.body_len == 0);
    }

    FUZZ_CHECK(store_record_encode(&rec, &buf, &len) == STORE_OK);
    FUZZ_CHECK(len == size && memcmp(buf, data, size) == 0);
    FUZZ_CHECK(store_record_decode(buf, len, &again) == STORE_OK);
    check_same(&rec, &again);

    free(buf);
    store_record_clear(&again);
    store_record_clear(&rec);
    return 0;
}
