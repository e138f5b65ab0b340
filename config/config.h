/*
 * config.h - idemproxy's configuration: the JSON file of CONTRACT.md
 * section 4, its defaults, and the effective configuration printed by
 * `idemproxy check-config`.
 *
 * Loading never logs: a failure returns a negative code and writes one line
 * to err that names the field, e.g.
 *     routes[0].ttl: "forever" is not a duration
 * (jansson's own parse errors are reported with line and column).
 *
 * Ownership: a struct config and everything it points to belong to it and
 * are freed by config_free(). Nothing here is global; every function is
 * thread-safe on distinct configs.
 */
#ifndef IDEM_CONFIG_H
#define IDEM_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CONFIG_MAX_SCOPE_LENGTH 128

enum config_error {
    CONFIG_OK = 0,
    CONFIG_EINVAL = -1, /* the configuration is invalid (err says where) */
    CONFIG_EIO = -2,    /* the file could not be read */
    CONFIG_ENOMEM = -3,
};

enum config_match { CONFIG_MATCH_PREFIX = 0, CONFIG_MATCH_EXACT = 1 };
/* "auto": canonical JSON for JSON bodies; "raw": the body bytes as sent. */
enum config_fingerprint { CONFIG_FINGERPRINT_AUTO = 0, CONFIG_FINGERPRINT_RAW = 1 };
enum config_on_unknown { CONFIG_ON_UNKNOWN_RELEASE = 0, CONFIG_ON_UNKNOWN_COMPLETE = 1 };
enum config_durability { CONFIG_DURABILITY_SYNC = 0, CONFIG_DURABILITY_INTERVAL = 1 };

struct config_route {
    char *path;
    enum config_match match;
    char **methods; /* upper-case tokens, e.g. "POST" */
    size_t n_methods;
    char *scope;        /* never NULL after loading (derived from path) */
    char *scope_header; /* NULL when not set */
    int64_t ttl_ms;
    int64_t lease_ms;
    int64_t heartbeat_ms;
    int64_t wait_ms;
    bool require_key;
    enum config_fingerprint fingerprint;
    uint64_t max_body_bytes;
    size_t max_key_length;
    bool release_on[600]; /* release_on[status]: release instead of complete */
    enum config_on_unknown on_unknown;
    char **strip_headers; /* response headers never stored or replayed */
    size_t n_strip_headers;
};

/* The HTTP client that talks to the upstream: the proxy's own minimal
 * HTTP/1.1 client (proxy/upstream.h), or libcurl. */
enum config_upstream_client { CONFIG_UPSTREAM_NATIVE = 0, CONFIG_UPSTREAM_LIBCURL = 1 };

struct config_upstream {
    char *url; /* http://host[:port][/base] */
    enum config_upstream_client client;
    int64_t connect_timeout_ms;
    int64_t timeout_ms;
    uint64_t max_response_bytes; /* larger responses: 502, record released */
    int64_t resolve_interval_ms; /* the upstream's name is looked up again this often */
    int64_t idle_timeout_ms;     /* a pooled connection idle this long is not reused */
};

struct config_store {
    char *path;
    uint64_t map_size_bytes;
    enum config_durability durability;
    int64_t sync_interval_ms;
    int64_t purge_interval_ms;
    bool require_local_fs; /* false: start on NFS, FUSE, ... too (a warning) */
};

/* Server limits (libmicrohttpd and the drain on shutdown). */
struct config_server {
    unsigned workers;         /* event loops; 0 = one per core */
    unsigned max_connections; /* total client connections */
    unsigned per_ip_connections;
    int64_t client_timeout_ms; /* idle client connection timeout */
    size_t header_memory_bytes; /* per-connection header memory (431 past it) */
    /* request bodies, answers and replays held in memory by the process at
     * once (503 out-of-memory past it); 0: "auto", from the memory limit */
    uint64_t max_buffered_bytes;
    int64_t drain_timeout_ms;   /* bound on in-flight requests at SIGTERM */
};

struct config {
    char *listen; /* "host:port", "[v6]:port" or ":port" */
    struct config_upstream upstream;
    struct config_store store;
    struct config_server server;
    bool access_log; /* one JSON line per request on stdout */
    struct config_route *routes;
    size_t n_routes;
};

/* A config holding every default (one catch-all route, upstream unset). */
int config_new_default(struct config **out, char *err, size_t errlen);
int config_load_file(const char *path, struct config **out, char *err, size_t errlen);
int config_load_string(const char *json, size_t len, struct config **out, char *err,
                       size_t errlen);
/* Command-line overrides; NULL leaves a field as it is. Validates the result
 * (e.g. a missing upstream is an error: "upstream: is required"). */
int config_override(struct config *cfg, const char *listen, const char *upstream,
                    const char *store_path, char *err, size_t errlen);
/* Final validation after overrides (upstream present and a valid URL...). */
int config_validate(const struct config *cfg, char *err, size_t errlen);
/* The effective configuration as pretty JSON, every default spelled out,
 * durations as strings with units. Returns a malloc'd string or NULL. */
char *config_dump(const struct config *cfg);
/* config_free(NULL) is a no-op. */
void config_free(struct config *cfg);

/* Parsers exposed for tests and the fuzzer. Both accept what the JSON file
 * accepts as a string ("250ms", "1.5s", "24h", "1MiB", "512"). */
int config_parse_duration(const char *s, int64_t *out_ms);
int config_parse_size(const char *s, uint64_t *out_bytes);

/* Finds the first route (in file order) whose path matches and whose methods
 * include method; NULL when none does (the request is not covered). "prefix"
 * matches on a segment boundary: "/v1/pay" matches "/v1/pay" and "/v1/pay/x"
 * but not "/v1/payx"; a path ending in '/' matches everything below it.
 * path is the request path without the query string. */
const struct config_route *config_match_route(const struct config *cfg, const char *method,
                                              const char *path, size_t path_len);

#endif
