/*
 * access_log.h - the access log's writer thread: stdout never blocks a worker.
 *
 * Workers hand finished lines to a bounded in-memory buffer; one thread of
 * its own writes that buffer to the descriptor (stdout). When the reader of
 * stdout stops reading (a full pipe, a stopped terminal), that thread waits
 * and the buffer fills; lines that do not fit are dropped and counted, never
 * waited for, so request handling and the SIGTERM drain go on. The count is
 * said on stderr at once and then at most every 10 s while lines keep being
 * dropped: "idemproxy: access log: N lines dropped, stdout not being read".
 *
 * stdout keeps its blocking mode: O_NONBLOCK belongs to the open file
 * description, which the shell, a supervisor or a pipeline stage may share.
 *
 * Threads: proxy_access_log_put() may be called from any thread at once;
 * proxy_access_log_new() and proxy_access_log_free() from one thread, with
 * no put() running.
 */
#ifndef IDEM_ACCESS_LOG_H
#define IDEM_ACCESS_LOG_H

#include <stddef.h>
#include <stdint.h>

struct proxy_access_log;

/* Starts the writer thread for fd (not closed by the log), buffering at
 * most cap_bytes. Returns 0, or -1 (out of memory, no thread). */
int proxy_access_log_new(int fd, size_t cap_bytes, struct proxy_access_log **out);

/* Queues len bytes of whole lines (each ends with '\n'). Never waits for
 * the descriptor: what does not fit in the buffer is dropped, whole lines
 * only, and counted. */
void proxy_access_log_put(struct proxy_access_log *log, const char *lines, size_t len);

/* Lines dropped so far. */
uint64_t proxy_access_log_dropped(struct proxy_access_log *log);

/* Writes out what is buffered, waiting at most flush_ms for the
 * descriptor, says any drops not said yet, and stops. A writer thread
 * still stuck in write() then is left behind (it frees the log itself if
 * it ever returns): exiting never waits for a reader of stdout.
 * proxy_access_log_free(NULL) is a no-op. */
void proxy_access_log_free(struct proxy_access_log *log, int flush_ms);

#endif
