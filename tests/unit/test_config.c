/*
 * test_config.c - unit tests of config/: the duration and size grammars,
 * route matching, command-line overrides, validation of configs edited in
 * code, error reporting, and the dump round trip. The file-level cases
 * (every key, every error message) live in tests/config as data.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "config.h"

#include <stdlib.h>
#include <string.h>

#define ERR_LEN 512

static struct config *load(const char *json)
{
    struct config *cfg = NULL;
    char err[ERR_LEN] = "";

    if (config_load_string(json, strlen(json), &cfg, err, sizeof err) != CONFIG_OK)
        fail_msg("unexpected load error: %s", err);
    return cfg;
}

/* The error a JSON text fails with, loading then validating. */
static void assert_load_error(const char *json, const char *expected)
{
    struct config *cfg = NULL;
    char err[ERR_LEN] = "";
    int rc;

    rc = config_load_string(json, strlen(json), &cfg, err, sizeof err);
    if (rc == CONFIG_OK) {
        rc = config_validate(cfg, err, sizeof err);
        config_free(cfg);
    } else {
        assert_null(cfg);
    }
    assert_int_equal(rc, CONFIG_EINVAL);
    assert_string_equal(err, expected);
}

/* ---- durations ------------------------------------------------------ */

static void assert_duration(const char *s, int64_t expected_ms)
{
    int64_t ms = -1;

    if (config_parse_duration(s, &ms) != CONFIG_OK)
        fail_msg("\"%s\" was rejected", s);
    assert_int_equal(ms, expected_ms);
}

static void assert_not_duration(const char *s)
{
    int64_t ms = 12345;

    if (config_parse_duration(s, &ms) != CONFIG_EINVAL)
        fail_msg("\"%s\" was accepted", s);
    assert_int_equal(ms, 12345); /* untouched on error */
}

static void test_duration_units(void **state)
{
    (void)state;
    assert_duration("250ms", 250);
    assert_duration("1s", 1000);
    assert_duration("1.5s", 1500);
    assert_duration("2m", 120000);
    assert_duration("24h", 86400000);
    assert_duration("7d", 7 * 86400000LL);
    assert_duration("0.5d", 43200000);
}

static void test_duration_bare_number_is_seconds(void **state)
{
    (void)state;
    assert_duration("30", 30000);
    assert_duration("0", 0);
    assert_duration("0.25", 250);
    assert_duration("007s", 7000);
}

static void test_duration_fractions_are_exact_and_round_down(void **state)
{
    (void)state;
    /* Decimal, not binary: 0.1 s is 100 ms, 1.15 s is 1150 ms. */
    assert_duration("0.1s", 100);
    assert_duration("1.15s", 1150);
    assert_duration("0.001s", 1);
    assert_duration("0.0009s", 0);
    assert_duration("1.9999ms", 1);
    assert_duration("1.0000000000000000001s", 1000);
    assert_duration("0ms", 0);
    /* Every digit counts: these are exact values past the 9th digit, and
     * dropping digits before scaling would give one unit less. */
    assert_duration("0.0000003125d", 27);
    /* 1 ms is 0.0000000115740740...d (740 repeating): the 38th digit
     * decides between just over and just under. */
    assert_duration("0.00000001157407407407407407407407407408d", 1);
    assert_duration("0.00000001157407407407407407407407407407d", 0);
    assert_duration("0.99999999999999999999999999999999999999999999999999s", 999);
}

static void test_duration_bounds(void **state)
{
    (void)state;
    assert_duration("36500d", 36500LL * 86400000);
    assert_not_duration("36500.001d");
    assert_duration("36500.0000000115d", 36500LL * 86400000); /* + 0.9936 ms */
    assert_not_duration("36500.0000000116d");                 /* + 1.00224 ms */
    assert_not_duration("36501d");
    assert_not_duration("3153600001s");
    assert_not_duration("99999999999999999999999ms");
    assert_not_duration("18446744073709551616ms");
}

static void test_duration_rejects_malformed(void **state)
{
    static const char *const bad[] = {
        "",     "s",   "ms",   "-1s",  "-0s",     "+1s",  "1e3s", "1E3",    " 1s",
        "1s ",  "1 s", "1.s",  ".5s",  "1..5s",   "1sec", "1S",   "1H",     "5w",
        "10ss", "1s1", "0x10", "1,5s", "forever", "NaN",  "inf",  "1.5.5s", "1ms2",
    };
    size_t i;

    (void)state;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_not_duration(bad[i]);
    assert_int_equal(config_parse_duration(NULL, NULL), CONFIG_EINVAL);
}

/* ---- sizes ---------------------------------------------------------- */

static void assert_size(const char *s, uint64_t expected)
{
    uint64_t bytes = 1;

    if (config_parse_size(s, &bytes) != CONFIG_OK)
        fail_msg("\"%s\" was rejected", s);
    assert_int_equal(bytes, expected);
}

static void assert_not_size(const char *s)
{
    uint64_t bytes = 12345;

    if (config_parse_size(s, &bytes) != CONFIG_EINVAL)
        fail_msg("\"%s\" was accepted", s);
    assert_int_equal(bytes, 12345);
}

static void test_size_units(void **state)
{
    (void)state;
    assert_size("0", 0);
    assert_size("512", 512);
    assert_size("512B", 512);
    assert_size("32KiB", 32768);
    assert_size("1MiB", 1048576);
    assert_size("1GiB", 1073741824);
    assert_size("16GiB", 16ULL << 30);
}

static void test_size_fractions(void **state)
{
    (void)state;
    assert_size("1.5MiB", 1572864);
    assert_size("0.5KiB", 512);
    assert_size("0.001KiB", 1); /* 1.024 bytes, rounded down */
    assert_size("0.0001KiB", 0);
    /* Exact past the 9th digit: 1 + 2^-10 KiB, and 2^-30 GiB. */
    assert_size("1.0009765625KiB", 1025);
    assert_size("0.000000000931322574615478515625GiB", 1);
    assert_size("0.000000000931322574615478515624GiB", 0);
    assert_size("8589934591.99999999999999999999999999GiB", INT64_MAX);
    /* A fraction of a byte is a mistake, not something to round. */
    assert_not_size("1.5");
    assert_not_size("1.5B");
}

static void test_size_bounds(void **state)
{
    (void)state;
    /* The largest accepted size is INT64_MAX: it must fit a JSON integer. */
    assert_size("9223372036854775807", INT64_MAX);
    assert_size("8589934591GiB", (8589934591ULL) << 30);
    assert_not_size("9223372036854775808");
    assert_not_size("8589934592GiB");
    assert_not_size("18446744073709551616");
    assert_not_size("99999999999999999999999999GiB");
}

static void test_size_rejects_malformed(void **state)
{
    static const char *const bad[] = {
        "",   "B",  "KiB",  "-1",    "-1KiB", "+1", "1KB", "1MB",   "1GB",   "1kib", "1K",
        "1k", "1M", "1TiB", "1 MiB", " 1",    "1 ", "1e3", "1.KiB", ".5KiB", "0x10", "big",
    };
    size_t i;

    (void)state;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_not_size(bad[i]);
    assert_int_equal(config_parse_size(NULL, NULL), CONFIG_EINVAL);
}

/* ---- route matching ------------------------------------------------- */

static const char *matched_path(const struct config *cfg, const char *method, const char *path)
{
    const struct config_route *r = config_match_route(cfg, method, path, strlen(path));

    return r != NULL ? r->path : NULL;
}

static void test_match_prefix_on_segment_boundary(void **state)
{
    struct config *cfg = load("{\"routes\": [{\"path\": \"/v1/pay\"}, {\"path\": \"/files/\"}]}");

    (void)state;
    assert_string_equal(matched_path(cfg, "POST", "/v1/pay"), "/v1/pay");
    assert_string_equal(matched_path(cfg, "POST", "/v1/pay/"), "/v1/pay");
    assert_string_equal(matched_path(cfg, "POST", "/v1/pay/x/y"), "/v1/pay");
    assert_null(matched_path(cfg, "POST", "/v1/payx"));
    assert_null(matched_path(cfg, "POST", "/v1/pa"));
    assert_null(matched_path(cfg, "POST", "/v1"));
    assert_null(matched_path(cfg, "POST", "/V1/pay"));
    /* A route path ending in '/' covers what is below it, not itself
     * without the slash. */
    assert_string_equal(matched_path(cfg, "POST", "/files/"), "/files/");
    assert_string_equal(matched_path(cfg, "POST", "/files/a.txt"), "/files/");
    assert_null(matched_path(cfg, "POST", "/files"));
    assert_null(matched_path(cfg, "POST", "/filesx"));
    config_free(cfg);
}

static void test_match_exact(void **state)
{
    struct config *cfg = load("{\"routes\": [{\"path\": \"/v1/orders\", \"match\": \"exact\"}]}");

    (void)state;
    assert_string_equal(matched_path(cfg, "POST", "/v1/orders"), "/v1/orders");
    assert_null(matched_path(cfg, "POST", "/v1/orders/"));
    assert_null(matched_path(cfg, "POST", "/v1/orders/1"));
    assert_null(matched_path(cfg, "POST", "/v1/order"));
    config_free(cfg);
}

static void test_match_method_filter(void **state)
{
    struct config *cfg =
        load("{\"routes\": [{\"path\": \"/a\", \"methods\": [\"put\", \"DELETE\"]}]}");

    (void)state;
    assert_string_equal(matched_path(cfg, "PUT", "/a"), "/a");
    assert_string_equal(matched_path(cfg, "DELETE", "/a"), "/a");
    assert_null(matched_path(cfg, "POST", "/a"));
    assert_null(matched_path(cfg, "GET", "/a"));
    /* Methods are case-sensitive (RFC 9110 section 9.1); the config
     * upper-cases its own list, the request's method is taken as sent. */
    assert_null(matched_path(cfg, "put", "/a"));
    config_free(cfg);
}

static void test_match_first_route_wins(void **state)
{
    struct config *cfg = load("{\"routes\": ["
                              "{\"path\": \"/v1\", \"scope\": \"outer\", \"methods\": [\"POST\"]},"
                              "{\"path\": \"/v1/pay\", \"scope\": \"inner\"},"
                              "{\"path\": \"/v1\", \"scope\": \"patch\", \"methods\": [\"PATCH\"]}"
                              "]}");
    const struct config_route *r;

    (void)state;
    r = config_match_route(cfg, "POST", "/v1/pay", 7);
    assert_non_null(r);
    assert_string_equal(r->scope, "outer");
    /* The first route lacks PATCH, so the next one that matches wins. */
    r = config_match_route(cfg, "PATCH", "/v1/pay", 7);
    assert_non_null(r);
    assert_string_equal(r->scope, "inner");
    r = config_match_route(cfg, "PATCH", "/v1/x", 5);
    assert_non_null(r);
    assert_string_equal(r->scope, "patch");
    config_free(cfg);
}

static void test_match_uses_path_len(void **state)
{
    struct config *cfg = load("{\"routes\": [{\"path\": \"/v1/pay\", \"match\": \"exact\"}]}");
    const char *request = "/v1/pay?amount=5";

    (void)state;
    /* The caller passes the path without the query; nothing past path_len
     * is read. */
    assert_non_null(config_match_route(cfg, "POST", request, 7));
    assert_null(config_match_route(cfg, "POST", request, strlen(request)));
    assert_null(config_match_route(cfg, "POST", request, 6));
    config_free(cfg);
}

static void test_match_catch_all_and_null(void **state)
{
    struct config *cfg = NULL;
    char err[ERR_LEN];

    (void)state;
    assert_int_equal(config_new_default(&cfg, err, sizeof err), CONFIG_OK);
    assert_string_equal(matched_path(cfg, "POST", "/"), "/");
    assert_string_equal(matched_path(cfg, "PATCH", "/any/thing"), "/");
    assert_null(matched_path(cfg, "GET", "/any/thing"));
    assert_null(matched_path(cfg, "PUT", "/any/thing"));
    assert_null(config_match_route(NULL, "POST", "/", 1));
    assert_null(config_match_route(cfg, NULL, "/", 1));
    assert_null(config_match_route(cfg, "POST", NULL, 0));
    config_free(cfg);
}

/* ---- defaults, overrides, validation -------------------------------- */

static void test_new_default(void **state)
{
    struct config *cfg = NULL;
    const struct config_route *r;
    char err[ERR_LEN] = "";
    int status;

    (void)state;
    assert_int_equal(config_new_default(&cfg, err, sizeof err), CONFIG_OK);
    assert_string_equal(cfg->listen, "127.0.0.1:8080");
    assert_null(cfg->upstream.url);
    assert_int_equal(cfg->upstream.connect_timeout_ms, 5000);
    assert_int_equal(cfg->upstream.timeout_ms, 60000);
    assert_int_equal(cfg->upstream.max_response_bytes, 16 << 20);
    assert_string_equal(cfg->store.path, "./idemproxy-data");
    assert_int_equal(cfg->store.map_size_bytes, 1 << 30);
    assert_int_equal(cfg->store.durability, CONFIG_DURABILITY_SYNC);
    assert_int_equal(cfg->store.sync_interval_ms, 1000);
    assert_int_equal(cfg->store.purge_interval_ms, 60000);
    assert_true(cfg->store.require_local_fs);
    assert_int_equal(cfg->server.workers, 0);
    assert_int_equal(cfg->server.max_connections, 4096);
    assert_int_equal(cfg->server.per_ip_connections, 256);
    assert_int_equal(cfg->server.client_timeout_ms, 30000);
    assert_int_equal(cfg->server.header_memory_bytes, 16 << 10);
    assert_int_equal(cfg->server.drain_timeout_ms, 30000);
    assert_true(cfg->access_log);
    assert_int_equal(cfg->n_routes, 1);
    r = &cfg->routes[0];
    assert_string_equal(r->path, "/");
    assert_int_equal(r->match, CONFIG_MATCH_PREFIX);
    assert_int_equal(r->n_methods, 2);
    assert_string_equal(r->methods[0], "POST");
    assert_string_equal(r->methods[1], "PATCH");
    assert_string_equal(r->scope, "/");
    assert_null(r->scope_header);
    assert_int_equal(r->ttl_ms, 86400000);
    assert_int_equal(r->lease_ms, 30000);
    assert_int_equal(r->heartbeat_ms, 15000);
    assert_int_equal(r->wait_ms, 10000);
    assert_false(r->require_key);
    assert_int_equal(r->fingerprint, CONFIG_FINGERPRINT_AUTO);
    assert_int_equal(r->max_body_bytes, 1 << 20);
    assert_int_equal(r->max_key_length, 255);
    for (status = 0; status < 600; status++)
        assert_int_equal(r->release_on[status], status >= 500);
    assert_int_equal(r->on_unknown, CONFIG_ON_UNKNOWN_RELEASE);
    assert_int_equal(r->n_strip_headers, 1);
    assert_string_equal(r->strip_headers[0], "Set-Cookie");
    /* Everything but the upstream, which has no default. */
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "upstream: is required");
    config_free(cfg);
}

static void test_load_string_equals_new_default(void **state)
{
    struct config *a = NULL;
    struct config *b = load("{}");
    char err[ERR_LEN];
    char *da;
    char *db;

    (void)state;
    assert_int_equal(config_new_default(&a, err, sizeof err), CONFIG_OK);
    da = config_dump(a);
    db = config_dump(b);
    assert_non_null(da);
    assert_non_null(db);
    assert_string_equal(da, db);
    free(da);
    free(db);
    config_free(a);
    config_free(b);
}

static void test_override_applies_values(void **state)
{
    struct config *cfg = NULL;
    char err[ERR_LEN] = "";

    (void)state;
    assert_int_equal(config_new_default(&cfg, err, sizeof err), CONFIG_OK);
    assert_int_equal(config_override(cfg, "[::]:9443", "http://10.0.0.7:8000/api/", "/srv/idem",
                                     err, sizeof err),
                     CONFIG_OK);
    assert_string_equal(cfg->listen, "[::]:9443");
    assert_string_equal(cfg->upstream.url, "http://10.0.0.7:8000/api");
    assert_string_equal(cfg->store.path, "/srv/idem");
    /* NULL leaves a field alone. */
    assert_int_equal(config_override(cfg, NULL, NULL, NULL, err, sizeof err), CONFIG_OK);
    assert_string_equal(cfg->listen, "[::]:9443");
    assert_int_equal(config_override(cfg, ":8081", NULL, NULL, err, sizeof err), CONFIG_OK);
    assert_string_equal(cfg->listen, ":8081");
    assert_string_equal(cfg->upstream.url, "http://10.0.0.7:8000/api");
    config_free(cfg);
}

static void test_override_keeps_upstream_object_settings(void **state)
{
    struct config *cfg = load("{\"upstream\": {\"url\": \"http://a:1\", \"timeout\": \"5m\"}}");
    char err[ERR_LEN] = "";

    (void)state;
    assert_int_equal(config_override(cfg, NULL, "http://b:2", NULL, err, sizeof err), CONFIG_OK);
    assert_string_equal(cfg->upstream.url, "http://b:2");
    assert_int_equal(cfg->upstream.timeout_ms, 300000);
    config_free(cfg);
}

static void assert_override_error(const char *listen, const char *upstream, const char *store_path,
                                  const char *expected)
{
    struct config *cfg = NULL;
    char err[ERR_LEN] = "";

    assert_int_equal(config_new_default(&cfg, err, sizeof err), CONFIG_OK);
    assert_int_equal(config_override(cfg, listen, upstream, store_path, err, sizeof err),
                     CONFIG_EINVAL);
    assert_string_equal(err, expected);
    /* All or nothing: no field changed when a value was invalid. */
    if (strncmp(expected, "--", 2) == 0) {
        assert_string_equal(cfg->listen, "127.0.0.1:8080");
        assert_null(cfg->upstream.url);
        assert_string_equal(cfg->store.path, "./idemproxy-data");
    }
    config_free(cfg);
}

static void test_override_errors(void **state)
{
    (void)state;
    assert_override_error("localhost", "http://x", "/d",
                          "--listen: \"localhost\" has no port (host:port, [v6]:port or :port)");
    assert_override_error("127.0.0.1:", NULL, NULL,
                          "--listen: \"127.0.0.1:\" has no port (host:port, [v6]:port or :port)");
    assert_override_error("[::1]", NULL, NULL,
                          "--listen: \"[::1]\" has no port (host:port, [v6]:port or :port)");
    assert_override_error("::1:8080", NULL, NULL,
                          "--listen: \"::1:8080\": an IPv6 address goes in brackets, "
                          "\"[::1]:8080\"");
    assert_override_error("127.0.0.1:80x", NULL, NULL,
                          "--listen: \"127.0.0.1:80x\" has an invalid port (a number 1..65535)");
    assert_override_error(":0", NULL, NULL, "--listen: \":0\" has a port outside 1..65535");
    assert_override_error("", NULL, NULL,
                          "--listen: must not be empty (host:port, [v6]:port or :port)");
    assert_override_error(NULL, "ftp://x", NULL, "--upstream: \"ftp://x\" is not an http:// URL");
    assert_override_error(NULL, "http://", NULL, "--upstream: \"http://\" has no host");
    assert_override_error(NULL, "http://x:99999", NULL,
                          "--upstream: \"http://x:99999\" has a port outside 1..65535");
    assert_override_error(NULL, "http://x y", NULL,
                          "--upstream: \"http://x y\" is not an http:// URL");
    assert_override_error(NULL, "http://x", "", "--store: must not be empty");
    assert_override_error(NULL, "http://x", "/data/\xff", "--store: must be valid UTF-8");
    assert_override_error(NULL, NULL, "/data", "upstream: is required");
    assert_override_error(":8080", NULL, NULL, "upstream: is required");
}

static void test_override_quotes_control_characters(void **state)
{
    (void)state;
    /* A value from the command line is quoted and escaped: the error stays
     * one line whatever was typed. */
    assert_override_error("a\nb:1", NULL, NULL,
                          "--listen: \"a\\u000ab:1\" is not host:port, [v6]:port or :port");
}

static void test_validate_catches_edits(void **state)
{
    struct config *cfg = load("{\"upstream\": \"http://u\", \"routes\": [{\"path\": \"/a\"}, "
                              "{\"path\": \"/b\"}]}");
    char err[ERR_LEN] = "";

    (void)state;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_OK);
    cfg->routes[1].heartbeat_ms = cfg->routes[1].lease_ms;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "routes[1].heartbeat: must be less than lease");
    cfg->routes[1].heartbeat_ms = 1000;
    /* Floors a heartbeat can meet through the synced store writer. */
    cfg->routes[1].lease_ms = 999;
    cfg->routes[1].heartbeat_ms = 500;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "routes[1].lease: must be at least 1s");
    cfg->routes[1].lease_ms = 1000;
    cfg->routes[1].heartbeat_ms = 99;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "routes[1].heartbeat: must be at least 100ms");
    cfg->routes[1].heartbeat_ms = 100;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_OK);
    cfg->routes[0].scope[0] = '\0';
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "routes[0].scope: must not be empty");
    cfg->routes[0].scope[0] = 'x';
    cfg->store.map_size_bytes = 4096;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "store.map_size: must be at least 1MiB");
    cfg->store.map_size_bytes = 1 << 20;
    cfg->upstream.max_response_bytes = 4095;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "upstream.max_response: must be at least 4KiB");
    cfg->upstream.max_response_bytes = 4096;
    cfg->server.workers = 65;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "server.workers: must be between 0 and 64");
    cfg->server.workers = 64;
    assert_int_equal(config_validate(cfg, err, sizeof err), CONFIG_OK);
    assert_int_equal(config_validate(NULL, err, sizeof err), CONFIG_EINVAL);
    config_free(cfg);
}

/* ---- errors --------------------------------------------------------- */

static void test_syntax_error_has_line_and_column(void **state)
{
    (void)state;
    assert_load_error("{\n  \"listen\": \":8080\",\n}",
                      "line 3, column 1: string or '}' expected near '}'");
    assert_load_error("{\"a\": 1, \"a\": 2}",
                      "line 1, column 12: duplicate object key near '\"a\"'");
    assert_load_error("", "line 1, column 0: '[' or '{' expected near end of file");
}

static void test_error_messages(void **state)
{
    (void)state;
    assert_load_error("{\"routes\": [{\"path\": \"/a\", \"ttl\": \"forever\"}]}",
                      "routes[0].ttl: \"forever\" is not a duration");
    assert_load_error("{\"store\": {\"paht\": \"x\"}}", "store: unknown key \"paht\"");
    assert_load_error("{\"upstream\": {\"url\": \"ftp://x\"}}",
                      "upstream.url: \"ftp://x\" is not an http:// URL");
    /* Keys are quoted and escaped like values. */
    assert_load_error("{\"rou\\ntes\": 1}", "top level: unknown key \"rou\\u000ates\"");
    /* Long values are cut short. */
    assert_load_error(
        "{\"listen\": \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
        "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}",
        "listen: \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"... "
        "has no port (host:port, [v6]:port or :port)");
}

static void test_small_and_missing_error_buffers(void **state)
{
    const char *json = "{\"store\": {\"paht\": \"x\"}}";
    struct config *cfg = NULL;
    char err[8];

    (void)state;
    memset(err, 'z', sizeof err);
    assert_int_equal(config_load_string(json, strlen(json), &cfg, err, sizeof err), CONFIG_EINVAL);
    assert_string_equal(err, "store: ");
    assert_int_equal(config_load_string(json, strlen(json), &cfg, NULL, 0), CONFIG_EINVAL);
    assert_null(cfg);
    assert_int_equal(config_load_string(NULL, 0, &cfg, NULL, 0), CONFIG_EINVAL);
}

static void test_load_string_uses_len(void **state)
{
    const char *json = "{\"listen\": \":1\"} trailing garbage";
    struct config *cfg = NULL;
    char err[ERR_LEN] = "";

    (void)state;
    assert_int_equal(config_load_string(json, 16, &cfg, err, sizeof err), CONFIG_OK);
    assert_string_equal(cfg->listen, ":1");
    config_free(cfg);
    assert_int_equal(config_load_string(json, strlen(json), &cfg, err, sizeof err), CONFIG_EINVAL);
}

static void test_load_file_missing(void **state)
{
    struct config *cfg = NULL;
    char err[ERR_LEN] = "";

    (void)state;
    assert_int_equal(config_load_file("/nonexistent/idemproxy.json", &cfg, err, sizeof err),
                     CONFIG_EIO);
    assert_null(cfg);
    assert_string_equal(err, "/nonexistent/idemproxy.json: No such file or directory");
    assert_int_equal(config_load_file("/", &cfg, err, sizeof err), CONFIG_EIO);
    assert_string_equal(err, "/: Is a directory");
}

static void test_free_null(void **state)
{
    (void)state;
    config_free(NULL);
    assert_null(config_dump(NULL));
}

/* ---- dump ----------------------------------------------------------- */

static void assert_routes_equal(const struct config_route *a, const struct config_route *b)
{
    size_t i;

    assert_string_equal(a->path, b->path);
    assert_int_equal(a->match, b->match);
    assert_int_equal(a->n_methods, b->n_methods);
    for (i = 0; i < a->n_methods; i++)
        assert_string_equal(a->methods[i], b->methods[i]);
    assert_string_equal(a->scope, b->scope);
    if (a->scope_header == NULL)
        assert_null(b->scope_header);
    else
        assert_string_equal(a->scope_header, b->scope_header);
    assert_int_equal(a->ttl_ms, b->ttl_ms);
    assert_int_equal(a->lease_ms, b->lease_ms);
    assert_int_equal(a->heartbeat_ms, b->heartbeat_ms);
    assert_int_equal(a->wait_ms, b->wait_ms);
    assert_int_equal(a->require_key, b->require_key);
    assert_int_equal(a->fingerprint, b->fingerprint);
    assert_int_equal(a->max_body_bytes, b->max_body_bytes);
    assert_int_equal(a->max_key_length, b->max_key_length);
    assert_memory_equal(a->release_on, b->release_on, sizeof a->release_on);
    assert_int_equal(a->on_unknown, b->on_unknown);
    assert_int_equal(a->n_strip_headers, b->n_strip_headers);
    for (i = 0; i < a->n_strip_headers; i++)
        assert_string_equal(a->strip_headers[i], b->strip_headers[i]);
}

static void assert_configs_equal(const struct config *a, const struct config *b)
{
    size_t i;

    assert_string_equal(a->listen, b->listen);
    assert_string_equal(a->upstream.url, b->upstream.url);
    assert_int_equal(a->upstream.connect_timeout_ms, b->upstream.connect_timeout_ms);
    assert_int_equal(a->upstream.timeout_ms, b->upstream.timeout_ms);
    assert_int_equal(a->upstream.max_response_bytes, b->upstream.max_response_bytes);
    assert_string_equal(a->store.path, b->store.path);
    assert_int_equal(a->store.map_size_bytes, b->store.map_size_bytes);
    assert_int_equal(a->store.durability, b->store.durability);
    assert_int_equal(a->store.sync_interval_ms, b->store.sync_interval_ms);
    assert_int_equal(a->store.purge_interval_ms, b->store.purge_interval_ms);
    assert_int_equal(a->store.require_local_fs, b->store.require_local_fs);
    assert_int_equal(a->server.workers, b->server.workers);
    assert_int_equal(a->server.max_connections, b->server.max_connections);
    assert_int_equal(a->server.per_ip_connections, b->server.per_ip_connections);
    assert_int_equal(a->server.client_timeout_ms, b->server.client_timeout_ms);
    assert_int_equal(a->server.header_memory_bytes, b->server.header_memory_bytes);
    assert_int_equal(a->server.drain_timeout_ms, b->server.drain_timeout_ms);
    assert_int_equal(a->access_log, b->access_log);
    assert_int_equal(a->n_routes, b->n_routes);
    for (i = 0; i < a->n_routes; i++)
        assert_routes_equal(&a->routes[i], &b->routes[i]);
}

static void assert_round_trip(const char *json)
{
    struct config *a = load(json);
    struct config *b;
    char *dump_a = config_dump(a);
    char *dump_b;

    assert_non_null(dump_a);
    b = load(dump_a);
    assert_configs_equal(a, b);
    dump_b = config_dump(b);
    assert_non_null(dump_b);
    assert_string_equal(dump_a, dump_b);
    free(dump_a);
    free(dump_b);
    config_free(a);
    config_free(b);
}

static void test_dump_round_trip(void **state)
{
    (void)state;
    assert_round_trip("{\"upstream\": \"http://127.0.0.1:9000\"}");
    assert_round_trip(
        "{\"listen\": \"[::1]:8443\","
        " \"upstream\": {\"url\": \"http://api:80/base/\", \"connect_timeout\": 0.25,"
        "   \"timeout\": \"1.5m\", \"max_response\": 5000},"
        " \"store\": {\"path\": \"/var/lib/idem\", \"map_size\": \"1.5GiB\","
        "   \"durability\": \"interval\", \"sync_interval\": \"10ms\", \"purge_interval\": 7,"
        "   \"require_local_fs\": false},"
        " \"server\": {\"workers\": 3, \"max_connections\": 7, \"per_ip_connections\": 0,"
        "   \"client_timeout\": \"1001ms\", \"header_memory\": 5000, \"drain_timeout\": 0},"
        " \"access_log\": false,"
        " \"routes\": ["
        "  {\"path\": \"/v1/pay\", \"match\": \"exact\", \"methods\": [\"post\", \"put\"],"
        "   \"scope\": \"pay\", \"scope_header\": \"X-Tenant\", \"ttl\": \"36500d\","
        "   \"lease\": \"61s\", \"heartbeat\": \"60999ms\", \"wait\": 0, \"require_key\": true,"
        "   \"fingerprint\": \"raw\", \"max_body\": 0, \"max_key_length\": 4096,"
        "   \"release_on\": [\"4xx\", 503, \"1xx\", 599], \"on_unknown\": \"complete\","
        "   \"strip_headers\": []},"
        "  {\"path\": \"/x\", \"release_on\": [100, 199, \"2xx\", 300, 399, 500]},"
        "  {\"path\": \"/\", \"release_on\": []}"
        " ]}");
}

static void test_dump_layout(void **state)
{
    struct config *cfg = load("{\"upstream\": \"http://u:1\", \"routes\": [{\"path\": \"/a\","
                              " \"release_on\": [503, \"4xx\", 409]}]}");
    char *dump = config_dump(cfg);

    (void)state;
    assert_non_null(dump);
    /* Lists of scalars on one line; a class listed whole; statuses as
     * numbers in order; durations and sizes with their largest exact unit. */
    assert_non_null(strstr(dump, "\n      \"methods\": [\"POST\", \"PATCH\"],\n"));
    assert_non_null(strstr(dump, "\"release_on\": [\"4xx\", 503],"));
    assert_non_null(strstr(dump, "\"ttl\": \"24h\","));
    assert_non_null(strstr(dump, "\"heartbeat\": \"15s\","));
    assert_non_null(strstr(dump, "\"map_size\": \"1GiB\","));
    assert_non_null(strstr(dump, "\"scope_header\": null,"));
    assert_int_equal(strncmp(dump, "{\n  \"listen\": \"127.0.0.1:8080\",\n  \"upstream\": {\n", 47),
                     0);
    assert_int_not_equal(dump[strlen(dump) - 1], '\n');
    free(dump);
    config_free(cfg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_duration_units),
        cmocka_unit_test(test_duration_bare_number_is_seconds),
        cmocka_unit_test(test_duration_fractions_are_exact_and_round_down),
        cmocka_unit_test(test_duration_bounds),
        cmocka_unit_test(test_duration_rejects_malformed),
        cmocka_unit_test(test_size_units),
        cmocka_unit_test(test_size_fractions),
        cmocka_unit_test(test_size_bounds),
        cmocka_unit_test(test_size_rejects_malformed),
        cmocka_unit_test(test_match_prefix_on_segment_boundary),
        cmocka_unit_test(test_match_exact),
        cmocka_unit_test(test_match_method_filter),
        cmocka_unit_test(test_match_first_route_wins),
        cmocka_unit_test(test_match_uses_path_len),
        cmocka_unit_test(test_match_catch_all_and_null),
        cmocka_unit_test(test_new_default),
        cmocka_unit_test(test_load_string_equals_new_default),
        cmocka_unit_test(test_override_applies_values),
        cmocka_unit_test(test_override_keeps_upstream_object_settings),
        cmocka_unit_test(test_override_errors),
        cmocka_unit_test(test_override_quotes_control_characters),
        cmocka_unit_test(test_validate_catches_edits),
        cmocka_unit_test(test_syntax_error_has_line_and_column),
        cmocka_unit_test(test_error_messages),
        cmocka_unit_test(test_small_and_missing_error_buffers),
        cmocka_unit_test(test_load_string_uses_len),
        cmocka_unit_test(test_load_file_missing),
        cmocka_unit_test(test_free_null),
        cmocka_unit_test(test_dump_round_trip),
        cmocka_unit_test(test_dump_layout),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
