/*
 * test_policy.c - unit tests of the proxy's pure policy (proxy/policy.h):
 * key parsing, fingerprints, scopes, header filters, the stored header
 * encoding, the decision tables, Retry-After and problem+json bodies.
 *
 * Routes are built by hand (route_init) where a test needs one field, and
 * with config_load_string() where the config grammar is part of what is
 * tested (release_on classes, strip_headers).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>
#include <limits.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "policy.h"
#include "store.h"

/* ---- helpers ----------------------------------------------------------- */

static char path_root[] = "/";
static char scope_payments[] = "payments";
static char header_tenant[] = "X-Tenant-Id";

/* A route holding the contract's defaults (CONTRACT.md section 4), with no
 * methods or strip_headers: tests set what they need. */
static void route_init(struct config_route *r)
{
    memset(r, 0, sizeof(*r));
    r->path = path_root;
    r->scope = scope_payments;
    r->ttl_ms = 24 * 3600 * 1000;
    r->lease_ms = 30 * 1000;
    r->heartbeat_ms = 15 * 1000;
    r->wait_ms = 10 * 1000;
    r->max_body_bytes = 1024 * 1024;
    r->max_key_length = 255;
    for (int status = 500; status < 600; status++)
        r->release_on[status] = true;
    r->on_unknown = CONFIG_ON_UNKNOWN_RELEASE;
    r->fingerprint = CONFIG_FINGERPRINT_AUTO;
}

static struct config *load_config(const char *json)
{
    char err[256] = "";
    struct config *cfg = NULL;
    int rc = config_load_string(json, strlen(json), &cfg, err, sizeof(err));
    if (rc != CONFIG_OK)
        print_error("config_load_string: %s\n", err);
    assert_int_equal(rc, CONFIG_OK);
    assert_non_null(cfg);
    assert_true(cfg->n_routes >= 1);
    return cfg;
}

static void push(struct idem_headers *h, const char *name, const char *value)
{
    assert_int_equal(idem_headers_push(h, name, strlen(name), value, strlen(value)), 0);
}

static void push_n(struct idem_headers *h, const char *name, size_t name_len, const char *value,
                   size_t value_len)
{
    assert_int_equal(idem_headers_push(h, name, name_len, value, value_len), 0);
}

/* Asserts that h is exactly the name/value pairs of want, in order
 * (names compared case-sensitively: the filters must not rewrite them). */
static void assert_headers(const struct idem_headers *h, const char *const want[][2], size_t n_want)
{
    if (h->n != n_want) {
        for (size_t i = 0; i < h->n; i++)
            print_message("  got %s: %s\n", h->v[i].name, h->v[i].value);
    }
    assert_int_equal(h->n, n_want);
    for (size_t i = 0; i < n_want; i++) {
        assert_string_equal(h->v[i].name, want[i][0]);
        assert_string_equal(h->v[i].value, want[i][1]);
        assert_int_equal(h->v[i].name_len, strlen(want[i][0]));
        assert_int_equal(h->v[i].value_len, strlen(want[i][1]));
    }
}

static bool contains(const char *hay, size_t hay_len, const char *needle)
{
    size_t n = strlen(needle);
    for (size_t i = 0; n <= hay_len && i <= hay_len - n; i++)
        if (memcmp(hay + i, needle, n) == 0)
            return true;
    return false;
}

/* ---- Idempotency-Key ------------------------------------------------- */

/* Parses raw with an output buffer of exactly max_len bytes (so ASan sees
 * any write past what policy.h promises) and checks status and key. */
static void check_key(const char *raw, size_t raw_len, size_t max_len, enum idem_key_status want,
                      const char *want_key)
{
    char *out = malloc(max_len);
    size_t out_len = 12345;
    enum idem_key_status got;

    assert_non_null(out);
    got = idem_key_parse(raw, raw_len, max_len, out, &out_len);
    if (got != want)
        print_error("key of %zu bytes: got %s, want %s\n", raw_len, idem_key_status_text(got),
                    idem_key_status_text(want));
    assert_int_equal(got, want);
    if (want == IDEM_KEY_OK) {
        assert_int_equal(out_len, strlen(want_key));
        assert_memory_equal(out, want_key, out_len);
    } else {
        assert_int_equal(out_len, 0);
    }
    free(out);
}

#define CHECK_KEY(lit, want, key) check_key(lit, sizeof(lit) - 1, 255, want, key)

static void test_key_bare(void **state)
{
    char all[0x7f];
    size_t n = 0;

    (void)state;
    CHECK_KEY("abc", IDEM_KEY_OK, "abc");
    CHECK_KEY("8e3c7a2b-1f4d-4c1e-9a55-0b7d3f2e6a91", IDEM_KEY_OK,
              "8e3c7a2b-1f4d-4c1e-9a55-0b7d3f2e6a91");
    CHECK_KEY("x", IDEM_KEY_OK, "x");
    /* Every visible ASCII character except DQUOTE is allowed bare,
     * backslash included (it is only an escape inside an sf-string). */
    for (int c = 0x21; c <= 0x7e; c++)
        if (c != '"')
            all[n++] = (char)c;
    all[n] = '\0';
    check_key(all, n, 255, IDEM_KEY_OK, all);
    CHECK_KEY("a\\b", IDEM_KEY_OK, "a\\b");
}

static void test_key_sf_string_equals_bare(void **state)
{
    char quoted[16];
    char bare[16];
    size_t qlen = 0;
    size_t blen = 0;

    (void)state;
    CHECK_KEY("\"abc\"", IDEM_KEY_OK, "abc");
    assert_int_equal(idem_key_parse("\"abc\"", 5, sizeof(quoted), quoted, &qlen), IDEM_KEY_OK);
    assert_int_equal(idem_key_parse("abc", 3, sizeof(bare), bare, &blen), IDEM_KEY_OK);
    assert_int_equal(qlen, blen);
    assert_memory_equal(quoted, bare, qlen);
    CHECK_KEY("\"x\"", IDEM_KEY_OK, "x");
}

static void test_key_escapes(void **state)
{
    (void)state;
    CHECK_KEY("\"a\\\"b\"", IDEM_KEY_OK, "a\"b");
    CHECK_KEY("\"a\\\\b\"", IDEM_KEY_OK, "a\\b");
    CHECK_KEY("\"\\\\\"", IDEM_KEY_OK, "\\");
    CHECK_KEY("\"\\\"\"", IDEM_KEY_OK, "\"");
    CHECK_KEY("\"\\\"\\\\\\\"\"", IDEM_KEY_OK, "\"\\\"");
    /* RFC 8941 section 3.3.3: only \" and \\ are escapes. */
    CHECK_KEY("\"a\\bc\"", IDEM_KEY_BAD_QUOTING, NULL);
    CHECK_KEY("\"a\\nb\"", IDEM_KEY_BAD_QUOTING, NULL);
    CHECK_KEY("\"a\\", IDEM_KEY_BAD_QUOTING, NULL);
    /* The escaped quote does not close the string. */
    CHECK_KEY("\"abc\\\"", IDEM_KEY_BAD_QUOTING, NULL);
}

static void test_key_empty(void **state)
{
    char out[4];
    size_t out_len = 99;

    (void)state;
    assert_int_equal(idem_key_parse("", 0, 255, out, &out_len), IDEM_KEY_EMPTY);
    assert_int_equal(out_len, 0);
    /* raw_len is what counts, not the bytes after it. */
    assert_int_equal(idem_key_parse("abc", 0, 255, out, &out_len), IDEM_KEY_EMPTY);
    CHECK_KEY("\"\"", IDEM_KEY_EMPTY, NULL);
}

static void test_key_length(void **state)
{
    enum { MAX = 255 };
    char raw[MAX + 8];
    char want[MAX + 1];

    (void)state;
    memset(want, 'k', MAX);
    want[MAX] = '\0';

    /* Bare: exactly max, and one more. */
    memset(raw, 'k', MAX + 1);
    check_key(raw, MAX, MAX, IDEM_KEY_OK, want);
    check_key(raw, MAX + 1, MAX, IDEM_KEY_TOO_LONG, NULL);

    /* Quoted: the quotes do not count, the unescaped length does. */
    raw[0] = '"';
    memset(raw + 1, 'k', MAX);
    raw[MAX + 1] = '"';
    check_key(raw, MAX + 2, MAX, IDEM_KEY_OK, want);
    raw[MAX + 1] = 'k';
    raw[MAX + 2] = '"';
    check_key(raw, MAX + 3, MAX, IDEM_KEY_TOO_LONG, NULL);

    /* An escape pair is one character of the key. */
    raw[0] = '"';
    memset(raw + 1, 'k', MAX - 1);
    raw[MAX] = '\\';
    raw[MAX + 1] = '"';
    raw[MAX + 2] = '"';
    want[MAX - 1] = '"';
    check_key(raw, MAX + 3, MAX, IDEM_KEY_OK, want);

    /* Small limits. */
    check_key("a", 1, 1, IDEM_KEY_OK, "a");
    check_key("ab", 2, 1, IDEM_KEY_TOO_LONG, NULL);
    check_key("\"a\"", 3, 1, IDEM_KEY_OK, "a");
    check_key("\"ab\"", 4, 1, IDEM_KEY_TOO_LONG, NULL);
}

/* Every byte value in the middle of a bare and of a quoted key. */
static void test_key_characters(void **state)
{
    (void)state;
    for (int c = 0; c < 256; c++) {
        char bare[3] = {'a', (char)c, 'b'};
        char quoted[5] = {'"', 'a', (char)c, 'b', '"'};
        char want[4] = {'a', (char)c, 'b', '\0'};
        bool visible = c >= 0x21 && c <= 0x7e;

        /* '"' inside a bare key is a visible character like any other. */
        if (visible)
            check_key(bare, 3, 255, IDEM_KEY_OK, want);
        else
            check_key(bare, 3, 255, IDEM_KEY_BAD_CHAR, NULL);

        if (c == '"' || c == '\\') /* a closing quote then garbage; a bad escape */
            check_key(quoted, 5, 255, IDEM_KEY_BAD_QUOTING, NULL);
        else if (visible)
            check_key(quoted, 5, 255, IDEM_KEY_OK, want);
        else
            check_key(quoted, 5, 255, IDEM_KEY_BAD_CHAR, NULL);
    }
}

static void test_key_bad_chars_named(void **state)
{
    (void)state;
    CHECK_KEY("a b", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY(" abc", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("abc ", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("\"a b\"", IDEM_KEY_BAD_CHAR, NULL); /* a valid sf-string, not a visible key */
    CHECK_KEY("ab\x7f", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("ab\r", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("ab\ncd", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("ab\tcd", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("ab\0cd", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("\0", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("caf\xc3\xa9", IDEM_KEY_BAD_CHAR, NULL); /* UTF-8 e-acute */
    CHECK_KEY("\xff", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("\"caf\xc3\xa9\"", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("\"a\0b\"", IDEM_KEY_BAD_CHAR, NULL);
    CHECK_KEY("\"a\r\nb\"", IDEM_KEY_BAD_CHAR, NULL);
}

static void check_target(const char *t, bool want)
{
    if (idem_target_is_canonical(t, strlen(t)) != want)
        fail_msg("target %s: expected %s", t, want ? "canonical" : "refused");
}

/* Targets the proxy can route unambiguously, and the ones a normaliser
 * between the proxy and the API would read as another path. */
/* An obs-fold continuation joins the last value with one space; the byte
 * count the header caps use follows. */
static void test_headers_extend_last(void **state)
{
    struct idem_headers h = {0};
    (void)state;
    assert_int_equal(idem_headers_extend_last(&h, "x", 1), -1);
    push(&h, "X-A", "one");
    push(&h, "X-Folded", "first");
    assert_int_equal(idem_headers_extend_last(&h, "second", 6), 0);
    assert_int_equal(idem_headers_extend_last(&h, "third", 5), 0);
    assert_string_equal(h.v[0].value, "one");
    assert_string_equal(h.v[1].name, "X-Folded");
    assert_string_equal(h.v[1].value, "first second third");
    assert_int_equal(h.v[1].value_len, strlen("first second third"));
    assert_int_equal(h.bytes, strlen("X-A") + 3 + strlen("X-Folded") + 18);
    idem_headers_clear(&h);
}

static void test_target_canonical(void **state)
{
    (void)state;
    check_target("/", true);
    check_target("/v1/payments", true);
    check_target("/v1/payments/", true);
    check_target("/v1/payments?x=1&y=/../a", true);
    check_target("/v1/pay%20ments", true);
    check_target("/a...b/c..d/.e", true);
    check_target("/v1/%E2%82%AC", true);
    check_target("", false);
    check_target("*", false);
    check_target("/v1/payments#x", false);
    check_target("/v1/payments#", false);
    check_target("/v1/payments?a=1#x", false);
    check_target("/v1/pay%23ments", true);
    check_target("v1/payments", false);
    check_target("http://host/v1/payments", false);
    check_target("@host:80/v1/payments", false);
    check_target("//host/v1/payments", false);
    check_target("/v1//payments", false);
    check_target("/v1/./payments", false);
    check_target("/x/../v1/payments", false);
    check_target("/v1/payments/.", false);
    check_target("/v1/payments/..", false);
    check_target("/v1/%2e/payments", false);
    check_target("/v1/%2E%2e/payments", false);
    check_target("/v1/.%2E/payments", false);
    check_target("/v1/%70ayments", false);
    check_target("/v1%2Fpayments", false);
    check_target("/v1%5Cpayments", false);
    check_target("/v1\\payments", false);
    check_target("/v1/pay%2", false);
    check_target("/v1/pay%zz", false);
    check_target("/v1/pay ments", false);
    check_target("/v1/pay\x7fments", false);
}

static void test_key_bad_quoting(void **state)
{
    (void)state;
    CHECK_KEY("\"", IDEM_KEY_BAD_QUOTING, NULL);
    CHECK_KEY("\"abc", IDEM_KEY_BAD_QUOTING, NULL);
    CHECK_KEY("\"abc\"x", IDEM_KEY_BAD_QUOTING, NULL);
    CHECK_KEY("\"abc\" ", IDEM_KEY_BAD_QUOTING, NULL);
    CHECK_KEY("\"abc\"\"", IDEM_KEY_BAD_QUOTING, NULL);
    CHECK_KEY("\"a\";x=1", IDEM_KEY_BAD_QUOTING, NULL);
    CHECK_KEY("\"a\", \"b\"", IDEM_KEY_BAD_QUOTING, NULL);
    /* Not sf-strings: a bare key may hold '"' after its first character. */
    CHECK_KEY("ab\"c", IDEM_KEY_OK, "ab\"c");
    CHECK_KEY("abc\"", IDEM_KEY_OK, "abc\"");
    CHECK_KEY("a\"b\"", IDEM_KEY_OK, "a\"b\"");
}

static void test_key_status_text(void **state)
{
    (void)state;
    for (int s = IDEM_KEY_OK; s <= IDEM_KEY_BAD_QUOTING; s++) {
        const char *t = idem_key_status_text((enum idem_key_status)s);
        assert_non_null(t);
        assert_true(strlen(t) > 0);
    }
}

static void test_key_loghash(void **state)
{
    char a[9];
    char b[9];
    char c[9];

    char d[9];
    char plain[9];
    uint8_t salt[STORE_LOG_SALT_BYTES] = {1, 2, 3};
    uint8_t other_salt[STORE_LOG_SALT_BYTES] = {9};
    uint8_t k1[STORE_KEY_BYTES], k2[STORE_KEY_BYTES];

    (void)state;
    store_key_derive("payments", 8, "secret-key-1", 12, k1);
    store_key_derive("payments", 8, "secret-key-2", 12, k2);
    idem_key_loghash(salt, k1, a);
    idem_key_loghash(salt, k1, b);
    idem_key_loghash(salt, k2, c);
    idem_key_loghash(other_salt, k1, d);
    assert_int_equal(strlen(a), 8);
    assert_string_equal(a, b);
    assert_string_not_equal(a, c);
    assert_int_equal(strspn(a, "0123456789abcdef"), 8);
    /* Keyed by the store's salt: not the record key's own first bytes
     * (what the log showed before, and anyone could compute). */
    assert_string_not_equal(a, d);
    for (size_t i = 0; i < 4; i++)
        snprintf(plain + 2 * i, 3, "%02x", k1[i]);
    assert_string_not_equal(a, plain);
}

/* ---- fingerprint ------------------------------------------------------ */

struct fp {
    uint8_t d[STORE_FINGERPRINT_BYTES];
};

static struct fp fingerprint(const char *method, const char *target, const char *ctype,
                             const char *body, enum config_fingerprint mode)
{
    struct fp f;
    memset(&f, 0xa5, sizeof(f));
    assert_int_equal(idem_fingerprint(method, target, strlen(target), ctype, body,
                                      body ? strlen(body) : 0, mode, f.d),
                     0);
    return f;
}

#define FP_EQUAL(x, y) assert_memory_equal((x).d, (y).d, STORE_FINGERPRINT_BYTES)
#define FP_DIFFER(x, y) assert_memory_not_equal((x).d, (y).d, STORE_FINGERPRINT_BYTES)

static const char json_a[] = "{\"b\":1,\"a\":[1,2,{\"d\":null,\"c\":\"x\"}],\"e\":\"\\u0041\"}";
static const char json_b[] = " {\n  \"e\" : \"A\",\t\"a\": [1, 2, {\"c\":\"x\",  \"d\":null}] ,"
                             "\"b\":1 }\r\n";

static void test_fingerprint_json_canonical(void **state)
{
    static const char *const types[] = {
        "application/json", "application/vnd.x+json",       "application/json; charset=utf-8",
        "Application/JSON", "application/problem+json;v=2",
    };

    (void)state;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        struct fp a =
            fingerprint("POST", "/v1/payments", types[i], json_a, CONFIG_FINGERPRINT_AUTO);
        struct fp b =
            fingerprint("POST", "/v1/payments", types[i], json_b, CONFIG_FINGERPRINT_AUTO);
        FP_EQUAL(a, b);
    }
}

/* The fingerprint is stored with every record: its formula is a format.
 * SHA-256(method NUL target NUL canonical-body), canonical = sorted keys,
 * compact. A change here makes every stored key a 422 after an upgrade. */
static void test_fingerprint_known_answer(void **state)
{
    static const char msg[] = "POST\0/v1/p?x=1\0{\"a\":1,\"b\":[true,null]}";
    uint8_t want[SHA256_DIGEST_LENGTH];
    struct fp got;

    (void)state;
    SHA256((const unsigned char *)msg, sizeof(msg) - 1, want);
    got = fingerprint("POST", "/v1/p?x=1", "application/json", "{ \"b\": [true, null], \"a\": 1 }",
                      CONFIG_FINGERPRINT_AUTO);
    assert_memory_equal(got.d, want, sizeof(want));

    SHA256((const unsigned char *)"PUT\0/x\0", 7, want);
    got = fingerprint("PUT", "/x", NULL, NULL, CONFIG_FINGERPRINT_AUTO);
    assert_memory_equal(got.d, want, sizeof(want));
}

static void test_fingerprint_raw_mode(void **state)
{
    struct fp a;
    struct fp b;

    (void)state;
    a = fingerprint("POST", "/v1/payments", "application/json", json_a, CONFIG_FINGERPRINT_RAW);
    b = fingerprint("POST", "/v1/payments", "application/json", json_b, CONFIG_FINGERPRINT_RAW);
    FP_DIFFER(a, b);
    /* RAW is deterministic. */
    b = fingerprint("POST", "/v1/payments", "application/json", json_a, CONFIG_FINGERPRINT_RAW);
    FP_EQUAL(a, b);
}

static void test_fingerprint_non_json_hashed_raw(void **state)
{
    static const char *const types[] = {"text/plain", "application/jsonx", "application/x-json",
                                        "+json", "application/json-seq"};
    struct fp raw;
    struct fp a;
    struct fp b;

    (void)state;
    raw = fingerprint("POST", "/p", "application/json", json_a, CONFIG_FINGERPRINT_RAW);
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        a = fingerprint("POST", "/p", types[i], json_a, CONFIG_FINGERPRINT_AUTO);
        b = fingerprint("POST", "/p", types[i], json_b, CONFIG_FINGERPRINT_AUTO);
        FP_DIFFER(a, b);
        FP_EQUAL(a, raw);
    }
    /* No Content-Type at all. */
    a = fingerprint("POST", "/p", NULL, json_a, CONFIG_FINGERPRINT_AUTO);
    FP_EQUAL(a, raw);
}

static void test_fingerprint_invalid_json_hashed_raw(void **state)
{
    static const char *const bodies[] = {"{\"a\":1,", "{\"a\":1}}", "{'a':1}", "{\"a\":1,\"a\":2}",
                                         "\xff\xfe"};
    (void)state;
    for (size_t i = 0; i < sizeof(bodies) / sizeof(bodies[0]); i++) {
        struct fp a =
            fingerprint("POST", "/p", "application/json", bodies[i], CONFIG_FINGERPRINT_AUTO);
        struct fp r =
            fingerprint("POST", "/p", "application/json", bodies[i], CONFIG_FINGERPRINT_RAW);
        FP_EQUAL(a, r);
    }
    /* Invalid JSON is not normalised: white space still counts. */
    {
        struct fp a =
            fingerprint("POST", "/p", "application/json", "{\"a\":1,", CONFIG_FINGERPRINT_AUTO);
        struct fp b =
            fingerprint("POST", "/p", "application/json", "{ \"a\": 1,", CONFIG_FINGERPRINT_AUTO);
        FP_DIFFER(a, b);
    }
}

static void test_fingerprint_fields_differ(void **state)
{
    struct fp base;
    struct fp f;

    (void)state;
    base = fingerprint("POST", "/v1/payments", "application/json", "{\"amount\":100}",
                       CONFIG_FINGERPRINT_AUTO);
    f = fingerprint("PATCH", "/v1/payments", "application/json", "{\"amount\":100}",
                    CONFIG_FINGERPRINT_AUTO);
    FP_DIFFER(base, f);
    f = fingerprint("POST", "/v1/payments/2", "application/json", "{\"amount\":100}",
                    CONFIG_FINGERPRINT_AUTO);
    FP_DIFFER(base, f);
    f = fingerprint("POST", "/v1/payments?x=1", "application/json", "{\"amount\":100}",
                    CONFIG_FINGERPRINT_AUTO);
    FP_DIFFER(base, f);
    f = fingerprint("POST", "/v1/payments", "application/json", "{\"amount\":101}",
                    CONFIG_FINGERPRINT_AUTO);
    FP_DIFFER(base, f);
    f = fingerprint("POST", "/v1/payments", "application/json", "", CONFIG_FINGERPRINT_AUTO);
    FP_DIFFER(base, f);
    /* Fields cannot run into each other: target "/ab" with an empty body is
     * not target "/a" with body "b". */
    base = fingerprint("POST", "/ab", NULL, "", CONFIG_FINGERPRINT_RAW);
    f = fingerprint("POST", "/a", NULL, "b", CONFIG_FINGERPRINT_RAW);
    FP_DIFFER(base, f);
}

static void test_is_json_media_type(void **state)
{
    (void)state;
    assert_true(idem_is_json_media_type("application/json"));
    assert_true(idem_is_json_media_type("  application/json ; charset=utf-8"));
    assert_true(idem_is_json_media_type("application/merge-patch+json"));
    assert_true(idem_is_json_media_type("APPLICATION/VND.API+JSON"));
    assert_false(idem_is_json_media_type(NULL));
    assert_false(idem_is_json_media_type(""));
    assert_false(idem_is_json_media_type("text/plain"));
    assert_false(idem_is_json_media_type("application/jsonp"));
    assert_false(idem_is_json_media_type("+json"));
    assert_false(idem_is_json_media_type("text/plain; x=+json"));
    /* One media type, type "/" subtype of tokens (RFC 9110 section 8.3.1).
     * A list or junk that merely ends in "+json" is not JSON: canonicalised,
     * `{"a":1,"b":2}` and `{"b":2,"a":1}` as text/plain were one request. */
    assert_false(idem_is_json_media_type("text/plain, application/vnd.api+json"));
    assert_false(idem_is_json_media_type("text/plain,application/x+json"));
    assert_false(idem_is_json_media_type("text/plain application/x+json"));
    assert_false(idem_is_json_media_type("text/x/y+json"));
    assert_false(idem_is_json_media_type("(comment) application/x+json"));
    assert_false(idem_is_json_media_type("/x+json"));
    assert_false(idem_is_json_media_type("\"application/json\""));
}

/* ---- scope -------------------------------------------------------------- */

static void test_scope_without_header(void **state)
{
    struct config_route r;
    char *out = NULL;
    size_t len = 0;

    (void)state;
    route_init(&r);
    assert_int_equal(idem_scope_build(&r, NULL, 0, &out, &len), 0);
    assert_int_equal(len, strlen("payments"));
    assert_memory_equal(out, "payments", len);
    assert_int_equal(out[len], '\0');
    free(out);
}

static void test_scope_with_header(void **state)
{
    static const char tenant_a[] = "tenant-Alpha-42";
    static const char tenant_b[] = "tenant-Bravo-43";
    struct config_route r;
    uint8_t digest[SHA256_DIGEST_LENGTH];
    char hex[2 * SHA256_DIGEST_LENGTH + 1];
    char *a = NULL;
    char *a2 = NULL;
    char *b = NULL;
    size_t alen = 0;
    size_t a2len = 0;
    size_t blen = 0;
    size_t slen = strlen("payments");

    (void)state;
    route_init(&r);
    r.scope_header = header_tenant;
    assert_int_equal(idem_scope_build(&r, tenant_a, strlen(tenant_a), &a, &alen), 0);
    assert_int_equal(idem_scope_build(&r, tenant_a, strlen(tenant_a), &a2, &a2len), 0);
    assert_int_equal(idem_scope_build(&r, tenant_b, strlen(tenant_b), &b, &blen), 0);

    /* scope NUL hex(SHA-256(value)), as policy.h documents. */
    assert_int_equal(alen, slen + 1 + 2 * SHA256_DIGEST_LENGTH);
    assert_memory_equal(a, "payments", slen + 1);
    SHA256((const unsigned char *)tenant_a, strlen(tenant_a), digest);
    for (size_t i = 0; i < sizeof(digest); i++)
        snprintf(hex + 2 * i, 3, "%02x", digest[i]);
    assert_memory_equal(a + slen + 1, hex, 2 * SHA256_DIGEST_LENGTH);

    /* Same tenant, same scope; another tenant, another scope. */
    assert_int_equal(alen, a2len);
    assert_memory_equal(a, a2, alen);
    assert_int_equal(alen, blen);
    assert_memory_not_equal(a, b, alen);

    /* CONTRACT.md section 2: the value itself is never stored. */
    assert_false(contains(a, alen, tenant_a));
    assert_false(contains(b, blen, tenant_b));
    assert_false(contains(a, alen, "Alpha"));

    /* With a header, the scope differs from the header-less scope. */
    {
        char *plain = NULL;
        size_t plain_len = 0;
        r.scope_header = NULL;
        assert_int_equal(idem_scope_build(&r, NULL, 0, &plain, &plain_len), 0);
        assert_int_not_equal(plain_len, alen);
        free(plain);
    }
    free(a);
    free(a2);
    free(b);
}

/* ---- request header filter -------------------------------------------- */

static const struct idem_forward_info fwd_info = {"10.0.0.7", "http"};

static void test_filter_request_drops_and_adds(void **state)
{
    struct idem_headers in = {0};
    struct idem_headers out = {0};
    static const char *const want[][2] = {
        {"Idempotency-Key", "\"abc\""},
        {"Content-Type", "application/json"},
        {"Accept", "*/*"},
        {"X-Request-Id", "r1"},
        {"accept", "text/plain"},
        {"Authorization", "Bearer t"},
        {"X-Forwarded-For", "10.0.0.7"},
        {"X-Forwarded-Proto", "http"},
        {"X-Forwarded-Host", "api.example:8080"},
    };

    (void)state;
    push(&in, "Host", "api.example:8080");
    push(&in, "Connection", "keep-alive, X-Custom-Hop");
    push(&in, "Idempotency-Key", "\"abc\"");
    push(&in, "x-custom-hop", "1");
    push(&in, "Keep-Alive", "timeout=5");
    push(&in, "Content-Type", "application/json");
    push(&in, "Proxy-Authorization", "Basic Zm9vOmJhcg==");
    push(&in, "Proxy-Connection", "keep-alive");
    push(&in, "TE", "trailers");
    push(&in, "Accept", "*/*");
    push(&in, "Trailer", "X-Checksum");
    push(&in, "Transfer-Encoding", "chunked");
    push(&in, "Upgrade", "h2c");
    push(&in, "X-Request-Id", "r1");
    push(&in, "Content-Length", "10");
    push(&in, "Expect", "100-continue");
    push(&in, "X-Forwarded-For", "6.6.6.6");
    push(&in, "x-forwarded-proto", "https");
    push(&in, "X-Forwarded-Host", "evil.example");
    push(&in, "accept", "text/plain");
    push(&in, "Authorization", "Bearer t");
    push(&in, "Connection", "close");

    assert_int_equal(idem_filter_request_headers(&in, &fwd_info, &out), 0);
    assert_headers(&out, want, sizeof(want) / sizeof(want[0]));
    idem_headers_clear(&in);
    idem_headers_clear(&out);
}

/* policy.h: "drops ... any client-sent X-Forwarded-*". A client must not be
 * able to hand the upstream a forged X-Forwarded-Port or -Prefix either, nor
 * an RFC 7239 Forwarded chain. */
static void test_filter_request_drops_every_x_forwarded(void **state)
{
    struct idem_headers in = {0};
    struct idem_headers out = {0};
    static const char *const want[][2] = {
        {"Accept", "*/*"},
        {"X-Forwarded-For", "10.0.0.7"},
        {"X-Forwarded-Proto", "http"},
    };

    (void)state;
    push(&in, "X-Forwarded-Port", "443");
    push(&in, "X-Forwarded-Prefix", "/admin");
    push(&in, "x-forwarded-server", "internal");
    push(&in, "X-FORWARDED-FOR", "1.2.3.4");
    push(&in, "X-Forwarded-For", "5.6.7.8");
    push(&in, "Forwarded", "for=1.2.3.4;proto=https");
    push(&in, "Accept", "*/*");
    assert_int_equal(idem_filter_request_headers(&in, &fwd_info, &out), 0);
    assert_headers(&out, want, sizeof(want) / sizeof(want[0]));
    assert_int_equal(idem_headers_count(&out, "X-Forwarded-For"), 1);
    /* No Host: no X-Forwarded-Host. */
    assert_null(idem_headers_find(&out, "X-Forwarded-Host"));
    idem_headers_clear(&in);
    idem_headers_clear(&out);
}

static void test_filter_request_connection_tokens(void **state)
{
    struct idem_headers in = {0};
    struct idem_headers out = {0};
    static const char *const want[][2] = {
        {"X-Keep", "k"},
        {"X-Forwarded-For", "10.0.0.7"},
        {"X-Forwarded-Proto", "http"},
    };

    (void)state;
    push(&in, "connection", " ,X-A ,\tx-b,,  X-C\t");
    push(&in, "X-A", "1");
    push(&in, "X-B", "2");
    push(&in, "X-C", "3");
    push(&in, "X-Keep", "k");
    push(&in, "Connection", "X-D");
    push(&in, "x-d", "4");
    assert_int_equal(idem_filter_request_headers(&in, &fwd_info, &out), 0);
    assert_headers(&out, want, sizeof(want) / sizeof(want[0]));
    idem_headers_clear(&in);
    idem_headers_clear(&out);
}

/* One bad header makes the whole request a 400 (-1), whatever its name. */
static void check_request_rejected(const char *name, size_t name_len, const char *value,
                                   size_t value_len)
{
    struct idem_headers in = {0};
    struct idem_headers out = {0};

    push(&in, "Accept", "*/*");
    push_n(&in, name, name_len, value, value_len);
    push(&in, "X-After", "a");
    assert_int_equal(idem_filter_request_headers(&in, &fwd_info, &out), -1);
    for (size_t i = 0; i < out.n; i++) {
        assert_null(memchr(out.v[i].value, '\r', out.v[i].value_len));
        assert_null(memchr(out.v[i].value, '\n', out.v[i].value_len));
    }
    idem_headers_clear(&in);
    idem_headers_clear(&out);
}

#define REJECT(name, value) check_request_rejected(name, sizeof(name) - 1, value, sizeof(value) - 1)

static void test_filter_request_rejects_bad_headers(void **state)
{
    (void)state;
    REJECT("X-A", "a\rb");
    REJECT("X-A", "a\nb");
    REJECT("X-A", "a\r\nX-Injected: 1");
    REJECT("X-A", "a\0b");
    REJECT("X-A", "\n");
    /* Dropped headers are checked too: they are part of the request. */
    REJECT("Connection", "close\r\nX-Injected: 1");
    REJECT("Host", "a\nb");
    REJECT("Idempotency-Key", "abc\r\n");
    /* Names must be RFC 9110 tokens. */
    REJECT("", "v");
    REJECT("Bad Name", "v");
    REJECT("Bad:Name", "v");
    REJECT("X-A\r\nX-B", "v");
    REJECT("X-A\0B", "v");
    REJECT("X-\xc3\xa9", "v");
    REJECT("X-(A)", "v");
    REJECT("X-A\"", "v");
    REJECT("X-A\x7f", "v");
}

static void test_filter_request_token_names_accepted(void **state)
{
    struct idem_headers in = {0};
    struct idem_headers out = {0};

    (void)state;
    push(&in, "!#$%&'*+-.^_`|~09azAZ", "v");
    push(&in, "X-Empty", "");
    push(&in, "X-Tab", "a\tb");
    assert_int_equal(idem_filter_request_headers(&in, &fwd_info, &out), 0);
    assert_string_equal(out.v[0].name, "!#$%&'*+-.^_`|~09azAZ");
    assert_string_equal(out.v[1].name, "X-Empty");
    assert_int_equal(out.v[1].value_len, 0);
    assert_string_equal(out.v[2].value, "a\tb");
    idem_headers_clear(&in);
    idem_headers_clear(&out);
}

static void test_hop_by_hop_names(void **state)
{
    static const char *const hop[] = {"Connection",         "keep-alive", "Proxy-Authorization",
                                      "proxy-authenticate", "TE",         "Trailer",
                                      "Transfer-Encoding",  "UPGRADE",    "Proxy-Connection"};
    static const char *const e2e[] = {
        "Content-Type", "Idempotency-Key",          "Authorization", "Trailers-X", "Tea",
        "Proxy",        "Upgrade-Insecure-Requests"};

    (void)state;
    for (size_t i = 0; i < sizeof(hop) / sizeof(hop[0]); i++)
        assert_true(idem_header_is_hop_by_hop(hop[i]));
    for (size_t i = 0; i < sizeof(e2e) / sizeof(e2e[0]); i++)
        assert_false(idem_header_is_hop_by_hop(e2e[i]));
}

/* ---- response header filter -------------------------------------------- */

static void fill_response(struct idem_headers *in)
{
    push(in, "Content-Type", "application/json");
    push(in, "Connection", "close, X-Hop");
    push(in, "X-Hop", "1");
    push(in, "Keep-Alive", "timeout=5");
    push(in, "Transfer-Encoding", "chunked");
    push(in, "Content-Length", "5");
    push(in, "Set-Cookie", "a=b");
    push(in, "Proxy-Authenticate", "Basic");
    push(in, "ETag", "\"v1\"");
    push(in, "Upgrade", "websocket");
    push(in, "Trailer", "X-Sum");
    push(in, "set-cookie", "c=d");
    push(in, "X-Secret", "s");
    push(in, "Idempotent-Replayed", "true");
    push(in, "X-Bad", "a\r\nInjected: 1");
    push(in, "Location", "/v1/payments/1");
}

static void test_filter_response_without_route(void **state)
{
    struct idem_headers in = {0};
    struct idem_headers out = {0};
    static const char *const want[][2] = {
        {"Content-Type", "application/json"},
        {"Set-Cookie", "a=b"},
        {"ETag", "\"v1\""},
        {"set-cookie", "c=d"},
        {"X-Secret", "s"},
        {"Location", "/v1/payments/1"},
    };

    (void)state;
    fill_response(&in);
    assert_int_equal(idem_filter_response_headers(&in, NULL, &out), 0);
    assert_headers(&out, want, sizeof(want) / sizeof(want[0]));
    idem_headers_clear(&in);
    idem_headers_clear(&out);
}

static void test_filter_response_strip_headers(void **state)
{
    struct idem_headers in = {0};
    struct idem_headers out = {0};
    struct config *cfg;
    static const char *const want_default[][2] = {
        {"Content-Type", "application/json"},
        {"ETag", "\"v1\""},
        {"X-Secret", "s"},
        {"Location", "/v1/payments/1"},
    };
    static const char *const want_custom[][2] = {
        {"Content-Type", "application/json"},
        {"ETag", "\"v1\""},
        {"Location", "/v1/payments/1"},
    };

    (void)state;
    fill_response(&in);

    /* The default strip_headers is ["Set-Cookie"], matched in any case. */
    cfg = load_config("{\"routes\":[{\"path\":\"/v1/payments\"}]}");
    assert_int_equal(idem_filter_response_headers(&in, &cfg->routes[0], &out), 0);
    assert_headers(&out, want_default, sizeof(want_default) / sizeof(want_default[0]));
    idem_headers_clear(&out);
    config_free(cfg);

    cfg = load_config("{\"routes\":[{\"path\":\"/v1/payments\","
                      "\"strip_headers\":[\"SET-COOKIE\",\"x-secret\"]}]}");
    assert_int_equal(idem_filter_response_headers(&in, &cfg->routes[0], &out), 0);
    assert_headers(&out, want_custom, sizeof(want_custom) / sizeof(want_custom[0]));
    idem_headers_clear(&out);
    config_free(cfg);

    /* An empty strip list strips nothing beyond the hop-by-hop ones. */
    {
        struct config_route r;
        route_init(&r);
        assert_int_equal(idem_filter_response_headers(&in, &r, &out), 0);
        assert_int_equal(out.n, 6);
        assert_non_null(idem_headers_find(&out, "Set-Cookie"));
        idem_headers_clear(&out);
    }
    idem_headers_clear(&in);
}

/* ---- stored header encoding ------------------------------------------- */

static void assert_same_headers(const struct idem_headers *a, const struct idem_headers *b)
{
    assert_int_equal(a->n, b->n);
    for (size_t i = 0; i < a->n; i++) {
        assert_int_equal(a->v[i].name_len, b->v[i].name_len);
        assert_int_equal(a->v[i].value_len, b->v[i].value_len);
        assert_memory_equal(a->v[i].name, b->v[i].name, a->v[i].name_len);
        if (a->v[i].value_len > 0)
            assert_memory_equal(a->v[i].value, b->v[i].value, a->v[i].value_len);
        assert_int_equal(b->v[i].name[b->v[i].name_len], '\0');
        assert_int_equal(b->v[i].value[b->v[i].value_len], '\0');
    }
}

static void test_headers_encode_empty(void **state)
{
    struct idem_headers h = {0};
    struct idem_headers back = {0};
    uint8_t *buf = (uint8_t *)&h; /* must be overwritten */
    size_t len = 99;
    static const uint8_t nothing[1] = {0};

    (void)state;
    assert_int_equal(idem_headers_encode(&h, &buf, &len), 0);
    assert_null(buf);
    assert_int_equal(len, 0);
    assert_int_equal(idem_headers_decode(NULL, 0, &back), 0);
    assert_int_equal(back.n, 0);
    assert_int_equal(idem_headers_decode(nothing, 0, &back), 0);
    assert_int_equal(back.n, 0);
    idem_headers_clear(&back);
}

/* The stored form is a format: u32le name_len, name, u32le value_len, value. */
static void test_headers_encode_known_bytes(void **state)
{
    static const uint8_t want[] = {1, 0, 0, 0, 'A', 2,   0, 0, 0, 'b', 'c',
                                   2, 0, 0, 0, 'X', 'y', 0, 0, 0, 0};
    struct idem_headers h = {0};
    uint8_t *buf = NULL;
    size_t len = 0;

    (void)state;
    push(&h, "A", "bc");
    push(&h, "Xy", "");
    assert_int_equal(idem_headers_encode(&h, &buf, &len), 0);
    assert_int_equal(len, sizeof(want));
    assert_memory_equal(buf, want, sizeof(want));
    free(buf);
    idem_headers_clear(&h);
}

static void test_headers_round_trip(void **state)
{
    struct idem_headers h = {0};
    struct idem_headers back = {0};
    uint8_t *buf = NULL;
    size_t len = 0;
    size_t big_len = 100000;
    char *big = malloc(big_len);

    (void)state;
    assert_non_null(big);
    for (size_t i = 0; i < big_len; i++)
        big[i] = (char)('a' + i % 26);
    push(&h, "Content-Type", "application/json");
    push(&h, "X-Empty", "");
    push(&h, "Set-Cookie", "a=b");
    push(&h, "set-cookie", "c=d");
    push(&h, "X-Bytes", "\t\x80\xff\x01 ~");
    push_n(&h, "X-Big", 5, big, big_len);
    assert_int_equal(idem_headers_encode(&h, &buf, &len), 0);
    assert_non_null(buf);
    assert_int_equal(len, h.bytes + 8 * h.n);
    assert_int_equal(idem_headers_decode(buf, len, &back), 0);
    assert_same_headers(&h, &back);
    assert_int_equal(back.bytes, h.bytes);

    /* decode appends. */
    assert_int_equal(idem_headers_decode(buf, len, &back), 0);
    assert_int_equal(back.n, 2 * h.n);
    free(buf);
    free(big);
    idem_headers_clear(&h);
    idem_headers_clear(&back);
}

static void test_headers_decode_rejects_truncated(void **state)
{
    struct idem_headers h = {0};
    uint8_t *buf = NULL;
    size_t len = 0;
    /* Offsets at which a prefix is itself a whole, shorter list. */
    size_t bounds[4];
    size_t nb = 0;

    (void)state;
    push(&h, "Content-Type", "text/plain");
    push(&h, "X-E", "");
    push(&h, "ETag", "\"1\"");
    assert_int_equal(idem_headers_encode(&h, &buf, &len), 0);
    bounds[nb++] = 0;
    bounds[nb++] = 8 + 12 + 10;
    bounds[nb++] = bounds[1] + 8 + 3;
    bounds[nb++] = len;
    for (size_t cut = 0; cut <= len; cut++) {
        struct idem_headers back = {0};
        bool whole = false;
        /* An exact-size copy, so ASan sees any read past the cut. */
        uint8_t *copy = malloc(cut > 0 ? cut : 1);
        assert_non_null(copy);
        memcpy(copy, buf, cut);
        for (size_t k = 0; k < nb; k++)
            whole = whole || bounds[k] == cut;
        if (whole) {
            assert_int_equal(idem_headers_decode(copy, cut, &back), 0);
        } else {
            if (idem_headers_decode(copy, cut, &back) != -1)
                print_error("a prefix of %zu bytes decoded\n", cut);
            assert_int_equal(idem_headers_decode(copy, cut, &back), -1);
        }
        idem_headers_clear(&back);
        free(copy);
    }
    free(buf);
    idem_headers_clear(&h);
}

static void test_headers_decode_rejects_malformed(void **state)
{
    static const uint8_t empty_name[] = {0, 0, 0, 0, 1, 0, 0, 0, 'v'};
    static const uint8_t nul_name[] = {3, 0, 0, 0, 'A', 0, 'B', 0, 0, 0, 0};
    static const uint8_t nul_value[] = {1, 0, 0, 0, 'A', 3, 0, 0, 0, 'x', 0, 'y'};
    static const uint8_t huge_name[] = {0xff, 0xff, 0xff, 0xff, 'A'};
    static const uint8_t huge_value[] = {1, 0, 0, 0, 'A', 0xff, 0xff, 0xff, 0xff, 'v'};
    static const uint8_t long_by_one[] = {1, 0, 0, 0, 'A', 2, 0, 0, 0, 'v'};
    static const uint8_t trailing[] = {1, 0, 0, 0, 'A', 1, 0, 0, 0, 'v', 7};
    static const struct {
        const uint8_t *p;
        size_t n;
    } bad[] = {
        {empty_name, sizeof(empty_name)}, {nul_name, sizeof(nul_name)},
        {nul_value, sizeof(nul_value)},   {huge_name, sizeof(huge_name)},
        {huge_value, sizeof(huge_value)}, {long_by_one, sizeof(long_by_one)},
        {trailing, sizeof(trailing)},
    };

    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct idem_headers back = {0};
        assert_int_equal(idem_headers_decode(bad[i].p, bad[i].n, &back), -1);
        idem_headers_clear(&back);
    }
}

static void test_headers_find_count(void **state)
{
    struct idem_headers h = {0};

    (void)state;
    push(&h, "Idempotency-Key", "a");
    push(&h, "idempotency-key", "b");
    push(&h, "X", "c");
    assert_int_equal(idem_headers_count(&h, "IDEMPOTENCY-KEY"), 2);
    assert_string_equal(idem_headers_find(&h, "IDEMPOTENCY-KEY")->value, "a");
    assert_null(idem_headers_find(&h, "Idempotency"));
    assert_int_equal(idem_headers_count(&h, "Y"), 0);
    idem_headers_clear(&h);
    assert_int_equal(h.n, 0);
    idem_headers_clear(&h); /* clearing twice is harmless */
}

/* ---- idem_decide_lookup -------------------------------------------------- */

enum when { PAST, NOW, FUTURE };
static const int64_t now_ms = 1700000000000;

static int64_t at(enum when w)
{
    return w == PAST ? now_ms - 1 : w == NOW ? now_ms : now_ms + 1;
}

/* The record as the store would have it; the canonical fingerprint of the
 * request is 0x11 bytes, the record's 0x11 (same) or 0x22 (other). The raw
 * fingerprints always differ, so the canonical ones decide. */
static enum idem_lookup_action lookup_lease(enum store_state st, bool same_fp, enum when lease,
                                            enum when ttl, bool held)
{
    struct store_record rec;
    struct idem_fingerprints fp;

    memset(&rec, 0, sizeof(rec));
    memset(rec.lease_id, held ? 0x00 : 0x55, sizeof(rec.lease_id));
    memset(&fp, 0, sizeof(fp));
    memset(fp.raw, 0x33, sizeof(fp.raw));
    memset(fp.canonical, 0x11, sizeof(fp.canonical));
    fp.canonical_ready = true;
    rec.state = st;
    memset(rec.fingerprint, same_fp ? 0x11 : 0x22, sizeof(rec.fingerprint));
    rec.has_raw_fingerprint = true;
    memset(rec.raw_fingerprint, 0x44, sizeof(rec.raw_fingerprint));
    rec.lease_expires_ms = at(lease);
    rec.expires_ms = at(ttl);
    if (st == STORE_STATE_COMPLETE)
        rec.status = 201;
    return idem_decide_lookup(&rec, &fp, now_ms, now_ms);
}

static enum idem_lookup_action lookup(enum store_state st, bool same_fp, enum when lease,
                                      enum when ttl)
{
    return lookup_lease(st, same_fp, lease, ttl, false);
}

/* Leases are on the lease clock, TTLs on the wall clock (store_clock): each
 * time is compared with its own clock's now. Here the two clocks are far
 * apart, as the boot clock and the wall clock are. */
static void test_decide_lookup_two_clocks(void **state)
{
    struct store_record rec;
    struct idem_fingerprints fp;
    const int64_t lease_now = 5000000; /* 83 minutes since boot */

    (void)state;
    memset(&rec, 0, sizeof(rec));
    memset(&fp, 0, sizeof(fp));
    memset(fp.raw, 0x33, sizeof(fp.raw));
    memset(fp.canonical, 0x11, sizeof(fp.canonical));
    fp.canonical_ready = true;
    memset(rec.fingerprint, 0x11, sizeof(rec.fingerprint));
    memset(rec.lease_id, 0x55, sizeof(rec.lease_id));
    rec.state = STORE_STATE_IN_PROGRESS;
    rec.expires_ms = now_ms + 60000;
    rec.lease_expires_ms = lease_now + 1000; /* live on its clock, long past as wall time */
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, lease_now), IDEM_LOOKUP_BUSY);
    rec.lease_expires_ms = lease_now - 1;
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, lease_now), IDEM_LOOKUP_ACQUIRE);
    /* A COMPLETE record's TTL is a wall-clock time. */
    rec.state = STORE_STATE_COMPLETE;
    rec.status = 201;
    rec.lease_expires_ms = 0;
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, lease_now), IDEM_LOOKUP_REPLAY);
    rec.expires_ms = now_ms;
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, lease_now), IDEM_LOOKUP_ACQUIRE);
}

static void test_decide_lookup_table(void **state)
{
    (void)state;
    for (int same = 0; same <= 1; same++) {
        for (int l = PAST; l <= FUTURE; l++) {
            for (int t = PAST; t <= FUTURE; t++) {
                enum idem_lookup_action got;
                enum idem_lookup_action want;
                bool live;

                /* Absent: always acquire. */
                got = lookup(STORE_STATE_ABSENT, same, (enum when)l, (enum when)t);
                assert_int_equal(got, IDEM_LOOKUP_ACQUIRE);

                /* COMPLETE: live while expires > now, whatever the (stale)
                 * lease says; expired is absent (seed 000). */
                live = t == FUTURE;
                want = !live  ? IDEM_LOOKUP_ACQUIRE
                       : same ? IDEM_LOOKUP_REPLAY
                              : IDEM_LOOKUP_MISMATCH;
                got = lookup(STORE_STATE_COMPLETE, same, (enum when)l, (enum when)t);
                if (got != want)
                    print_error("COMPLETE same=%d lease=%d ttl=%d\n", same, l, t);
                assert_int_equal(got, want);

                /* IN_PROGRESS: live while lease_expires > now; an expired
                 * lease is stealable; a live lease past its TTL is still
                 * held (CONTRACT.md section 2, purge keeps it too). */
                live = l == FUTURE;
                want = !live ? IDEM_LOOKUP_ACQUIRE : same ? IDEM_LOOKUP_BUSY : IDEM_LOOKUP_MISMATCH;
                got = lookup(STORE_STATE_IN_PROGRESS, same, (enum when)l, (enum when)t);
                if (got != want)
                    print_error("IN_PROGRESS same=%d lease=%d ttl=%d\n", same, l, t);
                assert_int_equal(got, want);
            }
        }
    }
}

static void test_decide_lookup_named_cases(void **state)
{
    (void)state;
    assert_int_equal(lookup(STORE_STATE_COMPLETE, true, PAST, FUTURE), IDEM_LOOKUP_REPLAY);
    assert_int_equal(lookup(STORE_STATE_COMPLETE, false, PAST, FUTURE), IDEM_LOOKUP_MISMATCH);
    assert_int_equal(lookup(STORE_STATE_COMPLETE, false, PAST, NOW), IDEM_LOOKUP_ACQUIRE);
    assert_int_equal(lookup(STORE_STATE_IN_PROGRESS, true, FUTURE, FUTURE), IDEM_LOOKUP_BUSY);
    assert_int_equal(lookup(STORE_STATE_IN_PROGRESS, false, FUTURE, FUTURE), IDEM_LOOKUP_MISMATCH);
    assert_int_equal(lookup(STORE_STATE_IN_PROGRESS, true, NOW, FUTURE), IDEM_LOOKUP_ACQUIRE);
    assert_int_equal(lookup(STORE_STATE_IN_PROGRESS, false, PAST, FUTURE), IDEM_LOOKUP_ACQUIRE);
    assert_int_equal(lookup(STORE_STATE_IN_PROGRESS, true, FUTURE, PAST), IDEM_LOOKUP_BUSY);
}

/* A held record (the action ran, its result could not be stored): a
 * duplicate learns it at once instead of waiting; a different request is
 * still a mismatch, and once the hold ends the key is free again. */
static void test_decide_lookup_held(void **state)
{
    (void)state;
    assert_int_equal(lookup_lease(STORE_STATE_IN_PROGRESS, true, FUTURE, FUTURE, true),
                     IDEM_LOOKUP_HELD);
    assert_int_equal(lookup_lease(STORE_STATE_IN_PROGRESS, true, FUTURE, PAST, true),
                     IDEM_LOOKUP_HELD);
    assert_int_equal(lookup_lease(STORE_STATE_IN_PROGRESS, false, FUTURE, FUTURE, true),
                     IDEM_LOOKUP_MISMATCH);
    assert_int_equal(lookup_lease(STORE_STATE_IN_PROGRESS, true, NOW, FUTURE, true),
                     IDEM_LOOKUP_ACQUIRE);
    assert_int_equal(lookup_lease(STORE_STATE_IN_PROGRESS, true, PAST, PAST, true),
                     IDEM_LOOKUP_ACQUIRE);
}

/* A request of the lookup tests below: POST /v1/payments with a JSON body. */
static void request_fp(struct idem_fingerprints *fp, const char *body, const char *ctype,
                       enum config_fingerprint mode)
{
    static const char target[] = "/v1/payments";
    assert_int_equal(
        idem_fingerprints_init(fp, "POST", target, strlen(target), ctype, body, strlen(body), mode),
        0);
}

/* The COMPLETE record a first request leaves: both of its fingerprints, or
 * (v1) the canonical one only, as a store written before version 2 has. */
static void record_of(struct store_record *rec, const char *body, bool v1)
{
    struct idem_fingerprints fp;

    memset(rec, 0, sizeof(*rec));
    rec->state = STORE_STATE_COMPLETE;
    rec->status = 201;
    rec->expires_ms = now_ms + 1000;
    request_fp(&fp, body, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(idem_fingerprints_canonical(&fp), 0);
    memcpy(rec->fingerprint, fp.canonical, STORE_FINGERPRINT_BYTES);
    rec->has_raw_fingerprint = !v1;
    if (!v1)
        memcpy(rec->raw_fingerprint, fp.raw, STORE_FINGERPRINT_BYTES);
}

static const char pay_a[] = "{\"amount\":100,\"currency\":\"EUR\"}";
static const char pay_a_reordered[] = "{ \"currency\": \"EUR\", \"amount\": 100 }";
static const char pay_b[] = "{\"amount\":101,\"currency\":\"EUR\"}";

/* The replay fast path: a byte-identical retry matches on the raw
 * fingerprint, and its body is never canonicalised. */
static void test_lookup_raw_match_skips_canonical(void **state)
{
    struct store_record rec;
    struct idem_fingerprints fp;

    (void)state;
    record_of(&rec, pay_a, false);
    request_fp(&fp, pay_a, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_false(fp.canonical_ready);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_REPLAY);
    assert_false(fp.canonical_ready);

    /* The same for a live IN_PROGRESS record: busy, without canonicalising. */
    rec.state = STORE_STATE_IN_PROGRESS;
    rec.lease_expires_ms = now_ms + 1000;
    memset(rec.lease_id, 0x55, sizeof(rec.lease_id));
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_BUSY);
    assert_false(fp.canonical_ready);
}

/* CONTRACT.md section 3: key order and white space are not a mismatch. The
 * raw fingerprints differ, so the canonical ones decide. */
static void test_lookup_reordered_json_replays(void **state)
{
    struct store_record rec;
    struct idem_fingerprints fp;

    (void)state;
    record_of(&rec, pay_a, false);
    request_fp(&fp, pay_a_reordered, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_memory_not_equal(fp.raw, rec.raw_fingerprint, STORE_FINGERPRINT_BYTES);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_REPLAY);
    assert_true(fp.canonical_ready);
    assert_memory_equal(fp.canonical, rec.fingerprint, STORE_FINGERPRINT_BYTES);
}

static void test_lookup_different_body_mismatch(void **state)
{
    struct store_record rec;
    struct idem_fingerprints fp;

    (void)state;
    record_of(&rec, pay_a, false);
    request_fp(&fp, pay_b, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_MISMATCH);
    rec.state = STORE_STATE_IN_PROGRESS;
    rec.lease_expires_ms = now_ms + 1000;
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_MISMATCH);
}

/* A record stored before version 2 has no raw fingerprint: every
 * comparison goes through the canonical one, with the same answers. */
static void test_lookup_v1_record_uses_canonical(void **state)
{
    struct store_record rec;
    struct idem_fingerprints fp;

    (void)state;
    record_of(&rec, pay_a, true);
    request_fp(&fp, pay_a, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_REPLAY);
    assert_true(fp.canonical_ready);
    request_fp(&fp, pay_a_reordered, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_REPLAY);
    request_fp(&fp, pay_b, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_MISMATCH);
}

/* An acquire stores the canonical fingerprint (for later retries formatted
 * otherwise), so ACQUIRE always comes with it, equal to idem_fingerprint(). */
static void test_lookup_acquire_makes_canonical(void **state)
{
    struct store_record rec;
    struct idem_fingerprints fp;
    uint8_t want[STORE_FINGERPRINT_BYTES];

    (void)state;
    memset(&rec, 0, sizeof(rec));
    request_fp(&fp, pay_a_reordered, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_ACQUIRE);
    assert_true(fp.canonical_ready);
    assert_int_equal(idem_fingerprint("POST", "/v1/payments", 12, "application/json",
                                      pay_a_reordered, strlen(pay_a_reordered),
                                      CONFIG_FINGERPRINT_AUTO, want),
                     0);
    assert_memory_equal(fp.canonical, want, sizeof(want));
    assert_memory_not_equal(fp.raw, want, sizeof(want));

    /* An expired COMPLETE record is absent: the same. */
    record_of(&rec, pay_b, false);
    rec.expires_ms = now_ms;
    request_fp(&fp, pay_a, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_ACQUIRE);
    assert_true(fp.canonical_ready);
}

/* Allocation failure on demand: this test is linked with --wrap=realloc
 * (tests/unit/CMakeLists.txt), and realloc is what the canonicaliser's
 * buffers grow with. */
void *__real_realloc(void *p, size_t n);
void *__wrap_realloc(void *p, size_t n);
static bool realloc_fails;

void *__wrap_realloc(void *p, size_t n)
{
    return realloc_fails ? NULL : __real_realloc(p, n);
}

/* A canonical fingerprint that memory ran out for is an error, not the raw
 * one. Taken for the raw one, a first request stored its raw hash as the
 * canonical fingerprint, and every retry of that key with its JSON in
 * another key order was a 422 for the record's whole TTL; a retry looked up
 * then was a 422 at once. */
static void test_lookup_canonical_out_of_memory_is_an_error(void **state)
{
    struct store_record rec;
    struct idem_fingerprints fp;
    enum idem_lookup_action action;
    uint8_t want[STORE_FINGERPRINT_BYTES];

    (void)state;
    /* No record: the acquire would store the fingerprint. */
    memset(&rec, 0, sizeof(rec));
    request_fp(&fp, pay_a_reordered, "application/json", CONFIG_FINGERPRINT_AUTO);
    realloc_fails = true;
    action = idem_decide_lookup(&rec, &fp, now_ms, now_ms);
    realloc_fails = false;
    assert_int_equal(action, IDEM_LOOKUP_ERROR);
    assert_false(fp.canonical_ready);
    /* With memory again, the real canonical fingerprint. */
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_ACQUIRE);
    assert_int_equal(idem_fingerprint("POST", "/v1/payments", 12, "application/json", pay_a,
                                      strlen(pay_a), CONFIG_FINGERPRINT_AUTO, want),
                     0);
    assert_memory_equal(fp.canonical, want, sizeof(want));

    /* A live record of the same request in another key order: not a 422. */
    record_of(&rec, pay_a, false);
    request_fp(&fp, pay_a_reordered, "application/json", CONFIG_FINGERPRINT_AUTO);
    realloc_fails = true;
    action = idem_decide_lookup(&rec, &fp, now_ms, now_ms);
    realloc_fails = false;
    assert_int_equal(action, IDEM_LOOKUP_ERROR);
    assert_int_equal(idem_decide_lookup(&rec, &fp, now_ms, now_ms), IDEM_LOOKUP_REPLAY);
}

/* Where canonicalisation does not apply, raw and canonical are one hash,
 * computed once by init. */
static void test_fingerprints_one_hash_when_not_canonicalised(void **state)
{
    struct idem_fingerprints fp;
    uint8_t want[STORE_FINGERPRINT_BYTES];

    (void)state;
    request_fp(&fp, pay_a_reordered, "application/json", CONFIG_FINGERPRINT_RAW);
    assert_true(fp.canonical_ready);
    assert_memory_equal(fp.raw, fp.canonical, STORE_FINGERPRINT_BYTES);
    request_fp(&fp, pay_a_reordered, "text/plain", CONFIG_FINGERPRINT_AUTO);
    assert_true(fp.canonical_ready);
    assert_memory_equal(fp.raw, fp.canonical, STORE_FINGERPRINT_BYTES);
    request_fp(&fp, "", "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_true(fp.canonical_ready);
    assert_memory_equal(fp.raw, fp.canonical, STORE_FINGERPRINT_BYTES);
    /* JSON that does not parse is hashed as sent: canonical equals raw. */
    request_fp(&fp, "{\"a\":", "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_false(fp.canonical_ready);
    assert_int_equal(idem_fingerprints_canonical(&fp), 0);
    assert_memory_equal(fp.raw, fp.canonical, STORE_FINGERPRINT_BYTES);
    /* The raw fingerprint is the canonical one of the body as sent. */
    request_fp(&fp, pay_a_reordered, "application/json", CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(idem_fingerprint("POST", "/v1/payments", 12, "application/json",
                                      pay_a_reordered, strlen(pay_a_reordered),
                                      CONFIG_FINGERPRINT_RAW, want),
                     0);
    assert_memory_equal(fp.raw, want, sizeof(want));
}

/* ---- idem_decide_record -------------------------------------------------- */

static void test_decide_record_default_release_on(void **state)
{
    struct config_route r;

    (void)state;
    route_init(&r);
    for (int status = 100; status < 600; status++) {
        enum idem_record_action want = status >= 500 ? IDEM_RECORD_RELEASE : IDEM_RECORD_COMPLETE;
        assert_int_equal(idem_decide_record(&r, IDEM_UPSTREAM_RESPONSE, status), want);
    }
}

static void test_decide_record_configured_release_on(void **state)
{
    struct config *cfg;
    const struct config_route *r;

    (void)state;
    cfg = load_config("{\"routes\":[{\"path\":\"/a\",\"release_on\":[409,\"5xx\"]},"
                      "{\"path\":\"/b\",\"release_on\":[]},"
                      "{\"path\":\"/c\",\"release_on\":[\"4xx\",\"503\"]}]}");
    assert_int_equal(cfg->n_routes, 3);

    r = &cfg->routes[0];
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 409), IDEM_RECORD_RELEASE);
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 408), IDEM_RECORD_COMPLETE);
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 500), IDEM_RECORD_RELEASE);
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 200), IDEM_RECORD_COMPLETE);

    /* Nothing listed: even a 500 is the key's result. */
    r = &cfg->routes[1];
    for (int status = 100; status < 600; status++)
        assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, status),
                         IDEM_RECORD_COMPLETE);

    r = &cfg->routes[2];
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 400), IDEM_RECORD_RELEASE);
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 499), IDEM_RECORD_RELEASE);
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 503), IDEM_RECORD_RELEASE);
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 500), IDEM_RECORD_COMPLETE);
    assert_int_equal(idem_decide_record(r, IDEM_UPSTREAM_RESPONSE, 201), IDEM_RECORD_COMPLETE);
    config_free(cfg);
}

static void test_decide_record_on_unknown(void **state)
{
    static const enum idem_upstream_result unknown[] = {IDEM_UPSTREAM_TIMEOUT, IDEM_UPSTREAM_BROKEN,
                                                        IDEM_UPSTREAM_TOO_LARGE};
    struct config_route r;

    (void)state;
    route_init(&r);
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        r.on_unknown = CONFIG_ON_UNKNOWN_RELEASE;
        assert_int_equal(idem_decide_record(&r, unknown[i], 504), IDEM_RECORD_RELEASE);
        assert_int_equal(idem_decide_record(&r, unknown[i], 0), IDEM_RECORD_RELEASE);
        r.on_unknown = CONFIG_ON_UNKNOWN_COMPLETE;
        assert_int_equal(idem_decide_record(&r, unknown[i], 504), IDEM_RECORD_COMPLETE);
        assert_int_equal(idem_decide_record(&r, unknown[i], 0), IDEM_RECORD_COMPLETE);
    }
}

/* Nothing was sent, nothing ran: release, whatever the route says. */
static void test_decide_record_not_sent_always_releases(void **state)
{
    struct config_route r;

    (void)state;
    route_init(&r);
    memset(r.release_on, 0, sizeof(r.release_on));
    for (int u = CONFIG_ON_UNKNOWN_RELEASE; u <= CONFIG_ON_UNKNOWN_COMPLETE; u++) {
        r.on_unknown = (enum config_on_unknown)u;
        assert_int_equal(idem_decide_record(&r, IDEM_UPSTREAM_NOT_SENT, 0), IDEM_RECORD_RELEASE);
        assert_int_equal(idem_decide_record(&r, IDEM_UPSTREAM_NOT_SENT, 502), IDEM_RECORD_RELEASE);
        assert_int_equal(idem_decide_record(&r, IDEM_UPSTREAM_NOT_SENT, 200), IDEM_RECORD_RELEASE);
    }
}

/* ---- Retry-After ------------------------------------------------------- */

static void expect_field(const char *line, enum idem_field_kind kind, const char *name,
                         const char *value)
{
    struct idem_field_line f;
    assert_int_equal(idem_field_line_split(line, strlen(line), &f), kind);
    if (name != NULL) {
        assert_int_equal(f.name_len, strlen(name));
        assert_memory_equal(f.name, name, f.name_len);
    }
    if (value != NULL) {
        assert_int_equal(f.value_len, strlen(value));
        assert_memory_equal(f.value, value, f.value_len);
    }
}

/* Upstream header lines, as both upstream clients read them (RFC 9112
 * section 5). */
static void test_field_line_split(void **state)
{
    (void)state;
    expect_field("Content-Type: text/plain", IDEM_FIELD, "Content-Type", "text/plain");
    expect_field("X-A:v", IDEM_FIELD, "X-A", "v");
    expect_field("X-A: \t v w \t", IDEM_FIELD, "X-A", "v w");
    expect_field("X-A:", IDEM_FIELD, "X-A", "");
    expect_field("X-A \t: v", IDEM_FIELD, "X-A", "v"); /* white space before the colon */
    expect_field("X-A: a:b", IDEM_FIELD, "X-A", "a:b"); /* the first colon ends the name */
    expect_field(" \t more text \t", IDEM_FIELD_FOLD, NULL, "more text");
    expect_field("\tx", IDEM_FIELD_FOLD, NULL, "x");
    expect_field(" \t ", IDEM_FIELD_SKIP, NULL, NULL);
    expect_field(" : v", IDEM_FIELD_FOLD, NULL, ": v"); /* a fold, not a field */
    expect_field("\t: v", IDEM_FIELD_FOLD, NULL, ": v");
    expect_field("no colon here", IDEM_FIELD_BAD, NULL, NULL);
    expect_field(": v", IDEM_FIELD_BAD, NULL, NULL);
    expect_field("", IDEM_FIELD_BAD, NULL, NULL);
    /* Not NUL-terminated: only n bytes are read. */
    {
        struct idem_field_line f;
        assert_int_equal(idem_field_line_split("X-B: 12345", 7, &f), IDEM_FIELD);
        assert_int_equal(f.value_len, 2);
        assert_memory_equal(f.value, "12", 2);
    }
}

static void test_retry_after(void **state)
{
    (void)state;
    assert_int_equal(idem_retry_after_seconds(now_ms - 5000, now_ms), 1);
    assert_int_equal(idem_retry_after_seconds(now_ms, now_ms), 1);
    assert_int_equal(idem_retry_after_seconds(now_ms + 1, now_ms), 1);
    assert_int_equal(idem_retry_after_seconds(now_ms + 999, now_ms), 1);
    assert_int_equal(idem_retry_after_seconds(now_ms + 1000, now_ms), 1);
    assert_int_equal(idem_retry_after_seconds(now_ms + 1001, now_ms), 2);
    assert_int_equal(idem_retry_after_seconds(now_ms + 29001, now_ms), 30);
    assert_int_equal(idem_retry_after_seconds(now_ms + 30000, now_ms), 30);
}

/* A lease expiry comes from a decoded record, which may hold any int64
 * (store_record_decode() accepts them all), and tests inject clocks that
 * start at 0: rounding up must not overflow. */
static void test_retry_after_extreme(void **state)
{
    (void)state;
#if LONG_MAX >= INT64_MAX
    assert_int_equal(idem_retry_after_seconds(INT64_MAX, 0), INT64_MAX / 1000 + 1);
    assert_int_equal(idem_retry_after_seconds(INT64_MAX - 1, 1), INT64_MAX / 1000 + 1);
#endif
    assert_true(idem_retry_after_seconds(INT64_MAX, now_ms) >= 1);
}

/* ---- problem+json ------------------------------------------------------ */

static void test_problem_json(void **state)
{
    json_error_t jerr;
    json_t *j;
    size_t len = 0;
    char *s;

    (void)state;
    s = idem_problem_json(409, "in-progress", "Request in progress",
                          "another request with this key is \"running\"\n", &len);
    assert_non_null(s);
    assert_int_equal(len, strlen(s));
    j = json_loads(s, 0, &jerr);
    assert_non_null(j);
    assert_true(json_is_object(j));
    assert_int_equal(json_object_size(j), 4);
    assert_string_equal(json_string_value(json_object_get(j, "type")),
                        "urn:idemproxy:problem:in-progress");
    assert_string_equal(json_string_value(json_object_get(j, "title")), "Request in progress");
    assert_true(json_is_integer(json_object_get(j, "status")));
    assert_int_equal(json_integer_value(json_object_get(j, "status")), 409);
    assert_string_equal(json_string_value(json_object_get(j, "detail")),
                        "another request with this key is \"running\"\n");
    json_decref(j);
    free(s);

    /* out_len is optional. */
    s = idem_problem_json(400, "invalid-key", "Invalid Idempotency-Key",
                          idem_key_status_text(IDEM_KEY_BAD_CHAR), NULL);
    assert_non_null(s);
    j = json_loads(s, 0, &jerr);
    assert_non_null(j);
    assert_int_equal(json_integer_value(json_object_get(j, "status")), 400);
    json_decref(j);
    free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_bare),
        cmocka_unit_test(test_key_sf_string_equals_bare),
        cmocka_unit_test(test_key_escapes),
        cmocka_unit_test(test_key_empty),
        cmocka_unit_test(test_key_length),
        cmocka_unit_test(test_key_characters),
        cmocka_unit_test(test_key_bad_chars_named),
        cmocka_unit_test(test_key_bad_quoting),
        cmocka_unit_test(test_headers_extend_last),
        cmocka_unit_test(test_target_canonical),
        cmocka_unit_test(test_key_status_text),
        cmocka_unit_test(test_key_loghash),
        cmocka_unit_test(test_fingerprint_json_canonical),
        cmocka_unit_test(test_fingerprints_one_hash_when_not_canonicalised),
        cmocka_unit_test(test_lookup_raw_match_skips_canonical),
        cmocka_unit_test(test_lookup_reordered_json_replays),
        cmocka_unit_test(test_lookup_different_body_mismatch),
        cmocka_unit_test(test_lookup_v1_record_uses_canonical),
        cmocka_unit_test(test_lookup_acquire_makes_canonical),
        cmocka_unit_test(test_lookup_canonical_out_of_memory_is_an_error),
        cmocka_unit_test(test_fingerprint_known_answer),
        cmocka_unit_test(test_fingerprint_raw_mode),
        cmocka_unit_test(test_fingerprint_non_json_hashed_raw),
        cmocka_unit_test(test_fingerprint_invalid_json_hashed_raw),
        cmocka_unit_test(test_fingerprint_fields_differ),
        cmocka_unit_test(test_is_json_media_type),
        cmocka_unit_test(test_scope_without_header),
        cmocka_unit_test(test_scope_with_header),
        cmocka_unit_test(test_filter_request_drops_and_adds),
        cmocka_unit_test(test_filter_request_drops_every_x_forwarded),
        cmocka_unit_test(test_filter_request_connection_tokens),
        cmocka_unit_test(test_filter_request_rejects_bad_headers),
        cmocka_unit_test(test_filter_request_token_names_accepted),
        cmocka_unit_test(test_hop_by_hop_names),
        cmocka_unit_test(test_filter_response_without_route),
        cmocka_unit_test(test_filter_response_strip_headers),
        cmocka_unit_test(test_headers_encode_empty),
        cmocka_unit_test(test_headers_encode_known_bytes),
        cmocka_unit_test(test_headers_round_trip),
        cmocka_unit_test(test_headers_decode_rejects_truncated),
        cmocka_unit_test(test_headers_decode_rejects_malformed),
        cmocka_unit_test(test_headers_find_count),
        cmocka_unit_test(test_decide_lookup_table),
        cmocka_unit_test(test_decide_lookup_two_clocks),
        cmocka_unit_test(test_decide_lookup_named_cases),
        cmocka_unit_test(test_decide_lookup_held),
        cmocka_unit_test(test_decide_record_default_release_on),
        cmocka_unit_test(test_decide_record_configured_release_on),
        cmocka_unit_test(test_decide_record_on_unknown),
        cmocka_unit_test(test_decide_record_not_sent_always_releases),
        cmocka_unit_test(test_field_line_split),
        cmocka_unit_test(test_retry_after),
        cmocka_unit_test(test_retry_after_extreme),
        cmocka_unit_test(test_problem_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
