/*
 * upstream.c - the native HTTP/1.1 upstream client (see upstream.h).
 *
 * An exchange's life, all on its worker's thread:
 *
 *   upstream_start   request head built once (one allocation); an idle
 *                    pooled connection taken, or a new one connected
 *                    (non-blocking); the head and body written at once,
 *                    the rest on EPOLLOUT
 *   reading          bytes read into the connection's buffer and parsed
 *                    (upstream_parse); the body copied into the response
 *   done             moved to the pool's done list; the connection goes
 *                    back to the idle pool when the answer allows it
 *
 * A connection is registered in epoll once, for as long as it is open:
 * EPOLLIN | EPOLLRDHUP while idle or waiting for the answer (an idle
 * connection with news has been closed by the upstream: it is closed here
 * too), EPOLLOUT while connecting or while the request does not fit in the
 * socket buffer. Reusing a connection costs no epoll_ctl at all.
 */
#define _GNU_SOURCE 1
#include "upstream.h"
#include "clock.h"

#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ---- the response parser ------------------------------------------------ */

enum parse_state {
    PS_STATUS = 0,
    PS_HEADERS,
    PS_BODY_LENGTH,
    PS_BODY_CLOSE,
    PS_CHUNK_SIZE,
    PS_CHUNK_DATA,
    PS_CHUNK_END,
    PS_TRAILERS,
    PS_DONE,
};

void upstream_parser_init(struct upstream_parser *p, bool no_body_request, size_t max_header_bytes,
                          uint64_t max_body_bytes)
{
    memset(p, 0, sizeof(*p));
    p->state = PS_STATUS;
    p->no_body_request = no_body_request;
    p->max_header_bytes = max_header_bytes;
    p->max_body_bytes = max_body_bytes;
}

void upstream_parser_clear(struct upstream_parser *p)
{
    idem_headers_clear(&p->resp.headers);
    free(p->resp.body);
    p->resp.body = NULL;
    p->resp.body_len = p->resp.body_cap = 0;
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static bool name_is(const char *name, size_t len, const char *want)
{
    return len == strlen(want) && strncasecmp(name, want, len) == 0;
}

/* Does a comma-separated list contain token (case-insensitive)? */
static bool list_has(const char *v, size_t len, const char *token)
{
    size_t tl = strlen(token);
    size_t i = 0;

    while (i < len) {
        size_t s, e;
        while (i < len && (v[i] == ' ' || v[i] == '\t' || v[i] == ','))
            i++;
        s = i;
        while (i < len && v[i] != ',')
            i++;
        e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t'))
            e--;
        if (e - s == tl && strncasecmp(v + s, token, tl) == 0)
            return true;
    }
    return false;
}

/* Is the last coding of a Transfer-Encoding value "chunked"? */
static bool last_coding_chunked(const char *v, size_t len)
{
    size_t e = len, s;

    while (e > 0 && (v[e - 1] == ' ' || v[e - 1] == '\t' || v[e - 1] == ','))
        e--;
    s = e;
    while (s > 0 && v[s - 1] != ',')
        s--;
    while (s < e && (v[s] == ' ' || v[s] == '\t'))
        s++;
    return e - s == 7 && strncasecmp(v + s, "chunked", 7) == 0;
}

/* Room for more bytes of body: exactly that much when exact (the whole
 * body, its Content-Length known), else doubling from 4 KiB. The buffer is
 * what the answer holds in memory, and what server.max_buffered counts. */
static enum upstream_parse_rc body_reserve(struct upstream_parser *p, size_t more, bool exact)
{
    struct upstream_response *r = &p->resp;
    size_t need = r->body_len + more;
    size_t cap;
    uint8_t *nb;

    if (need <= r->body_cap)
        return UPSTREAM_PARSE_MORE;
    cap = r->body_cap ? r->body_cap : 4096;
    while (cap < need)
        cap *= 2;
    if ((uint64_t)cap > p->max_body_bytes && (uint64_t)need <= p->max_body_bytes)
        cap = (size_t)p->max_body_bytes;
    if (exact)
        cap = need;
    nb = realloc(r->body, cap);
    if (nb == NULL)
        return UPSTREAM_PARSE_NOMEM;
    r->body = nb;
    r->body_cap = cap;
    return UPSTREAM_PARSE_MORE;
}

static enum upstream_parse_rc body_append(struct upstream_parser *p, const char *b, size_t n)
{
    enum upstream_parse_rc rc;

    if ((uint64_t)p->resp.body_len + n > p->max_body_bytes)
        return UPSTREAM_PARSE_TOO_LARGE;
    rc = body_reserve(p, n, false);
    if (rc != UPSTREAM_PARSE_MORE)
        return rc;
    memcpy(p->resp.body + p->resp.body_len, b, n);
    p->resp.body_len += n;
    return UPSTREAM_PARSE_MORE;
}

/* "HTTP/1.x SSS[ reason]" (RFC 9112 section 4). */
static enum upstream_parse_rc parse_status_line(struct upstream_parser *p, const char *l, size_t n)
{
    int status;

    if (n < 12 || memcmp(l, "HTTP/1.", 7) != 0 || !is_digit(l[7]) || l[8] != ' ' ||
        !is_digit(l[9]) || !is_digit(l[10]) || !is_digit(l[11]) || (n > 12 && l[12] != ' '))
        return UPSTREAM_PARSE_BROKEN;
    status = (l[9] - '0') * 100 + (l[10] - '0') * 10 + (l[11] - '0');
    if (status < 100 || status > 599)
        return UPSTREAM_PARSE_BROKEN;
    p->resp.status = status;
    p->resp.minor_version = l[7] - '0';
    /* A new status line (after a 1xx): start the header list again. */
    idem_headers_clear(&p->resp.headers);
    p->chunked = p->has_length = p->conn_close = false;
    p->length = 0;
    p->state = PS_HEADERS;
    return UPSTREAM_PARSE_MORE;
}

static enum upstream_parse_rc too_large_head(struct upstream_parser *p)
{
    p->resp.headers_too_large = true;
    return UPSTREAM_PARSE_TOO_LARGE;
}

/* Checks framing after a Content-Length or Transfer-Encoding field. */
static enum upstream_parse_rc check_framing(struct upstream_parser *p)
{
    const struct idem_headers *h = &p->resp.headers;
    const struct idem_header *cl = NULL;
    bool te = false;

    p->chunked = false;
    for (size_t i = 0; i < h->n; i++) {
        const struct idem_header *f = &h->v[i];
        if (name_is(f->name, f->name_len, "Content-Length")) {
            /* Two differing values (RFC 9112 section 6.3): the outcome
             * is unknown, not a response. */
            if (cl != NULL && strcmp(cl->value, f->value) != 0)
                return UPSTREAM_PARSE_BROKEN;
            cl = f;
        } else if (name_is(f->name, f->name_len, "Transfer-Encoding")) {
            /* Only "chunked" alone: the proxy removes the field (hop by
             * hop), so any other coding ("gzip", "gzip, chunked") would
             * leave encoded bytes passed off, and stored, as the body.
             * A second field likewise. The libcurl path refuses the same
             * (on_upstream_header(): libcurl 7.88 took "gzip, chunked"
             * for an empty body). */
            if (te || !last_coding_chunked(f->value, f->value_len) ||
                memchr(f->value, ',', f->value_len) != NULL)
                return UPSTREAM_PARSE_BROKEN;
            te = true;
            p->chunked = true;
        }
    }
    if (cl != NULL && te)
        return UPSTREAM_PARSE_BROKEN;
    if (cl != NULL) {
        uint64_t v = 0;
        if (cl->value_len == 0 || cl->value_len > 18)
            return UPSTREAM_PARSE_BROKEN;
        for (size_t i = 0; i < cl->value_len; i++) {
            if (!is_digit(cl->value[i]))
                return UPSTREAM_PARSE_BROKEN;
            v = v * 10 + (uint64_t)(cl->value[i] - '0');
        }
        p->has_length = true;
        p->length = v;
    }
    return UPSTREAM_PARSE_MORE;
}

/* A field pushed, or extended by a folded line: framing and Connection
 * follow its value. */
static enum upstream_parse_rc field_added(struct upstream_parser *p, const struct idem_header *f)
{
    if (name_is(f->name, f->name_len, "Content-Length") ||
        name_is(f->name, f->name_len, "Transfer-Encoding"))
        return check_framing(p);
    if (name_is(f->name, f->name_len, "Connection") && list_has(f->value, f->value_len, "close"))
        p->conn_close = true;
    return UPSTREAM_PARSE_MORE;
}

static enum upstream_parse_rc parse_field_line(struct upstream_parser *p, const char *l, size_t n)
{
    struct idem_headers *h = &p->resp.headers;
    struct idem_field_line f;

    /* NUL is in no field (RFC 9110 section 5.5): a name holding one would
     * read as a shorter name to the C-string code after us
     * ("Transfer-Encoding\0x" as Transfer-Encoding), so the framing this
     * parser chose and what the rest of the proxy sees could differ. */
    if (memchr(l, '\0', n) != NULL)
        return UPSTREAM_PARSE_BROKEN;
    switch (idem_field_line_split(l, n, &f)) {
    case IDEM_FIELD_FOLD:
        if (h->n == 0)
            return UPSTREAM_PARSE_MORE;
        if (h->bytes + 4 * h->n + 1 + f.value_len > p->max_header_bytes)
            return too_large_head(p);
        if (idem_headers_extend_last(h, f.value, f.value_len) != 0)
            return UPSTREAM_PARSE_NOMEM;
        /* The folded value is the field's value (RFC 9112 section 5.2):
         * what decided framing or the connection is decided again on it
         * ("Transfer-Encoding: chunked" folded with ", gzip" is not
         * chunked alone; "Content-Length: 5" folded with "6" is no
         * length). */
        return field_added(p, &h->v[h->n - 1]);
    case IDEM_FIELD_SKIP:
        return UPSTREAM_PARSE_MORE;
    case IDEM_FIELD_BAD:
        return UPSTREAM_PARSE_BROKEN; /* not a field line: a malformed answer, as libcurl saw it */
    case IDEM_FIELD:
        break;
    }
    /* The header block as the client's answer will carry it must fit
     * max_header_bytes (see response_header_max() in server.c). */
    if (h->bytes + 4 * h->n + 4 + n > p->max_header_bytes)
        return too_large_head(p);
    if (idem_headers_push(h, f.name, f.name_len, f.value, f.value_len) != 0)
        return UPSTREAM_PARSE_NOMEM;
    return field_added(p, &h->v[h->n - 1]);
}

/* The empty line that ends a header section (RFC 9112 section 6.3). */
static enum upstream_parse_rc end_of_head(struct upstream_parser *p)
{
    int st = p->resp.status;

    if (st < 200) {
        /* An interim answer (100, 103...): skipped; the final one follows. */
        idem_headers_clear(&p->resp.headers);
        p->state = PS_STATUS;
        return UPSTREAM_PARSE_MORE;
    }
    if (p->no_body_request || st == 204 || st == 304) {
        p->state = PS_DONE;
        return UPSTREAM_PARSE_DONE;
    }
    /* check_framing() refused any Transfer-Encoding but "chunked" alone. */
    if (p->chunked) {
        p->state = PS_CHUNK_SIZE;
    } else if (p->has_length) {
        enum upstream_parse_rc rc;
        if (p->length > p->max_body_bytes)
            return UPSTREAM_PARSE_TOO_LARGE;
        if (p->length == 0) {
            p->state = PS_DONE;
            return UPSTREAM_PARSE_DONE;
        }
        rc = body_reserve(p, (size_t)p->length, true);
        if (rc != UPSTREAM_PARSE_MORE)
            return rc;
        p->remaining = p->length;
        p->state = PS_BODY_LENGTH;
    } else {
        p->state = PS_BODY_CLOSE;
    }
    return UPSTREAM_PARSE_MORE;
}

/* chunk-size [ chunk-ext ] (RFC 9112 section 7.1); extensions ignored. */
static enum upstream_parse_rc parse_chunk_size(struct upstream_parser *p, const char *l, size_t n)
{
    uint64_t v = 0;
    size_t i = 0;

    while (i < n && idem_hex_value(l[i]) >= 0) {
        if (i >= 15)
            return UPSTREAM_PARSE_BROKEN;
        v = v * 16 + (uint64_t)idem_hex_value(l[i]);
        i++;
    }
    if (i == 0 || (i < n && l[i] != ';' && l[i] != ' ' && l[i] != '\t'))
        return UPSTREAM_PARSE_BROKEN;
    if (v == 0) {
        p->state = PS_TRAILERS;
        return UPSTREAM_PARSE_MORE;
    }
    if ((uint64_t)p->resp.body_len + v > p->max_body_bytes)
        return UPSTREAM_PARSE_TOO_LARGE;
    p->remaining = v;
    p->state = PS_CHUNK_DATA;
    return UPSTREAM_PARSE_MORE;
}

static enum upstream_parse_rc parse_line(struct upstream_parser *p, const char *l, size_t n)
{
    enum upstream_parse_rc rc = UPSTREAM_PARSE_MORE;

    switch (p->state) {
    case PS_STATUS:
        rc = parse_status_line(p, l, n);
        break;
    case PS_HEADERS:
        rc = n == 0 ? end_of_head(p) : parse_field_line(p, l, n);
        break;
    case PS_CHUNK_SIZE:
        rc = parse_chunk_size(p, l, n);
        break;
    case PS_CHUNK_END:
        if (n != 0)
            rc = UPSTREAM_PARSE_BROKEN;
        else
            p->state = PS_CHUNK_SIZE;
        break;
    case PS_TRAILERS:
        /* Trailer fields are dropped (RFC 9110 section 6.5.1), but their
         * size is bounded like a header block's. */
        if (n == 0) {
            p->state = PS_DONE;
            rc = UPSTREAM_PARSE_DONE;
        } else {
            p->trailer_bytes += n + 4;
            if (p->trailer_bytes > p->max_header_bytes)
                rc = too_large_head(p);
        }
        break;
    default:
        rc = UPSTREAM_PARSE_BROKEN;
        break;
    }
    return rc;
}

static size_t line_limit(const struct upstream_parser *p)
{
    if (p->state == PS_CHUNK_SIZE || p->state == PS_CHUNK_END)
        return UPSTREAM_MAX_CHUNK_LINE;
    return p->max_header_bytes + 2;
}

enum upstream_parse_rc upstream_parse(struct upstream_parser *p, const char *buf, size_t len,
                                      size_t *used)
{
    enum upstream_parse_rc rc = UPSTREAM_PARSE_MORE;
    size_t off = 0;

    if (len > 0 && p->state != PS_DONE)
        p->seen_byte = true;
    while (rc == UPSTREAM_PARSE_MORE && off < len && p->state != PS_DONE) {
        if (p->state == PS_BODY_LENGTH || p->state == PS_CHUNK_DATA) {
            size_t k = len - off;
            if ((uint64_t)k > p->remaining)
                k = (size_t)p->remaining;
            rc = body_append(p, buf + off, k);
            off += k;
            p->remaining -= k;
            if (rc == UPSTREAM_PARSE_MORE && p->remaining == 0) {
                if (p->state == PS_CHUNK_DATA) {
                    p->state = PS_CHUNK_END;
                } else {
                    p->state = PS_DONE;
                    rc = UPSTREAM_PARSE_DONE;
                }
            }
        } else if (p->state == PS_BODY_CLOSE) {
            rc = body_append(p, buf + off, len - off);
            off = len;
        } else {
            const char *l = buf + off;
            const char *nl = memchr(l, '\n', len - off);
            size_t n;
            if (nl == NULL) {
                if (len - off > line_limit(p))
                    rc = p->state == PS_CHUNK_SIZE || p->state == PS_CHUNK_END
                             ? UPSTREAM_PARSE_BROKEN
                             : too_large_head(p);
                break;
            }
            n = (size_t)(nl - l);
            off += n + 1;
            if (n > line_limit(p)) {
                rc = p->state == PS_CHUNK_SIZE || p->state == PS_CHUNK_END ? UPSTREAM_PARSE_BROKEN
                                                                           : too_large_head(p);
                break;
            }
            if (n > 0 && l[n - 1] == '\r')
                n--;
            rc = parse_line(p, l, n);
        }
    }
    if (rc == UPSTREAM_PARSE_MORE && p->state == PS_DONE)
        rc = UPSTREAM_PARSE_DONE;
    *used = off;
    return rc;
}

enum upstream_parse_rc upstream_parse_eof(struct upstream_parser *p)
{
    if (p->state == PS_BODY_CLOSE) {
        p->conn_close = true;
        p->state = PS_DONE;
    }
    return p->state == PS_DONE ? UPSTREAM_PARSE_DONE : UPSTREAM_PARSE_BROKEN;
}

bool upstream_parse_keep_alive(const struct upstream_parser *p)
{
    return p->state == PS_DONE && p->resp.minor_version >= 1 && !p->conn_close;
}

/* ---- the origin ------------------------------------------------------------ */

/* One resolution of the origin's name: shared by the connections opened
 * from it, freed when the last of them and the origin let go. */
struct upstream_addrs {
    atomic_uint refs;
    unsigned gen; /* the origin's gen when it became current */
    struct addrinfo *ai;
    unsigned n;
    /* Per address (in list order): until when it is taken for down, after
     * a connect to it failed or got no answer. New connections try the
     * others first meanwhile, so a host that is down among several costs
     * one connect timeout, not one per new connection. */
    _Atomic int64_t *down_until_ms;
};

/* How long an address whose connect failed is tried after the others (as
 * nginx's fail_timeout). */
#define ADDR_DOWN_MS 10000

static void addrs_put(struct upstream_addrs *a)
{
    if (a != NULL && atomic_fetch_sub(&a->refs, 1) == 1) {
        freeaddrinfo(a->ai);
        free(a->down_until_ms);
        free(a);
    }
}

static bool addr_same(const struct addrinfo *a, const struct addrinfo *b)
{
    return a->ai_family == b->ai_family && a->ai_addrlen == b->ai_addrlen &&
           memcmp(a->ai_addr, b->ai_addr, a->ai_addrlen) == 0;
}

/* ai's place in addrs' list (ai is one of its entries). */
static unsigned addr_index(const struct upstream_addrs *addrs, const struct addrinfo *ai)
{
    unsigned i = 0;
    for (const struct addrinfo *a = addrs->ai; a != NULL && a != ai; a = a->ai_next)
        i++;
    return i;
}

static void addr_mark_in(struct upstream_addrs *addrs, unsigned i, int64_t until_ms)
{
    if (i < addrs->n)
        atomic_store_explicit(&addrs->down_until_ms[i], until_ms, memory_order_relaxed);
}

static bool addr_down(const struct upstream_addrs *addrs, unsigned i, int64_t now_ms)
{
    return i < addrs->n &&
           atomic_load_explicit(&addrs->down_until_ms[i], memory_order_relaxed) > now_ms;
}

/* A new lookup keeps what is known of the addresses it gives again. */
static void addrs_carry_down(struct upstream_addrs *fresh, const struct upstream_addrs *old)
{
    unsigned i = 0;
    if (old == NULL)
        return;
    for (const struct addrinfo *a = fresh->ai; a != NULL && i < fresh->n; a = a->ai_next, i++) {
        unsigned j = 0;
        for (const struct addrinfo *b = old->ai; b != NULL && j < old->n; b = b->ai_next, j++)
            if (addr_same(a, b)) {
                atomic_store_explicit(&fresh->down_until_ms[i],
                                      atomic_load_explicit(&old->down_until_ms[j],
                                                           memory_order_relaxed),
                                      memory_order_relaxed);
                break;
            }
    }
}

struct upstream_origin {
    char *host_header; /* "host[:port]", as libcurl wrote it */
    size_t host_header_len;
    char *base; /* the URL's path, without trailing slashes ("" for none) */
    size_t base_len;
    char host[256], port[8];
    int64_t resolve_interval_ms;

    /* The addresses new connections use; NULL while the name does not
     * resolve. A literal address is resolved once; a name is resolved
     * again every resolve_interval_ms by the resolver thread, and at once
     * (at most once a second) when a worker finds no address that
     * connects, so a changed or late DNS answer is picked up without a
     * restart. lock guards cur, want_now and stop. */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct upstream_addrs *cur;
    /* Counts the resolutions that became current; readable without the
     * lock, so a connection looks its address up in cur only once per new
     * resolution (conn_addr_gone). */
    atomic_uint gen;
    bool want_now, stop, thread_started;
    bool resolving; /* the thread is in getaddrinfo */
    bool orphaned;  /* freed meanwhile: the thread frees the origin */
    pthread_t thread;
};

static void origin_destroy(struct upstream_origin *o);

/* getaddrinfo, off every worker's event loop. */
static struct upstream_addrs *origin_resolve(const struct upstream_origin *o)
{
    struct addrinfo hints = {0};
    struct upstream_addrs *a = calloc(1, sizeof(*a));

    if (a == NULL)
        return NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    if (getaddrinfo(o->host, o->port, &hints, &a->ai) != 0 || a->ai == NULL) {
        free(a);
        return NULL;
    }
    for (const struct addrinfo *ai = a->ai; ai != NULL; ai = ai->ai_next)
        a->n++;
    a->down_until_ms = calloc(a->n, sizeof(*a->down_until_ms));
    if (a->down_until_ms == NULL) {
        freeaddrinfo(a->ai);
        free(a);
        return NULL;
    }
    for (unsigned i = 0; i < a->n; i++)
        atomic_init(&a->down_until_ms[i], 0);
    atomic_init(&a->refs, 1);
    return a;
}

/* The addresses to connect to, with a reference the caller puts back; NULL
 * when the name does not resolve (now). */
static struct upstream_addrs *origin_addrs(struct upstream_origin *o)
{
    struct upstream_addrs *a;

    pthread_mutex_lock(&o->lock);
    a = o->cur;
    if (a != NULL)
        atomic_fetch_add(&a->refs, 1);
    pthread_mutex_unlock(&o->lock);
    return a;
}

/* Takes ai (of addrs) for down, or for up again, there and in the current
 * resolution if that is a newer one (which new connections use). */
static void addr_mark(struct upstream_origin *o, struct upstream_addrs *addrs,
                      const struct addrinfo *ai, bool down)
{
    int64_t until_ms = down ? idem_mono_ms() + ADDR_DOWN_MS : 0;
    unsigned at = addr_index(addrs, ai);

    if (at >= addrs->n ||
        (!down && atomic_load_explicit(&addrs->down_until_ms[at], memory_order_relaxed) == 0))
        return; /* (clearing: the usual case, nothing to clear) */
    addr_mark_in(addrs, at, until_ms);
    if (addrs->gen == atomic_load_explicit(&o->gen, memory_order_relaxed))
        return;
    pthread_mutex_lock(&o->lock);
    if (o->cur != NULL && o->cur != addrs) {
        unsigned i = 0;
        for (const struct addrinfo *a = o->cur->ai; a != NULL; a = a->ai_next, i++)
            if (addr_same(a, ai)) {
                addr_mark_in(o->cur, i, until_ms);
                break;
            }
    }
    pthread_mutex_unlock(&o->lock);
}

/* A worker found no address that connects (or none at all): resolve again
 * soon. */
static void origin_resolve_soon(struct upstream_origin *o)
{
    if (!o->thread_started)
        return;
    pthread_mutex_lock(&o->lock);
    if (!o->want_now) {
        o->want_now = true;
        pthread_cond_signal(&o->cond);
    }
    pthread_mutex_unlock(&o->lock);
}

static void *resolver_main(void *arg)
{
    struct upstream_origin *o = arg;
    int64_t last_ms = idem_mono_ms();
    int64_t next_ms;

    pthread_mutex_lock(&o->lock);
    /* A name that did not resolve at start is tried again every second. */
    next_ms = last_ms + (o->cur == NULL ? 1000 : o->resolve_interval_ms);
    while (!o->stop) {
        int64_t now = idem_mono_ms();
        /* Asked for at once: still at most once a second. */
        int64_t due = o->want_now && last_ms + 1000 < next_ms ? last_ms + 1000 : next_ms;
        if (now < due) {
            struct timespec ts = idem_deadline_in_ms(due - now);
            pthread_cond_timedwait(&o->cond, &o->lock, &ts);
            continue;
        }
        o->want_now = false;
        o->resolving = true;
        pthread_mutex_unlock(&o->lock);
        {
            struct upstream_addrs *fresh = origin_resolve(o);
            struct upstream_addrs *old = NULL;
            last_ms = idem_mono_ms();
            /* A failed lookup keeps the addresses there are: a DNS server
             * that is down for a moment must not take a working upstream
             * away. Without any, it is tried again every second. */
            pthread_mutex_lock(&o->lock);
            o->resolving = false;
            if (o->orphaned) {
                /* The proxy stopped during a slow lookup and did not wait. */
                pthread_mutex_unlock(&o->lock);
                addrs_put(fresh);
                origin_destroy(o);
                return NULL;
            }
            if (fresh != NULL) {
                old = o->cur;
                addrs_carry_down(fresh, old);
                o->cur = fresh;
                fresh->gen = atomic_load(&o->gen) + 1;
                atomic_store(&o->gen, fresh->gen);
            }
            next_ms = last_ms + (o->cur == NULL ? 1000 : o->resolve_interval_ms);
            pthread_mutex_unlock(&o->lock);
            addrs_put(old);
        }
        pthread_mutex_lock(&o->lock);
    }
    pthread_mutex_unlock(&o->lock);
    return NULL;
}

int upstream_origin_new(const char *url, int64_t resolve_interval_ms, struct upstream_origin **out,
                        char *err, size_t errlen)
{
    struct upstream_origin *o = NULL;
    struct addrinfo hints = {0};
    struct addrinfo *numeric = NULL;
    const char *auth, *path, *host, *port = NULL;
    char hostbuf[256], portbuf[8];
    size_t auth_len, host_len;
    int rc = -1;

    *out = NULL;
    if (strncmp(url, "http://", 7) != 0) {
        snprintf(err, errlen, "upstream: not an http:// URL");
        goto out;
    }
    auth = url + 7;
    auth_len = strcspn(auth, "/");
    path = auth + auth_len;
    host = auth;
    host_len = auth_len;
    if (auth[0] == '[') {
        const char *end = memchr(auth, ']', auth_len);
        if (end == NULL)
            goto bad;
        host = auth + 1;
        host_len = (size_t)(end - host);
        if (end + 1 < auth + auth_len) {
            if (end[1] != ':')
                goto bad;
            port = end + 2;
        }
    } else {
        const char *colon = memchr(auth, ':', auth_len);
        if (colon != NULL) {
            host_len = (size_t)(colon - auth);
            port = colon + 1;
        }
    }
    if (host_len == 0 || host_len >= sizeof(hostbuf))
        goto bad;
    memcpy(hostbuf, host, host_len);
    hostbuf[host_len] = '\0';
    if (port != NULL) {
        size_t pl = (size_t)(auth + auth_len - port);
        if (pl == 0 || pl >= sizeof(portbuf))
            goto bad;
        memcpy(portbuf, port, pl);
        portbuf[pl] = '\0';
    } else {
        strcpy(portbuf, "80");
    }
    o = calloc(1, sizeof(*o));
    if (o == NULL)
        goto nomem;
    pthread_mutex_init(&o->lock, NULL);
    idem_cond_init_monotonic(&o->cond);
    memcpy(o->host, hostbuf, host_len + 1);
    memcpy(o->port, portbuf, strlen(portbuf) + 1);
    o->resolve_interval_ms = resolve_interval_ms > 0 ? resolve_interval_ms : 30000;
    {
        /* libcurl's Host: the host as written (IPv6 in brackets), plus
         * ":port" unless it is the scheme's default. */
        bool v6 = auth[0] == '[';
        bool dflt = strtol(portbuf, NULL, 10) == 80;
        size_t l = host_len + (v6 ? 2 : 0) + (dflt ? 0 : 1 + strlen(portbuf));
        o->host_header = malloc(l + 1);
        if (o->host_header == NULL)
            goto nomem;
        snprintf(o->host_header, l + 1, "%s%s%s%s%s", v6 ? "[" : "", hostbuf, v6 ? "]" : "",
                 dflt ? "" : ":", dflt ? "" : portbuf);
        o->host_header_len = strlen(o->host_header);
    }
    o->base_len = strlen(path);
    while (o->base_len > 0 && path[o->base_len - 1] == '/')
        o->base_len--;
    o->base = malloc(o->base_len + 1);
    if (o->base == NULL)
        goto nomem;
    memcpy(o->base, path, o->base_len);
    o->base[o->base_len] = '\0';
    o->cur = origin_resolve(o); /* NULL: every exchange NOT_SENT until it resolves */
    atomic_init(&o->gen, 0); /* (o->cur->gen is 0 too) */
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | AI_NUMERICHOST;
    if (getaddrinfo(hostbuf, portbuf, &hints, &numeric) == 0) {
        freeaddrinfo(numeric); /* a literal address: nothing to resolve again */
    } else {
        if (pthread_create(&o->thread, NULL, resolver_main, o) != 0) {
            snprintf(err, errlen, "upstream: cannot start the resolver thread");
            goto out;
        }
        o->thread_started = true;
    }
    *out = o;
    o = NULL;
    rc = 0;
    goto out;
bad:
    snprintf(err, errlen, "upstream: invalid URL");
    goto out;
nomem:
    snprintf(err, errlen, "out of memory");
out:
    upstream_origin_free(o);
    return rc;
}

bool upstream_origin_resolved(struct upstream_origin *o)
{
    struct upstream_addrs *a = origin_addrs(o);
    addrs_put(a);
    return a != NULL;
}

void upstream_origin_free(struct upstream_origin *o)
{
    if (o == NULL)
        return;
    if (o->thread_started) {
        bool busy;
        pthread_mutex_lock(&o->lock);
        o->stop = true;
        busy = o->resolving;
        o->orphaned = busy;
        if (busy) {
            /* A lookup can take the resolver's whole timeout (seconds, with
             * a DNS server down): stopping does not wait for it. Detached
             * under the lock: once it is released the thread may free o. */
            pthread_detach(o->thread);
            pthread_mutex_unlock(&o->lock);
            return;
        }
        pthread_cond_signal(&o->cond);
        pthread_mutex_unlock(&o->lock);
        pthread_join(o->thread, NULL);
    }
    origin_destroy(o);
}

static void origin_destroy(struct upstream_origin *o)
{
    addrs_put(o->cur);
    pthread_cond_destroy(&o->cond);
    pthread_mutex_destroy(&o->lock);
    free(o->host_header);
    free(o->base);
    free(o);
}

/* ---- connections and exchanges -------------------------------------------- */

struct upstream_conn {
    int fd;
    bool connecting;
    unsigned uses;     /* exchanges answered on it */
    unsigned gen_seen; /* the origin's gen when its address was last found current */
    int64_t idle_since_ms;
    uint32_t events;
    struct upstream_addrs *addrs;      /* the resolution addr is from (a reference) */
    const struct addrinfo *addr;       /* the address it connects to */
    struct upstream_exchange *x;       /* NULL while idle */
    struct upstream_conn *prev, *next; /* idle list */
    size_t len, cap;
    char buf[]; /* read buffer, cap bytes */
};

enum x_list { XL_NONE = 0, XL_FLIGHT, XL_DONE };

struct upstream_exchange {
    struct upstream_pool *pool;
    void *ctx;
    struct upstream_conn *conn;
    char *head;
    size_t head_len;
    const uint8_t *body;
    size_t body_len;
    size_t written;    /* of head + body, on the current connection */
    bool ever_written; /* a request byte left on some connection */
    bool may_retry;
    bool retried;
    bool took_new_addrs; /* went on to a newer resolution's addresses once */
    bool no_memory;      /* it failed for want of this process's memory */
    size_t body_told;    /* of the answer's body_cap, told to opt.body_grew */
    uint64_t tried;      /* the addresses (by place) of conn's list it tried */
    int64_t deadline_ms;
    int64_t connect_deadline_ms;
    enum idem_upstream_result result;
    struct upstream_parser parser;
    enum x_list list;
    struct upstream_exchange *prev, *next;
};

struct upstream_pool {
    struct upstream_origin *o;
    struct upstream_options opt;
    int epfd;
    uint64_t ep_tag;
    size_t buf_bytes;
    struct upstream_conn **by_fd;
    size_t n_by_fd;
    struct upstream_conn *idle; /* most recently used first */
    unsigned n_idle;
    struct upstream_exchange *flight;
    struct upstream_exchange *done;
    int64_t next_expire_ms;
    int64_t next_idle_sweep_ms; /* when the oldest idle connection times out */
};

#define EXPIRE_STEP_MS 10

static void x_unlink(struct upstream_exchange *x)
{
    struct upstream_exchange **head = NULL;

    if (x->pool != NULL && x->list == XL_FLIGHT)
        head = &x->pool->flight;
    else if (x->pool != NULL && x->list == XL_DONE)
        head = &x->pool->done;
    if (head != NULL) {
        if (x->prev != NULL)
            x->prev->next = x->next;
        else
            *head = x->next;
        if (x->next != NULL)
            x->next->prev = x->prev;
    }
    x->prev = x->next = NULL;
    x->list = XL_NONE;
}

static void x_link(struct upstream_exchange *x, enum x_list list)
{
    struct upstream_exchange **head = list == XL_FLIGHT ? &x->pool->flight : &x->pool->done;

    x_unlink(x);
    x->prev = NULL;
    x->next = *head;
    if (*head != NULL)
        (*head)->prev = x;
    *head = x;
    x->list = list;
}

static void idle_remove(struct upstream_pool *p, struct upstream_conn *c)
{
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        p->idle = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    c->prev = c->next = NULL;
    p->n_idle--;
}

static void conn_close(struct upstream_pool *p, struct upstream_conn *c)
{
    if (p != NULL && (size_t)c->fd < p->n_by_fd)
        p->by_fd[c->fd] = NULL;
    /* Closing the descriptor drops its epoll registration. */
    close(c->fd);
    addrs_put(c->addrs);
    free(c);
}

static int conn_watch(struct upstream_pool *p, struct upstream_conn *c, uint32_t events)
{
    struct epoll_event ev = {0};

    if (c->events == events)
        return 0;
    ev.events = events;
    ev.data.u64 = p->ep_tag | (uint64_t)(uint32_t)c->fd << 8;
    if (epoll_ctl(p->epfd, EPOLL_CTL_MOD, c->fd, &ev) != 0)
        return -1;
    c->events = events;
    return 0;
}

/* The exchange is over: to the done list; its connection is the caller's
 * business (closed or pooled before this). */
static void x_finish(struct upstream_exchange *x, enum idem_upstream_result res)
{
    x->result = res;
    x->conn = NULL;
    x_link(x, XL_DONE);
}

static void x_close_conn(struct upstream_exchange *x)
{
    if (x->conn != NULL) {
        conn_close(x->pool, x->conn);
        x->conn = NULL;
    }
}

static void x_connect(struct upstream_exchange *x, struct upstream_addrs *addrs);
static void x_connect_fresh(struct upstream_exchange *x);
static bool x_write(struct upstream_exchange *x);

/* The addresses of a lookup newer than addrs, with a reference the caller
 * puts back, once per exchange: NULL when there is none, or when x already
 * went on to newer addresses (a name that changes on every lookup must not
 * keep one request connecting for ever). */
static struct upstream_addrs *x_newer_addrs(struct upstream_exchange *x,
                                            const struct upstream_addrs *addrs)
{
    struct upstream_origin *o = x->pool->o;
    struct upstream_addrs *cur;

    if (x->took_new_addrs || addrs == NULL ||
        addrs->gen == atomic_load_explicit(&o->gen, memory_order_relaxed))
        return NULL;
    cur = origin_addrs(o);
    if (cur == addrs) {
        addrs_put(cur);
        return NULL;
    }
    if (cur != NULL)
        x->took_new_addrs = true;
    return cur;
}

/*
 * The connection failed (an error, a reset or an end before the answer was
 * complete). Decides between another address, a resend and a result:
 *  - while connecting: nothing was sent; the next address, else NOT_SENT;
 *  - a reused connection that fails before any response byte: the upstream
 *    may have closed it while it was idle. Resent once on a fresh connection
 *    when nothing of the request left, or when the caller allows it; a
 *    keyed or non-idempotent request is never sent twice;
 *  - otherwise BROKEN, or NOT_SENT when no request byte ever left.
 */
static void x_conn_failed(struct upstream_exchange *x)
{
    struct upstream_conn *c = x->conn;
    bool connecting = c->connecting;
    bool reused = c->uses > 0;
    const struct addrinfo *c_addr = c->addr; /* lives in addrs */
    struct upstream_addrs *addrs = c->addrs;

    if (addrs != NULL)
        atomic_fetch_add(&addrs->refs, 1); /* c_addr lives in it */
    x_close_conn(x);
    if (connecting) {
        /* Nothing was sent: the next address (none left: see x_connect). */
        if (addrs != NULL) {
            addr_mark(x->pool->o, addrs, c_addr, true);
            x_connect(x, addrs);
        } else {
            x_finish(x, x->ever_written ? IDEM_UPSTREAM_BROKEN : IDEM_UPSTREAM_NOT_SENT);
        }
        addrs_put(addrs);
        return;
    }
    addrs_put(addrs);
    if (reused && !x->parser.seen_byte && !x->retried && (x->written == 0 || x->may_retry)) {
        x->retried = true;
        x->written = 0;
        x_connect_fresh(x);
        return;
    }
    x_finish(x, x->ever_written ? IDEM_UPSTREAM_BROKEN : IDEM_UPSTREAM_NOT_SENT);
}

/* Has the name moved away from c's address? When a lookup gave other
 * addresses, a connection to one no longer among them finishes its exchange
 * and is closed, not reused, so traffic follows a moved name even while the
 * old address still answers. Addresses that stay keep their connections.
 * Cheap: the current addresses are looked at once per new resolution. */
static bool conn_addr_gone(struct upstream_origin *o, struct upstream_conn *c)
{
    bool gone = false;

    if (c->addr == NULL ||
        c->gen_seen == atomic_load_explicit(&o->gen, memory_order_relaxed))
        return false;
    pthread_mutex_lock(&o->lock);
    if (o->cur != NULL) {
        const struct addrinfo *a = o->cur->ai;
        while (a != NULL && !addr_same(a, c->addr))
            a = a->ai_next;
        gone = a == NULL;
        c->gen_seen = o->cur->gen;
    }
    pthread_mutex_unlock(&o->lock);
    return gone;
}

/* A complete answer: the connection goes back to the pool if it may. */
static void x_answered(struct upstream_exchange *x)
{
    struct upstream_pool *p = x->pool;
    struct upstream_conn *c = x->conn;
    bool keep = upstream_parse_keep_alive(&x->parser) && c->len == 0 &&
                x->written == x->head_len + x->body_len && p->n_idle < p->opt.max_idle &&
                !conn_addr_gone(p->o, c);

    c->uses++;
    c->x = NULL;
    x->conn = NULL;
    if (keep && conn_watch(p, c, EPOLLIN | EPOLLRDHUP) == 0) {
        c->idle_since_ms = idem_mono_ms();
        if (p->idle == NULL)
            p->next_idle_sweep_ms = c->idle_since_ms + p->opt.idle_timeout_ms;
        c->prev = NULL;
        c->next = p->idle;
        if (p->idle != NULL)
            p->idle->prev = c;
        p->idle = c;
        p->n_idle++;
    } else {
        conn_close(p, c);
    }
    x_finish(x, IDEM_UPSTREAM_RESPONSE);
}

static void x_parsed(struct upstream_exchange *x, enum upstream_parse_rc rc)
{
    switch (rc) {
    case UPSTREAM_PARSE_DONE:
        x_answered(x);
        break;
    case UPSTREAM_PARSE_TOO_LARGE:
        x_close_conn(x);
        x_finish(x, IDEM_UPSTREAM_TOO_LARGE);
        break;
    case UPSTREAM_PARSE_BROKEN:
    case UPSTREAM_PARSE_NOMEM:
        x->no_memory = rc == UPSTREAM_PARSE_NOMEM;
        x_close_conn(x);
        x_finish(x, x->ever_written ? IDEM_UPSTREAM_BROKEN : IDEM_UPSTREAM_NOT_SENT);
        break;
    default:
        break;
    }
}

/* Reads what the socket holds (a bounded number of times: the loop must
 * serve everyone) and parses it. True when the exchange still waits on the
 * same connection; false when it moved on (finished, failed, or resent on
 * another connection, which may even reuse the freed one's address, so
 * callers must not compare pointers). */
static bool x_read(struct upstream_exchange *x)
{
    struct upstream_conn *c = x->conn;

    for (int round = 0; round < 16; round++) {
        ssize_t n;
        size_t used = 0;
        enum upstream_parse_rc rc;

        if (c->len == c->cap) {
            /* The parser holds back less than a buffer (upstream.h). */
            x_parsed(x, UPSTREAM_PARSE_BROKEN);
            return false;
        }
        n = recv(c->fd, c->buf + c->len, c->cap - c->len, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return true;
            x_conn_failed(x);
            return false;
        }
        if (n == 0) {
            if (upstream_parse_eof(&x->parser) == UPSTREAM_PARSE_DONE) {
                x_close_conn(x);
                x_finish(x, IDEM_UPSTREAM_RESPONSE);
            } else {
                x_conn_failed(x);
            }
            return false;
        }
        c->len += (size_t)n;
        rc = upstream_parse(&x->parser, c->buf, c->len, &used);
        if (used < c->len)
            memmove(c->buf, c->buf + used, c->len - used);
        c->len -= used;
        if (x->parser.resp.body_cap > x->body_told) {
            /* Told before x_parsed(): the caller holds the buffer's
             * growth while it arrives, not only once the answer is done. */
            if (x->pool->opt.body_grew != NULL)
                x->pool->opt.body_grew(x->ctx, x->parser.resp.body_cap - x->body_told);
            x->body_told = x->parser.resp.body_cap;
        }
        if (rc != UPSTREAM_PARSE_MORE) {
            x_parsed(x, rc);
            return false;
        }
        if ((size_t)n < c->cap / 2)
            break; /* most likely drained; level-triggered epoll says if not */
    }
    return true;
}

/* Writes what is left of the request; waits for EPOLLOUT when the socket
 * buffer is full. True when the exchange still waits on the same
 * connection (see x_read). */
static bool x_write(struct upstream_exchange *x)
{
    struct upstream_conn *c = x->conn;
    size_t total = x->head_len + x->body_len;

    while (x->written < total) {
        struct iovec iov[2];
        struct msghdr msg = {0};
        int n_iov = 0;
        ssize_t n;

        if (x->written < x->head_len) {
            iov[n_iov].iov_base = x->head + x->written;
            iov[n_iov].iov_len = x->head_len - x->written;
            n_iov++;
            if (x->body_len > 0) {
                iov[n_iov].iov_base = (void *)x->body;
                iov[n_iov].iov_len = x->body_len;
                n_iov++;
            }
        } else {
            iov[n_iov].iov_base = (void *)(x->body + (x->written - x->head_len));
            iov[n_iov].iov_len = total - x->written;
            n_iov++;
        }
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)n_iov;
        n = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (conn_watch(x->pool, c, EPOLLIN | EPOLLRDHUP | EPOLLOUT) == 0)
                    return true;
                x_conn_failed(x);
                return false;
            }
            /* The upstream may have answered and closed (an early error
             * answer): what it sent decides. */
            if (x_read(x))
                x_conn_failed(x);
            return false;
        }
        x->written += (size_t)n;
        x->ever_written = true;
    }
    if (conn_watch(x->pool, c, EPOLLIN | EPOLLRDHUP) == 0)
        return true;
    x_conn_failed(x);
    return false;
}

static int pool_track(struct upstream_pool *p, struct upstream_conn *c)
{
    size_t fd = (size_t)c->fd;

    if (fd >= p->n_by_fd) {
        size_t n = p->n_by_fd ? p->n_by_fd : 256;
        struct upstream_conn **nb;
        while (n <= fd)
            n *= 2;
        nb = realloc(p->by_fd, n * sizeof(*nb));
        if (nb == NULL)
            return -1;
        memset(nb + p->n_by_fd, 0, (n - p->n_by_fd) * sizeof(*nb));
        p->by_fd = nb;
        p->n_by_fd = n;
    }
    p->by_fd[fd] = c;
    return 0;
}

/* Opens a connection for x to the origin's current addresses. */
static void x_connect_fresh(struct upstream_exchange *x)
{
    struct upstream_addrs *addrs = origin_addrs(x->pool->o);

    if (addrs == NULL) {
        origin_resolve_soon(x->pool->o);
        x_finish(x, x->ever_written ? IDEM_UPSTREAM_BROKEN : IDEM_UPSTREAM_NOT_SENT);
        return;
    }
    x->tried = 0;
    x_connect(x, addrs);
    addrs_put(addrs);
}

static bool addrs_have(const struct upstream_addrs *addrs, const struct addrinfo *ai)
{
    for (const struct addrinfo *a = addrs->ai; a != NULL; a = a->ai_next)
        if (addr_same(a, ai))
            return true;
    return false;
}

/* Opens a fresh connection for x to the first address of addrs that x has
 * not tried: first those not taken for down, in their order, then those
 * that are (a single address is always tried). Only the first 64 addresses
 * of a name are used. The connection takes its own reference to addrs. */
static void x_connect(struct upstream_exchange *x, struct upstream_addrs *addrs)
{
    struct upstream_pool *p = x->pool;
    int64_t now = idem_mono_ms();
    bool out_of_addrs = true;

    for (int pass = 0; pass < 2 && out_of_addrs; pass++) {
        unsigned i = 0;
        for (const struct addrinfo *ai = addrs->ai; ai != NULL && i < 64; ai = ai->ai_next, i++) {
            struct upstream_conn *c;
            struct epoll_event ev = {0};
            int one = 1;
            int fd;
            int rc;

            if ((x->tried & (UINT64_C(1) << i)) != 0 || addr_down(addrs, i, now) != (pass == 1))
                continue;
            x->tried |= UINT64_C(1) << i;
            fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            if (fd < 0)
                continue;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
            rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
            if (rc != 0 && errno != EINPROGRESS) {
                /* Marked down for what the address did (refused,
                 * unreachable), not for this host's own shortage (no
                 * local port, no buffers): every worker would pass over
                 * a healthy address for ADDR_DOWN_MS. */
                bool local = errno == EAGAIN || errno == EADDRNOTAVAIL || errno == ENOBUFS ||
                             errno == ENOMEM || errno == EINTR;
                close(fd);
                if (!local)
                    addr_mark(p->o, addrs, ai, true);
                continue;
            }
            c = malloc(sizeof(*c) + p->buf_bytes);
            if (c == NULL) {
                close(fd);
                x->no_memory = true;
                out_of_addrs = false;
                break;
            }
            memset(c, 0, sizeof(*c));
            c->fd = fd;
            c->cap = p->buf_bytes;
            atomic_fetch_add(&addrs->refs, 1);
            c->addrs = addrs;
            c->addr = ai;
            c->gen_seen = addrs->gen;
            c->connecting = rc != 0;
            c->events = c->connecting ? EPOLLOUT : EPOLLIN | EPOLLRDHUP;
            ev.events = c->events;
            ev.data.u64 = p->ep_tag | (uint64_t)(uint32_t)fd << 8;
            if (pool_track(p, c) != 0 || epoll_ctl(p->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
                /* pool_track fails only for memory; epoll_ctl ADD for
                 * memory or the user's epoll watch limit. */
                x->no_memory = true;
                conn_close(p, c);
                out_of_addrs = false;
                break;
            }
            c->x = x;
            x->conn = c;
            x->connect_deadline_ms = now + p->opt.connect_timeout_ms;
            upstream_parser_clear(&x->parser);
            upstream_parser_init(&x->parser, x->parser.no_body_request, p->opt.max_header_bytes,
                                 p->opt.max_response_bytes);
            if (!c->connecting) {
                addr_mark(p->o, addrs, ai, false);
                x_write(x);
            }
            return;
        }
    }
    if (out_of_addrs) {
        /* No address of this resolution connects: the name may point
         * elsewhere now, and may already have been looked up again (while
         * a connect waited for its timeout): then the new addresses, less
         * those just tried. */
        struct upstream_addrs *newer = x_newer_addrs(x, addrs);
        if (newer != NULL) {
            unsigned i = 0;
            x->tried = 0;
            for (const struct addrinfo *ai = newer->ai; ai != NULL && i < 64; ai = ai->ai_next, i++)
                if (addrs_have(addrs, ai))
                    x->tried |= UINT64_C(1) << i;
            x_connect(x, newer);
            addrs_put(newer);
            return;
        }
    }
    origin_resolve_soon(p->o);
    x_finish(x, x->ever_written ? IDEM_UPSTREAM_BROKEN : IDEM_UPSTREAM_NOT_SENT);
}

static bool idle_too_long(const struct upstream_pool *p, const struct upstream_conn *c,
                          int64_t now_ms)
{
    return p->opt.idle_timeout_ms > 0 && now_ms - c->idle_since_ms >= p->opt.idle_timeout_ms;
}

/* Closes the idle connections that have been idle too long. The list is in
 * the order they went idle, newest first, so they are its tail. */
static void idle_sweep(struct upstream_pool *p, int64_t now_ms)
{
    struct upstream_conn *c = p->idle, *oldest_kept = NULL;

    while (c != NULL && !idle_too_long(p, c, now_ms)) {
        oldest_kept = c;
        c = c->next;
    }
    while (c != NULL) {
        struct upstream_conn *next = c->next;
        idle_remove(p, c);
        conn_close(p, c);
        c = next;
    }
    if (oldest_kept != NULL)
        p->next_idle_sweep_ms = oldest_kept->idle_since_ms + p->opt.idle_timeout_ms;
}

/* An idle connection for x, most recently used first, never one idle for
 * idle_timeout_ms or longer, checked with one peek: one the upstream has
 * closed meanwhile is not taken (for a request that may not be resent, a
 * failure after the write would be an unknown outcome), nor one with bytes
 * waiting, which came after the last answer (a 408 at the upstream's idle
 * timeout, or a body past its length) and would be read as this request's
 * answer. The loop sees those only at its next epoll_wait, and a request
 * may take the connection before. */
static struct upstream_conn *idle_take(struct upstream_pool *p, int64_t now_ms)
{
    while (p->idle != NULL) {
        struct upstream_conn *c = p->idle;
        char b;
        if (idle_too_long(p, c, now_ms)) {
            idle_sweep(p, now_ms); /* it and every older one */
            return NULL;
        }
        idle_remove(p, c);
        if (conn_addr_gone(p->o, c)) {
            conn_close(p, c);
            continue;
        }
        if (recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) < 0 &&
            (errno == EAGAIN || errno == EWOULDBLOCK))
            return c;
        conn_close(p, c);
    }
    return NULL;
}

static char *build_head(const struct upstream_origin *o, const struct upstream_request *req,
                        size_t *out_len)
{
    const struct idem_headers *h = req->headers;
    size_t mlen = strlen(req->method);
    size_t len = mlen + 1 + o->base_len + req->target_len + 11 + 6 + o->host_header_len + 2 + 2;
    char *head, *q;

    for (size_t i = 0; i < h->n; i++)
        len += h->v[i].name_len + 2 + h->v[i].value_len + 2;
    if (req->body_len > 0 || req->send_length)
        len += 16 + 20 + 2;
    head = malloc(len + 1);
    if (head == NULL)
        return NULL;
    q = head;
    memcpy(q, req->method, mlen);
    q += mlen;
    *q++ = ' ';
    memcpy(q, o->base, o->base_len);
    q += o->base_len;
    memcpy(q, req->target, req->target_len);
    q += req->target_len;
    memcpy(q, " HTTP/1.1\r\nHost: ", 17);
    q += 17;
    memcpy(q, o->host_header, o->host_header_len);
    q += o->host_header_len;
    *q++ = '\r';
    *q++ = '\n';
    for (size_t i = 0; i < h->n; i++) {
        memcpy(q, h->v[i].name, h->v[i].name_len);
        q += h->v[i].name_len;
        *q++ = ':';
        if (h->v[i].value_len > 0) {
            *q++ = ' ';
            memcpy(q, h->v[i].value, h->v[i].value_len);
            q += h->v[i].value_len;
        }
        *q++ = '\r';
        *q++ = '\n';
    }
    if (req->body_len > 0 || req->send_length)
        q += snprintf(q, 16 + 20 + 3, "Content-Length: %zu\r\n", req->body_len);
    *q++ = '\r';
    *q++ = '\n';
    *out_len = (size_t)(q - head);
    return head;
}

int upstream_pool_new(struct upstream_origin *o, const struct upstream_options *opt, int epfd,
                      uint64_t ep_tag, struct upstream_pool **out)
{
    struct upstream_pool *p = calloc(1, sizeof(*p));

    *out = NULL;
    if (p == NULL)
        return -1;
    p->o = o;
    p->opt = *opt;
    p->epfd = epfd;
    p->ep_tag = ep_tag;
    /* Room for the longest line the parser may hold back, and then some. */
    p->buf_bytes = opt->max_header_bytes + 4096;
    if (p->buf_bytes < 16384)
        p->buf_bytes = 16384;
    *out = p;
    return 0;
}

void upstream_pool_free(struct upstream_pool *p)
{
    if (p == NULL)
        return;
    while (p->idle != NULL) {
        struct upstream_conn *c = p->idle;
        idle_remove(p, c);
        conn_close(p, c);
    }
    /* Exchanges still owned by callers: detached, so that a later cancel
     * or free does not touch the pool. */
    while (p->flight != NULL) {
        struct upstream_exchange *x = p->flight;
        x_close_conn(x);
        x_unlink(x);
        x->pool = NULL;
    }
    while (p->done != NULL) {
        struct upstream_exchange *x = p->done;
        x_unlink(x);
        x->pool = NULL;
    }
    free(p->by_fd);
    free(p);
}

int upstream_start(struct upstream_pool *p, const struct upstream_request *req, void *ctx,
                   struct upstream_exchange **out)
{
    struct upstream_exchange *x = calloc(1, sizeof(*x));
    struct upstream_conn *c;
    int64_t now = idem_mono_ms();

    *out = NULL;
    if (x == NULL)
        return -1;
    x->head = build_head(p->o, req, &x->head_len);
    if (x->head == NULL) {
        free(x);
        return -1;
    }
    x->pool = p;
    x->ctx = ctx;
    x->body = req->body;
    x->body_len = req->body_len;
    x->may_retry = req->may_retry;
    x->deadline_ms = now + p->opt.timeout_ms;
    upstream_parser_init(&x->parser, strcmp(req->method, "HEAD") == 0, p->opt.max_header_bytes,
                         p->opt.max_response_bytes);
    x_link(x, XL_FLIGHT);
    if (p->flight->next == NULL)
        p->next_expire_ms = now + EXPIRE_STEP_MS;
    *out = x;
    c = idle_take(p, now);
    if (c != NULL) {
        c->x = x;
        x->conn = c;
        x_write(x);
    } else {
        x_connect_fresh(x);
    }
    return 0;
}

void upstream_event(struct upstream_pool *p, int fd, uint32_t events)
{
    struct upstream_conn *c = (size_t)fd < p->n_by_fd ? p->by_fd[fd] : NULL;
    struct upstream_exchange *x;

    if (c == NULL) {
        epoll_ctl(p->epfd, EPOLL_CTL_DEL, fd, NULL);
        return;
    }
    x = c->x;
    if (x == NULL) {
        /* Idle: the upstream closed it (or sent what nobody asked for). */
        idle_remove(p, c);
        conn_close(p, c);
        return;
    }
    if (c->connecting) {
        /* SO_ERROR, not the event's flags, decides: an event read in the
         * same batch may be a closed descriptor's whose number this
         * socket took over. */
        int soerr = 0;
        socklen_t sl = sizeof(soerr);
        struct sockaddr_storage peer;
        socklen_t pl = sizeof(peer);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr != 0) {
            x_conn_failed(x);
            return;
        }
        /* A socket still connecting has no error either: only a peer
         * address says the connect is done (an EPOLLOUT in the batch may
         * be the old descriptor's). */
        if ((events & EPOLLOUT) == 0 || getpeername(fd, (struct sockaddr *)&peer, &pl) != 0)
            return;
        c->connecting = false;
        addr_mark(p->o, c->addrs, c->addr, false);
        x_write(x);
        return;
    }
    if ((events & EPOLLOUT) != 0 && x->written < x->head_len + x->body_len && !x_write(x))
        return;
    if ((events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0)
        x_read(x);
}

void upstream_expire(struct upstream_pool *p, int64_t now_ms)
{
    struct upstream_exchange *x = p->flight;

    if (p->idle != NULL && p->opt.idle_timeout_ms > 0 && now_ms >= p->next_idle_sweep_ms)
        idle_sweep(p, now_ms);
    if (x == NULL || now_ms < p->next_expire_ms)
        return;
    p->next_expire_ms = now_ms + EXPIRE_STEP_MS;
    while (x != NULL) {
        struct upstream_exchange *next = x->next;
        bool connect_late =
            x->conn != NULL && x->conn->connecting && now_ms >= x->connect_deadline_ms;
        if (connect_late && now_ms < x->deadline_ms) {
            /* This address does not answer (a host that is down drops the
             * connect): on to the next one, as after a refused connect. */
            x_conn_failed(x);
            origin_resolve_soon(p->o); /* the address may be gone for good */
        } else if (connect_late || now_ms >= x->deadline_ms) {
            bool sent = x->ever_written;
            if (connect_late)
                origin_resolve_soon(p->o); /* the address may be gone for good */
            x_close_conn(x);
            x_finish(x, !sent          ? IDEM_UPSTREAM_NOT_SENT
                        : connect_late ? IDEM_UPSTREAM_BROKEN
                                       : IDEM_UPSTREAM_TIMEOUT);
        }
        x = next;
    }
}

int64_t upstream_next_timeout_ms(const struct upstream_pool *p, int64_t now_ms)
{
    int64_t t = -1;

    if (p->done != NULL)
        return 0;
    if (p->flight != NULL)
        t = p->next_expire_ms > now_ms ? p->next_expire_ms - now_ms : 0;
    if (p->idle != NULL && p->opt.idle_timeout_ms > 0) {
        int64_t d = p->next_idle_sweep_ms > now_ms ? p->next_idle_sweep_ms - now_ms : 0;
        if (t < 0 || d < t)
            t = d;
    }
    return t;
}

struct upstream_exchange *upstream_take_done(struct upstream_pool *p)
{
    struct upstream_exchange *x = p->done;

    if (x != NULL)
        x_unlink(x);
    return x;
}

void *upstream_exchange_ctx(const struct upstream_exchange *x)
{
    return x->ctx;
}

enum idem_upstream_result upstream_exchange_result(const struct upstream_exchange *x)
{
    return x->result;
}

bool upstream_exchange_no_memory(const struct upstream_exchange *x)
{
    return x->no_memory;
}

struct upstream_response *upstream_exchange_response(struct upstream_exchange *x)
{
    return &x->parser.resp;
}

void upstream_exchange_free(struct upstream_exchange *x)
{
    if (x == NULL)
        return;
    x_unlink(x);
    if (x->conn != NULL) {
        x->conn->x = NULL;
        conn_close(x->pool, x->conn);
    }
    upstream_parser_clear(&x->parser);
    free(x->head);
    free(x);
}

enum idem_upstream_result upstream_cancel(struct upstream_exchange *x)
{
    enum idem_upstream_result res =
        x->ever_written ? IDEM_UPSTREAM_TIMEOUT : IDEM_UPSTREAM_NOT_SENT;

    upstream_exchange_free(x);
    return res;
}
