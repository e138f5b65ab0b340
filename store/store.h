/*
 * store.h - the idempotency record store.
 *
 * A record is identified by a 32-byte key (store_key_derive() of scope and
 * Idempotency-Key) and is absent, IN_PROGRESS (a caller holds a lease) or
 * COMPLETE (it carries a replayable payload). There is no failed state: a
 * failed attempt is released, which deletes the row (seed 000, "Why there is
 * no failed state"). The edges are those of CONTRACT.md section 2:
 *
 *   acquire          absent / expired COMPLETE / IN_PROGRESS with an expired
 *                    lease (a steal) -> IN_PROGRESS with a new random lease id,
 *                    lease_expires = now + lease, expires = now + ttl.
 *   complete(lease)  IN_PROGRESS with that lease -> COMPLETE with the payload,
 *                    expires = now + ttl. Otherwise refused (STORE_FENCED).
 *   release(lease)   IN_PROGRESS with that lease -> deleted. Otherwise refused.
 *   extend(lease)    IN_PROGRESS with that lease -> lease_expires = now + lease.
 *                    A silent no-op otherwise (outcome STORE_FENCED, no error).
 *   purge            deletes COMPLETE records past their TTL and IN_PROGRESS
 *                    records whose TTL has elapsed and whose lease has expired.
 *
 * Caveats, as lmdb.h puts them:
 *   - The store keeps two environments (layout 4, store/README.md): the
 *     records in flight (acquire, release, extend) and the records
 *     (complete, a hold, forget), each with its own writer lock.
 *     store_apply() runs the ops of one call that go to one environment in
 *     ONE write transaction: that is the group commit. The ops of one key
 *     are applied in the order given, later ones seeing earlier ones; ops on
 *     different keys never see each other, and the store may run them in
 *     another order (it runs them in the order of their expiry-index
 *     entries). Either all of them are committed or (on a hard error, a
 *     negative return) none is, except for ops that report STORE_FULL,
 *     which are simply not applied while the others are. A call that mixes
 *     the two environments' ops runs one transaction per environment (or,
 *     when a key has ops in both, one per run of one environment's ops, in
 *     the order given), and a failing one leaves those before it committed:
 *     callers that need all-or-nothing give each call one environment's ops.
 *   - Only one write transaction per environment runs at a time across every
 *     process sharing the store path, so callers funnel each environment's
 *     writes through one writer thread (proxy/writer.c: two).
 *   - store_get() and the other reads never need the writer and may run on
 *     any thread concurrently with store_apply().
 *   - Records returned by store_get() are copies owned by the caller: free
 *     them with store_record_clear(). Nothing returned points into the store.
 *   - Time comes only from the clock given at open, so tests inject it.
 *
 * Thread safety: every function taking a struct store * is thread-safe.
 * A store handle must not be used across fork().
 */
#ifndef IDEM_STORE_H
#define IDEM_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define STORE_KEY_BYTES 32
#define STORE_LOG_SALT_BYTES 32
#define STORE_LEASE_ID_BYTES 16
#define STORE_FINGERPRINT_BYTES 32

/* A held record (see store_op.hold) carries this lease id: all zero bytes,
 * which no acquire hands out and no op's lease id matches. */
bool store_lease_is_held(const uint8_t lease_id[STORE_LEASE_ID_BYTES]);

/* Errors: every failing function returns one of these (negative). */
enum store_error {
    STORE_OK = 0,
    STORE_EIO = -1,      /* the backend failed (disk, LMDB error) */
    STORE_ENOMEM = -2,   /* an allocation failed */
    STORE_EINVAL = -3,   /* bad argument */
    STORE_ECORRUPT = -4, /* a stored record does not decode */
    STORE_EFULL = -5,    /* no room even after purging */
    STORE_ELAYOUT = -6,  /* a newer process raised the store's layout since this
                          * one opened it: this process can no longer write */
    STORE_EDEAD = -7,    /* the backend takes no more transactions, reads or
                          * writes, until the store is opened again (LMDB:
                          * MDB_PANIC, after a commit's meta page write failed;
                          * MDB_MAP_RESIZED, another process's larger map) */
};

const char *store_strerror(int err);

/* What lay behind the last store call on the calling thread that failed,
 * or was refused for room (STORE_EFULL, an op's STORE_FULL): writes a
 * sentence naming it into buf ("the file system is full (ENOSPC: No space
 * left on device)", "the map is full (MDB_MAP_FULL: ...), raise
 * store.map_size") and returns its LMDB or errno code, 0 (and "") when
 * there was none. For the caller's log: the store itself never logs.
 * Thread-safe (the cause is kept per thread). */
int store_last_cause(char *buf, size_t len);

/* A binary-safe span. The store never keeps the pointer after a call. */
struct store_span {
    const void *ptr;
    size_t len;
};

enum store_state {
    STORE_STATE_ABSENT = 0,
    STORE_STATE_IN_PROGRESS = 1,
    STORE_STATE_COMPLETE = 2,
};

/* Expected outcomes of an op: results, not errors. */
enum store_outcome {
    STORE_ACQUIRED = 1, /* acquire: new record, or a steal (op.stolen) */
    STORE_REPLAY,       /* acquire: live COMPLETE record, same fingerprint */
    STORE_BUSY,         /* acquire: live IN_PROGRESS record, same fingerprint */
    STORE_MISMATCH,     /* acquire: live record with another fingerprint */
    STORE_DONE,         /* complete/release/extend applied */
    STORE_FENCED,       /* complete/release refused, extend a no-op */
    STORE_FULL,         /* acquire/complete: no room after purging; not applied */
    STORE_NOT_FOUND,    /* forget: there was no record */
};

const char *store_outcome_name(enum store_outcome o);

/*
 * A decoded record. store_get() and a STORE_REPLAY acquire fill it with
 * copies owned by the record; store_record_clear() frees them (and is a no-op
 * on a zeroed record). headers is the opaque blob given to complete.
 */
struct store_record {
    enum store_state state;
    /* Always the stored id: all zero bytes mean a held record
     * (store_lease_is_held), so code that builds or copies an IN_PROGRESS
     * record must carry its id over, never leave it zeroed. */
    uint8_t lease_id[STORE_LEASE_ID_BYTES];
    int64_t lease_expires_ms;
    int64_t expires_ms;
    uint8_t fingerprint[STORE_FINGERPRINT_BYTES]; /* canonical (see store_op) */
    /* false for a record stored before the raw fingerprint was (record
     * version 1): it is compared on the canonical fingerprint alone. */
    bool has_raw_fingerprint;
    uint8_t raw_fingerprint[STORE_FINGERPRINT_BYTES];
    int status;       /* COMPLETE only */
    uint8_t *headers; /* COMPLETE only; owned */
    size_t headers_len;
    uint8_t *body; /* COMPLETE only; owned */
    size_t body_len;
};

void store_record_clear(struct store_record *rec);

enum store_op_kind {
    STORE_OP_ACQUIRE = 1,
    STORE_OP_COMPLETE,
    STORE_OP_RELEASE,
    STORE_OP_EXTEND,
    /* An operator's delete (idemproxy forget-key), outside the record model's
     * edges: the record goes whatever its state, and the key is as if never
     * used. A live IN_PROGRESS record (its lease running, not held) is left
     * alone, outcome STORE_BUSY, unless force is set: its holder may still
     * complete, and a retry would run beside it. STORE_DONE when a record
     * went, STORE_NOT_FOUND when there was none. */
    STORE_OP_FORGET,
};

/*
 * One edge to apply. Fields marked "in" are set by the caller, "out" by the
 * store. The spans of a complete must stay valid for the store_apply() call.
 *
 * An acquire carries two fingerprints of its request: the canonical one
 * (fingerprint: what decides "same request", CONTRACT.md section 3) and,
 * when has_raw_fingerprint is set, the raw one (the same hash over the body
 * as sent). Both are stored. A later acquire is the same request when both
 * have raw fingerprints and they are equal (equal bytes canonicalise
 * equally, so this is only a shortcut), or else when the canonical ones are
 * equal. An acquire without a raw fingerprint stores none, and such a
 * record is compared on the canonical fingerprint alone.
 */
struct store_op {
    enum store_op_kind kind;                    /* in */
    uint8_t key[STORE_KEY_BYTES];               /* in */
    uint8_t lease_id[STORE_LEASE_ID_BYTES];     /* in: complete/release/extend; out: acquire */
    uint8_t fingerprint[STORE_FINGERPRINT_BYTES];     /* in: acquire (canonical) */
    bool has_raw_fingerprint;                         /* in: acquire */
    uint8_t raw_fingerprint[STORE_FINGERPRINT_BYTES]; /* in: acquire, if has_raw_fingerprint */
    int64_t lease_ms;                           /* in: acquire, extend */
    /* in: extend: hold the record instead of keeping a lease alive. For an
     * action that ran but whose result cannot be stored: the record stays
     * IN_PROGRESS until lease_ms from now, under a lease id nobody holds
     * (store_lease_is_held), so its duplicates can tell at once that
     * waiting will not help, and no op of any owner can settle it. */
    bool hold;
    bool force;                                 /* in: forget (see STORE_OP_FORGET) */
    /* in: acquire: a lease of the caller's own whose holder is alive (its
     * request still runs), when the record may hold it. The acquire never
     * steals that lease, expired or not (STORE_BUSY instead): an expired
     * lease of a live holder means its heartbeat is queued behind a slow
     * commit (a stalling disk: the lease an extend or acquire stores is
     * counted from its transaction's start, and may be over by the time the
     * commit is durable), not that the holder is gone. */
    bool has_live_lease;
    uint8_t live_lease_id[STORE_LEASE_ID_BYTES];
    int64_t ttl_ms;                             /* in: acquire, complete */
    int status;                                 /* in: complete */
    struct store_span headers;                  /* in: complete */
    struct store_span body;                     /* in: complete */

    enum store_outcome outcome; /* out */
    bool stolen;                /* out: acquire took over an expired lease */
    int64_t lease_expires_ms;   /* out: ACQUIRED: ours; BUSY: the holder's */
    bool held;                  /* out: BUSY: the record is held (see hold) */
    /* out: with STORE_REPLAY, when want_replay is set, the stored record
     * (owned by the caller, free with store_record_clear()). */
    bool want_replay;           /* in */
    struct store_record replay; /* out */
};

struct store_clock {
    int64_t (*now_ms)(void *ctx); /* milliseconds; any epoch shared by all users of a store */
    void *ctx;
    /* The clock leases are measured on (lease_expires_ms), or NULL: now_ms.
     * It must be one that nobody sets: a step of the clock leases are on
     * would make live leases look expired, and their actions run twice. */
    int64_t (*lease_now_ms)(void *ctx);
    /* What names lease_now_ms's epoch, or NULL (no epoch: leases stay as
     * they are across opens). A store opened for writing under another
     * epoch than it last was takes every lease in it for expired: the
     * processes that held them are gone (the host rebooted). */
    const char *(*lease_epoch)(void *ctx);
};

/* Real time (CLOCK_REALTIME in ms) for TTLs, which outlive processes and
 * reboots; leases on CLOCK_BOOTTIME, which no one sets and every process of
 * the host shares, its epoch the kernel's boot id. */
extern const struct store_clock store_clock_realtime;

/* The lease clock's now for a store opened with clock (NULL: the default). */
int64_t store_clock_lease_now(const struct store_clock *clock);

struct store_options {
    const char *path;        /* directory; created if missing (unless read_only) */
    uint64_t map_size_bytes; /* the store's size cap; 0 means 1 GiB (read_only: the store's) */
    /* Opens an existing store for reading only (tools: check-store): creates
     * no directory or file, writes nothing, and fails when path holds no
     * store. Only the read calls (get, stats, scan, reader_check) work. */
    bool read_only;
    bool sync;               /* true: every commit is on disk when store_apply returns */
    /* Opens a store for writing on a file system store_open() would refuse
     * (NFS, FUSE, ...: see store_shared_fs_name()), for the operator who
     * knows only processes of one host ever open it. store_stats() names
     * the file system, so the caller can say so. */
    bool allow_shared_fs;
    /* Opens an existing store for writing without creating or upgrading
     * anything (tools: forget-key): a missing store, or one of an older
     * layout, is refused rather than created or raised, since raising it
     * would stop the older proxies running on it from writing. */
    bool keep_layout;
    const struct store_clock *clock; /* NULL: store_clock_realtime */
    /* A wait for LMDB's writer lock, or a hold of it, this long or longer
     * (ms) is a stall of the store's write path: the holders of leases, in
     * any process, could not commit their heartbeats through it. Every
     * process on the store then takes a lease that expired as live until a
     * full lease after the stall ended (see store_apply, STORE_BUSY), so a
     * disk that stalled for longer than a lease does not hand a live
     * holder's key to a duplicate. The proxy passes half the smallest
     * margin between a route's lease and its heartbeat. 0: not watched. */
    int64_t stall_ms;
    /* Optional: called once, on the thread whose call first returned
     * STORE_EDEAD, so the process can stop and be started again (the only
     * way back). It must not call into the store. */
    void (*on_dead)(void *ctx);
    void *on_dead_ctx;
};

struct store_stats {
    /* Write transactions committed by this handle in the records
     * environment (durable, as configured), and the ops applied in them:
     * completes, holds, forgets. */
    uint64_t commits;
    uint64_t ops_committed;
    /* Layout 4: the environment of the records in flight (inflight/ in the
     * store's directory, never flushed). has_inflight: this handle has it
     * open (a read-only look opens it only when it is of this boot). Its
     * commits by this handle and the ops in them (acquires, releases,
     * extends; the deletes that follow completes are not counted as ops),
     * and its entries now. */
    bool has_inflight;
    uint64_t inflight_commits;
    uint64_t inflight_ops_committed;
    uint64_t inflight_records;
    /* Records in the store now, both environments: a key whose complete
     * is in and whose entry in flight is not yet deleted counts twice. */
    uint64_t records;
    uint64_t map_size_bytes;
    uint64_t map_used_bytes; /* high-water mark of pages in use */
    uint64_t purge_sweeps;   /* key-order purge passes this handle started */
    /* Reader slots of dead processes cleared when this handle opened the
     * store (store_reader_check() reports later ones). */
    uint64_t stale_readers_cleared_at_open;
    /* The file system the store was opened on for writing when it is one
     * store_open() refuses unless allow_shared_fs ("FUSE", "NFS", ...);
     * NULL on a local one, and for a read-only open. */
    const char *shared_fs;
    /* map_size_bytes is the size the store records, larger than the one
     * asked for, taken because other processes had the store open (a
     * process beside others never maps less than they do). */
    bool map_size_from_store;
    /* Opened without sync (interval), its commits are flushed anyway now,
     * because a process opened with sync has the store open. */
    bool flushing_for_sync;
    /* The store's own random secret, made by the first writable open of
     * this version: the access log's key hash is keyed with it, so a log
     * reader cannot try guessable keys (order numbers) against the hashes.
     * has_log_salt is false only for a read-only open of a store no proxy
     * of this version has opened yet. */
    bool has_log_salt;
    uint8_t log_salt[STORE_LOG_SALT_BYTES];
    /* Which clock the stored leases were on when this handle opened the
     * store. A writable open puts them on this process's (settling them);
     * a read-only one (check-store) leaves them as found. */
    enum store_lease_clock {
        STORE_LEASES_THIS_BOOT = 0, /* this process's lease clock */
        STORE_LEASES_OTHER_BOOT,    /* a boot before this one: every lease but a
                                     * held record's has ended */
        STORE_LEASES_WALL,          /* layout 2: wall-clock times */
    } lease_clock;
};

/* Called by store_scan() for every record; return non-zero to stop. */
typedef int (*store_scan_fn)(const uint8_t key[STORE_KEY_BYTES], const struct store_record *rec,
                             void *ctx);
/* Called by store_scan_all() for every stored entry that is not a record:
 * its key as stored (key_len bytes, normally STORE_KEY_BYTES), the table
 * ("records" or "inflight"), the stored value's length and what is wrong. */
typedef void (*store_scan_bad_fn)(const uint8_t *key, size_t key_len, const char *table,
                                  size_t value_len, const char *detail, void *ctx);

/* Called by store_view() with the record as stored: its headers and body
 * point into the store and are valid only until fn returns (lmdb.h: "valid
 * only until the end of the transaction"); copy what must outlive it, and
 * never write through them or free them. */
typedef void (*store_view_fn)(const struct store_record *rec, void *ctx);

/*
 * A backend: the shape of Redis's connection types. Every function follows
 * the contract of the store_* wrapper of the same name below.
 */
struct store_ops {
    const char *name;
    int (*open)(const struct store_options *opt, void **impl, char *err, size_t errlen);
    void (*close)(void *impl);
    int (*apply)(void *impl, struct store_op *ops, size_t n);
    /* Optional (NULL: store_apply_purge() runs apply, then purge). */
    int (*apply_purge)(void *impl, struct store_op *ops, size_t n, size_t max_purge, size_t *purged,
                       bool *more);
    int (*get)(void *impl, const uint8_t key[STORE_KEY_BYTES], struct store_record *out);
    /* Optional (NULL: store_view() calls fn with a store_get() copy). */
    int (*view)(void *impl, const uint8_t key[STORE_KEY_BYTES], store_view_fn fn, void *ctx);
    int (*purge)(void *impl, size_t max_records, size_t *purged, bool *more);
    int (*reader_check)(void *impl, int *cleared);
    int (*stats)(void *impl, struct store_stats *out);
    /* bad NULL: stop at the first entry that does not decode (STORE_ECORRUPT). */
    int (*scan)(void *impl, store_scan_fn fn, store_scan_bad_fn bad, void *ctx);
    int (*sync)(void *impl);
};

/* The LMDB backend. */
extern const struct store_ops store_lmdb_ops;

/* What an LMDB store at path needs to open for writing, looked at without
 * making or changing anything (check-config): a local file system (unless
 * allow_shared_fs), path a directory this user may write in and search, or
 * (not there yet, and not a dangling symbolic link) the nearest directory
 * that exists above it one where it can be made, and a data.mdb there that
 * is not damaged (0 bytes); data.mdb, lock.mdb and durability.lock, where
 * present, readable and writable. STORE_OK, or an error with a message in
 * err (for a relative path, saying from which directory it was looked at).
 * Permissions are this process's effective ones: another user (the
 * service's) may see otherwise. */
int store_lmdb_path_check(const char *path, bool allow_shared_fs, char *err, size_t errlen);

struct store; /* opaque */

/* Opens a store with the given backend (NULL: LMDB). On failure returns a
 * negative error and writes a message to err. *out is owned by the caller.
 * opt->clock is copied; its ctx must outlive the store. A second open of a
 * path this process already has open fails with STORE_EINVAL (lmdb.h: an
 * environment must not be open twice in one process). */
int store_open(const struct store_ops *backend, const struct store_options *opt,
               struct store **out, char *err, size_t errlen);
/* store_close(NULL) is a no-op. */
void store_close(struct store *st);

/* Applies n ops in one atomic write transaction (see caveats). Returns 0 when
 * the transaction committed (each op has its outcome), negative otherwise.
 * Ops are checked first: an unknown kind, lease_ms or ttl_ms <= 0 where used,
 * a complete status outside 100..599 or a NULL span with a length fails the
 * call with STORE_EINVAL before anything is applied. A record that does not
 * decode fails it with STORE_ECORRUPT. The replay field of every op is
 * overwritten: clear a previous replay first. */
int store_apply(struct store *st, struct store_op *ops, size_t n);

/* store_apply() with purging on the side: after the ops, and in the same
 * write transaction (sharing its commit and, with sync, its fsync), deletes
 * up to max_purge purgeable records as store_purge() would (the same rules,
 * oldest expiry first; max_purge counts index entries handled, so *purged
 * may be less). The return value and every op's outcome are exactly those of
 * store_apply(ops, n): the purge part is best effort, and when it fails (a
 * full map, an I/O error) the transaction is run again without it and
 * *purged is 0 and *more false. *more is set when records were still due
 * once the budget ran out. n may be 0 (then it is a purge of max_purge in one
 * transaction whose errors are not reported); max_purge 0 is store_apply().
 * purged and more may be NULL. */
int store_apply_purge(struct store *st, struct store_op *ops, size_t n, size_t max_purge,
                      size_t *purged, bool *more);

/* Reads a record without the writer. Returns 0 and fills *out (state ABSENT
 * when there is none, or when it is a COMPLETE record past its TTL, which is
 * treated as absent even before a purge). *out needs no initialisation; on
 * an error it is left empty. */
int store_get(struct store *st, const uint8_t key[STORE_KEY_BYTES], struct store_record *out);

/* store_get() without the copy: calls fn once, on the calling thread, with
 * the record as store_get() would return it (state ABSENT when there is
 * none or it is past its TTL), borrowed for the call (store_view_fn), all
 * inside one read transaction. For a caller that copies only what it does
 * not already hold: a replay whose stored answer other replays of the same
 * record are sending. Returns 0 when fn was called, a negative error (and
 * fn not called) otherwise. fn must not call the store. */
int store_view(struct store *st, const uint8_t key[STORE_KEY_BYTES], store_view_fn fn, void *ctx);

/* Deletes up to max_records purgeable records, oldest expiry first, in one
 * write transaction, using the expiry index (never a full scan). *more is set
 * when more may be due. max_records 0 is STORE_EINVAL; purged and more may
 * be NULL. */
int store_purge(struct store *st, size_t max_records, size_t *purged, bool *more);

/* Clears reader slots left by dead processes (mdb_reader_check). */
int store_reader_check(struct store *st, int *cleared);
int store_stats(struct store *st, struct store_stats *out);
/* Visits every record in key order (for invariant checks and tools); a key
 * stored twice, which the store never writes, is visited twice in a row. */
int store_scan(struct store *st, store_scan_fn fn, void *ctx);
/* store_scan() that goes on past entries that do not decode: each is passed
 * to bad (and not to fn), and the scan returns 0 when it got to the end (or
 * fn stopped it). For check tools, which must count every damaged record. */
int store_scan_all(struct store *st, store_scan_fn fn, store_scan_bad_fn bad, void *ctx);
/* Flushes to disk (for durability "interval"). */
int store_sync(struct store *st);

/* Convenience single-edge calls: each is store_apply() of one op.
 * store_acquire() fills *out entirely (it need not be initialised) and always
 * asks for the replay copy: clear out->replay with store_record_clear().
 * Its request has one fingerprint, used as both the canonical and the raw
 * one (a body that canonicalisation leaves as it is). outcome may be NULL. */
int store_acquire(struct store *st, const uint8_t key[STORE_KEY_BYTES],
                  const uint8_t fingerprint[STORE_FINGERPRINT_BYTES], int64_t lease_ms,
                  int64_t ttl_ms, struct store_op *out);
int store_complete(struct store *st, const uint8_t key[STORE_KEY_BYTES],
                   const uint8_t lease_id[STORE_LEASE_ID_BYTES], int64_t ttl_ms, int status,
                   struct store_span headers, struct store_span body,
                   enum store_outcome *outcome);
/* STORE_OP_FORGET of one key. */
int store_forget(struct store *st, const uint8_t key[STORE_KEY_BYTES], bool force,
                 enum store_outcome *outcome);
int store_release(struct store *st, const uint8_t key[STORE_KEY_BYTES],
                  const uint8_t lease_id[STORE_LEASE_ID_BYTES], enum store_outcome *outcome);
int store_extend(struct store *st, const uint8_t key[STORE_KEY_BYTES],
                 const uint8_t lease_id[STORE_LEASE_ID_BYTES], int64_t lease_ms,
                 enum store_outcome *outcome);

/*
 * The record key: SHA-256 over the length-prefixed scope and key, so that
 * ("ab","c") and ("a","bc") differ and keys longer than LMDB's 511-byte key
 * limit fit. The scope already includes the scope_header hash if any.
 * It cannot fail short of OpenSSL running out of memory, and then it aborts:
 * a made-up key could merge two identities.
 */
void store_key_derive(const void *scope, size_t scope_len, const void *key, size_t key_len,
                      uint8_t out[STORE_KEY_BYTES]);

/*
 * The versioned record encoding (record.c), exposed for the fuzzer and the
 * tests. store_record_encode() returns a malloc'd buffer in *out (caller
 * frees); store_record_decode() never trusts its input and returns
 * STORE_ECORRUPT on anything malformed.
 */
int store_record_encode(const struct store_record *rec, uint8_t **out, size_t *out_len);
int store_record_decode(const void *buf, size_t len, struct store_record *out);

#endif
