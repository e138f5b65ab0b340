/*
 * diag.h - diagnostics on stderr that never block the process.
 *
 * While it serves, idemproxy says what goes wrong on stderr: store failures
 * (the writer thread), libmicrohttpd's messages about clients (the workers),
 * the drain (the main thread). stderr may be a pipe whose reader stopped; a
 * plain fprintf() would then block the thread that called it, and a worker
 * or the store writer blocked in write() stops every request. idem_diag()
 * writes a line only when poll() says stderr takes it now, else drops it
 * and counts it; the count is said with the next line that gets through
 * ("(N earlier diagnostics dropped: stderr not being read)").
 *
 * idem_diag_client() is for messages any client can cause at will
 * (libmicrohttpd's "connection was closed by remote side...", malformed
 * requests): at most DIAG_CLIENT_PER_S lines a second for the whole
 * process, so a client cannot flood stderr; the rest are counted and
 * said with the next line let through ("(N more such messages
 * suppressed)").
 *
 * Threads: both may be called from any thread at once.
 */
#ifndef IDEM_DIAG_H
#define IDEM_DIAG_H

#include <stdarg.h>

#define DIAG_CLIENT_PER_S 5

/* One line on stderr ("idemproxy: " is not added; fmt ends without '\n'). */
void idem_diag(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A message a client can cause (rate-limited); prefix goes before it, and
 * fm may end with '\n' or not. */
void idem_diag_client(const char *prefix, const char *fm, va_list ap)
    __attribute__((format(printf, 2, 0)));

#endif
