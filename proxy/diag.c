/*
 * diag.c - non-blocking, rate-limited diagnostics on stderr. See diag.h.
 */
#include "diag.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Longer lines are cut: a diagnostic is one line, and a pipe takes up to
 * PIPE_BUF bytes in one piece once poll() says it has room. */
#define DIAG_LINE_MAX 1024

static atomic_uint_fast64_t dropped;    /* lines stderr did not take */
static atomic_uint_fast64_t suppressed; /* client messages over the rate */
static atomic_int_fast64_t window_s;    /* the second being counted */
static atomic_uint_fast32_t window_n;   /* client lines let through in it */

/* Writes the line if stderr takes it now; counts it as dropped if not. */
static void emit(char *line, size_t len)
{
    struct pollfd pfd = {.fd = STDERR_FILENO, .events = POLLOUT};
    uint64_t before = atomic_exchange(&dropped, 0);
    char note[96];
    int n = 0;

    if (before > 0)
        n = snprintf(note, sizeof(note), " (%" PRIu64 " earlier diagnostics dropped: stderr not being read)",
                     before);
    if (n > 0 && len + (size_t)n + 1 < DIAG_LINE_MAX) {
        /* line ends with '\n' at len - 1: put the note before it */
        memcpy(line + len - 1, note, (size_t)n);
        len += (size_t)n;
        line[len - 1] = '\n';
    }
    if (poll(&pfd, 1, 0) == 1 && (pfd.revents & POLLOUT) != 0) {
        ssize_t wr;
        do {
            wr = write(STDERR_FILENO, line, len);
        } while (wr < 0 && errno == EINTR);
        if (wr == (ssize_t)len)
            return;
    }
    atomic_fetch_add(&dropped, before + 1);
}

/* Formats prefix + fm into line (room DIAG_LINE_MAX) ending in one '\n';
 * returns the length. A control character inside the text is written as
 * \xNN: libmicrohttpd's messages quote the request's path, decoded ("%0a"
 * is a line end, "%1b" an ESC), so any client could otherwise write lines
 * of its own into stderr ("idemproxy: store: ..." forged) or send escape
 * sequences to the terminal of an operator reading it. */
static size_t format_line(char *line, const char *prefix, const char *fm, va_list ap)
{
    static const char hex[] = "0123456789abcdef";
    char raw[DIAG_LINE_MAX];
    size_t rlen = 0;
    size_t len = 0;
    int n;

    if (prefix != NULL) {
        n = snprintf(raw, DIAG_LINE_MAX - 128, "%s", prefix);
        rlen = n > 0 ? (size_t)n : 0;
        if (rlen > DIAG_LINE_MAX - 129)
            rlen = DIAG_LINE_MAX - 129;
    }
    /* Leave room for the notes emit() and the caller may add. */
    n = vsnprintf(raw + rlen, DIAG_LINE_MAX - 128 - rlen, fm, ap);
    if (n > 0)
        rlen += (size_t)n < DIAG_LINE_MAX - 129 - rlen ? (size_t)n : DIAG_LINE_MAX - 129 - rlen;
    while (rlen > 0 && (raw[rlen - 1] == '\n' || raw[rlen - 1] == '\r'))
        rlen--;
    for (size_t i = 0; i < rlen; i++) {
        unsigned char c = (unsigned char)raw[i];
        if (c >= 0x20 && c != 0x7f) {
            if (len + 1 > DIAG_LINE_MAX - 129)
                break;
            line[len++] = (char)c;
        } else {
            if (len + 4 > DIAG_LINE_MAX - 129)
                break;
            line[len++] = '\\';
            line[len++] = 'x';
            line[len++] = hex[c >> 4];
            line[len++] = hex[c & 15];
        }
    }
    line[len++] = '\n';
    line[len] = '\0';
    return len;
}

void idem_diag(const char *fmt, ...)
{
    char line[DIAG_LINE_MAX];
    va_list ap;
    size_t len;

    va_start(ap, fmt);
    len = format_line(line, NULL, fmt, ap);
    va_end(ap);
    emit(line, len);
}

void idem_diag_client(const char *prefix, const char *fm, va_list ap)
{
    char line[DIAG_LINE_MAX];
    struct timespec ts;
    int64_t now;
    int64_t seen;
    uint64_t quiet;
    size_t len;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = (int64_t)ts.tv_sec;
    seen = atomic_load(&window_s);
    if (seen != now && atomic_compare_exchange_strong(&window_s, &seen, now))
        atomic_store(&window_n, 0);
    if (atomic_fetch_add(&window_n, 1) >= DIAG_CLIENT_PER_S) {
        atomic_fetch_add(&suppressed, 1);
        return;
    }
    len = format_line(line, prefix, fm, ap);
    quiet = atomic_exchange(&suppressed, 0);
    if (quiet > 0) {
        char note[64];
        int n = snprintf(note, sizeof(note), " (%" PRIu64 " more such messages suppressed)", quiet);
        if (n > 0 && len + (size_t)n + 1 < DIAG_LINE_MAX - 96) {
            memcpy(line + len - 1, note, (size_t)n);
            len += (size_t)n;
            line[len - 1] = '\n';
            line[len] = '\0';
        }
    }
    emit(line, len);
}
