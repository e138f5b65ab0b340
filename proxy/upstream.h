/*
 * upstream.h - the native HTTP/1.1 upstream client: a per-worker pool of
 * keep-alive connections to the one upstream origin, driven by the worker's
 * own epoll loop, and the response parser it reads answers with.
 *
 * Why not libcurl: per request libcurl re-parses the URL several times,
 * builds the request head with curl_maprintf and polls a reused connection
 * twice; on the pass-through GET that was more than half of the proxy's CPU
 * (docs/benchmarks.md). This client does only what the proxy needs: one
 * origin, plain http://, HTTP/1.1, no redirects, no proxies, no cookies.
 *
 * Caveats:
 *  - The origin's host name is resolved at start (getaddrinfo) and again
 *    every resolve interval, off the workers' loops; the latest addresses
 *    are tried in order on every new connection. A connection to an
 *    address the latest lookup no longer gives finishes its exchange and is
 *    closed, not reused, so traffic follows the name even while the old
 *    address still answers; connections to addresses that stay are kept.
 *  - An idle connection is reused only within idle_timeout_ms, and closed
 *    once past it, so the proxy closes it before the upstream does.
 *  - A request is sent at most twice: only when a reused connection fails
 *    before any response byte, and only when the caller allows it
 *    (upstream_request.may_retry) or nothing of the request was written.
 *  - Everything here except the origin runs on one worker thread: a pool
 *    and its exchanges are not thread-safe. The origin may be shared by
 *    every worker: its addresses are swapped under a lock.
 */
#ifndef IDEM_UPSTREAM_H
#define IDEM_UPSTREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "policy.h"

/* ---- the response parser (pure: no I/O) ------------------------------- */

/*
 * What an upstream answered: the final (non-1xx) status, its header section
 * with the repairs a proxy makes (RFC 9112 section 5: obs-fold replaced by a
 * space, white space before the colon removed, empty values kept), and the
 * body without its framing. Trailer fields of a chunked body are dropped,
 * never merged into the header section (RFC 9110 section 6.5.1).
 * The parser owns headers and body; a caller may take them (and must then
 * zero the fields) before upstream_parser_clear().
 */
struct upstream_response {
    int status;
    int minor_version; /* HTTP/1.<minor_version> */
    struct idem_headers headers;
    uint8_t *body;
    size_t body_len, body_cap;
    bool headers_too_large; /* TOO_LARGE came from the header block */
};

enum upstream_parse_rc {
    UPSTREAM_PARSE_MORE = 0,       /* needs more bytes */
    UPSTREAM_PARSE_DONE = 1,       /* the answer is complete */
    UPSTREAM_PARSE_BROKEN = -1,    /* unparsable, or ambiguous framing */
    UPSTREAM_PARSE_TOO_LARGE = -2, /* header block or body over its cap */
    UPSTREAM_PARSE_NOMEM = -3,
};

struct upstream_parser {
    int state;
    bool no_body_request; /* HEAD: an answer never has a body */
    size_t max_header_bytes;
    uint64_t max_body_bytes;
    bool seen_byte; /* any response byte arrived */
    bool chunked;
    bool has_length;
    bool conn_close;
    uint64_t length;    /* Content-Length */
    uint64_t remaining; /* of the body or of the current chunk */
    uint64_t trailer_bytes;
    struct upstream_response resp;
};

/* Longest chunk-size line (with extensions) the parser accepts. */
#define UPSTREAM_MAX_CHUNK_LINE 4096

/* max_header_bytes counts a header block as the client's answer will carry
 * it (names and values plus 4 bytes a field); max_body_bytes caps the body. */
void upstream_parser_init(struct upstream_parser *p, bool no_body_request, size_t max_header_bytes,
                          uint64_t max_body_bytes);
/* Frees what the parser still owns; it may be initialised again after. */
void upstream_parser_clear(struct upstream_parser *p);
/*
 * Feeds len bytes. *used is set to how many were consumed; on MORE the rest
 * is an incomplete line that must be presented again, followed by more
 * bytes. It never holds back more than max_header_bytes + 2 (a head line) or
 * UPSTREAM_MAX_CHUNK_LINE bytes. Bytes after DONE are not consumed.
 */
enum upstream_parse_rc upstream_parse(struct upstream_parser *p, const char *buf, size_t len,
                                      size_t *used);
/* The connection ended: DONE for a body read until close, BROKEN otherwise. */
enum upstream_parse_rc upstream_parse_eof(struct upstream_parser *p);
/* After DONE: may the connection carry another request (HTTP/1.1, no
 * "Connection: close", a delimited body)? */
bool upstream_parse_keep_alive(const struct upstream_parser *p);

/* ---- the origin -------------------------------------------------------- */

struct upstream_origin;

/* Parses http://host[:port][/base] and resolves host. A name that does not
 * resolve is not an error: exchanges end NOT_SENT (as libcurl's "could not
 * resolve" did) until it does. A name (not a literal address) is resolved
 * again every resolve_interval_ms (<= 0: 30 s) on a thread of the origin's
 * own, and soon (at most once a second) after no address connected, so new
 * connections follow a changed name. err gets one line on failure. */
int upstream_origin_new(const char *url, int64_t resolve_interval_ms, struct upstream_origin **out,
                        char *err, size_t errlen);
/* Does the host resolve now? (For a warning at start: requests get 502.) */
bool upstream_origin_resolved(struct upstream_origin *o);
/* upstream_origin_free(NULL) is a no-op. */
void upstream_origin_free(struct upstream_origin *o);

/* ---- the pool and its exchanges ----------------------------------------- */

struct upstream_options {
    int64_t connect_timeout_ms;
    int64_t timeout_ms; /* the whole exchange, from upstream_start() */
    size_t max_header_bytes;
    uint64_t max_response_bytes;
    unsigned max_idle; /* idle keep-alive connections kept */
    /* A connection idle this long is closed, never reused (<= 0: no limit).
     * Below the upstream's own keep-alive timeout, no request is written
     * into a connection the upstream is closing at that moment. */
    int64_t idle_timeout_ms;
    /* Called with the exchange's ctx each time the answer's body buffer
     * grows, with the bytes of capacity it gained (with a Content-Length
     * all of it comes at the end of the header block; otherwise it doubles
     * as the body arrives): once per growth, not per read, so a caller can
     * count the memory an answer holds while it arrives. Never told of a
     * shrink (a buffer freed with a failed exchange, or by a resend that
     * starts the answer over): once the exchange is done the caller settles
     * on the body_cap it takes over, 0 for any result but a response. NULL:
     * not told. */
    void (*body_grew)(void *ctx, size_t more);
};

struct upstream_request {
    const char *method;
    const char *target; /* as received: appended to the origin's base path */
    size_t target_len;
    const struct idem_headers *headers; /* forwarded headers, copied at start */
    const uint8_t *body;                /* borrowed until the exchange is done or cancelled */
    size_t body_len;
    bool send_length; /* write Content-Length even for an empty body */
    /* A reused connection that dies after the request was written but
     * before any response byte: resend once on a fresh connection? Only for
     * a request whose second execution cannot change the outcome. */
    bool may_retry;
};

struct upstream_pool;
struct upstream_exchange;

/*
 * A pool registers its sockets in epfd with data.u64 = ep_tag | fd << 8
 * (the worker's event encoding) and expects upstream_event() for them.
 * The origin must outlive the pool.
 */
int upstream_pool_new(struct upstream_origin *o, const struct upstream_options *opt, int epfd,
                      uint64_t ep_tag, struct upstream_pool **out);
/* Closes every connection; exchanges must all be freed or cancelled.
 * upstream_pool_free(NULL) is a no-op. */
void upstream_pool_free(struct upstream_pool *p);

/* Starts an exchange; ctx is the caller's. Never completes synchronously:
 * the result comes out of upstream_take_done(). -1 when out of memory. */
int upstream_start(struct upstream_pool *p, const struct upstream_request *req, void *ctx,
                   struct upstream_exchange **out);
/* An epoll event on one of the pool's sockets. */
void upstream_event(struct upstream_pool *p, int fd, uint32_t events);
/* Ends exchanges past their deadline; cheap to call every loop iteration. */
void upstream_expire(struct upstream_pool *p, int64_t now_ms);
/* Milliseconds until upstream_expire() has work, -1 for none. */
int64_t upstream_next_timeout_ms(const struct upstream_pool *p, int64_t now_ms);
/* The next finished exchange, or NULL. The caller owns it from here: read
 * it, then upstream_exchange_free(). */
struct upstream_exchange *upstream_take_done(struct upstream_pool *p);

void *upstream_exchange_ctx(const struct upstream_exchange *x);
enum idem_upstream_result upstream_exchange_result(const struct upstream_exchange *x);
/* Whether a result other than RESPONSE came of this process's own want of
 * memory (a connection, or the answer's headers or body, could not be
 * allocated) rather than of the upstream. */
bool upstream_exchange_no_memory(const struct upstream_exchange *x);
/* Valid with IDEM_UPSTREAM_RESPONSE (status, headers and body) and with
 * TOO_LARGE (headers_too_large); the caller may take headers and body. */
struct upstream_response *upstream_exchange_response(struct upstream_exchange *x);
/* upstream_exchange_free(NULL) is a no-op. */
void upstream_exchange_free(struct upstream_exchange *x);
/*
 * Abandons an exchange in any state, finished or not (its connection is
 * closed), frees it and returns what it amounts to as a timeout: NOT_SENT
 * when no request byte was written, TIMEOUT otherwise.
 */
enum idem_upstream_result upstream_cancel(struct upstream_exchange *x);

#endif
