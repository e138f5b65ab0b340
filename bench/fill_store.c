/*
 * fill_store.c - pre-fills an idemproxy store with N COMPLETE records, fast,
 * for the benchmark's store-scale legs (bench/run).
 *
 *   fill_store --store DIR --count N [--ttl-ms MS] [--map-size BYTES]
 *              [--scope NAME] [--batch N] [--prefix STR]
 *
 * It goes through the real store API (store.h, linked against idem_store),
 * so the records, the expiry index and the on-disk format are exactly those
 * the proxy writes: per batch, one store_apply() of N acquires, then one of N
 * completes with the lease ids the acquires returned. The store is opened
 * without per-commit sync and synced once at the end (a bulk load, not the
 * proxy's durability path). Keys are store_key_derive(scope, "<prefix>-<i>"),
 * payloads look like a small upstream answer (201, a few headers, JSON body).
 * With a short --ttl-ms the records expire right after the fill, which is
 * how the purge leg gets 1,000,000 expired records.
 *
 * Prints "filled N records in S s (R records/s)" and exits 0, or 1 on error.
 * Run it only while no proxy has the store open (the bench does).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The proxy's stored header encoding (policy.h idem_headers_encode):
 * for each header u32le name_len, name, u32le value_len, value. */
static size_t put_header(uint8_t *p, const char *name, const char *value)
{
    uint32_t nl = (uint32_t)strlen(name), vl = (uint32_t)strlen(value);
    size_t o = 0;
    for (int i = 0; i < 4; i++)
        p[o++] = (uint8_t)(nl >> (8 * i));
    memcpy(p + o, name, nl);
    o += nl;
    for (int i = 0; i < 4; i++)
        p[o++] = (uint8_t)(vl >> (8 * i));
    memcpy(p + o, value, vl);
    return o + vl;
}

static int by_key(const void *a, const void *b)
{
    return memcmp(((const struct store_op *)a)->key, ((const struct store_op *)b)->key,
                  STORE_KEY_BYTES);
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *scope = "bench", *prefix = "fill";
    unsigned long long count = 0, map_size = 4ULL << 30;
    long long ttl_ms = 24LL * 3600 * 1000;
    size_t batch = 20000;
    struct store *st = NULL;
    struct store_op *ops = NULL;
    char err[256];
    static const char body[] = "{\"id\":\"pay_bench\",\"status\":\"created\",\"amount\":100}";
    uint8_t headers[256];
    size_t headers_len = 0;
    double t0;
    unsigned long long done = 0;
    int rc = 1;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            goto usage;
        if (strcmp(a, "--store") == 0)
            dir = v;
        else if (strcmp(a, "--count") == 0)
            count = strtoull(v, NULL, 10);
        else if (strcmp(a, "--ttl-ms") == 0)
            ttl_ms = strtoll(v, NULL, 10);
        else if (strcmp(a, "--map-size") == 0)
            map_size = strtoull(v, NULL, 10);
        else if (strcmp(a, "--scope") == 0)
            scope = v;
        else if (strcmp(a, "--prefix") == 0)
            prefix = v;
        else if (strcmp(a, "--batch") == 0)
            batch = (size_t)strtoull(v, NULL, 10);
        else
            goto usage;
        i++;
    }
    if (dir == NULL || count == 0 || batch == 0 || ttl_ms <= 0)
        goto usage;

    headers_len += put_header(headers + headers_len, "Content-Type", "application/json");
    headers_len += put_header(headers + headers_len, "Server", "nginx/1.22.1");
    headers_len += put_header(headers + headers_len, "Date", "Wed, 02 Dec 2026 13:00:00 GMT");

    {
        struct store_options so = {
            .path = dir, .map_size_bytes = map_size, .sync = false, .clock = NULL};
        if (store_open(NULL, &so, &st, err, sizeof(err)) != 0) {
            fprintf(stderr, "fill_store: %s: %s\n", dir, err);
            return 1;
        }
    }
    ops = calloc(batch, sizeof(*ops));
    if (ops == NULL) {
        fprintf(stderr, "fill_store: out of memory\n");
        goto out;
    }
    t0 = now_s();
    while (done < count) {
        size_t n = count - done < batch ? (size_t)(count - done) : batch;
        for (size_t i = 0; i < n; i++) {
            char key[96];
            int kl = snprintf(key, sizeof(key), "%s-%llu", prefix, done + i);
            struct store_op *op = &ops[i];
            memset(op, 0, sizeof(*op));
            op->kind = STORE_OP_ACQUIRE;
            store_key_derive(scope, strlen(scope), key, (size_t)kl, op->key);
            /* Any 32 bytes will do as a fingerprint: derive them from the key. */
            store_key_derive("fp", 2, key, (size_t)kl, op->fingerprint);
            op->lease_ms = 30000;
            op->ttl_ms = ttl_ms;
        }
        /* In key order: LMDB appends to fewer, hotter pages. */
        qsort(ops, n, sizeof(*ops), by_key);
        if (store_apply(st, ops, n) != 0) {
            fprintf(stderr, "fill_store: acquire batch failed\n");
            goto out;
        }
        for (size_t i = 0; i < n; i++) {
            struct store_op *op = &ops[i];
            if (op->outcome != STORE_ACQUIRED) {
                fprintf(stderr, "fill_store: acquire gave %s (key exists?)\n",
                        store_outcome_name(op->outcome));
                goto out;
            }
            op->kind = STORE_OP_COMPLETE; /* key and lease_id as acquired */
            op->status = 201;
            op->ttl_ms = ttl_ms;
            op->headers.ptr = headers;
            op->headers.len = headers_len;
            op->body.ptr = body;
            op->body.len = sizeof(body) - 1;
            op->stolen = false;
        }
        if (store_apply(st, ops, n) != 0) {
            fprintf(stderr, "fill_store: complete batch failed\n");
            goto out;
        }
        for (size_t i = 0; i < n; i++) {
            if (ops[i].outcome != STORE_DONE) {
                fprintf(stderr, "fill_store: complete gave %s\n",
                        store_outcome_name(ops[i].outcome));
                goto out;
            }
        }
        done += n;
    }
    if (store_sync(st) != 0) {
        fprintf(stderr, "fill_store: sync failed\n");
        goto out;
    }
    {
        double dt = now_s() - t0;
        printf("filled %llu records in %.2f s (%.0f records/s)\n", done, dt,
               dt > 0 ? (double)done / dt : 0.0);
    }
    rc = 0;
out:
    free(ops);
    store_close(st);
    return rc;
usage:
    fprintf(stderr, "usage: fill_store --store DIR --count N [--ttl-ms MS] [--map-size BYTES]\n"
                    "                  [--scope NAME] [--batch N] [--prefix STR]\n");
    return 2;
}
