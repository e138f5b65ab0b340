/*
 * access_log.c - a bounded buffer between the workers and stdout, and the
 * one thread that writes it out. See access_log.h.
 *
 * The writer thread waits for the descriptor with poll() and writes at most
 * PIPE_BUF bytes at a time: a pipe that poll() calls writable takes that
 * much without blocking (POSIX: writes up to PIPE_BUF are atomic, and
 * Linux reports POLLOUT while a page of the pipe is free), so the thread
 * itself keeps waking up to say the drops on stderr and to notice a stop.
 * A descriptor that blocks anyway (a second writer racing for the same
 * pipe) only stalls this thread, never a worker.
 */
/* memrchr is a GNU extension. */
#define _GNU_SOURCE 1
#include "access_log.h"
#include "clock.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHUNK_BYTES PIPE_BUF /* one write(): atomic on a pipe */
#define WAIT_MS 200          /* longest wait before looking again */
#define REPORT_EVERY_MS 10000

struct proxy_access_log {
    int fd;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake; /* lines queued, or stop */
    pthread_cond_t done; /* the thread ended */

    /* all below under lock */
    char *buf; /* ring of cap bytes: len bytes from head */
    size_t cap, head, len;
    uint64_t dropped;  /* lines dropped so far */
    uint64_t reported; /* dropped as of the last line on stderr */
    int64_t reported_ms;
    int write_errno; /* the descriptor failed (not just full): why */
    bool mid_line;   /* the last byte written was not the end of a line */
    bool cut_line;   /* a failure cut a line short: end it before the next */
    bool stopping;
    bool abandoned; /* the stopper left: the thread frees the log */
    bool exited;
};

static uint64_t count_lines(const char *p, size_t n)
{
    uint64_t lines = 0;
    const char *end = p + n;
    const char *nl;
    while (p < end && (nl = memchr(p, '\n', (size_t)(end - p))) != NULL) {
        lines++;
        p = nl + 1;
    }
    return lines;
}

/* Lines still buffered (a stop that gives up drops them). Under lock. */
static uint64_t buffered_lines(const struct proxy_access_log *log)
{
    size_t first = log->len < log->cap - log->head ? log->len : log->cap - log->head;
    return count_lines(log->buf + log->head, first) + count_lines(log->buf, log->len - first);
}

static void consume(struct proxy_access_log *log, size_t n)
{
    log->head = (log->head + n) % log->cap;
    log->len -= n;
    if (log->len == 0)
        log->head = 0;
}

/*
 * Says the drops not said yet on stderr, if due (force: whatever the time).
 * stderr can be an unread pipe too: the line is written only when poll()
 * says it fits, else it is tried again later. Called under lock; drops it
 * around the write.
 */
static void report(struct proxy_access_log *log, uint64_t extra, bool force)
{
    char line[200];
    struct pollfd pfd = {.fd = STDERR_FILENO, .events = POLLOUT};
    uint64_t total = log->dropped + extra;
    int64_t now = idem_mono_ms();
    int n;

    if (total == log->reported)
        return;
    if (!force && log->reported_ms != 0 && now - log->reported_ms < REPORT_EVERY_MS)
        return;
    n = snprintf(line, sizeof(line),
                 "idemproxy: access log: %" PRIu64 " lines dropped, %s (%" PRIu64 " in total)\n",
                 total - log->reported,
                 log->write_errno == 0       ? "stdout not being read"
                 : log->write_errno == EPIPE ? "stdout closed by its reader"
                                             : "stdout write failed",
                 total);
    if (n <= 0 || (size_t)n >= sizeof(line))
        return;
    pthread_mutex_unlock(&log->lock);
    if (poll(&pfd, 1, 0) == 1 && (pfd.revents & POLLOUT) != 0) {
        ssize_t wr = write(STDERR_FILENO, line, (size_t)n);
        pthread_mutex_lock(&log->lock);
        if (wr == n) {
            log->reported = total;
            log->reported_ms = now != 0 ? now : 1;
        }
    } else {
        pthread_mutex_lock(&log->lock);
    }
}

/* Waits at most WAIT_MS for fd to take data, then writes n bytes or fewer.
 * Returns the bytes written, 0 when the descriptor stayed full, -errno on
 * failure. */
static ssize_t write_some(int fd, const char *p, size_t n)
{
    struct pollfd pfd = {.fd = fd, .events = POLLOUT};
    ssize_t rc;
    int pr = poll(&pfd, 1, WAIT_MS);

    if (pr < 0)
        return errno == EINTR ? 0 : -errno;
    if (pr == 0)
        return 0;
    if ((pfd.revents & POLLOUT) == 0 && (pfd.revents & (POLLERR | POLLNVAL)) != 0)
        return (pfd.revents & POLLNVAL) != 0 ? -EBADF : -EPIPE;
    rc = write(fd, p, n);
    if (rc < 0)
        return errno == EINTR || errno == EAGAIN ? 0 : -errno;
    return rc;
}

static void *log_main(void *arg)
{
    struct proxy_access_log *log = arg;
    char chunk[CHUNK_BYTES];
    bool free_it;

    pthread_mutex_lock(&log->lock);
    for (;;) {
        size_t n;
        ssize_t wr;

        if (log->len == 0 && !log->stopping) {
            /* Idle; with drops not said yet, wake up to say them when due. */
            if (log->dropped != log->reported) {
                struct timespec until = idem_deadline_in_ms(1000);
                pthread_cond_timedwait(&log->wake, &log->lock, &until);
            } else {
                pthread_cond_wait(&log->wake, &log->lock);
            }
        }
        report(log, 0, false);
        if (log->abandoned || (log->stopping && log->len == 0))
            break;
        if (log->len == 0)
            continue;
        if (log->cut_line) {
            /* A write failed mid-line (a full disk, a file size limit) and
             * the rest of that line was dropped: end the fragment, so the
             * next line starts a line of its own instead of being glued to
             * it (a JSON-lines reader then loses one line, not two). */
            pthread_mutex_unlock(&log->lock);
            wr = write_some(log->fd, "\n", 1);
            pthread_mutex_lock(&log->lock);
            if (wr == 1) {
                log->cut_line = false;
                log->mid_line = false;
                continue;
            }
            if (wr == 0)
                continue; /* still full: wait again */
            /* Still failing: drop the next lines as below. */
            log->write_errno = (int)-wr;
            n = log->cap - log->head < log->len ? log->cap - log->head : log->len;
            log->dropped += count_lines(log->buf + log->head, n);
            consume(log, n);
            continue;
        }
        n = log->cap - log->head;
        if (n > log->len)
            n = log->len;
        if (n > sizeof(chunk))
            n = sizeof(chunk);
        memcpy(chunk, log->buf + log->head, n);
        pthread_mutex_unlock(&log->lock);
        wr = write_some(log->fd, chunk, n);
        pthread_mutex_lock(&log->lock);
        if (wr > 0) {
            log->write_errno = 0;
            log->mid_line = chunk[wr - 1] != '\n';
            consume(log, (size_t)wr);
        } else if (wr < 0) {
            /* The descriptor failed (a closed pipe, a full disk): these
             * lines are lost, the next ones may still get through. */
            log->write_errno = (int)-wr;
            log->dropped += count_lines(chunk, n);
            consume(log, n);
            if (log->mid_line)
                log->cut_line = true;
        }
    }
    log->exited = true;
    free_it = log->abandoned;
    pthread_cond_signal(&log->done);
    pthread_mutex_unlock(&log->lock);
    if (free_it) {
        pthread_detach(pthread_self());
        pthread_cond_destroy(&log->done);
        pthread_cond_destroy(&log->wake);
        pthread_mutex_destroy(&log->lock);
        free(log->buf);
        free(log);
    }
    return NULL;
}

int proxy_access_log_new(int fd, size_t cap_bytes, struct proxy_access_log **out)
{
    struct proxy_access_log *log = NULL;
    int rc = -1;

    *out = NULL;
    log = calloc(1, sizeof(*log));
    if (log == NULL)
        goto out;
    log->fd = fd;
    log->cap = cap_bytes > 0 ? cap_bytes : 1;
    log->buf = malloc(log->cap);
    if (log->buf == NULL) {
        free(log);
        goto out;
    }
    pthread_mutex_init(&log->lock, NULL);
    idem_cond_init_monotonic(&log->wake);
    idem_cond_init_monotonic(&log->done);
    if (pthread_create(&log->thread, NULL, log_main, log) != 0) {
        pthread_cond_destroy(&log->done);
        pthread_cond_destroy(&log->wake);
        pthread_mutex_destroy(&log->lock);
        free(log->buf);
        free(log);
        goto out;
    }
    *out = log;
    rc = 0;
out:
    return rc;
}

static void ring_copy(struct proxy_access_log *log, const char *p, size_t n)
{
    size_t tail = (log->head + log->len) % log->cap;
    size_t first = log->cap - tail < n ? log->cap - tail : n;
    memcpy(log->buf + tail, p, first);
    memcpy(log->buf, p + first, n - first);
    log->len += n;
}

void proxy_access_log_put(struct proxy_access_log *log, const char *lines, size_t len)
{
    size_t fits;

    if (len == 0)
        return;
    pthread_mutex_lock(&log->lock);
    fits = log->cap - log->len;
    if (len <= fits) {
        fits = len;
    } else {
        /* Whole lines only: a reader never sees half a JSON line. */
        const char *nl = fits > 0 ? memrchr(lines, '\n', fits) : NULL;
        fits = nl != NULL ? (size_t)(nl - lines) + 1 : 0;
        log->dropped += count_lines(lines + fits, len - fits);
    }
    if (fits > 0) {
        ring_copy(log, lines, fits);
        pthread_cond_signal(&log->wake);
    }
    pthread_mutex_unlock(&log->lock);
}

uint64_t proxy_access_log_dropped(struct proxy_access_log *log)
{
    uint64_t n;
    pthread_mutex_lock(&log->lock);
    n = log->dropped;
    pthread_mutex_unlock(&log->lock);
    return n;
}

void proxy_access_log_free(struct proxy_access_log *log, int flush_ms)
{
    struct timespec until;
    bool joined = false;

    if (log == NULL)
        return;
    until = idem_deadline_in_ms(flush_ms > 0 ? flush_ms : 0);
    pthread_mutex_lock(&log->lock);
    log->stopping = true;
    pthread_cond_signal(&log->wake);
    while (!log->exited) {
        if (pthread_cond_timedwait(&log->done, &log->lock, &until) == ETIMEDOUT)
            break;
    }
    /* Given up: stdout is not being read, what is still buffered is
     * dropped. */
    report(log, log->exited ? 0 : buffered_lines(log), true);
    if (log->exited)
        joined = true;
    else
        log->abandoned = true; /* the thread, maybe stuck in write(), is
                                  left to the exit */
    pthread_mutex_unlock(&log->lock);
    if (joined) {
        pthread_join(log->thread, NULL);
        pthread_cond_destroy(&log->done);
        pthread_cond_destroy(&log->wake);
        pthread_mutex_destroy(&log->lock);
        free(log->buf);
        free(log);
    }
}
