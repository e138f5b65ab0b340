/*
 * main.c - idemproxy's command line (CONTRACT.md section 5).
 *
 *   idemproxy --config FILE [--listen HOST:PORT] [--upstream URL] [--store PATH]
 *   idemproxy --upstream URL             every default
 *   idemproxy check-config FILE [overrides]  validate, print the effective config
 *   idemproxy check-store PATH           check a store's records (JSON summary)
 *   idemproxy show-key PATH SCOPE KEY    one key's record (JSON)
 *   idemproxy forget-key PATH SCOPE KEY  delete it (an operator's decision)
 *   idemproxy --help | --version
 *
 * SIGTERM/SIGINT stop accepting and drain in-flight requests (their records
 * completed or released) up to server.drain_timeout, then exit 0; 75 when a
 * commit is still waiting for a stalled disk two seconds past it (run()).
 */
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>
#include <malloc.h>

#include "config.h"
#include "diag.h"
#include "idem_build.h"
#include "fault.h"
#include "policy.h"
#include "server.h"
#include "store.h"

/* Each command's synopsis: --help prints them all, a usage error the one
 * of the command it is about. */
#define USAGE_RUN                                                                                  \
    "idemproxy --config FILE [--listen HOST:PORT] [--upstream URL] [--store PATH]\n"               \
    "       idemproxy --upstream URL [--listen HOST:PORT] [--store PATH]"
#define USAGE_CHECK_CONFIG                                                                         \
    "idemproxy check-config FILE [--listen HOST:PORT] [--upstream URL] [--store PATH]"
#define USAGE_CHECK_STORE "idemproxy check-store PATH [--records]"
#define USAGE_SHOW_KEY "idemproxy show-key PATH SCOPE KEY [--scope-header-value VALUE]"
#define USAGE_FORGET_KEY                                                                           \
    "idemproxy forget-key PATH SCOPE KEY [--scope-header-value VALUE] [--force]\n"                 \
    "                 [--allow-shared-fs]"

static const char usage[] =
    "usage: " USAGE_RUN "\n"
    "       " USAGE_CHECK_CONFIG "\n"
    "       " USAGE_CHECK_STORE "\n"
    "       " USAGE_SHOW_KEY "\n"
    "       " USAGE_FORGET_KEY "\n"
    "       idemproxy --help | --version\n"
    "\n"
    "A reverse proxy that gives an HTTP API Idempotency-Key semantics: the first\n"
    "request with a key is forwarded and its response stored; duplicates get the\n"
    "stored response without reaching the upstream. See README.md.\n"
    "\n"
    "  --config FILE      JSON configuration (see README.md, Configuration)\n"
    "  --listen ADDR      listen address, overrides \"listen\" (default 127.0.0.1:8080)\n"
    "  --upstream URL     upstream base URL, overrides \"upstream\"\n"
    "  --store PATH       LMDB store directory, overrides \"store.path\"\n"
    "  check-config FILE  validate FILE (with the overrides given) and print the\n"
    "                     effective configuration; exit 1 if the proxy could not run\n"
    "                     with it (no upstream, a store.path it could not use)\n"
    "  check-store PATH   decode every record of a store and check its invariants\n"
    "                     (JSON summary; --records adds one line per record)\n"
    "  show-key PATH SCOPE KEY\n"
    "                     print the record of KEY in SCOPE (a route's scope, as\n"
    "                     check-config and the access log show it) as JSON; exit 0,\n"
    "                     or 1 when there is none. With a route's scope_header, give\n"
    "                     the request's value of it: --scope-header-value VALUE\n"
    "                     (VALUE \"-\": read from stdin, off the command line)\n"
    "  forget-key PATH SCOPE KEY\n"
    "                     delete that record, so the key runs again when next sent;\n"
    "                     one whose request is running now (live lease) only with\n"
    "                     --force. Exit 0 deleted, 1 none, 3 running. A store on\n"
    "                     a network or FUSE file system only with --allow-shared-fs\n"
    "                     (as store.require_local_fs false); one of an older layout\n"
    "                     is refused, not upgraded under the proxies serving it\n";

/*
 * A mistake on the command line: "idemproxy: <what is wrong>", the synopsis
 * of the command it is about and where the rest is, on stderr; exit status
 * 2 (README, Command line). Not the whole --help text, which would bury the
 * one line that says what is wrong.
 */
static int vusage_error(const char *synopsis, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));
static int vusage_error(const char *synopsis, const char *fmt, va_list ap)
{
    fputs("idemproxy: ", stderr);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\nusage: %s\nTry 'idemproxy --help' for more information.\n", synopsis);
    return 2;
}

static int usage_error(const char *synopsis, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int usage_error(const char *synopsis, const char *fmt, ...)
{
    va_list ap;
    int rc;

    va_start(ap, fmt);
    rc = vusage_error(synopsis, fmt, ap);
    va_end(ap);
    return rc;
}

/* show-key's and forget-key's: an option given in place of PATH, SCOPE or
 * KEY (misplaced) is what a wrong command line is said as, since the rest
 * follows from it. */
static int key_usage_error(const char *synopsis, const char *cmd, const char *misplaced,
                           const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int key_usage_error(const char *synopsis, const char *cmd, const char *misplaced,
                           const char *fmt, ...)
{
    va_list ap;
    int rc;

    if (misplaced != NULL)
        return usage_error(synopsis, "%s: %s: the options come after PATH SCOPE KEY", cmd,
                           misplaced);
    va_start(ap, fmt);
    rc = vusage_error(synopsis, fmt, ap);
    va_end(ap);
    return rc;
}

/* The configuration the proxy would run with: FILE, then the command
 * line's overrides. Exit 1 when it could not run, the missing upstream
 * included, so a script can gate a deploy on it. */
static int check_config(const char *path, const char *listen, const char *upstream,
                        const char *store_path)
{
    char err[1024]; /* a store message may name two paths and the working directory */
    struct config *cfg = NULL;
    char *dump = NULL;
    int rc = 1;

    if (config_load_file(path, &cfg, err, sizeof(err)) != 0) {
        fprintf(stderr, "idemproxy: %s\n", err);
        goto out;
    }
    if (cfg->upstream.url == NULL && upstream == NULL) {
        fprintf(stderr, "idemproxy: upstream: is required: set \"upstream\" in %s, or check "
                        "it with the --upstream URL the proxy will run with\n", path);
        goto out;
    }
    /* Validates the whole configuration, as the proxy does at start. */
    if (config_override(cfg, listen, upstream, store_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "idemproxy: %s\n", err);
        goto out;
    }
    /* What would stop the proxy at start, looked at without making the
     * store: the proxy makes store.path and its data file there. */
    if (store_lmdb_path_check(cfg->store.path, !cfg->store.require_local_fs, err, sizeof(err)) !=
        STORE_OK) {
        fprintf(stderr, "idemproxy: %s\n", err);
        goto out;
    }
    dump = config_dump(cfg);
    if (dump == NULL) {
        fprintf(stderr, "idemproxy: out of memory\n");
        goto out;
    }
    printf("%s\n", dump);
    rc = 0;
out:
    free(dump);
    config_free(cfg);
    return rc;
}

/* How many corrupt entries check-store names (it counts them all). */
#define CHECK_CORRUPT_SHOWN 5

/* A store that would not open: the message names the store when it says
 * it is damaged ("store DIR is damaged: ..."); others get its path. */
static void print_store_error(const char *path, const char *err)
{
    if (strncmp(err, "store ", 6) == 0 || (strncmp(err, "store: ", 7) == 0 && strstr(err, path)))
        fprintf(stderr, "idemproxy: %s\n", err); /* names the store already */
    else
        fprintf(stderr, "idemproxy: store %s: %s\n", path,
                strncmp(err, "store: ", 7) == 0 ? err + 7 : err);
}

struct check_ctx {
    bool print_records;
    int64_t now_ms;
    int64_t lease_now_ms; /* leases are on the lease clock (store_clock) */
    enum store_lease_clock lease_clock; /* the clock the stored leases are on */
    uint64_t absent, in_progress, held, complete, stealable, expired_complete, duplicate_keys, bad;
    uint64_t seen;
    uint8_t prev_key[STORE_KEY_BYTES];
    uint64_t corrupt; /* entries that are not records (check_corrupt) */
    char corrupt_first[CHECK_CORRUPT_SHOWN][256];
};

/* A lease's end as a wall-clock time, as expires_ms is shown (saturating:
 * the value comes from the store), and as the next proxy to open the store
 * will take it: a lease from a boot before this one has ended with its
 * holder, unless the record is held, which stays held until its TTL
 * (leases_settle() in store_lmdb.c). A layout-2 store's leases are
 * wall-clock times already. */
static int64_t lease_end_wall(const struct check_ctx *c, const struct store_record *rec)
{
    int64_t d;

    if (c->lease_clock == STORE_LEASES_WALL)
        return rec->lease_expires_ms;
    if (c->lease_clock == STORE_LEASES_OTHER_BOOT)
        return store_lease_is_held(rec->lease_id) && rec->expires_ms > c->now_ms
                   ? rec->expires_ms
                   : c->now_ms;
    if (__builtin_sub_overflow(rec->lease_expires_ms, c->lease_now_ms, &d) ||
        __builtin_add_overflow(c->now_ms, d, &d))
        return rec->lease_expires_ms > c->lease_now_ms ? INT64_MAX : INT64_MIN;
    return d;
}

static int check_record(const uint8_t key[STORE_KEY_BYTES], const struct store_record *rec,
                        void *arg)
{
    struct check_ctx *c = arg;
    const char *state = "absent";
    int64_t lease_end = lease_end_wall(c, rec);

    /* The scan is in key order: the same key twice is one record in two
     * tables of the records environment (the store keeps each key in one
     * of them; a key also in flight is visited once, store_scan). */
    if (c->seen++ > 0 && memcmp(key, c->prev_key, STORE_KEY_BYTES) == 0) {
        c->duplicate_keys++;
        c->bad++;
    }
    memcpy(c->prev_key, key, STORE_KEY_BYTES);
    switch (rec->state) {
    case STORE_STATE_IN_PROGRESS:
        state = "in_progress";
        c->in_progress++;
        if (lease_end <= c->now_ms)
            c->stealable++;
        else if (store_lease_is_held(rec->lease_id))
            c->held++; /* ran, result not stored: taken until its TTL */
        if (rec->body_len != 0 || rec->headers_len != 0)
            c->bad++; /* an IN_PROGRESS record never carries a payload */
        break;
    case STORE_STATE_COMPLETE:
        state = "complete";
        c->complete++;
        if (rec->expires_ms <= c->now_ms)
            c->expired_complete++;
        if (rec->status < 100 || rec->status > 599)
            c->bad++;
        break;
    default:
        c->absent++;
        c->bad++; /* an absent record is never stored */
        break;
    }
    if (c->print_records) {
        printf("{\"key\":\"");
        for (size_t i = 0; i < STORE_KEY_BYTES; i++)
            printf("%02x", key[i]);
        char lease[24] = "null"; /* a COMPLETE record's lease is history */
        if (rec->state == STORE_STATE_IN_PROGRESS)
            snprintf(lease, sizeof(lease), "%lld", (long long)lease_end);
        printf("\",\"state\":\"%s\",\"held\":%s,\"lease_expires_ms\":%s,"
               "\"expires_ms\":%lld,\"status\":%d,\"body_bytes\":%zu}\n",
               state,
               rec->state == STORE_STATE_IN_PROGRESS && lease_end > c->now_ms &&
                       store_lease_is_held(rec->lease_id)
                   ? "true"
                   : "false", /* as in the summary: a hold that ended is stealable */
               lease, (long long)rec->expires_ms,
               rec->state == STORE_STATE_COMPLETE ? rec->status : 0, rec->body_len);
    }
    return 0;
}

/* A stored entry that is not a record: counted, and the first few named as
 * JSON objects (key in hex, at most 32 bytes of it, table, value size,
 * what is wrong). */
static void check_corrupt(const uint8_t *key, size_t key_len, const char *table, size_t value_len,
                          const char *detail, void *arg)
{
    struct check_ctx *c = arg;
    char hex[2 * STORE_KEY_BYTES + 1] = "";
    size_t shown = key_len < STORE_KEY_BYTES ? key_len : STORE_KEY_BYTES;

    if (c->corrupt < CHECK_CORRUPT_SHOWN) {
        for (size_t i = 0; i < shown; i++)
            snprintf(hex + 2 * i, 3, "%02x", key[i]);
        snprintf(c->corrupt_first[c->corrupt], sizeof(c->corrupt_first[0]),
                 "{\"key\":\"%s\",\"key_bytes\":%zu,\"table\":\"%s\",\"value_bytes\":%zu,"
                 "\"detail\":\"%s\"}",
                 hex, key_len, table, value_len, detail);
    }
    c->corrupt++;
    c->bad++;
}

/*
 * check-store PATH [--records]: opens a store (beside running proxies, if
 * any), decodes every record and checks the invariants that need no clock
 * agreement: every record decodes, is IN_PROGRESS or COMPLETE, only a
 * COMPLETE one carries a payload, and no key is stored twice. Prints a JSON summary (and with
 * --records one line per record, keys as their 32-byte hashes); exit 0 when they hold.
 * The store is opened read-only: nothing is created or written, and a path
 * that holds no store, or a damaged one, fails the check. Records that do not
 * decode are all counted ("corrupt"), the first few named ("corrupt_first").
 */
static int check_store(const char *path, bool print_records)
{
    char err[512];
    struct store *st = NULL;
    struct store_options so = {
        .path = path, .map_size_bytes = 0, .sync = true, .clock = NULL, .read_only = true};
    struct check_ctx c = {.print_records = print_records};
    struct store_stats stats = {0};
    int cleared = 0;
    int rc = 1;
    int src;

    if (store_open(NULL, &so, &st, err, sizeof(err)) != 0) {
        print_store_error(path, err);
        printf("{\"ok\":false,\"scan\":\"not opened\",\"error\":\"");
        for (const char *p = err; *p != '\0'; p++) {
            if (*p == '"' || *p == '\\')
                putchar('\\');
            if ((unsigned char)*p >= 0x20)
                putchar(*p);
        }
        printf("\"}\n");
        goto out;
    }
    store_reader_check(st, &cleared);
    c.now_ms = store_clock_realtime.now_ms(store_clock_realtime.ctx);
    c.lease_now_ms = store_clock_lease_now(&store_clock_realtime);
    store_stats(st, &stats);
    c.lease_clock = stats.lease_clock;
    src = store_scan_all(st, check_record, check_corrupt, &c);
    store_stats(st, &stats);
    printf("{\"ok\":%s,\"scan\":\"%s\",\"records\":%llu,\"in_progress\":%llu,"
           "\"held\":%llu,\"stealable\":%llu,\"complete\":%llu,\"expired_complete\":%llu,"
           "\"duplicate_keys\":%llu,\"corrupt\":%llu,\"corrupt_first\":[",
           src == 0 && c.bad == 0 ? "true" : "false",
           src != 0         ? store_strerror(src)
           : c.corrupt != 0 ? store_strerror(STORE_ECORRUPT)
                            : "ok",
           (unsigned long long)(c.in_progress + c.complete + c.absent + c.corrupt),
           (unsigned long long)c.in_progress, (unsigned long long)c.held,
           (unsigned long long)c.stealable,
           (unsigned long long)c.complete, (unsigned long long)c.expired_complete,
           (unsigned long long)c.duplicate_keys, (unsigned long long)c.corrupt);
    for (uint64_t i = 0; i < c.corrupt && i < CHECK_CORRUPT_SHOWN; i++)
        printf("%s%s", i > 0 ? "," : "", c.corrupt_first[i]);
    printf("],\"bad\":%llu,\"leases_from\":\"%s\",\"in_flight_env\":\"%s\","
           "\"stale_readers_cleared\":%llu,\"map_used_bytes\":%llu,\"map_size_bytes\":%llu}\n",
           (unsigned long long)c.bad,
           c.lease_clock == STORE_LEASES_THIS_BOOT    ? "this_boot"
           : c.lease_clock == STORE_LEASES_OTHER_BOOT ? "previous_boot"
                                                      : "wall_clock",
           /* Layout 4's records in flight: read when they are of this
            * boot; of another, they ended with it, and are not opened. */
           stats.has_inflight                          ? "read"
           : c.lease_clock == STORE_LEASES_THIS_BOOT  ? "none"
                                                      : "not_this_boot",
           (unsigned long long)stats.stale_readers_cleared_at_open +
               (unsigned long long)(cleared > 0 ? cleared : 0),
           (unsigned long long)stats.map_used_bytes, (unsigned long long)stats.map_size_bytes);
    rc = src == 0 && c.bad == 0 ? 0 : 1;
out:
    store_close(st);
    return rc;
}

/* The exit status after the store went dead (EX_TEMPFAIL, sysexits.h): a
 * supervisor's "restart on failure" starts the proxy again, and the new
 * process's open of the store is what brings it back. */
#define EXIT_STORE_DEAD 75

static atomic_bool store_dead;

/* store_options.stall_ms: a wait for the store's writer lock, or a hold of
 * it, past half the smallest margin a route leaves between its heartbeat
 * and its lease is taken as a stall (a heartbeat held up by one could not
 * keep its lease), at least 1 ms. */
static int64_t stall_threshold_ms(const struct config *cfg)
{
    int64_t margin = INT64_MAX;

    for (size_t i = 0; i < cfg->n_routes; i++) {
        int64_t m = cfg->routes[i].lease_ms - cfg->routes[i].heartbeat_ms;
        if (m < margin)
            margin = m;
    }
    if (margin == INT64_MAX)
        margin = 30000 - 15000; /* no route: the defaults */
    return margin / 2 > 0 ? margin / 2 : 1;
}

/* store_options.on_dead: LMDB refuses every transaction from here on (a
 * commit's meta page could not be written: MDB_PANIC), reads included, so
 * every request would get 503 until someone restarted the process. Stop
 * now, as SIGTERM does (requests in flight are answered as the store lets
 * them), and exit with EXIT_STORE_DEAD. */
static void on_store_dead(void *ctx)
{
    char cause[256];

    (void)ctx;
    atomic_store(&store_dead, true);
    /* Called on the thread whose call met it, so the cause is that call's. */
    if (store_last_cause(cause, sizeof(cause)) == 0)
        snprintf(cause, sizeof(cause), "the store takes no more transactions");
    idem_diag("idemproxy: store: %s; stopping, exit status %d: start the proxy again (a "
              "supervisor's restart on failure does) and it reopens the store",
              cause, EXIT_STORE_DEAD);
    kill(getpid(), SIGTERM);
}

static int run(const char *config_path, const char *listen, const char *upstream,
               const char *store_path)
{
    char err[512];
    struct config *cfg = NULL;
    struct store *st = NULL;
    struct proxy_server *srv = NULL;
    sigset_t set;
    int sig = 0;
    int rc = 1;
    bool curl_ready = false;

    if (config_path != NULL)
        rc = config_load_file(config_path, &cfg, err, sizeof(err));
    else
        rc = config_new_default(&cfg, err, sizeof(err));
    if (rc != 0) {
        fprintf(stderr, "idemproxy: %s\n", err);
        rc = 1;
        goto out;
    }
    if (cfg->upstream.url == NULL && upstream == NULL) {
        fprintf(stderr,
                "idemproxy: upstream: is required: set \"upstream\" in %s, or give --upstream "
                "URL\n",
                config_path);
        rc = 1;
        goto out;
    }
    if (config_override(cfg, listen, upstream, store_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "idemproxy: %s\n", err);
        rc = 1;
        goto out;
    }
    {
        struct store_options so = {
            .path = cfg->store.path,
            .map_size_bytes = cfg->store.map_size_bytes,
            .sync = cfg->store.durability == CONFIG_DURABILITY_SYNC,
            .allow_shared_fs = !cfg->store.require_local_fs,
            .clock = NULL,
            .stall_ms = stall_threshold_ms(cfg),
            .on_dead = on_store_dead,
        };
        struct store_stats stats = {0};
        if (store_open(NULL, &so, &st, err, sizeof(err)) != 0) {
            print_store_error(cfg->store.path, err);
            rc = 1;
            goto out;
        }
        /* A map_size below what the store already holds (lowered at a
         * restart) is raised by LMDB to the data's size: the map is full
         * from the start, and every new key would get 503 with no word why. */
        if (store_stats(st, &stats) == 0 && stats.flushing_for_sync)
            fprintf(stderr,
                    "idemproxy: store: durability is \"interval\", but a process with \"sync\" "
                    "has this store open: while it does, this process flushes every commit too "
                    "(an unflushed commit lost in a power cut can take the whole store with it, "
                    "that process's records included)\n");
        if (store_stats(st, &stats) == 0 && stats.shared_fs != NULL)
            fprintf(stderr,
                    "idemproxy: store: warning: %s is on %s, where LMDB's locks and memory map "
                    "work only among the processes of one host; store.require_local_fs is "
                    "false, so it is used anyway: if another host opens it, the same key can "
                    "run twice\n",
                    cfg->store.path, stats.shared_fs);
        if (store_stats(st, &stats) == 0 && so.map_size_bytes > 0 &&
            stats.map_size_bytes > so.map_size_bytes && stats.map_size_from_store)
            fprintf(stderr,
                    "idemproxy: store: warning: map_size (%llu bytes) is smaller than the %llu "
                    "bytes the other processes sharing the store map; this process maps %llu "
                    "too (a smaller map would be full while the store has room). Give every "
                    "process on a store the same store.map_size\n",
                    (unsigned long long)so.map_size_bytes, (unsigned long long)stats.map_size_bytes,
                    (unsigned long long)stats.map_size_bytes);
        else if (store_stats(st, &stats) == 0 && so.map_size_bytes > 0 &&
                 stats.map_size_bytes > so.map_size_bytes)
            fprintf(stderr,
                    "idemproxy: store: warning: map_size (%llu bytes) is smaller than the store's "
                    "data "
                    "(%llu bytes): the map is full (MDB_MAP_FULL) and new keys get 503 until "
                    "purging frees room; raise store.map_size\n",
                    (unsigned long long)so.map_size_bytes,
                    (unsigned long long)stats.map_size_bytes);
    }
    /* Signals are taken by sigwait() below, never by a worker. SIGHUP (a
     * closed terminal, or a supervisor's "reload", which idemproxy does not
     * have) drains like SIGTERM rather than killing the process with
     * requests in flight. */
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* A write past a file size limit (RLIMIT_FSIZE) must fail with EFBIG,
     * which the store treats as a full file system (fail closed), rather
     * than kill the process with SIGXFSZ in the middle of a commit. */
    signal(SIGXFSZ, SIG_IGN);
    /* SIGUSR1/SIGUSR2 mean "reopen your logs" to logrotate and to nginx
     * users; idemproxy writes to stdout and stderr and has nothing to
     * reopen. Their default action would kill requests in flight. */
    signal(SIGUSR1, SIG_IGN);
    signal(SIGUSR2, SIG_IGN);
    /* Only for the libcurl client. Its global init sets up OpenSSL, which
     * neither client uses (the upstream is http:// only), and that alone
     * keeps ~2 MiB more of libcrypto resident in the process. */
    if (cfg->upstream.client == CONFIG_UPSTREAM_LIBCURL) {
        CURLcode cc = curl_global_init(CURL_GLOBAL_DEFAULT);
        if (cc != CURLE_OK) {
            fprintf(stderr, "idemproxy: libcurl: cannot initialise: %s\n", curl_easy_strerror(cc));
            rc = 1;
            goto out;
        }
        curl_ready = true;
    }
    if (proxy_server_start(cfg, st, &srv, err, sizeof(err)) != 0) {
        fprintf(stderr, "idemproxy: %s\n", err);
        rc = 1;
        goto out;
    }
    idem_fault_arm(); /* tests/faults: count from here, not during startup */
    while (sigwait(&set, &sig) != 0)
        ;
    /* Not fprintf: a stderr nobody reads must not hold up the exit. */
    idem_diag("idemproxy: %s: draining",
              sig == SIGINT                 ? "SIGINT"
              : sig == SIGHUP               ? "SIGHUP"
              : atomic_load(&store_dead)    ? "store dead"
                                            : "SIGTERM");
    proxy_server_stop(srv);
    if (proxy_server_join(srv) == PROXY_STORE_STUCK) {
        /* The writer is still inside a commit (or a sync), waiting for the
         * disk, two seconds past server.drain_timeout; the clients waiting
         * for it have had their 503 (server.c, give_up_store_waits).
         * Waiting longer would make the stop as long as the stall, and the
         * store cannot be closed under a live transaction (mdb_env_close),
         * so the process ends here as a crash would end it: LMDB keeps the
         * last committed state (the stuck commit never wrote its meta
         * page, or did and is whole), and a record the exit leaves
         * IN_PROGRESS is freed when its lease ends. Not exit 0: that says
         * every request in flight was settled, and this stop left a commit
         * unfinished; EXIT_STORE_DEAD, as for a store that takes no more
         * transactions. A thread stuck in the kernel itself (a device that
         * never answers) still holds the process until the I/O returns,
         * as it would hold a kill -9. */
        idem_diag("idemproxy: store: a commit did not finish within server.drain_timeout "
                  "and two seconds (the disk is stalled); exiting without it, exit status %d: "
                  "the records it held keep their last committed state, and any left in "
                  "progress are freed when their leases end",
                  EXIT_STORE_DEAD);
        _exit(EXIT_STORE_DEAD);
    }
    idem_diag("idemproxy: stopped");
    rc = atomic_load(&store_dead) ? EXIT_STORE_DEAD : 0;
out:
    store_close(st);
    config_free(cfg);
    if (curl_ready)
        curl_global_cleanup();
    return rc;
}

/*
 * Makes sure descriptors 0, 1 and 2 are open, on /dev/null if they were
 * closed (`idemproxy ... >&-`), as daemons do. Otherwise the next open()
 * takes the lowest free number: LMDB's lock.mdb became stdout or stderr,
 * the access log and the diagnostics were written into the store, and
 * requests failed (503, then a robust-mutex assertion). Returns 0, or -1
 * when /dev/null cannot be opened.
 */
static int std_fds_open(void)
{
    int rc = 0;

    for (int fd = STDIN_FILENO; fd <= STDERR_FILENO && rc == 0; fd++) {
        int nfd;
        if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF)
            continue;
        /* The lower ones are open, so this is fd itself. */
        nfd = open("/dev/null", O_RDWR);
        if (nfd < 0) {
            rc = -1;
        } else if (nfd != fd) {
            if (dup2(nfd, fd) < 0)
                rc = -1;
            close(nfd);
        }
    }
    return rc;
}

/* show-key and forget-key: PATH SCOPE KEY [--scope-header-value VALUE]
 * [--force]. The record key is derived as the proxy derives it: KEY as an
 * Idempotency-Key header value (bare or a structured-field string), SCOPE
 * a route's scope, with the SHA-256 of the scope header's value when the
 * route has one. */
#define KEYTOOL_MAX_KEY 8192

struct key_args {
    const char *path;
    bool force;
    bool allow_shared_fs;
    uint8_t record_key[STORE_KEY_BYTES];
    /* As the access log shows it (keyed with the store's salt, so known
     * once the store is open); "" when the store has none yet. */
    char log_key[9];
};

/* The options of the proxy and of check-config. */
static bool is_run_option(const char *a)
{
    static const char *const options[] = {"--config", "--listen", "--upstream", "--store",
                                          "--help",   "-h",       "--version"};

    for (size_t i = 0; i < sizeof(options) / sizeof(options[0]); i++)
        if (strcmp(a, options[i]) == 0)
            return true;
    return false;
}

static int key_args_parse(int argc, char **argv, bool forget, struct key_args *ka)
{
    const char *scope_value = NULL;
    char *key = NULL, *scope = NULL, *line = NULL;
    size_t value_len = 0;
    size_t key_len = 0, scope_len = 0;
    struct config_route route;
    enum idem_key_status ks;
    const char *cmd = forget ? "forget-key" : "show-key";
    const char *synopsis = forget ? USAGE_FORGET_KEY : USAGE_SHOW_KEY;
    const char *misplaced = NULL;
    int rc = 2;

    memset(ka, 0, sizeof(*ka));
    /* The options come after PATH SCOPE KEY. One of them in their place
     * is said as that, but only when the command line is wrong either way:
     * a scope or a key may be "--force" too (a client may send any visible
     * key), and "show-key PATH SCOPE --force" looks that key up. */
    for (int i = 2; i < argc && i < 5 && misplaced == NULL; i++) {
        if (strcmp(argv[i], "--scope-header-value") == 0 || strcmp(argv[i], "--force") == 0 ||
            strcmp(argv[i], "--allow-shared-fs") == 0)
            misplaced = argv[i];
    }
    if (argc < 5)
        return key_usage_error(synopsis, cmd, misplaced, "%s: needs PATH SCOPE KEY (%s missing)",
                               cmd,
                               argc == 2   ? "all three"
                               : argc == 3 ? "SCOPE and KEY"
                                           : "KEY");
    for (int i = 5; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--scope-header-value") == 0) {
            if (i + 1 >= argc)
                return key_usage_error(synopsis, cmd, misplaced, "%s: needs a value", a);
            if (scope_value != NULL)
                return key_usage_error(synopsis, cmd, misplaced, "%s: given twice", a);
            scope_value = argv[++i];
        } else if ((strcmp(a, "--force") == 0 || strcmp(a, "--allow-shared-fs") == 0) && !forget) {
            return key_usage_error(synopsis, cmd, misplaced,
                                   "%s: only with forget-key (show-key only reads)", a);
        } else if (strcmp(a, "--force") == 0 || strcmp(a, "--allow-shared-fs") == 0) {
            bool *flag = strcmp(a, "--force") == 0 ? &ka->force : &ka->allow_shared_fs;
            if (*flag)
                return key_usage_error(synopsis, cmd, misplaced, "%s: given twice", a);
            *flag = true;
        } else if (a[0] == '-' && a[1] != '\0') {
            return key_usage_error(synopsis, cmd, misplaced, "%s: unknown option", a);
        } else {
            return key_usage_error(synopsis, cmd, misplaced,
                                   "%s: unexpected argument (%s takes PATH SCOPE KEY)", a, cmd);
        }
    }
    ka->path = argv[2];
    /* As check-config allows a route's scope: any other holds no record,
     * and "no such key" (exit 1) would send the operator looking for it. */
    bool scope_ok = argv[3][0] != '\0' && strlen(argv[3]) <= 128;
    for (const char *p = argv[3]; scope_ok && *p != '\0'; p++)
        scope_ok = *p >= 0x21 && *p <= 0x7e;
    if (!scope_ok) {
        fprintf(stderr, "idemproxy: SCOPE: a route's scope is 1 to 128 visible ASCII characters "
                        "(no spaces), as check-config prints it\n");
        return 2;
    }
    key = malloc(KEYTOOL_MAX_KEY);
    if (key == NULL)
        goto out;
    ks = idem_key_parse(argv[4], strlen(argv[4]), KEYTOOL_MAX_KEY, key, &key_len);
    if (ks != IDEM_KEY_OK) {
        fprintf(stderr, "idemproxy: KEY: %s\n", idem_key_status_text(ks));
        goto out;
    }
    /* "-": the value is read from stdin, one line, so that a credential
     * (scope_header "Authorization") is not on the command line, where
     * every local user can read it (ps, /proc). */
    if (scope_value != NULL && strcmp(scope_value, "-") == 0) {
        size_t n;
        line = malloc(KEYTOOL_MAX_KEY);
        if (line == NULL)
            goto out;
        if (fgets(line, KEYTOOL_MAX_KEY, stdin) == NULL) {
            fprintf(stderr, "idemproxy: --scope-header-value -: no line on stdin\n");
            goto out;
        }
        n = strlen(line);
        if (n == KEYTOOL_MAX_KEY - 1 && line[n - 1] != '\n' && getc(stdin) != EOF) {
            fprintf(stderr, "idemproxy: --scope-header-value -: the line is longer than %d bytes\n",
                    KEYTOOL_MAX_KEY - 1);
            goto out;
        }
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = '\0';
        scope_value = line;
    }
    /* As the proxy sees a header's value: without the white space around
     * it, and never empty (a request with an empty one gets 400). */
    if (scope_value != NULL) {
        size_t n;
        while (*scope_value == ' ' || *scope_value == '\t')
            scope_value++;
        n = strlen(scope_value);
        while (n > 0 && (scope_value[n - 1] == ' ' || scope_value[n - 1] == '\t'))
            n--;
        if (n == 0) {
            fprintf(stderr, "idemproxy: --scope-header-value: empty (the proxy answers 400 to "
                            "a request whose scope header is empty, so no record has one)\n");
            goto out;
        }
        value_len = n;
    }
    memset(&route, 0, sizeof(route));
    route.scope = argv[3];
    route.scope_header = scope_value != NULL ? "(given)" : NULL;
    if (idem_scope_build(&route, scope_value, value_len, &scope, &scope_len) != 0) {
        fprintf(stderr, "idemproxy: out of memory\n");
        goto out;
    }
    store_key_derive(scope, scope_len, key, key_len, ka->record_key);
    rc = 0;
out:
    free(scope);
    free(key);
    free(line);
    return rc;
}

/* A header name or value as a JSON string: as UTF-8 when it is, else each
 * byte as the ISO-8859-1 character it was in HTTP's past (RFC 9110 section
 * 5.5, obs-text), so a value the proxy replays is never left out. NULL only
 * when memory ran out. */
static json_t *header_text(const char *s, size_t len)
{
    json_t *v = json_stringn(s, len);
    char *text = NULL;
    size_t n = 0;

    if (v != NULL)
        goto out;
    text = malloc(2 * len + 1);
    if (text == NULL)
        goto out;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x80) {
            text[n++] = (char)c;
        } else {
            text[n++] = (char)(0xc0 | (c >> 6));
            text[n++] = (char)(0x80 | (c & 0x3f));
        }
    }
    v = json_stringn(text, n);
out:
    free(text);
    return v;
}

/* The record as JSON (show-key): its state and times as check-store shows
 * them, and the stored answer, body as a string when it is UTF-8 (else
 * body_base64 is not given: body_bytes says how long it is). */
static json_t *record_json(const struct key_args *ka, const struct store_record *rec,
                           const struct check_ctx *c)
{
    char hex[2 * STORE_KEY_BYTES + 1];
    int64_t lease_end = lease_end_wall(c, rec);
    bool held = rec->state == STORE_STATE_IN_PROGRESS && lease_end > c->now_ms &&
                store_lease_is_held(rec->lease_id);
    json_t *o = json_object();
    json_t *headers = json_array();
    struct idem_headers h = {0};

    for (size_t i = 0; i < STORE_KEY_BYTES; i++)
        snprintf(hex + 2 * i, 3, "%02x", ka->record_key[i]);
    json_object_set_new(o, "found", json_true());
    json_object_set_new(o, "record_key", json_string(hex));
    json_object_set_new(o, "log_key", ka->log_key[0] ? json_string(ka->log_key) : json_null());
    json_object_set_new(o, "state", json_string(rec->state == STORE_STATE_COMPLETE
                                                    ? "complete"
                                                    : "in_progress"));
    json_object_set_new(o, "held", json_boolean(held));
    json_object_set_new(o, "stealable", json_boolean(rec->state == STORE_STATE_IN_PROGRESS &&
                                                     lease_end <= c->now_ms));
    if (rec->state == STORE_STATE_IN_PROGRESS)
        json_object_set_new(o, "lease_expires_ms", json_integer(lease_end));
    json_object_set_new(o, "expires_ms", json_integer(rec->expires_ms));
    if (rec->state == STORE_STATE_COMPLETE) {
        json_object_set_new(o, "status", json_integer(rec->status));
        if (idem_headers_decode(rec->headers, rec->headers_len, &h) == 0) {
            for (size_t i = 0; i < h.n; i++) {
                json_t *pair = json_array();
                json_array_append_new(pair, header_text(h.v[i].name, h.v[i].name_len));
                json_array_append_new(pair, header_text(h.v[i].value, h.v[i].value_len));
                json_array_append_new(headers, pair);
            }
        }
        idem_headers_clear(&h);
        json_object_set_new(o, "headers", headers);
        headers = NULL;
        json_object_set_new(o, "body_bytes", json_integer((json_int_t)rec->body_len));
        json_t *body = json_stringn((const char *)rec->body, rec->body_len);
        if (body != NULL)
            json_object_set_new(o, "body", body);
    }
    json_decref(headers);
    return o;
}

static int print_json(json_t *o)
{
    char *text = o != NULL ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (text == NULL) {
        fprintf(stderr, "idemproxy: out of memory\n");
        return -1;
    }
    printf("%s\n", text);
    free(text);
    return 0;
}

/* Opens the store read-only (beside running proxies) and reads the key's
 * record into *rec; c gets the clocks to show its times with. 0, 1 (no
 * record), 2 (the store or the record could not be read). */
static int key_read(struct key_args *ka, struct store_record *rec, struct check_ctx *c,
                    uint64_t *map_size)
{
    char err[512];
    struct store *st = NULL;
    struct store_options so = {.path = ka->path, .sync = true, .read_only = true};
    struct store_stats stats = {0};
    int rc = 2;
    int grc;

    memset(rec, 0, sizeof(*rec));
    if (store_open(NULL, &so, &st, err, sizeof(err)) != 0) {
        print_store_error(ka->path, err);
        return 2;
    }
    c->now_ms = store_clock_realtime.now_ms(store_clock_realtime.ctx);
    c->lease_now_ms = store_clock_lease_now(&store_clock_realtime);
    if (store_stats(st, &stats) == 0) {
        c->lease_clock = stats.lease_clock;
        *map_size = stats.map_size_bytes;
        if (stats.has_log_salt)
            idem_key_loghash(stats.log_salt, ka->record_key, ka->log_key);
    }
    grc = store_get(st, ka->record_key, rec);
    if (grc == STORE_ECORRUPT) {
        fprintf(stderr, "idemproxy: the record does not decode (damaged); forget-key deletes "
                        "it\n");
    } else if (grc != 0) {
        fprintf(stderr, "idemproxy: store %s: %s\n", ka->path, store_strerror(grc));
    } else {
        rc = rec->state == STORE_STATE_ABSENT ? 1 : 0;
    }
    store_close(st);
    return rc;
}

static int show_key(int argc, char **argv)
{
    struct key_args ka;
    struct store_record rec;
    struct check_ctx c = {0};
    uint64_t map_size = 0;
    int rc = key_args_parse(argc, argv, false, &ka);

    if (rc != 0)
        return rc;
    rc = key_read(&ka, &rec, &c, &map_size);
    if (rc == 0 && print_json(record_json(&ka, &rec, &c)) != 0)
        rc = 2;
    if (rc == 1)
        printf("{\"found\":false,\"log_key\":%s%s%s}\n", ka.log_key[0] ? "\"" : "",
               ka.log_key[0] ? ka.log_key : "null", ka.log_key[0] ? "\"" : "");
    store_record_clear(&rec);
    return rc;
}

/* Deletes the record (STORE_OP_FORGET) in a writable open of the store
 * with the store's own map size. The open creates and upgrades nothing
 * (keep_layout): raising an older store's layout would stop the proxies of
 * that version running on it from writing. */
static int forget_key(int argc, char **argv)
{
    char err[512];
    struct key_args ka;
    struct store_record rec;
    struct check_ctx c = {0};
    struct store *st = NULL;
    uint64_t map_size = 0;
    enum store_outcome o = 0;
    const char *was = "absent";
    int rc = key_args_parse(argc, argv, true, &ka);
    int frc;

    if (rc != 0)
        return rc;
    rc = key_read(&ka, &rec, &c, &map_size);
    if (rc == 0)
        was = rec.state == STORE_STATE_COMPLETE ? "complete" : "in_progress";
    else if (rc == 2 && map_size == 0)
        return 2; /* the store did not open */
    store_record_clear(&rec);
    struct store_options so = {.path = ka.path,
                               .map_size_bytes = map_size,
                               .sync = true,
                               .allow_shared_fs = ka.allow_shared_fs,
                               .keep_layout = true};
    if (store_open(NULL, &so, &st, err, sizeof(err)) != 0) {
        print_store_error(ka.path, err);
        if (strstr(err, "LMDB needs a local file system") != NULL)
            fprintf(stderr, "idemproxy: forget-key: if only processes of this one host ever "
                            "open it, give --allow-shared-fs\n");
        return 2;
    }
    frc = store_forget(st, ka.record_key, ka.force, &o);
    store_close(st);
    if (frc != 0) {
        fprintf(stderr, "idemproxy: store %s: %s\n", ka.path, store_strerror(frc));
        return 2;
    }
    printf("{\"forgotten\":%s,\"outcome\":\"%s\",\"was\":\"%s\",\"log_key\":%s%s%s}\n",
           o == STORE_DONE ? "true" : "false", store_outcome_name(o),
           o == STORE_DONE && rc == 2 ? "damaged" : was, ka.log_key[0] ? "\"" : "",
           ka.log_key[0] ? ka.log_key : "null", ka.log_key[0] ? "\"" : "");
    if (o == STORE_BUSY)
        fprintf(stderr, "idemproxy: its request is running now (a live lease): deleting the "
                        "record would let a retry run beside it, and its result would not be "
                        "stored; wait for it, or give --force\n");
    return o == STORE_DONE ? 0 : o == STORE_BUSY ? 3 : 1;
}

int main(int argc, char **argv)
{
    const char *config_path = NULL, *listen = NULL, *upstream = NULL, *store_path = NULL;

    /* Bodies and answers of a MiB or more come and go with the traffic.
     * glibc raises its mmap threshold to the largest block freed (up to
     * 32 MiB) and then keeps such blocks in its heaps: after a burst of
     * 10 MiB replays the process held 2.5 GiB it no longer used. A fixed
     * threshold (glibc's initial one) gives them back to the system when
     * freed, so server.max_buffered bounds what the process holds. */
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    /* Before anything is opened (every command opens a store or a file). */
    if (std_fds_open() != 0) {
        fprintf(stderr, "idemproxy: cannot open /dev/null in place of a closed stdin, stdout "
                        "or stderr\n");
        return 1;
    }
    /* "idemproxy check-store --help" asks for help, not for a store named
     * "--help". */
    if (argc == 3 && (strcmp(argv[2], "--help") == 0 || strcmp(argv[2], "-h") == 0) &&
        (strcmp(argv[1], "check-store") == 0 || strcmp(argv[1], "show-key") == 0 ||
         strcmp(argv[1], "forget-key") == 0 || strcmp(argv[1], "check-config") == 0)) {
        fputs(usage, stdout);
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "check-store") == 0) {
        if (argc < 3 || strcmp(argv[2], "--records") == 0)
            return usage_error(USAGE_CHECK_STORE, "check-store: needs PATH, the store's "
                                                  "directory, first");
        for (int i = 3; i < argc; i++) {
            if (strcmp(argv[i], "--records") != 0)
                return usage_error(USAGE_CHECK_STORE, "%s: %s", argv[i],
                                   argv[i][0] == '-' ? "unknown option"
                                                     : "unexpected argument (check-store "
                                                       "takes one PATH)");
            if (i > 3)
                return usage_error(USAGE_CHECK_STORE, "--records: given twice");
        }
        return check_store(argv[2], argc == 4);
    }
    if (argc >= 2 && strcmp(argv[1], "show-key") == 0)
        return show_key(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "forget-key") == 0)
        return forget_key(argc, argv);
    bool checking = argc >= 2 && strcmp(argv[1], "check-config") == 0;
    const char *synopsis = checking ? USAGE_CHECK_CONFIG : USAGE_RUN;
    if (checking) {
        if (argc < 3 || (argv[2][0] == '-' && argv[2][1] != '\0'))
            return usage_error(synopsis, "check-config: needs FILE, the configuration to "
                                         "check, first");
        config_path = argv[2];
    }
    for (int i = checking ? 3 : 1; i < argc; i++) {
        const char *a = argv[i];
        const char **slot = NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage, stdout);
            return 0;
        }
        if (strcmp(a, "--version") == 0) {
            /* The release, and the commit built (two builds of one release
             * told apart, as in a rolling upgrade). */
            if (IDEM_BUILD[0] != '\0')
                printf("idemproxy %s (%s)\n", IDEM_VERSION, IDEM_BUILD);
            else
                printf("idemproxy %s\n", IDEM_VERSION);
            return 0;
        }
        if (strcmp(a, "--config") == 0 && !checking)
            slot = &config_path;
        else if (strcmp(a, "--listen") == 0)
            slot = &listen;
        else if (strcmp(a, "--upstream") == 0)
            slot = &upstream;
        else if (strcmp(a, "--store") == 0)
            slot = &store_path;
        if (slot == NULL) {
            const char *eq = strchr(a, '=');
            if (checking && strcmp(a, "--config") == 0)
                return usage_error(synopsis, "--config: not with check-config, whose FILE is "
                                             "the configuration");
            if (strncmp(a, "--", 2) == 0 && eq != NULL)
                return usage_error(synopsis,
                                   "%s: unknown option (give the value after a space: %.*s VALUE)",
                                   a, (int)(eq - a), a);
            if (a[0] == '-')
                return usage_error(synopsis, "%s: unknown option", a);
            if (checking)
                return usage_error(synopsis,
                                   "%s: unexpected argument (check-config takes one FILE)", a);
            return usage_error(synopsis, "%s: %s", a,
                               i == 1 ? "unknown command (commands: check-config, check-store, "
                                        "show-key, forget-key)"
                                      : "unexpected argument");
        }
        /* "--config --upstream URL": the file was left out, and the next
         * option is not its value. Only one of the options: a value may
         * start with "--" too (a store directory "--data", say). */
        if (i + 1 >= argc || is_run_option(argv[i + 1]))
            return usage_error(synopsis, "%s: needs a value", a);
        /* Given twice is a mistake somewhere (a wrapper script adding its
         * own --store, say): say so rather than silently take one. */
        if (*slot != NULL)
            return usage_error(synopsis, "%s: given twice (\"%s\" and \"%s\")", a, *slot,
                               argv[i + 1]);
        *slot = argv[++i];
    }
    if (checking)
        return check_config(config_path, listen, upstream, store_path);
    if (config_path == NULL && upstream == NULL)
        return usage_error(synopsis, "give --config FILE or --upstream URL");
    return run(config_path, listen, upstream, store_path);
}
