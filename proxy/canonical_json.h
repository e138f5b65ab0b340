/*
 * canonical_json.h - the canonical form of a JSON body, for the fingerprint
 * (CONTRACT section 3, fingerprint "auto").
 *
 * The canonical form is the body with object members sorted by key and
 * every insignificant white space removed, and nothing else changed that
 * could tell two requests apart: every number is kept exactly as written
 * (after checking the RFC 8259 section 6 grammar), so `1.0` and `1`, or
 * `1.50` and `1.5`, stay different requests. Strings are decoded and
 * written again in one fixed way, so `"\u0041"` and `"A"` are the same.
 *
 * The output is byte for byte what jansson 2.14 wrote for the same document
 * (json_loadb with JSON_DECODE_ANY | JSON_REJECT_DUPLICATES |
 * JSON_ALLOW_NUL, then json_dumps with JSON_COMPACT | JSON_SORT_KEYS |
 * JSON_ENCODE_ANY), which is what fingerprints stored by earlier versions
 * were computed from, whenever that document holds no real number (a
 * number with a fraction or an exponent) and no integer outside int64.
 * jansson turned those into doubles or refused the body; a double loses
 * digits, so different amounts got one fingerprint.
 *
 * What is written (jansson's json_dumps rules):
 *   - objects `{"k":v,...}`, arrays `[v,...]`, no white space;
 *   - members sorted by their decoded key bytes (memcmp, then the shorter
 *     first: UTF-8 byte order is code point order);
 *   - strings with `\"` `\\` `\b` `\f` `\n` `\r` `\t`, every other control
 *     character as `\u00XX` (upper-case hex), everything else, `/` and
 *     non-ASCII included, as its UTF-8 bytes;
 *   - integers as written, except `-0`, which jansson read as the integer 0
 *     and wrote `0`; reals as written; `true`, `false`, `null`.
 *
 * What is refused (IDEM_CJSON_NOT_JSON; the caller then hashes the body as
 * sent): anything that is not one RFC 8259 JSON text of any type, white
 * space being space, tab, LF and CR only; invalid UTF-8 (overlong forms,
 * encoded surrogates, past U+10FFFF); a `\u` escape naming a lone
 * surrogate; a control character not escaped; an object key holding NUL
 * (`\u0000`, which jansson refused in keys; allowed in other strings); the
 * same key twice in one object (after decoding); nesting deeper than
 * IDEM_CJSON_MAX_DEPTH. One difference from jansson, on purpose: jansson
 * skipped a single NUL byte right after a number or `true`/`false`/`null`
 * (a quirk of its lexer), so `[1\0]` read as `[1]`; that is not JSON, and
 * is refused here.
 *
 * Cost: time and memory linear in the input (sorting aside, n log n in the
 * members of each object); no recursion, so hostile nesting costs heap, not
 * stack. The output is never longer than the input.
 *
 * Thread-safe: no state outside the call.
 */
#ifndef IDEM_CANONICAL_JSON_H
#define IDEM_CANONICAL_JSON_H

#include <stddef.h>

/* jansson's JSON_PARSER_MAX_DEPTH (2048): every value, container or not,
 * counts one level for itself and one for each container around it. */
#define IDEM_CJSON_MAX_DEPTH 2048

#define IDEM_CJSON_NOT_JSON (-1) /* expected: the body is hashed as sent */
#define IDEM_CJSON_NOMEM (-2)

/* Canonicalises in[0..in_len). On success returns 0 and sets *out to a new
 * NUL-terminated string (the caller frees it with free()) and *out_len to
 * its length without the NUL. On failure returns IDEM_CJSON_NOT_JSON or
 * IDEM_CJSON_NOMEM and leaves *out NULL and *out_len 0. */
int idem_canonical_json(const void *in, size_t in_len, char **out, size_t *out_len);

/* A static text for a return code of idem_canonical_json(). */
const char *idem_canonical_json_strerror(int rc);

#endif
