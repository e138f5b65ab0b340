/*
 * config.c - loading and validating idemproxy's JSON configuration
 * (CONTRACT.md section 4) and the command-line overrides (section 5).
 *
 * Loading happens in two passes. The first walks the JSON in file order and
 * turns each value into its field of struct config, failing on the first
 * wrong type, unknown key or malformed value; it then fills what the file
 * left out (the catch-all route, a route's methods, scope and heartbeat).
 * The second, check_config(), checks ranges and relations between fields
 * on the struct alone, so it also serves config_validate() after
 * config_override() and for configs built or edited in code.
 *
 * Every failure writes one line "<field>: <what is wrong>" to err; the
 * field is the JSON path ("routes[0].ttl") or the option ("--listen").
 */
#include "config.h"
#include "config_internal.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define DEFAULT_LISTEN "127.0.0.1:8080"
#define DEFAULT_STORE_PATH "./idemproxy-data"

#define MAX_WORKERS 64
#define MAX_CONNECTIONS 1000000
#define MIN_MAP_SIZE CONFIG_MIB
#define MIN_HEADER_MEMORY (4 * CONFIG_KIB)
/* libmicrohttpd allocates header_memory x 1.5 (the answer's header block
 * included) for every connection: "65536GiB" passed check-config, and the
 * first connection's allocation then failed (under ASan: an abort). 1 MiB
 * is 128 times nginx's 8 KiB header buffer, and 6 GiB resident at the
 * default max_connections already. */
#define MAX_HEADER_MEMORY CONFIG_MIB
#define MIN_MAX_BUFFERED CONFIG_MIB
/* Below a few KiB every ordinary answer (a JSON object, a problem+json
 * error) is "too large": each keyed request would run its action, get 502
 * and be released, and each retry would run it again. 4 KiB is one page,
 * the proxy's first allocation for a response body anyway, so a smaller
 * cap would save no memory. */
#define MIN_MAX_RESPONSE (4 * CONFIG_KIB)
/* A request body and an upstream answer are held whole in memory (the
 * answer also in one store record, and copied out of it for each replay):
 * "64GiB" passed check-config and promised what no process here can hold.
 * 1 GiB is far past any API call; larger uploads want a route without
 * idempotency in a proxy that streams them. */
#define MAX_BODY_LIMIT CONFIG_GIB
/* A lease must outlast a heartbeat interval plus the time the extension
 * takes to land: up to one worker tick (10 ms), the queue to the single
 * store writer, and a synced commit (an fsync: milliseconds on an idle SSD,
 * far more on a busy disk or network storage). With a lease of a few
 * milliseconds no heartbeat can keep up, a duplicate takes over a record
 * that is still running, and the action runs twice. Each heartbeat is one
 * durable write per running request, so a floor on it also keeps
 * heartbeats from crowding out the writes they wait behind. */
#define MIN_LEASE_MS 1000
#define MIN_TTL_MS 1000
#define MAX_MAP_SIZE ((uint64_t)1 << 46) /* 64 TiB */
#define MIN_HEARTBEAT_MS 100
#define MAX_KEY_LENGTH_LIMIT 4096
/* A configuration file is a few KiB; the cap keeps a wrong path such as
 * /dev/zero from eating memory. */
#define MAX_FILE_BYTES (1024 * 1024)

/* Room for "routes[<20 digits>].strip_headers[<20 digits>]". */
#define FIELD_LEN 96
/* Room for config_quote()'s output. */
#define QUOTE_LEN 512

struct errbuf {
    char *text;
    size_t len;
};

/* What the file set explicitly, for the defaults derived after parsing. */
struct route_seen {
    bool path;
    bool methods;
    bool heartbeat;
    bool strip_headers;
};

static bool route_has_method(const struct config_route *r, const char *method);
static bool route_matches_path(const struct config_route *r, const char *path, size_t path_len);
static int fail(struct errbuf *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int invalid(struct errbuf *e, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Control bytes (from a file name or jansson's "near '...'" text) would
 * break the one-line promise, so they become spaces. */
static void one_line(struct errbuf *e)
{
    size_t i;

    for (i = 0; e->text[i] != '\0'; i++) {
        if ((unsigned char)e->text[i] < 0x20 || e->text[i] == 0x7f)
            e->text[i] = ' ';
    }
}

static int fail(struct errbuf *e, int code, const char *fmt, ...)
{
    va_list ap;

    if (e->text != NULL && e->len > 0) {
        va_start(ap, fmt);
        vsnprintf(e->text, e->len, fmt, ap);
        va_end(ap);
        one_line(e);
    }
    return code;
}

/* "<field>: <message>", CONFIG_EINVAL. */
static int invalid(struct errbuf *e, const char *field, const char *fmt, ...)
{
    va_list ap;
    int n;

    if (e->text != NULL && e->len > 0) {
        n = snprintf(e->text, e->len, "%s: ", field);
        if (n >= 0 && (size_t)n < e->len) {
            va_start(ap, fmt);
            vsnprintf(e->text + n, e->len - (size_t)n, fmt, ap);
            va_end(ap);
        }
        one_line(e);
    }
    return CONFIG_EINVAL;
}

static int no_memory(struct errbuf *e)
{
    return fail(e, CONFIG_ENOMEM, "out of memory");
}

/* A JSON value as it appears in an error: strings quoted and cut short,
 * containers elided. */
static void render(const json_t *v, char *buf, size_t len)
{
    size_t n;

    if (json_is_string(v)) {
        config_quote(json_string_value(v), buf, len);
    } else if (json_is_object(v)) {
        snprintf(buf, len, "{...}");
    } else if (json_is_array(v)) {
        snprintf(buf, len, "[...]");
    } else {
        n = json_dumpb(v, buf, len - 1, JSON_ENCODE_ANY | JSON_COMPACT | JSON_REAL_PRECISION(15));
        if (n == 0 || n >= len)
            snprintf(buf, len, "value");
        else
            buf[n] = '\0';
    }
}

/* Field paths are built only from known key names and indices, so they
 * always fit; a cut one would still name the field well enough. */
static void join_key(char *buf, const char *parent, const char *key)
{
    int n = snprintf(buf, FIELD_LEN, "%s.%s", parent, key);

    if (n < 0)
        buf[0] = '\0';
}

static void join_index(char *buf, const char *parent, size_t index)
{
    int n = snprintf(buf, FIELD_LEN, "%s[%zu]", parent, index);

    if (n < 0)
        buf[0] = '\0';
}

static int unknown_key(struct errbuf *e, const char *where, const char *key)
{
    char q[QUOTE_LEN];

    config_quote(key, q, sizeof q);
    return invalid(e, where, "unknown key %s", q);
}

static char ascii_upper(char c)
{
    return c >= 'a' && c <= 'z' ? (char)(c - 'a' + 'A') : c;
}

/* Header names and methods are ASCII tokens; no locale is involved. */
static bool ascii_equal_nocase(const char *a, const char *b)
{
    while (*a != '\0' && ascii_upper(*a) == ascii_upper(*b)) {
        a++;
        b++;
    }
    return *a == '\0' && *b == '\0';
}

static void free_strings(char **v, size_t n)
{
    size_t i;

    if (v != NULL) {
        for (i = 0; i < n; i++)
            free(v[i]);
        free(v);
    }
}

/* ---- values shared by the file and the command line ---------------- */

/* Two colons outside brackets: an IPv6 address written as in a URL
 * without its brackets ("::1:8080"), which cannot be told from its port. */
static bool unbracketed_ipv6(const char *s)
{
    const char *colon = strchr(s, ':');

    return s[0] != '[' && colon != NULL && strchr(colon + 1, ':') != NULL;
}

static int listen_error(const char *s, const char *field, struct errbuf *e)
{
    char q[QUOTE_LEN];
    /* Where the port would be: after "[v6]", else after the first ':'. */
    const char *host_end = s[0] == '[' ? strchr(s, ']') : s;
    const char *colon = host_end != NULL ? strchr(host_end, ':') : NULL;
    enum config_addr scan = config_scan_listen(s);
    int rc = CONFIG_OK;

    config_quote(s, q, sizeof q);
    if (scan == CONFIG_ADDR_OK)
        rc = CONFIG_OK;
    else if (scan == CONFIG_ADDR_PORT_RANGE)
        rc = invalid(e, field, "%s has a port outside 1..65535", q);
    else if (scan == CONFIG_ADDR_BAD_IPV4)
        rc = invalid(e, field, "%s: an IPv4 address must be four decimal numbers 0-255 "
                               "without leading zeros", q);
    else if (s[0] == '\0')
        rc = invalid(e, field, "must not be empty (host:port, [v6]:port or :port)");
    else if (unbracketed_ipv6(s))
        rc = invalid(e, field, "%s: an IPv6 address goes in brackets, \"[::1]:8080\"", q);
    else if (host_end != NULL && (colon == NULL || colon[1] == '\0'))
        rc = invalid(e, field, "%s has no port (host:port, [v6]:port or :port)", q);
    else if (scan == CONFIG_ADDR_BAD_PORT)
        rc = invalid(e, field, "%s has an invalid port (a number 1..65535)", q);
    else
        rc = invalid(e, field, "%s is not host:port, [v6]:port or :port", q);
    return rc;
}

static int make_listen(const char *s, const char *field, char **out, struct errbuf *e)
{
    int rc;

    rc = listen_error(s, field, e);
    if (rc == CONFIG_OK) {
        *out = strdup(s);
        if (*out == NULL)
            rc = no_memory(e);
    }
    return rc;
}

static int url_error(const char *s, const char *field, struct errbuf *e)
{
    char q[QUOTE_LEN];
    int rc = CONFIG_OK;

    config_quote(s, q, sizeof q);
    switch (config_scan_url(s)) {
    case CONFIG_ADDR_OK:
        break;
    case CONFIG_ADDR_NOT_HTTP:
        if (strncasecmp(s, "https://", 8) == 0)
            rc = invalid(e, field,
                         "%s is not an http:// URL (TLS to the upstream is not supported)", q);
        else
            rc = invalid(e, field, "%s is not an http:// URL", q);
        break;
    case CONFIG_ADDR_QUERY:
        rc = invalid(e, field, "%s must not have a query or fragment", q);
        break;
    case CONFIG_ADDR_NO_HOST:
        rc = invalid(e, field, "%s has no host", q);
        break;
    case CONFIG_ADDR_BAD_HOST:
        rc = invalid(e, field, "%s has an invalid host", q);
        break;
    case CONFIG_ADDR_BAD_PORT:
        rc = invalid(e, field, "%s has an invalid port", q);
        break;
    case CONFIG_ADDR_PORT_RANGE:
        rc = invalid(e, field, "%s has a port outside 1..65535", q);
        break;
    case CONFIG_ADDR_BAD_IPV4:
        rc = invalid(e, field, "%s: an IPv4 address must be four decimal numbers 0-255 "
                               "without leading zeros", q);
        break;
    }
    return rc;
}

/* The URL without trailing slashes: the proxy appends the request path,
 * which starts with one. */
static int make_url(const char *s, const char *field, char **out, struct errbuf *e)
{
    int rc;
    size_t len;

    rc = url_error(s, field, e);
    if (rc != CONFIG_OK)
        goto out;
    *out = strdup(s);
    if (*out == NULL) {
        rc = no_memory(e);
        goto out;
    }
    len = strlen(*out);
    while (len > 0 && (*out)[len - 1] == '/')
        (*out)[--len] = '\0';
out:
    return rc;
}

static int make_store_path(const char *s, const char *field, char **out, struct errbuf *e)
{
    int rc = CONFIG_EINVAL;

    if (s[0] == '\0') {
        rc = invalid(e, field, "must not be empty");
    } else if (!config_is_utf8(s)) {
        /* config_dump() prints it as a JSON string. */
        rc = invalid(e, field, "must be valid UTF-8");
    } else {
        *out = strdup(s);
        rc = *out != NULL ? CONFIG_OK : no_memory(e);
    }
    return rc;
}

/* ---- typed JSON values ---------------------------------------------- */

static int get_duration(const json_t *v, const char *field, int64_t *out, struct errbuf *e)
{
    enum config_scan scan = CONFIG_SCAN_SYNTAX;
    int64_t ms = 0;
    char q[QUOTE_LEN];
    int rc = CONFIG_OK;

    if (json_is_string(v)) {
        scan = config_scan_duration(json_string_value(v), &ms);
    } else if (json_is_integer(v)) {
        json_int_t n = json_integer_value(v);
        if (n < 0) {
            scan = CONFIG_SCAN_NEGATIVE;
        } else if (n > CONFIG_MAX_DURATION_MS / 1000) {
            scan = CONFIG_SCAN_RANGE;
        } else {
            ms = (int64_t)n * 1000;
            scan = CONFIG_SCAN_OK;
        }
    } else if (json_is_real(v)) {
        double d = json_real_value(v);
        char digits[64];
        if (d < 0) {
            scan = CONFIG_SCAN_NEGATIVE;
        } else if (!(d <= (double)(CONFIG_MAX_DURATION_MS / 1000))) {
            scan = CONFIG_SCAN_RANGE;
        } else {
            /* Through the decimal text, so 1.15 is 1150 ms and not the
             * 1149.999... that 1.15 * 1000 gives in binary. */
            snprintf(digits, sizeof digits, "%.6f", d);
            scan = config_scan_duration(digits, &ms);
        }
    }
    render(v, q, sizeof q);
    switch (scan) {
    case CONFIG_SCAN_OK:
        *out = ms;
        break;
    case CONFIG_SCAN_SYNTAX:
        rc = invalid(e, field, "%s is not a duration", q);
        break;
    case CONFIG_SCAN_NEGATIVE:
        rc = invalid(e, field, "must not be negative");
        break;
    case CONFIG_SCAN_RANGE:
        rc = invalid(e, field, "%s is too large (at most 36500d)", q);
        break;
    }
    return rc;
}

static int get_size(const json_t *v, const char *field, uint64_t *out, struct errbuf *e)
{
    enum config_scan scan = CONFIG_SCAN_SYNTAX;
    uint64_t bytes = 0;
    char q[QUOTE_LEN];
    int rc = CONFIG_OK;

    if (json_is_string(v)) {
        scan = config_scan_size(json_string_value(v), &bytes);
    } else if (json_is_integer(v)) {
        json_int_t n = json_integer_value(v);
        if (n < 0) {
            scan = CONFIG_SCAN_NEGATIVE;
        } else {
            bytes = (uint64_t)n;
            scan = CONFIG_SCAN_OK;
        }
    }
    render(v, q, sizeof q);
    switch (scan) {
    case CONFIG_SCAN_OK:
        *out = bytes;
        break;
    case CONFIG_SCAN_SYNTAX:
        rc = invalid(e, field, "%s is not a size", q);
        break;
    case CONFIG_SCAN_NEGATIVE:
        rc = invalid(e, field, "must not be negative");
        break;
    case CONFIG_SCAN_RANGE:
        rc = invalid(e, field, "%s is too large", q);
        break;
    }
    return rc;
}

static int get_bool(const json_t *v, const char *field, bool *out, struct errbuf *e)
{
    int rc = CONFIG_OK;

    if (json_is_boolean(v))
        *out = json_is_true(v);
    else
        rc = invalid(e, field, "must be true or false");
    return rc;
}

static int get_integer(const json_t *v, const char *field, json_int_t min, json_int_t max,
                       json_int_t *out, struct errbuf *e)
{
    int rc = CONFIG_OK;

    if (!json_is_integer(v))
        rc = invalid(e, field, "must be an integer");
    else if (json_integer_value(v) < min || json_integer_value(v) > max)
        rc = invalid(e, field, "must be between %lld and %lld", (long long)min, (long long)max);
    else
        *out = json_integer_value(v);
    return rc;
}

/* One of two names; *out is 0 for a, 1 for b (the enums of config.h are
 * numbered that way). */
static int get_choice(const json_t *v, const char *field, const char *a, const char *b, int *out,
                      struct errbuf *e)
{
    char q[QUOTE_LEN];
    int rc = CONFIG_OK;

    if (!json_is_string(v)) {
        rc = invalid(e, field, "must be a string");
    } else if (strcmp(json_string_value(v), a) == 0) {
        *out = 0;
    } else if (strcmp(json_string_value(v), b) == 0) {
        *out = 1;
    } else {
        render(v, q, sizeof q);
        rc = invalid(e, field, "%s is not \"%s\" or \"%s\"", q, a, b);
    }
    return rc;
}

static int get_string(const json_t *v, const char *field, const char **out, struct errbuf *e)
{
    int rc = CONFIG_OK;

    if (json_is_string(v))
        *out = json_string_value(v);
    else
        rc = invalid(e, field, "must be a string");
    return rc;
}

/* Replaces *dst with a copy of s. */
static int replace_string(char **dst, const char *s, struct errbuf *e)
{
    char *copy = strdup(s);
    int rc = CONFIG_OK;

    if (copy == NULL) {
        rc = no_memory(e);
    } else {
        free(*dst);
        *dst = copy;
    }
    return rc;
}

/* An array of tokens: methods (upper-cased, non-empty) or header names.
 * A name listed twice is a mistake worth reporting (case-insensitively:
 * "post" and "POST" are one method here, and header names ignore case). */
static int get_tokens(const json_t *v, const char *field, bool methods, char ***out, size_t *n_out,
                      struct errbuf *e)
{
    char elem[FIELD_LEN];
    char q[QUOTE_LEN];
    char **list = NULL;
    size_t n = 0;
    size_t count;
    size_t i;
    size_t j;
    int rc = CONFIG_OK;

    if (!json_is_array(v)) {
        rc = invalid(e, field, "must be an array");
        goto out;
    }
    count = json_array_size(v);
    if (count == 0 && methods) {
        rc = invalid(e, field, "must not be empty");
        goto out;
    }
    if (count > 0) {
        list = calloc(count, sizeof *list);
        if (list == NULL) {
            rc = no_memory(e);
            goto out;
        }
    }
    for (i = 0; i < count; i++) {
        const json_t *item = json_array_get(v, i);
        join_index(elem, field, i);
        if (!json_is_string(item)) {
            rc = invalid(e, elem, "must be a string");
            goto out;
        }
        render(item, q, sizeof q);
        if (!config_is_token(json_string_value(item))) {
            rc = invalid(e, elem, "%s is not %s", q, methods ? "an HTTP method" : "a header name");
            goto out;
        }
        for (j = 0; j < n; j++) {
            if (ascii_equal_nocase(list[j], json_string_value(item))) {
                rc = invalid(e, elem, "%s is listed twice", q);
                goto out;
            }
        }
        list[n] = strdup(json_string_value(item));
        if (list[n] == NULL) {
            rc = no_memory(e);
            goto out;
        }
        if (methods) {
            for (j = 0; list[n][j] != '\0'; j++)
                list[n][j] = ascii_upper(list[n][j]);
        }
        n++;
    }
    free_strings(*out, *n_out);
    *out = list;
    *n_out = n;
    list = NULL;
out:
    free_strings(list, n);
    return rc;
}

/* One release_on entry: a class "5xx" or a status 100..599, as a number or
 * a numeric string. */
static int add_release_status(const json_t *item, const char *field, bool *set, struct errbuf *e)
{
    char q[QUOTE_LEN];
    json_int_t status = -1;
    const char *s;
    int rc = CONFIG_OK;
    int i;

    render(item, q, sizeof q);
    if (json_is_integer(item)) {
        status = json_integer_value(item);
    } else if (json_is_string(item)) {
        s = json_string_value(item);
        if (strlen(s) == 3 && s[0] >= '1' && s[0] <= '5' && (s[1] == 'x' || s[1] == 'X') &&
            (s[2] == 'x' || s[2] == 'X')) {
            for (i = 0; i < 100; i++)
                set[(s[0] - '0') * 100 + i] = true;
            goto out;
        }
        if (strlen(s) == 0 || strlen(s) > 3 || strspn(s, "0123456789") != strlen(s)) {
            rc = invalid(e, field, "%s is not a status class or code", q);
            goto out;
        }
        status = strtol(s, NULL, 10);
    } else {
        rc = invalid(e, field, "must be a status class (\"5xx\") or code");
        goto out;
    }
    if (status < 100 || status > 599) {
        rc = invalid(e, field, "%s is not a status code (100..599)", q);
        goto out;
    }
    set[status] = true;
out:
    return rc;
}

static int get_release_on(const json_t *v, const char *field, bool *release_on, struct errbuf *e)
{
    bool set[600] = {false};
    char elem[FIELD_LEN];
    size_t i;
    int rc = CONFIG_OK;

    if (!json_is_array(v)) {
        rc = invalid(e, field, "must be an array");
        goto out;
    }
    for (i = 0; i < json_array_size(v); i++) {
        join_index(elem, field, i);
        rc = add_release_status(json_array_get(v, i), elem, set, e);
        if (rc != CONFIG_OK)
            goto out;
    }
    memcpy(release_on, set, sizeof set);
out:
    return rc;
}

/* ---- sections ------------------------------------------------------- */

static int parse_upstream(json_t *v, struct config_upstream *up, struct errbuf *e)
{
    char field[FIELD_LEN];
    const char *key;
    json_t *val;
    char *url = NULL;
    int rc = CONFIG_OK;

    if (json_is_string(v)) {
        rc = make_url(json_string_value(v), "upstream", &url, e);
    } else if (json_is_object(v)) {
        json_object_foreach(v, key, val)
        {
            const char *s = NULL;
            join_key(field, "upstream", key);
            if (strcmp(key, "url") == 0) {
                rc = get_string(val, field, &s, e);
                if (rc == CONFIG_OK) {
                    free(url);
                    url = NULL;
                    rc = make_url(s, field, &url, e);
                }
            } else if (strcmp(key, "connect_timeout") == 0) {
                rc = get_duration(val, field, &up->connect_timeout_ms, e);
            } else if (strcmp(key, "timeout") == 0) {
                rc = get_duration(val, field, &up->timeout_ms, e);
            } else if (strcmp(key, "resolve_interval") == 0) {
                rc = get_duration(val, field, &up->resolve_interval_ms, e);
            } else if (strcmp(key, "idle_timeout") == 0) {
                rc = get_duration(val, field, &up->idle_timeout_ms, e);
            } else if (strcmp(key, "max_response") == 0) {
                rc = get_size(val, field, &up->max_response_bytes, e);
            } else if (strcmp(key, "client") == 0) {
                rc = get_string(val, field, &s, e);
                if (rc == CONFIG_OK && strcmp(s, "native") == 0) {
                    up->client = CONFIG_UPSTREAM_NATIVE;
                } else if (rc == CONFIG_OK && strcmp(s, "libcurl") == 0) {
                    up->client = CONFIG_UPSTREAM_LIBCURL;
                } else if (rc == CONFIG_OK) {
                    char q[QUOTE_LEN];
                    config_quote(s, q, sizeof q);
                    rc = invalid(e, field, "%s is not \"native\" or \"libcurl\"", q);
                }
            } else {
                rc = unknown_key(e, "upstream", key);
            }
            if (rc != CONFIG_OK)
                break;
        }
    } else {
        rc = invalid(e, "upstream", "must be a URL string or an object");
    }
    if (rc == CONFIG_OK && url != NULL) {
        free(up->url);
        up->url = url;
        url = NULL;
    }
    free(url);
    return rc;
}

static int parse_store(json_t *v, struct config_store *st, struct errbuf *e)
{
    char field[FIELD_LEN];
    const char *key;
    json_t *val;
    int choice;
    int rc = CONFIG_OK;

    if (!json_is_object(v)) {
        rc = invalid(e, "store", "must be an object");
        goto out;
    }
    json_object_foreach(v, key, val)
    {
        join_key(field, "store", key);
        if (strcmp(key, "path") == 0) {
            const char *s = NULL;
            char *path = NULL;
            rc = get_string(val, field, &s, e);
            if (rc == CONFIG_OK)
                rc = make_store_path(s, field, &path, e);
            if (rc == CONFIG_OK) {
                free(st->path);
                st->path = path;
            }
        } else if (strcmp(key, "map_size") == 0) {
            rc = get_size(val, field, &st->map_size_bytes, e);
        } else if (strcmp(key, "durability") == 0) {
            rc = get_choice(val, field, "sync", "interval", &choice, e);
            if (rc == CONFIG_OK)
                st->durability = (enum config_durability)choice;
        } else if (strcmp(key, "sync_interval") == 0) {
            rc = get_duration(val, field, &st->sync_interval_ms, e);
        } else if (strcmp(key, "purge_interval") == 0) {
            rc = get_duration(val, field, &st->purge_interval_ms, e);
        } else if (strcmp(key, "require_local_fs") == 0) {
            rc = get_bool(val, field, &st->require_local_fs, e);
        } else {
            rc = unknown_key(e, "store", key);
        }
        if (rc != CONFIG_OK)
            goto out;
    }
out:
    return rc;
}

static int parse_server(json_t *v, struct config_server *sv, struct errbuf *e)
{
    char field[FIELD_LEN];
    const char *key;
    json_t *val;
    json_int_t n = 0;
    uint64_t bytes = 0;
    int rc = CONFIG_OK;

    if (!json_is_object(v)) {
        rc = invalid(e, "server", "must be an object");
        goto out;
    }
    json_object_foreach(v, key, val)
    {
        join_key(field, "server", key);
        if (strcmp(key, "workers") == 0) {
            rc = get_integer(val, field, 0, MAX_WORKERS, &n, e);
            if (rc == CONFIG_OK)
                sv->workers = (unsigned)n;
        } else if (strcmp(key, "max_connections") == 0) {
            rc = get_integer(val, field, 1, MAX_CONNECTIONS, &n, e);
            if (rc == CONFIG_OK)
                sv->max_connections = (unsigned)n;
        } else if (strcmp(key, "per_ip_connections") == 0) {
            rc = get_integer(val, field, 0, MAX_CONNECTIONS, &n, e);
            if (rc == CONFIG_OK)
                sv->per_ip_connections = (unsigned)n;
        } else if (strcmp(key, "client_timeout") == 0) {
            rc = get_duration(val, field, &sv->client_timeout_ms, e);
        } else if (strcmp(key, "header_memory") == 0) {
            rc = get_size(val, field, &bytes, e);
#if SIZE_MAX < UINT64_MAX
            if (rc == CONFIG_OK && bytes > SIZE_MAX)
                rc = invalid(e, field, "is too large");
#endif
            if (rc == CONFIG_OK)
                sv->header_memory_bytes = (size_t)bytes;
        } else if (strcmp(key, "max_buffered") == 0) {
            if (json_is_string(val) && strcmp(json_string_value(val), "auto") == 0) {
                sv->max_buffered_bytes = 0;
            } else {
                rc = get_size(val, field, &sv->max_buffered_bytes, e);
                if (rc == CONFIG_OK && sv->max_buffered_bytes < MIN_MAX_BUFFERED)
                    rc = invalid(e, field, "must be \"auto\" or at least 1MiB");
            }
        } else if (strcmp(key, "drain_timeout") == 0) {
            rc = get_duration(val, field, &sv->drain_timeout_ms, e);
        } else {
            rc = unknown_key(e, "server", key);
        }
        if (rc != CONFIG_OK)
            goto out;
    }
out:
    return rc;
}

/* A route path is matched against the request path without its query, so
 * '?' and '#' could never match; white space and controls are typos. */
static bool valid_route_path(const char *s)
{
    return s[0] == '/' && config_is_visible_ascii(s) && strpbrk(s, "?#") == NULL;
}

static void route_set_defaults(struct config_route *r)
{
    int status;

    r->match = CONFIG_MATCH_PREFIX;
    r->ttl_ms = 24 * 3600 * 1000;
    r->lease_ms = 30 * 1000;
    r->heartbeat_ms = 15 * 1000;
    r->wait_ms = 10 * 1000;
    r->require_key = false;
    r->fingerprint = CONFIG_FINGERPRINT_AUTO;
    r->max_body_bytes = CONFIG_MIB;
    r->max_key_length = 255;
    for (status = 0; status < 600; status++)
        r->release_on[status] = status >= 500;
    r->on_unknown = CONFIG_ON_UNKNOWN_RELEASE;
}

/* Fills what the file did not set: path "/" for the catch-all route,
 * methods POST and PATCH, strip_headers Set-Cookie, scope = path,
 * heartbeat = lease / 2. */
static int route_finish(struct config_route *r, const struct route_seen *seen, size_t index,
                        struct errbuf *e)
{
    char field[FIELD_LEN];
    int rc = CONFIG_OK;

    if (!seen->path) {
        rc = replace_string(&r->path, "/", e);
        if (rc != CONFIG_OK)
            goto out;
    }
    if (!seen->methods) {
        r->methods = calloc(2, sizeof *r->methods);
        if (r->methods == NULL) {
            rc = no_memory(e);
            goto out;
        }
        r->methods[0] = strdup("POST");
        r->methods[1] = strdup("PATCH");
        r->n_methods = 2;
        if (r->methods[0] == NULL || r->methods[1] == NULL) {
            rc = no_memory(e);
            goto out;
        }
    }
    if (!seen->strip_headers) {
        r->strip_headers = calloc(1, sizeof *r->strip_headers);
        if (r->strip_headers == NULL) {
            rc = no_memory(e);
            goto out;
        }
        r->strip_headers[0] = strdup("Set-Cookie");
        r->n_strip_headers = 1;
        if (r->strip_headers[0] == NULL) {
            rc = no_memory(e);
            goto out;
        }
    }
    if (r->scope == NULL) {
        if (strlen(r->path) > CONFIG_MAX_SCOPE_LENGTH) {
            snprintf(field, sizeof field, "routes[%zu].scope", index);
            rc = invalid(e, field, "longer than %d bytes (derived from path; set \"scope\")",
                         CONFIG_MAX_SCOPE_LENGTH);
            goto out;
        }
        rc = replace_string(&r->scope, r->path, e);
        if (rc != CONFIG_OK)
            goto out;
    }
    if (!seen->heartbeat)
        r->heartbeat_ms = r->lease_ms / 2;
out:
    return rc;
}

static int parse_route_key(const char *key, const json_t *val, const char *where, const char *field,
                           struct config_route *r, struct route_seen *seen, struct errbuf *e)
{
    char q[QUOTE_LEN];
    const char *s = NULL;
    json_int_t n = 0;
    int choice = 0;
    int rc = CONFIG_OK;

    if (strcmp(key, "path") == 0) {
        rc = get_string(val, field, &s, e);
        if (rc == CONFIG_OK && s[0] != '/') {
            rc = invalid(e, field, "must start with '/'");
        } else if (rc == CONFIG_OK && !valid_route_path(s)) {
            render(val, q, sizeof q);
            rc = invalid(e, field, "%s is not a path (visible ASCII, no '?' or '#')", q);
        } else if (rc == CONFIG_OK) {
            rc = replace_string(&r->path, s, e);
            seen->path = true;
        }
    } else if (strcmp(key, "match") == 0) {
        rc = get_choice(val, field, "prefix", "exact", &choice, e);
        if (rc == CONFIG_OK)
            r->match = (enum config_match)choice;
    } else if (strcmp(key, "methods") == 0) {
        rc = get_tokens(val, field, true, &r->methods, &r->n_methods, e);
        seen->methods = true;
    } else if (strcmp(key, "scope") == 0) {
        /* Length and characters: check_route(), for derived scopes too. */
        rc = get_string(val, field, &s, e);
        if (rc == CONFIG_OK)
            rc = replace_string(&r->scope, s, e);
    } else if (strcmp(key, "scope_header") == 0) {
        if (json_is_null(val)) {
            free(r->scope_header);
            r->scope_header = NULL;
        } else {
            rc = get_string(val, field, &s, e);
            if (rc == CONFIG_OK && !config_is_token(s)) {
                render(val, q, sizeof q);
                rc = invalid(e, field, "%s is not a header name", q);
            } else if (rc == CONFIG_OK) {
                rc = replace_string(&r->scope_header, s, e);
            }
        }
    } else if (strcmp(key, "ttl") == 0) {
        rc = get_duration(val, field, &r->ttl_ms, e);
    } else if (strcmp(key, "lease") == 0) {
        rc = get_duration(val, field, &r->lease_ms, e);
    } else if (strcmp(key, "heartbeat") == 0) {
        rc = get_duration(val, field, &r->heartbeat_ms, e);
        seen->heartbeat = true;
    } else if (strcmp(key, "wait") == 0) {
        rc = get_duration(val, field, &r->wait_ms, e);
    } else if (strcmp(key, "require_key") == 0) {
        rc = get_bool(val, field, &r->require_key, e);
    } else if (strcmp(key, "fingerprint") == 0) {
        rc = get_choice(val, field, "auto", "raw", &choice, e);
        if (rc == CONFIG_OK)
            r->fingerprint = (enum config_fingerprint)choice;
    } else if (strcmp(key, "max_body") == 0) {
        rc = get_size(val, field, &r->max_body_bytes, e);
        if (rc == CONFIG_OK && r->max_body_bytes > MAX_BODY_LIMIT)
            rc = invalid(e, field, "must be at most 1GiB (a body is held in memory)");
    } else if (strcmp(key, "max_key_length") == 0) {
        rc = get_integer(val, field, 1, MAX_KEY_LENGTH_LIMIT, &n, e);
        if (rc == CONFIG_OK)
            r->max_key_length = (size_t)n;
    } else if (strcmp(key, "release_on") == 0) {
        rc = get_release_on(val, field, r->release_on, e);
    } else if (strcmp(key, "on_unknown") == 0) {
        rc = get_choice(val, field, "release", "complete", &choice, e);
        if (rc == CONFIG_OK)
            r->on_unknown = (enum config_on_unknown)choice;
    } else if (strcmp(key, "strip_headers") == 0) {
        rc = get_tokens(val, field, false, &r->strip_headers, &r->n_strip_headers, e);
        seen->strip_headers = true;
    } else {
        rc = unknown_key(e, where, key);
    }
    return rc;
}

static int parse_route(json_t *v, size_t index, struct config_route *r, struct errbuf *e)
{
    struct route_seen seen = {false, false, false, false};
    char where[FIELD_LEN];
    char field[FIELD_LEN];
    const char *key;
    json_t *val;
    int rc = CONFIG_OK;

    join_index(where, "routes", index);
    route_set_defaults(r);
    if (!json_is_object(v)) {
        rc = invalid(e, where, "must be an object");
        goto out;
    }
    json_object_foreach(v, key, val)
    {
        join_key(field, where, key);
        rc = parse_route_key(key, val, where, field, r, &seen, e);
        if (rc != CONFIG_OK)
            goto out;
    }
    if (!seen.path) {
        join_key(field, where, "path");
        rc = invalid(e, field, "is required");
        goto out;
    }
    rc = route_finish(r, &seen, index, e);
out:
    return rc;
}

static int parse_routes(const json_t *v, struct config *cfg, struct errbuf *e)
{
    size_t i;
    int rc = CONFIG_OK;

    if (!json_is_array(v)) {
        rc = invalid(e, "routes", "must be an array");
        goto out;
    }
    /* No routes at all would make the proxy a plain forwarder, which is
     * surely not what an explicit [] meant. Leaving "routes" out gives
     * the catch-all route. */
    if (json_array_size(v) == 0) {
        rc = invalid(e, "routes", "must not be empty");
        goto out;
    }
    cfg->routes = calloc(json_array_size(v), sizeof *cfg->routes);
    if (cfg->routes == NULL) {
        rc = no_memory(e);
        goto out;
    }
    /* calloc'd routes are safe for config_free() even if parsing stops. */
    cfg->n_routes = json_array_size(v);
    for (i = 0; i < cfg->n_routes; i++) {
        rc = parse_route(json_array_get(v, i), i, &cfg->routes[i], e);
        if (rc != CONFIG_OK)
            goto out;
    }
out:
    return rc;
}

static int add_default_route(struct config *cfg, struct errbuf *e)
{
    struct route_seen seen = {false, false, false, false};
    int rc = CONFIG_OK;

    cfg->routes = calloc(1, sizeof *cfg->routes);
    if (cfg->routes == NULL) {
        rc = no_memory(e);
        goto out;
    }
    cfg->n_routes = 1;
    route_set_defaults(&cfg->routes[0]);
    rc = route_finish(&cfg->routes[0], &seen, 0, e);
out:
    return rc;
}

static int parse_top(json_t *root, struct config *cfg, struct errbuf *e)
{
    const char *key;
    const char *s = NULL;
    json_t *val;
    bool has_routes = false;
    int rc = CONFIG_OK;

    if (!json_is_object(root)) {
        rc = invalid(e, "top level", "must be an object");
        goto out;
    }
    json_object_foreach(root, key, val)
    {
        if (strcmp(key, "listen") == 0) {
            char *listen = NULL;
            rc = get_string(val, key, &s, e);
            if (rc == CONFIG_OK)
                rc = make_listen(s, key, &listen, e);
            if (rc == CONFIG_OK) {
                free(cfg->listen);
                cfg->listen = listen;
            }
        } else if (strcmp(key, "upstream") == 0) {
            rc = parse_upstream(val, &cfg->upstream, e);
        } else if (strcmp(key, "store") == 0) {
            rc = parse_store(val, &cfg->store, e);
        } else if (strcmp(key, "server") == 0) {
            rc = parse_server(val, &cfg->server, e);
        } else if (strcmp(key, "access_log") == 0) {
            rc = get_bool(val, key, &cfg->access_log, e);
        } else if (strcmp(key, "routes") == 0) {
            rc = parse_routes(val, cfg, e);
            has_routes = true;
        } else {
            rc = unknown_key(e, "top level", key);
        }
        if (rc != CONFIG_OK)
            goto out;
    }
    if (!has_routes)
        rc = add_default_route(cfg, e);
out:
    return rc;
}

/* Every default except the routes, which depend on the file. */
static int config_alloc(struct config **out, struct errbuf *e)
{
    struct config *cfg = calloc(1, sizeof *cfg);
    int rc = CONFIG_OK;

    if (cfg == NULL) {
        rc = no_memory(e);
        goto out;
    }
    cfg->listen = strdup(DEFAULT_LISTEN);
    cfg->store.path = strdup(DEFAULT_STORE_PATH);
    if (cfg->listen == NULL || cfg->store.path == NULL) {
        rc = no_memory(e);
        goto out;
    }
    cfg->upstream.url = NULL;
    cfg->upstream.connect_timeout_ms = 5 * 1000;
    cfg->upstream.resolve_interval_ms = 30 * 1000;
    /* Below the 5 s idle keep-alive timeout of Node.js, uvicorn and Apache:
     * a connection the upstream is closing at the moment it is reused would
     * fail a request that may not be sent again. */
    cfg->upstream.idle_timeout_ms = 4 * 1000;
    cfg->upstream.timeout_ms = 60 * 1000;
    cfg->upstream.max_response_bytes = 16 * CONFIG_MIB;
    cfg->upstream.client = CONFIG_UPSTREAM_NATIVE;
    cfg->store.map_size_bytes = CONFIG_GIB;
    cfg->store.durability = CONFIG_DURABILITY_SYNC;
    cfg->store.sync_interval_ms = 1000;
    cfg->store.purge_interval_ms = 60 * 1000;
    cfg->store.require_local_fs = true;
    cfg->server.workers = 0;
    cfg->server.max_connections = 4096;
    cfg->server.per_ip_connections = 256;
    cfg->server.client_timeout_ms = 30 * 1000;
    cfg->server.header_memory_bytes = 16 * CONFIG_KIB;
    cfg->server.drain_timeout_ms = 30 * 1000;
    cfg->access_log = true;
out:
    if (rc != CONFIG_OK) {
        config_free(cfg);
        cfg = NULL;
    }
    *out = cfg;
    return rc;
}

/* ---- semantic checks on the struct ---------------------------------- */

static int check_positive(int64_t ms, const char *field, struct errbuf *e)
{
    return ms > 0 ? CONFIG_OK : invalid(e, field, "must be greater than 0");
}

static int check_not_negative(int64_t ms, const char *field, struct errbuf *e)
{
    return ms >= 0 ? CONFIG_OK : invalid(e, field, "must not be negative");
}

static int check_tokens(char *const *list, size_t n, const char *field, const char *what,
                        struct errbuf *e)
{
    char elem[FIELD_LEN];
    char q[QUOTE_LEN];
    size_t i;
    int rc = CONFIG_OK;

    for (i = 0; rc == CONFIG_OK && i < n; i++) {
        if (list[i] == NULL || !config_is_token(list[i])) {
            join_index(elem, field, i);
            config_quote(list[i] != NULL ? list[i] : "", q, sizeof q);
            rc = invalid(e, elem, "%s is not %s", q, what);
        }
    }
    return rc;
}

/* A scope_header must name the caller (a tenant, an account), not a part of
 * the request the proxy reads or drops itself: with Content-Length, a
 * duplicate with another body would be a new key in another scope, run
 * again instead of refused with 422. */
static bool scope_header_usable(const char *name)
{
    static const char *const refused[] = {
        "Idempotency-Key",
        "Content-Length",
        "Transfer-Encoding",
        "Content-Type",
        "Content-Encoding",
        "Connection",
        "Keep-Alive",
        "TE",
        "Trailer",
        "Upgrade",
        "Expect",
    };

    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++)
        if (strcasecmp(name, refused[i]) == 0)
            return false;
    return true;
}

static int check_route(const struct config_route *r, size_t index, struct errbuf *e)
{
    char where[FIELD_LEN];
    char field[FIELD_LEN];
    int rc = CONFIG_OK;

    join_index(where, "routes", index);
#define FIELD(name) (join_key(field, where, name), field)
    if (r->path == NULL || r->path[0] != '/')
        rc = invalid(e, FIELD("path"), "must start with '/'");
    else if (!valid_route_path(r->path))
        rc = invalid(e, FIELD("path"), "is not a path (visible ASCII, no '?' or '#')");
    else if (r->n_methods == 0 || r->methods == NULL)
        rc = invalid(e, FIELD("methods"), "must not be empty");
    else if (r->scope == NULL || r->scope[0] == '\0')
        rc = invalid(e, FIELD("scope"), "must not be empty");
    else if (strlen(r->scope) > CONFIG_MAX_SCOPE_LENGTH)
        rc = invalid(e, FIELD("scope"), "longer than %d bytes", CONFIG_MAX_SCOPE_LENGTH);
    else if (!config_is_visible_ascii(r->scope))
        rc = invalid(e, FIELD("scope"), "must be visible ASCII (no spaces or controls)");
    else if (r->scope_header != NULL && !config_is_token(r->scope_header))
        rc = invalid(e, FIELD("scope_header"), "is not a header name");
    else if (r->scope_header != NULL && !scope_header_usable(r->scope_header))
        rc = invalid(e, FIELD("scope_header"), "\"%s\" cannot name a tenant: %s", r->scope_header,
                     strcasecmp(r->scope_header, "Idempotency-Key") == 0
                         ? "it is the key itself (each key would be a scope of its own; use a "
                           "header that names the caller)"
                         : "it says how the body or the connection is sent (a duplicate "
                           "differing in it would be a new key in another scope, run again "
                           "instead of refused with 422)");
    else if (r->ttl_ms <= 0)
        rc = check_positive(r->ttl_ms, FIELD("ttl"), e);
    /* Waiting duplicates in another process learn of a completion by
     * polling (every 10-200 ms): a record that expired before they looked
     * would be run again instead of replayed. */
    else if (r->ttl_ms < MIN_TTL_MS)
        rc = invalid(e, FIELD("ttl"), "must be at least 1s");
    /* The lease first: a derived heartbeat (lease / 2) is then at least
     * 500 ms, so an error about it always names a field the file set. */
    else if (r->lease_ms < MIN_LEASE_MS)
        rc = invalid(e, FIELD("lease"), "must be at least 1s");
    else if (r->heartbeat_ms < MIN_HEARTBEAT_MS)
        rc = invalid(e, FIELD("heartbeat"), "must be at least 100ms");
    /* A heartbeat at or past the lease lets the lease lapse between two
     * beats, and another caller steals a record that is still running. */
    else if (r->heartbeat_ms >= r->lease_ms)
        rc = invalid(e, FIELD("heartbeat"), "must be less than lease");
    else if (r->wait_ms < 0)
        rc = check_not_negative(r->wait_ms, FIELD("wait"), e);
    else if (r->max_key_length < 1 || r->max_key_length > MAX_KEY_LENGTH_LIMIT)
        rc = invalid(e, FIELD("max_key_length"), "must be between 1 and %d", MAX_KEY_LENGTH_LIMIT);
    else
        rc = check_tokens(r->methods, r->n_methods, FIELD("methods"), "an HTTP method", e);
    for (size_t i = 0; rc == CONFIG_OK && i < r->n_methods; i++)
        if (strcmp(r->methods[i], "CONNECT") == 0)
            rc = invalid(e, FIELD("methods"), "CONNECT is never forwarded (the proxy answers 501)");
    if (rc == CONFIG_OK)
        rc = check_tokens(r->strip_headers, r->n_strip_headers, FIELD("strip_headers"),
                          "a header name", e);
#undef FIELD
    return rc;
}

/* Whether route a, tried before b, takes every request b would match for
 * method m: a has m, and a's path covers all of b's. A prefix route covers
 * any route whose own path it matches (the paths b matches extend that one
 * past a's segment boundary); an exact route only an exact route on the
 * same path. */
static bool route_shadows(const struct config_route *a, const struct config_route *b,
                          const char *m)
{
    bool covers;

    if (a->match == CONFIG_MATCH_EXACT)
        covers = b->match == CONFIG_MATCH_EXACT && strcmp(a->path, b->path) == 0;
    else
        covers = route_matches_path(a, b->path, strlen(b->path));
    return covers && route_has_method(a, m);
}

/* Routes are tried in order and the first match wins (CONTRACT.md section
 * 4), so a route whose path and methods earlier ones already cover is
 * never used: its scope, ttl and require_key would silently not apply
 * ("/" first, then "/v1/payments"). */
static int check_reachable(const struct config *cfg, size_t index, struct errbuf *e)
{
    const struct config_route *r = &cfg->routes[index];
    char field[FIELD_LEN];
    char q[QUOTE_LEN];
    size_t by = 0; /* the route that takes its first method */
    bool reachable = false;
    int rc = CONFIG_OK;

    for (size_t m = 0; !reachable && m < r->n_methods; m++) {
        size_t i = 0;
        while (i < index && !route_shadows(&cfg->routes[i], r, r->methods[m]))
            i++;
        reachable = i == index;
        if (m == 0)
            by = i;
    }
    if (!reachable) {
        snprintf(field, sizeof field, "routes[%zu].path", index);
        config_quote(r->path, q, sizeof q);
        rc = invalid(e, field, "%s is never matched: routes[%zu] comes first and takes its "
                               "requests (for every method it lists)",
                     q, by);
    }
    return rc;
}

/* Routes that share a scope share one key space (CONTRACT.md section 4),
 * which holds only if they agree on scope_header: with it on one and not
 * the other, the "shared" keys are two spaces; with two header names, the
 * tenants of one header meet those of the other. */
static int check_shared_scope(const struct config *cfg, size_t index, struct errbuf *e)
{
    const struct config_route *r = &cfg->routes[index];
    char field[FIELD_LEN];
    char q[QUOTE_LEN];

    for (size_t i = 0; i < index; i++) {
        const struct config_route *o = &cfg->routes[i];
        if (strcmp(o->scope, r->scope) != 0)
            continue;
        if ((o->scope_header == NULL) == (r->scope_header == NULL) &&
            (o->scope_header == NULL || strcasecmp(o->scope_header, r->scope_header) == 0))
            return CONFIG_OK;
        snprintf(field, sizeof field, "routes[%zu].scope_header", index);
        config_quote(r->scope, q, sizeof q);
        return invalid(e, field,
                       "routes sharing scope %s share one key space and must agree on "
                       "scope_header: routes[%zu] has %s%s%s",
                       q, i, o->scope_header ? "\"" : "",
                       o->scope_header ? o->scope_header : "none", o->scope_header ? "\"" : "");
    }
    return CONFIG_OK;
}

static int check_config(const struct config *cfg, bool need_upstream, struct errbuf *e)
{
    size_t i;
    int rc = CONFIG_OK;

    if (cfg->listen == NULL)
        rc = invalid(e, "listen", "is required");
    else
        rc = listen_error(cfg->listen, "listen", e);
    if (rc != CONFIG_OK)
        goto out;
    if (cfg->upstream.url == NULL && need_upstream)
        rc = invalid(e, "upstream", "is required");
    else if (cfg->upstream.url != NULL)
        rc = url_error(cfg->upstream.url, "upstream", e);
    /* Accepted in any case; kept lower case, as the clients and the dump
     * expect it. */
    if (rc == CONFIG_OK && cfg->upstream.url != NULL)
        for (size_t c = 0; c < 4; c++)
            cfg->upstream.url[c] = (char)tolower((unsigned char)cfg->upstream.url[c]);
    if (rc != CONFIG_OK)
        goto out;
    if (cfg->upstream.connect_timeout_ms <= 0)
        rc = check_positive(cfg->upstream.connect_timeout_ms, "upstream.connect_timeout", e);
    else if (cfg->upstream.timeout_ms <= 0)
        rc = check_positive(cfg->upstream.timeout_ms, "upstream.timeout", e);
    else if (cfg->upstream.max_response_bytes < MIN_MAX_RESPONSE)
        rc = invalid(e, "upstream.max_response", "must be at least 4KiB");
    else if (cfg->upstream.max_response_bytes > MAX_BODY_LIMIT)
        rc = invalid(e, "upstream.max_response",
                     "must be at most 1GiB (an answer is held in memory and in one record)");
    else if (cfg->upstream.resolve_interval_ms < 1000)
        rc = invalid(e, "upstream.resolve_interval", "must be at least 1s");
    else if (cfg->upstream.idle_timeout_ms < 1000)
        rc = invalid(e, "upstream.idle_timeout", "must be at least 1s");
    /* libcurl takes whole seconds, and a 0 means "reuse only under 1 s" to
     * libcurl before 8.x's millisecond compare and "no limit" after it: from
     * 2s up, one second less keeps every reuse under the timeout with both. */
    else if (cfg->upstream.client == CONFIG_UPSTREAM_LIBCURL && cfg->upstream.idle_timeout_ms < 2000)
        rc = invalid(e, "upstream.idle_timeout", "must be at least 2s with client \"libcurl\"");
    else if (cfg->store.path == NULL || cfg->store.path[0] == '\0')
        rc = invalid(e, "store.path", "must not be empty");
    else if (cfg->store.map_size_bytes < MIN_MAP_SIZE)
        rc = invalid(e, "store.map_size", "must be at least 1MiB");
    /* It is reserved as address space at start: past what a process can
     * map, the proxy would only say "Cannot allocate memory". */
    else if (cfg->store.map_size_bytes > MAX_MAP_SIZE)
        rc = invalid(e, "store.map_size", "must be at most 65536GiB");
    else if (cfg->store.sync_interval_ms <= 0)
        rc = check_positive(cfg->store.sync_interval_ms, "store.sync_interval", e);
    else if (cfg->store.purge_interval_ms <= 0)
        rc = check_positive(cfg->store.purge_interval_ms, "store.purge_interval", e);
    else if (cfg->server.workers > MAX_WORKERS)
        rc = invalid(e, "server.workers", "must be between 0 and %d", MAX_WORKERS);
    else if (cfg->server.max_connections < 1 || cfg->server.max_connections > MAX_CONNECTIONS)
        rc = invalid(e, "server.max_connections", "must be between 1 and %d", MAX_CONNECTIONS);
    else if (cfg->server.per_ip_connections > MAX_CONNECTIONS)
        rc = invalid(e, "server.per_ip_connections", "must be between 0 and %d", MAX_CONNECTIONS);
    else if (cfg->server.client_timeout_ms <= 0)
        rc = check_positive(cfg->server.client_timeout_ms, "server.client_timeout", e);
    else if (cfg->server.header_memory_bytes < MIN_HEADER_MEMORY)
        rc = invalid(e, "server.header_memory", "must be at least 4KiB");
    else if (cfg->server.header_memory_bytes > MAX_HEADER_MEMORY)
        rc = invalid(e, "server.header_memory", "must be at most 1MiB");
    else if (cfg->server.drain_timeout_ms < 0)
        rc = check_not_negative(cfg->server.drain_timeout_ms, "server.drain_timeout", e);
    else if (cfg->n_routes == 0 || cfg->routes == NULL)
        rc = invalid(e, "routes", "must not be empty");
    for (i = 0; rc == CONFIG_OK && i < cfg->n_routes; i++)
        rc = check_route(&cfg->routes[i], i, e);
    /* A body larger than the budget could never be admitted: every such
     * request would get 503 for ever. */
    for (i = 0; rc == CONFIG_OK && i < cfg->n_routes; i++)
        if (cfg->server.max_buffered_bytes != 0 &&
            cfg->routes[i].max_body_bytes > cfg->server.max_buffered_bytes)
            rc = invalid(e, "server.max_buffered",
                         "must be at least every route's max_body (routes[%zu].max_body)", i);
    for (i = 1; rc == CONFIG_OK && i < cfg->n_routes; i++)
        rc = check_reachable(cfg, i, e);
    for (i = 1; rc == CONFIG_OK && i < cfg->n_routes; i++)
        rc = check_shared_scope(cfg, i, e);
out:
    return rc;
}

/* ---- loading -------------------------------------------------------- */

static int load_json(json_t *root, struct config **out, struct errbuf *e)
{
    struct config *cfg = NULL;
    int rc;

    rc = config_alloc(&cfg, e);
    if (rc != CONFIG_OK)
        goto out;
    rc = parse_top(root, cfg, e);
    if (rc != CONFIG_OK)
        goto out;
    /* The upstream may still come from --upstream: config_validate(). */
    rc = check_config(cfg, false, e);
    /* libmicrohttpd counts a connection's timeout in whole seconds: the
     * effective value, which check-config prints, is rounded up to one. */
    if (rc == CONFIG_OK)
        cfg->server.client_timeout_ms = (cfg->server.client_timeout_ms + 999) / 1000 * 1000;
out:
    if (rc != CONFIG_OK) {
        config_free(cfg);
        cfg = NULL;
    }
    *out = cfg;
    return rc;
}

static int read_file(const char *path, char **out, size_t *out_len, struct errbuf *e)
{
    char reason[128];
    FILE *f = NULL;
    char *buf = NULL;
    size_t len = 0;
    int rc = CONFIG_OK;

    if (path[0] == '\0') {
        rc = fail(e, CONFIG_EIO, "the configuration file's name is empty");
        goto out;
    }
    f = fopen(path, "r");
    if (f == NULL) {
        if (strerror_r(errno, reason, sizeof reason) != 0)
            snprintf(reason, sizeof reason, "cannot open");
        rc = fail(e, CONFIG_EIO, "%s: %s", path, reason);
        goto out;
    }
    buf = malloc(MAX_FILE_BYTES + 1);
    if (buf == NULL) {
        rc = no_memory(e);
        goto out;
    }
    len = fread(buf, 1, MAX_FILE_BYTES + 1, f);
    if (ferror(f)) {
        /* fread sets errno on POSIX systems (a directory: EISDIR). */
        if (strerror_r(errno, reason, sizeof reason) != 0)
            snprintf(reason, sizeof reason, "read error");
        rc = fail(e, CONFIG_EIO, "%s: %s", path, reason);
        goto out;
    }
    if (len > MAX_FILE_BYTES) {
        rc = fail(e, CONFIG_EINVAL, "%s: larger than %d bytes", path, MAX_FILE_BYTES);
        goto out;
    }
    buf[len] = '\0'; /* for the string functions; len bytes are the file */
    *out = buf;
    *out_len = len;
    buf = NULL;
out:
    free(buf);
    if (f != NULL)
        fclose(f);
    return rc;
}

/* RFC 8259 section 8.1: a parser may ignore a byte order mark, and some
 * editors write one. */
static size_t bom_length(const char *text, size_t len)
{
    return len >= 3 && memcmp(text, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
}

/* jansson reads a NUL byte as the end of the text, and then says "end of
 * file expected near end of file" (a NUL after the object) or "'[' or '{'
 * expected near end of file" (a UTF-16 file, which Windows editors write):
 * nothing about what is wrong. The position is jansson's: line, byte. */
static int nul_byte_error(const char *text, size_t len, const char *path, struct errbuf *e)
{
    const char *nul = memchr(text, '\0', len);
    int line = 1;
    int column = 0;
    int rc = CONFIG_OK;

    if (nul != NULL) {
        for (const char *p = text; p <= nul; p++) {
            column++;
            if (*p == '\n' && p < nul) {
                line++;
                column = 0;
            }
        }
        rc = fail(e, CONFIG_EINVAL, "%s:%d:%d: a NUL byte: the file is not UTF-8 text (UTF-16?)",
                  path, line, column);
    }
    return rc;
}

static int parse_error(const json_error_t *jerr, const char *path, struct errbuf *e)
{
    int code = json_error_code(jerr) == json_error_out_of_memory ? CONFIG_ENOMEM : CONFIG_EINVAL;
    int rc;

    /* jansson leaves the text empty when it fails to allocate its lexer. */
    if (code == CONFIG_ENOMEM || jerr->text[0] == '\0')
        rc = no_memory(e);
    else if (strstr(jerr->text, "JSON_ALLOW_NUL") != NULL && path != NULL)
        /* jansson's text names its own flag. */
        rc = fail(e, code, "%s:%d:%d: a string holds \\u0000 (a NUL), which no value may hold",
                  path, jerr->line, jerr->column);
    else if (strstr(jerr->text, "JSON_ALLOW_NUL") != NULL)
        rc = fail(e, code,
                  "line %d, column %d: a string holds \\u0000 (a NUL), which no value may hold",
                  jerr->line, jerr->column);
    else if (path != NULL)
        rc = fail(e, code, "%s:%d:%d: %s", path, jerr->line, jerr->column, jerr->text);
    else
        rc = fail(e, code, "line %d, column %d: %s", jerr->line, jerr->column, jerr->text);
    return rc;
}

int config_new_default(struct config **out, char *err, size_t errlen)
{
    struct errbuf e = {err, errlen};
    struct config *cfg = NULL;
    int rc;

    rc = config_alloc(&cfg, &e);
    if (rc == CONFIG_OK)
        rc = add_default_route(cfg, &e);
    if (rc != CONFIG_OK) {
        config_free(cfg);
        cfg = NULL;
    }
    *out = cfg;
    return rc;
}

int config_load_file(const char *path, struct config **out, char *err, size_t errlen)
{
    struct errbuf e = {err, errlen};
    json_error_t jerr;
    json_t *root = NULL;
    char *text = NULL;
    size_t len = 0;
    size_t skip;
    int rc;

    *out = NULL;
    rc = read_file(path, &text, &len, &e);
    if (rc != CONFIG_OK)
        goto out;
    rc = nul_byte_error(text, len, path, &e);
    if (rc != CONFIG_OK)
        goto out;
    skip = bom_length(text, len);
    /* jansson would say "'[' or '{' expected near end of file" (a file
     * truncated by a failed copy, or created but never written). */
    if (strspn(text + skip, " \t\r\n") == len - skip) {
        rc = fail(&e, CONFIG_EINVAL,
                  "%s: the file is empty (a configuration is a JSON object; {\"upstream\": "
                  "\"http://HOST:PORT\"} at least)",
                  path);
        goto out;
    }
    root = json_loadb(text + skip, len - skip, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL) {
        rc = parse_error(&jerr, path, &e);
        goto out;
    }
    rc = load_json(root, out, &e);
out:
    json_decref(root);
    free(text);
    return rc;
}

int config_load_string(const char *json, size_t len, struct config **out, char *err, size_t errlen)
{
    struct errbuf e = {err, errlen};
    json_error_t jerr;
    json_t *root = NULL;
    size_t skip;
    int rc = CONFIG_EINVAL;

    *out = NULL;
    if (json == NULL) {
        rc = fail(&e, CONFIG_EINVAL, "no configuration text");
        goto out;
    }
    skip = bom_length(json, len);
    root = json_loadb(json + skip, len - skip, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL) {
        rc = parse_error(&jerr, NULL, &e);
        goto out;
    }
    rc = load_json(root, out, &e);
out:
    json_decref(root);
    return rc;
}

int config_override(struct config *cfg, const char *listen, const char *upstream,
                    const char *store_path, char *err, size_t errlen)
{
    struct errbuf e = {err, errlen};
    char *new_listen = NULL;
    char *new_url = NULL;
    char *new_path = NULL;
    int rc = CONFIG_OK;

    if (cfg == NULL) {
        rc = fail(&e, CONFIG_EINVAL, "no configuration");
        goto out;
    }
    /* All or nothing: cfg changes only when every given value is valid. */
    if (listen != NULL)
        rc = make_listen(listen, "--listen", &new_listen, &e);
    if (rc == CONFIG_OK && upstream != NULL)
        rc = make_url(upstream, "--upstream", &new_url, &e);
    if (rc == CONFIG_OK && store_path != NULL)
        rc = make_store_path(store_path, "--store", &new_path, &e);
    if (rc != CONFIG_OK)
        goto out;
    if (new_listen != NULL) {
        free(cfg->listen);
        cfg->listen = new_listen;
        new_listen = NULL;
    }
    if (new_url != NULL) {
        free(cfg->upstream.url);
        cfg->upstream.url = new_url;
        new_url = NULL;
    }
    if (new_path != NULL) {
        free(cfg->store.path);
        cfg->store.path = new_path;
        new_path = NULL;
    }
    rc = check_config(cfg, true, &e);
out:
    free(new_listen);
    free(new_url);
    free(new_path);
    return rc;
}

int config_validate(const struct config *cfg, char *err, size_t errlen)
{
    struct errbuf e = {err, errlen};
    int rc;

    if (cfg == NULL)
        rc = fail(&e, CONFIG_EINVAL, "no configuration");
    else
        rc = check_config(cfg, true, &e);
    return rc;
}

void config_free(struct config *cfg)
{
    size_t i;

    if (cfg != NULL) {
        for (i = 0; i < cfg->n_routes; i++) {
            struct config_route *r = &cfg->routes[i];
            free(r->path);
            free_strings(r->methods, r->n_methods);
            free(r->scope);
            free(r->scope_header);
            free_strings(r->strip_headers, r->n_strip_headers);
        }
        free(cfg->routes);
        free(cfg->listen);
        free(cfg->upstream.url);
        free(cfg->store.path);
        free(cfg);
    }
}

int config_parse_duration(const char *s, int64_t *out_ms)
{
    int64_t ms = 0;
    int rc = CONFIG_EINVAL;

    if (s != NULL && out_ms != NULL && config_scan_duration(s, &ms) == CONFIG_SCAN_OK) {
        *out_ms = ms;
        rc = CONFIG_OK;
    }
    return rc;
}

int config_parse_size(const char *s, uint64_t *out_bytes)
{
    uint64_t bytes = 0;
    int rc = CONFIG_EINVAL;

    if (s != NULL && out_bytes != NULL && config_scan_size(s, &bytes) == CONFIG_SCAN_OK) {
        *out_bytes = bytes;
        rc = CONFIG_OK;
    }
    return rc;
}

/* ---- route matching ------------------------------------------------- */

static bool route_has_method(const struct config_route *r, const char *method)
{
    bool found = false;
    size_t i;

    for (i = 0; !found && i < r->n_methods; i++)
        found = strcmp(r->methods[i], method) == 0;
    return found;
}

static bool route_matches_path(const struct config_route *r, const char *path, size_t path_len)
{
    size_t len = strlen(r->path);
    bool match;

    if (path_len < len || memcmp(path, r->path, len) != 0)
        match = false;
    else if (path_len == len)
        match = true;
    else if (r->match == CONFIG_MATCH_EXACT)
        match = false;
    else /* on a segment boundary: "/v1/pay" covers "/v1/pay/x", not "/v1/payx" */
        match = (len > 0 && r->path[len - 1] == '/') || path[len] == '/';
    return match;
}

const struct config_route *config_match_route(const struct config *cfg, const char *method,
                                              const char *path, size_t path_len)
{
    const struct config_route *found = NULL;
    size_t i;

    if (cfg != NULL && method != NULL && path != NULL) {
        for (i = 0; found == NULL && i < cfg->n_routes; i++) {
            if (route_has_method(&cfg->routes[i], method) &&
                route_matches_path(&cfg->routes[i], path, path_len))
                found = &cfg->routes[i];
        }
    }
    return found;
}
