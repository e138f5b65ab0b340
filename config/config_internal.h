/*
 * config_internal.h - what config.c and config_dump.c share: the value
 * grammars (durations, sizes, host:port, URLs, tokens) of config_values.c.
 * Not part of the module's API; nothing outside config/ includes it.
 *
 * The scanners only read their input and never allocate, so they are
 * thread-safe.
 */
#ifndef IDEM_CONFIG_INTERNAL_H
#define IDEM_CONFIG_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* 100 years. A bound far above any sensible TTL that keeps now + ttl far
 * from overflowing an int64_t of milliseconds in the store and the proxy. */
#define CONFIG_MAX_DURATION_MS ((int64_t)36500 * 86400 * 1000)
/* Sizes fit a JSON integer (jansson's json_int_t is long long), so the dump
 * of any accepted size loads back. */
#define CONFIG_MAX_SIZE_BYTES ((uint64_t)INT64_MAX)

#define CONFIG_KIB ((uint64_t)1024)
#define CONFIG_MIB (CONFIG_KIB * 1024)
#define CONFIG_GIB (CONFIG_MIB * 1024)

enum config_scan {
    CONFIG_SCAN_OK = 0,
    CONFIG_SCAN_SYNTAX,   /* not of the grammar at all */
    CONFIG_SCAN_NEGATIVE, /* a well-formed number with a minus sign */
    CONFIG_SCAN_RANGE,    /* well-formed but too large */
};

/* "250ms", "1.5s", "24h", "7d", "30" (seconds); rounded down to whole ms. */
enum config_scan config_scan_duration(const char *s, int64_t *out_ms);
/* "512", "512B", "32KiB", "1.5MiB", "1GiB"; fractions need a binary unit
 * and are rounded down to whole bytes. */
enum config_scan config_scan_size(const char *s, uint64_t *out_bytes);

/* The largest exact unit of h, m, s, ms ("24h", "90m", "15s", "250ms").
 * Days are never used so the default TTL reads "24h" as in the contract. */
void config_format_duration(int64_t ms, char *buf, size_t len);
/* The largest exact unit of GiB, MiB, KiB; false (buf untouched) when no
 * unit divides bytes exactly or bytes is 0: the dump then writes a plain
 * number of bytes. */
bool config_format_size(uint64_t bytes, char *buf, size_t len);

enum config_addr {
    CONFIG_ADDR_OK = 0,
    CONFIG_ADDR_NOT_HTTP,   /* URL: no "http://" scheme, or a blank/control byte */
    CONFIG_ADDR_QUERY,      /* URL: has a query or a fragment */
    CONFIG_ADDR_NO_HOST,    /* URL: empty authority */
    CONFIG_ADDR_BAD_HOST,   /* host part malformed (or missing ":port" for listen) */
    CONFIG_ADDR_BAD_PORT,   /* port not a number */
    CONFIG_ADDR_PORT_RANGE, /* port a number outside 1..65535 */
    CONFIG_ADDR_BAD_IPV4,   /* a numeric host that is not a plain dotted quad */
};

/* listen: "host:port", "[v6]:port" or ":port". */
enum config_addr config_scan_listen(const char *s);
/* upstream: "http://host[:port][/base]". */
enum config_addr config_scan_url(const char *s);

/* RFC 9110 section 5.6.2 token (methods and header names); non-empty. */
bool config_is_token(const char *s);
/* Every byte in 0x21..0x7e, and at least one byte. */
bool config_is_visible_ascii(const char *s);

/* Well-formed UTF-8 (RFC 3629): what a JSON string may hold, so anything
 * that reaches config_dump() from the command line must pass it. */
bool config_is_utf8(const char *s);

/* s as a JSON string literal for an error message: quoted, escaped, and cut
 * to about 64 bytes with "..." so an error stays one short line. */
void config_quote(const char *s, char *buf, size_t len);

#endif
