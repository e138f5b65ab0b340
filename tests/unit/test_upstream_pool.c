/*
 * test_upstream_pool.c - the native upstream client's idle pool
 * (proxy/upstream.h) against a real listening socket that the test answers
 * by hand: a connection idle for idle_timeout_ms is never reused, not even
 * behind a newer one the upstream has closed, and the pool closes it on its
 * own once due. And an answer's body buffer is told to opt.body_grew as it
 * grows, adding up to its final body_cap.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "upstream.h"

#define IDLE_TIMEOUT_MS 400

struct rig {
    int listen_fd;
    int epfd;
    struct upstream_origin *origin;
    struct upstream_pool *pool;
    int done;                /* exchanges finished */
    enum idem_upstream_result last;
    char last_body[256];     /* the last answer's body, when there was one */
    size_t last_cap;         /* and its body_cap */
    size_t grown;            /* what opt.body_grew was told, in all */
    int grew_calls;
};

static void on_body_grew(void *ctx, size_t more)
{
    struct rig *r = ctx;
    r->grown += more;
    r->grew_calls++;
}

static int setup(void **state)
{
    struct rig *r = calloc(1, sizeof *r);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    char url[64], err[200];
    struct upstream_options opt = {.connect_timeout_ms = 2000,
                                   .timeout_ms = 5000,
                                   .max_header_bytes = 8192,
                                   .max_response_bytes = 1 << 20,
                                   .max_idle = 64,
                                   .idle_timeout_ms = IDLE_TIMEOUT_MS,
                                   .body_grew = on_body_grew};

    assert_non_null(r);
    r->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(r->listen_fd >= 0);
    assert_int_equal(bind(r->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(r->listen_fd, 16), 0);
    assert_int_equal(getsockname(r->listen_fd, (struct sockaddr *)&a, &alen), 0);
    snprintf(url, sizeof url, "http://127.0.0.1:%u", (unsigned)ntohs(a.sin_port));
    assert_int_equal(upstream_origin_new(url, 30000, &r->origin, err, sizeof err), 0);
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    assert_true(r->epfd >= 0);
    assert_int_equal(upstream_pool_new(r->origin, &opt, r->epfd, 7, &r->pool), 0);
    *state = r;
    return 0;
}

static int teardown(void **state)
{
    struct rig *r = *state;
    upstream_pool_free(r->pool);
    upstream_origin_free(r->origin);
    close(r->epfd);
    close(r->listen_fd);
    free(r);
    return 0;
}

/* The worker loop, for ms milliseconds or until `until` exchanges are done. */
static void pump(struct rig *r, int64_t ms, int until)
{
    int64_t end = idem_mono_ms() + ms;

    while (r->done < until || until < 0) {
        struct epoll_event ev[16];
        struct upstream_exchange *x;
        int64_t now = idem_mono_ms(), d;
        int t, n;
        if (now >= end)
            break;
        t = (int)(end - now);
        d = upstream_next_timeout_ms(r->pool, now);
        if (d >= 0 && d < t)
            t = (int)d;
        n = epoll_wait(r->epfd, ev, 16, t);
        for (int i = 0; i < n; i++)
            upstream_event(r->pool, (int)(ev[i].data.u64 >> 8), ev[i].events);
        upstream_expire(r->pool, idem_mono_ms());
        while ((x = upstream_take_done(r->pool)) != NULL) {
            r->last = upstream_exchange_result(x);
            r->last_body[0] = '\0';
            r->last_cap = 0;
            if (r->last == IDEM_UPSTREAM_RESPONSE) {
                const struct upstream_response *resp = upstream_exchange_response(x);
                r->last_cap = resp->body_cap;
                snprintf(r->last_body, sizeof r->last_body, "%.*s", (int)resp->body_len,
                         resp->body != NULL ? (const char *)resp->body : "");
            }
            r->done++;
            upstream_exchange_free(x);
        }
    }
}

static void start(struct rig *r, const char *method, const char *target)
{
    static const struct idem_headers none;
    bool get = strcmp(method, "GET") == 0;
    struct upstream_request req = {.method = method,
                                   .target = target,
                                   .target_len = strlen(target),
                                   .headers = &none,
                                   .send_length = !get,
                                   .may_retry = get};
    struct upstream_exchange *x;
    assert_int_equal(upstream_start(r->pool, &req, r, &x), 0);
}

/* Accepts the next connection the pool makes, waiting up to 2 s. */
static int accept_conn(struct rig *r)
{
    struct pollfd p = {.fd = r->listen_fd, .events = POLLIN};
    int fd;
    for (int i = 0; i < 200 && poll(&p, 1, 0) == 0; i++)
        pump(r, 10, -1);
    assert_int_equal(poll(&p, 1, 0), 1);
    fd = accept(r->listen_fd, NULL, NULL);
    assert_true(fd >= 0);
    return fd;
}

/* Reads one request head on fd (the pool's requests have no body) and
 * returns its first line; the pool runs meanwhile. */
static void read_request(struct rig *r, int fd, char *line, size_t cap)
{
    char buf[4096];
    size_t len = 0;
    while (len < sizeof buf - 1) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        ssize_t n;
        if (poll(&p, 1, 0) == 0) {
            pump(r, 10, -1);
            continue;
        }
        n = recv(fd, buf + len, sizeof buf - 1 - len, 0);
        assert_true(n > 0);
        len += (size_t)n;
        buf[len] = '\0';
        if (strstr(buf, "\r\n\r\n") != NULL)
            break;
    }
    snprintf(line, cap, "%.*s", (int)strcspn(buf, "\r"), buf);
}

static void answer(int fd)
{
    static const char ok[] = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    assert_int_equal(send(fd, ok, sizeof ok - 1, MSG_NOSIGNAL), (ssize_t)(sizeof ok - 1));
}

/* What the server side of a pooled connection sees: 1 a byte, 0 the pool
 * closed it, -1 nothing yet. */
static int peer_state(int fd)
{
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_DONTWAIT | MSG_PEEK);
    if (n > 0)
        return 1;
    if (n == 0)
        return 0;
    return errno == EAGAIN || errno == EWOULDBLOCK ? -1 : 0;
}

static void reused_within_the_timeout_and_closed_after(void **state)
{
    struct rig *r = *state;
    char line[128];
    int a;

    start(r, "GET", "/first");
    a = accept_conn(r);
    read_request(r, a, line, sizeof line);
    assert_string_equal(line, "GET /first HTTP/1.1");
    answer(a);
    pump(r, 2000, 1);
    assert_int_equal(r->last, IDEM_UPSTREAM_RESPONSE);

    /* Within the timeout: the same connection. */
    pump(r, IDLE_TIMEOUT_MS / 2, -1);
    start(r, "POST", "/second");
    read_request(r, a, line, sizeof line);
    assert_string_equal(line, "POST /second HTTP/1.1");
    answer(a);
    pump(r, 2000, 2);
    assert_int_equal(r->last, IDEM_UPSTREAM_RESPONSE);

    /* Past it, with no request asking: the pool closes it itself. */
    assert_int_equal(peer_state(a), -1);
    pump(r, IDLE_TIMEOUT_MS + 200, -1);
    assert_int_equal(peer_state(a), 0);
    close(a);
}

/*
 * Two idle connections: A (older, past the timeout) behind B (newer, which
 * the upstream has closed, and whose close the loop has not seen yet). A
 * request that may not be resent skips B, and must not take A either: it
 * gets a new connection. (It used to take A: only the newest was checked.)
 */
static void too_old_behind_a_closed_one_not_reused(void **state)
{
    struct rig *r = *state;
    char line[128];
    int a, b, c;

    start(r, "GET", "/a");
    start(r, "GET", "/b");
    a = accept_conn(r);
    b = accept_conn(r);
    read_request(r, a, line, sizeof line);
    read_request(r, b, line, sizeof line);
    answer(a);
    pump(r, 2000, 1);
    pump(r, IDLE_TIMEOUT_MS / 2, -1);
    answer(b);
    pump(r, 2000, 2);
    assert_int_equal(r->last, IDEM_UPSTREAM_RESPONSE);

    /* The loop is busy elsewhere: B is closed by the upstream, A passes
     * its timeout, and no event or sweep runs before the next request. */
    shutdown(b, SHUT_WR);
    usleep((IDLE_TIMEOUT_MS / 2 + 150) * 1000);
    start(r, "POST", "/keyed");

    c = accept_conn(r);
    read_request(r, c, line, sizeof line);
    assert_string_equal(line, "POST /keyed HTTP/1.1");
    assert_int_not_equal(peer_state(a), 1); /* nothing was written into A */
    answer(c);
    pump(r, 2000, 3);
    assert_int_equal(r->last, IDEM_UPSTREAM_RESPONSE);
    close(a);
    close(b);
    close(c);
}

/* Bytes the upstream sends after a complete answer (a 408 at its idle
 * timeout, a body past its Content-Length, a HEAD answer's body) wait in
 * the idle connection until the loop's next epoll_wait. A request taking
 * the connection before that, a GET (one that may be resent) too, must not
 * read them as its answer: the peek at take sees them, and the request
 * goes on a new connection. */
static void bytes_waiting_on_an_idle_connection_are_not_an_answer(void **state)
{
    struct rig *r = *state;
    static const char stray[] = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray";
    char line[128];
    int a, b;

    for (int i = 0; i < 2; i++) {
        const char *method = i == 0 ? "GET" : "POST";
        start(r, "GET", "/first");
        a = accept_conn(r);
        read_request(r, a, line, sizeof line);
        answer(a);
        pump(r, 2000, r->done + 1);
        assert_string_equal(r->last_body, "ok");
        assert_int_equal(send(a, stray, sizeof stray - 1, MSG_NOSIGNAL), (ssize_t)(sizeof stray - 1));
        usleep(50 * 1000); /* arrived; the loop has not looked */
        start(r, method, "/second");
        b = accept_conn(r);
        read_request(r, b, line, sizeof line);
        assert_non_null(strstr(line, "/second"));
        answer(b);
        pump(r, 2000, r->done + 1);
        assert_int_equal(r->last, IDEM_UPSTREAM_RESPONSE);
        assert_string_equal(r->last_body, "ok");
        close(a);
        close(b);
    }
}

static void send_all(int fd, const char *b, size_t n)
{
    assert_int_equal(send(fd, b, n, MSG_NOSIGNAL), (ssize_t)n);
}

static void send_str(int fd, const char *s)
{
    send_all(fd, s, strlen(s));
}

/* Told while the answer arrives, not once it is done, and in all exactly the
 * body_cap the caller takes over: with a Content-Length all of it once the
 * header block is in, a buffer of exactly that length (it was the power of
 * two above it: up to twice the memory), chunked as the buffer doubles. */
static void body_growth_told_as_it_arrives(void **state)
{
    struct rig *r = *state;
    static char filler[100000];
    char line[128], head[128];
    int a;

    memset(filler, 'x', sizeof filler);
    start(r, "POST", "/length");
    a = accept_conn(r);
    read_request(r, a, line, sizeof line);
    send_str(a, "HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n");
    send_all(a, filler, 10);
    pump(r, 200, -1);
    assert_int_equal(r->done, 0);
    assert_int_equal(r->grown, 100000); /* exactly the length: no more is held */
    send_all(a, filler, 100000 - 10);
    pump(r, 2000, 1);
    assert_int_equal(r->last, IDEM_UPSTREAM_RESPONSE);
    assert_int_equal(r->last_cap, 100000);
    assert_int_equal(r->grown, 100000);
    assert_int_equal(r->grew_calls, 1);

    /* The same connection, reused within the timeout. */
    r->grown = 0;
    r->grew_calls = 0;
    start(r, "POST", "/chunked");
    read_request(r, a, line, sizeof line);
    assert_string_equal(line, "POST /chunked HTTP/1.1");
    send_str(a, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
    snprintf(head, sizeof head, "%x\r\n", 5000);
    send_str(a, head);
    send_all(a, filler, 5000);
    send_str(a, "\r\n");
    pump(r, 200, -1);
    assert_int_equal(r->done, 1);
    assert_int_equal(r->grown, 8192);
    snprintf(head, sizeof head, "%x\r\n", 60000);
    send_str(a, head);
    send_all(a, filler, 60000);
    send_str(a, "\r\n0\r\n\r\n");
    pump(r, 2000, 2);
    assert_int_equal(r->last, IDEM_UPSTREAM_RESPONSE);
    assert_int_equal(r->last_cap, 65536);
    assert_int_equal(r->grown, 65536);
    assert_true(r->grew_calls >= 2);
    close(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(reused_within_the_timeout_and_closed_after, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(too_old_behind_a_closed_one_not_reused, setup, teardown),
        cmocka_unit_test_setup_teardown(bytes_waiting_on_an_idle_connection_are_not_an_answer,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(body_growth_told_as_it_arrives, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
