/*
 * record.c - the versioned, binary-safe encoding of a record.
 *
 * Layout, version 2 (every integer little-endian, whatever the host):
 *
 *   offset  size  field
 *        0     1  version (2)
 *        1     1  state (1 IN_PROGRESS, 2 COMPLETE)
 *        2    16  lease id
 *       18     8  lease_expires_ms (two's complement)
 *       26     8  expires_ms (two's complement)
 *       34    32  fingerprint (canonical)
 *       66    32  raw fingerprint
 *   COMPLETE only:
 *       98     4  status (100..599)
 *      102     8  headers length H
 *      110     H  headers
 *    110+H     8  body length B
 *    118+H     B  body
 *
 * Version 1 is the same without the raw fingerprint (the status at offset
 * 66). It is still read: stores written before version 2 keep working, and
 * their records are compared on the canonical fingerprint alone. A record
 * is written as version 2 when it has a raw fingerprint (every record the
 * proxy acquires) and as version 1 otherwise (a version-1 record that is
 * completed, extended or moved by purge, whose raw fingerprint is unknown),
 * so that every record still has exactly one encoding.
 *
 * The version byte comes first so that a later layout can be told apart
 * from this one. The decoder trusts nothing: stored values outlive the code
 * that wrote them, LMDB has no checksums, and the fuzzer feeds it garbage.
 */
#include "store.h"
#include "store_internal.h"

#include <stdlib.h>
#include <string.h>

#define RECORD_VERSION_1 1
#define RECORD_VERSION_2 2
#define RECORD_V1_FIXED_BYTES (1 + 1 + STORE_LEASE_ID_BYTES + 8 + 8 + STORE_FINGERPRINT_BYTES)
#define RECORD_V2_FIXED_BYTES (RECORD_V1_FIXED_BYTES + STORE_FINGERPRINT_BYTES)
#define RECORD_RAW_FP_OFFSET RECORD_V1_FIXED_BYTES
#define RECORD_STATUS_BYTES 4
#define RECORD_LEN_BYTES 8

/* RFC 9110 section 15: every valid status code is within 100..599. */
#define RECORD_STATUS_MIN 100
#define RECORD_STATUS_MAX 599

static void put_u64(uint8_t *p, uint64_t v)
{
    for (size_t i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (size_t i = 0; i < 8; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

static void put_u32(uint8_t *p, uint32_t v)
{
    for (size_t i = 0; i < 4; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (size_t i = 0; i < 4; i++) {
        v |= (uint32_t)p[i] << (8 * i);
    }
    return v;
}

/* Two's complement conversions spelled out: a plain cast of an out-of-range
 * unsigned value to a signed type is implementation-defined. */
static uint64_t i64_to_u64(int64_t v)
{
    return (uint64_t)v;
}

static int64_t u64_to_i64(uint64_t u)
{
    int64_t v;
    if (u <= (uint64_t)INT64_MAX) {
        v = (int64_t)u;
    } else {
        v = -(int64_t)(UINT64_MAX - u) - 1;
    }
    return v;
}

static bool status_valid(int status)
{
    return status >= RECORD_STATUS_MIN && status <= RECORD_STATUS_MAX;
}

/* A bounds-checked cursor over the input: every read goes through take(). */
struct reader {
    const uint8_t *p;
    size_t left;
};

static const uint8_t *take(struct reader *r, size_t n)
{
    const uint8_t *p = NULL;
    if (n <= r->left) {
        p = r->p;
        r->p += n;
        r->left -= n;
    }
    return p;
}

/* Reads a length field followed by that many bytes. The length is compared
 * with what is left before anything is added to it, so a huge length can
 * neither overflow nor point past the end. */
static bool take_blob(struct reader *r, const uint8_t **data, size_t *len)
{
    bool ok = false;
    const uint8_t *lp = take(r, RECORD_LEN_BYTES);
    if (lp == NULL) {
        goto out;
    }
    uint64_t n = get_u64(lp);
    if (n > (uint64_t)r->left) {
        goto out;
    }
    *len = (size_t)n;
    *data = n > 0 ? take(r, (size_t)n) : NULL;
    ok = true;
out:
    return ok;
}

bool store_record_peek_expiry(const void *buf, size_t len, int64_t *expires_ms)
{
    const uint8_t *p = buf;

    if (p == NULL || len < 34 || (p[0] != RECORD_VERSION_1 && p[0] != RECORD_VERSION_2)) {
        return false;
    }
    *expires_ms = u64_to_i64(get_u64(p + 26));
    return true;
}

int store_record_parse(const void *buf, size_t len, struct store_record_view *out)
{
    int rc = STORE_ECORRUPT;
    struct store_record_view v;
    struct reader r = {buf, len};
    const uint8_t *p;
    uint8_t version;

    memset(&v, 0, sizeof(v));
    memset(out, 0, sizeof(*out));
    if (buf == NULL) {
        goto out;
    }
    version = len > 0 ? *(const uint8_t *)buf : 0;
    if (version != RECORD_VERSION_1 && version != RECORD_VERSION_2) {
        goto out;
    }
    v.has_raw_fingerprint = version == RECORD_VERSION_2;
    p = take(&r, v.has_raw_fingerprint ? RECORD_V2_FIXED_BYTES : RECORD_V1_FIXED_BYTES);
    if (p == NULL) {
        goto out;
    }
    if (p[1] == STORE_STATE_IN_PROGRESS) {
        v.state = STORE_STATE_IN_PROGRESS;
    } else if (p[1] == STORE_STATE_COMPLETE) {
        v.state = STORE_STATE_COMPLETE;
    } else {
        goto out; /* ABSENT is never stored; anything else is unknown */
    }
    memcpy(v.lease_id, p + 2, STORE_LEASE_ID_BYTES);
    v.lease_expires_ms = u64_to_i64(get_u64(p + 18));
    v.expires_ms = u64_to_i64(get_u64(p + 26));
    memcpy(v.fingerprint, p + 34, STORE_FINGERPRINT_BYTES);
    if (v.has_raw_fingerprint) {
        memcpy(v.raw_fingerprint, p + RECORD_RAW_FP_OFFSET, STORE_FINGERPRINT_BYTES);
    }

    if (v.state == STORE_STATE_COMPLETE) {
        p = take(&r, RECORD_STATUS_BYTES);
        if (p == NULL) {
            goto out;
        }
        uint32_t status = get_u32(p);
        if (status < RECORD_STATUS_MIN || status > RECORD_STATUS_MAX) {
            goto out;
        }
        v.status = (int)status;
        if (!take_blob(&r, &v.headers, &v.headers_len) || !take_blob(&r, &v.body, &v.body_len)) {
            goto out;
        }
    }
    if (r.left != 0) {
        goto out; /* trailing bytes: not something this version wrote */
    }
    *out = v;
    rc = STORE_OK;
out:
    return rc;
}

int store_record_size(const struct store_record_view *v, size_t *out)
{
    int rc = STORE_EINVAL;
    size_t n = v->has_raw_fingerprint ? RECORD_V2_FIXED_BYTES : RECORD_V1_FIXED_BYTES;

    if (v->state == STORE_STATE_COMPLETE) {
        if (!status_valid(v->status) || (v->headers == NULL && v->headers_len > 0) ||
            (v->body == NULL && v->body_len > 0)) {
            goto out;
        }
        n += RECORD_STATUS_BYTES + 2 * RECORD_LEN_BYTES;
        if (v->headers_len > SIZE_MAX - n) {
            goto out;
        }
        n += v->headers_len;
        if (v->body_len > SIZE_MAX - n) {
            goto out;
        }
        n += v->body_len;
    } else if (v->state != STORE_STATE_IN_PROGRESS) {
        goto out;
    }
    *out = n;
    rc = STORE_OK;
out:
    return rc;
}

void store_record_write(const struct store_record_view *v, uint8_t *buf)
{
    uint8_t *p = buf;

    p[0] = v->has_raw_fingerprint ? RECORD_VERSION_2 : RECORD_VERSION_1;
    p[1] = (uint8_t)v->state;
    memcpy(p + 2, v->lease_id, STORE_LEASE_ID_BYTES);
    put_u64(p + 18, i64_to_u64(v->lease_expires_ms));
    put_u64(p + 26, i64_to_u64(v->expires_ms));
    memcpy(p + 34, v->fingerprint, STORE_FINGERPRINT_BYTES);
    p += RECORD_V1_FIXED_BYTES;
    if (v->has_raw_fingerprint) {
        memcpy(p, v->raw_fingerprint, STORE_FINGERPRINT_BYTES);
        p += STORE_FINGERPRINT_BYTES;
    }
    if (v->state == STORE_STATE_COMPLETE) {
        put_u32(p, (uint32_t)v->status);
        p += RECORD_STATUS_BYTES;
        put_u64(p, (uint64_t)v->headers_len);
        p += RECORD_LEN_BYTES;
        if (v->headers_len > 0) {
            memcpy(p, v->headers, v->headers_len);
            p += v->headers_len;
        }
        put_u64(p, (uint64_t)v->body_len);
        p += RECORD_LEN_BYTES;
        if (v->body_len > 0) {
            memcpy(p, v->body, v->body_len);
        }
    }
}

static int dup_bytes(const uint8_t *src, size_t len, uint8_t **out)
{
    int rc = STORE_OK;
    *out = NULL;
    if (len > 0) {
        *out = malloc(len);
        if (*out == NULL) {
            rc = STORE_ENOMEM;
        } else {
            memcpy(*out, src, len);
        }
    }
    return rc;
}

int store_record_copy(const struct store_record_view *v, struct store_record *out)
{
    int rc;
    struct store_record rec;

    memset(&rec, 0, sizeof(rec));
    rec.state = v->state;
    memcpy(rec.lease_id, v->lease_id, STORE_LEASE_ID_BYTES);
    rec.lease_expires_ms = v->lease_expires_ms;
    rec.expires_ms = v->expires_ms;
    memcpy(rec.fingerprint, v->fingerprint, STORE_FINGERPRINT_BYTES);
    rec.has_raw_fingerprint = v->has_raw_fingerprint;
    if (v->has_raw_fingerprint) {
        memcpy(rec.raw_fingerprint, v->raw_fingerprint, STORE_FINGERPRINT_BYTES);
    }
    rec.status = v->status;
    rc = dup_bytes(v->headers, v->headers_len, &rec.headers);
    if (rc != STORE_OK) {
        goto out;
    }
    rec.headers_len = v->headers_len;
    rc = dup_bytes(v->body, v->body_len, &rec.body);
    if (rc != STORE_OK) {
        goto out;
    }
    rec.body_len = v->body_len;
out:
    if (rc != STORE_OK) {
        store_record_clear(&rec);
    }
    *out = rec;
    return rc;
}

int store_record_encode(const struct store_record *rec, uint8_t **out, size_t *out_len)
{
    int rc = STORE_EINVAL;
    struct store_record_view v;
    size_t n = 0;
    uint8_t *buf = NULL;

    if (rec == NULL || out == NULL || out_len == NULL) {
        goto out;
    }
    memset(&v, 0, sizeof(v));
    v.state = rec->state;
    memcpy(v.lease_id, rec->lease_id, STORE_LEASE_ID_BYTES);
    v.lease_expires_ms = rec->lease_expires_ms;
    v.expires_ms = rec->expires_ms;
    memcpy(v.fingerprint, rec->fingerprint, STORE_FINGERPRINT_BYTES);
    v.has_raw_fingerprint = rec->has_raw_fingerprint;
    if (rec->has_raw_fingerprint) {
        memcpy(v.raw_fingerprint, rec->raw_fingerprint, STORE_FINGERPRINT_BYTES);
    }
    if (rec->state == STORE_STATE_COMPLETE) {
        v.status = rec->status;
        v.headers = rec->headers;
        v.headers_len = rec->headers_len;
        v.body = rec->body;
        v.body_len = rec->body_len;
    }
    rc = store_record_size(&v, &n);
    if (rc != STORE_OK) {
        goto out;
    }
    buf = malloc(n);
    if (buf == NULL) {
        rc = STORE_ENOMEM;
        goto out;
    }
    store_record_write(&v, buf);
    *out = buf;
    *out_len = n;
out:
    return rc;
}

int store_record_decode(const void *buf, size_t len, struct store_record *out)
{
    int rc = STORE_EINVAL;
    struct store_record_view v;

    if (out == NULL) {
        goto out;
    }
    memset(out, 0, sizeof(*out));
    rc = store_record_parse(buf, len, &v);
    if (rc != STORE_OK) {
        goto out;
    }
    rc = store_record_copy(&v, out);
out:
    return rc;
}
