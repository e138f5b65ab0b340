/*
 * fuzz_json.c - the canonical JSON of fingerprint "auto"
 * (proxy/canonical_json.h), differentially against jansson, which made the
 * canonical form before and whose output stored fingerprints hold.
 *
 * The input is a request body. Invariants:
 *   - jansson accepts it and it holds no real number: the output is
 *     byte for byte jansson's (json_dumps, compact, sorted keys);
 *   - jansson accepts it with reals: it is accepted, and jansson reads the
 *     output as the same document (json_equal; numbers are kept as written);
 *   - jansson refuses it: it is refused, unless jansson's reason is a
 *     number too big for it (json_error_numeric_overflow);
 *   - with a NUL byte in the input, refusing is always allowed: jansson's
 *     lexer skips one right after a number or literal, which is not JSON;
 *   - an output is never longer than the input, holds no NUL, and is its
 *     own canonical form.
 */
#include "fuzz.h"

#include <jansson.h>
#include <stdbool.h>
#include <string.h>

#include "canonical_json.h"

static bool has_real(const json_t *j)
{
    const char *k;
    json_t *v;
    size_t i;

    if (json_is_real(j))
        return true;
    if (json_is_array(j)) {
        json_array_foreach(j, i, v)
        {
            if (has_real(v))
                return true;
        }
    }
    if (json_is_object(j)) {
        json_object_foreach((json_t *)j, k, v)
        {
            if (has_real(v))
                return true;
        }
    }
    return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    json_error_t err;
    json_t *tree = json_loadb((const char *)data, size,
                              JSON_DECODE_ANY | JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &err);
    char *out = NULL;
    size_t out_len = 0;
    int rc = idem_canonical_json(data, size, &out, &out_len);
    bool nul = memchr(data, '\0', size) != NULL;

    FUZZ_CHECK(rc == 0 || rc == IDEM_CJSON_NOT_JSON);
    FUZZ_CHECK((rc == 0) == (out != NULL));
    if (rc == 0) {
        char *again = NULL;
        size_t again_len = 0;
        FUZZ_CHECK(out_len <= size && strlen(out) == out_len);
        FUZZ_CHECK(idem_canonical_json(out, out_len, &again, &again_len) == 0);
        FUZZ_CHECK(again_len == out_len && memcmp(again, out, out_len) == 0);
        free(again);
    } else {
        FUZZ_CHECK(out_len == 0);
    }

    if (tree != NULL && !has_real(tree)) {
        char *want = json_dumps(tree, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
        FUZZ_CHECK(want != NULL);
        FUZZ_CHECK(rc == 0 || nul);
        if (rc == 0)
            FUZZ_CHECK(strcmp(out, want) == 0);
        free(want);
    } else if (tree != NULL) {
        FUZZ_CHECK(rc == 0 || nul);
        if (rc == 0) {
            json_t *back = json_loadb(out, out_len, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
            FUZZ_CHECK(back != NULL && json_equal(tree, back));
            json_decref(back);
        }
    } else if (rc == 0) {
        FUZZ_CHECK(json_error_code(&err) == json_error_numeric_overflow);
    }
    json_decref(tree);
    free(out);
    return 0;
}
