/*
 * slow_upstream.c - the benchmark's slow upstream: answers every request with
 * 201 and a small JSON body after a fixed delay, on keep-alive connections.
 *
 *   slow_upstream [--listen 127.0.0.1:PORT] [--delay-ms 50]
 *
 * Stock nginx cannot delay a response without a third-party module, and the
 * Python test upstream (tests/upstream/upstream.py) cannot sustain the
 * ~5,000 req/s of 256 connections x 50 ms, so the slow leg uses this: one
 * thread, one epoll loop, non-blocking sockets. The delay is the same for
 * every request, so the pending answers form a FIFO ordered by deadline and
 * the loop only ever waits for the head of that queue. It handles thousands
 * of connections at a few microseconds of CPU per request, so it is never
 * the bottleneck of the leg; the SAME process serves idemproxy and the nginx
 * proxy in the slow leg (bench/run).
 *
 * It reads a request's head up to the blank line, then Content-Length bytes
 * of body (chunked request bodies are answered 400 and closed: neither proxy
 * sends them here). Pipelined requests are answered in order, one at a time.
 * SIGTERM/SIGINT: prints the number of answers to stderr and exits 0.
 * Binds only the address it is given (127.0.0.1 by default).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memmem, accept4 */
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_HEAD 65536
#define MAX_EVENTS 256

static const char body[] = "{\"id\":\"pay_bench\",\"status\":\"created\",\"amount\":100}";

struct conn {
    int fd;
    char *buf; /* received bytes not consumed yet */
    size_t len, cap;
    size_t need; /* bytes of the current request (head + body); 0 = unknown */
    int queued;  /* an answer is pending in the FIFO */
    int dead;    /* closed while queued: freed when dequeued */
    int close_after;
    char *out; /* unsent answer bytes */
    size_t out_len, out_off;
    int64_t due_ns;
    struct conn *qnext;
};

static volatile sig_atomic_t stop;
static int epfd;
static struct conn *qhead, *qtail;
static char response[512];
static size_t response_len;
static unsigned long long answered;

static void on_signal(int sig)
{
    (void)sig;
    stop = 1;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void conn_close(struct conn *c)
{
    if (c->fd >= 0) {
        epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
        c->fd = -1;
    }
    if (c->queued) {
        c->dead = 1; /* the FIFO still points at it */
        return;
    }
    free(c->buf);
    free(c->out);
    free(c);
}

/* Returns the size of a complete request at the head of c->buf, 0 when more
 * bytes are needed, -1 on a request this server refuses. */
static long request_size(struct conn *c)
{
    char *end;
    size_t head;
    long clen = 0;
    char *p;

    if (c->len < 4)
        return 0;
    end = memmem(c->buf, c->len, "\r\n\r\n", 4);
    if (end == NULL)
        return c->len > MAX_HEAD ? -1 : 0;
    head = (size_t)(end - c->buf) + 4;
    /* Scan the header lines (the request line first, then fields). */
    p = memchr(c->buf, '\n', head);
    c->close_after = 0;
    while (p != NULL && p + 1 < c->buf + head - 2) {
        char *line = p + 1;
        char *eol = memchr(line, '\n', (size_t)(c->buf + head - line));
        size_t n = eol ? (size_t)(eol - line) : 0;
        if (n > 15 && strncasecmp(line, "content-length:", 15) == 0) {
            clen = strtol(line + 15, NULL, 10);
            if (clen < 0)
                return -1;
        } else if (n > 18 && strncasecmp(line, "transfer-encoding:", 18) == 0) {
            return -1;
        } else if (n > 11 && strncasecmp(line, "connection:", 11) == 0) {
            if (memmem(line + 11, n - 11, "close", 5) != NULL)
                c->close_after = 1;
        }
        p = eol;
    }
    if (c->len < head + (size_t)clen)
        return 0;
    return (long)(head + (size_t)clen);
}

/* Returns -1 when the connection was closed (and possibly freed). */
static int try_write(struct conn *c)
{
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
                epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
                return 0;
            }
            conn_close(c);
            return -1;
        }
        c->out_off += (size_t)n;
    }
    c->out_len = c->out_off = 0;
    answered++;
    if (c->close_after) {
        conn_close(c);
        return -1;
    }
    {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
    }
    return 0;
}

static void schedule(struct conn *c, int64_t delay_ns);
static int answer(struct conn *c);

/* Consumes the request at the head of the buffer, if complete. */
static void parse(struct conn *c, int64_t delay_ns)
{
    long sz;
    if (c->queued || c->out_len > 0 || c->fd < 0)
        return;
    sz = request_size(c);
    if (sz < 0) {
        static const char bad[] =
            "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        if (send(c->fd, bad, sizeof(bad) - 1, MSG_NOSIGNAL) < 0) {
            /* closing anyway */
        }
        conn_close(c);
        return;
    }
    if (sz == 0)
        return;
    memmove(c->buf, c->buf + sz, c->len - (size_t)sz);
    c->len -= (size_t)sz;
    schedule(c, delay_ns);
}

/* Returns -1 when the connection was closed (and possibly freed). */
static int answer(struct conn *c)
{
    if (c->out == NULL)
        c->out = malloc(sizeof(response));
    if (c->out == NULL) {
        conn_close(c);
        return -1;
    }
    memcpy(c->out, response, response_len);
    c->out_len = response_len;
    c->out_off = 0;
    return try_write(c);
}

static void schedule(struct conn *c, int64_t delay_ns)
{
    if (delay_ns <= 0) {
        answer(c); /* c may be gone after this; nothing touches it */
        return;
    }
    c->due_ns = now_ns() + delay_ns;
    c->queued = 1;
    c->qnext = NULL;
    if (qtail != NULL)
        qtail->qnext = c;
    else
        qhead = c;
    qtail = c;
}

static void on_readable(struct conn *c, int64_t delay_ns)
{
    for (;;) {
        ssize_t n;
        if (c->cap - c->len < 4096) {
            size_t ncap = c->cap ? c->cap * 2 : 8192;
            char *nb;
            if (ncap > 4 * MAX_HEAD + (1u << 20)) {
                conn_close(c);
                return;
            }
            nb = realloc(c->buf, ncap);
            if (nb == NULL) {
                conn_close(c);
                return;
            }
            c->buf = nb;
            c->cap = ncap;
        }
        n = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
        if (n > 0) {
            c->len += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        conn_close(c); /* EOF or error */
        return;
    }
    parse(c, delay_ns);
}

static int listen_on(const char *spec)
{
    char host[64] = "127.0.0.1";
    const char *colon = strrchr(spec, ':');
    struct sockaddr_in sa = {0};
    int one = 1;
    int fd;

    if (colon != NULL) {
        size_t hl = (size_t)(colon - spec);
        if (hl > 0 && hl < sizeof(host)) {
            memcpy(host, spec, hl);
            host[hl] = '\0';
        }
        spec = colon + 1;
    }
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)atoi(spec));
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        fprintf(stderr, "slow_upstream: bad address %s\n", host);
        return -1;
    }
    fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(fd, 4096) != 0) {
        perror("slow_upstream: bind/listen");
        close(fd);
        return -1;
    }
    return fd;
}

int main(int argc, char **argv)
{
    const char *listen_spec = "127.0.0.1:9050";
    int64_t delay_ns = 50 * 1000000LL;
    struct epoll_event evs[MAX_EVENTS];
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    int lfd;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--listen") == 0 && i + 1 < argc) {
            listen_spec = argv[++i];
        } else if (strcmp(argv[i], "--delay-ms") == 0 && i + 1 < argc) {
            delay_ns = (int64_t)(atof(argv[++i]) * 1e6);
        } else {
            fprintf(stderr, "usage: slow_upstream [--listen 127.0.0.1:PORT] [--delay-ms MS]\n");
            return 2;
        }
    }
    response_len = (size_t)snprintf(response, sizeof(response),
                                    "HTTP/1.1 201 Created\r\n"
                                    "Content-Type: application/json\r\n"
                                    "Content-Length: %zu\r\n"
                                    "\r\n%s",
                                    sizeof(body) - 1, body);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    lfd = listen_on(listen_spec);
    if (lfd < 0)
        return 1;
    epfd = epoll_create1(EPOLL_CLOEXEC);
    epoll_ctl(epfd, EPOLL_CTL_ADD, lfd, &lev);

    while (!stop) {
        int timeout = -1;
        int n;
        int64_t now;

        if (qhead != NULL) {
            int64_t d = qhead->due_ns - now_ns();
            timeout = d <= 0 ? 0 : (int)((d + 999999) / 1000000);
        }
        n = epoll_wait(epfd, evs, MAX_EVENTS, timeout);
        if (n < 0 && errno != EINTR)
            break;
        for (int i = 0; i < n; i++) {
            struct conn *c = evs[i].data.ptr;
            if (c == NULL) {
                for (;;) {
                    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                    int one = 1;
                    struct conn *nc;
                    struct epoll_event ev = {.events = EPOLLIN};
                    if (fd < 0)
                        break;
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
                    nc = calloc(1, sizeof(*nc));
                    if (nc == NULL) {
                        close(fd);
                        continue;
                    }
                    nc->fd = fd;
                    ev.data.ptr = nc;
                    epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
                }
                continue;
            }
            if (evs[i].events & EPOLLOUT) {
                if (try_write(c) == 0 && c->out_len == 0)
                    parse(c, delay_ns);
                continue;
            }
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))
                on_readable(c, delay_ns);
        }
        now = now_ns();
        while (qhead != NULL && qhead->due_ns <= now) {
            struct conn *c = qhead;
            qhead = c->qnext;
            if (qhead == NULL)
                qtail = NULL;
            c->queued = 0;
            if (c->dead) {
                conn_close(c);
                continue;
            }
            if (answer(c) == 0 && c->out_len == 0)
                parse(c, delay_ns); /* a pipelined request already read */
        }
    }
    fprintf(stderr, "slow_upstream: %llu answers\n", answered);
    close(lfd);
    close(epfd);
    return 0;
}
