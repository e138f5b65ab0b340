/*
 * fuzz_headers.c - the header filters and the stored header encoding on
 * arbitrary header lists.
 *
 * Input: a header list, one header per record, name and value split at the
 * first name separator (a record without one is a name with an empty
 * value). Two framings, chosen by the first byte, so that both readable
 * seeds and values holding LF are possible:
 *   - text (first byte not NUL): records end at LF, name ends at ':';
 *   - binary (first byte NUL, then the list): records end at 0x1e (ASCII
 *     record separator), name ends at 0x1f (unit separator).
 * Bytes are taken as they are: CR, NUL and non-ASCII reach the filters.
 *
 * Invariants:
 *   - idem_filter_request_headers() fails (-1) exactly when some input name
 *     is not a token or some value holds CR, LF or NUL; otherwise what it
 *     emits has token names, no CR/LF/NUL anywhere, exactly one
 *     X-Forwarded-For (the client address) and X-Forwarded-Proto, at most
 *     one X-Forwarded-Host, and nothing hop-by-hop, Host, Content-Length,
 *     Expect, or named by a Connection header;
 *   - idem_filter_response_headers() emits only clean headers too, with and
 *     without a route's strip list, and never a stripped one;
 *   - idem_headers_encode() then idem_headers_decode() gives the list back
 *     when it has no empty name and no NUL, and is refused otherwise.
 */
#include "fuzz.h"

#include <stdbool.h>
#include <string.h>
#include <strings.h>

#include "policy.h"

#define CLIENT_ADDR "192.0.2.7"

static bool is_tchar(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

static bool is_token(const char *s, size_t len)
{
    bool ok = len > 0;
    for (size_t i = 0; ok && i < len; i++)
        ok = is_tchar((unsigned char)s[i]);
    return ok;
}

static bool has_break(const char *s, size_t len)
{
    return memchr(s, '\r', len) != NULL || memchr(s, '\n', len) != NULL ||
           memchr(s, '\0', len) != NULL;
}

static void check_clean(const struct idem_headers *h)
{
    for (size_t i = 0; i < h->n; i++) {
        const struct idem_header *hd = &h->v[i];
        FUZZ_CHECK(is_token(hd->name, hd->name_len));
        FUZZ_CHECK(!has_break(hd->name, hd->name_len));
        FUZZ_CHECK(!has_break(hd->value, hd->value_len));
        FUZZ_CHECK(hd->name[hd->name_len] == '\0' && hd->value[hd->value_len] == '\0');
    }
}

static void parse_input(const uint8_t *data, size_t size, struct idem_headers *in)
{
    uint8_t rs = '\n';
    uint8_t us = ':';
    size_t off = 0;

    if (size > 0 && data[0] == 0) {
        rs = 0x1e;
        us = 0x1f;
        off = 1;
    }
    while (off < size) {
        const uint8_t *rec = data + off;
        const uint8_t *end = memchr(rec, rs, size - off);
        size_t rlen = end ? (size_t)(end - rec) : size - off;
        const uint8_t *sep = memchr(rec, us, rlen);
        size_t nlen = sep ? (size_t)(sep - rec) : rlen;
        const uint8_t *val = sep ? sep + 1 : rec + rlen;
        size_t vlen = sep ? rlen - nlen - 1 : 0;

        FUZZ_CHECK(idem_headers_push(in, (const char *)rec, nlen, (const char *)val, vlen) == 0);
        off += rlen + (end ? 1 : 0);
    }
}

static void check_round_trip(const struct idem_headers *h)
{
    struct idem_headers back = {0};
    uint8_t *buf = NULL;
    size_t len = 0;
    bool encodable = true;

    for (size_t i = 0; i < h->n; i++) {
        const struct idem_header *hd = &h->v[i];
        if (hd->name_len == 0 || memchr(hd->name, '\0', hd->name_len) != NULL ||
            memchr(hd->value, '\0', hd->value_len) != NULL)
            encodable = false;
    }
    FUZZ_CHECK(idem_headers_encode(h, &buf, &len) == 0);
    FUZZ_CHECK((len == 0) == (buf == NULL));
    if (encodable) {
        FUZZ_CHECK(idem_headers_decode(buf, len, &back) == 0);
        FUZZ_CHECK(back.n == h->n && back.bytes == h->bytes);
        for (size_t i = 0; i < h->n; i++) {
            FUZZ_CHECK(back.v[i].name_len == h->v[i].name_len);
            FUZZ_CHECK(back.v[i].value_len == h->v[i].value_len);
            FUZZ_CHECK(memcmp(back.v[i].name, h->v[i].name, h->v[i].name_len) == 0);
            FUZZ_CHECK(memcmp(back.v[i].value, h->v[i].value, h->v[i].value_len) == 0);
        }
    } else {
        FUZZ_CHECK(idem_headers_decode(buf, len, &back) == -1);
    }
    idem_headers_clear(&back);
    free(buf);
}

/* Non-empty comma-separated tokens over every Connection header: more than
 * 32 of them is refused by the filter. */
static size_t connection_tokens(const struct idem_headers *in)
{
    size_t n = 0;
    for (size_t i = 0; i < in->n; i++) {
        const char *p = in->v[i].value;
        if (strcasecmp(in->v[i].name, "Connection") != 0)
            continue;
        while (*p != '\0') {
            bool any = false;
            while (*p == ' ' || *p == '\t' || *p == ',')
                p++;
            while (*p != '\0' && *p != ',') {
                if (*p != ' ' && *p != '\t')
                    any = true;
                p++;
            }
            n += any;
        }
    }
    return n;
}

static void check_request_filter(const struct idem_headers *in)
{
    static const char *const never[] = {
        "Host",    "Content-Length", "Expect",     "Connection",        "TE",
        "Trailer", "Upgrade",        "Keep-Alive", "Transfer-Encoding", "Forwarded"};
    const struct idem_forward_info info = {CLIENT_ADDR, "http"};
    struct idem_headers out = {0};
    const struct idem_header *xff;
    bool bad = false;
    int rc;

    for (size_t i = 0; i < in->n; i++)
        bad = bad || !is_token(in->v[i].name, in->v[i].name_len) ||
              has_break(in->v[i].value, in->v[i].value_len);
    bad = bad || connection_tokens(in) > 32;
    rc = idem_filter_request_headers(in, &info, &out);
    FUZZ_CHECK(rc == 0 || rc == -1);
    FUZZ_CHECK((rc == -1) == bad);
    check_clean(&out);
    if (rc == 0) {
        FUZZ_CHECK(idem_headers_count(&out, "X-Forwarded-For") == 1);
        xff = idem_headers_find(&out, "X-Forwarded-For");
        FUZZ_CHECK(strcmp(xff->value, CLIENT_ADDR) == 0);
        FUZZ_CHECK(idem_headers_count(&out, "X-Forwarded-Proto") == 1);
        FUZZ_CHECK(idem_headers_count(&out, "X-Forwarded-Host") <= 1);
        for (size_t k = 0; k < sizeof(never) / sizeof(never[0]); k++)
            FUZZ_CHECK(idem_headers_find(&out, never[k]) == NULL);
        for (size_t i = 0; i < out.n; i++) {
            FUZZ_CHECK(!idem_header_is_hop_by_hop(out.v[i].name));
            /* Our own X-Forwarded-* are added after the client's are gone. */
            if (strncasecmp(out.v[i].name, "X-Forwarded-", 12) != 0)
                FUZZ_CHECK(!idem_header_named_by_connection(in, out.v[i].name));
        }
        check_round_trip(&out);
    }
    idem_headers_clear(&out);
}

static void check_response_filter(const struct idem_headers *in)
{
    static char set_cookie[] = "Set-Cookie";
    static char x_secret[] = "x-secret";
    static char *strip[] = {set_cookie, x_secret};
    struct config_route route;
    struct idem_headers out = {0};

    memset(&route, 0, sizeof(route));
    route.strip_headers = strip;
    route.n_strip_headers = 2;

    FUZZ_CHECK(idem_filter_response_headers(in, NULL, &out) == 0);
    check_clean(&out);
    for (size_t i = 0; i < out.n; i++) {
        FUZZ_CHECK(!idem_header_is_hop_by_hop(out.v[i].name));
        FUZZ_CHECK(strcasecmp(out.v[i].name, "Content-Length") != 0);
        FUZZ_CHECK(!idem_header_named_by_connection(in, out.v[i].name));
    }
    check_round_trip(&out);
    idem_headers_clear(&out);

    FUZZ_CHECK(idem_filter_response_headers(in, &route, &out) == 0);
    check_clean(&out);
    FUZZ_CHECK(idem_headers_find(&out, "SET-COOKIE") == NULL);
    FUZZ_CHECK(idem_headers_find(&out, "X-Secret") == NULL);
    check_round_trip(&out);
    idem_headers_clear(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct idem_headers in = {0};

    parse_input(data, size, &in);
    check_request_filter(&in);
    check_response_filter(&in);
    check_round_trip(&in);
    idem_headers_clear(&in);
    return 0;
}
