/*
 * policy.h - the pure part of the proxy: everything that decides, with no
 * I/O, so it is unit-tested and fuzzed without sockets.
 *
 *   - Idempotency-Key parsing (bare token or RFC 8941 sf-string);
 *   - the request fingerprint (SHA-256 over method, target and body, JSON
 *     bodies canonicalised under fingerprint "auto");
 *   - the header filters that build the upstream request and the stored
 *     response (hop-by-hop handling, RFC 9110 section 7.6.1);
 *   - the decision tables: what a looked-up record means for a request, and
 *     what an upstream result does to the record (CONTRACT.md section 3);
 *   - the binary header-list encoding stored with a COMPLETE record;
 *   - problem+json bodies (RFC 9457).
 *
 * All functions are thread-safe. Ownership is stated per function.
 */
#ifndef IDEM_POLICY_H
#define IDEM_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "store.h"

/* ---- header lists ---------------------------------------------------- */

struct idem_header {
    char *name; /* owned by the list, NUL-terminated, may not contain NUL */
    size_t name_len;
    char *value; /* owned by the list, NUL-terminated */
    size_t value_len;
};

struct idem_header_block; /* string storage, see policy.c */

/* A growable list that owns its strings. Zero-initialise, then push. The
 * strings live in a few blocks owned by the list (not one allocation per
 * string): a request's headers cost two or three allocations, not two per
 * header. */
struct idem_headers {
    struct idem_header *v;
    size_t n;
    size_t cap;
    size_t bytes; /* sum of name and value lengths, for caps */
    struct idem_header_block *blocks; /* newest first */
};

int idem_headers_push(struct idem_headers *h, const char *name, size_t name_len,
                      const char *value, size_t value_len);
/* Appends " " and more to the last header's value (an obs-fold
 * continuation line, RFC 9112 5.2). -1 with no header or no memory. */
int idem_headers_extend_last(struct idem_headers *h, const char *more, size_t more_len);
/* Frees the strings and the array; the list is empty and reusable after. */
void idem_headers_clear(struct idem_headers *h);
/* First header with that name (case-insensitive), or NULL. */
const struct idem_header *idem_headers_find(const struct idem_headers *h, const char *name);
size_t idem_headers_count(const struct idem_headers *h, const char *name);

/* Stored form: for each header u32le name_len, name, u32le value_len, value.
 * encode returns a malloc'd buffer (caller frees; *out may be NULL when
 * empty). decode appends to *out and rejects malformed input (-1); -2 when
 * memory ran out (the input may be fine). */
int idem_headers_encode(const struct idem_headers *h, uint8_t **out, size_t *out_len);
int idem_headers_decode(const void *buf, size_t len, struct idem_headers *out);

/* ---- Idempotency-Key ----------------------------------------------- */

enum idem_key_status {
    IDEM_KEY_OK = 0,
    IDEM_KEY_EMPTY,
    IDEM_KEY_TOO_LONG,
    IDEM_KEY_BAD_CHAR, /* outside visible ASCII (0x21-0x7e) */
    IDEM_KEY_BAD_QUOTING,
};

/*
 * Parses one Idempotency-Key field value (already stripped of surrounding
 * OWS): `"abc"` (an sf-string, draft-ietf-httpapi-idempotency-key-header
 * section 2, with \" and \\ escapes) and bare `abc` both give the key abc.
 * The key is written to out (at least max_len bytes); *out_len its length.
 */
enum idem_key_status idem_key_parse(const char *raw, size_t raw_len, size_t max_len, char *out,
                                    size_t *out_len);
const char *idem_key_status_text(enum idem_key_status s);

/* A short hash of a key for logs, 8 hex chars + NUL: the first 4 bytes of
 * SHA-256(salt, record key). The record key holds the whole scope (tenant
 * included), so one key of two tenants logs two hashes; the salt is the
 * store's secret (store_stats), so a reader of the log cannot try guessable
 * keys against it. "????????" when the hash could not be made (memory). */
void idem_key_loghash(const uint8_t salt[STORE_LOG_SALT_BYTES],
                      const uint8_t record_key[STORE_KEY_BYTES], char out[9]);

/* ---- fingerprint ------------------------------------------------------ */

/* True for application/json and any +json media type (parameters ignored). */
bool idem_is_json_media_type(const char *content_type);

/*
 * A request's two fingerprints (CONTRACT.md section 3), both SHA-256 over
 * method, target (path with query) and body:
 *
 *   raw        the body as sent;
 *   canonical  with mode AUTO and a JSON media type, a body that parses as
 *              JSON canonicalised first (sorted keys, compact); one that
 *              does not is hashed as sent.
 *
 * Where canonicalisation does not apply (mode RAW, another media type, no
 * body) the two are one hash, computed once. Otherwise the canonical one is
 * computed only when asked for (idem_fingerprints_canonical()): a retry is
 * almost always byte-identical to the first request, and then the raw
 * fingerprints already match and the body is never parsed.
 *
 * The struct borrows method, target and body from the caller (the request),
 * which must keep them unchanged while the struct is in use.
 */
struct idem_fingerprints {
    uint8_t raw[STORE_FINGERPRINT_BYTES];
    uint8_t canonical[STORE_FINGERPRINT_BYTES]; /* valid when canonical_ready */
    bool canonical_ready;
    /* borrowed, for the deferred canonical fingerprint */
    const char *method;
    const char *target;
    size_t target_len;
    const void *body;
    size_t body_len;
};

/* Computes the raw fingerprint (and the canonical one when it is the same
 * hash). 0, or -1 when hashing fails. */
int idem_fingerprints_init(struct idem_fingerprints *fp, const char *method, const char *target,
                           size_t target_len, const char *content_type, const void *body,
                           size_t body_len, enum config_fingerprint mode);
/* Makes fp->canonical valid (a no-op when it already is). 0, or -1 when
 * hashing or canonicalising fails (out of memory; a body that is not JSON
 * is not a failure: it is hashed as sent). */
int idem_fingerprints_canonical(struct idem_fingerprints *fp);

/* The canonical fingerprint alone, in one call. */
int idem_fingerprint(const char *method, const char *target, size_t target_len,
                     const char *content_type, const void *body, size_t body_len,
                     enum config_fingerprint mode, uint8_t out[STORE_FINGERPRINT_BYTES]);

/* The scope of a request: route scope, plus "\0" and SHA-256 hex of the
 * scope_header value when the route sets one (the value is never stored).
 * Writes a malloc'd buffer to *out (caller frees). */
int idem_scope_build(const struct config_route *route, const char *header_value,
                     size_t header_len, char **out, size_t *out_len);

/* ---- header filters --------------------------------------------------- */

/* True when s is a non-empty RFC 9110 token (field names, methods). */
bool idem_is_token(const char *s, size_t len);

/* The value of one hexadecimal digit (either case), or -1. */
int idem_hex_value(char c);

/* One line of an upstream answer's header section, CRLF already removed,
 * as a proxy must read it (RFC 9112 section 5): */
enum idem_field_kind {
    IDEM_FIELD,     /* name: value (white space around the value, and before
                     * the colon, removed) */
    IDEM_FIELD_FOLD,/* obs-fold: more value for the previous field, trimmed;
                     * the caller joins it with one space (section 5.2) */
    IDEM_FIELD_SKIP,/* nothing to keep: a fold of white space only */
    IDEM_FIELD_BAD  /* no colon, or a colon first: not a field line */
};
struct idem_field_line {
    const char *name;
    size_t name_len;
    const char *value;
    size_t value_len;
};
enum idem_field_kind idem_field_line_split(const char *line, size_t n,
                                           struct idem_field_line *out);

/* True for the fixed hop-by-hop names (Connection, Keep-Alive, Proxy-*, TE,
 * Trailer, Transfer-Encoding, Upgrade). */
bool idem_header_is_hop_by_hop(const char *name);
/* True when name is one of the comma-separated tokens of the Connection
 * header values in h (which the sender declares hop-by-hop). */
bool idem_header_named_by_connection(const struct idem_headers *h, const char *name);

struct idem_forward_info {
    const char *client_addr; /* textual client IP */
    const char *proto;       /* "http" */
};

/*
 * Builds the upstream request headers from the client's: drops hop-by-hop
 * ones and those Connection names (more than 32 names: -1), Host,
 * Content-Length, Expect and any
 * client-sent X-Forwarded-*; adds exactly one X-Forwarded-For (the client
 * address: a client cannot forge the chain), X-Forwarded-Proto and
 * X-Forwarded-Host (the client's Host). Never emits a name or value holding
 * CR, LF or NUL: returns -1 when a client header holds one (the caller
 * answers 400). out is appended to; caller clears it.
 */
/* Whether the Connection headers name more fields than the filter below
 * tracks (32): such a request is refused (400) before anything is stored. */
bool idem_connection_too_many_names(const struct idem_headers *in);

int idem_filter_request_headers(const struct idem_headers *in,
                                const struct idem_forward_info *info, struct idem_headers *out);

/*
 * Filters upstream response headers for the client (drops hop-by-hop ones,
 * those Connection names, Content-Length and Date-independent framing) and,
 * when strip is non-NULL, also the route's strip_headers (for the stored
 * copy). Values with CR/LF/NUL are dropped. out is appended to.
 */
int idem_filter_response_headers(const struct idem_headers *in, const struct config_route *strip,
                                 struct idem_headers *out);
/* The same filter without allocating: calls fn for every header kept, in
 * order; stops and returns -1 when fn returns non-zero. */
int idem_response_headers_each(const struct idem_headers *in, const struct config_route *strip,
                               int (*fn)(const struct idem_header *h, void *ctx), void *ctx);

/* ---- request target ------------------------------------------------------ */

/*
 * True when target (path and query, as sent) is a path the proxy can route
 * unambiguously, so that the route it matched is the one the upstream
 * resolves: origin-form (starts with '/'), visible ASCII only, and a path
 * with no empty segment ("//"), no dot segment ("/./", "/../", also as
 * %2E), no percent-encoded unreserved character (RFC 3986 section 6.2.2.2:
 * "%70ayments" is "payments" to a normaliser) and no broken escape. The
 * query is not examined beyond visible ASCII. Anything else gets 400.
 */
bool idem_target_is_canonical(const char *target, size_t len);

/* ---- decisions --------------------------------------------------------- */

/* What a record found by a read means for a keyed request. */
enum idem_lookup_action {
    IDEM_LOOKUP_ACQUIRE,  /* absent, expired or stealable: ask the writer */
    IDEM_LOOKUP_REPLAY,   /* COMPLETE, same fingerprint */
    IDEM_LOOKUP_BUSY,     /* live IN_PROGRESS, same fingerprint */
    IDEM_LOOKUP_HELD,     /* the same, but held: the action ran and its result
                           * could not be stored (store_op.hold); 409 now */
    IDEM_LOOKUP_MISMATCH, /* live record, other fingerprint: 422 */
    IDEM_LOOKUP_ERROR,    /* the canonical fingerprint could not be computed */
};

/*
 * "Same fingerprint" is the rule of the store (struct store_op in store.h):
 * the raw fingerprints are compared first, when the record has one; only
 * when they differ (or the record has none) is fp's canonical fingerprint
 * computed and compared with the record's. A byte-identical retry of a
 * COMPLETE key is therefore answered without canonicalising its body.
 * IDEM_LOOKUP_ACQUIRE guarantees fp->canonical_ready: the acquire stores it.
 */
enum idem_lookup_action idem_decide_lookup(const struct store_record *rec,
                                           struct idem_fingerprints *fp, int64_t now_ms,
                                           int64_t lease_now_ms);

/* How an upstream exchange ended. */
enum idem_upstream_result {
    IDEM_UPSTREAM_RESPONSE,    /* a complete response arrived */
    IDEM_UPSTREAM_NOT_SENT,    /* refused/unreachable: nothing was sent (502) */
    IDEM_UPSTREAM_TIMEOUT,     /* outcome unknown (504) */
    IDEM_UPSTREAM_BROKEN,      /* connection lost / bad reply after sending (502) */
    IDEM_UPSTREAM_TOO_LARGE,   /* response over max_response (502) */
};

enum idem_record_action {
    IDEM_RECORD_COMPLETE, /* store the response as the key's result */
    IDEM_RECORD_RELEASE,  /* delete the record: a retry runs afresh */
};

/* release_on for responses; on_unknown for timeouts and broken exchanges;
 * NOT_SENT always releases (nothing ran). */
enum idem_record_action idem_decide_record(const struct config_route *route,
                                           enum idem_upstream_result result, int status);

/* Seconds for Retry-After given a holder's lease expiry: at least 1. */
long idem_retry_after_seconds(int64_t lease_expires_ms, int64_t now_ms);

/* ---- problem+json ------------------------------------------------------ */

/* A malloc'd RFC 9457 body {"type","title","status","detail"}; NULL on OOM.
 * slug names the problem type ("urn:idemproxy:problem:<slug>"). */
char *idem_problem_json(int status, const char *slug, const char *title, const char *detail,
                        size_t *out_len);

#endif
