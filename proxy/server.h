/*
 * server.h - the proxy's event loops.
 *
 * One worker thread per core, each running its own epoll loop that drives a
 * libmicrohttpd daemon in external-epoll mode (its own SO_REUSEPORT listen
 * socket on the shared address) and a libcurl multi handle through
 * curl_multi_socket_action. A request never blocks its worker: while it
 * waits for the store writer, the upstream or another request holding its
 * key, its connection is suspended and later resumed with the answer.
 * Store writes go through the single group-commit writer (writer.h); replays
 * of COMPLETE records are read directly on the worker.
 *
 * Threads: proxy_server_start() spawns the workers; proxy_server_stop() may
 * be called from any thread (e.g. on SIGTERM) and starts the drain;
 * proxy_server_join() waits for the workers and frees everything (bounded:
 * see PROXY_STORE_STUCK).
 */
#ifndef IDEM_SERVER_H
#define IDEM_SERVER_H

#include <stddef.h>

#include "config.h"
#include "store.h"

struct proxy_server;

/* cfg and st are borrowed and must outlive the server. */
int proxy_server_start(const struct config *cfg, struct store *st, struct proxy_server **out,
                       char *err, size_t errlen);
/* Stop accepting; in-flight requests finish (completing or releasing their
 * records) up to server.drain_timeout. Async-signal-unsafe: call it from a
 * normal thread. */
void proxy_server_stop(struct proxy_server *srv);
/* Waits for the drain to end and frees the server. Returns 0, or
 * PROXY_STORE_STUCK when the store writer was still inside a commit two
 * seconds past the drain's bound (a stalled disk): then the server is not
 * freed and the store must not be closed; the caller ends the process with
 * _exit() (see writer_stop_by()). */
#define PROXY_STORE_STUCK 1
int proxy_server_join(struct proxy_server *srv);

#endif
