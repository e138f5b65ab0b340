/*
 * test_upstream.c - the native upstream client's response parser
 * (proxy/upstream.h): framing, chunked bodies, interim answers, trailers,
 * the repairs of odd field lines, the caps, and the same answers cut at
 * every byte boundary.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "upstream.h"

#define HDR_MAX 8192
#define BODY_MAX (1u << 20)

/*
 * Feeds data the way a connection does: pieces appended to a buffer, the
 * parser given the whole buffer, what it did not consume kept for the next
 * round. cut == 0: one piece; cut > 0: the first piece is cut bytes, the
 * rest follows; step > 0: pieces of step bytes. With eof the connection
 * ends after the last piece.
 */
static enum upstream_parse_rc feed(struct upstream_parser *p, const char *data, size_t len,
                                   size_t cut, size_t step, bool eof, size_t *left)
{
    static char buf[1 << 16];
    size_t bl = 0, pos = 0;
    enum upstream_parse_rc rc = UPSTREAM_PARSE_MORE;

    while (pos < len) {
        size_t n = len - pos;
        size_t used = 0;
        if (step > 0 && n > step)
            n = step;
        if (cut > 0 && pos == 0 && n > cut)
            n = cut;
        assert_true(bl + n <= sizeof(buf));
        memcpy(buf + bl, data + pos, n);
        bl += n;
        pos += n;
        rc = upstream_parse(p, buf, bl, &used);
        assert_true(used <= bl);
        memmove(buf, buf + used, bl - used);
        bl -= used;
        if (rc != UPSTREAM_PARSE_MORE)
            break;
    }
    if (left != NULL)
        *left = bl + (len - pos);
    if (rc == UPSTREAM_PARSE_MORE && eof)
        rc = upstream_parse_eof(p);
    return rc;
}

static enum upstream_parse_rc parse_all(struct upstream_parser *p, bool head, const char *data,
                                        bool eof)
{
    upstream_parser_init(p, head, HDR_MAX, BODY_MAX);
    return feed(p, data, strlen(data), 0, 0, eof, NULL);
}

static const char *hval(const struct upstream_parser *p, const char *name)
{
    const struct idem_header *h = idem_headers_find(&p->resp.headers, name);
    return h != NULL ? h->value : NULL;
}

static void assert_body(const struct upstream_parser *p, const char *want)
{
    assert_int_equal(p->resp.body_len, strlen(want));
    if (p->resp.body_len > 0)
        assert_memory_equal(p->resp.body, want, p->resp.body_len);
}

/* ---- framing --------------------------------------------------------- */

static void content_length_keep_alive(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false,
                               "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\n"
                               "Content-Length: 5\r\n\r\nhello",
                               false),
                     UPSTREAM_PARSE_DONE);
    assert_int_equal(p.resp.status, 201);
    assert_string_equal(hval(&p, "content-type"), "text/plain");
    assert_body(&p, "hello");
    assert_true(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
}

static void bytes_after_answer_not_consumed(void **state)
{
    struct upstream_parser p;
    size_t left = 0;
    const char *d = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n";
    (void)state;
    upstream_parser_init(&p, false, HDR_MAX, BODY_MAX);
    assert_int_equal(feed(&p, d, strlen(d), 0, 0, false, &left), UPSTREAM_PARSE_DONE);
    assert_int_equal(left, strlen("HTTP/1.1 200 OK\r\n"));
    assert_body(&p, "ok");
    upstream_parser_clear(&p);
}

static void connection_close_not_kept(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false,
                               "HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\n"
                               "Content-Length: 0\r\n\r\n",
                               false),
                     UPSTREAM_PARSE_DONE);
    assert_false(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
}

static void http10_read_until_close(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false, "HTTP/1.0 200 OK\r\nX-A: 1\r\n\r\nuntil the end", false),
                     UPSTREAM_PARSE_MORE);
    assert_int_equal(upstream_parse_eof(&p), UPSTREAM_PARSE_DONE);
    assert_body(&p, "until the end");
    assert_false(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
}

static void http10_with_length_not_kept(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false, "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", false),
                     UPSTREAM_PARSE_DONE);
    assert_false(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
}

static void no_length_http11_reads_until_close(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false, "HTTP/1.1 200 OK\r\n\r\nabc", true), UPSTREAM_PARSE_DONE);
    assert_body(&p, "abc");
    assert_false(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
}

static void other_transfer_codings_are_broken(void **state)
{
    struct upstream_parser p;
    /* The proxy drops Transfer-Encoding (hop by hop): a coding other than
     * chunked would leave encoded bytes stored as the body. Broken, as
     * libcurl had it; so is a second field. */
    static const char *const te[] = {
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n3\r\nabc",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
        "0\r\n\r\n",
    };
    (void)state;
    for (size_t i = 0; i < sizeof(te) / sizeof(te[0]); i++) {
        assert_int_equal(parse_all(&p, false, te[i], true), UPSTREAM_PARSE_BROKEN);
        upstream_parser_clear(&p);
    }
}

static void no_body_for_head_204_304(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, true, "HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n", false),
                     UPSTREAM_PARSE_DONE);
    assert_int_equal(p.resp.body_len, 0);
    assert_string_equal(hval(&p, "Content-Length"), "99");
    assert_true(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
    assert_int_equal(parse_all(&p, false, "HTTP/1.1 204 No Content\r\n\r\n", false),
                     UPSTREAM_PARSE_DONE);
    assert_true(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
    assert_int_equal(
        parse_all(&p, false, "HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n", false),
        UPSTREAM_PARSE_DONE);
    assert_int_equal(p.resp.body_len, 0);
    upstream_parser_clear(&p);
}

static void same_content_length_twice_accepted(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(
        parse_all(&p, false, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
                  false),
        UPSTREAM_PARSE_DONE);
    upstream_parser_clear(&p);
}

static void ambiguous_framing_broken(void **state)
{
    static const char *const bad[] = {
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: \r\n\r\n",
    };
    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct upstream_parser p;
        assert_int_equal(parse_all(&p, false, bad[i], false), UPSTREAM_PARSE_BROKEN);
        upstream_parser_clear(&p);
    }
}

static void bad_status_lines_broken(void **state)
{
    static const char *const bad[] = {
        "HTTP/1.1 2x1 Cr\x01"
        "ated\r\nContent-Length: 0\r\n\r\n",
        "HTTP/2 200 OK\r\n\r\n",
        "HTTP/1.1 99 Low\r\n\r\n",
        "HTTP/1.1 600 High\r\n\r\n",
        "HTTP/1.1 2000 OK\r\n\r\n",
        "HTTP/1.1  200 OK\r\n\r\n",
        "ICY 200 OK\r\n\r\n",
        "\r\nHTTP/1.1 200 OK\r\n\r\n",
        "hello\n",
    };
    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct upstream_parser p;
        assert_int_equal(parse_all(&p, false, bad[i], false), UPSTREAM_PARSE_BROKEN);
        upstream_parser_clear(&p);
    }
}

static void status_line_without_reason(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false, "HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n", false),
                     UPSTREAM_PARSE_DONE);
    assert_int_equal(p.resp.status, 200);
    upstream_parser_clear(&p);
    /* Bare LF line ends are read too. */
    assert_int_equal(parse_all(&p, false, "HTTP/1.1 202 Accepted\nContent-Length: 1\n\nx", false),
                     UPSTREAM_PARSE_DONE);
    assert_int_equal(p.resp.status, 202);
    assert_body(&p, "x");
    upstream_parser_clear(&p);
}

static void eof_before_end_broken(void **state)
{
    static const char *const cut[] = {
        "",
        "HTTP/1.1 200 OK\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n",
    };
    (void)state;
    for (size_t i = 0; i < sizeof(cut) / sizeof(cut[0]); i++) {
        struct upstream_parser p;
        assert_int_equal(parse_all(&p, false, cut[i], true), UPSTREAM_PARSE_BROKEN);
        upstream_parser_clear(&p);
    }
}

/* ---- chunked ------------------------------------------------------------ */

static void chunked_with_extensions(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false,
                               "HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n"
                               "5;name=value\r\nhello\r\n1 ; x\r\n \r\nA\r\n0123456789\r\n"
                               "0\r\n\r\n",
                               false),
                     UPSTREAM_PARSE_DONE);
    assert_body(&p, "hello 0123456789");
    assert_true(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
}

static void chunked_trailers_dropped(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false,
                               "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                               "X-Request-Id: r-1\r\nTransfer-Encoding: chunked\r\n\r\n"
                               "2\r\n{}\r\n0\r\nContent-Type: text/html\r\n"
                               "Set-Cookie: trailer=1\r\nConnection: X-Request-Id\r\n"
                               "Content-Length: 1\r\n\r\n",
                               false),
                     UPSTREAM_PARSE_DONE);
    assert_body(&p, "{}");
    assert_int_equal(p.resp.headers.n, 3);
    assert_int_equal(idem_headers_count(&p.resp.headers, "Content-Type"), 1);
    assert_string_equal(hval(&p, "Content-Type"), "application/json");
    assert_null(hval(&p, "Set-Cookie"));
    assert_null(hval(&p, "Connection"));
    assert_null(hval(&p, "Content-Length"));
    upstream_parser_clear(&p);
}

static void bad_chunks_broken(void **state)
{
    static const char *const bad[] = {
        "zz\r\nhello\r\n0\r\n\r\n", "\r\n",
        "5x\r\nhello\r\n0\r\n\r\n", "5\r\nhelloXX0\r\n\r\n",
        "-5\r\nhello\r\n0\r\n\r\n", "10000000000000000\r\n",
    };
    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct upstream_parser p;
        char d[256];
        snprintf(d, sizeof(d), "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%s", bad[i]);
        assert_int_equal(parse_all(&p, false, d, false), UPSTREAM_PARSE_BROKEN);
        upstream_parser_clear(&p);
    }
}

static void chunk_size_line_too_long_broken(void **state)
{
    struct upstream_parser p;
    char *d = malloc(UPSTREAM_MAX_CHUNK_LINE * 2 + 100);
    int n;
    (void)state;
    assert_non_null(d);
    n = sprintf(d, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;");
    memset(d + n, 'e', UPSTREAM_MAX_CHUNK_LINE * 2);
    d[n + UPSTREAM_MAX_CHUNK_LINE * 2] = '\0';
    assert_int_equal(parse_all(&p, false, d, false), UPSTREAM_PARSE_BROKEN);
    upstream_parser_clear(&p);
    free(d);
}

/* ---- 1xx and field lines ------------------------------------------------ */

static void interim_answers_skipped(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false,
                               "HTTP/1.1 100 Continue\r\n\r\n"
                               "HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
                               "HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
                               false),
                     UPSTREAM_PARSE_DONE);
    assert_int_equal(p.resp.status, 201);
    assert_null(hval(&p, "Link"));
    assert_int_equal(p.resp.headers.n, 1);
    assert_body(&p, "ok");
    upstream_parser_clear(&p);
}

static void odd_fields_repaired(void **state)
{
    struct upstream_parser p;
    (void)state;
    assert_int_equal(parse_all(&p, false,
                               "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n"
                               "X-Folded: first-part\r\n \t second-part\r\n"
                               "X-Empty:\r\nX-Space : spaced\r\nX-Trim:  v  \r\n\r\n",
                               false),
                     UPSTREAM_PARSE_DONE);
    assert_string_equal(hval(&p, "X-Folded"), "first-part second-part");
    assert_non_null(hval(&p, "X-Empty"));
    assert_string_equal(hval(&p, "X-Empty"), "");
    assert_string_equal(hval(&p, "X-Space"), "spaced");
    assert_string_equal(hval(&p, "X-Trim"), "v");
    assert_int_equal(p.resp.headers.n, 5);
    upstream_parser_clear(&p);
}

/* A folded line continues the field's value, and framing follows the
 * value as folded: a fold could otherwise slip a coding past the
 * "chunked alone" rule, and gzip bytes be stored as the body. */
static void folded_framing_fields_are_checked(void **state)
{
    struct upstream_parser p;
    static const char *const bad[] = {
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n , gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n 6\r\n\r\nhello!",
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\t, x\r\n\r\n",
    };
    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(parse_all(&p, false, bad[i], false), UPSTREAM_PARSE_BROKEN);
        upstream_parser_clear(&p);
    }
    /* Connection: keep-alive folded with close: not kept. */
    assert_int_equal(parse_all(&p, false,
                               "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n , close\r\n"
                               "Content-Length: 0\r\n\r\n",
                               false),
                     UPSTREAM_PARSE_DONE);
    assert_false(upstream_parse_keep_alive(&p));
    upstream_parser_clear(&p);
}

static void field_line_without_name_is_broken(void **state)
{
    struct upstream_parser p;
    static const char *const bad[] = {
        "HTTP/1.1 200 OK\r\nNoColon\r\nContent-Length: 2\r\n\r\nok",
        "HTTP/1.1 200 OK\r\n: no name\r\nContent-Length: 2\r\n\r\nok",
    };
    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(parse_all(&p, false, bad[i], false), UPSTREAM_PARSE_BROKEN);
        upstream_parser_clear(&p);
    }
}

/* A NUL in a field line (found by fuzz_upstream): "Transfer-Encoding\0x"
 * was not Transfer-Encoding to the framing check but was to the C-string
 * lookup at the end of the head, so a Content-Length answer was read until
 * close and stored with the next bytes as its body. */
static void nul_in_field_line_is_broken(void **state)
{
    struct upstream_parser p;
    static const char head[] = "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
                               "Transfer-Encoding\0x: chunked\r\n\r\nabcdef";
    static const char value[] = "HTTP/1.1 200 OK\r\nX-A: a\0b\r\n"
                                "Content-Length: 2\r\n\r\nok";
    (void)state;
    upstream_parser_init(&p, false, HDR_MAX, BODY_MAX);
    assert_int_equal(feed(&p, head, sizeof(head) - 1, 0, 0, true, NULL), UPSTREAM_PARSE_BROKEN);
    upstream_parser_clear(&p);
    upstream_parser_init(&p, false, HDR_MAX, BODY_MAX);
    assert_int_equal(feed(&p, value, sizeof(value) - 1, 0, 0, true, NULL), UPSTREAM_PARSE_BROKEN);
    upstream_parser_clear(&p);
}

/* ---- caps ------------------------------------------------------------- */

static void header_block_too_large(void **state)
{
    struct upstream_parser p;
    char *d = malloc(HDR_MAX * 2 + 200);
    size_t n;
    (void)state;
    assert_non_null(d);
    n = (size_t)sprintf(d, "HTTP/1.1 200 OK\r\n");
    /* Many fields under the cap each, over it together. */
    while (n < HDR_MAX * 2 - 100)
        n += (size_t)sprintf(d + n, "X-Pad: %040zu\r\n", n);
    n += (size_t)sprintf(d + n, "Content-Length: 0\r\n\r\n");
    assert_int_equal(parse_all(&p, false, d, false), UPSTREAM_PARSE_TOO_LARGE);
    assert_true(p.resp.headers_too_large);
    upstream_parser_clear(&p);
    /* One field longer than the cap, never completed: refused as soon as
     * the held-back line exceeds it, not after waiting for its end. */
    n = (size_t)sprintf(d, "HTTP/1.1 200 OK\r\nX-Long: ");
    memset(d + n, 'v', HDR_MAX + 10);
    d[n + HDR_MAX + 10] = '\0';
    assert_int_equal(parse_all(&p, false, d, false), UPSTREAM_PARSE_TOO_LARGE);
    assert_true(p.resp.headers_too_large);
    upstream_parser_clear(&p);
    free(d);
}

static void header_block_at_cap_accepted(void **state)
{
    struct upstream_parser p;
    char d[256];
    const char *line = "X-A: 0123456789";
    (void)state;
    snprintf(d, sizeof(d), "HTTP/1.1 200 OK\r\n%s\r\n\r\n", line);
    /* One field costs its line plus 4 (see server.c answer_header_bytes). */
    upstream_parser_init(&p, false, strlen(line) + 4, BODY_MAX);
    assert_int_equal(feed(&p, d, strlen(d), 0, 0, true, NULL), UPSTREAM_PARSE_DONE);
    upstream_parser_clear(&p);
    upstream_parser_init(&p, false, strlen(line) + 3, BODY_MAX);
    assert_int_equal(feed(&p, d, strlen(d), 0, 0, true, NULL), UPSTREAM_PARSE_TOO_LARGE);
    upstream_parser_clear(&p);
}

static void body_over_cap_too_large(void **state)
{
    static const char *const big[] = {
        "HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n0123456789a",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: "
        "chunked\r\n\r\n6\r\n012345\r\n5\r\n6789a\r\n0\r\n\r\n",
        "HTTP/1.0 200 OK\r\n\r\n0123456789a",
    };
    (void)state;
    for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
        struct upstream_parser p;
        upstream_parser_init(&p, false, HDR_MAX, 10);
        assert_int_equal(feed(&p, big[i], strlen(big[i]), 0, 0, true, NULL),
                         UPSTREAM_PARSE_TOO_LARGE);
        assert_false(p.resp.headers_too_large);
        upstream_parser_clear(&p);
        /* At the cap exactly: fine. */
        upstream_parser_init(&p, false, HDR_MAX, 11);
        assert_int_equal(feed(&p, big[i], strlen(big[i]), 0, 0, true, NULL), UPSTREAM_PARSE_DONE);
        assert_body(&p, "0123456789a");
        upstream_parser_clear(&p);
    }
}

static void trailers_over_cap_too_large(void **state)
{
    struct upstream_parser p;
    const char *d = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"
                    "X-T1: 0123456789012345678901234567890123456789\r\n"
                    "X-T2: 0123456789012345678901234567890123456789\r\n\r\n";
    (void)state;
    upstream_parser_init(&p, false, 64, BODY_MAX);
    assert_int_equal(feed(&p, d, strlen(d), 0, 0, false, NULL), UPSTREAM_PARSE_TOO_LARGE);
    upstream_parser_clear(&p);
}

/* ---- split reads -------------------------------------------------------- */

struct split_case {
    const char *data;
    bool head;
    bool eof;
    enum upstream_parse_rc rc;
    int status;
    const char *body;
};

static void same_at_every_boundary(void **state)
{
    static const struct split_case cases[] = {
        {"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello", false, false,
         UPSTREAM_PARSE_DONE, 200, "hello"},
        {"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n"
         "\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n",
         false, false, UPSTREAM_PARSE_DONE, 201, "abcde"},
        {"HTTP/1.1 200 OK\r\nX-F: a\r\n  b\r\nX-Empty:\r\nX-S : s\r\nContent-Length: 1\r\n\r\nz",
         false, false, UPSTREAM_PARSE_DONE, 200, "z"},
        {"HTTP/1.0 200 OK\r\nX-A: 1\r\n\r\nread until close", false, true, UPSTREAM_PARSE_DONE, 200,
         "read until close"},
        {"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", true, false, UPSTREAM_PARSE_DONE, 200, ""},
        {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n", false, false,
         UPSTREAM_PARSE_BROKEN, 200, NULL},
        {"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", false, false,
         UPSTREAM_PARSE_BROKEN, 200, NULL},
    };
    (void)state;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const struct split_case *k = &cases[c];
        size_t len = strlen(k->data);
        /* cut = 0 is the whole answer at once; then every cut; then one
         * byte at a time. */
        for (size_t cut = 0; cut <= len; cut++) {
            struct upstream_parser p;
            size_t step = cut == len ? 1 : 0;
            enum upstream_parse_rc rc;
            upstream_parser_init(&p, k->head, HDR_MAX, BODY_MAX);
            rc = feed(&p, k->data, len, step ? 0 : cut, step, k->eof, NULL);
            if (rc != k->rc)
                fail_msg("case %zu cut %zu: rc %d, want %d", c, cut, (int)rc, (int)k->rc);
            if (k->rc == UPSTREAM_PARSE_DONE) {
                assert_int_equal(p.resp.status, k->status);
                assert_body(&p, k->body);
                if (c == 2) {
                    assert_string_equal(hval(&p, "X-F"), "a b");
                    assert_string_equal(hval(&p, "X-Empty"), "");
                    assert_string_equal(hval(&p, "X-S"), "s");
                }
                if (c == 1)
                    assert_null(hval(&p, "X-Trailer"));
            }
            upstream_parser_clear(&p);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(content_length_keep_alive),
        cmocka_unit_test(bytes_after_answer_not_consumed),
        cmocka_unit_test(connection_close_not_kept),
        cmocka_unit_test(http10_read_until_close),
        cmocka_unit_test(http10_with_length_not_kept),
        cmocka_unit_test(no_length_http11_reads_until_close),
        cmocka_unit_test(other_transfer_codings_are_broken),
        cmocka_unit_test(no_body_for_head_204_304),
        cmocka_unit_test(same_content_length_twice_accepted),
        cmocka_unit_test(ambiguous_framing_broken),
        cmocka_unit_test(bad_status_lines_broken),
        cmocka_unit_test(status_line_without_reason),
        cmocka_unit_test(eof_before_end_broken),
        cmocka_unit_test(chunked_with_extensions),
        cmocka_unit_test(chunked_trailers_dropped),
        cmocka_unit_test(bad_chunks_broken),
        cmocka_unit_test(chunk_size_line_too_long_broken),
        cmocka_unit_test(interim_answers_skipped),
        cmocka_unit_test(odd_fields_repaired),
        cmocka_unit_test(folded_framing_fields_are_checked),
        cmocka_unit_test(field_line_without_name_is_broken),
        cmocka_unit_test(nul_in_field_line_is_broken),
        cmocka_unit_test(header_block_too_large),
        cmocka_unit_test(header_block_at_cap_accepted),
        cmocka_unit_test(body_over_cap_too_large),
        cmocka_unit_test(trailers_over_cap_too_large),
        cmocka_unit_test(same_at_every_boundary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
