/*
 * server.c - worker event loops: libmicrohttpd (external epoll) + the
 * upstream client (the native one, upstream.h, or a libcurl multi handle) +
 * the store writer. See server.h for the shape, policy.h for the
 * decisions, CONTRACT.md section 3 for the behaviour.
 *
 * A request's life (all on its worker's thread):
 *
 *   uri log callback   allocate struct request with the raw target
 *   handler, 1st call  headers: framing checks, route, key, scope, 413 by
 *                      Content-Length; errors answered at once (close)
 *   handler, body      copied up to max_body
 *   handler, last      not covered/no key: forward. Keyed: read the record
 *                      (no writer): replay / 422 / wait or 409 / acquire
 *   ACQUIRING          acquire op queued to the writer; suspended
 *   WAITING            a duplicate of a live IN_PROGRESS record; woken by a
 *                      complete/release in this process, or polls (backoff)
 *   UPSTREAM           upstream exchange; the lease is extended by heartbeats
 *   FINISHING          complete/release op queued; answered only after the
 *                      writer committed it (durable before the client hears)
 *   RESPOND            resumed; the handler queues the response
 */
/* pthread_setname_np is a GNU extension. */
#define _GNU_SOURCE 1
#include "server.h"
#include "clock.h"

#include <arpa/inet.h>
#include <assert.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "access_log.h"
#include "diag.h"
#include "fault.h"
#include "policy.h"
#include "replay_share.h"
#include "upstream.h"
#include "wire_check.h"
#include "writer.h"

#define TICK_MS 10
#define IDLE_TICK_MS 1000
#define SWEEP_MS 1000 /* sweep_closed() */
#define POLL_MIN_MS 10
#define POLL_MAX_MS 200
#define LOG_FLUSH_BYTES 32768
/* The access log's buffer between the workers and stdout (about a
 * thousand lines), and how long a stop waits for stdout to take it. */
#define ACCESS_LOG_BUFFER_BYTES (256 * 1024)
#define ACCESS_LOG_STOP_FLUSH_MS 2000
#define MAX_EVENTS 128
/* Idle keep-alive connections the native client keeps per worker. */
#define UPSTREAM_IDLE_MAX 64
/* A rejected upload the proxy stops reading is answered and then read and
 * discarded for a while before the socket is closed (a "lingering close",
 * RFC 9112 section 9.6): closing with unread bytes makes the kernel send a
 * reset, which can destroy the answer before the client reads it. Bounded
 * in time, bytes and sockets per worker; past the count, closed at once. */
#define LINGER_MS 2000
#define LINGER_MAX_BYTES (64u << 20)
#define LINGER_MAX_SOCKS 64
/* After the drain deadline: how long the answers just forced (503, 504)
 * get to be written before every remaining connection is closed. A worker
 * with store writes still out at the end of it (the store's disk stalls)
 * answers the requests waiting for them (give_up_store_waits) and gives
 * those answers one more grace; the writer gets until then too
 * (proxy_server_join). */
#define DRAIN_GRACE_MS 1000
/* What the writer gets at the stop beyond the workers' last grace, to hand
 * back what it just finished (proxy_server_join). */
#define WRITER_LAST_MS 250

/* What an epoll event is about: data.u64 = kind | fd << 8. */
enum ep_kind { EP_MHD = 1, EP_INBOX, EP_CURL, EP_LINGER, EP_UPSTREAM };

static uint64_t ep_data(enum ep_kind kind, int fd)
{
    return (uint64_t)kind | (uint64_t)(uint32_t)fd << 8;
}

/*
 * A libcurl socket's epoll registration. libcurl drops a connection's socket
 * (CURL_POLL_REMOVE) after every transfer and adds it again for the next
 * one on the same kept-alive connection: two epoll_ctl calls per request.
 * Instead a removed socket stays registered ("parked"); a re-add with the
 * same interest costs nothing, an event on a parked socket unregisters it
 * then, and libcurl's close callback forgets it (the kernel drops the
 * registration of a closed descriptor itself).
 */
struct curl_sock {
    uint32_t events; /* registered interest */
    bool registered;
    bool wanted; /* libcurl currently watches it */
};

enum req_state {
    RS_HEADERS = 0, /* created; first handler call not seen yet */
    RS_BODY,
    RS_ACQUIRING,
    RS_WAITING,
    RS_UPSTREAM,
    RS_FINISHING,
    RS_RESPOND,
    RS_DONE,
};

/* A client socket taken over from libmicrohttpd to answer a rejected
 * upload and linger (see LINGER_MS). The descriptor is a dup: libmicrohttpd
 * closes its own one as usual. */
struct linger_sock {
    int fd;
    int64_t deadline_ms;
    size_t discarded;
    char *out; /* the answer, until written */
    size_t out_len, out_off;
    struct linger_sock *next;
};

struct worker;
struct request;

/*
 * One client connection, from libmicrohttpd's start notification to its
 * close (MHD_OPTION_NOTIFY_CONNECTION), for the sweep: libmicrohttpd
 * 0.9.75 watches its sockets edge-triggered and takes a short read as
 * "drained", so a client whose last bytes and FIN arrive together (half a
 * request head, then close) is never read again: the connection, and the
 * request it started, stay until client_timeout and hold up a drain. Once a
 * second the worker peeks at the connections that hold no action in flight
 * and shuts down the ones whose client has closed, which libmicrohttpd then
 * reads as the close it is. See sweep_closed().
 */
struct conn_slot {
    int fd;
    bool ip_counted;         /* holds one of its address's per-IP count */
    unsigned char ip[16];    /* the client's address, IPv4 mapped to IPv6 */
    bool addr_done;          /* addr holds the client's address as text */
    char addr[INET6_ADDRSTRLEN];
    struct request *req; /* the request it is reading, if any */
    struct wire_check *wire; /* its raw bytes, framed strictly */
    struct conn_slot *prev, *next;
};

struct request {
    struct worker *w;
    struct MHD_Connection *conn;
    struct conn_slot *slot; /* NULL once the connection is closed */
    size_t head_bytes; /* header lines as received (collect_header) */
    const char *last_field; /* the last field's name in libmicrohttpd's
                             * buffer (see count_trailer) */
    unsigned trailers;      /* trailer fields after a chunked body */
    const char *line_end; /* where the request line or the last field value
                           * seen ends in libmicrohttpd's read buffer; NULL:
                           * lines not checked (collect_header) */
    size_t pool_bytes; /* what the request holds of libmicrohttpd's pool */
    struct request *prev, *next; /* worker's active (suspended) list */
    bool active;

    char *target; /* raw request target (path and query) */
    size_t target_len;
    size_t path_len; /* up to '?' */
    char *method;
    bool http10;
    struct idem_headers headers;
    const struct config_route *route;
    bool keyed;
    char *key;
    size_t key_len;
    char *scope;
    size_t scope_len;
    char keyhash[9];
    uint8_t record_key[STORE_KEY_BYTES];
    struct idem_fingerprints fp; /* borrows method, target and body */

    /* rejection found in the headers, answered at the end of the body */
    int reject_status;

    uint8_t *body;
    size_t body_len, body_cap;
    uint64_t charged;      /* of server.max_buffered: returned by request_free() */
    uint64_t body_charged; /* of which for the body: its Content-Length, or body_cap */
    size_t resp_grown;     /* of charged: the native exchange's body buffer, as it grew */
    uint64_t store_charged; /* of charged: the store's copy of a complete, until it is delivered */
    bool budget_full;      /* oom: server.max_buffered, not a failed allocation */
    bool body_too_large;
    size_t body_discarded;

    enum req_state state;
    bool suspended;
    bool mhd_done;

    struct writer_job job;
    bool job_pending;
    struct writer_job hb_job;
    bool hb_pending;
    int64_t next_hb_ms;
    bool lease_lost; /* a heartbeat was fenced (the key was stolen): no more of them */
    bool live_lease; /* acquired: the writer knows lease_id as live until request_free */
    uint8_t lease_id[STORE_LEASE_ID_BYTES];

    int64_t wait_deadline_ms;
    int64_t next_poll_ms;
    int64_t poll_step_ms;
    int64_t holder_lease_expires_ms;
    bool counted_waiting;

    CURL *easy;
    struct curl_slist *curl_headers;
    struct upstream_exchange *ux; /* the native client's exchange */
    struct idem_headers resp_headers;
    int resp_status;
    uint8_t *resp_body;
    size_t resp_len, resp_cap;
    struct shared_answer *resp_shared; /* resp_body, shared with the response */
    bool resp_too_large;
    bool upstream_no_memory;     /* the exchange failed for want of our memory */
    bool resp_headers_too_large; /* the header block, not the body */
    bool resp_head_done;         /* the final answer's header section ended */
    unsigned sends;      /* times libcurl was about to send this request */
    bool resend_blocked; /* a silent resend was refused */
    bool resp_bad_framing; /* the upstream's response framing was ambiguous */
    bool oom;              /* an allocation failed on the way */
    bool drain_cut;        /* ended by the drain deadline, not by the upstream */
    bool store_abandoned;  /* answered at the stop with its store write still out */
    const char *problem;   /* the problem type of an answer the proxy made (static) */
    unsigned full_retries; /* acquires asked again after STORE_FULL */
    int64_t upstream_start_ms;
    double upstream_ms;

    /* the answer the client gets once the record is settled */
    struct MHD_Response *response;
    struct replay_ready *response_ready; /* response is this one's, not the request's own */
    int response_status;
    const char *outcome;
    /* the payload to store (complete) */
    uint8_t *store_headers;
    size_t store_headers_len;

    int64_t start_ms;
};

/*
 * A replay answer a worker keeps made: libmicrohttpd queues one response on
 * any number of connections (it counts them), so replays of one record
 * version share the response with its headers, besides its body's copy
 * (replay_share.h), instead of building and freeing one each. Each replay
 * still reads the record first and takes this answer only for the version
 * it read (replay_body_is()), so a record forgotten, purged or replaced is
 * never answered from it. Only bodies of up to REPLAY_READY_MAX_BODY are
 * kept (their bytes stay counted in server.max_buffered while kept), and an
 * answer not replayed between two sweeps (SWEEP_MS, a second) is let go.
 * Worker-owned: only its thread touches it.
 */
#define REPLAY_READY_MAX_BODY (64 * 1024)
struct replay_ready {
    struct MHD_Response *resp; /* holds body's reference, given back when freed */
    const struct replay_body *body;
    int status;
    size_t header_bytes; /* answer_header_bytes() of its stored headers */
    unsigned refs;       /* the worker's, and each request's not yet queued */
    bool used;           /* replayed since the last sweep_closed() */
};

static struct replay_ready *replay_ready_ref(struct replay_ready *rr)
{
    rr->refs++;
    return rr;
}

static void replay_ready_put(struct replay_ready *rr)
{
    if (rr == NULL || --rr->refs > 0)
        return;
    /* Connections it is queued on hold references of libmicrohttpd's own:
     * the response, and the body's copy with it, go with the last. */
    MHD_destroy_response(rr->resp);
    free(rr);
}

struct inbox_key {
    uint8_t key[STORE_KEY_BYTES];
    struct inbox_key *next;
};

struct worker {
    struct proxy_server *srv;
    int index;
    pthread_t thread;
    int epfd;
    int evfd;
    int listen_fd;
    struct MHD_Daemon *mhd;
    struct conn_slot *conns; /* open client connections */
    int64_t next_sweep_ms;
    CURLM *multi;             /* upstream.client "libcurl" */
    struct upstream_pool *pool; /* upstream.client "native" */
    int64_t curl_deadline_ms; /* monotonic; -1 = none */
    struct curl_sock *socks; /* indexed by descriptor, sized at start-up */
    size_t n_socks;
    struct MHD_Response *oom_response; /* 503 for when nothing can be allocated */
    struct replay_ready *replay_ready; /* the last replay answer made, kept for more */

    pthread_mutex_t inbox_lock;
    struct writer_job *inbox_jobs;
    struct inbox_key *inbox_keys;

    struct request *active;
    size_t n_active;
    size_t n_requests; /* allocated and not yet freed */
    bool draining;
    int64_t drain_deadline_ms;
    bool drain_forced;  /* the deadline passed: in-flight requests were settled */
    bool store_given_up; /* a grace later: those waiting for the store were answered */
    size_t n_jobs;      /* writer jobs submitted and not yet delivered back */
    struct linger_sock *lingering;
    size_t n_lingering;
    bool mhd_pending; /* a connection was resumed: run MHD */
    unsigned quiet_app_errors; /* see drop_waiter() */

    char *logbuf;
    size_t loglen;

};

/* Client connections per address, for server.per_ip_connections across all
 * workers (see on_connection()). Under proxy_server.ip_lock. */
#define IP_BUCKETS 1024
struct ip_count {
    unsigned char ip[16];
    unsigned n;
    struct ip_count *next;
};

struct proxy_server {
    const struct config *cfg;
    struct store *store;
    struct writer *writer;
    struct worker *workers;
    unsigned n_workers;
    atomic_int stopping;
    int64_t stop_ms; /* when proxy_server_stop() was called (idem_mono_ms) */
    atomic_int n_waiting;
    atomic_uint n_conns; /* client connections of all workers, see on_connection() */
    /* server.max_buffered: bytes of request bodies, answers and replays the
     * requests of all workers hold (see budget_take()), and the bound */
    _Atomic uint64_t buffered;
    uint64_t max_buffered;
    struct replay_share *shares; /* one copy of a stored answer for its concurrent replays */
    pthread_mutex_t ip_lock;
    struct ip_count *ip_buckets[IP_BUCKETS];
    char *upstream_base; /* upstream URL without trailing slash */
    bool upstream_literal; /* its host is an IP address (libcurl: see curl_host_check) */
    struct upstream_origin *origin; /* the native client's; NULL with libcurl */
    struct proxy_access_log *access_log; /* NULL: access_log off */
    int listen_lock_fd;  /* see claim_listen_address(); -1 = none */
    uint8_t log_salt[STORE_LOG_SALT_BYTES]; /* keys the access log's key hash */
};

/* ---- clocks ------------------------------------------------------------ */

static double mono_ms_f(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1000.0 + (double)ts.tv_nsec / 1e6;
}

/* The store's clocks: TTLs are wall-clock times, leases times on the lease
 * clock (store_clock), both shared between processes. */
static int64_t real_ms(void)
{
    return store_clock_realtime.now_ms(store_clock_realtime.ctx);
}

static int64_t lease_ms(void)
{
    return store_clock_lease_now(&store_clock_realtime);
}

/* ---- access log ------------------------------------------------------- */

/* Hands the worker's lines to the access log's own thread: a stdout that
 * is not being read must never block a worker (lines are dropped and
 * counted there instead, see access_log.h). */
static void log_flush(struct worker *w)
{
    if (w->loglen > 0 && w->srv->access_log != NULL)
        proxy_access_log_put(w->srv->access_log, w->logbuf, w->loglen);
    w->loglen = 0;
}

/* Escapes s into dst (cap > 16). A string that does not fit is cut at a
 * character boundary and ends with "..." so a reader knows it is not all. */
static size_t json_escape(char *dst, size_t cap, const char *s, size_t len)
{
    size_t o = 0, i = 0, fits = 0; /* fits: the last cut with room for "..." */

    for (; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        size_t n = 1;
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            n = 2;
        } else if (c < 0x20 || c >= 0x7f) {
            n = (size_t)snprintf(esc, sizeof esc, "\\u%04x", c);
        } else {
            esc[0] = (char)c;
        }
        if (o + n >= cap) /* and its NUL */
            break;
        memcpy(dst + o, esc, n);
        o += n;
        if (o + 3 < cap)
            fits = o;
    }
    if (i < len) {
        o = fits;
        memcpy(dst + o, "...", 3);
        o += 3;
    }
    dst[o] = '\0';
    return o;
}

static void log_request(struct worker *w, struct request *r)
{
    char when[40];
    char path[512];
    char method[40];
    char scope[300];
    char line[1400];
    struct timespec ts;
    struct tm tm;
    int n;

    if (!w->srv->cfg->access_log)
        return;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
    json_escape(path, sizeof(path), r->target ? r->target : "", r->target ? r->path_len : 0);
    json_escape(method, sizeof(method), r->method ? r->method : "", r->method ? strlen(r->method) : 0);
    if (r->route != NULL)
        json_escape(scope, sizeof(scope), r->route->scope, strlen(r->route->scope));
    n = snprintf(line, sizeof(line),
                 "{\"time\":\"%s.%03ldZ\",\"method\":\"%s\",\"path\":\"%s\",\"status\":%d,"
                 "\"outcome\":\"%s\",\"scope\":%s%s%s,\"key\":%s%s%s,\"upstream_ms\":%.1f,"
                 "\"total_ms\":%.1f,\"problem\":%s%s%s}\n",
                 when, ts.tv_nsec / 1000000, method, path, r->response_status,
                 r->outcome ? r->outcome : "aborted", r->route ? "\"" : "",
                 r->route ? scope : "null", r->route ? "\"" : "", r->keyed ? "\"" : "",
                 r->keyed ? r->keyhash : "null", r->keyed ? "\"" : "", r->upstream_ms,
                 mono_ms_f() - (double)r->start_ms, r->problem ? "\"" : "",
                 r->problem ? r->problem : "null", r->problem ? "\"" : "");
    if (n <= 0 || (size_t)n >= sizeof(line))
        return;
    if (w->loglen + (size_t)n > LOG_FLUSH_BYTES)
        log_flush(w);
    memcpy(w->logbuf + w->loglen, line, (size_t)n);
    w->loglen += (size_t)n;
}

/* ---- request bookkeeping --------------------------------------------- */

static void active_add(struct request *r)
{
    struct worker *w = r->w;
    if (r->active)
        return;
    r->prev = NULL;
    r->next = w->active;
    if (w->active != NULL)
        w->active->prev = r;
    w->active = r;
    r->active = true;
    w->n_active++;
}

static void active_remove(struct request *r)
{
    struct worker *w = r->w;
    if (!r->active)
        return;
    if (r->prev != NULL)
        r->prev->next = r->next;
    else
        w->active = r->next;
    if (r->next != NULL)
        r->next->prev = r->prev;
    r->prev = r->next = NULL;
    r->active = false;
    w->n_active--;
}

static void set_waiting(struct request *r, bool waiting)
{
    if (waiting && !r->counted_waiting) {
        atomic_fetch_add(&r->w->srv->n_waiting, 1);
        r->counted_waiting = true;
    } else if (!waiting && r->counted_waiting) {
        atomic_fetch_sub(&r->w->srv->n_waiting, 1);
        r->counted_waiting = false;
    }
}

/* The memory the process may use: its cgroup's limit (v2 memory.max, v1
 * memory.limit_in_bytes) or the machine's, whichever is smaller. 0: none
 * found. */
static uint64_t read_u64_file(const char *path)
{
    char buf[64];
    unsigned long long v = 0;
    FILE *f = fopen(path, "re");

    if (f == NULL)
        return 0;
    if (fgets(buf, sizeof(buf), f) == NULL || sscanf(buf, "%llu", &v) != 1)
        v = 0; /* "max" (v2: no limit) */
    fclose(f);
    return v;
}

static uint64_t memory_limit(void)
{
    uint64_t limit = 0;
    char line[512], path[640];
    FILE *f = fopen("/proc/meminfo", "re");
    unsigned long long kib;

    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, "MemTotal: %llu kB", &kib) == 1) {
            limit = (uint64_t)kib * 1024;
            break;
        }
    if (f != NULL)
        fclose(f);
    f = fopen("/proc/self/cgroup", "re");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        char *cg = strrchr(line, ':');
        uint64_t v = 0;
        if (cg == NULL)
            continue;
        cg[strcspn(cg, "\n")] = '\0';
        if (strncmp(line, "0::", 3) == 0)
            snprintf(path, sizeof(path), "/sys/fs/cgroup%s/memory.max", cg + 1);
        else if (strstr(line, ":memory:") != NULL)
            snprintf(path, sizeof(path), "/sys/fs/cgroup/memory%s/memory.limit_in_bytes", cg + 1);
        else
            continue;
        v = read_u64_file(path);
        if (v > 0 && (limit == 0 || v < limit))
            limit = v;
    }
    if (f != NULL)
        fclose(f);
    return limit;
}

/* server.max_buffered "auto": half the memory the process may use (the
 * rest: the store's pages, which count against a cgroup, allocator slack,
 * and answers arriving past the bound), at least 64 MiB and the largest
 * max_body, so every route's bodies can be admitted. */
static uint64_t max_buffered_auto(const struct config *cfg)
{
    uint64_t b = memory_limit() / 2;

    if (b < ((uint64_t)64 << 20))
        b = (uint64_t)64 << 20;
    for (size_t i = 0; i < cfg->n_routes; i++)
        if (cfg->routes[i].max_body_bytes > b)
            b = cfg->routes[i].max_body_bytes;
    return b;
}

/*
 * server.max_buffered: what the process's requests hold in memory (bodies,
 * upstream answers and their copies, replayed answers), counted per request
 * and given back when the request is freed (its answer has been sent by
 * then). Without force, false when n more would pass the bound: the caller
 * answers 503 out-of-memory before anything is forwarded. With force (an
 * answer whose action already ran) it is counted anyway, and new requests
 * wait for room.
 */
static bool budget_take(struct request *r, uint64_t n, bool force)
{
    struct proxy_server *srv = r->w->srv;
    uint64_t was = atomic_fetch_add(&srv->buffered, n);

    if (!force && was + n > srv->max_buffered) {
        atomic_fetch_sub(&srv->buffered, n);
        return false;
    }
    r->charged += n;
    return true;
}

/* Gives back n of what r took (budget_take()) before request_free(). */
static void budget_give(struct request *r, uint64_t n)
{
    atomic_fetch_sub(&r->w->srv->buffered, n);
    r->charged -= n;
}

/* Whether the process holds more than server.max_buffered now. */
static bool budget_over(const struct request *r)
{
    return atomic_load(&r->w->srv->buffered) > r->w->srv->max_buffered;
}

/*
 * An upstream's answer, sent to the client by libmicrohttpd straight from
 * the request's buffer, which the complete job also reads: the request and
 * the response each hold a reference, and the last one frees it. So the
 * answer is held once, not copied for libmicrohttpd (which can keep a
 * response a little past request_free(), until it closes the connection).
 */
struct shared_answer {
    atomic_uint refs;
    uint8_t *data;
};

static void shared_answer_put(void *cls)
{
    struct shared_answer *a = cls;

    if (a != NULL && atomic_fetch_sub(&a->refs, 1) == 1) {
        free(a->data);
        free(a);
    }
}

/* Lets the worker's kept answer go (its requests keep theirs). */
static void replay_ready_drop(struct worker *w)
{
    replay_ready_put(w->replay_ready);
    w->replay_ready = NULL;
}

/* Gives back the answer a request holds and has not queued. */
static void response_drop(struct request *r)
{
    if (r->response_ready != NULL)
        replay_ready_put(r->response_ready); /* r->response is its */
    else if (r->response != NULL)
        MHD_destroy_response(r->response);
    r->response_ready = NULL;
    r->response = NULL;
}

/* Takes the request's own answer out of it, to queue. Only the upstream's
 * answers are taken so: a replay never settles a record, and a kept replay
 * answer (response_ready) must go back through response_drop(), not be
 * queued as the request's own and destroyed by libmicrohttpd. */
static struct MHD_Response *response_take(struct request *r)
{
    struct MHD_Response *resp = r->response;

    assert(r->response_ready == NULL);
    r->response = NULL;
    return resp;
}

static void request_free(struct request *r)
{
    if (r == NULL)
        return;
    set_waiting(r, false);
    active_remove(r);
    if (r->slot != NULL && r->slot->req == r)
        r->slot->req = NULL;
    if (r->easy != NULL) {
        curl_multi_remove_handle(r->w->multi, r->easy);
        curl_easy_cleanup(r->easy);
    }
    if (r->ux != NULL)
        upstream_cancel(r->ux);
    curl_slist_free_all(r->curl_headers);
    idem_headers_clear(&r->headers);
    idem_headers_clear(&r->resp_headers);
    response_drop(r);
    store_record_clear(&r->job.op.replay);
    if (r->live_lease)
        writer_forget_lease(r->w->srv->writer, r->record_key, r->lease_id);
    r->w->n_requests--;
    if (r->charged > 0)
        atomic_fetch_sub(&r->w->srv->buffered, r->charged);
    free(r->store_headers);
    if (r->resp_shared != NULL)
        shared_answer_put(r->resp_shared); /* and resp_body with it, if last */
    else
        free(r->resp_body);
    free(r->body);
    free(r->scope);
    free(r->key);
    free(r->method);
    free(r->target);
    free(r);
}

static void maybe_free(struct request *r)
{
    if (r->mhd_done && !r->job_pending && !r->hb_pending)
        request_free(r);
}

/* ---- responses ---------------------------------------------------------- */

static struct MHD_Response *make_problem(int status, const char *slug, const char *title,
                                         const char *detail)
{
    size_t len = 0;
    char *body = idem_problem_json(status, slug, title, detail, &len);
    struct MHD_Response *resp;

    if (body == NULL)
        return NULL;
    resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (resp == NULL) {
        free(body);
        return NULL;
    }
    MHD_add_response_header(resp, "Content-Type", "application/problem+json");
    return resp;
}

/*
 * Settles a request with its answer. When the connection is suspended it is
 * resumed and the handler queues the response; when we are still inside the
 * handler's last call, the caller queues it on return.
 */
static void respond(struct request *r, struct MHD_Response *resp, int status,
                    const char *outcome)
{
    response_drop(r);
    r->response = resp;
    r->response_status = status;
    r->outcome = outcome;
    r->state = RS_RESPOND;
    set_waiting(r, false);
    active_remove(r);
    if (r->suspended) {
        r->suspended = false;
        MHD_resume_connection(r->conn);
        /* In external-epoll mode a resume does not wake MHD's epoll set:
         * the loop runs MHD at the end of this iteration. */
        r->w->mhd_pending = true;
    }
}

static void respond_problem(struct request *r, int status, const char *slug, const char *title,
                            const char *detail, const char *outcome, long retry_after,
                            bool close_conn)
{
    struct MHD_Response *resp = make_problem(status, slug, title, detail);
    r->problem = slug;
    if (resp != NULL) {
        if (retry_after > 0) {
            char ra[24];
            snprintf(ra, sizeof(ra), "%ld", retry_after);
            MHD_add_response_header(resp, "Retry-After", ra);
        }
        if (close_conn)
            MHD_add_response_header(resp, "Connection", "close");
    }
    respond(r, resp, status, outcome);
}

/* Out of memory before anything was forwarded: 503, a retry may fit. */
#define HOLD_FAILED "the proxy could not hold this request; nothing was forwarded"
#define BUDGET_FULL                                                                                \
    "the proxy holds server.max_buffered of request and response bodies; nothing was "             \
    "forwarded; retry"
#define BUDGET_REPLAY                                                                              \
    "the proxy holds server.max_buffered of request and response bodies; this key's stored "       \
    "answer was not sent; retry"
static void respond_oom(struct request *r, const char *detail, bool close_conn)
{
    respond_problem(r, 503, "out-of-memory", "Out of memory", detail, "unavailable", 1,
                    close_conn);
}

static void respond_unavailable(struct request *r, const char *detail)
{
    respond_problem(r, 503, "store-unavailable", "Store unavailable", detail, "unavailable", 1,
                    false);
}

/* 503 shutting-down: "try again later" (RFC 9110 section 15.6.4), like
 * every other 503 of the proxy, and the last answer on this connection. */
static struct MHD_Response *make_shutting_down(const char *detail)
{
    struct MHD_Response *resp = make_problem(503, "shutting-down", "Shutting down", detail);
    if (resp != NULL) {
        MHD_add_response_header(resp, "Retry-After", "1");
        MHD_add_response_header(resp, "Connection", "close");
    }
    return resp;
}

/* ---- lingering close ------------------------------------------------------ */

static void linger_close(struct worker *w, struct linger_sock *l)
{
    struct linger_sock **pp = &w->lingering;
    while (*pp != NULL && *pp != l)
        pp = &(*pp)->next;
    if (*pp == l) {
        *pp = l->next;
        w->n_lingering--;
    }
    close(l->fd); /* also drops its epoll registration: the only descriptor */
    free(l->out);
    free(l);
}

/* Writes what is left of the answer; once all of it is out, ends our side
 * (FIN after the answer) and stops watching for writability. Returns false
 * when the socket failed. */
static bool linger_flush(struct worker *w, struct linger_sock *l)
{
    while (l->out != NULL && l->out_off < l->out_len) {
        ssize_t n = send(l->fd, l->out + l->out_off, l->out_len - l->out_off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return true; /* EPOLLOUT brings us back */
        if (n <= 0)
            return false;
        l->out_off += (size_t)n;
    }
    if (l->out != NULL) {
        struct epoll_event ev = {0};
        free(l->out);
        l->out = NULL;
        shutdown(l->fd, SHUT_WR);
        ev.events = EPOLLIN | EPOLLRDHUP;
        ev.data.u64 = ep_data(EP_LINGER, l->fd);
        epoll_ctl(w->epfd, EPOLL_CTL_MOD, l->fd, &ev);
    }
    return true;
}

static void linger_event(struct worker *w, int fd, uint32_t events)
{
    struct linger_sock *l = w->lingering;
    char sink[16384];

    while (l != NULL && l->fd != fd)
        l = l->next;
    if (l == NULL)
        return;
    if (!linger_flush(w, l)) {
        linger_close(w, l);
        return;
    }
    if ((events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) == 0)
        return;
    for (;;) {
        ssize_t n = recv(fd, sink, sizeof(sink), 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (n <= 0) {
            /* The client closed (it has read the answer) or failed. */
            linger_close(w, l);
            return;
        }
        l->discarded += (size_t)n;
        if (l->discarded > LINGER_MAX_BYTES) {
            linger_close(w, l);
            return;
        }
    }
}

static void linger_expire(struct worker *w, int64_t now, bool all)
{
    struct linger_sock *l = w->lingering;
    while (l != NULL) {
        struct linger_sock *next = l->next;
        if (all || now >= l->deadline_ms)
            linger_close(w, l);
        l = next;
    }
}

/*
 * Answers a request whose body the proxy will not read to the end, on the
 * client socket itself, and lingers: libmicrohttpd 0.9.75 cannot queue an
 * answer while a body is being received, and the caller returns MHD_NO
 * right after, which makes libmicrohttpd close its descriptor. The answer
 * goes out on a dup of it, followed by a FIN; the rest of the body is read
 * and discarded until the client closes, or LINGER_MS or LINGER_MAX_BYTES
 * pass. Without a dup (out of descriptors or memory) the connection is
 * simply closed, as before.
 */
static void reject_lingering(struct request *r, int status, const char *reason,
                             const char *slug, const char *title, const char *detail)
{
    struct worker *w = r->w;
    const union MHD_ConnectionInfo *ci;
    struct linger_sock *l = NULL;
    struct epoll_event ev = {0};
    char head[256];
    char date[64];
    char *body = NULL;
    size_t body_len = 0;
    int head_len;
    int fd = -1;
    time_t t = time(NULL);
    struct tm tm;

    r->response_status = status;
    r->outcome = "rejected";
    r->problem = slug;
    r->state = RS_DONE;
    ci = MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci == NULL)
        goto out;
    gmtime_r(&t, &tm);
    strftime(date, sizeof(date), "%a, %d %b %Y %H:%M:%S GMT", &tm);
    body = idem_problem_json(status, slug, title, detail, &body_len);
    if (body == NULL)
        goto out;
    head_len = snprintf(head, sizeof(head),
                        "HTTP/1.1 %d %s\r\nDate: %s\r\nConnection: close\r\n"
                        "Content-Type: application/problem+json\r\nContent-Length: %zu\r\n\r\n",
                        status, reason, date, body_len);
    if (head_len <= 0 || (size_t)head_len >= sizeof(head))
        goto out;
    l = calloc(1, sizeof(*l));
    if (l == NULL)
        goto out;
    l->out = malloc((size_t)head_len + body_len);
    if (l->out == NULL)
        goto out;
    memcpy(l->out, head, (size_t)head_len);
    memcpy(l->out + head_len, body, body_len);
    l->out_len = (size_t)head_len + body_len;
    fd = fcntl(ci->connect_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        goto out;
    l->fd = fd;
    l->deadline_ms = idem_mono_ms() + LINGER_MS;
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP;
    ev.data.u64 = ep_data(EP_LINGER, fd);
    if (w->n_lingering >= LINGER_MAX_SOCKS || epoll_ctl(w->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        /* No room to linger: answer what the socket takes now, then close. */
        l->next = NULL;
        linger_flush(w, l);
        goto out;
    }
    l->next = w->lingering;
    w->lingering = l;
    w->n_lingering++;
    if (!linger_flush(w, l))
        linger_close(w, l);
    l = NULL;
    fd = -1;
out:
    if (l != NULL) {
        free(l->out);
        free(l);
    }
    if (fd >= 0)
        close(fd);
    free(body);
}

/*
 * libmicrohttpd 0.9.75 keeps a request's whole header block in the
 * connection's pool until the answer is sent, allocates a 56-byte entry
 * (64 with the pool's alignment) for every header, every query argument
 * and every cookie, and copies the first Cookie header to split it
 * (connection.c, parse_cookie_header). The answer's header block is then
 * written into what is left. If it does not fit, the connection is closed
 * unanswered, and a stored answer would replay as a drop too. So the
 * request side is capped at header_memory (431 past it, counting all of
 * the above), the answer's header block at half of it (502 past it), and
 * the pool holds both plus POOL_ANSWER_MARGIN for what libmicrohttpd adds
 * (status line, Date, Content-Length, Connection, Idempotent-Replayed).
 */
#define POOL_ENTRY_BYTES 64
#define POOL_ANSWER_MARGIN 2048

static size_t response_header_max(const struct config *cfg)
{
    return cfg->server.header_memory_bytes / 2;
}

static size_t count_char(const char *s, size_t len, char c)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        n += s[i] == c;
    return n;
}

static size_t request_pool_bytes(const struct request *r, const char *method, const char *version)
{
    size_t entries = r->headers.n;
    size_t bytes = strlen(method) + r->target_len + strlen(version) + 4 + r->head_bytes + 2;
    const struct idem_header *cookie = idem_headers_find(&r->headers, "Cookie");

    if (r->path_len < r->target_len) {
        const char *q = r->target + r->path_len + 1;
        entries += 1 + count_char(q, r->target_len - r->path_len - 1, '&');
    }
    if (cookie != NULL) {
        entries += 1 + count_char(cookie->value, cookie->value_len, ';') +
                   count_char(cookie->value, cookie->value_len, ',');
        bytes += cookie->value_len + 16;
    }
    return bytes + entries * POOL_ENTRY_BYTES;
}

/* The header block of an answer as libmicrohttpd will write it, without
 * what it adds itself (POOL_ANSWER_MARGIN). */
static size_t answer_header_bytes(const struct idem_headers *h)
{
    return h->bytes + 4 * h->n;
}

/* libmicrohttpd 0.9.75 refuses a header with an empty value; written as
 * one space ("X-Empty:  ") it reaches the client as the empty value it is
 * (the white space around a value is not part of it). */
static void add_field(struct MHD_Response *resp, const char *name, const char *value)
{
    MHD_add_response_header(resp, name, value[0] != '\0' ? value : " ");
}

static void add_headers(struct MHD_Response *resp, const struct idem_headers *h)
{
    for (size_t i = 0; i < h->n; i++)
        add_field(resp, h->v[i].name, h->v[i].value);
}

/* Whether an answer whose header block takes header_bytes fits next to
 * r's head in libmicrohttpd's pool; answers 431 when it does not. */
static bool replay_header_room(struct request *r, size_t header_bytes)
{
    /* A record stored before the answer's header block was capped at
     * response_header_max() may not fit next to a large request: say so
     * rather than drop the connection. A retry with smaller headers gets
     * the replay. */
    if (r->pool_bytes + header_bytes <=
        r->w->srv->cfg->server.header_memory_bytes + response_header_max(r->w->srv->cfg))
        return true;
    respond_problem(r, 431, "headers-too-large", "Request header fields too large",
                    "this key's stored answer has too large a header block to be sent "
                    "with this request's headers; retry with fewer or smaller headers",
                    "rejected", 0, false);
    return false;
}

/* Replays the answer the worker keeps (struct replay_ready), whose
 * reference rr is taken over. */
static void respond_ready(struct request *r, struct replay_ready *rr)
{
    if (!replay_header_room(r, rr->header_bytes)) {
        replay_ready_put(rr);
        return;
    }
    rr->used = true;
    respond(r, rr->resp, rr->status, "replayed");
    r->response_ready = rr;
}

/* Keeps resp, a replay answer holding a reference to body (its body's
 * shared copy), as the worker's ready answer in place of the one before;
 * r is answered with it. False when it is not kept (a body over
 * REPLAY_READY_MAX_BODY, or no memory for the bookkeeping): r is not
 * answered then. */
static bool keep_ready(struct request *r, struct MHD_Response *resp,
                       const struct replay_body *body, int status, size_t header_bytes)
{
    struct worker *w = r->w;
    struct replay_ready *rr;

    if (replay_body_len(body) > REPLAY_READY_MAX_BODY)
        return false;
    rr = calloc(1, sizeof(*rr));
    if (rr == NULL)
        return false;
    rr->resp = resp;
    rr->body = body;
    rr->status = status;
    rr->header_bytes = header_bytes;
    rr->refs = 1;
    replay_ready_drop(w);
    w->replay_ready = rr;
    respond_ready(r, replay_ready_ref(rr));
    return true;
}

/* Replays a COMPLETE record: its status and headers from rec, its body
 * from body, a reference to the shared copy (replay_share.h) that the
 * response takes over (NULL: an empty body). */
static void respond_replay(struct request *r, const struct store_record *rec,
                           struct replay_body *body)
{
    struct idem_headers h = {0};
    struct MHD_Response *resp = NULL;
    const struct replay_body *held = body;
    int drc = idem_headers_decode(rec->headers, rec->headers_len, &h);

    if (drc == -2) {
        /* Not the record's fault: an operator told "corrupt" might delete
         * a good answer. */
        respond_oom(r, "the proxy ran out of memory reading this key's stored answer; retry",
                    false);
        goto out;
    }
    if (drc != 0) {
        respond_problem(r, 500, "corrupt-record", "Stored response unreadable",
                        "the stored response for this key could not be decoded", "error", 0,
                        false);
        goto out;
    }
    if (!replay_header_room(r, answer_header_bytes(&h)))
        goto out;
    if (body != NULL) {
        /* The response holds the reference until libmicrohttpd has sent
         * it (and frees it with the response); the bytes are never
         * written. */
        resp = MHD_create_response_from_buffer_with_free_callback_cls(
            replay_body_len(body), (void *)replay_body_data(body), replay_body_put, body);
        if (resp != NULL)
            body = NULL;
    } else {
        resp = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    }
    if (resp != NULL) {
        add_headers(resp, &h);
        MHD_add_response_header(resp, "Idempotent-Replayed", "true");
        if (held != NULL && body == NULL &&
            keep_ready(r, resp, held, rec->status, answer_header_bytes(&h)))
            goto out;
    }
    respond(r, resp, rec->status, "replayed");
out:
    replay_body_put(body);
    idem_headers_clear(&h);
}

/* Takes a reference to the shared copy of the body of rec, a writer's
 * copy of the record, which becomes the shared one unless a replay of this
 * record holds one already. False when the request was answered instead:
 * 503 out-of-memory, the copy did not fit in server.max_buffered. */
static bool replay_body_adopt(struct request *r, struct store_record *rec, struct replay_body **out)
{
    int rc = REPLAY_SHARE_OK;

    *out = NULL;
    if (rec->body_len > 0)
        rc = replay_share_adopt(r->w->srv->shares, r->record_key, rec, out);
    if (rc == REPLAY_SHARE_FULL)
        respond_oom(r, BUDGET_REPLAY, false);
    else if (rc != REPLAY_SHARE_OK)
        respond_oom(r, "the proxy ran out of memory reading this key's stored answer; retry",
                    false);
    return rc == REPLAY_SHARE_OK;
}

static void suspend(struct request *r)
{
    active_add(r);
    if (!r->suspended) {
        r->suspended = true;
        MHD_suspend_connection(r->conn);
    }
}

/* ---- writer jobs --------------------------------------------------------- */

static void submit(struct request *r, struct writer_job *job)
{
    job->owner = r;
    r->w->n_jobs++;
    if (job == &r->hb_job)
        r->hb_pending = true;
    else
        r->job_pending = true;
    writer_submit(r->w->srv->writer, job);
}

static void submit_acquire(struct request *r)
{
    struct writer_job *j = &r->job;
    store_record_clear(&j->op.replay);
    memset(&j->op, 0, sizeof(j->op));
    j->op.kind = STORE_OP_ACQUIRE;
    memcpy(j->op.key, r->record_key, STORE_KEY_BYTES);
    /* lookup() decided ACQUIRE, which made the canonical fingerprint. */
    memcpy(j->op.fingerprint, r->fp.canonical, STORE_FINGERPRINT_BYTES);
    j->op.has_raw_fingerprint = true;
    memcpy(j->op.raw_fingerprint, r->fp.raw, STORE_FINGERPRINT_BYTES);
    j->op.lease_ms = r->route->lease_ms;
    j->op.ttl_ms = r->route->ttl_ms;
    j->op.want_replay = true;
    r->state = RS_ACQUIRING;
    submit(r, j);
}

static void submit_settle(struct request *r, enum store_op_kind kind, int status)
{
    struct writer_job *j = &r->job;
    memset(&j->op, 0, sizeof(j->op));
    j->op.kind = kind;
    memcpy(j->op.key, r->record_key, STORE_KEY_BYTES);
    memcpy(j->op.lease_id, r->lease_id, STORE_LEASE_ID_BYTES);
    if (kind == STORE_OP_COMPLETE) {
        j->op.ttl_ms = r->route->ttl_ms;
        j->op.status = status;
        j->op.headers.ptr = r->store_headers;
        j->op.headers.len = r->store_headers_len;
        j->op.body.ptr = r->resp_body;
        j->op.body.len = r->resp_len;
        /* LMDB writes the record into dirty pages it allocates (no
         * MDB_WRITEMAP), a second copy of the answer until the commit:
         * counted (never refused: the action ran) until the job is back. */
        r->store_charged = (uint64_t)r->resp_len + r->store_headers_len;
        budget_take(r, r->store_charged, true);
    } else if (kind == STORE_OP_EXTEND) {
        j->op.lease_ms = r->route->ttl_ms; /* the record is held until its TTL */
        j->op.hold = true;
    }
    r->state = RS_FINISHING;
    submit(r, j);
}

/* Runs on the writer thread: hand each job to its worker, one wake-up per
 * worker, and tell every worker about settled keys when anyone waits. */
static void deliver(struct writer_job **jobs, size_t n, void *ctx)
{
    struct proxy_server *srv = ctx;
    bool touched[256] = {false};
    bool broadcast = atomic_load(&srv->n_waiting) > 0;

    for (size_t i = 0; i < n; i++) {
        struct request *r = jobs[i]->owner;
        struct worker *w = r->w;
        /* Read the job before handing it over: the job lives in its
         * request, and once it is in the inbox the worker may run it,
         * answer, and free the request before this loop goes on
         * (tests/faults/test_deliver_race.py). */
        bool settled = broadcast && jobs[i]->error == 0 && jobs[i]->op.outcome == STORE_DONE &&
                       (jobs[i]->op.kind == STORE_OP_COMPLETE ||
                        jobs[i]->op.kind == STORE_OP_RELEASE ||
                        (jobs[i]->op.kind == STORE_OP_EXTEND && jobs[i]->op.hold));
        uint8_t key[STORE_KEY_BYTES];

        memcpy(key, jobs[i]->op.key, STORE_KEY_BYTES);
        pthread_mutex_lock(&w->inbox_lock);
        jobs[i]->next = w->inbox_jobs;
        w->inbox_jobs = jobs[i];
        pthread_mutex_unlock(&w->inbox_lock);
        idem_fault_deliver_pause(w->evfd);
        touched[w->index] = true;
        if (settled) {
            for (unsigned k = 0; k < srv->n_workers; k++) {
                struct inbox_key *m = malloc(sizeof(*m));
                if (m == NULL)
                    continue; /* the waiter's poll finds it instead */
                memcpy(m->key, key, STORE_KEY_BYTES);
                pthread_mutex_lock(&srv->workers[k].inbox_lock);
                m->next = srv->workers[k].inbox_keys;
                srv->workers[k].inbox_keys = m;
                pthread_mutex_unlock(&srv->workers[k].inbox_lock);
                touched[k] = true;
            }
        }
    }
    for (unsigned k = 0; k < srv->n_workers; k++) {
        if (touched[k]) {
            uint64_t one = 1;
            ssize_t rc = write(srv->workers[k].evfd, &one, sizeof(one));
            (void)rc; /* a full eventfd counter already means "wake" */
        }
    }
}

/* ---- upstream (libcurl) ---------------------------------------------- */

static bool ieq_trim(const char *v, const char *word);

static size_t on_upstream_header(char *buf, size_t size, size_t nitems, void *userdata)
{
    struct request *r = userdata;
    size_t len = size * nitems;
    size_t n = len;
    struct idem_field_line f;

    while (n > 0 && (buf[n - 1] == '\r' || buf[n - 1] == '\n'))
        n--;
    if (n >= 5 && strncmp(buf, "HTTP/", 5) == 0 && !r->resp_head_done) {
        /* A new status line (after a 1xx): start the header list again. */
        idem_headers_clear(&r->resp_headers);
        return len;
    }
    if (n == 0) {
        /* The end of a header section: a 1xx's, after which a status line
         * follows, or the final answer's. */
        long code = 0;
        curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &code);
        r->resp_head_done = code >= 200;
        return len;
    }
    /* libcurl hands a chunked answer's trailer fields to this callback
     * too. They must not be merged into the header section (RFC 9110
     * 6.5.1): a trailer "Content-Type" would be a second one, a trailer
     * "Connection: X-Id" would remove a real header. Dropped. */
    if (r->resp_head_done)
        return len;
    switch (idem_field_line_split(buf, n, &f)) {
    case IDEM_FIELD_FOLD:
        if (r->resp_headers.n == 0)
            return len;
        {
            /* libcurl framed the answer on the field's first line alone
             * ("Transfer-Encoding: chunked" folded with ", gzip": gzip bytes
             * de-chunked and taken for the body); the folded value is the
             * field's (RFC 9112 section 5.2), so the framing is unknown. */
            const struct idem_header *last = &r->resp_headers.v[r->resp_headers.n - 1];
            if (strcasecmp(last->name, "Content-Length") == 0 ||
                strcasecmp(last->name, "Transfer-Encoding") == 0) {
                r->resp_bad_framing = true;
                return 0;
            }
        }
        if (answer_header_bytes(&r->resp_headers) + 1 + f.value_len >
            response_header_max(r->w->srv->cfg)) {
            r->resp_too_large = true;
            r->resp_headers_too_large = true;
            return 0;
        }
        if (idem_headers_extend_last(&r->resp_headers, f.value, f.value_len) != 0) {
            r->upstream_no_memory = true;
            return 0;
        }
        return len;
    case IDEM_FIELD_SKIP:
    case IDEM_FIELD_BAD: /* libcurl itself fails the transfer on such a line */
        return len;
    case IDEM_FIELD:
        break;
    }
    {
        size_t name_len = f.name_len;
        /* The client's answer must fit libmicrohttpd's per-connection pool
         * next to the request (response_header_max), or the connection would
         * be dropped unanswered, and a stored record would replay as a drop
         * too. A larger header block is refused like an oversized body (nginx
         * answers 502 "upstream sent too big header" past 4-8 KiB). */
        if (answer_header_bytes(&r->resp_headers) + 4 + n > response_header_max(r->w->srv->cfg)) {
            r->resp_too_large = true;
            r->resp_headers_too_large = true;
            return 0;
        }
        if (idem_headers_push(&r->resp_headers, f.name, name_len, f.value, f.value_len) != 0) {
            r->upstream_no_memory = true;
            return 0;
        }
        /* Ambiguous response framing (RFC 9112 section 6.3): two differing
         * Content-Lengths, or Content-Length with Transfer-Encoding. libcurl
         * picks one reading; the outcome is unknown, not a response. So is
         * a Transfer-Encoding other than one "chunked", as the native
         * client holds: the field is dropped (hop by hop), and libcurl
         * 7.88 answered "gzip, chunked" with an empty body, a 201 stored. */
        if ((name_len == 14 && strncasecmp(buf, "Content-Length", 14) == 0) ||
            (name_len == 17 && strncasecmp(buf, "Transfer-Encoding", 17) == 0)) {
            const struct idem_header *cl = idem_headers_find(&r->resp_headers, "Content-Length");
            const struct idem_header *te = idem_headers_find(&r->resp_headers, "Transfer-Encoding");
            bool differ = false;
            for (size_t i = 0; cl != NULL && i < r->resp_headers.n; i++) {
                const struct idem_header *h = &r->resp_headers.v[i];
                if (strcasecmp(h->name, "Content-Length") == 0 && strcmp(h->value, cl->value) != 0)
                    differ = true;
            }
            if (te != NULL && (!ieq_trim(te->value, "chunked") ||
                               idem_headers_count(&r->resp_headers, "Transfer-Encoding") > 1))
                differ = true;
            if (differ || (te != NULL && cl != NULL)) {
                r->resp_bad_framing = true;
                return 0;
            }
        }
    }
    return len;
}

static size_t on_upstream_body(char *ptr, size_t size, size_t nmemb, void *userdata)
{
    struct request *r = userdata;
    size_t len = size * nmemb;
    uint64_t cap = r->w->srv->cfg->upstream.max_response_bytes;

    if ((uint64_t)r->resp_len + len > cap) {
        r->resp_too_large = true;
        return 0;
    }
    if (r->resp_len + len > r->resp_cap) {
        size_t ncap = r->resp_cap ? r->resp_cap : 4096;
        curl_off_t length = -1;
        uint8_t *nb;
        while (ncap < r->resp_len + len)
            ncap *= 2;
        /* With a Content-Length, a buffer of exactly that much (as the
         * native client's): what is held and counted is the answer, not the
         * power of two above it. */
        if (r->resp_cap == 0 &&
            curl_easy_getinfo(r->easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length) == CURLE_OK &&
            length >= (curl_off_t)(r->resp_len + len) && (uint64_t)length <= cap)
            ncap = (size_t)length;
        nb = realloc(r->resp_body, ncap);
        if (nb == NULL) {
            r->upstream_no_memory = true; /* libcurl says only "write error" */
            return 0;
        }
        /* The action ran: counted, never refused (budget_take()). */
        budget_take(r, ncap - r->resp_cap, true);
        r->resp_body = nb;
        r->resp_cap = ncap;
    }
    memcpy(r->resp_body + r->resp_len, ptr, len);
    r->resp_len += len;
    return len;
}

static int curl_close_cb(void *clientp, curl_socket_t s);

/* A new easy handle for every transfer: libcurl 7.88 (Debian 12) keeps a
 * pointer to the previous transfer's last response header in the handle
 * (for unfolding an obs-fold continuation) after freeing that header, and
 * curl_easy_reset() does not clear it. A reused handle whose next response
 * starts its first field line with white space then reads freed memory
 * (curl issue #11620; found by tests/adversarial/test_response_fuzz.py): an
 * upstream's malformed answer could crash the proxy. A fresh handle has no
 * such pointer, and libcurl refuses that answer (502). The connection cache
 * lives in the multi handle, so connections are still reused. */
static CURL *easy_get(struct worker *w)
{
    (void)w;
    return curl_easy_init();
}

/* Frees a finished transfer's handle (removed from the multi handle). */
static void easy_put(struct worker *w, CURL *e)
{
    (void)w;
    curl_easy_cleanup(e);
}

/* RFC 9110 section 9.2.2: a retry of these cannot change the outcome. */
static bool method_is_idempotent(const char *m)
{
    static const char *const idem[] = {"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"};
    for (size_t i = 0; i < sizeof(idem) / sizeof(idem[0]); i++)
        if (strcmp(m, idem[i]) == 0)
            return true;
    return false;
}

/*
 * libcurl silently resends a request on a fresh connection when a reused
 * one dies before any response byte, POST included. The first send may well
 * have run the action, so a keyed request, and any request whose method is
 * not idempotent (an unkeyed POST on a pass-through route), must never be
 * sent twice: the second call of this hook for one transfer aborts it, and
 * the exchange counts as an unknown outcome (upstream-broken, 502; for a
 * keyed request on_unknown decides). nginx does the same by default
 * (proxy_next_upstream leaves non-idempotent requests alone). Idempotent
 * unkeyed requests keep libcurl's resend.
 */
static int on_upstream_prereq(void *clientp, char *conn_primary_ip, char *conn_local_ip,
                              int conn_primary_port, int conn_local_port)
{
    struct request *r = clientp;
    (void)conn_primary_ip;
    (void)conn_local_ip;
    (void)conn_primary_port;
    (void)conn_local_port;
    r->sends++;
    if (r->sends > 1 && (r->keyed || !method_is_idempotent(r->method))) {
        r->resend_blocked = true;
        return CURL_PREREQFUNC_ABORT;
    }
    return CURL_PREREQFUNC_OK;
}

/* The native client (upstream.h): the same request libcurl wrote. */
static int start_native(struct request *r, const struct idem_headers *fwd)
{
    bool get = strcmp(r->method, "GET") == 0;
    bool head = strcmp(r->method, "HEAD") == 0;
    struct upstream_request req = {
        .method = r->method,
        .target = r->target,
        .target_len = r->target_len,
        .headers = fwd,
        /* libcurl sent no body with HEAD (CURLOPT_NOBODY), and a
         * Content-Length with any body, and with POST, PUT and PATCH
         * always, even 0. */
        .body = head ? NULL : r->body,
        .body_len = head ? 0 : r->body_len,
        .send_length = !head && !(get && r->body_len == 0) &&
                       (r->body_len > 0 || strcmp(r->method, "POST") == 0 ||
                        strcmp(r->method, "PUT") == 0 || strcmp(r->method, "PATCH") == 0),
        /* See on_upstream_prereq(): only an idempotent unkeyed request may
         * be sent a second time. */
        .may_retry = !r->keyed && method_is_idempotent(r->method),
    };
    int rc = upstream_start(r->w->pool, &req, r, &r->ux);

    if (rc == 0) {
        r->upstream_start_ms = idem_mono_ms();
        r->state = RS_UPSTREAM;
        if (r->keyed)
            r->next_hb_ms = idem_mono_ms() + r->route->heartbeat_ms;
    }
    return rc == 0 ? 0 : -ENOMEM; /* upstream_start fails only for memory */
}

/* What the client is told when start_upstream() failed (nothing was sent):
 * the proxy's own want of memory is a 503 a retry may get past, a header
 * the forwarding rules refuse is the client's 400, anything else 502. */
struct start_failure {
    int status;
    const char *slug, *title, *detail;
    long retry_after;
};

static struct start_failure start_failure_of(int rc)
{
    if (rc == -ENOMEM)
        return (struct start_failure){503, "out-of-memory", "Out of memory",
                                      "the proxy ran out of memory forwarding this request; "
                                      "nothing was sent",
                                      1};
    if (rc == -EINVAL)
        return (struct start_failure){400, "bad-request", "Bad request",
                                      "a request header cannot be forwarded; nothing was sent", 0};
    return (struct start_failure){502, "upstream-request-failed", "Upstream request failed",
                                  "the request could not be forwarded", 0};
}

/* The client's address as text (X-Forwarded-For; "" when unknown), made
 * once per connection (made for each request, it was 1.4 % of a
 * pass-through GET's CPU). buf (INET6_ADDRSTRLEN) is used when the
 * connection's slot is gone. */
static const char *client_addr_text(struct request *r, char *buf)
{
    const union MHD_ConnectionInfo *ci;
    char *addr = r->slot != NULL ? r->slot->addr : buf;

    if (r->slot != NULL && r->slot->addr_done)
        return addr;
    addr[0] = '\0';
    ci = MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ci != NULL && ci->client_addr != NULL) {
        const struct sockaddr *sa = ci->client_addr;
        if (sa->sa_family == AF_INET)
            inet_ntop(AF_INET, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, addr,
                      INET6_ADDRSTRLEN);
        else if (sa->sa_family == AF_INET6)
            inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr,
                      addr, INET6_ADDRSTRLEN);
    }
    if (r->slot != NULL)
        r->slot->addr_done = true;
    return addr;
}

static int start_upstream(struct request *r)
{
    const struct config *cfg = r->w->srv->cfg;
    struct idem_headers fwd = {0};
    struct idem_forward_info info = {.client_addr = "", .proto = "http"};
    char addr[INET6_ADDRSTRLEN];
    char *url = NULL;
    size_t base_len = strlen(r->w->srv->upstream_base);
    int rc = -ENOMEM; /* every step below fails only for memory, but two */
    CURL *e = NULL;

    info.client_addr = client_addr_text(r, addr);
    rc = idem_filter_request_headers(&r->headers, &info, &fwd);
    if (rc != 0) {
        rc = rc == -1 ? -EINVAL : -ENOMEM;
        goto out;
    }
    rc = -ENOMEM;
    if (r->w->pool != NULL) {
        rc = start_native(r, &fwd);
        goto out;
    }
    for (size_t i = 0; i < fwd.n; i++) {
        const struct idem_header *h = &fwd.v[i];
        size_t l = h->name_len + h->value_len + 3;
        char small[512];
        char *line = l <= sizeof(small) ? small : malloc(l);
        struct curl_slist *nl;
        if (line == NULL)
            goto out;
        /* "Name;" is curl's spelling of a header with an empty value;
         * curl_slist_append copies the line. */
        memcpy(line, h->name, h->name_len);
        if (h->value_len == 0) {
            memcpy(line + h->name_len, ";", 2);
        } else {
            memcpy(line + h->name_len, ": ", 2);
            memcpy(line + h->name_len + 2, h->value, h->value_len + 1);
        }
        nl = curl_slist_append(r->curl_headers, line);
        if (line != small)
            free(line);
        if (nl == NULL)
            goto out;
        r->curl_headers = nl;
    }
    /* Never let curl invent request headers the client did not send. */
    {
        static const char *const suppress[] = {"Expect:", "Accept:", "Content-Type:"};
        static const char *const names[] = {NULL, "Accept", "Content-Type"};
        for (size_t i = 0; i < 3; i++) {
            struct curl_slist *nl;
            if (names[i] != NULL && idem_headers_find(&fwd, names[i]) != NULL)
                continue;
            nl = curl_slist_append(r->curl_headers, suppress[i]);
            if (nl == NULL)
                goto out;
            r->curl_headers = nl;
        }
    }
    url = malloc(base_len + r->target_len + 1);
    if (url == NULL)
        goto out;
    memcpy(url, r->w->srv->upstream_base, base_len);
    memcpy(url + base_len, r->target, r->target_len);
    url[base_len + r->target_len] = '\0';

    e = easy_get(r->w);
    if (e == NULL)
        goto out;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROXY, "");
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, CURL_HTTP_VERSION_1_1);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)cfg->upstream.connect_timeout_ms);
    /* The same freshness as the native client's resolver. */
    curl_easy_setopt(e, CURLOPT_DNS_CACHE_TIMEOUT,
                     (long)((cfg->upstream.resolve_interval_ms + 999) / 1000));
    /* libcurl matches pooled connections by host name, not address: one
     * opened before the name moved would be used for good. Renewed once
     * they are a resolve interval old, connections follow a moved name (the
     * native client closes those of a replaced resolution instead). A
     * literal address cannot move. */
    if (!r->w->srv->upstream_literal)
        curl_easy_setopt(e, CURLOPT_MAXLIFETIME_CONN,
                         (long)((cfg->upstream.resolve_interval_ms + 999) / 1000));
    /* Whole seconds. libcurl 7.88 reuses a connection while its idle
     * seconds, rounded down, do not exceed this, newer ones while its idle
     * milliseconds do not exceed this x 1000 (and take 0 as no limit): with
     * idle_timeout at least 2s (config.c), one second less than its whole
     * seconds keeps every reuse under it with both. */
    curl_easy_setopt(e, CURLOPT_MAXAGE_CONN, (long)(cfg->upstream.idle_timeout_ms / 1000 - 1));
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)cfg->upstream.timeout_ms);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, r->curl_headers);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_upstream_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_upstream_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(e, CURLOPT_PRIVATE, r);
    curl_easy_setopt(e, CURLOPT_PREREQFUNCTION, on_upstream_prereq);
    curl_easy_setopt(e, CURLOPT_CLOSESOCKETFUNCTION, curl_close_cb);
    curl_easy_setopt(e, CURLOPT_CLOSESOCKETDATA, r->w);
    curl_easy_setopt(e, CURLOPT_PREREQDATA, r);
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http");
    curl_easy_setopt(e, CURLOPT_PATH_AS_IS, 1L);
    if (strcmp(r->method, "GET") == 0 && r->body_len == 0) {
        curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
    } else if (strcmp(r->method, "HEAD") == 0) {
        curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    } else {
        curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, r->method);
        if (r->body_len > 0 || strcmp(r->method, "POST") == 0 ||
            strcmp(r->method, "PUT") == 0 || strcmp(r->method, "PATCH") == 0) {
            curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)r->body_len);
            curl_easy_setopt(e, CURLOPT_POSTFIELDS, r->body_len ? (char *)r->body : "");
        }
    }
    {
        CURLMcode mrc = curl_multi_add_handle(r->w->multi, e);
        if (mrc != CURLM_OK) {
            curl_easy_cleanup(e);
            e = NULL;
            rc = mrc == CURLM_OUT_OF_MEMORY ? -ENOMEM : -1;
            goto out;
        }
    }
    r->easy = e;
    e = NULL;
    r->upstream_start_ms = idem_mono_ms();
    r->state = RS_UPSTREAM;
    if (r->keyed)
        r->next_hb_ms = idem_mono_ms() + r->route->heartbeat_ms;
    rc = 0;
out:
    free(url);
    idem_headers_clear(&fwd);
    return rc;
}

static enum idem_upstream_result classify(struct request *r, CURLcode code)
{
    curl_off_t sent = 0;
    long req_size = 0;

    if (code == CURLE_OK)
        return IDEM_UPSTREAM_RESPONSE;
    if (r->resp_too_large)
        return IDEM_UPSTREAM_TOO_LARGE;
    if (r->resend_blocked || r->resp_bad_framing)
        return IDEM_UPSTREAM_BROKEN;
    curl_easy_getinfo(r->easy, CURLINFO_REQUEST_SIZE, &req_size);
    (void)sent;
    switch (code) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
        return IDEM_UPSTREAM_NOT_SENT;
    case CURLE_OPERATION_TIMEDOUT:
        return req_size == 0 ? IDEM_UPSTREAM_NOT_SENT : IDEM_UPSTREAM_TIMEOUT;
    default:
        return req_size == 0 ? IDEM_UPSTREAM_NOT_SENT : IDEM_UPSTREAM_BROKEN;
    }
}

static int add_mhd_header(const struct idem_header *h, void *ctx)
{
    add_field(ctx, h->name, h->value);
    return 0;
}

/* The client's copy of the upstream's answer. The headers are filtered
 * straight into the response: no allocation of ours can drop them. */
static ssize_t no_body(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)cls;
    (void)pos;
    (void)buf;
    (void)max;
    return MHD_CONTENT_READER_END_OF_STREAM;
}

/* The upstream's Content-Length of an answer that has no body by
 * definition (to HEAD, or a 304): it states the size a GET would get (RFC
 * 9110 8.6, 9.3.2). -1 for any other answer. */
static int64_t bodiless_content_length(const struct request *r)
{
    const struct idem_header *cl;
    uint64_t v = 0;

    if (r->resp_len != 0 || (strcmp(r->method, "HEAD") != 0 && r->resp_status != 304))
        return -1;
    cl = idem_headers_find(&r->resp_headers, "Content-Length");
    if (cl == NULL || cl->value_len == 0 || cl->value_len > 18)
        return -1;
    for (size_t i = 0; i < cl->value_len; i++) {
        if (cl->value[i] < '0' || cl->value[i] > '9')
            return -1;
        v = v * 10 + (uint64_t)(cl->value[i] - '0');
    }
    return (int64_t)v;
}

static struct MHD_Response *response_from_upstream(struct request *r)
{
    struct MHD_Response *resp;
    int64_t size = bodiless_content_length(r);
    struct shared_answer *a = NULL;

    /* libmicrohttpd writes Content-Length from the response's size and
     * sends no body to HEAD or with a 304, so a size without a body is how
     * the upstream's value gets through (it wrote 0 before). */
    if (size < 0 && r->resp_len > 0)
        a = malloc(sizeof(*a));
    if (size >= 0) {
        resp = MHD_create_response_from_callback((uint64_t)size, 4096, no_body, NULL, NULL);
    } else if (a != NULL) {
        atomic_init(&a->refs, 2); /* the request's and the response's */
        a->data = r->resp_body;
        resp = MHD_create_response_from_buffer_with_free_callback_cls(r->resp_len, r->resp_body,
                                                                      shared_answer_put, a);
        if (resp == NULL)
            free(a);
        else
            r->resp_shared = a;
    } else {
        /* An empty body, or no memory to share it: libmicrohttpd's copy,
         * counted until the answer is sent. */
        resp = MHD_create_response_from_buffer(r->resp_len,
                                               r->resp_len ? r->resp_body : (void *)"",
                                               MHD_RESPMEM_MUST_COPY);
        if (resp != NULL)
            budget_take(r, r->resp_len, true);
    }
    if (resp == NULL)
        return NULL;
    idem_response_headers_each(&r->resp_headers, NULL, add_mhd_header, resp);
    return resp;
}

/* Prepares the stored payload (headers blob) for a complete. */
static int prepare_store_payload(struct request *r, const struct idem_headers *src)
{
    struct idem_headers h = {0};
    int rc = idem_filter_response_headers(src, r->route, &h);
    if (rc == 0)
        rc = idem_headers_encode(&h, &r->store_headers, &r->store_headers_len);
    idem_headers_clear(&h);
    return rc;
}

static void upstream_finish(struct request *r, enum idem_upstream_result res, long status);

static void upstream_done(struct request *r, CURLcode code)
{
    enum idem_upstream_result res = classify(r, code);
    long status = 0;

    /* Our own callbacks' failed allocations reach here as
     * CURLE_WRITE_ERROR; they set the flag themselves. */
    if (code == CURLE_OUT_OF_MEMORY)
        r->upstream_no_memory = true;

    if (res == IDEM_UPSTREAM_RESPONSE) {
        curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &status);
        if (status < 100 || status > 599) {
            res = IDEM_UPSTREAM_BROKEN;
            status = 0;
        }
    }
    curl_multi_remove_handle(r->w->multi, r->easy);
    easy_put(r->w, r->easy);
    r->easy = NULL;
    curl_slist_free_all(r->curl_headers);
    r->curl_headers = NULL;
    upstream_finish(r, res, status);
}

/* The native client's answer buffer grew by more bytes while the answer
 * arrives (upstream_options.body_grew): counted now, not once all of it is
 * in, so requests admitted meanwhile see what the process holds. Forced:
 * the action ran (budget_take()). */
static void native_body_grew(void *ctx, size_t more)
{
    struct request *r = ctx;

    budget_take(r, more, true);
    r->resp_grown += more;
}

/* The exchange is over: what its growth counted becomes cap, the buffer the
 * request took over (0: none, it was freed with the exchange). The two are
 * equal for an answer: the client resends only before any answer byte, when
 * nothing has grown yet. */
static void native_body_settle(struct request *r, size_t cap)
{
    if (cap > r->resp_grown)
        budget_take(r, cap - r->resp_grown, true);
    else if (cap < r->resp_grown)
        budget_give(r, r->resp_grown - cap);
    r->resp_grown = 0;
}

/* A native exchange ended: its answer becomes the request's (the headers
 * and body are taken over, not copied). */
static void native_done(struct upstream_exchange *x)
{
    struct request *r = upstream_exchange_ctx(x);
    enum idem_upstream_result res = upstream_exchange_result(x);
    struct upstream_response *resp = upstream_exchange_response(x);
    long status = 0;

    r->ux = NULL;
    r->upstream_no_memory = upstream_exchange_no_memory(x);
    if (res == IDEM_UPSTREAM_RESPONSE) {
        status = resp->status;
        idem_headers_clear(&r->resp_headers);
        r->resp_headers = resp->headers;
        memset(&resp->headers, 0, sizeof(resp->headers));
        free(r->resp_body);
        r->resp_body = resp->body;
        r->resp_len = resp->body_len;
        r->resp_cap = resp->body_cap;
        native_body_settle(r, r->resp_cap); /* counted as it arrived */
        resp->body = NULL;
        resp->body_len = resp->body_cap = 0;
    } else {
        /* The exchange's buffer goes with it (upstream_exchange_free()). */
        native_body_settle(r, 0);
        if (res == IDEM_UPSTREAM_TOO_LARGE)
            r->resp_headers_too_large = resp->headers_too_large;
    }
    upstream_exchange_free(x);
    upstream_finish(r, res, status);
}

static void native_check_done(struct worker *w)
{
    struct upstream_exchange *x;
    while ((x = upstream_take_done(w->pool)) != NULL)
        native_done(x);
}

/* The exchange is over and nothing sends or hashes the request body again
 * (the fingerprints were made before the acquire): it is freed, and given
 * back to server.max_buffered, now rather than once the answer has been
 * sent. Otherwise a large body stays counted through the complete's commit
 * and while a slow client reads the answer, and a client that has its
 * answer can find the proxy still full of the body it sent. body_len stays:
 * it is what was received. */
static void request_body_drop(struct request *r)
{
    free(r->body);
    r->body = NULL;
    r->body_cap = 0;
    r->fp.body = NULL;
    if (r->body_charged > 0) {
        budget_give(r, r->body_charged);
        r->body_charged = 0;
    }
}

/* After the exchange, whichever client ran it: the client's answer, and
 * the record's complete or release. */
static void upstream_finish(struct request *r, enum idem_upstream_result res, long status)
{
    struct MHD_Response *resp = NULL;
    const char *outcome = r->keyed ? "forwarded" : "passthrough";

    request_body_drop(r);
    r->upstream_ms = mono_ms_f() - (double)r->upstream_start_ms;
    if (res == IDEM_UPSTREAM_RESPONSE) {
        r->resp_status = (int)status;
        resp = response_from_upstream(r);
    } else {
        /* The proxy's own answer replaces whatever partial response came. */
        const char *detail = "the upstream could not be reached; nothing was sent";
        const char *slug = "upstream-unreachable";
        const char *title = "Upstream unreachable";
        int st = 502;
        struct idem_headers ph = {0};
        size_t len = 0;
        char *body;
        if (res == IDEM_UPSTREAM_TIMEOUT && r->drain_cut) {
            /* Not the upstream's slowness: an operator reading this must
             * not go looking for a slow upstream (and with on_unknown
             * "complete" it is the key's stored answer). */
            st = 504;
            slug = "drain-timeout";
            title = "Stopped before the upstream answered";
            detail = "the proxy was stopping and server.drain_timeout ran out before the "
                     "upstream answered; the outcome is unknown";
        } else if (res == IDEM_UPSTREAM_TIMEOUT) {
            st = 504;
            slug = "upstream-timeout";
            title = "Upstream timeout";
            detail = "the upstream did not answer in time; the outcome is unknown";
        } else if (res == IDEM_UPSTREAM_BROKEN) {
            slug = "upstream-broken";
            title = "Upstream connection failed";
            detail = "the upstream connection failed after the request was sent; the outcome is "
                     "unknown";
        }
        /* The proxy's own shortage, not the upstream's fault: an operator
         * must not go looking at the upstream. Before anything was sent a
         * retry may fit (503, Retry-After); after, the action may have run
         * and its answer could not be read (502, an unknown outcome). */
        if (r->upstream_no_memory &&
            (res == IDEM_UPSTREAM_NOT_SENT || res == IDEM_UPSTREAM_BROKEN)) {
            st = res == IDEM_UPSTREAM_NOT_SENT ? 503 : 502;
            slug = "out-of-memory";
            title = "Out of memory";
            detail = res == IDEM_UPSTREAM_NOT_SENT
                         ? "the proxy ran out of memory connecting to the upstream; nothing was "
                           "sent"
                         : "the proxy ran out of memory reading the upstream's answer; the "
                           "request was sent, the outcome is unknown";
        } else if (res == IDEM_UPSTREAM_TOO_LARGE) {
            slug = "upstream-response-too-large";
            title = "Upstream response too large";
            detail = r->resp_headers_too_large
                         ? "the upstream response header block exceeds half of "
                           "server.header_memory"
                         : "the upstream response exceeds upstream.max_response";
        }
        body = idem_problem_json(st, slug, title, detail, &len);
        r->problem = slug;
        free(r->resp_body);
        r->resp_body = (uint8_t *)body;
        r->resp_len = body ? len : 0;
        r->resp_cap = r->resp_len;
        r->resp_status = st;
        idem_headers_clear(&r->resp_headers);
        idem_headers_push(&r->resp_headers, "Content-Type", 12, "application/problem+json", 24);
        if (st == 503)
            idem_headers_push(&r->resp_headers, "Retry-After", 11, "1", 1);
        resp = response_from_upstream(r);
        idem_headers_clear(&ph);
        outcome = "released";
    }
    if (!r->keyed) {
        respond(r, resp, r->resp_status, res == IDEM_UPSTREAM_RESPONSE ? "passthrough" : "error");
        return;
    }
    /* Keyed: the answer waits until the record is settled. */
    r->response = resp;
    r->response_status = r->resp_status;
    if (idem_decide_record(r->route, res, r->resp_status) == IDEM_RECORD_COMPLETE) {
        if (prepare_store_payload(r, &r->resp_headers) != 0) {
            /* Out of memory for the stored form: the action ran, so this is
             * a result that cannot be stored (README, Failure policy), held
             * as on_job holds a failed complete. Releasing would let the
             * retry run it again. */
            r->outcome = "unstored";
            submit_settle(r, STORE_OP_EXTEND, 0);
            return;
        }
        r->outcome = res == IDEM_UPSTREAM_RESPONSE ? "forwarded" : "completed_unknown";
        submit_settle(r, STORE_OP_COMPLETE, r->resp_status);
    } else {
        r->outcome = "released";
        submit_settle(r, STORE_OP_RELEASE, 0);
    }
    (void)outcome;
}

/* ---- keyed flow ------------------------------------------------------------ */

static void respond_conflict(struct request *r)
{
    long ra = idem_retry_after_seconds(r->holder_lease_expires_ms, lease_ms());
    respond_problem(r, 409, "request-in-progress", "Request in progress",
                    "a request with this Idempotency-Key is still being processed; retry later",
                    "conflict", ra, false);
}

/* A duplicate of a held key (store_op.hold): its action ran but the result
 * could not be stored, so the key stays taken until its TTL ends and
 * waiting would not change that. 409 at once, Retry-After the hold's end. */
static void respond_held(struct request *r, int64_t held_until_ms)
{
    long ra = idem_retry_after_seconds(held_until_ms, lease_ms());
    respond_problem(r, 409, "request-unstored", "Request result not stored",
                    "a request with this Idempotency-Key ran, but its result could not be "
                    "stored; the key cannot be used again until its TTL ends",
                    "conflict", ra, false);
}

static void respond_mismatch(struct request *r)
{
    respond_problem(r, 422, "key-reused", "Idempotency-Key reused",
                    "this Idempotency-Key was already used with a different request", "mismatch",
                    0, false);
}

static void begin_or_continue_wait(struct request *r, int64_t holder_lease_expires_ms)
{
    int64_t now = idem_mono_ms();
    r->holder_lease_expires_ms = holder_lease_expires_ms;
    if (r->w->drain_forced) {
        /* The drain is over: no wait left to give; not a conflict. */
        r->problem = "shutting-down";
        respond(r, make_shutting_down("the proxy stopped before the key's holder finished; retry"),
                503, "unavailable");
        return;
    }
    if (r->wait_deadline_ms == 0) {
        /* During the drain a duplicate still waits: the holder is in
         * flight and finishing is what the drain is for. force_drain()
         * cuts the wait at the deadline. */
        if (r->route->wait_ms <= 0) {
            respond_conflict(r);
            return;
        }
        r->wait_deadline_ms = now + r->route->wait_ms;
        r->poll_step_ms = POLL_MIN_MS;
    }
    if (now >= r->wait_deadline_ms) {
        respond_conflict(r);
        return;
    }
    r->state = RS_WAITING;
    r->next_poll_ms = now + r->poll_step_ms;
    set_waiting(r, true);
    suspend(r);
}

/*
 * True when the client of a waiting duplicate has closed its connection
 * (FIN or reset, nothing unread). A suspended connection is not read by
 * libmicrohttpd, so nothing else notices: the waiter would hold its slot and
 * its per-IP count for the whole wait and, if the holder released the key,
 * acquire it and run the action for nobody. Like nginx (a client that closes
 * while its request is pending aborts it), a FIN counts as gone.
 */
static bool waiter_gone(struct request *r)
{
    char b;
    ssize_t n;

    if (r->slot == NULL)
        return false;
    n = recv(r->slot->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* A waiting duplicate whose client left: nothing of it ran and it holds
 * no record, so its connection is just closed (queue_answer() with no
 * response ends it), logged as aborted. libmicrohttpd says "Application
 * reported internal error" for that; mhd_log() leaves that line out, once
 * per dropped waiter. */
static void drop_waiter(struct request *r)
{
    r->w->quiet_app_errors++;
    respond(r, NULL, 0, "aborted");
}

/* What lookup() takes out of the store's read transaction (see
 * lookup_view()). */
struct lookup_result {
    struct request *r;
    enum idem_lookup_action action;
    struct store_record rec;  /* without its body; headers copied for a replay */
    struct replay_body *body; /* IDEM_LOOKUP_REPLAY: the shared copy */
    struct replay_ready *ready; /* IDEM_LOOKUP_REPLAY: or the worker's answer for it */
    int share_rc;             /* replay_share_get(), or REPLAY_SHARE_ENOMEM for the headers' copy */
};

/* store_view()'s callback: decides with the record as stored and copies
 * only what the answer needs; a replay takes a reference to the stored
 * body's shared copy, made now unless another replay of this very
 * record holds one already (replay_share.h), so N clients replaying one
 * answer hold it once. */
static void lookup_view(const struct store_record *rec, void *ctx)
{
    struct lookup_result *lr = ctx;
    struct request *r = lr->r;

    lr->action = idem_decide_lookup(rec, &r->fp, real_ms(), lease_ms());
    lr->rec = *rec;
    lr->rec.headers = NULL;
    lr->rec.headers_len = 0;
    lr->rec.body = NULL;
    lr->rec.body_len = 0;
    if (lr->action != IDEM_LOOKUP_REPLAY)
        return;
    if (r->w->replay_ready != NULL && rec->body_len > 0 &&
        replay_body_is(r->w->replay_ready->body, r->record_key, rec)) {
        lr->ready = replay_ready_ref(r->w->replay_ready);
        return;
    }
    if (rec->headers_len > 0) {
        lr->rec.headers = malloc(rec->headers_len);
        if (lr->rec.headers == NULL) {
            lr->share_rc = REPLAY_SHARE_ENOMEM;
            return;
        }
        memcpy(lr->rec.headers, rec->headers, rec->headers_len);
        lr->rec.headers_len = rec->headers_len;
    }
    if (rec->body_len > 0)
        lr->share_rc = replay_share_get(r->w->srv->shares, r->record_key, rec, &lr->body);
}

/* Reads the record without the writer and acts on it. */
static void lookup(struct request *r)
{
    struct lookup_result lr = {.r = r};
    int rc = store_view(r->w->srv->store, r->record_key, lookup_view, &lr);

    if (rc == STORE_ENOMEM) {
        respond_oom(r, "the proxy ran out of memory reading this key's record; nothing was "
                       "forwarded",
                    false);
        goto out;
    }
    if (rc != 0) {
        respond_unavailable(r, "the record store could not be read");
        goto out;
    }
    /* Past the bound nothing is forwarded, and a replay only when it
     * shares a copy other replays hold (it adds nothing). */
    if (lr.action == IDEM_LOOKUP_REPLAY && lr.share_rc == REPLAY_SHARE_FULL) {
        respond_oom(r, BUDGET_REPLAY, false);
        goto out;
    }
    if (lr.action != IDEM_LOOKUP_REPLAY && budget_over(r)) {
        respond_oom(r, BUDGET_FULL, false);
        goto out;
    }
    switch (lr.action) {
    case IDEM_LOOKUP_REPLAY:
        if (lr.share_rc != REPLAY_SHARE_OK) {
            respond_oom(r, "the proxy ran out of memory reading this key's stored answer; retry",
                        false);
            break;
        }
        if (lr.ready != NULL) {
            respond_ready(r, lr.ready);
            lr.ready = NULL;
            break;
        }
        respond_replay(r, &lr.rec, lr.body);
        lr.body = NULL;
        break;
    case IDEM_LOOKUP_MISMATCH:
        respond_mismatch(r);
        break;
    case IDEM_LOOKUP_BUSY:
        begin_or_continue_wait(r, lr.rec.lease_expires_ms);
        break;
    case IDEM_LOOKUP_HELD:
        respond_held(r, lr.rec.lease_expires_ms);
        break;
    case IDEM_LOOKUP_ACQUIRE:
        if (r->state == RS_WAITING && waiter_gone(r)) {
            /* The holder released the key after this client left: do not
             * run the action for nobody. */
            drop_waiter(r);
            break;
        }
        set_waiting(r, false);
        if (r->w->drain_forced) {
            /* Past the drain's deadline: an acquire now would queue behind
             * whatever holds the store up, and the worker stops within a
             * second, closing this connection unanswered. */
            r->problem = "shutting-down";
            respond(r, make_shutting_down("the proxy is stopping; nothing was forwarded; retry"),
                    503, "unavailable");
            break;
        }
        submit_acquire(r);
        suspend(r);
        break;
    case IDEM_LOOKUP_ERROR:
        /* The canonical fingerprint ran out of memory: a retry may fit. */
        respond_oom(r,
                    "the proxy could not compare this request with its key's; nothing was "
                    "forwarded",
                    false);
        break;
    }
out:
    replay_ready_put(lr.ready);
    replay_body_put(lr.body);
    store_record_clear(&lr.rec);
}

static void on_job(struct request *r, struct writer_job *j)
{
    int src;

    r->w->n_jobs--;
    if (j == &r->hb_job) {
        r->hb_pending = false;
        if (j->error == 0 && j->op.outcome == STORE_FENCED)
            r->lease_lost = true;
        maybe_free(r);
        return;
    }
    r->job_pending = false;
    if (r->store_charged > 0) {
        /* Committed or not, the store's copy is gone. */
        atomic_fetch_sub(&r->w->srv->buffered, r->store_charged);
        r->charged -= r->store_charged;
        r->store_charged = 0;
    }
    if (j->op.kind == STORE_OP_ACQUIRE && j->error == 0 && j->op.outcome == STORE_ACQUIRED) {
        /* The writer took it for live (no acquire of this process steals
         * it, however late its heartbeat) until request_free forgets it. */
        memcpy(r->lease_id, j->op.lease_id, STORE_LEASE_ID_BYTES);
        r->live_lease = true;
    }
    if (r->store_abandoned && j->op.kind == STORE_OP_ACQUIRE && j->error == 0 &&
        j->op.outcome == STORE_ACQUIRED) {
        /* Its client was told at the stop that nothing was forwarded
         * (give_up_store_waits), and the acquire landed after all: give the
         * key back, so that the retry runs now instead of waiting out the
         * lease. Not submit_settle(): the request's state stays, its answer
         * may still be on its way. Should the worker stop first, the key is
         * left to its lease, as an exit would leave it. */
        memset(&j->op, 0, sizeof(j->op));
        j->op.kind = STORE_OP_RELEASE;
        memcpy(j->op.key, r->record_key, STORE_KEY_BYTES);
        memcpy(j->op.lease_id, r->lease_id, STORE_LEASE_ID_BYTES);
        submit(r, j);
        return;
    }
    /* A client gone, or answered at the stop with the write still out: the
     * write landed after all, which changes nothing for the answer. */
    if (r->mhd_done || r->store_abandoned) {
        maybe_free(r);
        return;
    }
    switch (j->op.kind) {
    case STORE_OP_ACQUIRE:
        if (j->error == STORE_ELAYOUT) {
            respond_unavailable(r, "the record store was upgraded by a newer idemproxy and this "
                                   "process can no longer write it; nothing was forwarded");
            break;
        }
        if (j->error == STORE_ENOMEM) {
            respond_oom(r, HOLD_FAILED, false);
            break;
        }
        if (j->error != 0) {
            respond_unavailable(r, "the record store failed; nothing was forwarded");
            break;
        }
        switch (j->op.outcome) {
        case STORE_ACQUIRED:
            memcpy(r->lease_id, j->op.lease_id, STORE_LEASE_ID_BYTES);
            if (r->w->draining) {
                /* Acquired as we began to stop: give the key back. */
                r->response = make_shutting_down("the proxy is stopping; retry");
                r->problem = "shutting-down";
                r->response_status = 503;
                r->outcome = "unavailable";
                submit_settle(r, STORE_OP_RELEASE, 0);
                break;
            }
            src = start_upstream(r);
            if (src != 0) {
                struct start_failure f = start_failure_of(src);
                r->problem = f.slug;
                r->response = make_problem(f.status, f.slug, f.title, f.detail);
                if (r->response != NULL && f.retry_after > 0)
                    MHD_add_response_header(r->response, "Retry-After", "1");
                r->response_status = f.status;
                r->outcome = "released";
                submit_settle(r, STORE_OP_RELEASE, 0);
            }
            break;
        case STORE_REPLAY: {
            /* Completed between lookup() and this acquire: the writer's
             * copy becomes the shared one, unless a replay of this record
             * holds one already. */
            struct replay_body *body = NULL;
            if (replay_body_adopt(r, &j->op.replay, &body))
                respond_replay(r, &j->op.replay, body);
            store_record_clear(&j->op.replay);
            break;
        }
        case STORE_BUSY:
            if (j->op.held)
                respond_held(r, j->op.lease_expires_ms);
            else
                begin_or_continue_wait(r, j->op.lease_expires_ms);
            break;
        case STORE_MISMATCH:
            respond_mismatch(r);
            break;
        default:
            /* Full: the writer purges at once, but LMDB reuses the pages a
             * purge frees only a transaction or two later, so ask again
             * (twice) before failing closed. */
            if (r->full_retries < 2) {
                r->full_retries++;
                submit_acquire(r);
                break;
            }
            respond_unavailable(r, "the record store is full; nothing was forwarded");
            break;
        }
        break;
    case STORE_OP_COMPLETE:
        if (j->error != 0 || j->op.outcome == STORE_FULL) {
            /* The action ran but its result could not be stored (a full
             * map or file system, a failing disk). Releasing the key would
             * let the client's retry run the action a second time, so the
             * record stays IN_PROGRESS instead, its lease extended to the
             * route's TTL: retries get 409 until then, and purge removes it
             * after. The extend is a small in-place write that fits in the
             * reserve completions leave. The client still gets what the
             * upstream said. */
            r->outcome = "unstored";
            submit_settle(r, STORE_OP_EXTEND, 0);
            break;
        }
        if (j->op.outcome == STORE_FENCED)
            r->outcome = "fenced";
        respond(r, response_take(r), r->response_status, r->outcome);
        break;
    case STORE_OP_RELEASE:
    default: {
        struct MHD_Response *resp = response_take(r);
        /* A refused release: the lease was stolen while the action ran, and
         * the record is the new owner's. */
        if (j->error == 0 && j->op.outcome == STORE_FENCED)
            r->outcome = "fenced";
        respond(r, resp, r->response_status, r->outcome ? r->outcome : "released");
        break;
    }
    }
}

static void on_key_settled(struct worker *w, const uint8_t key[STORE_KEY_BYTES])
{
    struct request *r = w->active;
    while (r != NULL) {
        struct request *next = r->next;
        if (r->state == RS_WAITING && memcmp(r->record_key, key, STORE_KEY_BYTES) == 0)
            lookup(r);
        r = next;
    }
}

/* ---- MHD callbacks ------------------------------------------------------ */

static void *on_uri(void *cls, const char *uri, struct MHD_Connection *conn)
{
    struct worker *w = cls;
    struct request *r = calloc(1, sizeof(*r));
    const union MHD_ConnectionInfo *ci;
    const char *q;

    if (r == NULL)
        return NULL;
    r->w = w;
    r->conn = conn;
    r->start_ms = idem_mono_ms();
    r->target_len = strlen(uri);
    r->target = strdup(uri);
    if (r->target == NULL) {
        free(r);
        return NULL;
    }
    q = strchr(r->target, '?');
    r->path_len = q ? (size_t)(q - r->target) : r->target_len;
    /* libmicrohttpd cuts the target at an embedded NUL ("/v1/pay\0ments"
     * reads "/v1/pay"). Here the request line is still in its read buffer
     * with only the separating space turned into the terminator, so the
     * version must follow right after it; anything else means the target
     * went on past a NUL. */
    if (strncmp(uri + r->target_len + 1, "HTTP/", 5) != 0)
        r->reject_status = 400;
    ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    if (ci != NULL && ci->socket_context != NULL) {
        r->slot = ci->socket_context;
        /* The connection's previous request can outlive its answer (a
         * heartbeat of its still in the writer) and the connection too:
         * it lets go of the slot now, which is freed with the connection,
         * possibly before that request is. */
        if (r->slot->req != NULL && r->slot->req != r)
            r->slot->req->slot = NULL;
        r->slot->req = r;
    }
    w->n_requests++;
    return r;
}

static enum MHD_Result collect_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                      size_t key_size, const char *value, size_t value_size)
{
    struct request *r = cls;
    size_t trimmed = value ? value_size : 0;
    size_t line = key_size + trimmed + 4;
    (void)kind;
    /* The line as it sits in libmicrohttpd's read buffer, white space
     * around the value included (name, colon and value are one line). */
    if (value != NULL && value > key && (size_t)(value - key) < SIZE_MAX / 4 &&
        (size_t)(value - key) + value_size + 2 > line)
        line = (size_t)(value - key) + value_size + 2;
    r->head_bytes += line;
    /* A field value excludes the white space around it (RFC 9110 5.5).
     * libmicrohttpd 0.9.75 strips it in front only, so "X-Tenant-Id: acme "
     * would be another tenant than "acme" and its key another record. */
    while (trimmed > 0 && (value[trimmed - 1] == ' ' || value[trimmed - 1] == '\t'))
        trimmed--;
    if (idem_headers_push(&r->headers, key, key_size, value ? value : "", trimmed) != 0) {
        /* The walk stops here and returns a count, not an error: flag it,
         * or the request would go on without its remaining headers. */
        r->oom = true;
        return MHD_NO;
    }
    /* An embedded NUL hides bytes from C-string consumers: refuse it.
     * libmicrohttpd 0.9.75 reports a value cut at its first NUL ("a\0b" is
     * "a", size 1), so the sizes cannot show it. The value still sits in
     * the connection's read buffer, terminated where its line ended: a
     * byte other than a line end or white space right after the cut means
     * the line went on past a NUL. (A NUL followed only by white space
     * remains invisible.) */
    if (strlen(key) != key_size || (value != NULL && strlen(value) != value_size))
        r->reject_status = 400;
    if (value != NULL && value_size > 0) {
        char next = value[value_size + 1];
        if (next != '\0' && next != '\n' && next != '\r' && next != ' ' && next != '\t')
            r->reject_status = 400;
    }
    r->last_field = key;
    /* Each line must start right after the CRLF that ended the line before
     * (see on_headers). */
    if (r->line_end != NULL) {
        if ((uintptr_t)key != (uintptr_t)r->line_end + 2)
            r->reject_status = 400;
        r->line_end = value != NULL ? value + value_size : key + key_size;
    }
    return MHD_YES;
}

static bool ieq_trim(const char *v, const char *word)
{
    size_t len, wl = strlen(word);
    while (*v == ' ' || *v == '\t')
        v++;
    len = strlen(v);
    while (len > 0 && (v[len - 1] == ' ' || v[len - 1] == '\t'))
        len--;
    return len == wl && strncasecmp(v, word, wl) == 0;
}

static bool all_digits(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    if (*s == '\0')
        return false;
    while (*s >= '0' && *s <= '9')
        s++;
    while (*s == ' ' || *s == '\t')
        s++;
    return *s == '\0';
}

/* RFC 9110 section 7.2 and RFC 3986 section 3.2.2: Host = uri-host [ ":"
 * port ], uri-host an IP-literal ("[...]") or a reg-name (unreserved,
 * percent-encoded and sub-delims characters), port = *DIGIT. Empty is
 * allowed (a target without authority). Leading and trailing blanks are
 * optional white space around the value. */
static bool host_value_ok(const char *v, size_t n)
{
    static const char reg_name[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                   "0123456789-._~%!$&'()*+,;=";
    size_t i = 0;

    while (n > 0 && (v[n - 1] == ' ' || v[n - 1] == '\t'))
        n--;
    while (i < n && (v[i] == ' ' || v[i] == '\t'))
        i++;
    if (i < n && v[i] == '[') {
        for (i++; i < n && v[i] != ']'; i++) {
            if (v[i] == '\0' || (v[i] != ':' && strchr(reg_name, v[i]) == NULL))
                return false;
        }
        if (i == n)
            return false;
        i++;
    } else {
        while (i < n && v[i] != ':') {
            if (v[i] == '\0' || strchr(reg_name, v[i]) == NULL)
                return false;
            i++;
        }
    }
    if (i < n) {
        if (v[i] != ':')
            return false;
        for (i++; i < n; i++) {
            if (v[i] < '0' || v[i] > '9')
                return false;
        }
    }
    return true;
}

/* Headers are complete: everything decidable before the body. Returns
 * false when the request was answered (r->state is RS_RESPOND). */
/* The most body the proxy reads for this request: the route's max_body, or
 * for a request no route covers, the largest max_body of any route, so
 * pass-through cannot be used to exhaust memory. */
static uint64_t body_limit(const struct request *r)
{
    const struct config *cfg = r->w->srv->cfg;
    uint64_t cap = 0;

    if (r->route != NULL)
        return r->route->max_body_bytes;
    for (size_t i = 0; i < cfg->n_routes; i++)
        if (cfg->routes[i].max_body_bytes > cap)
            cap = cfg->routes[i].max_body_bytes;
    return cap;
}

#define BODY_TOO_LARGE_UNCOVERED                                                               \
    "the body exceeds the largest max_body of any route, the limit for requests no route "   \
    "covers"

/* A request whose raw bytes could not be checked (wire_check.h), for want of
 * memory: answered 503, nothing forwarded. True when it was. */
static bool unchecked_503(struct request *r)
{
    if (r->slot != NULL && r->slot->wire != NULL && !wire_check_oom(r->slot->wire))
        return false;
    respond_problem(r, 503, "out-of-memory", "Out of memory",
                    "the proxy could not hold this request; nothing was forwarded", "unavailable",
                    1, true);
    return true;
}

static bool on_headers(struct request *r, const char *method, const char *version)
{
    const struct config *cfg = r->w->srv->cfg;
    size_t n_te, n_cl, n_host;
    const struct idem_header *cl, *te, *host;
    char detail[256];
    uintptr_t block_end = 0;

    r->method = strdup(method);
    if (r->method == NULL) {
        respond_oom(r, HOLD_FAILED, true);
        return false;
    }
    r->http10 = strcmp(version, MHD_HTTP_VERSION_1_0) == 0;
    /* libmicrohttpd 0.9.75 parses the header block in place: the method,
     * target, version and every field are pointers into its read buffer,
     * each CRLF turned into two NULs, and the value of a field starts after
     * the white space behind its colon and runs to the line end. So a field
     * line starts exactly two bytes after the previous line's end, and the
     * block ends four bytes after the last one (its CRLF and the empty
     * line). What it makes of some malformed lines breaks that:
     *   - "Transfer-Encoding: chunked\0" (a NUL, then only white space) is
     *     reported as "chunked"; the bytes the sizes do not show are there;
     *   - a line starting with ':' ends the header block: the fields after it
     *     are dropped and taken for the next request, or an empty line that
     *     follows it becomes the body ("Content-Length: 2", ": x", "", "hi"
     *     forwards "\r\n" as the body);
     *   - an obs-fold continuation is glued to the field name elsewhere in
     *     the pool ("X-A: 1", " b" becomes "X-Ab: 1");
     *   - a bare LF ends a line one byte early.
     * Each of these is a 400 (RFC 9112 section 5.2 allows it for obs-fold,
     * RFC 9110 section 5.5 asks it for a NUL). When the layout is not the
     * one described (another libmicrohttpd), the lines are not checked
     * here; test_smuggling_corpus.py fails then. */
    {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
        uintptr_t m = (uintptr_t)method, v = (uintptr_t)version;
        if (ci != NULL && v > m && v - m < ci->header_size) {
            r->line_end = version + strlen(version);
            block_end = m + ci->header_size;
        }
    }
    /* The head as it came off the socket, framed strictly: the same
     * request, complete, with no line end other than CRLF, no NUL, no line
     * starting with white space or ':'. The checks above and below look at
     * libmicrohttpd's buffer, where some of those are no longer visible
     * (wire_check.h). */
    if (unchecked_503(r))
        return false;
    if (!wire_check_head(r->slot->wire))
        r->reject_status = 400;
    if (r->reject_status == 0 &&
        (MHD_get_connection_values_n(r->conn, MHD_HEADER_KIND, collect_header, r) < 0 ||
         r->oom)) {
        respond_oom(r, HOLD_FAILED, true);
        return false;
    }
    if (r->line_end != NULL && (uintptr_t)r->line_end + 4 != block_end)
        r->reject_status = 400;
    if (r->reject_status != 0) {
        /* The raw-byte check refuses a request whose head or body it could
         * not frame; a body that came in the same read as the head (a bad
         * chunk size, say) is refused here already, so the detail must not
         * blame a header. */
        respond_problem(r, 400, "bad-request", "Bad request",
                        "the request's framing is malformed (a line end other than CRLF, a NUL, "
                        "a field line that cannot be read, an invalid chunk or trailer line)",
                        "rejected", 0, true);
        return false;
    }
    /* Every field name a token and no value holding CR, LF or NUL (RFC 9110
     * section 5.1, 5.5): "Transfer-Encoding : chunked" must not be half
     * understood. A name that begins like a framing header but is longer
     * ("Content-Length105") is how libmicrohttpd 0.9.75 glues an obs-fold
     * continuation (RFC 9112 section 5.2) onto the line before: refused
     * too, since the framing the client meant is unknowable. The method must
     * be a token as well: "{}POST" is what is left of a body the client
     * framed differently. */
    {
        bool bad = !idem_is_token(method, strlen(method));
        for (size_t i = 0; !bad && i < r->headers.n; i++) {
            const struct idem_header *h = &r->headers.v[i];
            bad = !idem_is_token(h->name, h->name_len) ||
                  memchr(h->value, '\r', h->value_len) != NULL ||
                  memchr(h->value, '\n', h->value_len) != NULL ||
                  (h->name_len > 14 && strncasecmp(h->name, "Content-Length", 14) == 0) ||
                  (h->name_len > 17 && strncasecmp(h->name, "Transfer-Encoding", 17) == 0);
        }
        if (bad) {
            respond_problem(r, 400, "bad-request", "Bad request",
                            "a request header name or the method is not a token, or a framing "
                            "header is folded",
                            "rejected", 0, true);
            return false;
        }
    }
    /* The forwarding rules drop every field Connection names, and track up
     * to 32 of them: past that the request cannot be forwarded as asked.
     * Refused here, before a key is taken, not after (a 502 that blamed
     * the upstream). */
    if (idem_connection_too_many_names(&r->headers)) {
        respond_problem(r, 400, "bad-request", "Bad request",
                        "the Connection header names more than 32 fields", "rejected", 0, true);
        return false;
    }
    /* CONNECT asks for a tunnel (RFC 9110 section 9.3.6), which a reverse
     * proxy does not make: forwarded, a 2xx from the upstream went back
     * without framing (libmicrohttpd frames no 2xx to CONNECT) on a
     * connection left open. 501 is the answer for a method the server does
     * not implement (RFC 9110 section 15.6.2); the connection is closed,
     * since what follows a CONNECT is tunnel data, not a request. Checked
     * before routing, so a route listing CONNECT stores nothing either. */
    if (strcmp(method, MHD_HTTP_METHOD_CONNECT) == 0) {
        respond_problem(r, 501, "method-not-implemented", "Method not implemented",
                        "CONNECT (a tunnel) is not supported by this reverse proxy; nothing was "
                        "forwarded",
                        "rejected", 0, true);
        return false;
    }
    /* RFC 6585 section 5: the request line plus every field line, as sent,
     * and what libmicrohttpd makes of them in the connection's pool. */
    r->pool_bytes = request_pool_bytes(r, method, version);
    if (r->pool_bytes > cfg->server.header_memory_bytes) {
        snprintf(detail, sizeof(detail), "the request header block exceeds %zu bytes",
                 cfg->server.header_memory_bytes);
        respond_problem(r, 431, "headers-too-large", "Request header fields too large", detail,
                        "rejected", 0, true);
        return false;
    }
    /* Framing libmicrohttpd lets through (RFC 9112 section 6.1 and 6.3):
     * any of these would let a front end and the upstream disagree on
     * where this request ends. */
    n_te = idem_headers_count(&r->headers, "Transfer-Encoding");
    n_cl = idem_headers_count(&r->headers, "Content-Length");
    te = idem_headers_find(&r->headers, "Transfer-Encoding");
    cl = idem_headers_find(&r->headers, "Content-Length");
    if (n_te > 1 || (te != NULL && !ieq_trim(te->value, "chunked")) || (te && n_cl > 0) ||
        (te && r->http10) || n_cl > 1 || (cl != NULL && !all_digits(cl->value))) {
        respond_problem(r, 400, "bad-framing", "Bad request framing",
                        "Transfer-Encoding other than a single chunked, Transfer-Encoding with "
                        "Content-Length, or a repeated or invalid Content-Length",
                        "rejected", 0, true);
        return false;
    }
    /* RFC 9112 section 3.2: an HTTP/1.1 request without Host, or any
     * request with more than one or with a value that is not host[:port],
     * MUST be answered 400. The Host is what X-Forwarded-Host tells the
     * upstream; with two, the proxy and the upstream could each believe a
     * different one. */
    n_host = idem_headers_count(&r->headers, "Host");
    host = idem_headers_find(&r->headers, "Host");
    if (n_host > 1 || (n_host == 0 && !r->http10) ||
        (host != NULL && !host_value_ok(host->value, host->value_len))) {
        respond_problem(r, 400, "bad-host", "Bad Host header",
                        "an HTTP/1.1 request needs exactly one Host header of the form "
                        "host[:port]",
                        "rejected", 0, true);
        return false;
    }
    /* Only targets that route unambiguously are forwarded (RFC 9112 section
     * 3.2.1, RFC 3986 section 6): the target is appended to the upstream URL
     * as sent (CURLOPT_PATH_AS_IS), so the upstream resolves the path the
     * route was matched on, not one a normaliser makes of it. */
    if (!idem_target_is_canonical(r->target, r->target_len)) {
        respond_problem(r, 400, "bad-target", "Ambiguous request target",
                        "the request target must be a path (origin-form) of visible ASCII "
                        "without empty or dot segments or escaped unreserved characters",
                        "rejected", 0, true);
        return false;
    }
    r->route = config_match_route(cfg, r->method, r->target, r->path_len);
    /* 413 as soon as Content-Length says so, covered or not: the body is
     * never read. */
    if (cl != NULL && strtoull(cl->value, NULL, 10) > body_limit(r)) {
        if (r->route != NULL)
            snprintf(detail, sizeof(detail),
                     "the body exceeds this route's max_body of %llu bytes",
                     (unsigned long long)r->route->max_body_bytes);
        else
            snprintf(detail, sizeof(detail), BODY_TOO_LARGE_UNCOVERED " (%llu bytes)",
                     (unsigned long long)body_limit(r));
        respond_problem(r, 413, "body-too-large", "Request body too large", detail, "rejected", 0,
                        true);
        return false;
    }
    /* Room for the whole body before any of it is read (server.max_buffered):
     * past it, 503 at once and nothing forwarded, as a 413 is. */
    if (cl != NULL) {
        uint64_t n = strtoull(cl->value, NULL, 10);
        if (n > 0 && !budget_take(r, n, false)) {
            /* The body is read and thrown away, then answered (as a body
             * too large without Content-Length is), so the client reads
             * the 503 rather than a reset in the middle of its upload. */
            r->oom = true;
            r->budget_full = true;
            r->body_too_large = true;
        } else {
            r->body_charged = n;
        }
    }
    if (r->route == NULL)
        return true;
    {
        size_t n_key = idem_headers_count(&r->headers, "Idempotency-Key");
        const struct idem_header *kh = idem_headers_find(&r->headers, "Idempotency-Key");
        enum idem_key_status ks;
        if (n_key == 0) {
            if (r->route->require_key) {
                respond_problem(r, 400, "key-required", "Idempotency-Key required",
                                "this route requires an Idempotency-Key header", "rejected", 0,
                                false);
                return false;
            }
            return true; /* covered without a key: forwarded, nothing stored */
        }
        if (n_key > 1) {
            respond_problem(r, 400, "invalid-key", "Invalid Idempotency-Key",
                            "the Idempotency-Key header appears more than once", "rejected", 0,
                            false);
            return false;
        }
        /* Content-Type decides how the body is compared (its fingerprint)
         * and is no list (RFC 9110 section 8.3): with two, the proxy could
         * compare by one and the upstream read the other, and replay an
         * answer to a body it would read as different. */
        if (idem_headers_count(&r->headers, "Content-Type") > 1) {
            respond_problem(r, 400, "bad-request", "Bad request",
                            "the Content-Type header appears more than once", "rejected", 0,
                            false);
            return false;
        }
        r->key = malloc(r->route->max_key_length + 1);
        if (r->key == NULL) {
            respond_oom(r, HOLD_FAILED, true);
            return false;
        }
        ks = idem_key_parse(kh->value, kh->value_len, r->route->max_key_length, r->key,
                            &r->key_len);
        if (ks != IDEM_KEY_OK) {
            respond_problem(r, 400, "invalid-key", "Invalid Idempotency-Key",
                            idem_key_status_text(ks), "rejected", 0, false);
            return false;
        }
    }
    {
        const struct idem_header *sh = NULL;
        if (r->route->scope_header != NULL) {
            sh = idem_headers_find(&r->headers, r->route->scope_header);
            if (sh == NULL || sh->value_len == 0 ||
                idem_headers_count(&r->headers, r->route->scope_header) > 1) {
                /* Say which: "missing or repeated" sent an operator looking
                 * for a header the client did send, empty. */
                snprintf(detail, sizeof(detail), "this route is scoped by the %s header, which %s",
                         r->route->scope_header,
                         sh == NULL            ? "is missing"
                         : sh->value_len == 0 ? "is empty"
                                               : "is sent more than once");
                respond_problem(r, 400, "scope-header-missing", "Scope header missing", detail,
                                "rejected", 0, false);
                return false;
            }
        }
        if (idem_scope_build(r->route, sh ? sh->value : NULL, sh ? sh->value_len : 0, &r->scope,
                             &r->scope_len) != 0) {
            respond_oom(r, HOLD_FAILED, true);
            return false;
        }
    }
    store_key_derive(r->scope, r->scope_len, r->key, r->key_len, r->record_key);
    if (cfg->access_log)
        idem_key_loghash(r->w->srv->log_salt, r->record_key, r->keyhash);
    r->keyed = true;
    return true;
}

/* Returns false when the proxy stops reading the body: the request was
 * then answered on the socket (reject_lingering) and the handler must
 * return MHD_NO. */
static bool append_body(struct request *r, const char *data, size_t len)
{
    uint64_t cap = body_limit(r);

    if (r->body_too_large || (uint64_t)r->body_len + len > cap) {
        r->body_too_large = true;
        r->body_discarded += len;
        if (r->body_discarded <= 16 * (size_t)cap + 65536)
            return true; /* read on, answered at the end of the body */
        /* Too much to read on: answer now, on the socket, and linger, so
         * the client reads the 413 rather than a reset. */
        if (r->oom)
            reject_lingering(r, 503, "Service Unavailable", "out-of-memory", "Out of memory",
                             "the proxy could not hold this request; nothing was forwarded");
        else
                reject_lingering(r, 413, "Content Too Large", "body-too-large",
                             "Request body too large",
                             r->route != NULL ? "the body exceeds this route's max_body"
                                              : BODY_TOO_LARGE_UNCOVERED);
        return false;
    }
    if (r->body_len + len > r->body_cap) {
        size_t ncap = r->body_cap ? r->body_cap : 1024;
        uint8_t *nb;
        while (ncap < r->body_len + len)
            ncap *= 2;
        /* A Content-Length body is held in exactly its length, counted at
         * its head; a chunked one is counted as it grows. */
        if (r->body_charged >= r->body_len + len && ncap > r->body_charged)
            ncap = (size_t)r->body_charged;
        if (ncap > r->body_charged) {
            if (!budget_take(r, ncap - r->body_charged, false)) {
                /* Answered at the end of the body, like a failed realloc. */
                r->oom = true;
                r->budget_full = true;
                r->body_too_large = true;
                r->body_discarded += len;
                return true;
            }
            r->body_charged = ncap;
        }
        nb = realloc(r->body, ncap);
        if (nb == NULL) {
            /* Answered at the end of the body, like a body too large. */
            r->oom = true;
            r->body_too_large = true;
            r->body_discarded += len;
            return true;
        }
        r->body = nb;
        r->body_cap = ncap;
    }
    memcpy(r->body + r->body_len, data, len);
    r->body_len += len;
    return true;
}

/* The whole request is here: answer it or set it going. */
static void on_complete_request(struct request *r)
{
    if (r->oom) {
        respond_oom(r, r->budget_full ? BUDGET_FULL : HOLD_FAILED, true);
        return;
    }
    if (r->body_too_large) {
        respond_problem(r, 413, "body-too-large", "Request body too large",
                        r->route != NULL ? "the body exceeds this route's max_body"
                                         : BODY_TOO_LARGE_UNCOVERED,
                        "rejected", 0, true);
        return;
    }
    if (!r->keyed) {
        if (r->w->drain_forced) {
            /* Past the drain's deadline the worker stops within a grace
             * second, cutting whatever is still open: a request forwarded
             * now would run with nobody to tell. */
            r->problem = "shutting-down";
            respond(r, make_shutting_down("the proxy is stopping; nothing was forwarded; retry"),
                    503, "unavailable");
            return;
        }
        if (budget_over(r)) {
            /* Answers of requests already forwarded hold more than the
             * bound: nothing new is forwarded until they are sent. */
            respond_oom(r, BUDGET_FULL, false);
            return;
        }
        int src = start_upstream(r);
        if (src != 0) {
            struct start_failure f = start_failure_of(src);
            respond_problem(r, f.status, f.slug, f.title, f.detail,
                            f.status == 400   ? "rejected"
                            : f.status == 503 ? "unavailable"
                                              : "error",
                            f.retry_after, false);
            return;
        }
        suspend(r);
        return;
    }
    {
        const struct idem_header *ct = idem_headers_find(&r->headers, "Content-Type");
        if (idem_fingerprints_init(&r->fp, r->method, r->target, r->target_len,
                                   ct ? ct->value : NULL, r->body, r->body_len,
                                   r->route->fingerprint) != 0) {
            respond_oom(r, "the proxy could not hash this request; nothing was forwarded", false);
            return;
        }
    }
    lookup(r);
}

static enum MHD_Result queue_answer(struct request *r)
{
    enum MHD_Result ret;
    if (r->response == NULL) {
        /* Allocation failed on the way: end the connection rather than
         * answer something we did not mean. */
        r->state = RS_DONE;
        return MHD_NO;
    }
    /* A stopping proxy closes every connection: say so on each answer
     * (RFC 9112 section 9.6) so no client sends another request on it.
     * Marked on the request side, as if the client had sent it, which makes
     * libmicrohttpd close after the answer and write "Connection: close"
     * itself: adding the header to the response would lose its Date
     * (libmicrohttpd 0.9.75 resets the response's header flags when a
     * Connection header is first added, then sends a second Date), and a
     * replay must keep the stored headers as they are. */
    if (r->w->draining)
        (void)MHD_set_connection_value(r->conn, MHD_HEADER_KIND, "Connection", "close");
    ret = MHD_queue_response(r->conn, (unsigned int)r->response_status, r->response);
    response_drop(r);
    r->state = RS_DONE;
    return ret;
}

/* Counts the request's trailer fields. libmicrohttpd 0.9.75 adds the last
 * field of the header block once more, as a trailer, when the empty line
 * that ends the trailer section arrives split between its CR and its LF:
 * the same name pointer, which is not a trailer (found by
 * tests/adversarial/test_request_fuzz.py). */
static enum MHD_Result count_trailer(void *cls, enum MHD_ValueKind kind, const char *key,
                                     size_t key_size, const char *value, size_t value_size)
{
    struct request *r = cls;
    (void)kind;
    (void)key_size;
    (void)value;
    (void)value_size;
    if (key != r->last_field)
        r->trailers++;
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
    struct request *r = *con_cls;
    (void)url;

    if (r == NULL) {
        /* The request object could not be allocated: answer from the
         * response made at start-up, which needs no memory now. */
        struct worker *w = cls;
        return w->oom_response != NULL
                   ? MHD_queue_response(conn, MHD_HTTP_SERVICE_UNAVAILABLE, w->oom_response)
                   : MHD_NO;
    }
    r->conn = conn;
    switch (r->state) {
    case RS_HEADERS:
        r->state = RS_BODY;
        if (!on_headers(r, method, version))
            return queue_answer(r);
        return MHD_YES;
    case RS_BODY:
        if (*upload_data_size > 0) {
            bool ok = append_body(r, upload_data, *upload_data_size);
            *upload_data_size = 0;
            return ok ? MHD_YES : MHD_NO;
        }
        /* Trailer fields after a chunked body (RFC 9112 section 7.1.2) are
         * refused: libmicrohttpd 0.9.75 ends the trailer section at a line
         * that starts with ':' when a field came before it, and parses what
         * follows as the next request, where a front end could have read it
         * as more trailer fields (a request smuggled past it). Nothing tells
         * where the section really ended, so no trailer is trusted; they
         * were never forwarded anyway (the body is sent with a
         * Content-Length), and clients rarely send them. */
        MHD_get_connection_values_n(conn, MHD_FOOTER_KIND, count_trailer, r);
        /* The raw bytes must have framed this request the same way, to its
         * end, without trailer fields: libmicrohttpd drops some trailer
         * lines without recording them (a ':' line, a NUL-led line) and
         * then parses what follows as the next request. */
        if (unchecked_503(r))
            return queue_answer(r);
        if (!wire_check_end(r->slot->wire, (uint64_t)r->body_len + r->body_discarded)) {
            respond_problem(r, 400, "bad-request", "Bad request",
                            "the request's body framing is malformed (a line end other than "
                            "CRLF, a NUL, an invalid chunk or trailer line)",
                            "rejected", 0, true);
            return queue_answer(r);
        }
        if (r->trailers > 0) {
            respond_problem(r, 400, "bad-request", "Bad request",
                            "trailer fields after a chunked request body are not accepted",
                            "rejected", 0, true);
            return queue_answer(r);
        }
        on_complete_request(r);
        if (r->state == RS_RESPOND)
            return queue_answer(r);
        return MHD_YES;
    case RS_RESPOND:
        return queue_answer(r);
    default:
        return MHD_YES;
    }
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    struct worker *w = cls;
    struct request *r = *con_cls;
    (void)conn;

    if (r == NULL)
        return;
    *con_cls = NULL;
    if (r->slot != NULL && r->slot->wire != NULL)
        wire_check_done(r->slot->wire);
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK && r->state != RS_DONE && r->outcome == NULL)
        r->outcome = "aborted";
    if (r->state >= RS_BODY)
        log_request(w, r);
    r->mhd_done = true;
    /* A transfer still running belongs to a request whose client is gone
     * (only possible at shutdown); the record is settled elsewhere. */
    maybe_free(r);
}

/*
 * server.max_connections is one limit for the process. Each worker has its
 * own SO_REUSEPORT listener and the kernel picks one by a hash of the
 * client's address, whatever the worker's load: with the limit split over
 * the workers, a connection hashed to a full worker waited in its listen
 * queue, unanswered, while another worker had free slots. So every daemon
 * may hold the whole limit (plus one per worker, so that libmicrohttpd never
 * stops accepting on its own and leaves a connection queued), and admission
 * is decided here against the count of all workers: an over-limit
 * connection is closed at once. on_accept() refuses while the count is at
 * the limit; two workers may both pass it for the last slot, so the count
 * itself is taken in on_connection() and the loser's socket is shut down
 * there, which libmicrohttpd reads as the client closing. Thread-safe: any
 * worker calls both. server.per_ip_connections is kept the same way, with a
 * count per client address shared by the workers (ip_take/ip_release).
 */
/* The address of a client as 16 bytes (IPv4 mapped into IPv6); false for
 * other families, which have no per-IP limit. */
static bool ip_key(const struct sockaddr *sa, unsigned char out[16])
{
    if (sa == NULL)
        return false;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        memset(out, 0, 10);
        out[10] = 0xff;
        out[11] = 0xff;
        memcpy(out + 12, &in->sin_addr, 4);
        return true;
    }
    if (sa->sa_family == AF_INET6) {
        memcpy(out, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
        return true;
    }
    return false;
}

static struct ip_count **ip_find(struct proxy_server *srv, const unsigned char ip[16])
{
    uint32_t h = 2166136261u; /* FNV-1a */
    struct ip_count **pp;
    for (int i = 0; i < 16; i++)
        h = (h ^ ip[i]) * 16777619u;
    pp = &srv->ip_buckets[h % IP_BUCKETS];
    while (*pp != NULL && memcmp((*pp)->ip, ip, 16) != 0)
        pp = &(*pp)->next;
    return pp;
}

static unsigned ip_connections(struct proxy_server *srv, const unsigned char ip[16])
{
    const struct ip_count *c;
    unsigned n;
    pthread_mutex_lock(&srv->ip_lock);
    c = *ip_find(srv, ip);
    n = c != NULL ? c->n : 0;
    pthread_mutex_unlock(&srv->ip_lock);
    return n;
}

/* Counts one more connection from ip; returns the new count, or 0 when it
 * could not be counted (out of memory: the connection goes uncounted). */
static unsigned ip_take(struct proxy_server *srv, const unsigned char ip[16])
{
    struct ip_count **pp;
    unsigned n = 0;
    pthread_mutex_lock(&srv->ip_lock);
    pp = ip_find(srv, ip);
    if (*pp == NULL) {
        *pp = calloc(1, sizeof(**pp));
        if (*pp != NULL)
            memcpy((*pp)->ip, ip, 16);
    }
    if (*pp != NULL)
        n = ++(*pp)->n;
    pthread_mutex_unlock(&srv->ip_lock);
    return n;
}

static void ip_release(struct proxy_server *srv, const unsigned char ip[16])
{
    struct ip_count **pp;
    pthread_mutex_lock(&srv->ip_lock);
    pp = ip_find(srv, ip);
    if (*pp != NULL && --(*pp)->n == 0) {
        struct ip_count *gone = *pp;
        *pp = gone->next;
        free(gone);
    }
    pthread_mutex_unlock(&srv->ip_lock);
}

static void ip_table_free(struct proxy_server *srv);

static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
    const struct worker *w = cls;
    unsigned per_ip = w->srv->cfg->server.per_ip_connections;
    unsigned char ip[16];
    (void)addrlen;
    if (atomic_load(&w->srv->n_conns) >= w->srv->cfg->server.max_connections)
        return MHD_NO;
    if (per_ip > 0 && ip_key(addr, ip) && ip_connections(w->srv, ip) >= per_ip)
        return MHD_NO;
    return MHD_YES;
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    struct worker *w = cls;

    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        const union MHD_ConnectionInfo *ca =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        struct conn_slot *slot = ci != NULL ? calloc(1, sizeof(*slot)) : NULL;
        unsigned per_ip = w->srv->cfg->server.per_ip_connections;
        bool over = atomic_fetch_add(&w->srv->n_conns, 1) >= w->srv->cfg->server.max_connections;
        /* Counted per address as well when it can be released at the close
         * (needs the slot). */
        if (slot != NULL && per_ip > 0 && ca != NULL && ip_key(ca->client_addr, slot->ip)) {
            unsigned n = ip_take(w->srv, slot->ip);
            slot->ip_counted = n > 0;
            if (n > per_ip)
                over = true;
        }
        /* Every byte read from it goes to a checker of its own (wire_check.h).
         * Without one (out of memory) its requests cannot be checked: each
         * is answered 503 (unchecked_503). */
        if (slot != NULL && !over)
            slot->wire = wire_check_open(ci->connect_fd);
        if (over && ci != NULL)
            shutdown(ci->connect_fd, SHUT_RDWR);
        if (slot != NULL) {
            slot->fd = ci->connect_fd;
            slot->next = w->conns;
            if (w->conns != NULL)
                w->conns->prev = slot;
            w->conns = slot;
            *socket_context = slot;
        }
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        struct conn_slot *slot = *socket_context;
        atomic_fetch_sub(&w->srv->n_conns, 1);
        if (slot != NULL) {
            if (slot->ip_counted)
                ip_release(w->srv, slot->ip);
            if (slot->req != NULL)
                slot->req->slot = NULL;
            wire_check_close(slot->wire);
            if (slot->prev != NULL)
                slot->prev->next = slot->next;
            else
                w->conns = slot->next;
            if (slot->next != NULL)
                slot->next->prev = slot->prev;
            free(slot);
            *socket_context = NULL;
        }
    }
}

static void mhd_log(void *cls, const char *fm, va_list ap)
{
    struct worker *w = cls;
    /* Called on the worker's own thread, from its MHD_run(). libmicrohttpd
     * 0.9.75 passes its messages as "%s\n" and the text. */
    if (w != NULL && w->quiet_app_errors > 0) {
        const char *msg = fm;
        va_list cp;
        va_copy(cp, ap);
        if (strcmp(fm, "%s\n") == 0)
            msg = va_arg(cp, const char *);
        va_end(cp);
        if (msg != NULL && strncmp(msg, "Application reported internal error", 35) == 0) {
            w->quiet_app_errors--;
            return;
        }
    }
    /* Clients cause most of these at will (a request cut short, a
     * malformed one): rate-limited, and never blocking the worker. */
    idem_diag_client("idemproxy: libmicrohttpd: ", fm, ap);
}

/* ---- curl multi glue --------------------------------------------------- */

static struct curl_sock *curl_sock_at(struct worker *w, curl_socket_t s)
{
    size_t fd = (size_t)s;
    if (s < 0)
        return NULL;
    if (fd >= w->n_socks) {
        size_t n = w->n_socks ? w->n_socks : 64;
        struct curl_sock *ns;
        while (n <= fd)
            n *= 2;
        ns = realloc(w->socks, n * sizeof(*ns));
        if (ns == NULL)
            return NULL;
        memset(ns + w->n_socks, 0, (n - w->n_socks) * sizeof(*ns));
        w->socks = ns;
        w->n_socks = n;
    }
    return &w->socks[fd];
}

static int curl_socket_cb(CURL *easy, curl_socket_t s, int what, void *userp, void *socketp)
{
    struct worker *w = userp;
    struct curl_sock *cs = curl_sock_at(w, s);
    struct epoll_event ev = {0};
    (void)easy;
    (void)socketp;

    if (cs == NULL)
        return -1;
    if (what == CURL_POLL_REMOVE) {
        cs->wanted = false; /* parked: stays registered, see struct curl_sock */
        return 0;
    }
    if (what == CURL_POLL_IN || what == CURL_POLL_INOUT)
        ev.events |= EPOLLIN;
    if (what == CURL_POLL_OUT || what == CURL_POLL_INOUT)
        ev.events |= EPOLLOUT;
    ev.data.u64 = ep_data(EP_CURL, s);
    cs->wanted = true;
    if (!cs->registered || cs->events != ev.events) {
        /* The table can only be wrong if a descriptor was closed behind
         * libcurl's close callback and reused: ADD and MOD then fall back
         * on each other rather than fail the transfer. */
        int op = cs->registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
        if (epoll_ctl(w->epfd, op, s, &ev) != 0) {
            op = op == EPOLL_CTL_MOD ? EPOLL_CTL_ADD : EPOLL_CTL_MOD;
            if (epoll_ctl(w->epfd, op, s, &ev) != 0)
                return -1;
        }
        cs->registered = true;
        cs->events = ev.events;
    }
    return 0;
}

/* libcurl closes one of its sockets: its registration goes with it. */
static int curl_close_cb(void *clientp, curl_socket_t s)
{
    struct worker *w = clientp;
    if (s >= 0 && (size_t)s < w->n_socks) {
        w->socks[s].registered = false;
        w->socks[s].wanted = false;
    }
    return close(s);
}

static void curl_sock_event(struct worker *w, int fd, uint32_t events)
{
    struct curl_sock *cs = (size_t)fd < w->n_socks ? &w->socks[fd] : NULL;
    int mask = 0;
    int running;

    if (cs != NULL && !cs->wanted) {
        /* A parked socket has news (the upstream closed it, most likely):
         * stop watching it; libcurl finds out when it next looks. */
        if (cs->registered)
            epoll_ctl(w->epfd, EPOLL_CTL_DEL, fd, NULL);
        cs->registered = false;
        return;
    }
    if (events & EPOLLIN)
        mask |= CURL_CSELECT_IN;
    if (events & EPOLLOUT)
        mask |= CURL_CSELECT_OUT;
    if (events & (EPOLLERR | EPOLLHUP))
        mask |= CURL_CSELECT_ERR;
    curl_multi_socket_action(w->multi, fd, mask, &running);
}

static int curl_timer_cb(CURLM *multi, long timeout_ms, void *userp)
{
    struct worker *w = userp;
    (void)multi;
    w->curl_deadline_ms = timeout_ms < 0 ? -1 : idem_mono_ms() + timeout_ms;
    return 0;
}

static void curl_check_done(struct worker *w)
{
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(w->multi, &left)) != NULL) {
        struct request *r = NULL;
        if (msg->msg != CURLMSG_DONE)
            continue;
        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&r);
        if (r != NULL)
            upstream_done(r, msg->data.result);
    }
}

/* ---- the loop ------------------------------------------------------------ */

static void drain_inbox(struct worker *w)
{
    struct writer_job *jobs;
    struct inbox_key *keys;
    uint64_t v;
    ssize_t rc;

    rc = read(w->evfd, &v, sizeof(v));
    (void)rc;
    pthread_mutex_lock(&w->inbox_lock);
    jobs = w->inbox_jobs;
    keys = w->inbox_keys;
    w->inbox_jobs = NULL;
    w->inbox_keys = NULL;
    pthread_mutex_unlock(&w->inbox_lock);
    while (jobs != NULL) {
        struct writer_job *next = jobs->next;
        on_job(jobs->owner, jobs);
        jobs = next;
    }
    while (keys != NULL) {
        struct inbox_key *next = keys->next;
        on_key_settled(w, keys->key);
        free(keys);
        keys = next;
    }
}

static void tick(struct worker *w, int64_t now)
{
    struct request *r = w->active;
    while (r != NULL) {
        struct request *next = r->next;
        if (r->state == RS_WAITING) {
            if (now >= r->wait_deadline_ms) {
                /* One last look before the 409: the holder (in another
                 * process, say) may have finished since the last poll, up
                 * to POLL_MAX_MS ago. Still running: lookup answers 409,
                 * the deadline being past, with the lease as it is now. */
                lookup(r);
            } else if (now >= r->next_poll_ms) {
                /* Another process may have settled the key. */
                r->poll_step_ms = r->poll_step_ms * 2 > POLL_MAX_MS ? POLL_MAX_MS
                                                                    : r->poll_step_ms * 2;
                lookup(r);
            }
        } else if (r->state == RS_UPSTREAM && r->keyed && !r->hb_pending && !r->lease_lost &&
                   now >= r->next_hb_ms) {
            /* The heartbeat: keep the lease alive while the action runs. */
            struct writer_job *j = &r->hb_job;
            memset(&j->op, 0, sizeof(j->op));
            j->op.kind = STORE_OP_EXTEND;
            memcpy(j->op.key, r->record_key, STORE_KEY_BYTES);
            memcpy(j->op.lease_id, r->lease_id, STORE_LEASE_ID_BYTES);
            j->op.lease_ms = r->route->lease_ms;
            r->next_hb_ms = now + r->route->heartbeat_ms;
            submit(r, j);
        }
        r = next;
    }
}

/* At the drain deadline: settle what is still running. */
static void force_drain(struct worker *w)
{
    struct request *r = w->active;
    while (r != NULL) {
        struct request *next = r->next;
        if (r->state == RS_WAITING) {
            r->problem = "shutting-down";
            respond(r,
                    make_shutting_down("the proxy stopped before the key's holder finished; "
                                       "retry"),
                    503, "unavailable");
        } else if (r->state == RS_UPSTREAM) {
            /* The outcome is unknown: treat it as a timeout, the proxy's
             * own (drain_cut names it so to the client). */
            r->drain_cut = true;
            if (r->ux != NULL) {
                struct upstream_exchange *x = r->ux;
                enum idem_upstream_result res;
                r->ux = NULL;
                /* NOT_SENT when no byte left: nothing ran, released. */
                res = upstream_cancel(x);
                native_body_settle(r, 0); /* its buffer went with it */
                upstream_finish(r, res, 0);
            } else {
                upstream_done(r, CURLE_OPERATION_TIMEDOUT);
            }
        }
        r = next;
    }
}

/*
 * A grace after the drain deadline, store writes are still out: the store's
 * disk is stalled (a commit can wait on it for as long as the device takes),
 * and waiting for it would make the exit wait for the disk, while the README
 * promises the process is gone about a second past server.drain_timeout.
 * Every request still waiting for its write is answered 503 shutting-down
 * now. Never the answer the write was to settle: under durability "sync" a
 * client gets an answer only once the store holds it (README, Failure
 * policy), and a result the store may not hold cannot be replayed to a
 * retry, so the client is told that the action ran and its result may not
 * be stored. Whatever the write does later, the record stays what the model
 * allows for a process gone mid-request: IN_PROGRESS until its lease ends,
 * or what the write made it. The request stays allocated until the writer
 * hands its job back (its job and the payload it stores live in it).
 */
static void give_up_store_waits(struct worker *w)
{
    struct request *r = w->active;
    size_t n = 0;

    while (r != NULL) {
        struct request *next = r->next;
        if (r->job_pending && (r->state == RS_ACQUIRING || r->state == RS_FINISHING)) {
            const char *detail;
            const char *outcome = "unavailable";
            if (r->state == RS_ACQUIRING) {
                detail = "the proxy stopped before the record store took this key "
                         "(server.drain_timeout); nothing was forwarded; retry";
            } else if (r->job.op.kind == STORE_OP_RELEASE && r->response != NULL) {
                /* A release settles nothing the client is promised: its
                 * answer (the upstream's 5xx, or the proxy's 502/504 that
                 * says whether anything was sent) is true whether or not the
                 * release lands; if it does not, the key is freed when its
                 * lease ends. A 503 "retry" would hide that it was sent. */
                struct MHD_Response *resp = response_take(r);
                r->store_abandoned = true;
                respond(r, resp, r->response_status, r->outcome);
                n++;
                r = next;
                continue;
            } else if (r->job.op.kind == STORE_OP_COMPLETE || r->job.op.kind == STORE_OP_EXTEND) {
                detail = "the action ran, but the proxy stopped before the record store "
                         "had stored its result (server.drain_timeout): a retry gets the "
                         "result if the store took it after all, or, once the key's lease "
                         "ends, runs the action again";
                outcome = "unstored";
            } else {
                detail = "the proxy stopped before the record store settled this key "
                         "(server.drain_timeout); it is released when its lease ends; retry";
            }
            r->store_abandoned = true;
            r->problem = "shutting-down";
            respond(r, make_shutting_down(detail), 503, outcome);
            n++;
        }
        r = next;
    }
    if (n > 0)
        idem_diag("idemproxy: stop: the store did not finish %zu request%s' write%s within "
                  "server.drain_timeout and a second (the disk is stalled?): answered 503",
                  n, n == 1 ? "" : "s", n == 1 ? "" : "s");
}

/*
 * Shuts down the connections whose client has closed but that libmicrohttpd
 * will not read again (see struct conn_slot): those reading a request head
 * or body, or idle between requests, whose socket has the FIN and nothing
 * unread; and waiting duplicates whose client has gone (waiter_gone()). A
 * request further on (acquiring, in flight, answering) is left alone: its
 * action runs to the end whoever is still there.
 * The shutdown wakes libmicrohttpd's watch on the socket; it reads the end
 * and closes the connection as a client abort.
 */
static void sweep_closed(struct worker *w)
{
    for (struct conn_slot *c = w->conns; c != NULL; c = c->next) {
        char b;
        if (c->req != NULL && c->req->state == RS_WAITING) {
            if (waiter_gone(c->req))
                drop_waiter(c->req);
            continue;
        }
        if (c->req != NULL && c->req->state > RS_BODY)
            continue;
        if (recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0) {
            shutdown(c->fd, SHUT_RDWR);
            w->mhd_pending = true;
        }
    }
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct proxy_server *srv = w->srv;
    struct epoll_event evs[MAX_EVENTS];
    int64_t next_tick = idem_mono_ms() + TICK_MS;
    char name[16];

    /* Named for top -H, perf and gdb. */
    snprintf(name, sizeof(name), "idem-worker-%d", w->index);
    pthread_setname_np(pthread_self(), name);

    for (;;) {
        int64_t now = idem_mono_ms();
        int timeout;
        int n;
        bool run_mhd = false;
        MHD_UNSIGNED_LONG_LONG mhd_to = 0;

        if (atomic_load(&srv->stopping) && !w->draining) {
            MHD_socket ls = MHD_quiesce_daemon(w->mhd);
            if (ls != MHD_INVALID_SOCKET)
                close(ls);
            w->draining = true;
            w->drain_deadline_ms = now + srv->cfg->server.drain_timeout_ms;
        }
        if (w->draining) {
            if (w->n_requests == 0 && w->n_lingering == 0)
                break;
            if (!w->drain_forced && now >= w->drain_deadline_ms) {
                force_drain(w);
                w->drain_forced = true;
            }
            /* Past the deadline and a grace for the answers just forced,
             * with every record settled: stop, which closes whatever is
             * left (a client still sending its body, a slow reader). Those
             * requests hold no record; nothing of theirs ran. */
            if (w->drain_forced && now >= w->drain_deadline_ms + DRAIN_GRACE_MS &&
                w->n_jobs == 0)
                break;
            /* Records not settled yet: their writes wait for the disk.
             * Answer their clients, and stop a grace later whatever the
             * store does; proxy_server_join() decides how to end. */
            if (w->drain_forced && now >= w->drain_deadline_ms + DRAIN_GRACE_MS &&
                !w->store_given_up) {
                give_up_store_waits(w);
                w->store_given_up = true;
            }
            if (w->store_given_up && now >= w->drain_deadline_ms + 2 * DRAIN_GRACE_MS)
                break;
        }

        timeout = w->n_active > 0 ? (int)(next_tick - now) : IDLE_TICK_MS;
        if (timeout < 0)
            timeout = 0;
        if (w->curl_deadline_ms >= 0) {
            int64_t d = w->curl_deadline_ms - now;
            if (d < 0)
                d = 0;
            if (d < timeout)
                timeout = (int)d;
        }
        if (w->pool != NULL) {
            int64_t d = upstream_next_timeout_ms(w->pool, now);
            if (d >= 0 && d < timeout)
                timeout = (int)d;
        }
        if (MHD_get_timeout(w->mhd, &mhd_to) == MHD_YES && (int64_t)mhd_to < timeout)
            timeout = (int)mhd_to;
        if ((w->draining || w->n_lingering > 0) && timeout > 100)
            timeout = 100;
        log_flush(w);

        n = epoll_wait(w->epfd, evs, MAX_EVENTS, timeout);
        if (n < 0 && errno != EINTR)
            break;
        for (int i = 0; i < n; i++) {
            uint64_t d = evs[i].data.u64;
            enum ep_kind kind = (enum ep_kind)(d & 0xff);
            if (kind == EP_MHD)
                run_mhd = true;
            else if (kind == EP_INBOX)
                drain_inbox(w);
            else if (kind == EP_LINGER)
                linger_event(w, (int)(d >> 8), evs[i].events);
            else if (kind == EP_UPSTREAM)
                upstream_event(w->pool, (int)(d >> 8), evs[i].events);
            else
                curl_sock_event(w, (int)(d >> 8), evs[i].events);
        }
        now = idem_mono_ms();
        if (w->pool != NULL) {
            upstream_expire(w->pool, now);
            native_check_done(w);
        } else {
            if (w->curl_deadline_ms >= 0 && now >= w->curl_deadline_ms) {
                int running;
                w->curl_deadline_ms = -1;
                curl_multi_socket_action(w->multi, CURL_SOCKET_TIMEOUT, 0, &running);
            }
            curl_check_done(w);
        }
        if (w->n_lingering > 0)
            linger_expire(w, now, false);
        if (now >= next_tick) {
            tick(w, now);
            next_tick = now + TICK_MS;
        }
        if (now >= w->next_sweep_ms) {
            sweep_closed(w);
            /* Not replayed since the last sweep, a second ago. */
            if (w->replay_ready != NULL && !w->replay_ready->used)
                replay_ready_drop(w);
            else if (w->replay_ready != NULL)
                w->replay_ready->used = false;
            w->next_sweep_ms = now + SWEEP_MS;
        }
        if (run_mhd || n == 0 || w->draining || w->mhd_pending) {
            w->mhd_pending = false;
            MHD_run(w->mhd);
        }
    }
    linger_expire(w, 0, true);
    log_flush(w);
    return NULL;
}

/* ---- setup ------------------------------------------------------------- */

static int parse_listen(const char *listen, struct sockaddr_storage *ss, socklen_t *sslen,
                        char *err, size_t errlen)
{
    char host[256];
    const char *port;
    const char *colon;
    struct addrinfo hints = {0}, *res = NULL;
    int rc;

    if (listen[0] == '[') {
        const char *end = strchr(listen, ']');
        if (end == NULL || end[1] != ':' || (size_t)(end - listen - 1) >= sizeof(host))
            goto bad;
        memcpy(host, listen + 1, (size_t)(end - listen - 1));
        host[end - listen - 1] = '\0';
        port = end + 2;
    } else {
        colon = strrchr(listen, ':');
        if (colon == NULL || (size_t)(colon - listen) >= sizeof(host))
            goto bad;
        memcpy(host, listen, (size_t)(colon - listen));
        host[colon - listen] = '\0';
        port = colon + 1;
    }
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    rc = getaddrinfo(host[0] ? host : NULL, port, &hints, &res);
    if (rc != 0 || res == NULL) {
        snprintf(err, errlen, "listen: cannot resolve \"%s\": %s", listen, gai_strerror(rc));
        return -1;
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sslen = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
bad:
    snprintf(err, errlen, "listen: \"%s\" is not host:port", listen);
    return -1;
}

static void format_address(const struct sockaddr_storage *ss, char *host, size_t hostlen,
                           int *port)
{
    snprintf(host, hostlen, "?");
    *port = 0;
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *sin = (const struct sockaddr_in *)(const void *)ss;
        inet_ntop(AF_INET, &sin->sin_addr, host, (socklen_t)hostlen);
        *port = ntohs(sin->sin_port);
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *sin6 = (const struct sockaddr_in6 *)(const void *)ss;
        inet_ntop(AF_INET6, &sin6->sin6_addr, host, (socklen_t)hostlen);
        *port = ntohs(sin6->sin6_port);
    }
}

static int open_listener(const struct sockaddr_storage *ss, socklen_t len, char *err,
                         size_t errlen)
{
    int one = 1;
    int fd = socket(ss->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(err, errlen, "listen: socket: %s", strerror(errno));
        return -1;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    /* One listen socket per worker on the same address; the kernel spreads
     * connections over them. claim_listen_address() decides beforehand
     * whether another process may already be in the group. */
    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));
    if (bind(fd, (const struct sockaddr *)ss, len) != 0 || listen(fd, 1024) != 0) {
        snprintf(err, errlen, "listen: cannot bind: %s", strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/*
 * SO_REUSEPORT lets any process of the same user join a listening group, and
 * the kernel then splits new connections between them. A second idemproxy on
 * another store (or anything else) joining ours would split the keys between
 * two stores: a client's retry landing on the other one runs the request
 * again. So the port is shared only with processes on the same store: each
 * listener holds an OFD read lock on <store>/listen-<host>-<port>.lock for
 * its lifetime. Before binding, a socket without SO_REUSEPORT probes the
 * address: if it is taken and nobody on this store holds the lock, the
 * listener is a stranger and start-up fails with EADDRINUSE's meaning.
 * Two processes on different stores starting within the microseconds
 * between one's probe and its bind could still both bind. Resolves port 0
 * into ss. Returns the lock descriptor (kept open while listening) or -1
 * with err set.
 */
static int claim_listen_address(const char *store_path, struct sockaddr_storage *ss,
                                socklen_t *sslen, char *err, size_t errlen)
{
    char host[INET6_ADDRSTRLEN];
    char path[4096];
    int port, one = 1, lock_fd, probe_errno = 0;
    bool taken = false;
    struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET};
    int probe = socket(ss->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (probe < 0) {
        snprintf(err, errlen, "listen: socket: %s", strerror(errno));
        return -1;
    }
    setsockopt(probe, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(probe, (const struct sockaddr *)ss, *sslen) != 0) {
        probe_errno = errno;
        taken = probe_errno == EADDRINUSE;
    } else {
        /* Port 0: the workers bind the port the kernel chose. */
        struct sockaddr_storage bound;
        socklen_t bl = sizeof(bound);
        if (getsockname(probe, (struct sockaddr *)&bound, &bl) == 0) {
            memcpy(ss, &bound, bl);
            *sslen = bl;
        }
    }
    format_address(ss, host, sizeof(host), &port);
    if (probe_errno != 0 && !taken) {
        snprintf(err, errlen, "listen: cannot bind %s:%d: %s", host, port, strerror(probe_errno));
        close(probe);
        return -1;
    }
    if (snprintf(path, sizeof(path), "%s/listen-%s-%d.lock", store_path, host, port) >=
        (int)sizeof(path)) {
        snprintf(err, errlen, "listen: store path too long");
        close(probe);
        return -1;
    }
    lock_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock_fd < 0) {
        snprintf(err, errlen, "listen: cannot open %s: %s", path, strerror(errno));
        close(probe);
        return -1;
    }
    if (taken) {
        struct flock q = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
        if (fcntl(lock_fd, F_OFD_GETLK, &q) != 0) {
            snprintf(err, errlen, "listen: cannot test the lock on %s: %s", path,
                     strerror(errno));
            close(lock_fd);
            close(probe);
            return -1;
        }
        if (q.l_type == F_UNLCK) {
            snprintf(err, errlen,
                     "listen: %s:%d is already in use by a process that is not an idemproxy "
                     "on store %s (sharing a port splits keys between stores)",
                     host, port, store_path);
            close(lock_fd);
            close(probe);
            return -1;
        }
    }
    /* Blocks only while a process on this store holds a write lock, which
     * none takes: the read lock is granted at once. */
    if (fcntl(lock_fd, F_OFD_SETLKW, &fl) != 0) {
        snprintf(err, errlen, "listen: cannot lock %s: %s", path, strerror(errno));
        close(lock_fd);
        close(probe);
        return -1;
    }
    close(probe);
    return lock_fd;
}

/*
 * The pool holds a request of up to header_memory (as request_pool_bytes()
 * counts it) and an answer's header block of up to response_header_max(),
 * see POOL_ENTRY_BYTES. A header block that overflows the pool gets
 * libmicrohttpd's own HTML 431; blocks between header_memory and the pool
 * get the proxy's problem+json 431. The pool is not made larger than it
 * needs: libmicrohttpd clears it on every keep-alive request (a 256 KiB
 * pool cost 15 % of the CPU of a request under the unique leg, and 64 KiB
 * still 10 % under replay), and every connection that served a request
 * keeps all of it resident.
 */
static size_t mhd_memory_bytes(const struct config *cfg)
{
    size_t m = cfg->server.header_memory_bytes + response_header_max(cfg) + POOL_ANSWER_MARGIN;
    return m < 16 * 1024 ? 16 * 1024 : m;
}

static int worker_init(struct worker *w, int listen_fd, char *err, size_t errlen)
{
    const struct config *cfg = w->srv->cfg;
    unsigned n = w->srv->n_workers;
    /* See on_connection(): the process-wide limit is enforced there. */
    unsigned mhd_limit = cfg->server.max_connections + n;
    unsigned curl_cache = cfg->server.max_connections / n;
    unsigned timeout_s = (unsigned)((cfg->server.client_timeout_ms + 999) / 1000);
    const union MHD_DaemonInfo *info;
    struct epoll_event ev = {0};

    if (curl_cache == 0)
        curl_cache = 1;
    w->listen_fd = listen_fd;
    w->curl_deadline_ms = -1;
    pthread_mutex_init(&w->inbox_lock, NULL);
    w->logbuf = malloc(LOG_FLUSH_BYTES + 2048);
    w->epfd = epoll_create1(EPOLL_CLOEXEC);
    w->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->logbuf == NULL || w->epfd < 0 || w->evfd < 0) {
        snprintf(err, errlen, "worker: %s", strerror(errno));
        return -1;
    }
    w->mhd = MHD_start_daemon(
        MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | MHD_USE_TURBO, 0, on_accept,
        w, on_request, w, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, w, MHD_OPTION_LISTEN_SOCKET, (MHD_socket)listen_fd,
        MHD_OPTION_URI_LOG_CALLBACK, on_uri, w, MHD_OPTION_NOTIFY_COMPLETED, on_completed, w,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, w, MHD_OPTION_CONNECTION_LIMIT, mhd_limit,
        MHD_OPTION_CONNECTION_TIMEOUT, timeout_s, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
        mhd_memory_bytes(cfg), MHD_OPTION_END);
    if (w->mhd == NULL) {
        snprintf(err, errlen, "libmicrohttpd: cannot start the server");
        return -1;
    }
    info = MHD_get_daemon_info(w->mhd, MHD_DAEMON_INFO_EPOLL_FD);
    if (info == NULL) {
        snprintf(err, errlen, "libmicrohttpd: no epoll descriptor");
        return -1;
    }
    ev.events = EPOLLIN;
    ev.data.u64 = ep_data(EP_MHD, info->epoll_fd);
    if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, info->epoll_fd, &ev) != 0) {
        snprintf(err, errlen, "epoll: %s", strerror(errno));
        return -1;
    }
    ev.data.u64 = ep_data(EP_INBOX, w->evfd);
    if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->evfd, &ev) != 0) {
        snprintf(err, errlen, "epoll: %s", strerror(errno));
        return -1;
    }
    if (w->srv->origin != NULL) {
        struct upstream_options uo = {
            .connect_timeout_ms = cfg->upstream.connect_timeout_ms,
            .timeout_ms = cfg->upstream.timeout_ms,
            .max_header_bytes = response_header_max(cfg),
            .max_response_bytes = cfg->upstream.max_response_bytes,
            .max_idle = UPSTREAM_IDLE_MAX,
            .idle_timeout_ms = cfg->upstream.idle_timeout_ms,
            .body_grew = native_body_grew,
        };
        if (upstream_pool_new(w->srv->origin, &uo, w->epfd, EP_UPSTREAM, &w->pool) != 0) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
    } else {
        w->multi = curl_multi_init();
        if (w->multi == NULL) {
            snprintf(err, errlen, "libcurl: cannot create a multi handle");
            return -1;
        }
    }
    if (w->multi != NULL) {
        /* The socket table covers every descriptor the process may open, so
         * libcurl's socket callback never allocates (a failed allocation
         * there left a transfer hanging). */
        struct rlimit rl;
        size_t nfd = 65536;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
            nfd = rl.rlim_cur < (1u << 20) ? (size_t)rl.rlim_cur : (1u << 20);
        w->socks = calloc(nfd, sizeof(*w->socks));
        if (w->socks == NULL) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        w->n_socks = nfd;
    }
    {
        static const char body[] = "{\"type\":\"urn:idemproxy:problem:out-of-memory\","
                                   "\"title\":\"Out of memory\",\"status\":503,"
                                   "\"detail\":\"the proxy could not hold this request\"}";
        w->oom_response = MHD_create_response_from_buffer(sizeof(body) - 1, (void *)body,
                                                          MHD_RESPMEM_PERSISTENT);
        if (w->oom_response == NULL) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        MHD_add_response_header(w->oom_response, "Content-Type", "application/problem+json");
        MHD_add_response_header(w->oom_response, "Retry-After", "1");
        MHD_add_response_header(w->oom_response, "Connection", "close");
    }
    if (w->multi != NULL) {
        curl_multi_setopt(w->multi, CURLMOPT_SOCKETFUNCTION, curl_socket_cb);
        curl_multi_setopt(w->multi, CURLMOPT_SOCKETDATA, w);
        curl_multi_setopt(w->multi, CURLMOPT_TIMERFUNCTION, curl_timer_cb);
        curl_multi_setopt(w->multi, CURLMOPT_TIMERDATA, w);
        curl_multi_setopt(w->multi, CURLMOPT_MAXCONNECTS, (long)curl_cache);
    }
    return 0;
}

/* Stops the daemon; first resumes anything still suspended, since MHD must
 * not stop with suspended connections. The writer may still deliver. */
static void worker_stop_daemon(struct worker *w)
{
    struct request *r = w->active;
    while (r != NULL) {
        struct request *next = r->next;
        if (r->suspended) {
            r->suspended = false;
            MHD_resume_connection(r->conn);
        }
        r = next;
    }
    if (w->mhd != NULL)
        MHD_stop_daemon(w->mhd);
    w->mhd = NULL;
    replay_ready_drop(w);
}

/* Frees the rest, once the writer has stopped: nothing is delivered any
 * more, so what is left in the inbox (wake-ups for keys settled after this
 * worker stopped) is freed here. */
static void worker_fini(struct worker *w)
{
    worker_stop_daemon(w);
    /* The stop closes what is left, and the access-log lines of those
     * requests are written on the way (on_completed). */
    log_flush(w);
    while (w->inbox_keys != NULL) {
        struct inbox_key *next = w->inbox_keys->next;
        free(w->inbox_keys);
        w->inbox_keys = next;
    }
    if (w->multi != NULL)
        curl_multi_cleanup(w->multi);
    upstream_pool_free(w->pool);
    w->pool = NULL;
    free(w->socks);
    if (w->oom_response != NULL)
        MHD_destroy_response(w->oom_response);
    if (w->epfd >= 0)
        close(w->epfd);
    if (w->evfd >= 0)
        close(w->evfd);
    pthread_mutex_destroy(&w->inbox_lock);
    free(w->logbuf);
}

/* For upstream.client "libcurl", which resolves only when it connects:
 * does the URL's host resolve now (for the start-up warning)? And is it a
 * literal address (*literal), which always does? */
static bool curl_host_check(const char *url, bool *literal)
{
    CURLU *u = curl_url();
    char *host = NULL;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
    bool ok = true; /* when in doubt, no warning */

    *literal = false;

    if (u != NULL && curl_url_set(u, CURLUPART_URL, url, 0) == CURLUE_OK &&
        curl_url_get(u, CURLUPART_HOST, &host, 0) == CURLUE_OK) {
        size_t n = strlen(host);
        const char *name = host;
        if (n >= 2 && host[0] == '[' && host[n - 1] == ']') { /* an IPv6 literal */
            host[n - 1] = '\0';
            name = host + 1;
        }
        ok = getaddrinfo(name, NULL, &hints, &ai) == 0;
        if (ai != NULL)
            freeaddrinfo(ai);
        ai = NULL;
        hints.ai_flags = AI_NUMERICHOST;
        *literal = getaddrinfo(name, NULL, &hints, &ai) == 0;
        if (ai != NULL)
            freeaddrinfo(ai);
    }
    curl_free(host);
    curl_url_cleanup(u);
    return ok;
}

int proxy_server_start(const struct config *cfg, struct store *st, struct proxy_server **out,
                       char *err, size_t errlen)
{
    struct proxy_server *srv = NULL;
    struct sockaddr_storage ss;
    socklen_t sslen = 0;
    unsigned n;
    int rc = -1;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned started = 0;
    bool resolves = true; /* (libcurl's host, at start) */

    n = cfg->server.workers ? cfg->server.workers : (cores > 0 ? (unsigned)cores : 1);
    if (n > 64)
        n = 64;
    /* Client bytes reach wire_check through this process's recv(), which
     * must be the one libmicrohttpd calls (wire_check.h). */
    {
        struct rlimit rl;
        size_t nfd = 65536;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
            nfd = rl.rlim_cur < (1u << 20) ? (size_t)rl.rlim_cur : (1u << 20);
        if (wire_check_global_init(nfd) != 0) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        if (!wire_check_interposed()) {
            snprintf(err, errlen, "cannot check client bytes: this build's recv() is not the "
                                  "one libmicrohttpd calls (linked statically?)");
            return -1;
        }
    }
    srv = calloc(1, sizeof(*srv));
    if (srv == NULL)
        goto fail;
    srv->cfg = cfg;
    srv->store = st;
    srv->max_buffered =
        cfg->server.max_buffered_bytes ? cfg->server.max_buffered_bytes : max_buffered_auto(cfg);
    {
        /* The store's salt, so every process on it (and show-key) logs a
         * key alike. Without one (a store too full to take it) a salt of
         * this process's own keeps the hash unguessable, not comparable. */
        struct store_stats stats;
        if (store_stats(st, &stats) == 0 && stats.has_log_salt) {
            memcpy(srv->log_salt, stats.log_salt, sizeof(srv->log_salt));
        } else if (getrandom(srv->log_salt, sizeof(srv->log_salt), 0) !=
                   (ssize_t)sizeof(srv->log_salt)) {
            snprintf(err, errlen, "cannot read random bytes for the access log's key hash");
            free(srv);
            return -1;
        } else {
            idem_diag("idemproxy: store: warning: the store has no log salt and could not take "
                      "one (full?): this process's access-log key hashes are its own, and "
                      "show-key's log_key will not match them");
        }
    }
    pthread_mutex_init(&srv->ip_lock, NULL);
    srv->listen_lock_fd = -1;
    srv->n_workers = n;
    srv->upstream_base = strdup(cfg->upstream.url);
    srv->workers = calloc(n, sizeof(*srv->workers));
    srv->shares = replay_share_new(&srv->buffered, srv->max_buffered);
    if (srv->upstream_base == NULL || srv->workers == NULL || srv->shares == NULL) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    {
        size_t l = strlen(srv->upstream_base);
        while (l > 0 && srv->upstream_base[l - 1] == '/')
            srv->upstream_base[--l] = '\0';
    }
    if (cfg->upstream.client == CONFIG_UPSTREAM_NATIVE &&
        upstream_origin_new(srv->upstream_base, cfg->upstream.resolve_interval_ms, &srv->origin,
                            err, errlen) != 0)
        goto fail;
    if (cfg->upstream.client != CONFIG_UPSTREAM_NATIVE)
        resolves = curl_host_check(srv->upstream_base, &srv->upstream_literal);
    for (unsigned i = 0; i < n; i++) {
        srv->workers[i].srv = srv;
        srv->workers[i].index = (int)i;
        srv->workers[i].epfd = -1;
        srv->workers[i].evfd = -1;
    }
    if (parse_listen(cfg->listen, &ss, &sslen, err, errlen) != 0)
        goto fail;
    if (cfg->access_log &&
        proxy_access_log_new(STDOUT_FILENO, ACCESS_LOG_BUFFER_BYTES, &srv->access_log) != 0) {
        snprintf(err, errlen, "cannot start the access log");
        goto fail;
    }
    {
        struct writer_options wo = {
            .store = st,
            .deliver = deliver,
            .ctx = srv,
            .max_batch = 1024,
            .purge_interval_ms = cfg->store.purge_interval_ms,
            .sync_interval_ms = cfg->store.durability == CONFIG_DURABILITY_INTERVAL
                                    ? cfg->store.sync_interval_ms
                                    : 0,
        };
        if (writer_start(&wo, &srv->writer) != 0) {
            snprintf(err, errlen, "cannot start the store writer");
            goto fail;
        }
    }
    srv->listen_lock_fd = claim_listen_address(cfg->store.path, &ss, &sslen, err, errlen);
    if (srv->listen_lock_fd < 0)
        goto fail;
    for (unsigned i = 0; i < n; i++) {
        int fd = open_listener(&ss, sslen, err, errlen);
        if (fd < 0)
            goto fail;
        if (worker_init(&srv->workers[i], fd, err, errlen) != 0) {
            close(fd);
            goto fail;
        }
    }
    for (started = 0; started < n; started++) {
        if (pthread_create(&srv->workers[started].thread, NULL, worker_main,
                           &srv->workers[started]) != 0) {
            snprintf(err, errlen, "cannot start worker threads");
            goto fail;
        }
    }
    {
        char host[INET6_ADDRSTRLEN];
        int port;
        format_address(&ss, host, sizeof(host), &port);
        fprintf(stderr,
                "idemproxy: listening on %s:%d, %u workers, upstream %s, store %s, "
                "max_buffered %.0fMiB\n",
                host, port, n, srv->upstream_base, cfg->store.path,
                (double)srv->max_buffered / (1024.0 * 1024.0));
        if (srv->origin != NULL && !upstream_origin_resolved(srv->origin))
            fprintf(stderr,
                    "idemproxy: warning: the upstream's host does not resolve (yet); forwarded "
                    "requests get 502 until it does (looked up again every second)\n");
        else if (srv->origin == NULL && !resolves)
            fprintf(stderr,
                    "idemproxy: warning: the upstream's host does not resolve (yet); forwarded "
                    "requests get 502 until it does (looked up again when a connection is "
                    "made)\n");
    }
    *out = srv;
    return 0;
fail:
    if (srv != NULL) {
        atomic_store(&srv->stopping, 1);
        for (unsigned i = 0; i < started; i++) {
            uint64_t one = 1;
            ssize_t wr = write(srv->workers[i].evfd, &one, sizeof(one));
            (void)wr;
            pthread_join(srv->workers[i].thread, NULL);
        }
        for (unsigned i = 0; srv->workers != NULL && i < n; i++)
            worker_stop_daemon(&srv->workers[i]);
        writer_stop(srv->writer);
        for (unsigned i = 0; srv->workers != NULL && i < n; i++)
            worker_fini(&srv->workers[i]);
        if (srv->listen_lock_fd >= 0)
            close(srv->listen_lock_fd);
        proxy_access_log_free(srv->access_log, ACCESS_LOG_STOP_FLUSH_MS);
        free(srv->workers);
        free(srv->upstream_base);
        upstream_origin_free(srv->origin);
        replay_share_free(srv->shares); /* every response is gone */
        ip_table_free(srv);
        free(srv);
    }
    return rc;
}

/* Frees the per-IP counts (connections all closed, or never opened). */
static void ip_table_free(struct proxy_server *srv)
{
    for (size_t i = 0; i < IP_BUCKETS; i++) {
        while (srv->ip_buckets[i] != NULL) {
            struct ip_count *next = srv->ip_buckets[i]->next;
            free(srv->ip_buckets[i]);
            srv->ip_buckets[i] = next;
        }
    }
    pthread_mutex_destroy(&srv->ip_lock);
}

void proxy_server_stop(struct proxy_server *srv)
{
    srv->stop_ms = idem_mono_ms();
    atomic_store(&srv->stopping, 1);
    for (unsigned i = 0; i < srv->n_workers; i++) {
        uint64_t one = 1;
        ssize_t wr = write(srv->workers[i].evfd, &one, sizeof(one));
        (void)wr;
    }
}

/* The requests a worker answered at the stop with their store write still
 * out (give_up_store_waits) whose jobs the writer handed back after the
 * worker stopped: freed now that the writer has stopped too. */
static void free_abandoned(struct worker *w)
{
    while (w->inbox_jobs != NULL) {
        struct writer_job *j = w->inbox_jobs;
        struct request *r = j->owner;
        w->inbox_jobs = j->next;
        w->n_jobs--;
        if (j == &r->hb_job)
            r->hb_pending = false;
        else
            r->job_pending = false;
        maybe_free(r);
    }
}

/* At the exit every request is freed and every response gone, so nothing
 * is counted against server.max_buffered any more. A count left over is a
 * request that took more than it gave back (a running process would refuse
 * requests for memory it does not hold): said on stderr, and fatal in a
 * build with assertions, where the tests run. */
static void buffered_left_check(struct proxy_server *srv)
{
    uint64_t left = atomic_load(&srv->buffered);

    if (left == 0)
        return;
    idem_diag("idemproxy: internal error: %" PRIu64
              " bytes still counted against server.max_buffered at exit",
              left);
#ifndef NDEBUG
    abort();
#endif
}

int proxy_server_join(struct proxy_server *srv)
{
    int64_t by;

    for (unsigned i = 0; i < srv->n_workers; i++)
        pthread_join(srv->workers[i].thread, NULL);
    for (unsigned i = 0; i < srv->n_workers; i++) {
        worker_stop_daemon(&srv->workers[i]);
        /* The access-log lines of the connections the stop closed. */
        log_flush(&srv->workers[i]);
    }
    /* Every record is settled, or its client was answered without it; the
     * writer applies what is queued. Not past the end of the grace the
     * workers gave the store: a commit still waiting for the disk then
     * would hold up the exit for as long as the disk takes, which is
     * unbounded (a cloud volume's stall, a dead device). */
    by = srv->stop_ms + srv->cfg->server.drain_timeout_ms + 2 * DRAIN_GRACE_MS;
    /* The workers stop at that time at the earliest, so the writer gets a
     * moment of its own: one idle, or that just delivered, stops in it,
     * and only a commit still in the disk makes the exit 75. */
    if (by < idem_mono_ms() + WRITER_LAST_MS)
        by = idem_mono_ms() + WRITER_LAST_MS;
    if (writer_stop_by(srv->writer, by) != 0) {
        /* The writer may still deliver into the workers, which must stay
         * as they are: leave everything allocated for the exit. */
        close(srv->listen_lock_fd);
        proxy_access_log_free(srv->access_log, ACCESS_LOG_STOP_FLUSH_MS);
        return PROXY_STORE_STUCK;
    }
    srv->writer = NULL; /* freed: request_free() of an abandoned request forgets no lease */
    for (unsigned i = 0; i < srv->n_workers; i++) {
        free_abandoned(&srv->workers[i]);
        worker_fini(&srv->workers[i]);
    }
    /* The listeners are closed: another store may take the port now. */
    close(srv->listen_lock_fd);
    /* Bounded: a stdout nobody reads does not hold up the exit. */
    proxy_access_log_free(srv->access_log, ACCESS_LOG_STOP_FLUSH_MS);
    free(srv->workers);
    free(srv->upstream_base);
    upstream_origin_free(srv->origin);
    replay_share_free(srv->shares); /* every response is gone */
    ip_table_free(srv);
    buffered_left_check(srv);
    free(srv);
    return 0;
}
