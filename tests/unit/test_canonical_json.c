/*
 * test_canonical_json.c - the canonical JSON of fingerprint "auto"
 * (proxy/canonical_json.h).
 *
 * Numbers are kept as written, so amounts that one double cannot tell apart
 * are different requests; everything else must come out byte for byte as
 * jansson 2.14 wrote it, because fingerprints stored by earlier versions
 * were computed from that. The differential tests check the second part on
 * many generated documents and mutations of them (IDEM_CJSON_ITERATIONS sets
 * how many; the seed is fixed, so a failure repeats).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "canonical_json.h"
#include "config.h"
#include "policy.h"
#include "store.h"

/* ---- helpers ------------------------------------------------------------ */

/* Canonicalises in[0..len); returns the output (free it) or NULL. */
static char *canon_n(const char *in, size_t len, size_t *out_len)
{
    char *out = (char *)0x1;
    size_t n = 99;
    int rc = idem_canonical_json(in, len, &out, &n);

    if (rc != 0) {
        assert_int_equal(rc, IDEM_CJSON_NOT_JSON);
        assert_null(out);
        assert_int_equal(n, 0);
        return NULL;
    }
    assert_non_null(out);
    assert_int_equal(strlen(out), n);
    assert_true(n <= len);
    if (out_len != NULL)
        *out_len = n;
    return out;
}

static void assert_canon(const char *in, const char *want)
{
    char *got = canon_n(in, strlen(in), NULL);
    if (got == NULL)
        fail_msg("refused: %s", in);
    if (strcmp(got, want) != 0)
        fail_msg("%s\n  got  %s\n  want %s", in, got, want);
    free(got);
}

static void assert_refused_n(const char *in, size_t len)
{
    char *got = canon_n(in, len, NULL);
    if (got != NULL)
        fail_msg("accepted %s as %s", in, got);
}

static void assert_refused(const char *in)
{
    assert_refused_n(in, strlen(in));
}

static void assert_same(const char *a, const char *b)
{
    char *x = canon_n(a, strlen(a), NULL);
    char *y = canon_n(b, strlen(b), NULL);
    assert_non_null(x);
    assert_non_null(y);
    assert_string_equal(x, y);
    free(x);
    free(y);
}

static void assert_differ(const char *a, const char *b)
{
    char *x = canon_n(a, strlen(a), NULL);
    char *y = canon_n(b, strlen(b), NULL);
    assert_non_null(x);
    assert_non_null(y);
    assert_string_not_equal(x, y);
    free(x);
    free(y);
}

/* What the proxy did before: jansson's round trip. NULL when refused. */
static char *jansson_canon(const char *in, size_t len, json_t **tree, json_error_t *err)
{
    json_t *j = json_loadb(in, len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, err);
    char *s = NULL;

    if (j != NULL)
        s = json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
    if (tree != NULL)
        *tree = j;
    else
        json_decref(j);
    return s;
}

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

struct diff_stats {
    unsigned long both_accept;
    unsigned long both_refuse;
    unsigned long with_reals;
    unsigned long wide_numbers; /* accepted here, too big for jansson */
};

/* The differential check of one input against jansson:
 *   - jansson accepts, no real number: the same bytes here;
 *   - jansson accepts with reals: accepted here, and jansson reads the
 *     output as the same document (json_equal);
 *   - jansson refuses: refused here, unless only a number was too big for
 *     it (json_error_numeric_overflow);
 *   - a NUL byte in the input: jansson may have skipped it (its lexer
 *     drops one right after a number or literal); refusing is then fine;
 *   - whatever is accepted here canonicalises to itself. */
static void differential(const char *in, size_t len, struct diff_stats *st)
{
    json_error_t err;
    json_t *tree = NULL;
    char *want = jansson_canon(in, len, &tree, &err);
    size_t got_len = 0;
    char *got = canon_n(in, len, &got_len);
    bool nul = memchr(in, '\0', len) != NULL;

    if (tree != NULL && !has_real(tree)) {
        assert_non_null(want);
        if (got == NULL && nul) {
            st->both_refuse++;
        } else {
            if (got == NULL || strcmp(got, want) != 0)
                fail_msg("differs from jansson on [%.*s]\n  got  %s\n  want %s", (int)len, in,
                         got ? got : "(refused)", want);
            st->both_accept++;
        }
    } else if (tree != NULL) {
        if (got == NULL && !nul)
            fail_msg("refused, jansson accepted [%.*s]", (int)len, in);
        if (got != NULL) {
            json_t *again = json_loadb(got, got_len, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
            if (again == NULL || !json_equal(tree, again))
                fail_msg("[%.*s] became [%s], another document", (int)len, in, got);
            json_decref(again);
            st->with_reals++;
        }
    } else if (got != NULL) {
        if (json_error_code(&err) != json_error_numeric_overflow)
            fail_msg("accepted [%.*s] as %s, jansson: %s", (int)len, in, got, err.text);
        st->wide_numbers++;
    } else {
        st->both_refuse++;
    }
    if (got != NULL) {
        size_t again_len = 0;
        char *again = canon_n(got, got_len, &again_len);
        assert_non_null(again);
        assert_string_equal(again, got);
        free(again);
    }
    free(got);
    free(want);
    json_decref(tree);
}

/* ---- the bug: numbers one double cannot tell apart ---------------------- */

static void test_numbers_kept_as_written(void **state)
{
    (void)state;
    assert_differ("{\"amount\":1.000000000000000001}", "{\"amount\":1.000000000000000002}");
    assert_differ("{\"amount\":9007199254740993.0}", "{\"amount\":9007199254740992.0}");
    assert_differ("{\"amount\":1.50}", "{\"amount\":1.5}");
    assert_differ("{\"amount\":1.0}", "{\"amount\":1}");
    assert_differ("{\"amount\":1e2}", "{\"amount\":100}");
    assert_differ("{\"amount\":1E2}", "{\"amount\":1e2}");
    assert_differ("{\"amount\":1e+2}", "{\"amount\":1e2}");
    assert_differ("{\"amount\":-0.0}", "{\"amount\":0.0}");
    assert_differ("1e400", "1e401");
    assert_differ("1e-400", "0.0");
    assert_canon("{\"b\":1.50,\"a\":-2.5E-3}", "{\"a\":-2.5E-3,\"b\":1.50}");
    assert_canon("[ 0.1 , 1e400 , -1e-400 ]", "[0.1,1e400,-1e-400]");
    /* Integers too big for int64 made jansson refuse the body (hashed raw,
     * so key order mattered); now they are canonicalised, as written. */
    assert_canon("{\"b\":1, \"a\":99999999999999999999999}",
                 "{\"a\":99999999999999999999999,\"b\":1}");
    assert_canon("-9223372036854775809", "-9223372036854775809");
    assert_differ("18446744073709551616", "18446744073709551617");
}

struct fp {
    uint8_t d[STORE_FINGERPRINT_BYTES];
};

static struct fp fingerprint(const char *body)
{
    struct fp f;
    assert_int_equal(idem_fingerprint("POST", "/v1/payments", 12, "application/json", body,
                                      strlen(body), CONFIG_FINGERPRINT_AUTO, f.d),
                     0);
    return f;
}

/* The fingerprint itself: these pairs collided when jansson's doubles went
 * into it (the same key replayed the first amount instead of a 422). */
static void test_fingerprint_numbers_collide_no_more(void **state)
{
    static const char *const pairs[][2] = {
        {"{\"amount\":1.000000000000000001}", "{\"amount\":1.000000000000000002}"},
        {"{\"amount\":9007199254740993.0}", "{\"amount\":9007199254740992.0}"},
        {"{\"amount\":1.50}", "{\"amount\":1.5}"},
        {"{\"amount\":100000000000000000000000000001,\"c\":1}",
         "{\"c\":1,\"amount\":100000000000000000000000000002}"},
    };
    (void)state;
    for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
        struct fp a = fingerprint(pairs[i][0]);
        struct fp b = fingerprint(pairs[i][1]);
        assert_memory_not_equal(a.d, b.d, sizeof(a.d));
    }
    /* Key order and white space still do not count, reals or not. */
    {
        struct fp a = fingerprint("{\"amount\":1.50,\"currency\":\"eur\"}");
        struct fp b = fingerprint(" { \"currency\" : \"eur\" ,\n\t\"amount\" : 1.50 }\r\n");
        assert_memory_equal(a.d, b.d, sizeof(a.d));
    }
}

/* ---- what must stay equal ----------------------------------------------- */

static void test_equivalences(void **state)
{
    (void)state;
    /* Key order, at every level. */
    assert_same("{\"a\":1,\"b\":{\"c\":[1,{\"e\":2,\"d\":3}]}}",
                "{\"b\":{\"c\":[1,{\"d\":3,\"e\":2}]},\"a\":1}");
    /* The four white space characters, anywhere between tokens. */
    assert_same("{\"a\":[1,2,true,null,\"x\"]}",
                " \t\r\n{ \"a\" :\n[ 1 ,\t2 , true,null ,\r\"x\" ] }\n\n");
    /* An escape and the character it names. */
    assert_same("\"A\\u00e9\\u20ac\\ud83d\\ude00/\"",
                "\"\\u0041\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\\/\"");
    assert_same("\"\\u00E9\"", "\"\\u00e9\"");
    assert_same("\"\\n\\b\"", "\"\\u000a\\u0008\"");
    assert_same("{\"\\u0061\":1}", "{\"a\":1}");
    /* The integer -0 is 0, as it was under jansson. */
    assert_same("-0", "0");
    assert_same("[-0]", "[0]");
}

/* ---- what jansson wrote -------------------------------------------------- */

static void test_jansson_output_rules(void **state)
{
    (void)state;
    assert_canon("{}", "{}");
    assert_canon("[ ]", "[]");
    assert_canon(" [ { } , [ ] ] ", "[{},[]]");
    assert_canon("\"\"", "\"\"");
    assert_canon("true", "true");
    assert_canon(" null ", "null");
    assert_canon("[-1,0,9223372036854775807,-9223372036854775808]",
                 "[-1,0,9223372036854775807,-9223372036854775808]");
    /* Short escapes, \u00XX in upper case, / and DEL and non-ASCII as is. */
    assert_canon("\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u0001\\u001f\\u007f\\u00e9\"",
                 "\"\\\"\\\\/\\b\\f\\n\\r\\t\\u0000\\u0001\\u001F\x7f\xc3\xa9\"");
    /* NUL inside a value string is fine (JSON_ALLOW_NUL). */
    assert_canon("{\"k\":\"a\\u0000b\"}", "{\"k\":\"a\\u0000b\"}");
    /* Sorted by bytes, the shorter key first; an escaped key by its bytes. */
    assert_canon("{\"b\":1,\"a\":2,\"\":3,\"ab\":4,\"\\u00e9\":5,\"z\":6,\"B\":7,\"\\n\":8}",
                 "{\"\":3,\"\\n\":8,\"B\":7,\"a\":2,\"ab\":4,\"b\":1,\"z\":6,\"\xc3\xa9\":5}");

    /* The same, checked against jansson itself. */
    {
        static const char *const docs[] = {
            "{\"b\":1,\"a\":2,\"\":3,\"ab\":4,\"\\u00e9\":5,\"z\":6,\"B\":7,\"\\n\":8}",
            "\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u0001\\u001f\\u007f\\u00e9\\ud83d\\ude00\"",
            "[-0,0,-1,9223372036854775807,-9223372036854775808,true,false,null]",
            "{\"\xf4\x8f\xbf\xbf\":\"\xef\xbf\xbf\",\"\\uffff\":[\"\\u0800\",\"\\u07ff\"]}",
        };
        struct diff_stats st = {0};
        for (size_t i = 0; i < sizeof(docs) / sizeof(docs[0]); i++)
            differential(docs[i], strlen(docs[i]), &st);
        assert_int_equal(st.both_accept, sizeof(docs) / sizeof(docs[0]));
    }
}

/* ---- what is refused ----------------------------------------------------- */

static void test_refused(void **state)
{
    /* Grouped by what is wrong, not one per line. */
    /* clang-format off */
    static const char *const bad[] = {
        "", " ", "{", "}", "[", "[1,]", "[,1]", "{\"a\":1,}", "{,}", "{\"a\"}", "{\"a\" 1}",
        "{'a':1}", "{a:1}", "[1 2]", "1 2", "{\"a\":1}}", "{\"a\":1} x", "01", "-01", "00",
        "-", "+1", ".5", "1.", "1.e5", "1e", "1e+", "-a", "0x10", "NaN", "Infinity", "-Infinity",
        "tru", "truex", "True", "nul", "nulll", "[true1]", "true1",
        /* white space RFC 8259 does not have */
        "\f1", "\v1", "[1,\f2]", "\xc2\xa0" "1",
        /* strings */
        "\"abc", "\"\\x\"", "\"\\U0041\"", "\"\\u12\"", "\"\\u12g4\"", "\"\\\"", "\"a\tb\"",
        "\"a\nb\"", "\"\x1f\"",
        /* lone or broken surrogates */
        "\"\\ud800\"", "\"\\udc00\"", "\"\\ud800\\u0041\"", "\"\\ud800x\"", "\"\\udbff\\udbff\"",
        "\"\\ude00\\ud83d\"",
        /* invalid UTF-8: continuation first, overlong, surrogate, past U+10FFFF,
         * truncated, bytes never used */
        "\"\x80\"", "\"\xc0\x80\"", "\"\xc1\xbf\"", "\"\xe0\x80\xaf\"", "\"\xed\xa0\x80\"",
        "\"\xf4\x90\x80\x80\"", "\"\xf0\x80\x80\x80\"", "\"\xe2\x82\"", "\"\xf5\x80\x80\x80\"",
        "\"\xff\"", "\xef\xbb\xbf{}",
        /* the same key twice, also when spelled differently */
        "{\"a\":1,\"a\":2}", "{\"a\":1,\"\\u0061\":1}", "{\"b\":1,\"a\":1,\"c\":1,\"a\":1}",
        "[{\"x\":{\"y\":1,\"y\":1}}]",
        /* NUL in a key, which jansson refused */
        "{\"a\\u0000b\":1}", "{\"\\u0000\":1}",
    };
    /* clang-format on */
    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct diff_stats st = {0};
        assert_refused(bad[i]);
        differential(bad[i], strlen(bad[i]), &st); /* jansson refuses it too */
        assert_int_equal(st.both_refuse, 1);
    }
    /* NUL bytes: in a string, after a value, alone. jansson skipped one
     * right after a number or a literal; this is not JSON, so refused. */
    assert_refused_n("\"a\0b\"", 5);
    assert_refused_n("[1\0]", 4);
    assert_refused_n("true\0", 5);
    assert_refused_n("\0", 1);
    assert_refused_n("{}\0", 3);
}

/* jansson's JSON_PARSER_MAX_DEPTH: a value nested in 2047 containers is the
 * deepest; the same limit here, checked against jansson. */
static char *nested(size_t depth, const char *inner, const char *open, const char *close,
                    size_t *len)
{
    size_t ol = strlen(open);
    size_t cl = strlen(close);
    size_t il = strlen(inner);
    char *s = malloc(depth * (ol + cl) + il + 1);
    size_t n = 0;

    assert_non_null(s);
    for (size_t i = 0; i < depth; i++, n += ol)
        memcpy(s + n, open, ol);
    memcpy(s + n, inner, il);
    n += il;
    for (size_t i = 0; i < depth; i++, n += cl)
        memcpy(s + n, close, cl);
    s[n] = '\0';
    *len = n;
    return s;
}

static void test_depth_limit(void **state)
{
    static const struct {
        size_t depth;
        const char *inner;
        const char *open;
        const char *close;
        bool ok;
    } cases[] = {
        {IDEM_CJSON_MAX_DEPTH - 1, "1", "[", "]", true},
        {IDEM_CJSON_MAX_DEPTH, "1", "[", "]", false},
        {IDEM_CJSON_MAX_DEPTH, "", "[", "]", true},
        {IDEM_CJSON_MAX_DEPTH, "{}", "[", "]", false},
        {IDEM_CJSON_MAX_DEPTH + 1, "", "[", "]", false},
        {IDEM_CJSON_MAX_DEPTH - 1, "{}", "[", "]", true},
        {IDEM_CJSON_MAX_DEPTH - 1, "{\"a\":1}", "[", "]", false},
        {IDEM_CJSON_MAX_DEPTH - 1, "null", "{\"b\":0,\"a\":", "}", true},
        {IDEM_CJSON_MAX_DEPTH, "null", "{\"b\":0,\"a\":", "}", false},
        {100000, "", "[", "]", false},
    };
    (void)state;
    assert_int_equal(IDEM_CJSON_MAX_DEPTH, JSON_PARSER_MAX_DEPTH);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t len;
        char *s = nested(cases[i].depth, cases[i].inner, cases[i].open, cases[i].close, &len);
        char *got = canon_n(s, len, NULL);
        struct diff_stats st = {0};
        if (cases[i].ok != (got != NULL))
            fail_msg("depth %zu of %s: %s", cases[i].depth, cases[i].inner,
                     got ? "accepted" : "refused");
        differential(s, len, &st);
        free(got);
        free(s);
    }
}

/* Large and hostile bodies: linear work, nothing quadratic. Each case
 * would take minutes if any step were quadratic in its size. */
static void test_large_bodies(void **state)
{
    const size_t n = 200000;
    size_t cap = 40 * n + 64;
    char *s = malloc(cap);
    size_t len = 0;
    char *got;
    size_t got_len;
    struct diff_stats st = {0};

    (void)state;
    assert_non_null(s);
    /* A wide object, keys in reverse order. */
    s[len++] = '{';
    for (size_t i = n; i > 0; i--)
        len += (size_t)snprintf(s + len, cap - len, "%s\"k%07zu\":%zu", i == n ? "" : ",", i, i);
    s[len++] = '}';
    differential(s, len, &st);
    assert_int_equal(st.both_accept, 1);

    /* A wide object whose duplicate is the last member. */
    len--;
    len += (size_t)snprintf(s + len, cap - len, ",\"k%07zu\":1}", n / 2);
    assert_refused_n(s, len);

    /* Deep nesting around a big object, every level sorted: each level's
     * members must not be moved again for every level above it. */
    len = 0;
    for (size_t i = 0; i < IDEM_CJSON_MAX_DEPTH - 2; i++)
        len += (size_t)snprintf(s + len, cap - len, "{\"z\":0,\"a\":");
    s[len++] = '[';
    for (size_t i = 0; i < n; i++)
        len += (size_t)snprintf(s + len, cap - len, "%s\"%zu\"", i ? "," : "", i);
    s[len++] = ']';
    for (size_t i = 0; i < IDEM_CJSON_MAX_DEPTH - 2; i++)
        s[len++] = '}';
    differential(s, len, &st);
    assert_int_equal(st.both_accept, 2);

    /* One big string of escapes. */
    len = 0;
    s[len++] = '"';
    for (size_t i = 0; i < n; i++)
        len += (size_t)snprintf(s + len, cap - len, "\\u00%02zx\\ud83d\\ude00", i % 256);
    s[len++] = '"';
    got = canon_n(s, len, &got_len);
    assert_non_null(got);
    free(got);
    differential(s, len, &st);
    free(s);
}

/* ---- differential: generated documents against jansson ------------------ */

/* xorshift64*: deterministic, so a failing case repeats. */
static uint64_t rng_state;

static uint64_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ULL;
}

static size_t below(size_t n)
{
    return (size_t)(rnd() % n);
}

struct buf {
    char *p;
    size_t n;
    size_t cap;
};

static void add(struct buf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void adds(struct buf *b, const char *s)
{
    add(b, s, strlen(s));
}

static void gen_ws(struct buf *b)
{
    static const char ws[] = " \t\n\r";
    size_t n = below(8) == 0 ? below(4) + 1 : 0;
    for (size_t i = 0; i < n; i++)
        add(b, &ws[below(4)], 1);
}

static void put_cp_utf8(struct buf *b, uint32_t cp)
{
    char u[4];
    size_t n;
    if (cp < 0x80) {
        u[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xC0 | cp >> 6);
        u[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | cp >> 12);
        u[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        u[0] = (char)(0xF0 | cp >> 18);
        u[1] = (char)(0x80 | (cp >> 12 & 0x3F));
        u[2] = (char)(0x80 | (cp >> 6 & 0x3F));
        u[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    add(b, u, n);
}

static uint32_t gen_cp(void)
{
    uint32_t cp;
    switch (below(6)) {
    case 0:
        return (uint32_t)below(0x20); /* control */
    case 1:
        return 0x20 + (uint32_t)below(0x60); /* ASCII, DEL included */
    case 2:
        return 0x80 + (uint32_t)below(0x780);
    case 3:
        cp = 0x800 + (uint32_t)below(0x10000 - 0x800);
        return cp >= 0xD800 && cp <= 0xDFFF ? 0xFFFD : cp;
    case 4:
        return 0x10000 + (uint32_t)below(0x100000);
    default:
        return "\"\\/ab"[below(5)];
    }
}

/* A string; small alphabets for keys, so keys repeat and share prefixes. */
static void gen_string(struct buf *b, bool key)
{
    static const char *const key_parts[] = {"a",       "b",        "ab",  "",        "B", "\\u0061",
                                            "\\u00e9", "\xc3\xa9", "\\n", "\\u0000", "z", "\\/"};
    size_t n = below(key ? 3 : 8);
    char esc[16];

    adds(b, "\"");
    for (size_t i = 0; i < n; i++) {
        uint32_t cp;
        if (key) {
            adds(b, key_parts[below(sizeof(key_parts) / sizeof(key_parts[0]))]);
            continue;
        }
        cp = gen_cp();
        switch (below(4)) {
        case 0: /* \u escape, either case, surrogate pairs past the BMP */
            if (cp >= 0x10000) {
                uint32_t v = cp - 0x10000;
                snprintf(esc, sizeof(esc), below(2) ? "\\u%04x\\u%04x" : "\\u%04X\\u%04X",
                         0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
            } else {
                snprintf(esc, sizeof(esc), below(2) ? "\\u%04x" : "\\u%04X", cp);
            }
            adds(b, esc);
            break;
        case 1: { /* a short escape */
            static const char *const shorts[] = {"\\\"", "\\\\", "\\/", "\\b",
                                                 "\\f",  "\\n",  "\\r", "\\t"};
            adds(b, shorts[below(8)]);
            break;
        }
        default: /* the character itself, where JSON allows it */
            if (cp < 0x20 || cp == '"' || cp == '\\')
                cp = 'x';
            put_cp_utf8(b, cp);
            break;
        }
    }
    adds(b, "\"");
}

static void gen_number(struct buf *b, bool reals)
{
    static const char *const edges[] = {
        "0", "-0", "1", "-1", "9223372036854775807", "-9223372036854775808", "9007199254740993"};
    char s[64];
    size_t n;

    if (below(4) == 0) {
        adds(b, edges[below(sizeof(edges) / sizeof(edges[0]))]);
        return;
    }
    if (below(2))
        adds(b, "-");
    n = 1 + below(below(10) == 0 ? 19 : 6);
    s[0] = (char)('1' + below(9));
    for (size_t i = 1; i < n; i++)
        s[i] = (char)('0' + below(10));
    add(b, s, n);
    if (reals && below(3) == 0) {
        adds(b, ".");
        n = 1 + below(20);
        for (size_t i = 0; i < n; i++)
            s[i] = (char)('0' + below(10));
        add(b, s, n);
    }
    if (reals && below(5) == 0) {
        adds(b, below(2) ? "e" : "E");
        if (below(2))
            adds(b, below(2) ? "+" : "-");
        snprintf(s, sizeof(s), "%zu", below(400));
        adds(b, s);
    }
}

static void gen_value(struct buf *b, size_t depth, bool reals)
{
    size_t kind = below(depth < 6 ? 9 : 6);

    gen_ws(b);
    switch (kind) {
    case 0:
    case 1:
        gen_number(b, reals);
        break;
    case 2:
    case 3:
        gen_string(b, false);
        break;
    case 4:
        adds(b, below(2) ? "true" : below(2) ? "false" : "null");
        break;
    case 5:
        adds(b, below(2) ? "[]" : "{}");
        break;
    case 6:
    case 7: {
        size_t n = below(6);
        adds(b, "{");
        for (size_t i = 0; i < n; i++) {
            if (i > 0)
                adds(b, ",");
            gen_ws(b);
            gen_string(b, true);
            gen_ws(b);
            adds(b, ":");
            gen_value(b, depth + 1, reals);
        }
        gen_ws(b);
        adds(b, "}");
        break;
    }
    default: {
        size_t n = below(6);
        adds(b, "[");
        for (size_t i = 0; i < n; i++) {
            if (i > 0)
                adds(b, ",");
            gen_value(b, depth + 1, reals);
        }
        gen_ws(b);
        adds(b, "]");
        break;
    }
    }
    gen_ws(b);
}

/* Changes a few bytes: flips, inserts, deletes, truncation. */
static void mutate(struct buf *b)
{
    static const char interesting[] = "{}[],:\"\\u0-.eE+ \t\n\r\f\x00\x7f\x80\xc3\xed\xf4\xff";
    size_t n = 1 + below(3);

    for (size_t i = 0; i < n && b->n > 0; i++) {
        size_t at = below(b->n);
        char c = below(2) ? interesting[below(sizeof(interesting) - 1)] : (char)below(256);
        switch (below(4)) {
        case 0:
            b->p[at] = c;
            break;
        case 1:
            add(b, "", 1); /* room for one more */
            b->n--;
            memmove(b->p + at + 1, b->p + at, b->n - at);
            b->p[at] = c;
            b->n++;
            break;
        case 2:
            memmove(b->p + at, b->p + at + 1, b->n - at - 1);
            b->n--;
            break;
        default:
            b->n = at;
            break;
        }
    }
}

static unsigned long iterations(void)
{
    const char *s = getenv("IDEM_CJSON_ITERATIONS");
    unsigned long n = s ? strtoul(s, NULL, 10) : 0;
    return n > 0 ? n : 50000;
}

static void test_differential_generated(void **state)
{
    unsigned long n = iterations();
    struct diff_stats st = {0};
    struct buf b = {0};

    (void)state;
    rng_state = 0x9E3779B97F4A7C15ULL;
    for (unsigned long i = 0; i < n; i++) {
        b.n = 0;
        gen_value(&b, 0, i % 4 == 3);
        differential(b.p, b.n, &st);
    }
    free(b.p);
    print_message("generated: %lu documents, %lu identical to jansson, %lu with reals, %lu "
                  "refused by both, %lu numbers too big for jansson\n",
                  n, st.both_accept, st.with_reals, st.both_refuse, st.wide_numbers);
    assert_true(st.both_accept > n / 2);
}

static void test_differential_mutated(void **state)
{
    unsigned long n = iterations();
    struct diff_stats st = {0};
    struct buf b = {0};

    (void)state;
    rng_state = 0xD1B54A32D192ED03ULL;
    for (unsigned long i = 0; i < n; i++) {
        b.n = 0;
        gen_value(&b, 0, i % 4 == 3);
        mutate(&b);
        differential(b.p, b.n, &st);
    }
    free(b.p);
    print_message("mutated: %lu documents, %lu identical to jansson, %lu with reals, %lu "
                  "refused by both, %lu numbers too big for jansson\n",
                  n, st.both_accept, st.with_reals, st.both_refuse, st.wide_numbers);
    assert_true(st.both_refuse > n / 4);
    assert_true(st.both_accept > n / 20);
}

static void test_strerror(void **state)
{
    (void)state;
    assert_string_equal(idem_canonical_json_strerror(0), "ok");
    assert_non_null(idem_canonical_json_strerror(IDEM_CJSON_NOT_JSON));
    assert_non_null(idem_canonical_json_strerror(IDEM_CJSON_NOMEM));
    assert_non_null(idem_canonical_json_strerror(12345));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_numbers_kept_as_written),
        cmocka_unit_test(test_fingerprint_numbers_collide_no_more),
        cmocka_unit_test(test_equivalences),
        cmocka_unit_test(test_jansson_output_rules),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_depth_limit),
        cmocka_unit_test(test_large_bodies),
        cmocka_unit_test(test_differential_generated),
        cmocka_unit_test(test_differential_mutated),
        cmocka_unit_test(test_strerror),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
