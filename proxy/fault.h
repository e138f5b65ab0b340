/*
 * fault.h - fault injection for tests/faults (SQLite-style fault loops).
 *
 * Only a build with the CMake option IDEM_FAULT_INJECTION (default OFF; the
 * sanitizer build turns it on) has any of it: otherwise idem_fault_arm() is
 * an empty statement and nothing else exists. With it, idemproxy is linked
 * with -Wl,--wrap for malloc, calloc, realloc and strdup, so every such call
 * made by our own objects (config, store, proxy; not libcurl's,
 * libmicrohttpd's, jansson's or OpenSSL's own) goes through fault.c, and the
 * store wraps its LMDB calls (store/store_fault.h). After idem_fault_arm():
 *
 *   IDEM_FAULT_ALLOC_NTH=N   the Nth allocation returns NULL (ENOMEM), once
 *   IDEM_FAULT_LMDB_NTH=N    the Nth LMDB call fails, once
 *   IDEM_FAULT_LMDB_ERR=eio|full   how it fails (store/store_fault.h)
 *   IDEM_FAULT_COUNT_FILE=F  at exit, F gets one JSON line: the calls
 *                            counted ("alloc_calls", "lmdb_calls",
 *                            "lmdb_write_calls") and what was failed
 *                            ("lmdb_failed", "alloc_stack": return addresses
 *                            as offsets into the executable, for addr2line)
 *
 * With none of these set, nothing is counted. A failed allocation also
 * prints "idemproxy: fault: ..." and its stack to stderr when it happens.
 *
 *   IDEM_FAULT_DELIVER_PAUSE_MS=N   after handing each store result to its
 *                            worker, the writer wakes that worker and sleeps
 *                            N ms: a writer preempted right there, so the
 *                            worker may run the result, answer and free the
 *                            request meanwhile
 */
#ifndef IDEM_FAULT_H
#define IDEM_FAULT_H

#ifdef IDEM_FAULT_INJECTION
/* Starts counting (main thread, once the server is up, so that startup is
 * not counted). */
void idem_fault_arm(void);
/* The IDEM_FAULT_DELIVER_PAUSE_MS pause (writer thread; evfd: the worker's
 * wake-up eventfd). */
void idem_fault_deliver_pause(int evfd);
#else
#define idem_fault_arm() ((void)0)
#define idem_fault_deliver_pause(evfd) ((void)(evfd))
#endif

#endif
