/*
 * replay_share.h - one copy of a stored answer for all its replays at once.
 *
 * A replay's body must outlive the store's read transaction (LMDB's values
 * are valid only inside it), so it is copied, and the copy lives until
 * libmicrohttpd has sent it. 250 clients replaying one 10 MiB answer held
 * 250 copies. Here replays of one record version share one immutable,
 * reference-counted copy: the first replay makes it, the others take a
 * reference, and the last reference frees it.
 *
 * A version is (record key, lease id, expiry, status, lengths and
 * fingerprint of the record). Every acquire draws a new random lease id and
 * a COMPLETE record is written once per lease, so a record that is
 * forgotten, purged or replaced (a new acquire after its TTL) is another
 * version. The caller reads the record first, every time, and gets a copy
 * only for the version it read: a replacement visible in the store is never
 * served from an older copy. Only copies some reply still holds are kept:
 * nothing is cached here past its last replay. (A worker keeps its last
 * replay answer of up to 64 KiB made, for more replays of that version,
 * and with it a reference to its copy, until 1-2 s after its last
 * replay: struct replay_ready in server.c.)
 *
 * server.max_buffered: each copy is counted once against the process's
 * budget (the counter given to replay_share_new), when it is made, and
 * given back when it is freed.
 *
 * Thread safety: every function may be called from any thread; one mutex
 * guards the table, and copies are made outside it. A replay of a version
 * whose copy another thread is making waits for it (milliseconds).
 */
#ifndef IDEM_REPLAY_SHARE_H
#define IDEM_REPLAY_SHARE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store.h"

struct replay_share; /* opaque: the table */
struct replay_body;  /* opaque: one shared copy */

enum replay_share_result {
    REPLAY_SHARE_OK = 0,
    REPLAY_SHARE_ENOMEM = -1, /* the copy could not be allocated */
    REPLAY_SHARE_FULL = -2,   /* the copy would pass max_buffered */
};

/* buffered: the process's count of buffered bytes, which copies are added
 * to and taken from (it must outlive the table); max_buffered its bound.
 * NULL when out of memory. */
struct replay_share *replay_share_new(_Atomic uint64_t *buffered, uint64_t max_buffered);
/* Frees the table; no reference may be left (libmicrohttpd stopped).
 * replay_share_free(NULL) is a no-op. */
void replay_share_free(struct replay_share *t);

/* A reference to the shared copy of rec's body, rec being the COMPLETE
 * record of key as just read from the store (borrowed: a store_view()
 * record, or one the caller owns). When no replay holds this version, a
 * copy is made, if it fits in max_buffered; a version some replay holds is
 * shared whatever the budget (it costs nothing more). rec must have a body
 * (body_len > 0). *out is owned by the caller: replay_body_put(). */
int replay_share_get(struct replay_share *t, const uint8_t key[STORE_KEY_BYTES],
                     const struct store_record *rec, struct replay_body **out);

/* replay_share_get() for a record the caller owns (a STORE_REPLAY acquire's
 * copy): where no replay holds this version, rec's body becomes the shared
 * copy (it is taken: rec->body is NULL after), so nothing is copied. */
int replay_share_adopt(struct replay_share *t, const uint8_t key[STORE_KEY_BYTES],
                       struct store_record *rec, struct replay_body **out);

/* True when b is the copy of this version: rec being key's COMPLETE record
 * as just read (see replay_share_get()). b's version never changes, so the
 * check needs no lock; b must be held (a reference or what holds one). */
bool replay_body_is(const struct replay_body *b, const uint8_t key[STORE_KEY_BYTES],
                    const struct store_record *rec);

/* The bytes and length of a copy; valid while the reference is held, and
 * never changed. */
const void *replay_body_data(const struct replay_body *b);
size_t replay_body_len(const struct replay_body *b);

/* Gives a reference back; the last one frees the copy and gives its bytes
 * back to max_buffered. NULL is a no-op. Shaped as libmicrohttpd's
 * MHD_ContentReaderFreeCallback (cls: the replay_body). */
void replay_body_put(void *b);

#endif
