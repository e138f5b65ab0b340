/*
 * policy.c - pure decisions and encodings of the proxy (see policy.h).
 */
#include "policy.h"
#include "canonical_json.h"
#include "store_sha256.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- header lists ---------------------------------------------------- */

/* String storage of a header list: blocks of at least HEADER_BLOCK_BYTES,
 * filled front to back, freed together by idem_headers_clear. */
#define HEADER_BLOCK_BYTES 1024

struct idem_header_block {
    struct idem_header_block *next;
    size_t used;
    size_t cap;
    char data[];
};

static char *header_bytes(struct idem_headers *h, size_t need)
{
    struct idem_header_block *b = h->blocks;
    char *p;

    if (b == NULL || b->cap - b->used < need) {
        size_t cap = b != NULL ? b->cap * 2 : HEADER_BLOCK_BYTES;
        if (cap < need)
            cap = need;
        b = malloc(sizeof(*b) + cap);
        if (b == NULL)
            return NULL;
        b->used = 0;
        b->cap = cap;
        b->next = h->blocks;
        h->blocks = b;
    }
    p = b->data + b->used;
    b->used += need;
    return p;
}

int idem_headers_push(struct idem_headers *h, const char *name, size_t name_len,
                      const char *value, size_t value_len)
{
    char *n;

    if (name_len > SIZE_MAX / 2 - 2 || value_len > SIZE_MAX / 2)
        return -1;
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 16;
        struct idem_header *nv = realloc(h->v, cap * sizeof(*nv));
        if (nv == NULL)
            return -1;
        h->v = nv;
        h->cap = cap;
    }
    n = header_bytes(h, name_len + value_len + 2);
    if (n == NULL)
        return -1;
    memcpy(n, name, name_len);
    n[name_len] = '\0';
    if (value_len > 0)
        memcpy(n + name_len + 1, value, value_len);
    n[name_len + 1 + value_len] = '\0';
    h->v[h->n].name = n;
    h->v[h->n].name_len = name_len;
    h->v[h->n].value = n + name_len + 1;
    h->v[h->n].value_len = value_len;
    h->n++;
    h->bytes += name_len + value_len;
    return 0;
}

int idem_headers_extend_last(struct idem_headers *h, const char *more, size_t more_len)
{
    struct idem_header *last;
    char *v;

    if (h->n == 0 || more_len > SIZE_MAX / 4)
        return -1;
    last = &h->v[h->n - 1];
    if (last->value_len > SIZE_MAX / 4)
        return -1;
    v = header_bytes(h, last->value_len + 1 + more_len + 1);
    if (v == NULL)
        return -1;
    memcpy(v, last->value, last->value_len);
    v[last->value_len] = ' ';
    memcpy(v + last->value_len + 1, more, more_len);
    v[last->value_len + 1 + more_len] = '\0';
    last->value = v;
    last->value_len += 1 + more_len;
    h->bytes += 1 + more_len;
    return 0;
}

void idem_headers_clear(struct idem_headers *h)
{
    struct idem_header_block *b = h->blocks;
    while (b != NULL) {
        struct idem_header_block *next = b->next;
        free(b);
        b = next;
    }
    free(h->v);
    memset(h, 0, sizeof(*h));
}

/* Whether a header's name is name (len bytes), ignoring case. The length
 * first: most names differ in it, and every request's head is searched for
 * a dozen names (on_headers, the forwarding filter). */
static bool name_is(const char *name, size_t name_len, const char *lit, size_t len)
{
    return name_len == len && strncasecmp(name, lit, len) == 0;
}

static bool named(const struct idem_header *h, const char *name, size_t len)
{
    return name_is(h->name, h->name_len, name, len);
}

const struct idem_header *idem_headers_find(const struct idem_headers *h, const char *name)
{
    size_t len = strlen(name);
    for (size_t i = 0; i < h->n; i++)
        if (named(&h->v[i], name, len))
            return &h->v[i];
    return NULL;
}

size_t idem_headers_count(const struct idem_headers *h, const char *name)
{
    size_t len = strlen(name);
    size_t count = 0;
    for (size_t i = 0; i < h->n; i++)
        if (named(&h->v[i], name, len))
            count++;
    return count;
}

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int idem_headers_encode(const struct idem_headers *h, uint8_t **out, size_t *out_len)
{
    size_t len = 0;
    uint8_t *buf = NULL;
    uint8_t *p;

    *out = NULL;
    *out_len = 0;
    for (size_t i = 0; i < h->n; i++) {
        if (h->v[i].name_len > UINT32_MAX || h->v[i].value_len > UINT32_MAX)
            return -1;
        len += 8 + h->v[i].name_len + h->v[i].value_len;
    }
    if (len == 0)
        return 0;
    buf = malloc(len);
    if (buf == NULL)
        return -1;
    p = buf;
    for (size_t i = 0; i < h->n; i++) {
        put_u32(p, (uint32_t)h->v[i].name_len);
        memcpy(p + 4, h->v[i].name, h->v[i].name_len);
        p += 4 + h->v[i].name_len;
        put_u32(p, (uint32_t)h->v[i].value_len);
        memcpy(p + 4, h->v[i].value, h->v[i].value_len);
        p += 4 + h->v[i].value_len;
    }
    *out = buf;
    *out_len = len;
    return 0;
}

int idem_headers_decode(const void *buf, size_t len, struct idem_headers *out)
{
    const uint8_t *p = buf;
    size_t off = 0;

    while (off < len) {
        uint32_t nl, vl;
        const uint8_t *name;
        if (len - off < 4)
            return -1;
        nl = get_u32(p + off);
        off += 4;
        if (nl == 0 || len - off < nl)
            return -1;
        name = p + off;
        off += nl;
        if (len - off < 4)
            return -1;
        vl = get_u32(p + off);
        off += 4;
        if (len - off < vl)
            return -1;
        if (memchr(name, '\0', nl) != NULL || memchr(p + off, '\0', vl) != NULL)
            return -1;
        if (idem_headers_push(out, (const char *)name, nl, (const char *)(p + off), vl) != 0)
            return -2;
        off += vl;
    }
    return 0;
}

/* ---- Idempotency-Key ----------------------------------------------- */

enum idem_key_status idem_key_parse(const char *raw, size_t raw_len, size_t max_len, char *out,
                                    size_t *out_len)
{
    size_t n = 0;

    *out_len = 0;
    if (raw_len == 0)
        return IDEM_KEY_EMPTY;
    if (raw[0] == '"') {
        /* RFC 8941 section 3.3.3: sf-string = DQUOTE *chr DQUOTE, where
         * chr is a printable ASCII char other than \ and ", or \" or \\. */
        size_t i = 1;
        for (;;) {
            unsigned char c;
            if (i >= raw_len)
                return IDEM_KEY_BAD_QUOTING;
            c = (unsigned char)raw[i];
            if (c == '"') {
                i++;
                break;
            }
            if (c == '\\') {
                if (i + 1 >= raw_len)
                    return IDEM_KEY_BAD_QUOTING;
                c = (unsigned char)raw[i + 1];
                if (c != '"' && c != '\\')
                    return IDEM_KEY_BAD_QUOTING;
                i++;
            } else if (c < 0x20 || c > 0x7e) {
                return IDEM_KEY_BAD_CHAR;
            } else if (c == ' ') {
                /* A valid sf-string char, but not a visible one. */
                return IDEM_KEY_BAD_CHAR;
            }
            if (n >= max_len)
                return IDEM_KEY_TOO_LONG;
            out[n++] = (char)c;
            i++;
        }
        if (i != raw_len)
            return IDEM_KEY_BAD_QUOTING; /* parameters or trailing garbage */
    } else {
        for (size_t i = 0; i < raw_len; i++) {
            unsigned char c = (unsigned char)raw[i];
            /* Only a leading '"' makes an sf-string: '"' further in is one
             * more visible character of a bare key. */
            if (c < 0x21 || c > 0x7e)
                return IDEM_KEY_BAD_CHAR;
            if (n >= max_len)
                return IDEM_KEY_TOO_LONG;
            out[n++] = (char)c;
        }
    }
    if (n == 0)
        return IDEM_KEY_EMPTY;
    *out_len = n;
    return IDEM_KEY_OK;
}

const char *idem_key_status_text(enum idem_key_status s)
{
    switch (s) {
    case IDEM_KEY_OK:
        return "ok";
    case IDEM_KEY_EMPTY:
        return "the Idempotency-Key is empty";
    case IDEM_KEY_TOO_LONG:
        return "the Idempotency-Key is longer than this route allows";
    case IDEM_KEY_BAD_CHAR:
        return "the Idempotency-Key holds characters outside visible ASCII";
    case IDEM_KEY_BAD_QUOTING:
        return "the Idempotency-Key is neither a token nor a valid quoted string";
    }
    return "invalid Idempotency-Key";
}

static void hex_encode(const uint8_t *in, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[in[i] >> 4];
        out[2 * i + 1] = digits[in[i] & 15];
    }
    out[2 * n] = '\0';
}

void idem_key_loghash(const uint8_t salt[STORE_LOG_SALT_BYTES],
                      const uint8_t record_key[STORE_KEY_BYTES], char out[9])
{
    uint8_t digest[STORE_SHA256_BYTES];
    const struct store_span parts[] = {{salt, STORE_LOG_SALT_BYTES}, {record_key, STORE_KEY_BYTES}};

    if (store_sha256(parts, 2, digest) != STORE_OK) {
        memcpy(out, "????????", 9);
        return;
    }
    hex_encode(digest, 4, out);
}

/* ---- fingerprint ------------------------------------------------------ */

/* RFC 9110 section 5.6.2: tchar. */
static bool is_tchar(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

bool idem_is_json_media_type(const char *ct)
{
    size_t len;
    size_t slashes = 0;
    const char *semi;
    const char *slash;

    if (ct == NULL)
        return false;
    while (*ct == ' ' || *ct == '\t')
        ct++;
    semi = strchr(ct, ';');
    len = semi ? (size_t)(semi - ct) : strlen(ct);
    while (len > 0 && (ct[len - 1] == ' ' || ct[len - 1] == '\t'))
        len--;
    /* One media type, type "/" subtype, both tokens (RFC 9110 section
     * 8.3.1). A list ("text/plain, application/x+json") or junk that only
     * ends in "+json" is not one: canonicalised, its reordered body, which
     * an upstream reading "text/plain" tells apart, would be replayed. */
    for (size_t i = 0; i < len; i++) {
        if (ct[i] == '/')
            slashes++;
        else if (!is_tchar((unsigned char)ct[i]))
            return false;
    }
    slash = memchr(ct, '/', len);
    if (slashes != 1 || slash == ct || slash == ct + len - 1)
        return false;
    if (len == 16 && strncasecmp(ct, "application/json", 16) == 0)
        return true;
    return len > 5 && strncasecmp(ct + len - 5, "+json", 5) == 0;
}

/* SHA-256 over method, target and body bytes. NUL separators: a method or
 * target never holds NUL, so the fields cannot run into each other. */
static int hash_request(const char *method, const char *target, size_t target_len, const void *body,
                        size_t body_len, uint8_t out[STORE_FINGERPRINT_BYTES])
{
    static const uint8_t sep = 0;
    const struct store_span parts[] = {
        {method, strlen(method)}, {&sep, 1}, {target, target_len}, {&sep, 1}, {body, body_len},
    };
    return store_sha256(parts, sizeof(parts) / sizeof(parts[0]), out) == STORE_OK ? 0 : -1;
}

/* True when the canonical fingerprint may differ from the raw one. */
static bool canonicalises(const char *content_type, size_t body_len, enum config_fingerprint mode)
{
    return mode == CONFIG_FINGERPRINT_AUTO && body_len > 0 && idem_is_json_media_type(content_type);
}

int idem_fingerprints_init(struct idem_fingerprints *fp, const char *method, const char *target,
                           size_t target_len, const char *content_type, const void *body,
                           size_t body_len, enum config_fingerprint mode)
{
    int rc;

    memset(fp, 0, sizeof(*fp));
    fp->method = method;
    fp->target = target;
    fp->target_len = target_len;
    fp->body = body;
    fp->body_len = body_len;
    rc = hash_request(method, target, target_len, body, body_len, fp->raw);
    if (rc == 0 && !canonicalises(content_type, body_len, mode)) {
        memcpy(fp->canonical, fp->raw, STORE_FINGERPRINT_BYTES);
        fp->canonical_ready = true;
    }
    return rc;
}

int idem_fingerprints_canonical(struct idem_fingerprints *fp)
{
    int rc = 0;
    char *canon = NULL;
    size_t canon_len = 0;

    if (fp->canonical_ready)
        goto out;
    /* Only a JSON body under AUTO gets here (idem_fingerprints_init). One
     * that does not parse is hashed as sent, so canonical equals raw. One
     * that memory ran out for is an error: its raw hash, stored as the
     * canonical fingerprint, would make every retry in another key order a
     * 422 for the record's whole TTL. */
    rc = idem_canonical_json(fp->body, fp->body_len, &canon, &canon_len);
    if (rc == 0) {
        rc = hash_request(fp->method, fp->target, fp->target_len, canon, canon_len, fp->canonical);
    } else if (rc == IDEM_CJSON_NOT_JSON) {
        memcpy(fp->canonical, fp->raw, STORE_FINGERPRINT_BYTES);
        rc = 0;
    } else {
        rc = -1;
    }
    fp->canonical_ready = rc == 0;
out:
    free(canon);
    return rc;
}

int idem_fingerprint(const char *method, const char *target, size_t target_len,
                     const char *content_type, const void *body, size_t body_len,
                     enum config_fingerprint mode, uint8_t out[STORE_FINGERPRINT_BYTES])
{
    struct idem_fingerprints fp;
    int rc =
        idem_fingerprints_init(&fp, method, target, target_len, content_type, body, body_len, mode);

    if (rc == 0)
        rc = idem_fingerprints_canonical(&fp);
    if (rc == 0)
        memcpy(out, fp.canonical, STORE_FINGERPRINT_BYTES);
    return rc;
}

int idem_scope_build(const struct config_route *route, const char *header_value,
                     size_t header_len, char **out, size_t *out_len)
{
    size_t slen = strlen(route->scope);
    size_t len = slen;
    char *buf;

    if (route->scope_header != NULL)
        len += 1 + 2 * STORE_SHA256_BYTES;
    buf = malloc(len + 1);
    if (buf == NULL)
        return -1;
    memcpy(buf, route->scope, slen);
    if (route->scope_header != NULL) {
        uint8_t digest[STORE_SHA256_BYTES];
        const struct store_span part = {header_value, header_len};
        if (store_sha256(&part, 1, digest) != STORE_OK) {
            free(buf);
            return -1;
        }
        buf[slen] = '\0';
        hex_encode(digest, STORE_SHA256_BYTES, buf + slen + 1);
    }
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    return 0;
}

/* ---- header filters --------------------------------------------------- */

#define NAME(s) {s, sizeof(s) - 1}
struct name_len {
    const char *name;
    size_t len;
};

static bool named_in(const char *name, size_t name_len, const struct name_len *names, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (name_is(name, name_len, names[i].name, names[i].len))
            return true;
    return false;
}

static bool hop_by_hop(const char *name, size_t name_len)
{
    static const struct name_len fixed[] = {
        NAME("Connection"), NAME("Keep-Alive"),        NAME("TE"),      NAME("Trailer"),
        NAME("Trailers"),   NAME("Transfer-Encoding"), NAME("Upgrade"), NAME("Proxy-Connection")};
    return named_in(name, name_len, fixed, sizeof(fixed) / sizeof(fixed[0])) ||
           (name_len >= 6 && strncasecmp(name, "Proxy-", 6) == 0);
}

bool idem_header_is_hop_by_hop(const char *name)
{
    return hop_by_hop(name, strlen(name));
}

/*
 * The tokens of every Connection header, parsed once per list: matching each
 * header against a re-parse of Connection would cost headers x tokens string
 * scans, which a 30 KiB header block can make quadratic.
 */
#define MAX_CONNECTION_TOKENS 32

struct conn_tokens {
    const char *tok[MAX_CONNECTION_TOKENS];
    size_t len[MAX_CONNECTION_TOKENS];
    size_t n;
    bool overflow; /* more tokens than we track */
};

/* The next comma-separated element of a list value (RFC 9110 section 5.6.1),
 * trimmed; *p advances past it. Returns false at the end of the value. */
static bool next_list_token(const char **p, const char **tok, size_t *len)
{
    const char *q = *p;
    for (;;) {
        const char *start;
        size_t n;
        while (*q == ' ' || *q == '\t' || *q == ',')
            q++;
        if (*q == '\0') {
            *p = q;
            return false;
        }
        start = q;
        while (*q != '\0' && *q != ',')
            q++;
        n = (size_t)(q - start);
        while (n > 0 && (start[n - 1] == ' ' || start[n - 1] == '\t'))
            n--;
        if (n > 0) {
            *p = q;
            *tok = start;
            *len = n;
            return true;
        }
    }
}

static void conn_tokens_parse(const struct idem_headers *h, struct conn_tokens *ct)
{
    ct->n = 0;
    ct->overflow = false;
    for (size_t i = 0; i < h->n; i++) {
        const char *p = h->v[i].value;
        const char *tok;
        size_t len;
        if (!named(&h->v[i], "Connection", 10))
            continue;
        while (next_list_token(&p, &tok, &len)) {
            if (ct->n == MAX_CONNECTION_TOKENS) {
                ct->overflow = true;
                return;
            }
            ct->tok[ct->n] = tok;
            ct->len[ct->n] = len;
            ct->n++;
        }
    }
}

/* The slow scan, for the rare list whose tokens overflowed conn_tokens. */
static bool connection_names_slow(const struct idem_headers *h, const char *name, size_t nlen)
{
    for (size_t i = 0; i < h->n; i++) {
        const char *p = h->v[i].value;
        const char *tok;
        size_t len;
        if (!named(&h->v[i], "Connection", 10))
            continue;
        while (next_list_token(&p, &tok, &len))
            if (len == nlen && strncasecmp(tok, name, len) == 0)
                return true;
    }
    return false;
}

static bool conn_tokens_has(const struct conn_tokens *ct, const char *name, size_t name_len)
{
    for (size_t i = 0; i < ct->n; i++)
        if (ct->len[i] == name_len && strncasecmp(ct->tok[i], name, name_len) == 0)
            return true;
    return false;
}

bool idem_header_named_by_connection(const struct idem_headers *h, const char *name)
{
    return connection_names_slow(h, name, strlen(name));
}

static bool has_ctl_break(const char *s, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if (s[i] == '\r' || s[i] == '\n' || s[i] == '\0')
            return true;
    return false;
}

bool idem_is_token(const char *s, size_t len)
{
    static const char extra[] = "!#$%&'*+-.^_`|~";
    if (len == 0)
        return false;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c != '\0' && strchr(extra, c) != NULL)))
            return false;
    }
    return true;
}

bool idem_connection_too_many_names(const struct idem_headers *in)
{
    struct conn_tokens ct;
    conn_tokens_parse(in, &ct);
    return ct.overflow;
}

int idem_filter_request_headers(const struct idem_headers *in,
                                const struct idem_forward_info *info, struct idem_headers *out)
{
    static const struct name_len dropped[] = {NAME("Host"),
                                              NAME("Content-Length"),
                                              NAME("Expect"),
                                              NAME("X-Forwarded-For"),
                                              NAME("X-Forwarded-Proto"),
                                              NAME("X-Forwarded-Host"),
                                              NAME("Forwarded")};
    const struct idem_header *host = NULL;
    struct conn_tokens ct;

    /* A Connection header naming dozens of fields is not a client we serve. */
    conn_tokens_parse(in, &ct);
    if (ct.overflow)
        return -1;
    for (size_t i = 0; i < in->n; i++) {
        const struct idem_header *hd = &in->v[i];
        bool drop = hd->name_len >= 12 &&
                    strncasecmp(hd->name, "X-Forwarded-", 12) == 0; /* all forgeable */
        if (!idem_is_token(hd->name, hd->name_len) || has_ctl_break(hd->value, hd->value_len))
            return -1;
        if (host == NULL && named(hd, "Host", 4))
            host = hd;
        drop =
            drop || named_in(hd->name, hd->name_len, dropped, sizeof(dropped) / sizeof(dropped[0]));
        if (drop || hop_by_hop(hd->name, hd->name_len) ||
            conn_tokens_has(&ct, hd->name, hd->name_len))
            continue;
        if (idem_headers_push(out, hd->name, hd->name_len, hd->value, hd->value_len) != 0)
            return -2;
    }
    if (info->client_addr != NULL && info->client_addr[0] != '\0' &&
        !has_ctl_break(info->client_addr, strlen(info->client_addr))) {
        if (idem_headers_push(out, "X-Forwarded-For", 15, info->client_addr,
                              strlen(info->client_addr)) != 0)
            return -2;
    }
    if (idem_headers_push(out, "X-Forwarded-Proto", 17, info->proto, strlen(info->proto)) != 0)
        return -2;
    if (host != NULL && host->value_len > 0) {
        if (idem_headers_push(out, "X-Forwarded-Host", 16, host->value, host->value_len) != 0)
            return -2;
    }
    return 0;
}

static bool in_strip_list(const struct config_route *route, const char *name)
{
    for (size_t i = 0; i < route->n_strip_headers; i++)
        if (strcasecmp(route->strip_headers[i], name) == 0)
            return true;
    return false;
}

int idem_response_headers_each(const struct idem_headers *in, const struct config_route *strip,
                               int (*fn)(const struct idem_header *h, void *ctx), void *ctx)
{
    struct conn_tokens ct;

    conn_tokens_parse(in, &ct);
    for (size_t i = 0; i < in->n; i++) {
        const struct idem_header *hd = &in->v[i];
        if (!idem_is_token(hd->name, hd->name_len) || has_ctl_break(hd->value, hd->value_len))
            continue;
        /* MHD frames the body itself (RFC 9112 section 6): the upstream's
         * framing headers describe a different message. */
        if (named(hd, "Content-Length", 14) || hop_by_hop(hd->name, hd->name_len) ||
            conn_tokens_has(&ct, hd->name, hd->name_len) ||
            (ct.overflow && connection_names_slow(in, hd->name, hd->name_len)))
            continue;
        if (named(hd, "Idempotent-Replayed", 19))
            continue;
        if (strip != NULL && in_strip_list(strip, hd->name))
            continue;
        if (fn(hd, ctx) != 0)
            return -1;
    }
    return 0;
}

static int push_header(const struct idem_header *h, void *ctx)
{
    return idem_headers_push(ctx, h->name, h->name_len, h->value, h->value_len);
}

int idem_filter_response_headers(const struct idem_headers *in, const struct config_route *strip,
                                 struct idem_headers *out)
{
    return idem_response_headers_each(in, strip, push_header, out);
}

/* ---- request target ------------------------------------------------------ */

static void trim_ows(const char **v, size_t *n)
{
    while (*n > 0 && (**v == ' ' || **v == '\t')) {
        (*v)++;
        (*n)--;
    }
    while (*n > 0 && ((*v)[*n - 1] == ' ' || (*v)[*n - 1] == '\t'))
        (*n)--;
}

enum idem_field_kind idem_field_line_split(const char *line, size_t n,
                                           struct idem_field_line *out)
{
    const char *colon;

    memset(out, 0, sizeof(*out));
    if (n > 0 && (line[0] == ' ' || line[0] == '\t')) {
        out->value = line;
        out->value_len = n;
        trim_ows(&out->value, &out->value_len);
        return out->value_len == 0 ? IDEM_FIELD_SKIP : IDEM_FIELD_FOLD;
    }
    colon = memchr(line, ':', n);
    if (colon == NULL || colon == line)
        return IDEM_FIELD_BAD;
    out->name = line;
    out->name_len = (size_t)(colon - line);
    /* "Name : value": a proxy removes the white space before the colon
     * (section 5.1) rather than lose the field. */
    while (out->name_len > 0 && (line[out->name_len - 1] == ' ' || line[out->name_len - 1] == '\t'))
        out->name_len--;
    /* The name is not empty: line[0] is neither white space nor the colon. */
    out->value = colon + 1;
    out->value_len = n - (size_t)(colon - line) - 1;
    trim_ows(&out->value, &out->value_len);
    return IDEM_FIELD;
}

int idem_hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static bool is_unreserved(int c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '.' || c == '_' || c == '~';
}

bool idem_target_is_canonical(const char *target, size_t len)
{
    size_t path_len = 0;
    size_t seg_start = 1;
    size_t seg_dots = 0; /* '.' characters (plain or %2E) in this segment */
    size_t seg_chars = 0;

    if (len == 0 || target[0] != '/')
        return false;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)target[i];
        /* '#' has no place in an origin-form target (RFC 9112 3.2.1): a
         * URL parser on the way (libcurl's included) drops it and what
         * follows, so "/v1/payments#x" would miss the route yet reach
         * /v1/payments. */
        if (c <= 0x20 || c >= 0x7f || c == '#')
            return false;
    }
    while (path_len < len && target[path_len] != '?')
        path_len++;
    for (size_t i = 1; i <= path_len; i++) {
        if (i == path_len || target[i] == '/') {
            /* End of a segment: empty ("//") or "." / ".." are ambiguous. */
            if (i < path_len && i == seg_start)
                return false;
            if (seg_chars > 0 && seg_chars == seg_dots && seg_dots <= 2)
                return false;
            seg_start = i + 1;
            seg_dots = 0;
            seg_chars = 0;
            continue;
        }
        if (target[i] == '\\')
            return false; /* some servers read it as '/' */
        if (target[i] == '%') {
            int hi, lo, v;
            if (i + 2 >= path_len)
                return false;
            hi = idem_hex_value(target[i + 1]);
            lo = idem_hex_value(target[i + 2]);
            if (hi < 0 || lo < 0)
                return false;
            v = hi * 16 + lo;
            /* An escaped unreserved character, '/' or '\\' reads as another
             * path once decoded; an escaped '.' is checked as a dot. */
            if ((is_unreserved(v) && v != '.') || v == '/' || v == '\\')
                return false;
            if (v == '.')
                seg_dots++;
            seg_chars++;
            i += 2;
            continue;
        }
        if (target[i] == '.')
            seg_dots++;
        seg_chars++;
    }
    return true;
}

/* ---- decisions --------------------------------------------------------- */

/* The fingerprint rule (policy.h, store.h): raw first, then canonical.
 * 1 same, 0 different, -1 when the canonical fingerprint cannot be made. */
static int same_request(const struct store_record *rec, struct idem_fingerprints *fp)
{
    if (rec->has_raw_fingerprint &&
        memcmp(rec->raw_fingerprint, fp->raw, STORE_FINGERPRINT_BYTES) == 0)
        return 1;
    if (idem_fingerprints_canonical(fp) != 0)
        return -1;
    return memcmp(rec->fingerprint, fp->canonical, STORE_FINGERPRINT_BYTES) == 0;
}

enum idem_lookup_action idem_decide_lookup(const struct store_record *rec,
                                           struct idem_fingerprints *fp, int64_t now_ms,
                                           int64_t lease_now_ms)
{
    enum idem_lookup_action action = IDEM_LOOKUP_ACQUIRE;
    bool live = false;
    int same;

    if (rec->state == STORE_STATE_COMPLETE) {
        /* Seed: an expired COMPLETE record is treated as absent. */
        live = rec->expires_ms > now_ms;
    } else if (rec->state == STORE_STATE_IN_PROGRESS) {
        /* IN_PROGRESS with an expired lease is stealable (leases are on
         * the store's lease clock, store_clock). */
        live = rec->lease_expires_ms > lease_now_ms;
    }
    if (!live) {
        /* The acquire stores the canonical fingerprint, for later retries
         * that send the same JSON formatted otherwise. */
        if (idem_fingerprints_canonical(fp) != 0)
            action = IDEM_LOOKUP_ERROR;
        goto out;
    }
    same = same_request(rec, fp);
    if (same < 0)
        action = IDEM_LOOKUP_ERROR;
    else if (same == 0)
        action = IDEM_LOOKUP_MISMATCH;
    else if (rec->state == STORE_STATE_COMPLETE)
        action = IDEM_LOOKUP_REPLAY;
    else if (store_lease_is_held(rec->lease_id))
        action = IDEM_LOOKUP_HELD;
    else
        action = IDEM_LOOKUP_BUSY;
out:
    return action;
}

enum idem_record_action idem_decide_record(const struct config_route *route,
                                           enum idem_upstream_result result, int status)
{
    switch (result) {
    case IDEM_UPSTREAM_RESPONSE:
        if (status >= 0 && status < 600 && route->release_on[status])
            return IDEM_RECORD_RELEASE;
        return IDEM_RECORD_COMPLETE;
    case IDEM_UPSTREAM_NOT_SENT:
        return IDEM_RECORD_RELEASE;
    case IDEM_UPSTREAM_TIMEOUT:
    case IDEM_UPSTREAM_BROKEN:
    case IDEM_UPSTREAM_TOO_LARGE:
        return route->on_unknown == CONFIG_ON_UNKNOWN_COMPLETE ? IDEM_RECORD_COMPLETE
                                                               : IDEM_RECORD_RELEASE;
    }
    return IDEM_RECORD_RELEASE;
}

long idem_retry_after_seconds(int64_t lease_expires_ms, int64_t now_ms)
{
    int64_t left;
    long s;
    if (lease_expires_ms <= now_ms)
        return 1;
    /* Both may come from a damaged record: subtract without overflow. */
    left = (int64_t)((uint64_t)lease_expires_ms - (uint64_t)now_ms);
    if (left <= 0)
        return 1;
    s = (long)(left / 1000 + (left % 1000 != 0)); /* round up; left + 999 could overflow */
    return s < 1 ? 1 : s;
}

/* ---- problem+json ------------------------------------------------------ */

char *idem_problem_json(int status, const char *slug, const char *title, const char *detail,
                        size_t *out_len)
{
    char type[128];
    json_t *j;
    char *s = NULL;

    snprintf(type, sizeof(type), "urn:idemproxy:problem:%s", slug);
    j = json_pack("{s:s, s:s, s:i, s:s}", "type", type, "title", title, "status", status,
                  "detail", detail);
    if (j == NULL)
        return NULL;
    s = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(j);
    if (s != NULL && out_len != NULL)
        *out_len = strlen(s);
    return s;
}
