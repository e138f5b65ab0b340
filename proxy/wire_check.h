/*
 * wire_check.h - the client's request bytes as they came off the socket,
 * checked strictly, next to libmicrohttpd's own reading of them.
 *
 * libmicrohttpd 0.9.75 parses a request head in place, turning each line
 * end into NULs. After that, a CRLF, a NUL followed by a bare LF, a line of
 * only ':' or of only a NUL before a bare LF all look the same in its buffer,
 * and some of them end the header block or the trailer section early: the
 * rest is then parsed as another request (a smuggled one) or becomes the
 * body. No check on the parsed buffer can tell them apart, so this module
 * sees the raw bytes: the proxy's recv() (libmicrohttpd reads client sockets
 * with recv) hands every byte read from a client connection to that
 * connection's checker before libmicrohttpd parses it.
 *
 * The checker frames the stream itself, strictly (RFC 9112): every line end
 * a CRLF, no NUL, no bare CR, no field line starting with white space or
 * ':' or without a colon, at most one Content-Length (digits only) or one
 * Transfer-Encoding (exactly "chunked", not with Content-Length), chunk
 * sizes in hex with nothing but an extension after them, and no trailer
 * fields. It keeps, per request, in order, the length of the body it framed
 * and whether it broke a rule. The server asks, for each request
 * libmicrohttpd hands it, whether the checker framed the same request: head
 * complete (wire_check_head), then the same body length (wire_check_end);
 * anything else is a 400 and the connection closes.
 *
 * Threads: a connection's checker is fed and asked on the thread that runs
 * the connection (libmicrohttpd's worker); the fd table is read by every
 * thread's recv(), so its entries are atomic.
 */
#ifndef IDEM_WIRE_CHECK_H
#define IDEM_WIRE_CHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct wire_check;

/* Once, before any thread starts: the fd table (fds below max_fds are
 * checked) and the real recv. 0, or -1 with errno. */
int wire_check_global_init(size_t max_fds);

/* Whether this process's recv() is wire_check's (the dynamic linker chose
 * it over libc's for every library): false means no client byte is seen. */
bool wire_check_interposed(void);

/* A new client connection on fd: its checker, registered so that bytes
 * read from fd reach it. NULL when out of memory or fd is beyond the
 * table (the caller closes the connection). */
struct wire_check *wire_check_open(int fd);
/* The connection closes (before its fd is closed): unregistered, freed. */
void wire_check_close(struct wire_check *wc);

/* Checker only, not registered (tests, fuzzing). */
struct wire_check *wire_check_new(void);
void wire_check_free(struct wire_check *wc);
void wire_check_feed(struct wire_check *wc, const char *buf, size_t n);

/* The request libmicrohttpd is reading now (the oldest not yet done):
 * true when the checker has seen its whole head and found no fault in it. */
bool wire_check_head(const struct wire_check *wc);
/* The same request with its body read (body_len bytes): true when the
 * checker framed it completely, without a fault, with that body length. */
bool wire_check_end(const struct wire_check *wc, uint64_t body_len);
/* That request, when framed completely without a fault: true, and the
 * length of the body it framed. */
bool wire_check_framed(const struct wire_check *wc, uint64_t *body_len);
/* libmicrohttpd is done with that request: on to the next. A request not
 * framed completely yet makes every later one fail the checks. */
void wire_check_done(struct wire_check *wc);
/* Out of memory counting requests (more than a few pipelined at once):
 * the checks fail from then on, and the answer is a 503, not a 400. */
bool wire_check_oom(const struct wire_check *wc);

#endif
