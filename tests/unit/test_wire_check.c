/*
 * test_wire_check.c - the strict framing of raw request bytes (wire_check.h):
 * valid streams framed request by request with their body lengths, every
 * rule broken refused at the request that broke it, and the same results
 * whether the bytes come whole or one at a time.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "wire_check.h"

#define REQ(fields) "POST /v1/payments HTTP/1.1\r\nHost: x\r\n" fields "\r\n"

/* Feeds s (len bytes) whole, or one byte at a time. */
static struct wire_check *feed(const char *s, size_t len, bool bytewise)
{
    struct wire_check *wc = wire_check_new();
    assert_non_null(wc);
    if (bytewise) {
        for (size_t i = 0; i < len; i++)
            wire_check_feed(wc, s + i, 1);
    } else {
        wire_check_feed(wc, s, len);
    }
    return wc;
}

/* The stream frames into requests with these body lengths, all good; then
 * nothing more. */
static void expect_ok(const char *s, size_t len, const uint64_t *bodies, size_t n)
{
    for (int bytewise = 0; bytewise < 2; bytewise++) {
        struct wire_check *wc = feed(s, len, bytewise);
        for (size_t i = 0; i < n; i++) {
            assert_true(wire_check_head(wc));
            assert_true(wire_check_end(wc, bodies[i]));
            assert_false(wire_check_end(wc, bodies[i] + 1));
            wire_check_done(wc);
        }
        assert_false(wire_check_end(wc, 0));
        wire_check_free(wc);
    }
}

/* The stream's request number bad_at (from 0) breaks a rule: the requests
 * before it are good, it and every one after it fail. */
static void expect_bad(const char *s, size_t len, size_t bad_at)
{
    for (int bytewise = 0; bytewise < 2; bytewise++) {
        struct wire_check *wc = feed(s, len, bytewise);
        for (size_t i = 0; i < bad_at; i++) {
            assert_true(wire_check_head(wc));
            wire_check_done(wc);
        }
        assert_false(wire_check_head(wc));
        assert_false(wire_check_end(wc, 0));
        wire_check_done(wc);
        assert_false(wire_check_head(wc));
        wire_check_free(wc);
    }
}

#define OK(s, ...)                                                                 \
    do {                                                                           \
        static const uint64_t b_[] = {__VA_ARGS__};                                \
        expect_ok(s, sizeof(s) - 1, b_, sizeof(b_) / sizeof(b_[0]));              \
    } while (0)
#define BAD(s, at) expect_bad(s, sizeof(s) - 1, at)

static void test_valid_streams(void **state)
{
    (void)state;
    OK(REQ("Content-Length: 2\r\n") "{}", 2);
    OK(REQ("") , 0);
    OK("GET / HTTP/1.0\r\n\r\n", 0);
    OK(REQ("content-length:   5  \r\nX-Empty:\r\nX-Sp: a b \r\n") "he\r\nl", 5);
    OK(REQ("Transfer-Encoding: chunked\r\n") "5\r\nhello\r\n0\r\n\r\n", 5);
    OK(REQ("Transfer-Encoding:  CHUNKED\r\n") "000000000000000000005\r\nhello\r\n0\r\n\r\n", 5);
    OK(REQ("Transfer-Encoding: chunked\r\n") "3;a=b\r\nabc\r\n2 ; x\r\nde\r\n0;z\r\n\r\n", 5);
    OK(REQ("Transfer-Encoding: chunked\r\n") "0\r\n\r\n", 0);
    /* Leading zeros and white space of any length (a review found both
     * refused by a first version that kept 128 bytes of the line). */
    OK(REQ("Content-Length: 00000000000000000000000000000002\r\n") "{}", 2);
    OK(REQ("Content-Length:" "                                                  "
           "                                                  "
           "                                                  2  \r\n") "{}", 2);
    OK(REQ("Transfer-Encoding:" "                                                  "
           "                                                  "
           "                                                  chunked\r\n") "0\r\n\r\n", 0);
    OK(REQ("X-Long: " "0123456789012345678901234567890123456789012345678901234567890123456789"
           "0123456789012345678901234567890123456789012345678901234567890123456789\r\n"), 0);
    /* Pipelined, with empty lines before a request line. */
    OK(REQ("Content-Length: 2\r\n") "{}" "\r\n" REQ("Transfer-Encoding: chunked\r\n")
           "2\r\n{}\r\n0\r\n\r\n" REQ(""),
       2, 2, 0);
    /* A body may hold anything. */
    OK(REQ("Content-Length: 6\r\n") "\0\n\r:\0\n", 6);
    OK(REQ("Transfer-Encoding: chunked\r\n") "4\r\n\r\n\0\n\r\n0\r\n\r\n", 4);
}

static void test_line_ends_and_nul(void **state)
{
    (void)state;
    BAD(REQ("Transfer-Encoding: chunked\0\nX-After: 1\r\n") "0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\0\r\n\n") "0\r\n\r\n", 0);
    BAD(REQ("Content-Length: 0\r\n:\n"), 0);
    BAD(REQ("Content-Length: 2\r\n\0\n") "{}", 0);
    BAD(REQ("X-A: 1\n"), 0);
    BAD(REQ("X-A: 1\rX-B: 2\r\n"), 0);
    BAD(REQ("X-A: a\0b\r\n"), 0);
    BAD("POST /v1/pay\0ments HTTP/1.1\r\nHost: x\r\n\r\n", 0);
    BAD("POST /v1/payments HTTP/1.1\nHost: x\r\n\r\n", 0);
    BAD("\n" REQ(""), 0);
    /* The second of two pipelined requests. */
    BAD(REQ("") REQ("X-A: 1\n"), 1);
}

static void test_field_lines(void **state)
{
    (void)state;
    BAD(REQ(": x\r\n"), 0);
    BAD(REQ(" Transfer-Encoding: chunked\r\n"), 0);
    BAD(REQ("X-A: 1\r\n\tfolded\r\n"), 0);
    BAD(REQ("X-No-Colon\r\n"), 0);
    BAD(REQ("Content-Length : 2\r\n") "{}", 0);
    BAD(REQ("Content-Length: 2\r\nContent-Length: 2\r\n") "{}", 0);
    BAD(REQ("Content-Length: 2, 2\r\n") "{}", 0);
    BAD(REQ("Content-Length: +2\r\n") "{}", 0);
    BAD(REQ("Content-Length: 1234567890123456789\r\n"), 0);
    BAD(REQ("Content-Length: 1 2\r\n") "{}", 0);
    BAD(REQ("Content-Length:\r\n"), 0);
    /* libmicrohttpd 0.9.75 does not read "chunked " as chunked. */
    BAD(REQ("Transfer-Encoding: chunked \r\n") "0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked;q=1\r\n") "0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: gzip, chunked\r\n") "0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n") "0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\nContent-Length: 5\r\n") "0\r\n\r\n", 0);
}

static void test_chunked_framing(void **state)
{
    (void)state;
    BAD(REQ("Transfer-Encoding: chunked\r\n") "x\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "5 \r\nhello\r\n0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "5\nhello\r\n0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "5\r\nhello\n0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "3\r\nhello\r\n0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "1;\001\r\na\r\n0\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "fffffffffffffffff\r\n", 0);
    /* Trailer fields, and lines libmicrohttpd drops unrecorded. */
    BAD(REQ("Transfer-Encoding: chunked\r\n") "0\r\nX-T: 1\r\n\r\n", 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "0\r\n: x\r\n" REQ(""), 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "0\r\n\0junk\r\n" REQ(""), 0);
    BAD(REQ("Transfer-Encoding: chunked\r\n") "0\r\n\n", 0);
}

/* More requests framed at once than the checker keeps inline: all counted,
 * in order. */
static void test_many_pipelined(void **state)
{
    static const char one[] = REQ("Content-Length: 3\r\n") "abc";
    struct wire_check *wc = wire_check_new();
    (void)state;
    assert_non_null(wc);
    for (int i = 0; i < 40; i++)
        wire_check_feed(wc, one, sizeof(one) - 1);
    for (int i = 0; i < 40; i++) {
        assert_true(wire_check_head(wc));
        assert_true(wire_check_end(wc, 3));
        wire_check_done(wc);
    }
    assert_false(wire_check_oom(wc));
    assert_false(wire_check_end(wc, 3));
    wire_check_free(wc);
}

/* libmicrohttpd finishing a request this never framed makes the rest fail. */
static void test_desync(void **state)
{
    static const char s[] = REQ("Content-Length: 5\r\n") "{}";
    struct wire_check *wc = feed(s, sizeof(s) - 1, false);
    (void)state;
    assert_true(wire_check_head(wc));
    assert_false(wire_check_end(wc, 2));
    wire_check_done(wc);
    wire_check_feed(wc, "abc" REQ(""), 3 + sizeof(REQ("")) - 1);
    assert_false(wire_check_head(wc));
    assert_false(wire_check_end(wc, 0));
    wire_check_free(wc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_streams),
        cmocka_unit_test(test_line_ends_and_nul),
        cmocka_unit_test(test_field_lines),
        cmocka_unit_test(test_chunked_framing),
        cmocka_unit_test(test_many_pipelined),
        cmocka_unit_test(test_desync),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
