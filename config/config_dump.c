/*
 * config_dump.c - the effective configuration as JSON, for
 * `idemproxy check-config`. Every default is spelled out, in the order of
 * the contract's example, and in a form config_load_string() accepts, so
 * a dump loads back to the same configuration. The text has no trailing
 * newline.
 */
#include "config.h"
#include "config_internal.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* json_object_set_new() and json_array_append_new() take ownership of v
 * even when they fail, and fail on a NULL v (an earlier allocation that
 * failed), so one flag collects every failure. */
static void put(json_t *obj, const char *key, json_t *v, bool *ok)
{
    if (json_object_set_new(obj, key, v) != 0)
        *ok = false;
}

static void append(json_t *arr, json_t *v, bool *ok)
{
    if (json_array_append_new(arr, v) != 0)
        *ok = false;
}

static json_t *nullable_string(const char *s)
{
    return s != NULL ? json_string(s) : json_null();
}

static json_t *duration(int64_t ms)
{
    char buf[32];

    config_format_duration(ms, buf, sizeof buf);
    return json_string(buf);
}

static json_t *size(uint64_t bytes)
{
    char buf[32];

    return config_format_size(bytes, buf, sizeof buf) ? json_string(buf)
                                                      : json_integer((json_int_t)bytes);
}

static json_t *strings(char *const *list, size_t n)
{
    json_t *arr = json_array();
    bool ok = arr != NULL;
    size_t i;

    for (i = 0; ok && i < n; i++)
        append(arr, json_string(list[i]), &ok);
    if (!ok) {
        json_decref(arr);
        arr = NULL;
    }
    return arr;
}

/* A whole class as "5xx", other statuses as numbers, in ascending order:
 * the default reads ["5xx"], and [409, "5xx"] says what it means. */
static json_t *release_on(const bool *set)
{
    json_t *arr = json_array();
    bool ok = arr != NULL;
    char name[4] = "5xx";
    int cls;
    int status;

    for (cls = 1; ok && cls <= 5; cls++) {
        bool all = true;
        for (status = cls * 100; status < cls * 100 + 100; status++)
            all = all && set[status];
        if (all) {
            name[0] = (char)('0' + cls);
            append(arr, json_string(name), &ok);
            continue;
        }
        for (status = cls * 100; ok && status < cls * 100 + 100; status++) {
            if (set[status])
                append(arr, json_integer(status), &ok);
        }
    }
    if (!ok) {
        json_decref(arr);
        arr = NULL;
    }
    return arr;
}

static json_t *route(const struct config_route *r)
{
    json_t *o = json_object();
    bool ok = o != NULL;

    if (ok) {
        put(o, "path", nullable_string(r->path), &ok);
        put(o, "match", json_string(r->match == CONFIG_MATCH_EXACT ? "exact" : "prefix"), &ok);
        put(o, "methods", strings(r->methods, r->n_methods), &ok);
        put(o, "scope", nullable_string(r->scope), &ok);
        put(o, "scope_header", nullable_string(r->scope_header), &ok);
        put(o, "ttl", duration(r->ttl_ms), &ok);
        put(o, "lease", duration(r->lease_ms), &ok);
        put(o, "heartbeat", duration(r->heartbeat_ms), &ok);
        put(o, "wait", duration(r->wait_ms), &ok);
        put(o, "require_key", json_boolean(r->require_key), &ok);
        put(o, "fingerprint",
            json_string(r->fingerprint == CONFIG_FINGERPRINT_RAW ? "raw" : "auto"), &ok);
        put(o, "max_body", size(r->max_body_bytes), &ok);
        put(o, "max_key_length", json_integer((json_int_t)r->max_key_length), &ok);
        put(o, "release_on", release_on(r->release_on), &ok);
        put(o, "on_unknown",
            json_string(r->on_unknown == CONFIG_ON_UNKNOWN_COMPLETE ? "complete" : "release"), &ok);
        put(o, "strip_headers", strings(r->strip_headers, r->n_strip_headers), &ok);
    }
    if (!ok) {
        json_decref(o);
        o = NULL;
    }
    return o;
}

static json_t *document(const struct config *cfg)
{
    json_t *root = json_object();
    json_t *up = json_object();
    json_t *st = json_object();
    json_t *sv = json_object();
    json_t *routes = json_array();
    bool ok = true;
    size_t i;

    /* Each put() takes its value, so each container is handed over once,
     * failures included. */
    if (root == NULL) {
        json_decref(up);
        json_decref(st);
        json_decref(sv);
        json_decref(routes);
        goto out;
    }
    put(root, "listen", nullable_string(cfg->listen), &ok);

    /* No "url" until one is set: config_load_* accepts that, and the url
     * may still come from --upstream. */
    if (up != NULL && cfg->upstream.url != NULL)
        put(up, "url", json_string(cfg->upstream.url), &ok);
    if (up != NULL) {
        put(up, "connect_timeout", duration(cfg->upstream.connect_timeout_ms), &ok);
        put(up, "timeout", duration(cfg->upstream.timeout_ms), &ok);
        put(up, "resolve_interval", duration(cfg->upstream.resolve_interval_ms), &ok);
        put(up, "idle_timeout", duration(cfg->upstream.idle_timeout_ms), &ok);
        put(up, "max_response", size(cfg->upstream.max_response_bytes), &ok);
        put(up, "client",
            json_string(cfg->upstream.client == CONFIG_UPSTREAM_NATIVE ? "native" : "libcurl"),
            &ok);
    }
    put(root, "upstream", up, &ok);

    if (st != NULL) {
        put(st, "path", nullable_string(cfg->store.path), &ok);
        put(st, "map_size", size(cfg->store.map_size_bytes), &ok);
        put(st, "durability",
            json_string(cfg->store.durability == CONFIG_DURABILITY_INTERVAL ? "interval" : "sync"),
            &ok);
        put(st, "sync_interval", duration(cfg->store.sync_interval_ms), &ok);
        put(st, "purge_interval", duration(cfg->store.purge_interval_ms), &ok);
        put(st, "require_local_fs", json_boolean(cfg->store.require_local_fs), &ok);
    }
    put(root, "store", st, &ok);

    if (sv != NULL) {
        put(sv, "workers", json_integer(cfg->server.workers), &ok);
        put(sv, "max_connections", json_integer(cfg->server.max_connections), &ok);
        put(sv, "per_ip_connections", json_integer(cfg->server.per_ip_connections), &ok);
        put(sv, "client_timeout", duration(cfg->server.client_timeout_ms), &ok);
        put(sv, "header_memory", size(cfg->server.header_memory_bytes), &ok);
        put(sv, "max_buffered",
            cfg->server.max_buffered_bytes ? size(cfg->server.max_buffered_bytes)
                                           : json_string("auto"),
            &ok);
        put(sv, "drain_timeout", duration(cfg->server.drain_timeout_ms), &ok);
    }
    put(root, "server", sv, &ok);

    put(root, "access_log", json_boolean(cfg->access_log), &ok);

    for (i = 0; routes != NULL && i < cfg->n_routes; i++)
        append(routes, route(&cfg->routes[i]), &ok);
    put(root, "routes", routes, &ok);
out:
    if (!ok) {
        json_decref(root);
        root = NULL;
    }
    return root;
}

/* A growing output buffer; ok turns false on the first failed allocation. */
struct text {
    char *buf;
    size_t len;
    size_t cap;
    bool ok;
};

static char *reserve(struct text *t, size_t n)
{
    char *grown;
    size_t cap;

    if (t->ok && t->cap - t->len <= n) {
        cap = t->cap > 0 ? t->cap : 4096;
        while (cap - t->len <= n && cap < SIZE_MAX / 2)
            cap *= 2;
        grown = cap - t->len > n ? realloc(t->buf, cap) : NULL;
        if (grown == NULL) {
            t->ok = false;
        } else {
            t->buf = grown;
            t->cap = cap;
        }
    }
    return t->ok ? t->buf + t->len : NULL;
}

static void emit(struct text *t, const char *s)
{
    size_t n = strlen(s);
    char *p = reserve(t, n);

    if (p != NULL) {
        memcpy(p, s, n + 1);
        t->len += n;
    }
}

static void emit_indent(struct text *t, size_t depth)
{
    size_t i;

    for (i = 0; i < depth; i++)
        emit(t, "  ");
}

static void emit_scalar(struct text *t, const json_t *v)
{
    size_t n = json_dumpb(v, NULL, 0, JSON_ENCODE_ANY);
    char *p = n > 0 ? reserve(t, n) : NULL;

    if (n == 0)
        t->ok = false;
    if (p != NULL && json_dumpb(v, p, n, JSON_ENCODE_ANY) == n) {
        p[n] = '\0';
        t->len += n;
    } else {
        t->ok = false;
    }
}

static bool only_scalars(const json_t *arr)
{
    bool scalars = true;
    size_t i;

    for (i = 0; scalars && i < json_array_size(arr); i++)
        scalars = !json_is_object(json_array_get(arr, i)) && !json_is_array(json_array_get(arr, i));
    return scalars;
}

/* jansson's JSON_INDENT puts every array element on a line of its own;
 * here a list of scalars stays on one line (["POST", "PATCH"], ["5xx"]),
 * as in the contract's example, and only objects and lists of objects
 * are spread over lines. */
static void emit_value(struct text *t, json_t *v, size_t depth)
{
    const char *key;
    json_t *val;
    size_t i;
    size_t n;

    if (json_is_object(v) && json_object_size(v) > 0) {
        emit(t, "{\n");
        n = 0;
        json_object_foreach(v, key, val)
        {
            json_t *name = json_string(key);
            emit_indent(t, depth + 1);
            if (name == NULL)
                t->ok = false;
            else
                emit_scalar(t, name);
            json_decref(name);
            emit(t, ": ");
            emit_value(t, val, depth + 1);
            emit(t, ++n < json_object_size(v) ? ",\n" : "\n");
        }
        emit_indent(t, depth);
        emit(t, "}");
    } else if (json_is_array(v) && json_array_size(v) > 0 && !only_scalars(v)) {
        emit(t, "[\n");
        for (i = 0; i < json_array_size(v); i++) {
            emit_indent(t, depth + 1);
            emit_value(t, json_array_get(v, i), depth + 1);
            emit(t, i + 1 < json_array_size(v) ? ",\n" : "\n");
        }
        emit_indent(t, depth);
        emit(t, "]");
    } else if (json_is_array(v)) {
        emit(t, "[");
        for (i = 0; i < json_array_size(v); i++) {
            if (i > 0)
                emit(t, ", ");
            emit_scalar(t, json_array_get(v, i));
        }
        emit(t, "]");
    } else if (json_is_object(v)) {
        emit(t, "{}");
    } else {
        emit_scalar(t, v);
    }
}

char *config_dump(const struct config *cfg)
{
    struct text t = {NULL, 0, 0, true};
    json_t *root = NULL;

    if (cfg == NULL)
        goto out;
    root = document(cfg);
    if (root == NULL)
        goto out;
    emit_value(&t, root, 0);
out:
    if (root == NULL || !t.ok) {
        free(t.buf);
        t.buf = NULL;
    }
    json_decref(root);
    return t.buf;
}
