/*
 * fuzz_config.c - the configuration loader on arbitrary text.
 *
 * Invariants:
 *   - config_load_string() either fails with CONFIG_EINVAL (or ENOMEM)
 *     and one NUL-terminated line in err (config.h: "writes one line to err
 *     that names the field"), leaving *out NULL, or succeeds;
 *   - what loads dumps (config_dump), the dump loads again, and the second
 *     dump is the same text: `idemproxy check-config` output is a valid,
 *     stable configuration;
 *   - every loaded route is usable by the policy: a scope no longer than
 *     CONFIG_MAX_SCOPE_LENGTH, heartbeat below lease, and route matching
 *     never fails on odd paths.
 */
#include "fuzz.h"

#include <string.h>

#include "config.h"

static void check_error_text(const char *err, size_t cap)
{
    size_t len = strnlen(err, cap);
    FUZZ_CHECK(len < cap);
    FUZZ_CHECK(len > 0);
    FUZZ_CHECK(strchr(err, '\n') == NULL);
}

static void check_routes(const struct config *cfg)
{
    static const char *const paths[] = {"/", "/v1/payments", "/v1/payments/x", "", "//", "/%00"};
    static const char *const methods[] = {"POST", "GET", "PATCH", "post"};

    FUZZ_CHECK(cfg->n_routes >= 1 && cfg->routes != NULL);
    for (size_t i = 0; i < cfg->n_routes; i++) {
        const struct config_route *r = &cfg->routes[i];
        FUZZ_CHECK(r->path != NULL && r->scope != NULL);
        FUZZ_CHECK(strlen(r->scope) >= 1 && strlen(r->scope) <= CONFIG_MAX_SCOPE_LENGTH);
        FUZZ_CHECK(r->heartbeat_ms < r->lease_ms);
        FUZZ_CHECK(r->max_key_length >= 1);
    }
    for (size_t p = 0; p < sizeof(paths) / sizeof(paths[0]); p++)
        for (size_t m = 0; m < sizeof(methods) / sizeof(methods[0]); m++)
            (void)config_match_route(cfg, methods[m], paths[p], strlen(paths[p]));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512];
    struct config *cfg = NULL;
    struct config *again = NULL;
    char *dump = NULL;
    char *dump2 = NULL;
    int rc;

    memset(err, 0, sizeof(err));
    rc = config_load_string((const char *)data, size, &cfg, err, sizeof(err));
    if (rc != CONFIG_OK) {
        FUZZ_CHECK(rc == CONFIG_EINVAL || rc == CONFIG_ENOMEM);
        FUZZ_CHECK(cfg == NULL);
        check_error_text(err, sizeof(err));
        return 0;
    }
    FUZZ_CHECK(cfg != NULL);
    check_routes(cfg);

    dump = config_dump(cfg);
    FUZZ_CHECK(dump != NULL);
    memset(err, 0, sizeof(err));
    rc = config_load_string(dump, strlen(dump), &again, err, sizeof(err));
    if (rc != CONFIG_OK)
        fprintf(stderr, "the dump does not load: %s\n%s\n", err, dump);
    FUZZ_CHECK(rc == CONFIG_OK);
    dump2 = config_dump(again);
    FUZZ_CHECK(dump2 != NULL);
    if (strcmp(dump, dump2) != 0)
        fprintf(stderr, "first dump:\n%s\nsecond dump:\n%s\n", dump, dump2);
    FUZZ_CHECK(strcmp(dump, dump2) == 0);
    check_routes(again);

    free(dump2);
    free(dump);
    config_free(again);
    config_free(cfg);
    return 0;
}
