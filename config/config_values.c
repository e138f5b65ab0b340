/*
 * config_values.c - the grammars of single configuration values: durations,
 * sizes, listen addresses, upstream URLs, HTTP tokens. Pure functions on C
 * strings; config.c turns their results into error messages.
 *
 * Numbers are decimal with no sign, no exponent and no white space, like a
 * JSON number without them: "1.5s" and "30" are accepted, "+1s", "1e3s",
 * ".5s", "5.s" and "1 s" are not. The arithmetic is integer only, so "0.1s"
 * is exactly 100 ms.
 */
#include "config_internal.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

struct unit {
    const char *suffix;
    uint64_t scale;
};

/* A bare number is seconds (CONTRACT.md section 4). */
static const struct unit duration_units[] = {
    {"ms", 1}, {"s", 1000}, {"m", 60000}, {"h", 3600000}, {"d", 86400000}, {"", 1000},
};

/* Binary units only: "1MB" would be ambiguous (10^6 or 2^20), so it is
 * rejected rather than guessed. A bare number is bytes. */
static const struct unit size_units[] = {
    {"B", 1}, {"KiB", CONFIG_KIB}, {"MiB", CONFIG_MIB}, {"GiB", CONFIG_GIB}, {"", 1},
};

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static bool is_alnum(char c)
{
    return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

static bool is_hex(char c)
{
    return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* floor(0.<digits> * scale) for the n fraction digits at p, exactly and
 * for any n: the digits are multiplied by scale from the last one to the
 * first, as on paper, and what carries out of the first is the whole part.
 * Each carry is below scale (9 * scale + carry < 10 * scale), so nothing
 * overflows. Truncating the digits first would be one unit short for
 * exact values: "0.0000003125d" is 27 ms, "1.0009765625KiB" 1025 bytes. */
static uint64_t scale_fraction(const char *p, size_t n, uint64_t scale)
{
    uint64_t carry = 0;

    while (n > 0) {
        n--;
        carry = ((uint64_t)(p[n] - '0') * scale + carry) / 10;
    }
    return carry;
}

/* "<digits>[.<digits>]<unit>" scaled by the unit and rounded down.
 * fraction_of_scale_1: whether a fraction of the smallest unit is allowed
 * (half a millisecond rounds down to 0; half a byte is a mistake). */
static enum config_scan scan_scaled(const char *s, const struct unit *units, size_t n_units,
                                    uint64_t max, bool fraction_of_scale_1, uint64_t *out)
{
    enum config_scan rc = CONFIG_SCAN_SYNTAX;
    const char *p = s;
    const struct unit *unit = NULL;
    uint64_t whole = 0;
    const char *frac = NULL;
    size_t frac_len = 0;
    uint64_t value;
    uint64_t frac_value;
    bool whole_overflow = false;
    bool has_fraction = false;
    size_t i;

    if (*p == '-') {
        /* Say "negative" only about something that is a number. */
        enum config_scan abs_rc =
            scan_scaled(p + 1, units, n_units, max, fraction_of_scale_1, &value);
        if (abs_rc == CONFIG_SCAN_OK || abs_rc == CONFIG_SCAN_RANGE)
            rc = CONFIG_SCAN_NEGATIVE;
        goto out;
    }
    if (!is_digit(*p))
        goto out;
    while (is_digit(*p)) {
        uint64_t d = (uint64_t)(*p - '0');
        if (whole > (UINT64_MAX - d) / 10)
            whole_overflow = true;
        else
            whole = whole * 10 + d;
        p++;
    }
    if (*p == '.') {
        p++;
        if (!is_digit(*p))
            goto out;
        has_fraction = true;
        frac = p;
        while (is_digit(*p))
            p++;
        frac_len = (size_t)(p - frac);
    }
    for (i = 0; i < n_units; i++) {
        if (strcmp(p, units[i].suffix) == 0) {
            unit = &units[i];
            break;
        }
    }
    if (unit == NULL)
        goto out;
    if (has_fraction && unit->scale == 1 && !fraction_of_scale_1)
        goto out;
    if (whole_overflow || whole > max / unit->scale) {
        rc = CONFIG_SCAN_RANGE;
        goto out;
    }
    value = whole * unit->scale;
    frac_value = has_fraction ? scale_fraction(frac, frac_len, unit->scale) : 0;
    if (frac_value > max - value) {
        rc = CONFIG_SCAN_RANGE;
        goto out;
    }
    *out = value + frac_value;
    rc = CONFIG_SCAN_OK;
out:
    return rc;
}

enum config_scan config_scan_duration(const char *s, int64_t *out_ms)
{
    uint64_t ms = 0;
    enum config_scan rc;

    rc = scan_scaled(s, duration_units, sizeof duration_units / sizeof duration_units[0],
                     (uint64_t)CONFIG_MAX_DURATION_MS, true, &ms);
    if (rc == CONFIG_SCAN_OK)
        *out_ms = (int64_t)ms;
    return rc;
}

enum config_scan config_scan_size(const char *s, uint64_t *out_bytes)
{
    return scan_scaled(s, size_units, sizeof size_units / sizeof size_units[0],
                       CONFIG_MAX_SIZE_BYTES, false, out_bytes);
}

void config_format_duration(int64_t ms, char *buf, size_t len)
{
    if (ms == 0)
        snprintf(buf, len, "0s");
    else if (ms % 3600000 == 0)
        snprintf(buf, len, "%" PRId64 "h", ms / 3600000);
    else if (ms % 60000 == 0)
        snprintf(buf, len, "%" PRId64 "m", ms / 60000);
    else if (ms % 1000 == 0)
        snprintf(buf, len, "%" PRId64 "s", ms / 1000);
    else
        snprintf(buf, len, "%" PRId64 "ms", ms);
}

bool config_format_size(uint64_t bytes, char *buf, size_t len)
{
    bool exact = true;

    if (bytes == 0)
        exact = false;
    else if (bytes % CONFIG_GIB == 0)
        snprintf(buf, len, "%" PRIu64 "GiB", bytes / CONFIG_GIB);
    else if (bytes % CONFIG_MIB == 0)
        snprintf(buf, len, "%" PRIu64 "MiB", bytes / CONFIG_MIB);
    else if (bytes % CONFIG_KIB == 0)
        snprintf(buf, len, "%" PRIu64 "KiB", bytes / CONFIG_KIB);
    else
        exact = false;
    return exact;
}

static enum config_addr scan_port(const char *p, size_t len)
{
    enum config_addr rc = CONFIG_ADDR_BAD_PORT;
    unsigned long port = 0;
    size_t i;

    if (len == 0)
        goto out;
    for (i = 0; i < len; i++) {
        if (!is_digit(p[i]))
            goto out;
        if (port <= 65535)
            port = port * 10 + (unsigned long)(p[i] - '0');
    }
    rc = port >= 1 && port <= 65535 ? CONFIG_ADDR_OK : CONFIG_ADDR_PORT_RANGE;
out:
    return rc;
}

/* host[:port] in s[0..len): a name or IPv4 address, or "[IPv6]". Names are
 * letters, digits, '-', '.', '_': enough for DNS names and addresses, and
 * nothing that could smuggle a path, userinfo or white space. */
/*
 * A host whose last label is a number is an IPv4 address (as URL parsers
 * read it), and it must then be written as four decimal octets without
 * leading zeros. getaddrinfo() and libcurl accept the old inet_aton() forms
 * too and read them otherwise: "010.0.0.1" as 8.0.0.1 (octal), "127.1",
 * "0x7f.0.0.1" and "2130706433" as 127.0.0.1. Another meaning than the one
 * written is refused rather than guessed.
 */
static bool ipv4_form_ok(const char *s, size_t len)
{
    size_t last = len;
    size_t i;
    unsigned octets = 0;

    while (last > 0 && s[last - 1] != '.')
        last--;
    if (last == len)
        return true; /* empty last label: not a number; other rules apply */
    i = last;
    if (len - last >= 2 && s[last] == '0' && (s[last + 1] == 'x' || s[last + 1] == 'X')) {
        for (i = last + 2; i < len && is_hex(s[i]); i++)
            ;
    } else {
        for (; i < len && is_digit(s[i]); i++)
            ;
    }
    if (i < len)
        return true; /* "1a", "example": a name label, not a number */
    /* A number: the whole host must be a dotted quad. */
    i = 0;
    while (i <= len) {
        size_t start = i;
        unsigned v = 0;
        while (i < len && is_digit(s[i])) {
            v = v * 10 + (unsigned)(s[i] - '0');
            if (v > 255)
                return false;
            i++;
        }
        if (i == start || (i - start > 1 && s[start] == '0'))
            return false;
        octets++;
        if (i == len)
            break;
        if (s[i] != '.')
            return false;
        i++;
    }
    return octets == 4;
}

/* An IPv6 address as inet_pton() reads it ("::1", "::ffff:1.2.3.4"). The
 * characters alone let "[:]" and "[::1::2]" through: check-config passed
 * them, then the listen address did not resolve at start, and an upstream
 * "did not resolve (yet)", every request 502, for as long as it ran. */
static bool ipv6_ok(const char *s, size_t len)
{
    char text[INET6_ADDRSTRLEN];
    struct in6_addr addr;

    if (len >= sizeof text)
        return false;
    memcpy(text, s, len);
    text[len] = '\0';
    return inet_pton(AF_INET6, text, &addr) == 1;
}

static enum config_addr scan_host_port(const char *s, size_t len, bool host_required,
                                       bool port_required)
{
    enum config_addr rc = CONFIG_ADDR_BAD_HOST;
    const char *port = NULL;
    size_t port_len = 0;
    size_t host_len;
    size_t i;

    if (len > 0 && s[0] == '[') {
        const char *close = memchr(s, ']', len);
        bool has_colon = false;
        if (close == NULL)
            goto out;
        host_len = (size_t)(close - s) - 1;
        for (i = 1; i <= host_len; i++) {
            if (!is_hex(s[i]) && s[i] != ':' && s[i] != '.')
                goto out;
            has_colon = has_colon || s[i] == ':';
        }
        if (!has_colon || !ipv6_ok(s + 1, host_len))
            goto out;
        i = host_len + 2; /* just past ']' */
        if (i < len) {
            if (s[i] != ':')
                goto out;
            port = s + i + 1;
            port_len = len - i - 1;
        }
    } else {
        const char *colon = memchr(s, ':', len);
        host_len = colon != NULL ? (size_t)(colon - s) : len;
        for (i = 0; i < host_len; i++) {
            if (!is_alnum(s[i]) && s[i] != '-' && s[i] != '.' && s[i] != '_')
                goto out;
        }
        if (host_len == 0 && host_required)
            goto out;
        if (!ipv4_form_ok(s, host_len)) {
            rc = CONFIG_ADDR_BAD_IPV4;
            goto out;
        }
        if (colon != NULL) {
            port = colon + 1;
            port_len = len - host_len - 1;
        }
    }
    if (port == NULL)
        rc = port_required ? CONFIG_ADDR_BAD_PORT : CONFIG_ADDR_OK;
    else
        rc = scan_port(port, port_len);
out:
    return rc;
}

enum config_addr config_scan_listen(const char *s)
{
    return scan_host_port(s, strlen(s), false, true);
}

enum config_addr config_scan_url(const char *s)
{
    enum config_addr rc = CONFIG_ADDR_NOT_HTTP;
    const char *authority;
    size_t authority_len;

    /* The scheme is case-insensitive (RFC 3986 section 3.1): "HTTP://". */
    if (!config_is_visible_ascii(s) || strncasecmp(s, "http://", 7) != 0)
        goto out;
    /* The proxy appends the request's path and query to the base URL; a
     * query or fragment of its own would make that ambiguous. */
    rc = CONFIG_ADDR_QUERY;
    if (strpbrk(s, "?#") != NULL)
        goto out;
    authority = s + 7;
    authority_len = strcspn(authority, "/");
    rc = CONFIG_ADDR_NO_HOST;
    if (authority_len == 0)
        goto out;
    /* Userinfo ("user:pw@host") would otherwise read as a bad port. */
    rc = CONFIG_ADDR_BAD_HOST;
    if (memchr(authority, '@', authority_len) != NULL)
        goto out;
    rc = scan_host_port(authority, authority_len, true, false);
out:
    return rc;
}

bool config_is_token(const char *s)
{
    bool ok = *s != '\0';

    for (; ok && *s != '\0'; s++)
        ok = is_alnum(*s) || strchr("!#$%&'*+-.^_`|~", *s) != NULL;
    return ok;
}

bool config_is_visible_ascii(const char *s)
{
    bool ok = *s != '\0';

    for (; ok && *s != '\0'; s++)
        ok = *s >= 0x21 && *s <= 0x7e;
    return ok;
}

void config_quote(const char *s, char *buf, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    const size_t max_source = 64;
    size_t used = 0;
    size_t i;

    if (len < 16) {
        /* Too small to say anything useful; callers pass much more. */
        if (len > 0)
            buf[0] = '\0';
        goto out;
    }
    buf[used++] = '"';
    /* Room for the longest escape (6), the closing quote, "..." and NUL. */
    for (i = 0; s[i] != '\0' && i < max_source && used + 11 < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            buf[used++] = '\\';
            buf[used++] = (char)c;
        } else if (c < 0x20 || c == 0x7f) {
            memcpy(buf + used, "\\u00", 4);
            buf[used + 4] = hex[c >> 4];
            buf[used + 5] = hex[c & 0xf];
            used += 6;
        } else {
            buf[used++] = (char)c;
        }
    }
    buf[used++] = '"';
    if (s[i] != '\0') {
        memcpy(buf + used, "...", 3);
        used += 3;
    }
    buf[used] = '\0';
out:
    return;
}

bool config_is_utf8(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    bool ok = true;

    /* RFC 3629 section 4: no overlong forms, no surrogates, at most U+10FFFF. */
    while (ok && *p != '\0') {
        size_t n = 0;
        unsigned long cp = 0;
        size_t i;
        if (p[0] < 0x80) {
            p++;
            continue;
        }
        if (p[0] >= 0xc2 && p[0] <= 0xdf) {
            n = 1;
            cp = p[0] & 0x1fu;
        } else if (p[0] >= 0xe0 && p[0] <= 0xef) {
            n = 2;
            cp = p[0] & 0x0fu;
        } else if (p[0] >= 0xf0 && p[0] <= 0xf4) {
            n = 3;
            cp = p[0] & 0x07u;
        } else {
            ok = false;
        }
        for (i = 1; ok && i <= n; i++) {
            ok = (p[i] & 0xc0u) == 0x80;
            cp = (cp << 6) | (p[i] & 0x3fu);
        }
        if (ok && n == 2)
            ok = cp >= 0x800 && (cp < 0xd800 || cp > 0xdfff);
        if (ok && n == 3)
            ok = cp >= 0x10000 && cp <= 0x10ffff;
        p += n + 1;
    }
    return ok;
}
