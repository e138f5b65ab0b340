/*
 * fuzz_upstream.c - the native upstream client's response parser on
 * arbitrary byte streams, fed whole and fed in pieces.
 *
 * The parser decides what is stored and replayed for a key, and where one
 * answer ends on a kept-alive connection, so the next request does not read
 * this one's leftovers. Its input comes from the network in pieces of any
 * size, so the same bytes must give the same answer however they are cut.
 *
 * Input: two control bytes, then the bytes the upstream sends.
 *   - byte 0: bit 0 the request was HEAD; bits 1-2 max_header_bytes (64,
 *     256, 1024, 16384); bits 3-4 max_body_bytes (0, 16, 4096, 1 MiB);
 *   - byte 1: seeds the piece sizes of the second run.
 *
 * Each input is parsed twice:
 *   - whole: one upstream_parse() over everything, then
 *     upstream_parse_eof() if it still wants more (the connection closed);
 *   - in pieces: the way x_read() in upstream.c drives it, with a read
 *     buffer of that code's size, held-back bytes moved to its front and
 *     pieces of 1 to 64 bytes appended.
 *
 * Invariants:
 *   - both runs end the same: return code, status, version, header list,
 *     body, keep-alive and, when DONE, the number of bytes consumed (bytes
 *     after the answer are never consumed);
 *   - the parser never consumes more than it was given, and on MORE never
 *     holds back more than upstream.h promises (max_header_bytes + 2, or
 *     UPSTREAM_MAX_CHUNK_LINE for a chunk-size line), so the read buffer
 *     never fills up;
 *   - a finished answer: no field spans a line; after the response filter
 *     (what the client and the store get) names are tokens and values hold
 *     no CR, LF or NUL, and no framing field is left; the body is at most
 *     max_body_bytes, is empty for HEAD and for statuses 204 and 304, and
 *     is exactly the Content-Length when there is one; a kept-alive answer is HTTP/1.1
 *     and was delimited (not read until close);
 *   - feeding more bytes after DONE consumes none and stays DONE.
 */
#include "fuzz.h"

#include <stdbool.h>
#include <string.h>
#include <strings.h>

#include "upstream.h"

static const size_t header_caps[] = {64, 256, 1024, 16384};
static const uint64_t body_caps[] = {0, 16, 4096, 1u << 20};

struct outcome {
    enum upstream_parse_rc rc;
    size_t consumed;
    bool keep_alive;
};

static bool is_tchar(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

static size_t held_back_limit(size_t max_header_bytes)
{
    return max_header_bytes + 2 > UPSTREAM_MAX_CHUNK_LINE ? max_header_bytes + 2
                                                          : UPSTREAM_MAX_CHUNK_LINE;
}

static struct outcome run_whole(struct upstream_parser *p, const uint8_t *d, size_t n)
{
    struct outcome o = {0};
    size_t used = 0;

    o.rc = upstream_parse(p, (const char *)d, n, &used);
    FUZZ_CHECK(used <= n);
    if (o.rc == UPSTREAM_PARSE_MORE) {
        FUZZ_CHECK(n - used <= held_back_limit(p->max_header_bytes));
        o.rc = upstream_parse_eof(p);
    }
    o.consumed = used;
    if (o.rc == UPSTREAM_PARSE_DONE)
        o.keep_alive = upstream_parse_keep_alive(p);
    return o;
}

/* The read buffer of upstream.c's connections (pool_new: buf_bytes). */
static size_t read_buffer_size(size_t max_header_bytes)
{
    return max_header_bytes + 4096 < 16384 ? 16384 : max_header_bytes + 4096;
}

static struct outcome run_pieces(struct upstream_parser *p, const uint8_t *d, size_t n,
                                 uint32_t seed)
{
    struct outcome o = {.rc = UPSTREAM_PARSE_MORE};
    size_t cap = read_buffer_size(p->max_header_bytes);
    char *buf = malloc(cap);
    size_t len = 0, off = 0;

    FUZZ_CHECK(buf != NULL);
    while (o.rc == UPSTREAM_PARSE_MORE) {
        size_t piece, used = 0;
        if (off == n) {
            o.rc = upstream_parse_eof(p);
            break;
        }
        FUZZ_CHECK(len < cap); /* x_read() would call the answer broken */
        seed = seed * 1103515245u + 12345u;
        piece = 1 + (seed >> 16) % 64;
        if (piece > n - off)
            piece = n - off;
        if (piece > cap - len)
            piece = cap - len;
        memcpy(buf + len, d + off, piece);
        off += piece;
        len += piece;
        o.rc = upstream_parse(p, buf, len, &used);
        FUZZ_CHECK(used <= len);
        o.consumed += used;
        memmove(buf, buf + used, len - used);
        len -= used;
        if (o.rc == UPSTREAM_PARSE_MORE)
            FUZZ_CHECK(len <= held_back_limit(p->max_header_bytes));
    }
    if (o.rc == UPSTREAM_PARSE_DONE)
        o.keep_alive = upstream_parse_keep_alive(p);
    free(buf);
    return o;
}

static void check_same(const struct upstream_parser *a, const struct outcome *oa,
                       const struct upstream_parser *b, const struct outcome *ob)
{
    const struct upstream_response *ra = &a->resp, *rb = &b->resp;

    FUZZ_CHECK(oa->rc == ob->rc);
    FUZZ_CHECK(ra->headers_too_large == rb->headers_too_large);
    if (oa->rc != UPSTREAM_PARSE_DONE)
        return;
    FUZZ_CHECK(oa->consumed == ob->consumed);
    FUZZ_CHECK(oa->keep_alive == ob->keep_alive);
    FUZZ_CHECK(ra->status == rb->status);
    FUZZ_CHECK(ra->minor_version == rb->minor_version);
    FUZZ_CHECK(ra->headers.n == rb->headers.n);
    for (size_t i = 0; i < ra->headers.n; i++) {
        const struct idem_header *x = &ra->headers.v[i], *y = &rb->headers.v[i];
        FUZZ_CHECK(x->name_len == y->name_len && memcmp(x->name, y->name, x->name_len) == 0);
        FUZZ_CHECK(x->value_len == y->value_len &&
                   memcmp(x->value, y->value, x->value_len) == 0);
    }
    FUZZ_CHECK(ra->body_len == rb->body_len);
    FUZZ_CHECK(ra->body_len == 0 || memcmp(ra->body, rb->body, ra->body_len) == 0);
}

static void check_answer(struct upstream_parser *p, const struct outcome *o, bool head)
{
    const struct upstream_response *r = &p->resp;
    const struct idem_header *cl = NULL;
    struct idem_headers out = {0};
    size_t used = 99;

    if (o->rc != UPSTREAM_PARSE_DONE)
        return;
    FUZZ_CHECK(r->status >= 200 && r->status <= 599);
    FUZZ_CHECK(r->body_len <= p->max_body_bytes);
    for (size_t i = 0; i < r->headers.n; i++) {
        const struct idem_header *h = &r->headers.v[i];
        /* As received: a line's fields, which never span a line. */
        FUZZ_CHECK(h->name_len > 0 && memchr(h->name, '\n', h->name_len) == NULL);
        FUZZ_CHECK(memchr(h->value, '\n', h->value_len) == NULL);
        if (h->name_len == 14 && strncasecmp(h->name, "Content-Length", 14) == 0)
            cl = h;
    }
    /* What reaches the client and the store: fields a recipient may not
     * pass on (a name that is not a token, a bare CR or a NUL in a value:
     * RFC 9112 section 2.2) are dropped, the rest is clean. */
    FUZZ_CHECK(idem_filter_response_headers(&r->headers, NULL, &out) == 0);
    for (size_t i = 0; i < out.n; i++) {
        const struct idem_header *h = &out.v[i];
        FUZZ_CHECK(h->name_len > 0 && strlen(h->name) == h->name_len);
        for (size_t k = 0; k < h->name_len; k++)
            FUZZ_CHECK(is_tchar((unsigned char)h->name[k]));
        FUZZ_CHECK(strlen(h->value) == h->value_len);
        FUZZ_CHECK(strpbrk(h->value, "\r\n") == NULL);
        FUZZ_CHECK(strcasecmp(h->name, "Content-Length") != 0 &&
                   strcasecmp(h->name, "Transfer-Encoding") != 0);
    }
    idem_headers_clear(&out);
    if (head || r->status == 204 || r->status == 304)
        FUZZ_CHECK(r->body_len == 0);
    else if (cl != NULL)
        FUZZ_CHECK(r->body_len == strtoull(cl->value, NULL, 10));
    if (o->keep_alive)
        FUZZ_CHECK(r->minor_version >= 1 && (cl != NULL || p->chunked || head ||
                                             r->status == 204 || r->status == 304));
    /* Bytes after the answer belong to nobody: never consumed. */
    FUZZ_CHECK(upstream_parse(p, "HTTP/1.1 200 OK\r\n", 17, &used) == UPSTREAM_PARSE_DONE);
    FUZZ_CHECK(used == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct upstream_parser a, b;
    struct outcome oa, ob;
    bool head;
    size_t max_header;
    uint64_t max_body;

    if (size < 2)
        return 0;
    head = data[0] & 1;
    max_header = header_caps[(data[0] >> 1) & 3];
    max_body = body_caps[(data[0] >> 3) & 3];

    upstream_parser_init(&a, head, max_header, max_body);
    upstream_parser_init(&b, head, max_header, max_body);
    oa = run_whole(&a, data + 2, size - 2);
    ob = run_pieces(&b, data + 2, size - 2, data[1] * 2654435761u);
    check_same(&a, &oa, &b, &ob);
    check_answer(&a, &oa, head);
    upstream_parser_clear(&a);
    upstream_parser_clear(&b);
    return 0;
}
