/*
 * fuzz_key.c - the Idempotency-Key parser on arbitrary field values.
 *
 * The input is the raw field value. Invariants:
 *   - the parser never writes more than max_len bytes (the output buffer is
 *     exactly that large, so ASan sees an overrun) nor reads past raw_len;
 *   - an accepted key is 1..max_len bytes of visible ASCII (0x21-0x7e);
 *   - a bare value is accepted only as itself; a quoted one only if
 *     re-quoting the key gives a value that parses to the same key;
 *   - the limit only ever turns OK into TOO_LONG: a key accepted under a
 *     small limit is accepted, unchanged, under a larger one.
 */
#include "fuzz.h"

#include <string.h>

#include "policy.h"

#define SMALL_MAX 4
#define LARGE_MAX 255

/* Parses with an output buffer of exactly max_len bytes. */
static enum idem_key_status parse(const uint8_t *raw, size_t len, size_t max_len, char **key,
                                  size_t *key_len)
{
    enum idem_key_status st;
    char *out = malloc(max_len);

    FUZZ_CHECK(out != NULL);
    st = idem_key_parse((const char *)raw, len, max_len, out, key_len);
    FUZZ_CHECK(idem_key_status_text(st) != NULL);
    if (st == IDEM_KEY_OK) {
        FUZZ_CHECK(*key_len >= 1 && *key_len <= max_len);
        for (size_t i = 0; i < *key_len; i++)
            FUZZ_CHECK(out[i] >= 0x21 && out[i] <= 0x7e);
    } else {
        FUZZ_CHECK(*key_len == 0);
    }
    *key = out;
    return st;
}

/* The sf-string that serialises key (RFC 8941 section 4.1.6). */
static size_t quote(const char *key, size_t len, char *out)
{
    size_t n = 0;
    out[n++] = '"';
    for (size_t i = 0; i < len; i++) {
        if (key[i] == '"' || key[i] == '\\')
            out[n++] = '\\';
        out[n++] = key[i];
    }
    out[n++] = '"';
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *small = NULL;
    char *large = NULL;
    size_t small_len = 0;
    size_t large_len = 0;
    enum idem_key_status small_st = parse(data, size, SMALL_MAX, &small, &small_len);
    enum idem_key_status large_st = parse(data, size, LARGE_MAX, &large, &large_len);

    if (small_st == IDEM_KEY_OK) {
        FUZZ_CHECK(large_st == IDEM_KEY_OK);
        FUZZ_CHECK(large_len == small_len && memcmp(large, small, small_len) == 0);
    }
    if (large_st == IDEM_KEY_OK && large_len <= SMALL_MAX)
        FUZZ_CHECK(small_st == IDEM_KEY_OK);
    if (small_st != IDEM_KEY_OK && small_st != IDEM_KEY_TOO_LONG)
        FUZZ_CHECK(large_st != IDEM_KEY_OK);

    if (large_st == IDEM_KEY_OK) {
        if (size > 0 && data[0] != '"') {
            /* A bare key is the value itself. */
            FUZZ_CHECK(large_len == size && memcmp(large, data, size) == 0);
        } else {
            /* Quoting the key again gives the same key. */
            char requoted[2 * LARGE_MAX + 2];
            size_t rlen = quote(large, large_len, requoted);
            char *again = NULL;
            size_t again_len = 0;
            uint8_t *copy = malloc(rlen);
            FUZZ_CHECK(copy != NULL);
            memcpy(copy, requoted, rlen);
            FUZZ_CHECK(parse(copy, rlen, LARGE_MAX, &again, &again_len) == IDEM_KEY_OK);
            FUZZ_CHECK(again_len == large_len && memcmp(again, large, large_len) == 0);
            free(again);
            free(copy);
        }
    }
    free(small);
    free(large);
    return 0;
}
