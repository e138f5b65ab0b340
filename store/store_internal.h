/*
 * store_internal.h - shared between the files of the store module only.
 *
 * The LMDB backend works on records in place: it parses a stored value into a
 * view that borrows the payload from the value (no allocation on the write
 * path), and writes new values straight into space reserved by LMDB
 * (MDB_RESERVE). store_record_decode()/encode() in store.h are the owning
 * versions of the same functions, for the tests and the fuzzer.
 */
#ifndef IDEM_STORE_INTERNAL_H
#define IDEM_STORE_INTERNAL_H

#include "store.h"

/*
 * A record whose payload is borrowed: headers and body point into a buffer
 * owned by someone else (a caller's span, or a value inside an LMDB
 * transaction, valid only until that transaction ends).
 */
struct store_record_view {
    enum store_state state;
    uint8_t lease_id[STORE_LEASE_ID_BYTES];
    int64_t lease_expires_ms;
    int64_t expires_ms;
    uint8_t fingerprint[STORE_FINGERPRINT_BYTES];
    bool has_raw_fingerprint; /* false: a version-1 record */
    uint8_t raw_fingerprint[STORE_FINGERPRINT_BYTES];
    int status;             /* COMPLETE only */
    const uint8_t *headers; /* COMPLETE only; borrowed */
    size_t headers_len;
    const uint8_t *body; /* COMPLETE only; borrowed */
    size_t body_len;
};

/* Parses an encoded record without copying; the view borrows from buf.
 * Returns STORE_ECORRUPT on anything malformed (and leaves *out zeroed). */
int store_record_parse(const void *buf, size_t len, struct store_record_view *out);
/* The expires_ms of a record that may not decode, when its fixed header
 * still reads as one (a known version, long enough for the field): for
 * purge, to tell a damaged record's own index entry from a stale one. */
bool store_record_peek_expiry(const void *buf, size_t len, int64_t *expires_ms);

/* The encoded size of v, or STORE_EINVAL if v cannot be encoded (unknown
 * state, status out of range, a NULL span with a length, size overflow). */
int store_record_size(const struct store_record_view *v, size_t *out);

/* Writes v into buf, which holds exactly the store_record_size() bytes. */
void store_record_write(const struct store_record_view *v, uint8_t *buf);

/* Copies v into an owning record (free with store_record_clear()). */
int store_record_copy(const struct store_record_view *v, struct store_record *out);

/* The name of a file system LMDB cannot keep a store on, from statfs()'s
 * f_type ("NFS", "FUSE", ...), or NULL for any other (a local one, or one
 * not known). LMDB's caveats (lmdb.h): its locks and its shared memory map
 * do not work on a remote file system, even between processes of one host,
 * and processes on two hosts would each take the writer. FUSE is in the list
 * because the network file systems of clouds and clusters mount through it
 * (s3fs, gcsfuse, sshfs, GlusterFS), and its locks and shared map are the
 * daemon's to get right. Only the low 32 bits of f_type are read. */
const char *store_shared_fs_name(unsigned long f_type);

#endif
