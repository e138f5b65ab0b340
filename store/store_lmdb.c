/*
 * store_lmdb.c - the LMDB backend.
 *
 * Four named databases in one environment:
 *   records   32-byte record key -> encoded record (record.c): COMPLETE ones
 *   inflight  32-byte record key -> encoded record: IN_PROGRESS ones
 *   expiry    8-byte big-endian purge time + 32-byte record key -> empty
 *   meta      "layout" -> the layout of the other three, 4 bytes LE
 * A key is in at most one of records and inflight. IN_PROGRESS records live
 * apart because they are few at any time (one per request in flight): the
 * acquires of a batch then share a handful of leaf pages instead of writing
 * one leaf each of the large records tree, which the completion writes again
 * a commit later. Each commit writes fewer pages, and the pages are what a
 * durable commit costs (docs/benchmarks.md). A store written before the split
 * may hold IN_PROGRESS records in records; every op finds a record in either
 * and moves it to the table its new state belongs in.
 *
 * The layout (STORE_LAYOUT) is 1 for a store without meta (records and
 * expiry only), 2 since inflight, and 3 since leases are on the lease clock
 * (store_clock: CLOCK_BOOTTIME, not the wall clock, whose steps made live
 * leases look expired), with its epoch (the boot id) in meta. A process that does not know a layout
 * would not find every record in it: a record in flight where it does not
 * look could be acquired again and its request run twice. So opening a store
 * of a newer layout fails, and every write transaction checks the layout
 * first and fails (STORE_ELAYOUT: the proxy answers 503) once a newer process
 * has raised it. Processes older than layout 2 check nothing (README.md,
 * upgrading).
 * The expiry index lets purge walk records in order of the time they become
 * purgeable instead of scanning everything. Invariant, kept inside every
 * write transaction: each record has exactly one index entry, and its time
 * is the record's expires_ms. An entry that breaks the invariant (its record
 * is missing, or has another expiry) is stale and purge drops it.
 *
 * Writes: every store_apply() is one write transaction (the group commit).
 * LMDB admits one writer at a time across all processes sharing the path.
 * Reads: read-only transactions with MDB_NOTLS, so any thread may read and a
 * transaction is not tied to the thread that began it; finished read
 * transactions are reset and kept in a small pool so the hot path (replay
 * lookups) renews one instead of allocating one and taking a reader slot.
 */
#define _GNU_SOURCE 1 /* F_OFD_SETLK, F_OFD_GETLK */
#include "store.h"
#include "store_internal.h"
#include "store_fault.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <lmdb.h>
#include <openssl/crypto.h>
#include <pthread.h>
#include <pwd.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/types.h>
#include <unistd.h>

#define LMDB_DEFAULT_MAP_BYTES ((uint64_t)1 << 30)
#define LMDB_MAX_DBS 4
#define STORE_LAYOUT 4u
/* Layout 4's environment of the records in flight: a directory in the
 * store's, with a map of its own (one entry per request in flight). */
#define INFLIGHT_DIR "inflight"
#define INFLIGHT_MAP_BYTES ((uint64_t)64 << 20)
/* Internal, never returned: an op of F's writer needs R's writer lock (a
 * steal), so its batch runs again holding both. */
#define RC_NEED_RECORDS_LOCK (-100)
#define LAYOUT_KEY "layout"
#define EPOCH_KEY "lease_epoch"
#define LOG_SALT_KEY "log_salt"
/* The end of the latest stall of the write path any process saw, on the
 * lease clock (8 bytes, little endian; see stall_seen). */
#define STALL_KEY "stall_end"
/* Reader slots are shared by every process on the path; each pooled read
 * transaction holds one. */
#define LMDB_MAX_READERS 1024
#define LMDB_READ_POOL 64
/* Bytes between two pool slots: each on a cache line of its own, so the
 * workers taking and returning their read transactions do not pass lines
 * back and forth (a mutex over the pool cost ~2 % of a replay). */
#define READ_SLOT_BYTES 128
#define INDEX_KEY_BYTES (8 + STORE_KEY_BYTES)
/* When a batch hits MDB_MAP_FULL, apply purges at most this many batches of
 * this many records before retrying: bounded, so a full store of live
 * records costs a few short transactions, not a scan. */
#define FULL_PURGE_BATCH 256
#define FULL_PURGE_ROUNDS 8
/*
 * Purging a large backlog in key order (sweep_steps): once SWEEP_AFTER_CALLS
 * index-order purges in a row ended with due records left, and at most every
 * SWEEP_CHECK_EVERY_MS, the due entries are counted; when there are at least
 * SWEEP_MIN_DUE of them and at least 1/SWEEP_MIN_SHARE of the records, a pass
 * over the records in key order deletes the due ones. Each purge call looks
 * at up to SWEEP_EXAMINE_PER_DELETE records per record it may delete.
 */
#define SWEEP_AFTER_CALLS 16
#define SWEEP_CHECK_EVERY_MS 10000
#define SWEEP_MIN_DUE 20000
#define SWEEP_MIN_SHARE 8
#define SWEEP_EXAMINE_PER_DELETE 8
/* The most F entries a batch of R's writer purges (inflight_purge_share). */
#define INFLIGHT_PURGE_SHARE_MAX 32
/* Space rules, see space_claim(): a completion must leave the reserve free
 * (map/256, 16..256 pages) so that purge and release can always run, and an
 * acquire must leave the reserve plus headroom (map/64, 64 KiB..1 MiB, the
 * default max_body, or more: answer_keep()) for the answer it leads to. */
#define RESERVE_MIN_PAGES 16
#define RESERVE_MAX_PAGES 256
#define HEADROOM_MIN_BYTES ((uint64_t)64 << 10)
#define HEADROOM_MAX_BYTES ((uint64_t)1 << 20)
/* Pages a write transaction copies besides its values: the root-to-leaf
 * paths of the two trees, counted once per transaction, and about one page
 * per record written (leaf splits and copies of other leaves). */
#define TXN_PATH_PAGES 8
#define RECORD_PAGES 1
/* The data file is grown ahead of its use (posix_fallocate) by at least
 * this much at a time, so a growing store pays one such call per MiB
 * written, not one per transaction. */
#define FILE_GROW_MIN_BYTES ((uint64_t)1 << 20)
/* LMDB's page header, which an overflow value also carries. */
#define PAGE_HEADER_BYTES 16
/* Lease ids come from a buffer of kernel randomness this large: one
 * getrandom() per 256 acquires instead of one each. */
#define LEASE_RANDOM_BYTES 4096

/*
 * The LMDB calls that can fail once the store is open go through these, so
 * that a fault-injection build (IDEM_FAULT_INJECTION, tests/faults) can fail
 * the Nth of them: store_fault.h. Otherwise they are the calls themselves.
 * LMDB_WRITE marks puts and deletes (the calls that meet MDB_MAP_FULL);
 * LMDB_COMMIT frees the transaction on an injected failure too, as a failing
 * mdb_txn_commit() does.
 */
#ifdef IDEM_FAULT_INJECTION
#define LMDB_CALL(call)                                                                            \
    (store_fault_lmdb(__func__, #call, false) ? store_fault_lmdb_err(false) : (call))
#define LMDB_WRITE(call)                                                                           \
    (store_fault_lmdb(__func__, #call, true) ? store_fault_lmdb_err(true) : (call))
#define LMDB_COMMIT(txn)                                                                           \
    (store_fault_lmdb(__func__, "mdb_txn_commit(" #txn ")", false)                                 \
         ? (mdb_txn_abort(txn), store_fault_lmdb_err(false))                                       \
         : mdb_txn_commit(txn))
#else
#define LMDB_CALL(call) (call)
#define LMDB_WRITE(call) (call)
#define LMDB_COMMIT(txn) mdb_txn_commit(txn)
#endif
#ifdef IDEM_FAULT_INJECTION
#define FAULT_POINT(name) store_fault_point(name)
#else
#define FAULT_POINT(name) ((void)0)
#endif

struct lmdb_store {
    MDB_env *env;
    MDB_dbi records;
    MDB_dbi inflight;
    MDB_dbi expiry;
    MDB_dbi meta;
    struct store_clock clock;
    /* The lease clock's now in the write transaction under way: read with
     * the wall clock's once the writer lock is held; only touched inside a
     * write transaction. */
    int64_t lease_now;
    uint64_t page_bytes;
    uint64_t reserve_pages;
    uint64_t headroom_pages;
    /* What answers have taken, learnt from every completion this handle
     * attempted (see answer_keep()). Only touched inside a write
     * transaction, like lease_random. */
    /* Atomic: an acquire reads them in the other environment's writer
     * (layout 4: answer_keep of the in-flight handle). */
    _Atomic uint64_t answer_max_pages;
    _Atomic uint64_t answer_avg_pages_x16; /* moving average, in 1/16 pages */
    _Atomic uint64_t commits;
    _Atomic uint64_t ops_committed;
    _Atomic uint64_t sweeps; /* key-order purge passes started */

    /* Reset read transactions, one per slot. A thread starts at a slot of
     * its own (read_slot_hint) and nearly always finds there the
     * transaction it gave back, with one atomic exchange. */
    struct read_slot {
        _Atomic(MDB_txn *) txn;
        char pad[READ_SLOT_BYTES - sizeof(MDB_txn *)];
    } pool[LMDB_READ_POOL];

    bool read_only;           /* opened with store_options.read_only */
    bool keep_layout;         /* opened with store_options.keep_layout */
    /* Durability across processes (follow_sync): a process opened with
     * store_options.sync holds a shared lock on durability.lock for as long
     * as it has the store open; one opened without it (interval) looks for
     * such a lock at every write transaction, and while there is one its
     * commits are flushed as a sync process's are. -1: no file (read-only,
     * keep_layout). */
    int durability_fd;
    bool interval;            /* opened without store_options.sync, for writing */
    atomic_bool following_sync; /* MDB_NOSYNC is off for a sync process elsewhere */
    bool has_log_salt;          /* log_salt read from meta (or made) at open */
    uint8_t log_salt[STORE_LOG_SALT_BYTES];
    bool map_from_store;      /* mapped at the store's size, larger than asked */
    const char *shared_fs;    /* allowed by store_options.allow_shared_fs */
    uint64_t readers_cleared; /* dead readers' slots cleared at open */
    enum store_lease_clock lease_clock; /* as found at open (store_stats) */

    /* Stalls of the write path (store_options.stall_ms; 0: not watched).
     * stall_end is the end of the latest one this handle saw itself or read
     * from meta, on the lease clock; stall_unstamped one it saw and has not
     * yet written to meta for the other processes (0: none). Atomic: a
     * commit's end is noted after LMDB's writer lock is released. */
    int64_t stall_ms;
    _Atomic int64_t stall_end;
    _Atomic int64_t stall_unstamped;
    int64_t txn_began; /* the writer lock's taking, in the write txn under way */
    /* The last hold of the writer lock, shared by every process on the store
     * through durability.lock's first bytes (mapped; NULL: not available):
     * [0] when it was taken (lease clock, ms), written by the taker under
     * the lock; [1] (that taking's low 32 bits << 32) | how long it was held
     * (ms), written by the holder once it let go. See write_begin. */
    _Atomic int64_t *held;

    /* Random bytes for lease ids (new_lease_id). Only touched inside a
     * write transaction, and LMDB admits one at a time per environment,
     * across threads too, so LMDB's writer lock is what guards them. The
     * last lease_random_left bytes are unused; every byte is handed out
     * once (a handle is not used across fork(), store.h). */
    uint8_t lease_random[LEASE_RANDOM_BYTES];
    size_t lease_random_left;

    /* Key-order purge of a large backlog (sweep_steps). Like lease_random,
     * only touched inside a write transaction. */
    bool sweeping;        /* a pass over the records is under way */
    bool sweep_has_pos;   /* sweep_pos is where it goes on */
    uint8_t sweep_pos[STORE_KEY_BYTES];
    unsigned backlog_calls;      /* index-order purges in a row that left due records */
    int64_t sweep_next_check_ms; /* the backlog is measured at most this often */

    /*
     * Layout 4: the records in flight live in an environment of their own
     * (F: inflight/ in the store's directory), committed without a flush
     * and made again after a reboot (docs/design-inflight-environment.md).
     * In the records environment's handle (R), fl is F's handle (NULL in a
     * read-only handle when F is not of this boot, or there is none); in
     * F's, rec is R's. Whoever takes both writer locks takes R's first.
     */
    struct lmdb_store *fl;
    struct lmdb_store *rec;
    /* Inside a write transaction of this handle: a transaction of the other
     * environment (R's in F's writer, F's in R's), begun once this one's
     * writer lock was held. peer_locked: it is R's write transaction (a
     * steal, or a purge of F, holds both locks). need_peer_lock: an op
     * found that it needs R's lock, and the batch runs again with it. */
    MDB_txn *peer_txn;
    bool peer_locked;
    /* In F: the entries whose complete or hold R has committed, to delete
     * (if they still carry that lease) in F's next write transaction
     * rather than in one of their own on R's writer, whose answers would
     * wait for it (inflight_drop). Under drop_lock; dropping them late is
     * harmless (R's record shadows them), so they are kept in memory
     * only: a process that dies leaves them, as a crash between the two
     * commits always could. */
    /* In F, while R's writer purges F inside a batch of R's (under both
     * locks, inflight_purge_share): the batch's ops, whose completes and
     * holds are not committed yet. Their keys' entries must not be purged:
     * between F's commit and R's, an acquire would find neither. */
    const struct store_op *spare_ops;
    size_t spare_n;
    pthread_mutex_t drop_lock;
    struct drop *drops;
    size_t drops_len;
    size_t drops_cap;
    bool need_peer_lock;
    struct space *peer_space; /* R's space, claimed by F's acquires */

    char *path; /* the store's directory, as given (R's handle) */
    uint32_t layout; /* as found at open, before an upgrade */

    /* The environment's identity, for the same-process guard below. */
    dev_t dev;
    ino_t ino;
    pid_t pid;
    struct lmdb_store *next_open;
};

/*
 * lmdb.h: "Do not have open an LMDB database twice in the same process at
 * the same time": the second open would take the file locks the first one
 * relies on and reinitialise the shared reader table under it. So a process
 * keeps a list of the environments it has open and refuses a second one.
 * Entries carry the pid: a child after fork() inherits the list but not the
 * locks, and may open the path afresh.
 */
static pthread_mutex_t open_envs_lock = PTHREAD_MUTEX_INITIALIZER;
static struct lmdb_store *open_envs;

static bool open_envs_add(struct lmdb_store *s)
{
    bool added = true;
    pthread_mutex_lock(&open_envs_lock);
    for (struct lmdb_store *e = open_envs; e != NULL; e = e->next_open) {
        if (e->dev == s->dev && e->ino == s->ino && e->pid == s->pid) {
            added = false;
        }
    }
    if (added) {
        s->next_open = open_envs;
        open_envs = s;
    }
    pthread_mutex_unlock(&open_envs_lock);
    return added;
}

static void open_envs_remove(struct lmdb_store *s)
{
    pthread_mutex_lock(&open_envs_lock);
    for (struct lmdb_store **pp = &open_envs; *pp != NULL; pp = &(*pp)->next_open) {
        if (*pp == s) {
            *pp = s->next_open;
            break;
        }
    }
    pthread_mutex_unlock(&open_envs_lock);
}

/* The LMDB or errno code behind the last failure on this thread, for
 * store_last_cause(). The writer is one thread, so its failures and the
 * line it logs about them go together. */
static _Thread_local int last_cause;

/* A file system that cannot take more data: no space, a quota, or the
 * process's file size limit (RLIMIT_FSIZE, with SIGXFSZ ignored). */
static bool fs_full(int rc)
{
    return rc == ENOSPC || rc == EDQUOT || rc == EFBIG;
}

/* LMDB and errno codes to store errors. MDB_TXN_FULL counts as full: the
 * remedy is the same (smaller transactions). So does a full file system
 * (a commit that cannot write its pages): it must fail closed exactly as a
 * full map does, and purging frees pages inside the file for it too. */
static int map_err(int rc)
{
    int e = STORE_EIO;
    if (rc == 0) {
        e = STORE_OK;
    } else if (rc == MDB_MAP_FULL || rc == MDB_TXN_FULL || fs_full(rc)) {
        e = STORE_EFULL;
    } else if (rc == ENOMEM) {
        e = STORE_ENOMEM;
    } else if (rc == MDB_PANIC || rc == MDB_MAP_RESIZED) {
        /* MDB_MAP_RESIZED: another process (with a larger map_size) wrote
         * past this one's map. Taking the new size needs no transaction
         * open anywhere in the process; a new process maps it. */
        e = STORE_EDEAD;
    }
    if (rc != 0) {
        last_cause = rc;
    }
    return e;
}

int store_last_cause(char *buf, size_t len)
{
    int rc = last_cause;
    const char *what = "the store failed";
    const char *name = NULL;

    switch (rc) {
    case MDB_MAP_FULL: /* mdb_strerror() names these itself */
        what = "the map is full (raise store.map_size, or shorten TTLs)";
        break;
    case MDB_TXN_FULL:
        what = "a transaction was too large";
        break;
    case MDB_PANIC:
        what = "LMDB takes no more transactions after a commit it could not finish";
        break;
    case MDB_READERS_FULL:
        what = "every reader slot is taken (too many readers at once across the processes "
               "on the store)";
        break;
    case MDB_MAP_RESIZED:
        what = "another process grew the store past this process's map (its store.map_size "
               "is larger: give every process the same)";
        break;
    case ENOSPC:
        what = "the file system is full";
        name = "ENOSPC";
        break;
    case EDQUOT:
        what = "the disk quota is used up";
        name = "EDQUOT";
        break;
    case EFBIG:
        what = "the data file reached the file size limit";
        name = "EFBIG";
        break;
    case EIO:
        name = "EIO";
        break;
    default:
        break;
    }
    if (len == 0) {
        return rc;
    }
    if (rc == 0) {
        buf[0] = '\0';
    } else if (name != NULL) {
        snprintf(buf, len, "%s (%s: %s)", what, name, mdb_strerror(rc));
    } else if (rc == MDB_MAP_FULL || rc == MDB_TXN_FULL) {
        snprintf(buf, len, "%s (%s)", what, mdb_strerror(rc));
    } else {
        snprintf(buf, len, "%s (%d: %s)", what, rc, mdb_strerror(rc));
    }
    return rc;
}

/* The store's layout as txn sees it (0: not written, a store older than
 * the meta table). */
static int layout_read(const struct lmdb_store *s, MDB_txn *txn, uint32_t *out)
{
    MDB_val kv = {sizeof(LAYOUT_KEY) - 1, (void *)LAYOUT_KEY};
    MDB_val dv;
    int rc = mdb_get(txn, s->meta, &kv, &dv);

    *out = 0;
    if (rc == MDB_NOTFOUND) {
        return STORE_OK;
    }
    if (rc != 0) {
        return map_err(rc);
    }
    if (dv.mv_size != 4) {
        return STORE_ECORRUPT;
    }
    for (size_t i = 0; i < 4; i++) {
        *out |= (uint32_t)((const uint8_t *)dv.mv_data)[i] << (8 * i);
    }
    return STORE_OK;
}

/*
 * Durability is each process's own setting, but the store is one file. A
 * commit without a flush (MDB_NOSYNC, durability "interval") writes its
 * pages and then its meta page, and a power cut may leave the meta page on
 * disk without the pages: the meta page with the highest transaction id
 * wins, so the store then opens on a tree that was never written, and every
 * record in it is lost, those a sync process stored and answered included
 * (LMDB asserts, or reads garbage; tests/chaos/test_mixed_durability.py).
 * So while a process with durability "sync" has the store open, the others
 * flush their commits too. A sync process takes its shared lock before its
 * first transaction; an interval process looks for one after taking LMDB's
 * writer lock. An interval commit that looked before the lock was taken came
 * before the sync process's first commit, whose flush covers the file. What
 * an interval process writes while no sync process is there carries
 * MDB_NOSYNC's risk, as the configuration's documentation says.
 */
#define HELD_BYTES 64

/* Maps durability.lock's first HELD_BYTES as the store's shared record of
 * the last hold of the writer lock (lmdb_store.held). Best effort: without
 * it a process still notes the stalls it waits through or holds itself. The
 * file's lock (byte 0, F_OFD) is not its content, and older processes never
 * write to it. */
static void held_map(struct lmdb_store *s)
{
    struct stat sb;
    void *m;

    if (fstat(s->durability_fd, &sb) != 0 ||
        (sb.st_size < HELD_BYTES && ftruncate(s->durability_fd, HELD_BYTES) != 0)) {
        return;
    }
    m = mmap(NULL, HELD_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, s->durability_fd, 0);
    if (m != MAP_FAILED) {
        s->held = m;
    }
}

static int durability_open(struct lmdb_store *s, const char *path, bool sync, char *err,
                           size_t errlen)
{
    char name[PATH_MAX];
    struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};

    if (snprintf(name, sizeof name, "%s/durability.lock", path) >= (int)sizeof name) {
        snprintf(err, errlen, "store: path too long: %s", path);
        return STORE_EINVAL;
    }
    s->durability_fd = open(name, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (s->durability_fd < 0) {
        snprintf(err, errlen, "store: cannot open %s: %s", name, strerror(errno));
        return STORE_EIO;
    }
    if (sync && fcntl(s->durability_fd, F_OFD_SETLK, &fl) != 0) {
        snprintf(err, errlen, "store: cannot lock %s: %s", name, strerror(errno));
        return STORE_EIO;
    }
    s->interval = !sync;
    held_map(s);
    return STORE_OK;
}

/* Whether a process with durability "sync" has the store open. A look that
 * fails says yes: flushing is the safe side. */
static bool sync_process_present(const struct lmdb_store *s)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};

    if (fcntl(s->durability_fd, F_OFD_GETLK, &fl) != 0) {
        return true;
    }
    return fl.l_type != F_UNLCK;
}

/* Called with LMDB's writer lock held: the commit to come is flushed if a
 * sync process has the store open. Only the writer changes the flag, under
 * that lock (LMDB keeps its flushing descriptor for meta pages open even
 * with MDB_NOSYNC, for this). */
static void follow_sync(struct lmdb_store *s)
{
    bool follow;

    if (!s->interval) {
        return;
    }
    follow = sync_process_present(s);
    if (follow != s->following_sync &&
        mdb_env_set_flags(s->env, MDB_NOSYNC, follow ? 0 : 1) == MDB_SUCCESS) {
        s->following_sync = follow;
    }
}

/* Begins a write transaction on a store whose layout is still this code's:
 * another process may have raised it since this one opened the store. */
static int64_t lease_now_ms(const struct lmdb_store *s);

static void atomic_max(_Atomic int64_t *a, int64_t v)
{
    int64_t cur = atomic_load(a);
    while (cur < v && !atomic_compare_exchange_weak(a, &cur, v)) {
    }
}

/*
 * Stalls of the write path. A lease is counted from the start of the
 * transaction that stores it, and a holder keeps it by committing a
 * heartbeat: when the disk stalls a commit (a cloud volume's flush taking
 * seconds) every process's heartbeats queue behind it, and a lease can be
 * over by the time the write path moves again while its holder is alive and
 * its action running. A process never steals its own live requests' leases
 * (store_op.has_live_lease); for the others', every process notes a stall
 * it sees, a wait for the writer lock or a hold of it of stall_ms or more,
 * and writes its end to meta, so that no process on the store takes an
 * expired lease for a full lease after it (stall_credit): time for the
 * holder's heartbeat to get through, or for a dead holder's key to be
 * freed a lease later.
 */
static void stall_seen(struct lmdb_store *s, int64_t end)
{
    atomic_max(&s->stall_end, end);
    atomic_max(&s->stall_unstamped, end);
}

/*
 * With the writer lock just taken: how long did the previous holder, of any
 * process, hold it? A process that waited less than stall_ms for it (its
 * op came late in a long hold) would otherwise take a lease that ran out
 * during that hold, before the holder's own process had written the stall
 * to meta: its next commit comes after this one. The holder publishes its
 * hold once it lets go (held_publish); if it has not yet, it let go just
 * now, and its hold is counted up to now: at worst a hold counted too long,
 * which delays a steal by a lease, never brings one forward.
 */
static void held_check(struct lmdb_store *s)
{
    int64_t taken;
    int64_t tagged;
    int64_t hold;

    if (s->held == NULL) {
        return;
    }
    taken = atomic_load(&s->held[0]);
    tagged = atomic_load(&s->held[1]);
    if (taken > 0 && taken <= s->txn_began) {
        hold = (uint32_t)((uint64_t)tagged >> 32) == (uint32_t)taken
                   ? (int64_t)((uint64_t)tagged & 0xffffffffu)
                   : s->txn_began - taken;
        if (hold >= s->stall_ms) {
            stall_seen(s, taken + hold);
        }
    }
    atomic_store(&s->held[0], s->txn_began);
}

static void held_publish(struct lmdb_store *s, int64_t began, int64_t end)
{
    int64_t hold = end - began;

    if (s->held == NULL) {
        return;
    }
    hold = hold < 0 ? 0 : hold > 0xffffffff ? 0xffffffff : hold;
    atomic_store(&s->held[1], (int64_t)(((uint64_t)(uint32_t)began << 32) | (uint64_t)hold));
}

static int write_begin(struct lmdb_store *s, MDB_txn **out)
{
    MDB_txn *txn = NULL;
    uint32_t layout = 0;
    int64_t asked = s->stall_ms > 0 ? lease_now_ms(s) : 0;
    int rc = map_err(LMDB_CALL(mdb_txn_begin(s->env, NULL, 0, &txn)));

    if (rc == STORE_OK) {
        if (s->stall_ms > 0) {
            s->txn_began = lease_now_ms(s);
            if (s->txn_began - asked >= s->stall_ms) {
                stall_seen(s, s->txn_began);
            }
            held_check(s);
        }
        follow_sync(s);
        rc = layout_read(s, txn, &layout);
        if (rc == STORE_OK && layout != STORE_LAYOUT) {
            rc = STORE_ELAYOUT;
        }
        if (rc != STORE_OK) {
            mdb_txn_abort(txn);
            txn = NULL;
        }
    }
    *out = txn;
    return rc;
}

/* The end of a hold of the writer lock that began at began: published for
 * the next taker (held_publish), and noted if long enough to be a stall (a
 * flush that took seconds). */
static void write_done(struct lmdb_store *s, int64_t began)
{
    if (s->stall_ms > 0) {
        int64_t end = lease_now_ms(s);
        held_publish(s, began, end);
        if (end - began >= s->stall_ms) {
            stall_seen(s, end);
        }
    }
}

/* LMDB_COMMIT of a transaction write_begin() began. */
static int write_commit(struct lmdb_store *s, MDB_txn *txn)
{
    int64_t began = s->txn_began;
    int rc = LMDB_COMMIT(txn);

    write_done(s, began);
    return rc;
}

/* mdb_txn_abort of a transaction write_begin() began: a long one held the
 * writer lock as long as a commit would have (a purge's scan stalled on
 * page faults, say). */
static void write_abort(struct lmdb_store *s, MDB_txn *txn)
{
    int64_t began = s->txn_began;

    mdb_txn_abort(txn);
    write_done(s, began);
}

static int stall_read(MDB_txn *txn, MDB_dbi meta, int64_t *end)
{
    MDB_val kv = {sizeof(STALL_KEY) - 1, (void *)STALL_KEY};
    MDB_val v;
    int rc = LMDB_CALL(mdb_get(txn, meta, &kv, &v));
    uint64_t u = 0;

    *end = 0;
    if (rc == MDB_NOTFOUND) {
        return STORE_OK;
    }
    if (rc != 0) {
        return map_err(rc);
    }
    if (v.mv_size == 8) { /* another size: not ours, taken as none */
        for (int i = 7; i >= 0; i--) {
            u = (u << 8) | ((const uint8_t *)v.mv_data)[i];
        }
        *end = u <= INT64_MAX ? (int64_t)u : 0;
    }
    return STORE_OK;
}

/* Writes a stall this handle saw to meta, in a child transaction so that a
 * failure (a full map) leaves the batch as it was: the stamp is then tried
 * again with the next batch. Returns the end written, 0 if none. */
static int64_t stall_stamp(struct lmdb_store *s, MDB_txn *txn)
{
    int64_t pending = atomic_load(&s->stall_unstamped);
    MDB_txn *child = NULL;
    int64_t have = 0;
    uint8_t b[8];
    MDB_val kv = {sizeof(STALL_KEY) - 1, (void *)STALL_KEY};
    MDB_val v = {sizeof(b), b};

    if (pending <= 0 || LMDB_CALL(mdb_txn_begin(s->env, txn, 0, &child)) != 0) {
        return 0;
    }
    if (stall_read(child, s->meta, &have) != STORE_OK) {
        mdb_txn_abort(child);
        return 0;
    }
    if (have >= pending && have <= s->lease_now) {
        mdb_txn_abort(child); /* another process wrote a later one */
        return pending;
    }
    /* (One later than now is of another boot, left by an older process
     * that switched the epoch without deleting it: overwritten, or no stall
     * of this boot would be written until its clock passed that value.) */
    for (int i = 0; i < 8; i++) {
        b[i] = (uint8_t)((uint64_t)pending >> (8 * i));
    }
    if (LMDB_WRITE(mdb_put(child, s->meta, &kv, &v, 0)) != 0) {
        mdb_txn_abort(child);
        return 0;
    }
    return LMDB_COMMIT(child) == 0 ? pending : 0; /* frees child either way */
}

static int64_t now_ms(const struct lmdb_store *s)
{
    return s->clock.now_ms(s->clock.ctx);
}

static int64_t lease_now_ms(const struct lmdb_store *s)
{
    return store_clock_lease_now(&s->clock);
}

/* A time on the lease clock as a wall-clock time, by the two clocks' nows
 * (saturating: values come from records, which trust nothing). */
static int64_t lease_to_wall(int64_t lease_ms, int64_t lease_now, int64_t wall_now)
{
    int64_t d;
    if (__builtin_sub_overflow(lease_ms, lease_now, &d) ||
        __builtin_add_overflow(wall_now, d, &d)) {
        return lease_ms > lease_now ? INT64_MAX : INT64_MIN;
    }
    return d;
}

/* now + delta, saturating at INT64_MAX (delta > 0 is checked by store.c;
 * now may be negative: a test clock). */
static int64_t add_ms(int64_t now, int64_t delta)
{
    int64_t sum;
    return __builtin_add_overflow(now, delta, &sum) ? INT64_MAX : sum;
}

/* The index orders by time with memcmp, so the time is stored big-endian
 * with the sign bit flipped: negative times (a test clock) sort first. */
static void index_key(uint8_t out[INDEX_KEY_BYTES], int64_t t, const uint8_t key[STORE_KEY_BYTES])
{
    uint64_t u = (uint64_t)t ^ ((uint64_t)1 << 63);
    for (size_t i = 0; i < 8; i++) {
        out[i] = (uint8_t)(u >> (56 - 8 * i));
    }
    memcpy(out + 8, key, STORE_KEY_BYTES);
}

static int64_t index_time(const uint8_t in[INDEX_KEY_BYTES])
{
    uint64_t u = 0;
    int64_t t;
    for (size_t i = 0; i < 8; i++) {
        u = (u << 8) | in[i];
    }
    u ^= (uint64_t)1 << 63;
    if (u <= (uint64_t)INT64_MAX) {
        t = (int64_t)u;
    } else {
        t = -(int64_t)(UINT64_MAX - u) - 1;
    }
    return t;
}

static int index_put(struct lmdb_store *s, MDB_txn *txn, int64_t t,
                     const uint8_t key[STORE_KEY_BYTES])
{
    uint8_t k[INDEX_KEY_BYTES];
    MDB_val kv = {sizeof(k), k};
    MDB_val dv = {0, NULL};

    index_key(k, t, key);
    return map_err(LMDB_WRITE(mdb_put(txn, s->expiry, &kv, &dv, 0)));
}

/* Deleting an entry that is not there is fine: the invariant says it is,
 * but purge copes with either. */
static int index_del(struct lmdb_store *s, MDB_txn *txn, int64_t t,
                     const uint8_t key[STORE_KEY_BYTES])
{
    uint8_t k[INDEX_KEY_BYTES];
    MDB_val kv = {sizeof(k), k};
    int rc;

    index_key(k, t, key);
    rc = LMDB_WRITE(mdb_del(txn, s->expiry, &kv, NULL));
    return rc == MDB_NOTFOUND ? STORE_OK : map_err(rc);
}

/* Where a record is: COMPLETE ones in records, IN_PROGRESS ones in
 * inflight (and, written before the split, in records too). */
enum rec_table { REC_NONE = 0, REC_RECORDS, REC_INFLIGHT };

static MDB_dbi table_dbi(const struct lmdb_store *s, enum rec_table t)
{
    return t == REC_INFLIGHT ? s->inflight : s->records;
}

/* Loads a record into a view that borrows from the transaction, looking in
 * inflight first when inflight_first (ops that need it IN_PROGRESS), else
 * in records first. *where says which table holds the key, set even when
 * the value does not decode (STORE_ECORRUPT), so that it can be deleted. */
static int record_load(struct lmdb_store *s, MDB_txn *txn, const uint8_t key[STORE_KEY_BYTES],
                       struct store_record_view *v, bool *found, enum rec_table *where,
                       bool inflight_first)
{
    const enum rec_table order[2] = {inflight_first ? REC_INFLIGHT : REC_RECORDS,
                                     inflight_first ? REC_RECORDS : REC_INFLIGHT};
    MDB_val kv = {STORE_KEY_BYTES, (void *)key};
    MDB_val dv;
    int rc = STORE_OK;

    *found = false;
    *where = REC_NONE;
    memset(v, 0, sizeof(*v));
    for (size_t i = 0; i < 2; i++) {
        int got = LMDB_CALL(mdb_get(txn, table_dbi(s, order[i]), &kv, &dv));
        if (got == MDB_NOTFOUND) {
            continue;
        }
        if (got != 0) {
            rc = map_err(got);
        } else {
            *where = order[i];
            rc = store_record_parse(dv.mv_data, dv.mv_size, v);
            *found = rc == STORE_OK;
        }
        break;
    }
    return rc;
}

/* Deletes the key from table t (REC_NONE: nothing to delete). */
static int record_del(struct lmdb_store *s, MDB_txn *txn, const uint8_t key[STORE_KEY_BYTES],
                      enum rec_table t)
{
    MDB_val kv = {STORE_KEY_BYTES, (void *)key};
    int rc = t == REC_NONE ? MDB_NOTFOUND : LMDB_WRITE(mdb_del(txn, table_dbi(s, t), &kv, NULL));
    return rc == MDB_NOTFOUND ? STORE_OK : map_err(rc);
}

/* Encodes v straight into space LMDB reserves for the value, in the table
 * its state belongs in, and deletes the key from the table it was in
 * (from), when that is the other one. v must not borrow from the database
 * itself (the reserve may move pages): every caller builds it from its own
 * fields and caller spans. */
static int record_put(struct lmdb_store *s, MDB_txn *txn, const uint8_t key[STORE_KEY_BYTES],
                      const struct store_record_view *v, enum rec_table from)
{
    enum rec_table to = v->state == STORE_STATE_IN_PROGRESS ? REC_INFLIGHT : REC_RECORDS;
    MDB_val kv = {STORE_KEY_BYTES, (void *)key};
    MDB_val dv = {0, NULL};
    int rc = store_record_size(v, &dv.mv_size);

    if (rc == STORE_OK) {
        rc = map_err(LMDB_WRITE(mdb_put(txn, table_dbi(s, to), &kv, &dv, MDB_RESERVE)));
    }
    if (rc == STORE_OK) {
        store_record_write(v, dv.mv_data);
        if (from != to) {
            rc = record_del(s, txn, key, from);
        }
    }
    return rc;
}

/* Fills buf from the kernel's CSPRNG. */
static int fill_random(uint8_t *buf, size_t len)
{
    int rc = STORE_OK;
    size_t got = 0;
    while (got < len) {
        ssize_t n = getrandom(buf + got, len - got, 0);
        if (n < 0 && errno != EINTR) {
            rc = STORE_EIO;
            break;
        }
        if (n > 0) {
            got += (size_t)n;
        }
    }
    return rc;
}

/* A lease id is a capability: whoever knows it may complete the record, so
 * it comes from the kernel's CSPRNG, read LEASE_RANDOM_BYTES at a time.
 * Called inside a write transaction only (see struct lmdb_store). */
static int new_lease_id(struct lmdb_store *s, uint8_t out[STORE_LEASE_ID_BYTES])
{
    int rc = STORE_OK;
    uint8_t *p;

    if (s->lease_random_left < STORE_LEASE_ID_BYTES) {
        s->lease_random_left = 0; /* a failed refill leaves nothing usable */
        rc = fill_random(s->lease_random, sizeof(s->lease_random));
        if (rc != STORE_OK) {
            goto out;
        }
        s->lease_random_left = sizeof(s->lease_random);
    }
    p = s->lease_random + sizeof(s->lease_random) - s->lease_random_left;
    memcpy(out, p, STORE_LEASE_ID_BYTES);
    if (store_lease_is_held(out)) {
        out[0] = 1; /* all zero marks a held record; odds 2^-128, but never */
    }
    /* Handed out: the handle keeps no copy of a live capability. */
    OPENSSL_cleanse(p, STORE_LEASE_ID_BYTES);
    s->lease_random_left -= STORE_LEASE_ID_BYTES;
out:
    return rc;
}

static bool lease_matches(const struct store_record_view *v, const uint8_t lease_id[])
{
    /* Constant time, so a caller cannot learn a lease id byte by byte. A
     * held record's id is nobody's: an op carrying it (a caller that never
     * acquired) is fenced like any other stranger. */
    return CRYPTO_memcmp(v->lease_id, lease_id, STORE_LEASE_ID_BYTES) == 0 &&
           !store_lease_is_held(lease_id);
}

/* The pool slot this thread starts at: threads get consecutive ones. */
static unsigned read_slot_hint(void)
{
    static atomic_uint next_hint;
    static _Thread_local unsigned hint;
    static _Thread_local bool hinted;

    if (!hinted) {
        hint = atomic_fetch_add_explicit(&next_hint, 1, memory_order_relaxed) % LMDB_READ_POOL;
        hinted = true;
    }
    return hint;
}

/* Takes a read transaction from the pool (renewed to the latest snapshot)
 * or begins a new one. */
static int read_begin(struct lmdb_store *s, MDB_txn **out)
{
    MDB_txn *txn = NULL;
    int rc = STORE_OK;
    unsigned h = read_slot_hint();

    for (unsigned i = 0; i < LMDB_READ_POOL && txn == NULL; i++) {
        struct read_slot *sl = &s->pool[(h + i) % LMDB_READ_POOL];
        /* A plain load first: an empty slot costs no locked instruction. */
        if (atomic_load_explicit(&sl->txn, memory_order_relaxed) != NULL) {
            txn = atomic_exchange_explicit(&sl->txn, NULL, memory_order_acquire);
        }
    }
    if (txn != NULL && LMDB_CALL(mdb_txn_renew(txn)) != 0) {
        mdb_txn_abort(txn);
        txn = NULL;
    }
    if (txn == NULL) {
        int lrc = LMDB_CALL(mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn));
        int cleared = 0;
        /* Every reader slot taken: those of processes that died holding
         * them (SIGKILL leaves them) are cleared, and the begin tried once
         * more, rather than failing this call until the next periodic
         * check. */
        if (lrc == MDB_READERS_FULL && mdb_reader_check(s->env, &cleared) == 0 && cleared > 0) {
            lrc = LMDB_CALL(mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn));
        }
        rc = map_err(lrc);
    }
    *out = rc == STORE_OK ? txn : NULL;
    return rc;
}

/* Ends a read transaction: reset (it no longer pins a snapshot, so writers
 * can reuse pages) and pooled, or aborted when the pool is full. */
static void read_end(struct lmdb_store *s, MDB_txn *txn)
{
    unsigned h = read_slot_hint();

    mdb_txn_reset(txn);
    for (unsigned i = 0; i < LMDB_READ_POOL && txn != NULL; i++) {
        struct read_slot *sl = &s->pool[(h + i) % LMDB_READ_POOL];
        MDB_txn *expected = NULL;
        if (atomic_load_explicit(&sl->txn, memory_order_relaxed) == NULL &&
            atomic_compare_exchange_strong_explicit(&sl->txn, &expected, txn, memory_order_release,
                                                    memory_order_relaxed)) {
            txn = NULL;
        }
    }
    if (txn != NULL) {
        mdb_txn_abort(txn);
    }
}

/* Free pages on LMDB's freelist that the next write transaction may reuse.
 * A cursor on the freelist (dbi 0) is allowed only in a read transaction.
 * Each entry is keyed by the transaction that freed its pages, and those
 * pages are reusable only once that transaction is older than the last
 * committed one (LMDB keeps the previous snapshot intact for crash safety).
 * The value is an array of page numbers led by its count; memcpy because
 * LMDB aligns values only to 2 bytes. */
static int freelist_pages(struct lmdb_store *s, uint64_t *out)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    MDB_envinfo info;
    MDB_val kv;
    MDB_val dv;
    MDB_cursor_op step = MDB_FIRST;
    uint64_t total = 0;
    int rc = map_err(mdb_env_info(s->env, &info));

    if (rc == STORE_OK) {
        rc = read_begin(s, &txn);
    }
    if (rc != STORE_OK) {
        goto out;
    }
    rc = map_err(LMDB_CALL(mdb_cursor_open(txn, 0, &cur)));
    while (rc == STORE_OK) {
        size_t freed_by = 0;
        size_t count = 0;
        int got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, step));
        step = MDB_NEXT;
        if (got == MDB_NOTFOUND) {
            break;
        }
        if (got != 0) {
            rc = map_err(got);
        } else if (kv.mv_size == sizeof(freed_by) && dv.mv_size >= sizeof(count)) {
            memcpy(&freed_by, kv.mv_data, sizeof(freed_by));
            memcpy(&count, dv.mv_data, sizeof(count));
            if (freed_by < info.me_last_txnid) {
                total += count;
            }
        }
    }
    if (cur != NULL) {
        mdb_cursor_close(cur);
    }
    read_end(s, txn);
out:
    *out = total;
    return rc;
}

/*
 * Free space as one write transaction sees it. LMDB cannot delete anything
 * in a map that is full to the last page (every write copies pages), so a
 * store that let completions fill it would stay full even once every record
 * expired. And an acquire that fits while the answer it leads to does not
 * would let the proxy run an action whose result cannot be stored: the
 * store must be full for new keys before it is full for completions
 * (CONTRACT.md section 3, "full after purging": fail closed).
 *
 * So each acquire and complete claims an estimate of the pages it writes,
 * and must leave the reserve free (completes) or the reserve plus headroom
 * (acquires); a claim that does not fit fails like MDB_MAP_FULL and goes
 * through the same purge and retry. Free pages are those past the map's
 * high-water mark and, only when those are not enough, the reusable ones on
 * the freelist, so the usual cost is reading the meta page once per batch.
 * It is an estimate (contiguity is not counted, nor readers pinning old
 * pages), which is all a reserve needs: LMDB itself still refuses what does
 * not fit.
 *
 * The map is not the only limit: LMDB grows the data file as it writes past
 * its end, and on a full file system that write fails at commit, after an
 * acquire let the action run. So the same claim also holds for the file:
 * when the pages between the last used page and the file's end do not
 * cover it, the file is grown first (posix_fallocate, at least
 * FILE_GROW_MIN_BYTES at a time, never past the map), so it runs up to
 * about reserve + headroom + 1 MiB ahead of its used pages. Where it
 * cannot grow, the freelist (inside the file) must cover the rest. A file
 * system that cannot give the room (ENOSPC, EDQUOT, EFBIG) fails the
 * claim like MDB_MAP_FULL, before anything ran: the room for an
 * acquire's answer, and the reserve purge needs, are on disk, not just in
 * the map. A file system without fallocate (EOPNOTSUPP) is trusted, as
 * before: LMDB's own write then says whether it fits (map_err()).
 */
struct space {
    bool tail_known;
    bool list_known;
    uint64_t used_pages; /* the map's high-water mark */
    uint64_t map_tail;   /* pages past it that the map still allows */
    uint64_t file_tail;  /* pages past it inside the data file (<= map_tail) */
    uint64_t listed;     /* reusable pages on the freelist, once list_known */
    uint64_t claimed;
};

/* Grows the data file by at least missing pages (see struct space). */
static int file_grow(struct lmdb_store *s, struct space *sp, uint64_t missing)
{
    uint64_t room = sp->map_tail - sp->file_tail;
    uint64_t chunk = FILE_GROW_MIN_BYTES / s->page_bytes;
    off_t at = (off_t)((sp->used_pages + sp->file_tail) * s->page_bytes);
    int fd = -1;
    int err;
    int rc = STORE_OK;

    if (chunk < missing) {
        chunk = missing;
    }
    if (chunk > room) {
        chunk = room;
    }
    if (mdb_env_get_fd(s->env, &fd) != 0) {
        sp->file_tail = sp->map_tail; /* cannot tell: leave it to LMDB */
        goto out;
    }
    err = posix_fallocate(fd, at, (off_t)(chunk * s->page_bytes));
    if (err != 0 && chunk > missing) {
        chunk = missing; /* the exact need may still fit */
        err = posix_fallocate(fd, at, (off_t)(chunk * s->page_bytes));
    }
    if (err == 0) {
        sp->file_tail += chunk;
    } else if (fs_full(err)) {
        last_cause = err;
        rc = STORE_EFULL;
    } else {
        sp->file_tail = sp->map_tail; /* no fallocate here: leave it to LMDB */
    }
out:
    return rc;
}

static int space_claim(struct lmdb_store *s, struct space *sp, uint64_t need, uint64_t keep)
{
    int rc = STORE_OK;
    uint64_t want;

    if (!sp->tail_known) {
        MDB_envinfo info;
        struct stat st;
        int fd = -1;
        uint64_t map_pages;
        rc = map_err(mdb_env_info(s->env, &info));
        if (rc != STORE_OK) {
            goto out;
        }
        map_pages = (uint64_t)info.me_mapsize / s->page_bytes;
        sp->used_pages = (uint64_t)info.me_last_pgno + 1;
        sp->map_tail = map_pages > sp->used_pages ? map_pages - sp->used_pages : 0;
        sp->file_tail = sp->map_tail; /* unless the file says less */
        if (mdb_env_get_fd(s->env, &fd) == 0 && fstat(fd, &st) == 0) {
            uint64_t file_pages = (uint64_t)st.st_size / s->page_bytes;
            uint64_t in_file = file_pages > sp->used_pages ? file_pages - sp->used_pages : 0;
            sp->file_tail = in_file < sp->map_tail ? in_file : sp->map_tail;
        }
        sp->tail_known = true;
        sp->claimed = TXN_PATH_PAGES;
    }
    want = sp->claimed + need + keep;
    if (sp->map_tail < want && !sp->list_known) {
        rc = freelist_pages(s, &sp->listed);
        if (rc != STORE_OK) {
            goto out;
        }
        sp->list_known = true;
    }
    if (sp->map_tail + sp->listed < want) {
        last_cause = MDB_MAP_FULL;
        rc = STORE_EFULL;
        goto out;
    }
    /* The file is grown while the map allows, even where the freelist
     * would do: then the usual batch finds the file's own slack enough
     * and reads neither the freelist nor calls fallocate. */
    if (sp->file_tail < want && sp->file_tail < sp->map_tail) {
        rc = file_grow(s, sp, want - sp->file_tail);
        if (rc == STORE_EFULL) {
            rc = STORE_OK; /* the freelist may still cover it, below */
        } else if (rc != STORE_OK) {
            goto out;
        }
    }
    if (sp->file_tail < want && !sp->list_known) {
        rc = freelist_pages(s, &sp->listed);
        if (rc != STORE_OK) {
            goto out;
        }
        sp->list_known = true;
    }
    if (sp->file_tail + sp->listed < want) {
        rc = STORE_EFULL; /* file_grow() said why */
        goto out;
    }
    sp->claimed += need;
out:
    return rc;
}

/* The pages a value of n bytes takes once it no longer fits in a leaf: a
 * run of overflow pages. Small values are counted as one page. */
static uint64_t value_pages(const struct lmdb_store *s, size_t n)
{
    return ((uint64_t)n + PAGE_HEADER_BYTES + s->page_bytes - 1) / s->page_bytes;
}

/* The result of one op, kept apart from the op until the transaction
 * commits: a failed call leaves the caller's ops untouched. */
struct op_result {
    enum store_outcome outcome;
    bool stolen;
    bool held;
    int64_t lease_expires_ms;
    uint8_t lease_id[STORE_LEASE_ID_BYTES];
    struct store_record replay;
};

static void result_clear(struct op_result *r)
{
    store_record_clear(&r->replay);
    memset(r, 0, sizeof(*r));
}

/* The fingerprint rule of store.h (struct store_op): raw fingerprints
 * first, where both sides have one, then the canonical ones. The proxy's
 * read-side lookup applies the same rule (idem_decide_lookup). */
static bool same_request(const struct store_record_view *cur, const struct store_op *op)
{
    if (cur->has_raw_fingerprint && op->has_raw_fingerprint &&
        memcmp(cur->raw_fingerprint, op->raw_fingerprint, STORE_FINGERPRINT_BYTES) == 0) {
        return true;
    }
    return memcmp(cur->fingerprint, op->fingerprint, STORE_FINGERPRINT_BYTES) == 0;
}

/*
 * The room an acquire must leave for answers still to come, besides the
 * reserve: its own answer, at least the headroom and at least the largest
 * answer stored so far, plus one average answer for every
 * record in flight, all processes' (the inflight table's count), whose
 * answers are also still to come. With the headroom alone (map/64, at most
 * 1 MiB), a store nearly full ran every new key whose answer was larger
 * and stored none of them: each completion failed and held its key
 * (`unstored`), the next acquire fitted again, and so on. Now a large
 * answer stored once raises the bar for new keys, which get 503 before
 * their action runs. Still an estimate: the first answer of a new, larger
 * size, or a burst of them, can find no room (`unstored`, the record held,
 * never run twice). Learnt rather than configured: the store does not know
 * upstream.max_response, and reserving that much per request would refuse
 * most keys of a busy proxy long before the map is full.
 */
static int answer_keep(struct lmdb_store *s, MDB_txn *txn, uint64_t *keep)
{
    MDB_stat st;
    /* Answers are stored in R: its learning and headroom count, and (in
     * F's writer, layout 4) F's records in flight. */
    const struct lmdb_store *r = s->rec != NULL ? s->rec : s;
    uint64_t max = atomic_load(&r->answer_max_pages);
    uint64_t own = r->headroom_pages > max ? r->headroom_pages : max;
    uint64_t avg = (atomic_load(&r->answer_avg_pages_x16) + 15) / 16;
    int rc = map_err(LMDB_CALL(mdb_stat(txn, s->inflight, &st)));

    if (rc == STORE_OK) {
        *keep = own + (uint64_t)st.ms_entries * avg;
    }
    return rc;
}

static void answer_learn(struct lmdb_store *s, uint64_t pages)
{
    uint64_t avg = atomic_load(&s->answer_avg_pages_x16);

    if (pages > atomic_load(&s->answer_max_pages)) {
        atomic_store(&s->answer_max_pages, pages);
    }
    atomic_store(&s->answer_avg_pages_x16, avg - avg / 8 + pages * 2);
}

/* Until when an IN_PROGRESS record whose lease expired at lease_expires
 * is still taken as live: a full lease (the taker's, lease_ms) after the
 * latest stall of the write path this handle or, through meta, any other
 * process on the store saw (stall_seen). An end on meta later than now is
 * of another boot of the lease clock, and ignored. */
static int stall_credit(struct lmdb_store *s, MDB_txn *txn, int64_t lease_expires, int64_t lease_ms,
                        int64_t *until)
{
    int64_t end = 0;
    int rc = stall_read(txn, s->meta, &end);

    *until = lease_expires;
    if (rc != STORE_OK) {
        return rc;
    }
    if (end > 0 && end <= s->lease_now) {
        atomic_max(&s->stall_end, end);
    }
    end = atomic_load(&s->stall_end);
    if (end > 0 && add_ms(end, lease_ms) > *until) {
        *until = add_ms(end, lease_ms);
    }
    return STORE_OK;
}

static int do_acquire(struct lmdb_store *s, MDB_txn *txn, struct space *sp, int64_t now,
                      const struct store_op *op, struct op_result *res)
{
    struct store_record_view cur;
    struct store_record_view next;
    enum rec_table where = REC_NONE;
    bool found = false;
    bool same_fp;
    bool r_ended_lease = false;
    bool r_complete = false;
    bool leftover = false;
    uint8_t r_lease[STORE_LEASE_ID_BYTES];
    int rc = STORE_OK;

    if (s->rec != NULL) {
        /* Layout 4, in F's writer: R first. A COMPLETE there wins over an
         * entry in flight (its complete committed and has not yet deleted
         * it), and a held record there is BUSY as it always was. Read in a
         * transaction begun after F's writer lock was taken, so every
         * complete whose F entry is gone from this one is in it. */
        rc = record_load(s->rec, s->peer_txn, op->key, &cur, &found, &where, false);
        if (rc != STORE_OK) {
            goto out;
        }
        same_fp = found && same_request(&cur, op);
        if (found && cur.state == STORE_STATE_COMPLETE && cur.expires_ms > now) {
            res->outcome = same_fp ? STORE_REPLAY : STORE_MISMATCH;
            if (same_fp && op->want_replay) {
                rc = store_record_copy(&cur, &res->replay);
            }
            goto out;
        }
        if (found && cur.state == STORE_STATE_IN_PROGRESS && cur.lease_expires_ms > s->lease_now) {
            res->outcome = same_fp ? STORE_BUSY : STORE_MISMATCH;
            if (same_fp) {
                res->lease_expires_ms = cur.lease_expires_ms;
                res->held = store_lease_is_held(cur.lease_id);
            }
            goto out;
        }
        /* Absent from R, or there only past its TTL or its hold: what
         * counts is F (R's leftover goes with purge, or a complete). An
         * ended hold taken over is a steal, as it was in one table. */
        r_ended_lease = found && cur.state == STORE_STATE_IN_PROGRESS;
        r_complete = found && cur.state == STORE_STATE_COMPLETE;
        if (r_complete) {
            memcpy(r_lease, cur.lease_id, STORE_LEASE_ID_BYTES);
        }
    }
    rc = record_load(s, txn, op->key, &cur, &found, &where, false);
    if (rc != STORE_OK) {
        goto out;
    }
    /* An F entry under the lease of R's COMPLETE (past its TTL here) is the
     * one that complete left, its delete queued or lost (inflight_drop): no
     * holder is behind it, so it is replaced like an absent record, with no
     * steal and without R's lock. */
    leftover = found && r_complete && cur.state == STORE_STATE_IN_PROGRESS &&
               lease_matches(&cur, r_lease);
    same_fp = found && !leftover && same_request(&cur, op);
    if (found && cur.state == STORE_STATE_COMPLETE && cur.expires_ms > now) {
        res->outcome = same_fp ? STORE_REPLAY : STORE_MISMATCH;
        if (same_fp && op->want_replay) {
            rc = store_record_copy(&cur, &res->replay); /* before the txn ends */
        }
        goto out;
    }
    if (found && !leftover && cur.state == STORE_STATE_IN_PROGRESS) {
        bool own = op->has_live_lease &&
                   memcmp(cur.lease_id, op->live_lease_id, STORE_LEASE_ID_BYTES) == 0;
        int64_t live_until = cur.lease_expires_ms;

        if (!own && live_until <= s->lease_now) {
            rc = stall_credit(s, txn, cur.lease_expires_ms, op->lease_ms, &live_until);
            if (rc != STORE_OK) {
                goto out;
            }
        }
        if (own || live_until > s->lease_now) {
            res->outcome = same_fp ? STORE_BUSY : STORE_MISMATCH;
            if (same_fp) {
                res->lease_expires_ms = live_until;
                res->held = store_lease_is_held(cur.lease_id);
            }
            goto out;
        }
    }
    /* Absent, COMPLETE past its TTL (absent even before a purge, seed 000),
     * or IN_PROGRESS with an expired lease: a steal. In F a steal holds R's
     * writer lock too: a complete of the lease it takes holds that lock
     * from its lease check until its commit is durable, so the steal comes
     * before the check (the complete is fenced) or after the commit (it
     * finds the COMPLETE above and replays). */
    if (s->rec != NULL && found && !leftover && !s->peer_locked) {
        s->need_peer_lock = true;
        rc = RC_NEED_RECORDS_LOCK;
        goto out;
    }
    if (s->rec != NULL) {
        /* The answer this acquire leads to is stored in R: room for it
         * there too (an estimate, read without R's lock). */
        uint64_t keep = 0;
        rc = answer_keep(s, txn, &keep);
        if (rc == STORE_OK) {
            rc = space_claim(s->rec, s->peer_space, RECORD_PAGES,
                             s->rec->reserve_pages + keep);
        }
        if (rc == STORE_OK) {
            rc = space_claim(s, sp, RECORD_PAGES, s->reserve_pages);
        }
    } else {
        uint64_t keep = 0;
        rc = answer_keep(s, txn, &keep);
        if (rc == STORE_OK) {
            rc = space_claim(s, sp, RECORD_PAGES, s->reserve_pages + keep);
        }
    }
    if (rc != STORE_OK) {
        goto out;
    }
    if (found) {
        rc = index_del(s, txn, cur.expires_ms, op->key);
        if (rc != STORE_OK) {
            goto out;
        }
    }
    memset(&next, 0, sizeof(next));
    next.state = STORE_STATE_IN_PROGRESS;
    rc = new_lease_id(s, next.lease_id);
    if (rc != STORE_OK) {
        goto out;
    }
    next.lease_expires_ms = add_ms(s->lease_now, op->lease_ms);
    next.expires_ms = add_ms(now, op->ttl_ms);
    memcpy(next.fingerprint, op->fingerprint, STORE_FINGERPRINT_BYTES);
    next.has_raw_fingerprint = op->has_raw_fingerprint;
    if (op->has_raw_fingerprint) {
        memcpy(next.raw_fingerprint, op->raw_fingerprint, STORE_FINGERPRINT_BYTES);
    }
    rc = record_put(s, txn, op->key, &next, where);
    if (rc == STORE_OK) {
        rc = index_put(s, txn, next.expires_ms, op->key);
    }
    if (rc == STORE_OK) {
        res->outcome = STORE_ACQUIRED;
        res->stolen =
            (found && !leftover && cur.state == STORE_STATE_IN_PROGRESS) || r_ended_lease;
        res->lease_expires_ms = next.lease_expires_ms;
        memcpy(res->lease_id, next.lease_id, STORE_LEASE_ID_BYTES);
    }
out:
    return rc;
}

/*
 * Layout 4, in R's writer: a complete, or a hold (an extend with hold).
 * The lease is checked in F, in s->peer_txn, begun once R's writer lock was
 * held; a steal needs that lock too, so the lease cannot be taken from
 * under this op until its commit is durable. The record is written to R
 * (COMPLETE to records, held to inflight), over what R had for the key (a
 * COMPLETE past its TTL, a hold that ended), and F's entry is deleted once
 * the commit is durable (inflight_drop). A hold's record is written in the
 * reserve completes leave, as an extend's always was.
 */
static int do_settle(struct lmdb_store *s, MDB_txn *txn, struct space *sp, int64_t now,
                     const struct store_op *op, struct op_result *res)
{
    struct store_record_view cur;
    struct store_record_view old;
    struct store_record_view next;
    enum rec_table where = REC_NONE;
    enum rec_table old_where = REC_NONE;
    bool found = false;
    bool old_found = false;
    size_t size = 0;
    int rc = record_load(s->fl, s->peer_txn, op->key, &cur, &found, &where, true);

    if (rc != STORE_OK) {
        goto out;
    }
    res->outcome = STORE_FENCED;
    if (!found || cur.state != STORE_STATE_IN_PROGRESS || !lease_matches(&cur, op->lease_id) ||
        (op->kind != STORE_OP_COMPLETE && !(op->kind == STORE_OP_EXTEND && op->hold))) {
        goto out;
    }
    /* Built field by field from F's record, which borrows from F's map
     * (R's writes below do not move it). */
    memset(&next, 0, sizeof(next));
    next.state = STORE_STATE_IN_PROGRESS;
    memcpy(next.lease_id, cur.lease_id, STORE_LEASE_ID_BYTES); /* a COMPLETE keeps it */
    next.lease_expires_ms = cur.lease_expires_ms;
    next.expires_ms = cur.expires_ms;
    memcpy(next.fingerprint, cur.fingerprint, STORE_FINGERPRINT_BYTES);
    next.has_raw_fingerprint = cur.has_raw_fingerprint;
    memcpy(next.raw_fingerprint, cur.raw_fingerprint, STORE_FINGERPRINT_BYTES);
    rc = record_load(s, txn, op->key, &old, &old_found, &old_where, false);
    if (rc != STORE_OK) {
        goto out;
    }
    /* R already has what an acquire goes by: a COMPLETE within its TTL or
     * a live hold. The entry in flight is one its complete or hold left
     * (a process died before deleting it), and its lease settles nothing:
     * a COMPLETE is never replaced while it lasts. */
    if (old_found && (old.state == STORE_STATE_COMPLETE ? old.expires_ms > now
                                                        : old.lease_expires_ms > s->lease_now)) {
        goto out;
    }
    /* ... nor, past its TTL, by the lease that completed it. */
    if (old_found && old.state == STORE_STATE_COMPLETE && lease_matches(&old, op->lease_id)) {
        goto out;
    }
    if (op->kind == STORE_OP_COMPLETE) {
        next.state = STORE_STATE_COMPLETE;
        next.expires_ms = add_ms(now, op->ttl_ms); /* from completion */
        next.status = op->status;
        next.headers = op->headers.ptr;
        next.headers_len = op->headers.len;
        next.body = op->body.ptr;
        next.body_len = op->body.len;
        rc = store_record_size(&next, &size);
        if (rc == STORE_OK) {
            rc = space_claim(s, sp, value_pages(s, size) + RECORD_PAGES, s->reserve_pages);
        }
    } else {
        memset(next.lease_id, 0, STORE_LEASE_ID_BYTES);
        next.lease_expires_ms = add_ms(s->lease_now, op->lease_ms);
        rc = space_claim(s, sp, RECORD_PAGES, 0);
    }
    if (rc == STORE_OK && old_found) {
        rc = index_del(s, txn, old.expires_ms, op->key);
    }
    if (rc == STORE_OK) {
        rc = record_put(s, txn, op->key, &next, old_where);
    }
    if (rc == STORE_OK) {
        rc = index_put(s, txn, next.expires_ms, op->key);
    }
    if (rc == STORE_OK) {
        if (op->kind == STORE_OP_COMPLETE) {
            /* Only answers that fit: one that never can (larger than the
             * map or the file system allows) must not make every new key
             * wait for room that will never come. */
            answer_learn(s, value_pages(s, size));
        } else {
            res->lease_expires_ms = next.lease_expires_ms;
        }
        res->outcome = STORE_DONE;
    }
out:
    return rc;
}

/* Complete, release and extend: each needs the record IN_PROGRESS under the
 * caller's lease, which is what fences a stale owner out after a steal
 * (seed 000, "Fencing"). A lease that expired but was not stolen still
 * matches: nobody else has been given the record. Completes and holds go
 * to R's writer (do_settle); releases and extends to F's, here. */
static int do_leased(struct lmdb_store *s, MDB_txn *txn, struct space *sp, int64_t now,
                     const struct store_op *op, struct op_result *res)
{
    struct store_record_view cur;
    struct store_record_view next;
    enum rec_table where = REC_NONE;
    bool found = false;
    int rc;

    if (s->fl != NULL) {
        return do_settle(s, txn, sp, now, op, res);
    }
    if (op->kind != STORE_OP_RELEASE && !(op->kind == STORE_OP_EXTEND && !op->hold)) {
        return STORE_EINVAL; /* never: lmdb_apply_purge sorts the ops */
    }
    (void)sp;
    (void)now;
    rc = record_load(s, txn, op->key, &cur, &found, &where, true);
    if (rc != STORE_OK) {
        goto out;
    }
    res->outcome = STORE_FENCED;
    if (!found || cur.state != STORE_STATE_IN_PROGRESS || !lease_matches(&cur, op->lease_id)) {
        goto out;
    }
    /* next is built field by field: cur borrows from the database, and an
     * IN_PROGRESS record has no payload to carry over anyway. */
    memset(&next, 0, sizeof(next));
    next.state = cur.state;
    memcpy(next.lease_id, cur.lease_id, STORE_LEASE_ID_BYTES);
    next.lease_expires_ms = cur.lease_expires_ms;
    next.expires_ms = cur.expires_ms;
    memcpy(next.fingerprint, cur.fingerprint, STORE_FINGERPRINT_BYTES);
    next.has_raw_fingerprint = cur.has_raw_fingerprint;
    memcpy(next.raw_fingerprint, cur.raw_fingerprint, STORE_FINGERPRINT_BYTES);

    switch (op->kind) {
    case STORE_OP_RELEASE:
        /* No failed state: the row goes, and the key is as if never used. */
        rc = index_del(s, txn, cur.expires_ms, op->key);
        if (rc == STORE_OK) {
            rc = record_del(s, txn, op->key, where);
        }
        break;
    default: /* STORE_OP_EXTEND; the index follows expires_ms, not the lease */
        next.lease_expires_ms = add_ms(s->lease_now, op->lease_ms);
        rc = record_put(s, txn, op->key, &next, where);
        res->lease_expires_ms = next.lease_expires_ms;
        break;
    }
    if (rc == STORE_OK) {
        res->outcome = STORE_DONE;
    }
out:
    return rc;
}

/* Forget's look at one environment's tables: whether the key is there,
 * and whether it is a live lease forget must leave alone (without force).
 * With drop, it then goes. A record that does not decode goes too (what to
 * do with it is the operator's call); its index entry is deleted when its
 * header still gives the time, and otherwise left for purge to drop as
 * stale. */
static int forget_in(struct lmdb_store *s, MDB_txn *txn, const struct store_op *op, bool drop,
                     bool *present, int64_t *live_until)
{
    struct store_record_view cur;
    enum rec_table where = REC_NONE;
    bool found = false;
    int64_t expires = 0;
    bool has_expiry = false;
    int rc = record_load(s, txn, op->key, &cur, &found, &where, true);

    *present = false;
    *live_until = 0;
    if (rc == STORE_ECORRUPT && where != REC_NONE) {
        MDB_val kv = {STORE_KEY_BYTES, (void *)op->key};
        MDB_val dv;
        has_expiry = LMDB_CALL(mdb_get(txn, table_dbi(s, where), &kv, &dv)) == 0 &&
                     store_record_peek_expiry(dv.mv_data, dv.mv_size, &expires);
        rc = STORE_OK;
    } else if (rc == STORE_OK && found) {
        expires = cur.expires_ms;
        has_expiry = true;
        if (cur.state == STORE_STATE_IN_PROGRESS && !store_lease_is_held(cur.lease_id) &&
            cur.lease_expires_ms > s->lease_now) {
            *live_until = cur.lease_expires_ms;
        }
    }
    if (rc != STORE_OK || where == REC_NONE) {
        return rc;
    }
    *present = true;
    if (!drop) {
        return STORE_OK;
    }
    if (has_expiry) {
        rc = index_del(s, txn, expires, op->key);
    }
    if (rc == STORE_OK) {
        rc = record_del(s, txn, op->key, where);
    }
    return rc;
}

/* An operator's delete (STORE_OP_FORGET). Layout 4: from both
 * environments, s->peer_txn being F's write transaction. */
static int do_forget(struct lmdb_store *s, MDB_txn *txn, const struct store_op *op,
                     struct op_result *res)
{
    struct lmdb_store *f = s->fl;
    bool in_r = false;
    bool in_f = false;
    int64_t live_r = 0;
    int64_t live_f = 0;
    int rc = forget_in(s, txn, op, false, &in_r, &live_r);

    if (rc == STORE_OK && f != NULL) {
        f->lease_now = s->lease_now;
        rc = forget_in(f, s->peer_txn, op, false, &in_f, &live_f);
    }
    if (rc != STORE_OK) {
        return rc;
    }
    if (live_f > 0) {
        /* The entry a complete left (its delete queued, or lost with its
         * process) runs nothing: its lease is the COMPLETE's. */
        struct store_record_view rv;
        struct store_record_view fv;
        enum rec_table where = REC_NONE;
        bool rfound = false;
        bool ffound = false;
        if (record_load(s, txn, op->key, &rv, &rfound, &where, false) == STORE_OK && rfound &&
            rv.state == STORE_STATE_COMPLETE &&
            record_load(f, s->peer_txn, op->key, &fv, &ffound, &where, true) == STORE_OK &&
            ffound && lease_matches(&fv, rv.lease_id)) {
            live_f = 0;
        }
    }
    if (!op->force && (live_r > 0 || live_f > 0)) {
        res->outcome = STORE_BUSY;
        res->lease_expires_ms = live_r > live_f ? live_r : live_f;
        return STORE_OK;
    }
    if (!in_r && !in_f) {
        res->outcome = STORE_NOT_FOUND;
        return STORE_OK;
    }
    if (in_r) {
        rc = forget_in(s, txn, op, true, &in_r, &live_r);
    }
    if (rc == STORE_OK && in_f) {
        rc = forget_in(f, s->peer_txn, op, true, &in_f, &live_f);
    }
    if (rc == STORE_OK) {
        res->outcome = STORE_DONE;
    }
    return rc;
}

static int purge_steps(struct lmdb_store *s, MDB_txn *txn, int64_t now, size_t max_records,
                       size_t *deleted, bool *more, bool *changed);

/* Purge work that rides along in a batch's transaction (store_apply_purge):
 * the budget in, what it did out. failed says the purge part failed, after
 * which the transaction is lost and the ops must run again without it. */
struct purge_share {
    size_t max_records;
    size_t deleted;
    bool more;
    bool failed;
};

/* An F entry to delete once R's commit of its complete or hold is
 * durable: its key, and the lease that op settled. */
struct drop {
    uint8_t key[STORE_KEY_BYTES];
    uint8_t lease_id[STORE_LEASE_ID_BYTES];
};

static bool settles_in_r(const struct store_op *op)
{
    return op->kind == STORE_OP_COMPLETE || (op->kind == STORE_OP_EXTEND && op->hold);
}

/* Whether purge must leave key's entry alone (see spare_ops). */
static bool purge_spared(const struct lmdb_store *s, const uint8_t key[STORE_KEY_BYTES])
{
    for (size_t i = 0; i < s->spare_n; i++) {
        if (settles_in_r(&s->spare_ops[i]) &&
            memcmp(s->spare_ops[i].key, key, STORE_KEY_BYTES) == 0) {
            return true;
        }
    }
    return false;
}

/* Layout 4, once R's commit of a batch is durable: the F entries of the
 * batch's completes and holds are queued for F's next write transaction
 * (inflight_drops_apply), each to go only while it still carries the lease
 * that op settled (nothing else can have replaced it since: a steal finds
 * R's record first). Without memory for the queue they are left, which a
 * crash between the two could always do: R's record shadows them for every
 * acquire, read and scan, and purge takes them. */
static void inflight_drop(struct lmdb_store *f, const struct store_op *ops,
                          const struct op_result *res, size_t n)
{
    pthread_mutex_lock(&f->drop_lock);
    for (size_t i = 0; i < n; i++) {
        if (res[i].outcome != STORE_DONE || !settles_in_r(&ops[i])) {
            continue;
        }
        if (f->drops_len == f->drops_cap) {
            size_t cap = f->drops_cap ? f->drops_cap * 2 : 64;
            struct drop *d = realloc(f->drops, cap * sizeof(*d));
            if (d == NULL) {
                break;
            }
            f->drops = d;
            f->drops_cap = cap;
        }
        memcpy(f->drops[f->drops_len].key, ops[i].key, STORE_KEY_BYTES);
        memcpy(f->drops[f->drops_len].lease_id, ops[i].lease_id, STORE_LEASE_ID_BYTES);
        f->drops_len++;
    }
    pthread_mutex_unlock(&f->drop_lock);
}

/* Takes F's queued drops (the caller owns the array; *n of them). */
static struct drop *inflight_drops_take(struct lmdb_store *f, size_t *n)
{
    struct drop *d;

    pthread_mutex_lock(&f->drop_lock);
    d = f->drops;
    *n = f->drops_len;
    f->drops = NULL;
    f->drops_len = 0;
    f->drops_cap = 0;
    pthread_mutex_unlock(&f->drop_lock);
    return d;
}

/* Puts drops taken back (their transaction did not commit), before any
 * queued since. */
static void inflight_drops_put_back(struct lmdb_store *f, struct drop *d, size_t n)
{
    if (d == NULL) {
        return;
    }
    pthread_mutex_lock(&f->drop_lock);
    if (f->drops_len > 0) {
        struct drop *all = realloc(d, (n + f->drops_len) * sizeof(*d));
        if (all == NULL) {
            pthread_mutex_unlock(&f->drop_lock);
            free(d); /* left in F: harmless, see inflight_drop */
            return;
        }
        memcpy(all + n, f->drops, f->drops_len * sizeof(*all));
        free(f->drops);
        d = all;
        n += f->drops_len;
    }
    f->drops = d;
    f->drops_len = n;
    f->drops_cap = n;
    pthread_mutex_unlock(&f->drop_lock);
}

/* Deletes the drops' entries in F's write transaction txn. */
static int inflight_drops_apply(struct lmdb_store *f, MDB_txn *txn, const struct drop *d,
                                size_t n, bool *changed)
{
    int rc = STORE_OK;

    for (size_t i = 0; i < n && rc == STORE_OK; i++) {
        struct store_record_view v;
        enum rec_table where = REC_NONE;
        bool found = false;

        rc = record_load(f, txn, d[i].key, &v, &found, &where, true);
        if (rc == STORE_ECORRUPT) {
            rc = STORE_OK; /* not ours to judge here: purge's */
            continue;
        }
        if (rc == STORE_OK && found && v.state == STORE_STATE_IN_PROGRESS &&
            lease_matches(&v, d[i].lease_id)) {
            rc = index_del(f, txn, v.expires_ms, d[i].key);
            if (rc == STORE_OK) {
                rc = record_del(f, txn, d[i].key, where);
                *changed = true;
            }
        }
    }
    return rc;
}

/* F's queued drops in a transaction of their own (a purge, a sync, the
 * close: nothing else may come to F for a while). Best effort. */
static void inflight_drops_flush(struct lmdb_store *f)
{
    size_t n = 0;
    struct drop *d = inflight_drops_take(f, &n);
    MDB_txn *txn = NULL;
    bool changed = false;

    int rc;

    MDB_txn *rtxn = NULL;
    uint32_t layout = 0;

    if (n == 0 || write_begin(f, &txn) != STORE_OK) {
        inflight_drops_put_back(f, d, n);
        return;
    }
    /* Only while the store is of this layout (R's, which a newer process
     * raises; F's own is always this code's). */
    if (read_begin(f->rec, &rtxn) != STORE_OK) {
        write_abort(f, txn);
        inflight_drops_put_back(f, d, n);
        return;
    }
    rc = layout_read(f->rec, rtxn, &layout);
    read_end(f->rec, rtxn);
    if (rc != STORE_OK || layout != STORE_LAYOUT) {
        write_abort(f, txn);
        free(d);
        return;
    }
    rc = inflight_drops_apply(f, txn, d, n, &changed);
    if (rc == STORE_OK && !changed) {
        write_abort(f, txn);
        free(d); /* none of them is there any more */
        return;
    }
    if (rc == STORE_OK) {
        rc = map_err(write_commit(f, txn)); /* frees txn either way */
        if (rc == STORE_OK) {
            atomic_fetch_add(&f->commits, 1);
            free(d);
            return;
        }
    } else {
        write_abort(f, txn);
    }
    inflight_drops_put_back(f, d, n);
}

static bool inflight_due(struct lmdb_store *f);

/* Layout 4, in R's writer with a purge share left over: F's due entries,
 * in a transaction of F's committed while R's writer lock is still held
 * (purging F needs it, purge_txn). Best effort: a failure leaves them for
 * the next share or an idle purge. */
static void inflight_purge_share(struct lmdb_store *s, int64_t now, struct purge_share *ps,
                                 const struct store_op *ops, const struct op_result *res, size_t n)
{
    struct lmdb_store *f = s->fl;
    MDB_txn *ftxn = NULL;
    size_t deleted = 0;
    size_t budget;
    bool more = false;
    bool changed = false;
    int rc;

    if (!inflight_due(f) || write_begin(f, &ftxn) != STORE_OK) {
        return;
    }
    f->lease_now = s->lease_now;
    (void)res;
    f->spare_ops = ops;
    f->spare_n = n;
    /* Bounded on its own: F's writer lock, held meanwhile, is what every
     * acquire and heartbeat of the in-flight lane waits for. */
    budget = ps->max_records - ps->deleted;
    if (budget > INFLIGHT_PURGE_SHARE_MAX) {
        budget = INFLIGHT_PURGE_SHARE_MAX;
    }
    rc = purge_steps(f, ftxn, now, budget, &deleted, &more, &changed);
    f->spare_ops = NULL;
    f->spare_n = 0;
    if (rc == STORE_OK && changed && write_commit(f, ftxn) == 0) {
        atomic_fetch_add(&f->commits, 1);
        ps->deleted += deleted;
        ps->more = ps->more || more;
    } else if (rc != STORE_OK || !changed) {
        write_abort(f, ftxn);
    }
}

/* Whether a batch writes F too (layout 4, R's writer): a forget deletes
 * from both environments, so it takes F's writer lock after R's. */
static bool batch_writes_inflight(const struct store_op *ops, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (ops[i].kind == STORE_OP_FORGET) {
            return true;
        }
    }
    return false;
}

/* Applies ops[0..n) in one write transaction, then, with a purge share, up
 * to its budget of purge steps in the same transaction, so that they share
 * its commit (and fsync). On any failure nothing is committed and res[] is
 * cleared. The ops run first and fail exactly as they would alone; only
 * once they all succeeded may the purge part fail the transaction, and it
 * then says so in ps->failed.
 *
 * Layout 4: s is R's handle for completes, holds and forgets, F's for
 * acquires, releases and extends (lmdb_apply_purge sorts them). Each
 * batch reads the other environment in a transaction begun once its own
 * writer lock is held (s->peer_txn): F's writer reads R, R's reads F, or
 * writes it (a forget: F's lock taken after R's). A batch of F's that
 * meets a steal runs again holding R's writer lock first. F's batches
 * carry no purge share: purging F needs R's lock (purge_env). */
static int run_batch(struct lmdb_store *s, const struct store_op *ops, const size_t *order,
                     struct op_result *res, size_t n, struct purge_share *ps)
{
    MDB_txn *txn = NULL;
    MDB_txn *peer = NULL;
    struct lmdb_store *peer_of = s->rec != NULL ? s->rec : s->fl;
    bool peer_write = s->fl != NULL && batch_writes_inflight(ops, n);
    bool lock_r = false;
    struct drop *drops = NULL;
    size_t ndrops = 0;
    bool dropped = false;
    struct space psp;
    int64_t now;
    struct space sp;
    bool purging = false;
    int64_t stamped = 0;
    int rc;

again:
    memset(&sp, 0, sizeof(sp));
    memset(&psp, 0, sizeof(psp));
    txn = NULL;
    peer = NULL;
    purging = false;
    stamped = 0;
    if (ps != NULL) {
        ps->deleted = 0;
        ps->more = false;
        ps->failed = false;
        if (s->rec != NULL) {
            ps->max_records = 0;
        }
    }
    rc = STORE_OK;
    if (lock_r) {
        int64_t asked = lease_now_ms(s);
        rc = write_begin(s->rec, &peer);
        if (rc == STORE_OK && s->stall_ms > 0) {
            /* A long wait for R's lock (a stalled durable commit) held up
             * F's writer, this process's heartbeats included: a stall, as a
             * long wait for F's own lock would be (stall_credit). So is a
             * long hold of R's lock that ended just before this one took it
             * (held_check, in write_begin): a holder whose complete queued
             * behind it let its lease run out meanwhile, its heartbeats
             * over, and this steal could otherwise take the key before that
             * complete takes R's lock. */
            int64_t r_end = atomic_load(&s->rec->stall_end);
            int64_t stamped_end = 0;
            int64_t lnow = lease_now_ms(s);
            if (lnow - asked >= s->stall_ms) {
                stall_seen(s, lnow);
            }
            /* ... and what R's meta has (a stall another process saw and
             * stamped there, which a later short hold hid from held_check). */
            if (stall_read(peer, s->rec->meta, &stamped_end) == STORE_OK &&
                stamped_end > r_end && stamped_end <= lnow) {
                r_end = stamped_end;
            }
            if (r_end > 0 && r_end <= lnow) {
                stall_seen(s, r_end); /* into F's meta with this batch */
            }
        }
        if (rc != STORE_OK) {
            peer = NULL;
            goto out;
        }
    }
    rc = write_begin(s, &txn);
    if (rc != STORE_OK) {
        txn = NULL;
        goto out;
    }
    if (s->rec != NULL) {
        /* F's writer: the deletes queued by R's completes ride along. Taken
         * before R's snapshot below is begun: each was queued after its
         * complete's R commit, so that snapshot has the COMPLETE, and an
         * acquire of this batch that no longer finds the entry finds it. */
        drops = inflight_drops_take(s, &ndrops);
        rc = inflight_drops_apply(s, txn, drops, ndrops, &dropped);
        if (rc != STORE_OK) {
            goto out;
        }
        if (!dropped) {
            free(drops); /* none of them is there any more */
            drops = NULL;
            ndrops = 0;
        }
    }
    if (peer_of != NULL && !lock_r) {
        rc = peer_write ? write_begin(peer_of, &peer) : read_begin(peer_of, &peer);
        if (rc != STORE_OK) {
            peer = NULL;
            goto out;
        }
        if (s->rec != NULL) {
            /* F's writer: R's layout is the store's (a newer process may
             * have raised it; R's writer checks its own). */
            uint32_t layout = 0;
            rc = layout_read(s->rec, peer, &layout);
            if (rc == STORE_OK && layout != STORE_LAYOUT) {
                rc = STORE_ELAYOUT;
            }
            if (rc != STORE_OK) {
                goto out;
            }
            FAULT_POINT("inflight-batch-records-snapshot");
        }
    }
    s->peer_txn = peer;
    s->peer_locked = lock_r;
    s->need_peer_lock = false;
    s->peer_space = &psp;
    /* Read the clock only once the writer lock is held: a wait for the
     * lock must not make "now" stale. */
    now = now_ms(s);
    s->lease_now = lease_now_ms(s);
    for (size_t j = 0; j < n && rc == STORE_OK; j++) {
        size_t i = order != NULL ? order[j] : j;
        if (ops[i].kind == STORE_OP_ACQUIRE) {
            rc = do_acquire(s, txn, &sp, now, &ops[i], &res[i]);
        } else if (ops[i].kind == STORE_OP_FORGET) {
            rc = do_forget(s, txn, &ops[i], &res[i]);
        } else {
            rc = do_leased(s, txn, &sp, now, &ops[i], &res[i]);
        }
    }
    if (rc == RC_NEED_RECORDS_LOCK && !lock_r) {
        s->peer_txn = NULL;
        write_abort(s, txn);
        inflight_drops_put_back(s, drops, ndrops);
        drops = NULL;
        ndrops = 0;
        dropped = false;
        txn = NULL;
        read_end(s->rec, peer);
        peer = NULL;
        for (size_t i = 0; i < n; i++) {
            result_clear(&res[i]);
        }
        lock_r = true;
        goto again;
    }
    if (rc == RC_NEED_RECORDS_LOCK) {
        rc = STORE_EIO; /* cannot happen: with R's lock no op asks for it */
    }
    if (rc != STORE_OK) {
        goto out;
    }
    if (ps != NULL && ps->max_records > 0) {
        rc = purge_steps(s, txn, now, ps->max_records, &ps->deleted, &ps->more, &purging);
        if (rc != STORE_OK) {
            ps->failed = true;
            goto out;
        }
        if (s->fl != NULL && !peer_write && !ps->more && ps->deleted < ps->max_records) {
            inflight_purge_share(s, now, ps, ops, res, n);
        }
    }
    if (n == 0 && !purging && !dropped && atomic_load(&s->stall_unstamped) <= 0) {
        goto out; /* nothing to commit: abort, no disk write */
    }
    stamped = stall_stamp(s, txn);
    /* Cleared while the writer lock is held: the next holder sets them. */
    s->peer_txn = NULL;
    s->peer_space = NULL;
    rc = map_err(write_commit(s, txn)); /* frees txn, even when it fails */
    txn = NULL;
    if (rc == STORE_OK) {
        free(drops); /* done */
        drops = NULL;
        ndrops = 0;
        if (stamped > 0) {
            atomic_compare_exchange_strong(&s->stall_unstamped, &stamped, 0);
        }
        atomic_fetch_add(&s->commits, 1);
        atomic_fetch_add(&s->ops_committed, (uint64_t)n);
        if (peer_write) {
            /* R's commit is durable: F's deletes follow it. Should this
             * fail, the call fails (the operator's forget-key says so), and
             * a forget run again finds what stayed in F and deletes it. */
            rc = map_err(write_commit(peer_of, peer));
            peer = NULL;
            if (rc == STORE_OK) {
                atomic_fetch_add(&peer_of->commits, 1);
            }
        }
    } else if (rc == STORE_EFULL && purging) {
        /* The pages the purge freed must be listed at commit, and that
         * may be what did not fit: the ops alone might. */
        ps->failed = true;
    }
out:
    if (txn != NULL) {
        s->peer_txn = NULL;
        s->peer_space = NULL;
        write_abort(s, txn);
    }
    /* Not committed (an abort with nothing to commit included: then they
     * found nothing to delete, and going again costs a lookup each). */
    inflight_drops_put_back(s, drops, ndrops);
    if (peer != NULL) {
        if (lock_r || peer_write) {
            write_abort(peer_of, peer);
        } else {
            read_end(peer_of, peer);
        }
    }
    if (rc == STORE_OK && s->fl != NULL) {
        inflight_drop(s->fl, ops, res, n);
    }
    if (rc != STORE_OK) {
        for (size_t i = 0; i < n; i++) {
            result_clear(&res[i]);
        }
        if (ps != NULL) {
            ps->deleted = 0;
            ps->more = false;
        }
    }
    return rc;
}

static int lmdb_purge(void *impl, size_t max_records, size_t *purged, bool *more);

/* LMDB reuses the pages a transaction freed only from the second transaction
 * after it (the previous snapshot must survive a crash), so the pages the
 * last commit freed (a purge's, say) are of no use to the very next
 * transaction, and the space estimate does not count them. One small
 * committed write in between makes them usable for the retry. Without it a
 * store that had just been purged would stay full to every acquire until
 * some other write happened to commit, and a purge that had just used up
 * the reusable pages could not delete even one record (lmdb_purge). */
static int settle_after_purge(struct lmdb_store *s)
{
    MDB_txn *txn = NULL;
    uint8_t probe = 0;
    MDB_val kv = {sizeof(probe), &probe};
    MDB_val dv = {0, NULL};
    int rc = write_begin(s, &txn);

    if (rc == STORE_OK) {
        rc = LMDB_WRITE(mdb_put(txn, s->records, &kv, &dv, 0));
        if (rc == 0) {
            rc = LMDB_WRITE(mdb_del(txn, s->records, &kv, NULL));
        }
        if (rc == 0) {
            rc = write_commit(s, txn);
        } else {
            write_abort(s, txn);
        }
        rc = map_err(rc);
    }
    if (rc == STORE_OK) {
        atomic_fetch_add(&s->commits, 1);
    }
    return rc;
}

/* The batch hit MDB_MAP_FULL (after which LMDB requires the transaction to be
 * aborted) or a space rule. Make room by purging (a few bounded batches),
 * then retry the ops one by one so that only the ops that still do not fit
 * are refused. */
static int apply_after_full(struct lmdb_store *s, const struct store_op *ops, struct op_result *res,
                            size_t n)
{
    size_t purged = 0;
    bool more = true;
    bool hard = false;

    /* F's writer (layout 4) purges nothing here: purging either
     * environment takes R's writer lock, and F's writer, carrying every
     * heartbeat, must not wait for it (a disk slow enough to fill the
     * store's room with waiting completes would hold the heartbeats up
     * for as long, in holds too short for other processes to take for a
     * stall). Its ops that do not fit are refused (STORE_FULL), and its
     * caller has R's writer purge (store_purge(); proxy/writer.c asks the
     * records' lane). */
    if (s->rec == NULL) {
        for (int round = 0; round < FULL_PURGE_ROUNDS && more; round++) {
            /* A purge that fails (it may be full itself) just stops early. */
            if (lmdb_purge(s, FULL_PURGE_BATCH, &purged, &more) != STORE_OK) {
                more = false;
            }
        }
    }
    (void)settle_after_purge(s); /* best effort: the retry says what fits */
    /* Earlier ops may commit here, so the call itself succeeds and reports
     * them; an op that still does not fit is reported as not applied, and
     * after a hard error so is every later op (that error would repeat;
     * a corrupt record concerns its own op only). */
    bool committed = false;
    int dead = STORE_OK;
    for (size_t i = 0; i < n; i++) {
        int rc = hard ? STORE_EIO : run_batch(s, &ops[i], NULL, &res[i], 1, NULL);
        if (rc != STORE_OK) {
            res[i].outcome = STORE_FULL;
            hard = hard || (rc != STORE_EFULL && rc != STORE_ECORRUPT);
            if (rc == STORE_EDEAD || rc == STORE_ELAYOUT) {
                dead = rc;
            }
        } else {
            committed = true;
        }
    }
    /* The full store may have been a commit whose meta page write failed
     * with ENOSPC, after which LMDB takes no transaction (MDB_PANIC): that,
     * or a newer layout, is the call's result when no op committed, so the
     * caller stops (store_options.on_dead) instead of taking it for a full
     * store. When some did, they are reported, and the next call says it. */
    return committed ? STORE_OK : dead;
}

/* The order a batch's ops run in. Every ACQUIRE and COMPLETE of a batch
 * shares "now", so the expiry-index entries they write are ordered by TTL,
 * then by record key; run in that order, each entry goes at the end of the
 * index. In arrival order half of them land before the previous one, and
 * LMDB splits the full page they land on in half each time: the index ends
 * up a third full instead of half (what the later deletes of the acquires'
 * entries leave), and the store ~9 % larger. Ops of one key keep the order
 * they came in (they see each other's writes); ops on different keys do not
 * see each other, so the order changes no outcome. */
struct op_order {
    int64_t ttl_ms; /* of the key's first op that writes an entry; -1: none */
    const uint8_t *key;
    size_t i;
};

static int op_order_cmp(const void *a, const void *b)
{
    const struct op_order *x = a;
    const struct op_order *y = b;
    int c;

    if (x->ttl_ms != y->ttl_ms)
        return x->ttl_ms < y->ttl_ms ? -1 : 1;
    c = memcmp(x->key, y->key, STORE_KEY_BYTES);
    if (c != 0)
        return c;
    return x->i < y->i ? -1 : (x->i > y->i);
}

static bool writes_index_entry(const struct store_op *op)
{
    return (op->kind == STORE_OP_ACQUIRE || op->kind == STORE_OP_COMPLETE) && op->ttl_ms >= 0;
}

/* Returns the order for ops[0..n), or NULL (run them as they came) when n is
 * small or memory is short: the order saves space, it is never needed. */
static size_t *batch_order(const struct store_op *ops, size_t n)
{
    struct op_order *o;
    size_t *order;

    if (n < 2)
        return NULL;
    o = malloc(n * sizeof(*o));
    order = malloc(n * sizeof(*order));
    if (o == NULL || order == NULL) {
        free(o);
        free(order);
        return NULL;
    }
    /* Group the ops by key (in arrival order within a key), give each group
     * the TTL of its first op that writes an entry, then order the groups. */
    for (size_t i = 0; i < n; i++) {
        o[i].ttl_ms = 0;
        o[i].key = ops[i].key;
        o[i].i = i;
    }
    qsort(o, n, sizeof(*o), op_order_cmp);
    for (size_t g = 0; g < n;) {
        size_t end = g + 1;
        int64_t ttl = -1;

        while (end < n && memcmp(o[end].key, o[g].key, STORE_KEY_BYTES) == 0)
            end++;
        for (size_t i = g; i < end && ttl < 0; i++) {
            if (writes_index_entry(&ops[o[i].i]))
                ttl = ops[o[i].i].ttl_ms;
        }
        for (size_t i = g; i < end; i++)
            o[i].ttl_ms = ttl;
        g = end;
    }
    qsort(o, n, sizeof(*o), op_order_cmp);
    for (size_t i = 0; i < n; i++)
        order[i] = o[i].i;
    free(o);
    return order;
}

/* The ops of one environment's writer, as one batch (run_batch), with the
 * purge share when given, and the full-store fallback. */
static int apply_env(struct lmdb_store *h, const struct store_op *ops, struct op_result *res,
                     size_t n, struct purge_share *ps)
{
    size_t *order = batch_order(ops, n);
    int rc = run_batch(h, ops, order, res, n, ps);

    if (ps != NULL && ps->failed) {
        ps->max_records = 0;
        rc = run_batch(h, ops, order, res, n, ps);
    }
    if (rc == STORE_EFULL) {
        rc = apply_after_full(h, ops, res, n);
    }
    free(order);
    return rc;
}

/* Layout 4: which writer an op belongs to. F's: acquire, release, extend
 * (a heartbeat); R's: complete, hold, forget. */
static bool op_in_flight_env(const struct store_op *op)
{
    return op->kind == STORE_OP_ACQUIRE || op->kind == STORE_OP_RELEASE ||
           (op->kind == STORE_OP_EXTEND && !op->hold);
}

/* Layout 4: runs ops[from..to), all of one environment's writer, as one
 * batch of copies, and copies the results back. */
static int apply_part(struct lmdb_store *s, const struct store_op *ops, struct op_result *res,
                      const size_t *idx, size_t m, struct purge_share *ps)
{
    struct store_op *part = NULL;
    struct op_result *pres = NULL;
    bool in_f;
    int rc = STORE_OK;

    if (m == 0) {
        return STORE_OK;
    }
    in_f = op_in_flight_env(&ops[idx[0]]);
    part = malloc(m * sizeof(*part));
    pres = calloc(m, sizeof(*pres));
    if (part == NULL || pres == NULL) {
        rc = STORE_ENOMEM;
        goto out;
    }
    for (size_t k = 0; k < m; k++) {
        part[k] = ops[idx[k]];
    }
    rc = apply_env(in_f ? s->fl : s, part, pres, m, in_f ? NULL : ps);
    if (rc == STORE_OK) {
        for (size_t k = 0; k < m; k++) {
            res[idx[k]] = pres[k]; /* the replay's ownership moves along */
        }
    }
out:
    free(part);
    free(pres);
    return rc;
}

/* Layout 4: a batch of both writers' ops. With no key in both, F's part
 * then R's (ops on different keys do not see each other); otherwise runs of
 * consecutive ops of one writer, in the order given. Each part is its own
 * transaction: a failing part leaves the parts before it committed (the
 * proxy's writers never mix them). */
static int apply_split(struct lmdb_store *s, const struct store_op *ops, struct op_result *res,
                       size_t n, struct purge_share *ps)
{
    size_t *idx = malloc((n > 0 ? n : 1) * sizeof(*idx));
    size_t nf = 0;
    bool mixed_key = false;
    int rc = STORE_OK;

    if (idx == NULL) {
        return STORE_ENOMEM;
    }
    for (size_t i = 0; i < n && !mixed_key; i++) {
        for (size_t k = i + 1; k < n && !mixed_key; k++) {
            mixed_key = op_in_flight_env(&ops[i]) != op_in_flight_env(&ops[k]) &&
                        memcmp(ops[i].key, ops[k].key, STORE_KEY_BYTES) == 0;
        }
    }
    if (!mixed_key) {
        size_t nr = 0;
        for (size_t i = 0; i < n; i++) {
            if (op_in_flight_env(&ops[i])) {
                idx[nf++] = i;
            }
        }
        rc = apply_part(s, ops, res, idx, nf, NULL);
        for (size_t i = 0; i < n && rc == STORE_OK; i++) {
            if (!op_in_flight_env(&ops[i])) {
                idx[nr++] = i;
            }
        }
        if (rc == STORE_OK && (nr > 0 || (ps != NULL && ps->max_records > 0))) {
            rc = nr > 0 ? apply_part(s, ops, res, idx, nr, ps) : apply_env(s, NULL, NULL, 0, ps);
        }
    } else {
        for (size_t i = 0; i < n && rc == STORE_OK;) {
            size_t m = 0;
            bool in_f = op_in_flight_env(&ops[i]);
            while (i < n && op_in_flight_env(&ops[i]) == in_f) {
                idx[m++] = i++;
            }
            rc = apply_part(s, ops, res, idx, m, i == n ? ps : NULL);
        }
    }
    free(idx);
    return rc;
}

/* store_apply_purge(): the ops as store_apply() would apply them, plus up to
 * max_purge purge steps in the same transaction. The purge is best effort:
 * when its part fails (a full map, a disk error), the transaction is run
 * again without it, so what the ops get never depends on the purge. */
static int lmdb_apply_purge(void *impl, struct store_op *ops, size_t n, size_t max_purge,
                            size_t *purged, bool *more)
{
    struct lmdb_store *s = impl;
    struct op_result one;
    struct op_result *res = &one;
    struct purge_share ps;
    int rc = STORE_OK;

    last_cause = 0; /* store_last_cause() speaks of this call only */
    memset(&one, 0, sizeof(one));
    memset(&ps, 0, sizeof(ps));
    ps.max_records = max_purge;
    if (n > 1) {
        res = calloc(n, sizeof(*res));
        if (res == NULL) {
            rc = STORE_ENOMEM;
            goto out;
        }
    }
    rc = s->fl != NULL ? apply_split(s, ops, res, n, &ps) : apply_env(s, ops, res, n, &ps);
    if (rc != STORE_OK) {
        for (size_t i = 0; i < n; i++) {
            result_clear(&res[i]);
        }
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        struct store_op *op = &ops[i];
        op->outcome = res[i].outcome;
        op->stolen = res[i].stolen;
        op->lease_expires_ms = res[i].lease_expires_ms;
        op->held = res[i].held;
        if (op->kind == STORE_OP_ACQUIRE) {
            memcpy(op->lease_id, res[i].lease_id, STORE_LEASE_ID_BYTES);
        }
        op->replay = res[i].replay; /* ownership moves to the caller */
    }
out:
    if (res != &one) {
        free(res);
    }
    *purged = rc == STORE_OK ? ps.deleted : 0;
    *more = rc == STORE_OK && ps.more;
    return rc;
}

static int lmdb_apply(void *impl, struct store_op *ops, size_t n)
{
    size_t purged = 0;
    bool more = false;
    return lmdb_apply_purge(impl, ops, n, 0, &purged, &more);
}

/* A read of both environments (layout 4): F's transaction is begun before
 * R's, so a record whose complete deleted its F entry before the first is
 * in the second. ftxn is NULL without F. */
struct read_pair {
    MDB_txn *rtxn;
    MDB_txn *ftxn;
};

static int read_pair_begin(struct lmdb_store *s, struct read_pair *p)
{
    int rc = STORE_OK;

    p->rtxn = NULL;
    p->ftxn = NULL;
    if (s->fl != NULL) {
        rc = read_begin(s->fl, &p->ftxn);
    }
    if (rc == STORE_OK) {
        rc = read_begin(s, &p->rtxn);
        if (rc != STORE_OK && p->ftxn != NULL) {
            read_end(s->fl, p->ftxn);
            p->ftxn = NULL;
        }
    }
    return rc;
}

static void read_pair_end(struct lmdb_store *s, struct read_pair *p)
{
    if (p->rtxn != NULL) {
        read_end(s, p->rtxn);
    }
    if (p->ftxn != NULL) {
        read_end(s->fl, p->ftxn);
    }
}

/* The record of key as a read sees it across both environments: R's when
 * it is a COMPLETE within its TTL or a live hold (an acquire looks there
 * first), else F's entry in flight when there is one, unless it is the one
 * R's COMPLETE left (its lease; do_acquire), else R's. */
static int load_merged(struct lmdb_store *s, const struct read_pair *p,
                       const uint8_t key[STORE_KEY_BYTES], bool r_known_absent,
                       struct store_record_view *v, bool *found)
{
    struct store_record_view rv;
    struct store_record_view fv;
    enum rec_table where = REC_NONE;
    bool rfound = false;
    bool ffound = false;
    int rc = STORE_OK;

    memset(&rv, 0, sizeof(rv));
    if (!r_known_absent) {
        rc = record_load(s, p->rtxn, key, &rv, &rfound, &where, false);
    }
    *found = false;
    if (rc != STORE_OK) {
        return rc;
    }
    if (rfound && (rv.state == STORE_STATE_COMPLETE ? rv.expires_ms > now_ms(s)
                                                    : rv.lease_expires_ms > lease_now_ms(s))) {
        *v = rv;
        *found = true;
        return STORE_OK;
    }
    if (p->ftxn != NULL) {
        rc = record_load(s->fl, p->ftxn, key, &fv, &ffound, &where, false);
        if (rc != STORE_OK) {
            return rc;
        }
        if (ffound && fv.state == STORE_STATE_IN_PROGRESS &&
            !(rfound && rv.state == STORE_STATE_COMPLETE && lease_matches(&fv, rv.lease_id))) {
            *v = fv;
            *found = true;
            return STORE_OK;
        }
    }
    /* R's, as load_visible has it: a COMPLETE past its TTL is absent. */
    if (rfound && !(rv.state == STORE_STATE_COMPLETE)) {
        *v = rv;
        *found = true;
    }
    return STORE_OK;
}

/* Begins the reads of key and loads it (get, view): R alone when R has
 * what an acquire goes by (a COMPLETE within its TTL, a live hold: a
 * replay's lookup, one read transaction); otherwise F's snapshot, then R's
 * again, begun after it (load_merged: a complete that deleted its F entry
 * before F's snapshot is in that R snapshot). When R's renewed snapshot is
 * the one the key was just missing from (the same transaction id: nothing
 * committed to R in between, so the same pages), the key is not searched
 * for in R again: that is every new key's lookup but for the few that meet
 * a commit, one B-tree search fewer on the path of every new request. The
 * caller ends p. */
static int read_key(struct lmdb_store *s, const uint8_t key[STORE_KEY_BYTES], struct read_pair *p,
                    struct store_record_view *v, bool *found)
{
    enum rec_table where = REC_NONE;
    bool r_missed;
    size_t r_snapshot;
    int rc;

    p->rtxn = NULL;
    p->ftxn = NULL;
    *found = false;
    rc = read_begin(s, &p->rtxn);
    if (rc != STORE_OK) {
        return rc;
    }
    rc = record_load(s, p->rtxn, key, v, found, &where, false);
    if (rc != STORE_OK) {
        return rc;
    }
    if (*found && (v->state == STORE_STATE_COMPLETE ? v->expires_ms > now_ms(s)
                                                    : v->lease_expires_ms > lease_now_ms(s))) {
        return STORE_OK;
    }
    if (s->fl == NULL) {
        /* A COMPLETE past its TTL is absent even before a purge. */
        *found = *found && v->state != STORE_STATE_COMPLETE;
        return STORE_OK;
    }
    r_missed = !*found;
    r_snapshot = mdb_txn_id(p->rtxn);
    FAULT_POINT("read-key-records-missed");
    rc = read_begin(s->fl, &p->ftxn);
    if (rc != STORE_OK) {
        return rc;
    }
    mdb_txn_reset(p->rtxn);
    rc = map_err(LMDB_CALL(mdb_txn_renew(p->rtxn)));
    if (rc != STORE_OK) {
        mdb_txn_abort(p->rtxn);
        p->rtxn = NULL;
        return rc;
    }
    return load_merged(s, p, key, r_missed && mdb_txn_id(p->rtxn) == r_snapshot, v, found);
}

static int lmdb_get(void *impl, const uint8_t key[STORE_KEY_BYTES], struct store_record *out)
{
    struct lmdb_store *s = impl;
    struct read_pair p;
    struct store_record_view v;
    bool found = false;
    int rc;

    memset(out, 0, sizeof(*out));
    rc = read_key(s, key, &p, &v, &found);
    if (rc == STORE_OK && found) {
        rc = store_record_copy(&v, out); /* the value dies with the txn */
    }
    read_pair_end(s, &p);
    return rc;
}

static int lmdb_view(void *impl, const uint8_t key[STORE_KEY_BYTES], store_view_fn fn, void *ctx)
{
    struct lmdb_store *s = impl;
    struct read_pair p;
    struct store_record_view v;
    struct store_record rec;
    bool found = false;
    int rc;

    memset(&rec, 0, sizeof(rec));
    rc = read_key(s, key, &p, &v, &found);
    /* The spans borrow from the map, valid until read_pair_end(). */
    if (rc == STORE_OK && found) {
        rec.state = v.state;
        memcpy(rec.lease_id, v.lease_id, STORE_LEASE_ID_BYTES);
        rec.lease_expires_ms = v.lease_expires_ms;
        rec.expires_ms = v.expires_ms;
        memcpy(rec.fingerprint, v.fingerprint, STORE_FINGERPRINT_BYTES);
        rec.has_raw_fingerprint = v.has_raw_fingerprint;
        memcpy(rec.raw_fingerprint, v.raw_fingerprint, STORE_FINGERPRINT_BYTES);
        rec.status = v.status;
        rec.headers = (uint8_t *)v.headers;
        rec.headers_len = v.headers_len;
        rec.body = (uint8_t *)v.body;
        rec.body_len = v.body_len;
    }
    if (rc == STORE_OK) {
        fn(&rec, ctx);
    }
    read_pair_end(s, &p);
    return rc;
}

/* Whether the due index entry at time t is a damaged record's own, and so
 * purges it: yes when the record's header cannot give its expiry (nothing
 * to tell by), or gives t. An entry with another time is stale (a key-order
 * pass leaves the entries of the records it deleted, and the key may have a
 * new record since): deleting the record for it would throw away what
 * might be a COMPLETE result before its TTL. */
static bool corrupt_entry_is_its_own(struct lmdb_store *s, MDB_txn *txn,
                                     const uint8_t key[STORE_KEY_BYTES], enum rec_table where,
                                     int64_t t)
{
    MDB_val kv = {STORE_KEY_BYTES, (void *)key};
    MDB_val dv;
    int64_t expires;

    if (where == REC_NONE || LMDB_CALL(mdb_get(txn, table_dbi(s, where), &kv, &dv)) != 0 ||
        !store_record_peek_expiry(dv.mv_data, dv.mv_size, &expires)) {
        return true;
    }
    return expires == t;
}
/* The purge steps of one write transaction in index order: up to
 * max_records due index entries, deleting what is purgeable. Each step takes
 * the first index entry again rather than walking a cursor: every entry
 * handled leaves the due
 * range (deleted, or moved past now), so the first entry is always the next
 * one due. *changed says whether anything was written (the caller commits
 * only then); *more whether entries were still due when the budget ran out.
 * On an error the transaction must be aborted (after a failed put or delete
 * LMDB accepts nothing else). */
static int index_steps(struct lmdb_store *s, MDB_txn *txn, int64_t now, size_t max_records,
                       size_t *deleted, size_t *handled_out, bool *more, bool *changed)
{
    MDB_cursor *cur = NULL;
    size_t handled = 0;
    int rc = map_err(LMDB_CALL(mdb_cursor_open(txn, s->expiry, &cur)));

    *deleted = 0;
    *more = false;
    *changed = false;
    if (rc != STORE_OK) {
        cur = NULL;
    }
    while (rc == STORE_OK) {
        MDB_val kv;
        MDB_val dv;
        uint8_t ik[INDEX_KEY_BYTES];
        const uint8_t *key = ik + 8;
        struct store_record_view v;
        enum rec_table where = REC_NONE;
        bool found = false;
        int64_t t;
        int got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, MDB_FIRST));

        if (got == MDB_NOTFOUND) {
            break;
        }
        if (got != 0) {
            rc = map_err(got);
            break;
        }
        if (kv.mv_size != INDEX_KEY_BYTES) {
            /* Not an entry this code writes; drop it so it cannot block the
             * head of the index. */
            rc = map_err(LMDB_WRITE(mdb_cursor_del(cur, 0)));
            *changed = true;
            continue;
        }
        memcpy(ik, kv.mv_data, INDEX_KEY_BYTES); /* copied: pages change below */
        t = index_time(ik);
        if (t > now) {
            break;
        }
        if (handled == max_records) {
            *more = true;
            break;
        }
        handled++;
        *changed = true;
        rc = record_load(s, txn, key, &v, &found, &where, false);
        if (rc == STORE_ECORRUPT && !corrupt_entry_is_its_own(s, txn, key, where, t)) {
            rc = index_del(s, txn, t, key); /* stale entry: the record waits for its own */
            continue;
        }
        if (rc == STORE_ECORRUPT) {
            /* An undecodable record can never be served, and its due entry
             * would block purging forever: it goes. */
            rc = record_del(s, txn, key, where);
            if (rc == STORE_OK) {
                rc = index_del(s, txn, t, key);
                (*deleted)++;
            }
            continue;
        }
        if (rc != STORE_OK) {
            break;
        }
        if (!found || v.expires_ms != t) {
            rc = index_del(s, txn, t, key); /* stale entry */
        } else if (v.state == STORE_STATE_COMPLETE ||
                   (v.lease_expires_ms <= s->lease_now && !purge_spared(s, key))) {
            /* COMPLETE past its TTL, or IN_PROGRESS past its TTL whose lease
             * expired too (CONTRACT.md section 2, purge). */
            rc = record_del(s, txn, key, where);
            if (rc == STORE_OK) {
                rc = index_del(s, txn, t, key);
            }
            (*deleted)++;
        } else {
            /* IN_PROGRESS past its TTL under a live lease (or one whose
             * complete is in this batch of R's, purge_spared): a long action is
             * never purged out from under itself (seed 000). Its expiry
             * moves to the lease's, so that the index entry comes due again
             * then and the invariant (entry time == expires_ms) holds; for
             * an IN_PROGRESS record expires_ms only decides purging. */
            struct store_record_view next;
            memset(&next, 0, sizeof(next));
            next.state = STORE_STATE_IN_PROGRESS;
            memcpy(next.lease_id, v.lease_id, STORE_LEASE_ID_BYTES);
            next.lease_expires_ms = v.lease_expires_ms;
            next.expires_ms = lease_to_wall(v.lease_expires_ms, s->lease_now, now);
            if (next.expires_ms <= now) {
                next.expires_ms = add_ms(now, 1); /* (due again, not in this step) */
            }
            memcpy(next.fingerprint, v.fingerprint, STORE_FINGERPRINT_BYTES);
            next.has_raw_fingerprint = v.has_raw_fingerprint;
            memcpy(next.raw_fingerprint, v.raw_fingerprint, STORE_FINGERPRINT_BYTES);
            rc = index_del(s, txn, t, key);
            if (rc == STORE_OK) {
                rc = record_put(s, txn, key, &next, where);
            }
            if (rc == STORE_OK) {
                rc = index_put(s, txn, next.expires_ms, key);
            }
        }
    }
    if (cur != NULL) {
        mdb_cursor_close(cur);
    }
    *handled_out = handled;
    if (rc != STORE_OK) {
        *deleted = 0;
        *more = false;
    }
    return rc;
}

/*
 * Whether the due index entries number at least SWEEP_MIN_DUE and at least
 * 1/SWEEP_MIN_SHARE of the records: counted by walking the head of the index,
 * no further than that many entries.
 */
static int backlog_is_large(struct lmdb_store *s, MDB_txn *txn, int64_t now, bool *large)
{
    MDB_stat st;
    MDB_cursor *cur = NULL;
    MDB_val kv;
    MDB_val dv;
    size_t want;
    size_t due = 0;
    int got;
    int rc = map_err(LMDB_CALL(mdb_stat(txn, s->records, &st)));

    *large = false;
    if (rc != STORE_OK) {
        return rc;
    }
    want = st.ms_entries / SWEEP_MIN_SHARE;
    if (want < SWEEP_MIN_DUE) {
        want = SWEEP_MIN_DUE;
    }
    rc = map_err(LMDB_CALL(mdb_cursor_open(txn, s->expiry, &cur)));
    if (rc != STORE_OK) {
        return rc;
    }
    got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, MDB_FIRST));
    while (got == 0 && due < want) {
        if (kv.mv_size == INDEX_KEY_BYTES && index_time(kv.mv_data) > now) {
            break;
        }
        due++;
        got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, MDB_NEXT));
    }
    mdb_cursor_close(cur);
    if (got != 0 && got != MDB_NOTFOUND) {
        return map_err(got);
    }
    *large = due >= want;
    return STORE_OK;
}

/*
 * The purge steps of one write transaction during a sweep: records in key
 * order from where the last call stopped, deleting the purgeable ones (the
 * rule of index_steps), up to max_records deletions and
 * SWEEP_EXAMINE_PER_DELETE times as many records looked at. In index order a
 * large backlog costs about one leaf page written (and one freed) per record,
 * as the records due together lie anywhere in the key space; in key order
 * the records of one leaf go together. Their index entries are left behind,
 * stale, for index_steps to drop once the pass is over: they lie together at
 * the head of the index. The pass over, *more says true so that it runs.
 */
static int sweep_steps(struct lmdb_store *s, MDB_txn *txn, int64_t now, size_t max_records,
                       size_t *deleted, bool *more, bool *changed)
{
    MDB_cursor *cur = NULL;
    MDB_val kv;
    MDB_val dv;
    size_t examined = 0;
    size_t limit = max_records * SWEEP_EXAMINE_PER_DELETE;
    int got;
    int rc = map_err(LMDB_CALL(mdb_cursor_open(txn, s->records, &cur)));

    *deleted = 0;
    *more = true;
    *changed = false;
    if (rc != STORE_OK) {
        return rc;
    }
    if (s->sweep_has_pos) {
        kv.mv_size = STORE_KEY_BYTES;
        kv.mv_data = s->sweep_pos;
        got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, MDB_SET_RANGE));
    } else {
        got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, MDB_FIRST));
    }
    while (got == 0) {
        struct store_record_view v;
        bool purge;

        if (kv.mv_size != STORE_KEY_BYTES) {
            /* Not a record this code writes: not ours to judge. */
            got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, MDB_NEXT));
            continue;
        }
        if (*deleted == max_records || examined == limit) {
            memcpy(s->sweep_pos, kv.mv_data, STORE_KEY_BYTES);
            s->sweep_has_pos = true;
            break;
        }
        examined++;
        rc = store_record_parse(dv.mv_data, dv.mv_size, &v);
        if (rc == STORE_ECORRUPT) {
            /* Kept: it might hide a COMPLETE result whose TTL has not
             * elapsed, and only its index entry says when it has
             * (index_steps purges it then). */
            purge = false;
            rc = STORE_OK;
        } else if (rc != STORE_OK) {
            break;
        } else {
            purge = v.expires_ms <= now &&
                    (v.state == STORE_STATE_COMPLETE || v.lease_expires_ms <= s->lease_now) &&
                    !(kv.mv_size == STORE_KEY_BYTES && purge_spared(s, kv.mv_data));
        }
        if (purge) {
            /* The cursor then stands on the next record, which MDB_NEXT
             * returns. */
            rc = map_err(LMDB_WRITE(mdb_cursor_del(cur, 0)));
            if (rc != STORE_OK) {
                break;
            }
            (*deleted)++;
            *changed = true;
        }
        got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, MDB_NEXT));
    }
    if (rc == STORE_OK && got == MDB_NOTFOUND) {
        s->sweeping = false; /* the pass is over */
        s->sweep_has_pos = false;
    } else if (rc == STORE_OK && got != 0) {
        rc = map_err(got);
    }
    mdb_cursor_close(cur);
    if (rc != STORE_OK) {
        *deleted = 0;
        *more = false;
    }
    return rc;
}

/* The purge steps of one write transaction: in index order (index_steps),
 * or in key order while a sweep is under way, which a large backlog starts.
 * A failed transaction may leave the sweep's position past records it did
 * not delete: index order deletes them later. */
static int purge_steps(struct lmdb_store *s, MDB_txn *txn, int64_t now, size_t max_records,
                       size_t *deleted, bool *more, bool *changed)
{
    size_t handled = 0;
    int rc;

    if (!s->sweeping && s->backlog_calls >= SWEEP_AFTER_CALLS && now >= s->sweep_next_check_ms) {
        bool large = false;
        s->backlog_calls = 0;
        s->sweep_next_check_ms = now + SWEEP_CHECK_EVERY_MS;
        rc = backlog_is_large(s, txn, now, &large);
        if (rc != STORE_OK) {
            return rc;
        }
        if (large) {
            s->sweeping = true;
            s->sweep_has_pos = false;
            atomic_fetch_add(&s->sweeps, 1);
        }
    }
    if (s->sweeping) {
        return sweep_steps(s, txn, now, max_records, deleted, more, changed);
    }
    rc = index_steps(s, txn, now, max_records, deleted, &handled, more, changed);
    if (rc == STORE_OK) {
        /* A backlog of records, not of the stale entries a sweep leaves. */
        if (*more && *deleted * 2 > handled) {
            s->backlog_calls++;
        } else if (!*more) {
            s->backlog_calls = 0;
        }
    }
    return rc;
}

/* One purge transaction of its own. In F (layout 4) it holds R's writer
 * lock first, as a steal does: a complete checks its lease in F under that
 * lock and commits in R, and an entry purged between the two would let an
 * acquire run the key again beside it. */
static int purge_txn(struct lmdb_store *s, size_t max_records, size_t *purged, bool *more)
{
    MDB_txn *txn = NULL;
    MDB_txn *rtxn = NULL;
    size_t deleted = 0;
    bool changed = false;
    int rc = s->rec != NULL ? write_begin(s->rec, &rtxn) : STORE_OK;

    *purged = 0;
    *more = false;
    if (rc != STORE_OK) {
        rtxn = NULL;
        goto out;
    }
    rc = write_begin(s, &txn);
    if (rc != STORE_OK) {
        txn = NULL;
        goto out;
    }
    s->lease_now = lease_now_ms(s);
    rc = purge_steps(s, txn, now_ms(s), max_records, &deleted, more, &changed);
    if (rc != STORE_OK || !changed) {
        goto out; /* nothing to commit: abort, no disk write */
    }
    rc = map_err(write_commit(s, txn));
    txn = NULL;
    if (rc == STORE_OK) {
        atomic_fetch_add(&s->commits, 1);
        *purged = deleted;
    }
out:
    if (txn != NULL) {
        write_abort(s, txn);
    }
    if (rtxn != NULL) {
        write_abort(s->rec, rtxn);
    }
    if (rc != STORE_OK) {
        *more = false;
    }
    return rc;
}

/* Whether F has an index entry due (a cheap look before purging it takes
 * both writer locks): most of the time it has none, its records being
 * completed or released long before their TTL. */
static bool inflight_due(struct lmdb_store *f)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    MDB_val kv;
    MDB_val dv;
    bool due = true; /* a look that fails says purge */

    if (read_begin(f, &txn) != STORE_OK) {
        return true;
    }
    if (LMDB_CALL(mdb_cursor_open(txn, f->expiry, &cur)) == 0) {
        int got = LMDB_CALL(mdb_cursor_get(cur, &kv, &dv, MDB_FIRST));
        if (got == MDB_NOTFOUND) {
            due = false;
        } else if (got == 0 && kv.mv_size == INDEX_KEY_BYTES) {
            due = index_time(kv.mv_data) <= now_ms(f);
        }
        mdb_cursor_close(cur);
    }
    read_end(f, txn);
    return due;
}

/* Deleting copies pages too: in a nearly full map a big batch may not find
 * room for the pages it touches, while a smaller one (within the reserve
 * that completions leave) does. */
/*
 * Purges up to max_records in as many transactions as it takes. In a full
 * map a delete needs pages too (copy-on-write), so a batch that does not fit
 * is retried smaller, down to one record; each committed batch frees pages
 * that later ones can use, so the batch grows back. Without this a store
 * that had filled up kept its expired records while idle: every periodic
 * purge fell back to a record or two per round.
 */
static int purge_env(struct lmdb_store *s, size_t max_records, size_t *purged, bool *more)
{
    size_t total = 0;
    size_t batch = max_records;
    bool m = true;
    bool settled = false;
    int rc = STORE_OK;

    last_cause = 0; /* as in lmdb_apply_purge() */
    while (total < max_records && m) {
        size_t want = batch < max_records - total ? batch : max_records - total;
        size_t got = 0;
        rc = purge_txn(s, want, &got, &m);
        if (rc == STORE_EFULL && want > 1) {
            batch = want > 16 ? want / 16 : 1;
            m = true;
            continue;
        }
        if (rc == STORE_EFULL && !settled && settle_after_purge(s) == STORE_OK) {
            /* Not even one record fits: the free pages are those the
             * last commit freed, which LMDB reuses only from the second
             * transaction after it. Nothing else commits in an idle full
             * store, so without this small commit every purge would fail
             * the same way, forever (a full 1 MiB store kept ~980
             * expired records). */
            settled = true;
            m = true;
            continue;
        }
        if (rc != STORE_OK)
            break;
        settled = false;
        total += got;
        if (got < want)
            break; /* nothing more is due */
        if (batch < max_records)
            batch = batch * 2 < max_records ? batch * 2 : max_records;
    }
    *purged = total;
    *more = rc == STORE_OK ? m : false;
    /* What was purged counts, unless the store died meanwhile (MDB_PANIC:
     * see apply_after_full) or another process raised its layout. */
    return total > 0 && rc != STORE_EDEAD && rc != STORE_ELAYOUT ? STORE_OK : rc;
}

/* R's records, then (layout 4) F's, when any is due, in what is left of
 * the budget. */
static int lmdb_purge(void *impl, size_t max_records, size_t *purged, bool *more)
{
    struct lmdb_store *s = impl;
    size_t got = 0;
    bool fmore = false;
    int rc;

    if (s->fl != NULL) {
        inflight_drops_flush(s->fl); /* an idle proxy's last completes' */
    }
    rc = purge_env(s, max_records, purged, more);

    if (rc == STORE_OK && s->fl != NULL && *purged < max_records && inflight_due(s->fl)) {
        rc = purge_env(s->fl, max_records - *purged, &got, &fmore);
        *purged += got;
        *more = *more || fmore;
    }
    if (rc == STORE_OK && s->fl != NULL && *purged > 0 && !*more) {
        /* The purge is over: one small commit of R's makes the pages its
         * last commit freed reusable at once (settle_after_purge). Layout
         * 4's acquires, in F's writer, never purge or settle R themselves,
         * and in a store that was full they claim room in R from pages
         * the next R transaction may reuse. */
        (void)settle_after_purge(s);
    }
    return rc;
}

static int lmdb_reader_check(void *impl, int *cleared)
{
    struct lmdb_store *s = impl;
    int rc = map_err(LMDB_CALL(mdb_reader_check(s->env, cleared)));
    int more = 0;

    if (rc == STORE_OK && s->fl != NULL) {
        rc = map_err(LMDB_CALL(mdb_reader_check(s->fl->env, &more)));
        *cleared += more;
    }
    return rc;
}

static int lmdb_stats(void *impl, struct store_stats *out)
{
    struct lmdb_store *s = impl;
    MDB_txn *txn = NULL;
    MDB_stat st;
    MDB_envinfo info;
    int rc;

    if (s->fl != NULL && !s->read_only) {
        /* So that a key whose complete is in R is not counted in F too. */
        inflight_drops_flush(s->fl);
    }
    rc = read_begin(s, &txn);

    if (rc != STORE_OK) {
        goto out;
    }
    rc = map_err(mdb_stat(txn, s->records, &st));
    if (rc == STORE_OK) {
        out->records = (uint64_t)st.ms_entries;
        rc = map_err(mdb_stat(txn, s->inflight, &st));
    }
    if (rc == STORE_OK) {
        out->records += (uint64_t)st.ms_entries;
    }
    read_end(s, txn);
    if (rc == STORE_OK && s->fl != NULL) {
        /* Layout 4: F's entries in flight (a key whose complete is in R
         * and whose F entry is not yet deleted counts twice, briefly). */
        rc = read_begin(s->fl, &txn);
        if (rc == STORE_OK) {
            rc = map_err(mdb_stat(txn, s->fl->inflight, &st));
            if (rc == STORE_OK) {
                out->records += (uint64_t)st.ms_entries;
                out->inflight_records = (uint64_t)st.ms_entries;
            }
            read_end(s->fl, txn);
        }
    }
    if (rc != STORE_OK) {
        goto out;
    }
    rc = map_err(mdb_env_info(s->env, &info));
    if (rc == STORE_OK) {
        rc = map_err(mdb_env_stat(s->env, &st));
    }
    if (rc != STORE_OK) {
        goto out;
    }
    out->commits = atomic_load(&s->commits);
    out->ops_committed = atomic_load(&s->ops_committed);
    out->has_inflight = s->fl != NULL;
    if (s->fl != NULL) {
        out->inflight_commits = atomic_load(&s->fl->commits);
        out->inflight_ops_committed = atomic_load(&s->fl->ops_committed);
    }
    out->purge_sweeps = atomic_load(&s->sweeps);
    out->shared_fs = s->shared_fs;
    out->map_size_from_store = s->map_from_store;
    out->flushing_for_sync = s->following_sync;
    out->has_log_salt = s->has_log_salt;
    memcpy(out->log_salt, s->log_salt, sizeof(out->log_salt));
    out->map_size_bytes = (uint64_t)info.me_mapsize;
    out->map_used_bytes = ((uint64_t)info.me_last_pgno + 1) * st.ms_psize;
    out->stale_readers_cleared_at_open = s->readers_cleared;
    out->lease_clock = s->lease_clock;
out:
    return rc;
}

/* One table's cursor in a merged scan. */
struct scan_cursor {
    MDB_cursor *cur;
    MDB_val kv;
    MDB_val dv;
    const char *table;
    bool done;
};

static int scan_step(struct scan_cursor *c, MDB_cursor_op op)
{
    int got = LMDB_CALL(mdb_cursor_get(c->cur, &c->kv, &c->dv, op));

    if (got == MDB_NOTFOUND) {
        c->done = true;
        return STORE_OK;
    }
    if (got != 0) {
        return map_err(got);
    }
    return STORE_OK;
}

/* Every record of both tables in key order: the two are merged, so a key
 * present in both (which the store never writes) is visited twice in a row,
 * and the caller can tell. An entry that is not a record (a key of the wrong
 * size, a value that does not decode) ends the scan with STORE_ECORRUPT, or,
 * with bad, is passed to it and skipped. */
static int lmdb_scan(void *impl, store_scan_fn fn, store_scan_bad_fn bad, void *ctx)
{
    struct lmdb_store *s = impl;
    struct read_pair p;
    /* Layout 4: F's entries in flight are a third table in the merge. */
    struct scan_cursor t[3] = {
        {.table = "records"}, {.table = "inflight"}, {.table = INFLIGHT_DIR "/inflight"}};
    size_t nt;
    int rc = read_pair_begin(s, &p);

    if (rc != STORE_OK) {
        return rc;
    }
    nt = p.ftxn != NULL ? 3 : 2;
    rc = map_err(LMDB_CALL(mdb_cursor_open(p.rtxn, s->records, &t[0].cur)));
    if (rc == STORE_OK) {
        rc = map_err(LMDB_CALL(mdb_cursor_open(p.rtxn, s->inflight, &t[1].cur)));
    }
    if (rc == STORE_OK && nt == 3) {
        rc = map_err(LMDB_CALL(mdb_cursor_open(p.ftxn, s->fl->inflight, &t[2].cur)));
    }
    for (size_t i = 0; i < nt && rc == STORE_OK; i++) {
        rc = scan_step(&t[i], MDB_FIRST);
    }
    for (;;) {
        struct scan_cursor *c = NULL;
        struct store_record rec;
        uint8_t key[STORE_KEY_BYTES];
        bool stop;
        bool all_done = true;

        for (size_t i = 0; i < nt; i++) {
            all_done = all_done && t[i].done;
        }
        if (rc != STORE_OK || all_done) {
            break;
        }
        /* A key of the wrong size cannot be merged by key: it goes first. */
        for (size_t i = 0; i < nt && c == NULL; i++) {
            if (!t[i].done && t[i].kv.mv_size != STORE_KEY_BYTES) {
                c = &t[i];
            }
        }
        if (c != NULL) {
            if (bad == NULL) {
                rc = STORE_ECORRUPT;
                break;
            }
            bad(c->kv.mv_data, c->kv.mv_size, c->table, c->dv.mv_size,
                "the key is not a 32-byte record key", ctx);
            rc = scan_step(c, MDB_NEXT);
            continue;
        }
        for (size_t i = 0; i < nt; i++) {
            if (!t[i].done &&
                (c == NULL || memcmp(t[i].kv.mv_data, c->kv.mv_data, STORE_KEY_BYTES) < 0)) {
                c = &t[i];
            }
        }
        /* Layout 4: a key both in R and in flight is one record, the one an
         * acquire goes by (load_merged): R's while it is a COMPLETE within
         * its TTL or a live hold (the entry in flight is what its complete
         * had not yet deleted), else the one in flight (R's ended; a
         * complete or purge replaces it). The other is passed over. Two
         * tables of R holding one key are still both visited. */
        if (nt == 3 && c != &t[2] && !t[2].done &&
            memcmp(t[2].kv.mv_data, c->kv.mv_data, STORE_KEY_BYTES) == 0) {
            struct store_record_view rv;
            struct store_record_view fv;
            if (store_record_parse(c->dv.mv_data, c->dv.mv_size, &rv) == STORE_OK &&
                store_record_parse(t[2].dv.mv_data, t[2].dv.mv_size, &fv) == STORE_OK) {
                bool r_wins = rv.state == STORE_STATE_COMPLETE
                                  ? rv.expires_ms > now_ms(s) || lease_matches(&fv, rv.lease_id)
                                  : rv.lease_expires_ms > lease_now_ms(s);
                struct scan_cursor *pass = r_wins ? &t[2] : c;
                c = r_wins ? c : &t[2];
                rc = scan_step(pass, MDB_NEXT);
                if (rc != STORE_OK) {
                    break;
                }
            }
        }
        memcpy(key, c->kv.mv_data, STORE_KEY_BYTES);
        rc = store_record_decode(c->dv.mv_data, c->dv.mv_size, &rec);
        if (rc != STORE_OK) {
            if (bad == NULL || rc != STORE_ECORRUPT) {
                break;
            }
            bad(key, STORE_KEY_BYTES, c->table, c->dv.mv_size, "the value does not decode", ctx);
            rc = scan_step(c, MDB_NEXT);
            continue;
        }
        stop = fn(key, &rec, ctx) != 0;
        store_record_clear(&rec);
        if (stop) {
            break;
        }
        rc = scan_step(c, MDB_NEXT);
    }
    for (size_t i = 0; i < nt; i++) {
        if (t[i].cur != NULL) {
            mdb_cursor_close(t[i].cur);
        }
    }
    read_pair_end(s, &p);
    return rc;
}

static int lmdb_sync(void *impl)
{
    struct lmdb_store *s = impl;
    MDB_txn *txn = NULL;
    int rc;

    if (s->fl != NULL) {
        inflight_drops_flush(s->fl);
    }
    if (s->stall_ms <= 0) {
        return map_err(LMDB_CALL(mdb_env_sync(s->env, 1)));
    }
    /* Durability "interval": the flush under the writer lock, so that one
     * that stalls is a hold of the lock every process sees (held_check).
     * Outside it, the heartbeats of this process queued behind the flush
     * while the others' acquires went on, and took the leases it ran out. */
    rc = write_begin(s, &txn);
    if (rc != STORE_OK) {
        return rc;
    }
    rc = map_err(LMDB_CALL(mdb_env_sync(s->env, 1)));
    write_abort(s, txn);
    return rc;
}

/* A store is kept only on a file system LMDB works on (store_shared_fs_name):
 * on NFS, say, two hosts that mount one volume would each take LMDB's writer
 * lock and run the same key twice, and a store's map would not stay
 * coherent. Refused at start, by name, rather than found out later, unless
 * the caller allows it (store_options.allow_shared_fs: one host's processes
 * on a FUSE or virtiofs mount work); *shared names it either way. Fault
 * builds take the type from IDEM_FAULT_FS_TYPE (tests/faults), since no
 * test can mount a network file system here. */
static int check_file_system(const char *path, bool allow, const char **shared, char *err,
                             size_t errlen)
{
    char at[4096];
    struct statfs fs;
    unsigned long type;
    const char *name;
    size_t n = strlen(path);

    /* Before the store's directories are made: the nearest one that exists
     * holds what mkdir would make. */
    if (n == 0 || n >= sizeof(at)) {
        snprintf(err, errlen, "store: bad path");
        return STORE_EINVAL;
    }
    memcpy(at, path, n + 1);
    while (statfs(at, &fs) != 0) {
        char *slash = strrchr(at, '/');
        if (errno != ENOENT || (slash == NULL && strcmp(at, ".") == 0)) {
            snprintf(err, errlen, "store: cannot read the file system of %s: %s", path,
                     strerror(errno));
            return STORE_EIO;
        }
        if (slash == NULL) {
            memcpy(at, ".", 2);
        } else if (slash == at) {
            at[1] = '\0';
        } else {
            *slash = '\0';
        }
    }
    type = (unsigned long)fs.f_type;
#ifdef IDEM_FAULT_INJECTION
    if (getenv("IDEM_FAULT_FS_TYPE") != NULL) {
        type = strtoul(getenv("IDEM_FAULT_FS_TYPE"), NULL, 0);
    }
#endif
    name = store_shared_fs_name(type);
    *shared = name;
    if (name != NULL && !allow) {
        snprintf(err, errlen,
                 "store: %s is on %s (file system type 0x%lx); LMDB needs a local file system: its "
                 "locks and memory map do not work across hosts or through a network file "
                 "system, and two hosts would each run the same key. Put store.path on a "
                 "local disk (or, if only processes of this one host ever open it, set "
                 "store.require_local_fs to false)",
                 path, name, type & 0xFFFFFFFFul);
        return STORE_EINVAL;
    }
    return STORE_OK;
}

/* fsync of a directory, for the entries in it. 0, or the errno of a flush
 * that failed to write (EIO, ENOSPC, EDQUOT). A directory that cannot be
 * opened, or whose file system does not flush directories (EINVAL, EBADF,
 * ENOTSUP: PostgreSQL ignores these too), is passed over: there is nothing
 * this process can do about it, and refusing to start would not help. */
static int sync_dir(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int rc = 0;

    if (fd < 0) {
        return 0;
    }
    if (fsync(fd) != 0 && (errno == EIO || errno == ENOSPC || errno == EDQUOT)) {
        rc = errno;
    }
    close(fd);
    return rc;
}

/* Cuts the last component off a path in place ("a/b/" -> "a", "a" -> ".",
 * "/a" -> "/"); false when there is none left to cut ("/", "."). */
static bool path_up(char *buf)
{
    size_t n = strlen(buf);

    while (n > 1 && buf[n - 1] == '/') {
        n--;
    }
    buf[n] = '\0';
    if (strcmp(buf, "/") == 0 || strcmp(buf, ".") == 0) {
        return false;
    }
    while (n > 0 && buf[n - 1] != '/') {
        n--;
    }
    while (n > 1 && buf[n - 1] == '/') {
        n--;
    }
    if (n == 0) {
        memcpy(buf, ".", 2);
    } else {
        buf[n] = '\0';
    }
    return true;
}

/* Every open for writing flushes the store's file and its directories before
 * anything is stored, whatever the durability. LMDB writes a new data.mdb's
 * meta pages without a flush (with "interval", nothing is flushed until the
 * first sync), and never flushes a directory, where POSIX wants a
 * directory's own fsync for a new entry in it. A power cut soon after a first
 * start would otherwise leave data.mdb 0 bytes long, which the next start
 * refuses as damaged (probe_data_file), or not there at all.
 * tests/chaos/test_power_cut.py found the 0-byte file. Flushed: data.mdb,
 * the store's directory (data.mdb's entry), its parent, and on up while the
 * directory just flushed was made by this open (made_len: the length of the
 * first directory make_dirs made, 0 for none). Done at every open rather than
 * only at a store's creation, so an open that failed or died between LMDB's
 * creating the file and this flush is made good by the next one. */
static int sync_at_open(struct lmdb_store *s, const char *path, size_t made_len, char *err,
                        size_t errlen)
{
    char dir[4096];
    int lrc = LMDB_CALL(mdb_env_sync(s->env, 1));
    int e;

    if (lrc != 0) {
        snprintf(err, errlen, "store: cannot flush %s: %s", path, mdb_strerror(lrc));
        return map_err(lrc);
    }
    if (strlen(path) >= sizeof(dir)) {
        snprintf(err, errlen, "store: path too long");
        return STORE_EINVAL;
    }
    memcpy(dir, path, strlen(path) + 1);
    e = sync_dir(dir);
    for (bool first = true; e == 0; first = false) {
        bool made = made_len > 0 && strlen(dir) >= made_len;
        if (!(first || made) || !path_up(dir)) {
            break;
        }
        e = sync_dir(dir);
    }
    if (e != 0) {
        snprintf(err, errlen, "store: cannot flush the directory %s: %s", dir, strerror(e));
        return STORE_EIO;
    }
    return STORE_OK;
}

/* mkdir -p with mode 0700: the store holds stored responses, which are
 * nobody else's business. *made_len: the length of the first (topmost)
 * directory it made, 0 when all were there. */
static int make_dirs(const char *path, size_t *made_len, char *err, size_t errlen)
{
    int rc = STORE_OK;
    char *buf = strdup(path);
    struct stat sb;

    *made_len = 0;
    if (buf == NULL) {
        rc = STORE_ENOMEM;
        snprintf(err, errlen, "store: out of memory");
        goto out;
    }
    for (char *p = buf + 1; *p != '\0'; p++) {
        if (*p != '/') {
            continue;
        }
        *p = '\0';
        if (mkdir(buf, 0700) == 0) {
            if (*made_len == 0) {
                *made_len = strlen(buf);
            }
        } else if (errno != EEXIST) {
            rc = STORE_EIO;
            snprintf(err, errlen, "store: cannot create %s: %s", buf, strerror(errno));
            goto out;
        }
        *p = '/';
    }
    if (mkdir(buf, 0700) == 0) {
        if (*made_len == 0) {
            *made_len = strlen(buf);
        }
    } else if (errno != EEXIST) {
        rc = STORE_EIO;
        snprintf(err, errlen, "store: cannot create %s: %s", buf, strerror(errno));
        goto out;
    }
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        rc = STORE_EIO;
        snprintf(err, errlen, "store: %s is not a directory", path);
    }
out:
    free(buf);
    return rc;
}

/* "as user NAME" (or uid N), for a permission message: the proxy may run
 * as another user than the one checking. */
static void user_name(char *buf, size_t len)
{
    const struct passwd *pw = getpwuid(geteuid()); /* the command line's one thread */

    if (pw != NULL && pw->pw_name != NULL)
        snprintf(buf, len, "user %s", pw->pw_name);
    else
        snprintf(buf, len, "uid %u", (unsigned)geteuid());
}

static int probe_data_file(const char *path, bool read_only, bool *exists, bool *has_lock,
                           char *err, size_t errlen);

static int no_access(const char *what, const char *path, int e, char *err, size_t errlen)
{
    char user[64];

    user_name(user, sizeof(user));
    snprintf(err, errlen, "store: %s %s (as %s): %s", what, path, user, strerror(e));
    return e == EACCES || e == EPERM || e == EROFS ? STORE_EINVAL : STORE_EIO;
}

/* As this process would be let (its effective ids and capabilities), not
 * as access()'s real ids. */
static bool may(const char *path, int mode)
{
    return faccessat(AT_FDCWD, path, mode, AT_EACCESS) == 0;
}

/* A file of an existing store directory that the proxy opens for reading
 * and writing, when it is there. */
static int file_usable(const char *dir, const char *name, char *err, size_t errlen)
{
    char at[4096];

    if (snprintf(at, sizeof(at), "%s/%s", dir, name) >= (int)sizeof(at)) {
        snprintf(err, errlen, "store: path too long");
        return STORE_EINVAL;
    }
    if (access(at, F_OK) == 0 && !may(at, R_OK | W_OK))
        return no_access("cannot read and write", at, errno, err, errlen);
    return STORE_OK;
}

/* Layout 4's directory of the records in flight, when there is one: the
 * proxy removes and makes its files at a reboot, and writes them always. */
static int inflight_dir_usable(const char *path, char *err, size_t errlen)
{
    char dir[4200];
    struct stat sb;
    int rc = STORE_OK;

    if (snprintf(dir, sizeof(dir), "%s/" INFLIGHT_DIR, path) >= (int)sizeof(dir)) {
        snprintf(err, errlen, "store: path too long: %s", path);
        return STORE_EINVAL;
    }
    if (stat(dir, &sb) != 0) {
        if (lstat(dir, &sb) == 0) {
            snprintf(err, errlen, "store: %s is a symbolic link to a path that does not exist",
                     dir);
            return STORE_EINVAL;
        }
        return STORE_OK; /* made at start, in the store directory checked above */
    }
    if (!S_ISDIR(sb.st_mode)) {
        snprintf(err, errlen, "store: %s is not a directory", dir);
        return STORE_EINVAL;
    }
    if (!may(dir, W_OK | X_OK))
        return no_access("cannot write in", dir, errno, err, errlen);
    rc = file_usable(dir, "data.mdb", err, errlen);
    if (rc == STORE_OK)
        rc = file_usable(dir, "lock.mdb", err, errlen);
    return rc;
}

static int path_check(const char *path, bool allow_shared_fs, char *err, size_t errlen)
{
    char at[4096];
    struct stat sb;
    const char *shared = NULL;
    bool exists = false, has_lock = false;
    size_t n = strlen(path);
    int rc = check_file_system(path, allow_shared_fs, &shared, err, errlen);

    if (rc != STORE_OK)
        return rc;
    if (stat(path, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode)) {
            snprintf(err, errlen, "store: %s is not a directory", path);
            return STORE_EINVAL;
        }
        /* Write and search; reading the directory is not needed. */
        if (!may(path, W_OK | X_OK))
            return no_access("cannot write in", path, errno, err, errlen);
        rc = probe_data_file(path, false, &exists, &has_lock, err, errlen);
        if (rc == STORE_OK)
            rc = file_usable(path, "data.mdb", err, errlen);
        if (rc == STORE_OK)
            rc = file_usable(path, "lock.mdb", err, errlen);
        if (rc == STORE_OK)
            rc = file_usable(path, "durability.lock", err, errlen);
        if (rc == STORE_OK)
            rc = inflight_dir_usable(path, err, errlen);
        return rc;
    }
    if (errno == EACCES)
        return no_access("cannot reach", path, errno, err, errlen);
    if (errno != ENOENT) {
        snprintf(err, errlen, "store: %s: %s", path, strerror(errno));
        return errno == ENOTDIR ? STORE_EINVAL : STORE_EIO;
    }
    if (lstat(path, &sb) == 0) {
        /* mkdir() would find it there (EEXIST) and the open then fail. */
        snprintf(err, errlen, "store: %s is a symbolic link to a path that does not exist", path);
        return STORE_EINVAL;
    }
    /* Made at start (make_dirs()): the nearest directory that exists above
     * it must be one this user can make it in. */
    if (n == 0 || n >= sizeof(at)) {
        snprintf(err, errlen, "store: bad path");
        return STORE_EINVAL;
    }
    memcpy(at, path, n + 1);
    for (;;) {
        char *slash = strrchr(at, '/');
        if (slash == NULL)
            memcpy(at, ".", 2);
        else if (slash == at)
            at[1] = '\0';
        else
            *slash = '\0';
        if (stat(at, &sb) == 0)
            break;
        if (errno == EACCES)
            return no_access("cannot reach", at, errno, err, errlen);
        if (errno != ENOENT || strcmp(at, ".") == 0 || strcmp(at, "/") == 0) {
            snprintf(err, errlen, "store: cannot create %s: %s: %s", path, at, strerror(errno));
            return errno == ENOTDIR ? STORE_EINVAL : STORE_EIO;
        }
    }
    if (!S_ISDIR(sb.st_mode)) {
        snprintf(err, errlen, "store: cannot create %s: %s is not a directory", path, at);
        return STORE_EINVAL;
    }
    if (!may(at, W_OK | X_OK)) {
        int e = errno;
        char what[4200];
        snprintf(what, sizeof(what), "cannot create %s: no permission to write in", path);
        return no_access(what, at, e, err, errlen);
    }
    return STORE_OK;
}

int store_lmdb_path_check(const char *path, bool allow_shared_fs, char *err, size_t errlen)
{
    int rc = path_check(path, allow_shared_fs, err, errlen);
    char cwd[4096];

    /* The proxy takes a relative path from its own working directory,
     * which need not be this one. */
    if (rc != STORE_OK && path[0] != '/' && getcwd(cwd, sizeof(cwd)) != NULL) {
        size_t used = strlen(err);
        if (used + 1 < errlen)
            snprintf(err + used, errlen - used,
                     " (store.path is relative: looked at from this working directory, %s; the "
                     "proxy takes it from its own)",
                     cwd);
    }
    return rc;
}

/* The lease epoch this process's clock is on: NULL when it has none (a
 * test clock), "" when it cannot be told (store_open then refuses). */
static const char *lease_epoch(const struct lmdb_store *s)
{
    return s->clock.lease_epoch != NULL ? s->clock.lease_epoch(s->clock.ctx) : NULL;
}

/* Whether the store's leases are on this process's lease clock: a layout
 * of 3 whose epoch (when the clock has one) is this one. */
static int leases_current(const struct lmdb_store *s, MDB_txn *txn, uint32_t layout, bool *yes)
{
    const char *epoch = lease_epoch(s);
    MDB_val kv = {sizeof(EPOCH_KEY) - 1, (void *)EPOCH_KEY};
    MDB_val dv;
    int got;

    *yes = false;
    if (layout < 3) {
        return STORE_OK;
    }
    if (epoch == NULL) {
        *yes = true;
        return STORE_OK;
    }
    got = mdb_get(txn, s->meta, &kv, &dv);
    if (got == MDB_NOTFOUND) {
        return STORE_OK;
    }
    if (got != 0) {
        return map_err(got);
    }
    *yes = dv.mv_size == strlen(epoch) && memcmp(dv.mv_data, epoch, dv.mv_size) == 0;
    return STORE_OK;
}

/* The keys of the IN_PROGRESS records in one table (a few: one per request
 * in flight, and abandoned ones until purged). */
static int in_progress_keys(MDB_txn *txn, MDB_dbi dbi, uint8_t **keys, size_t *n)
{
    MDB_cursor *cur = NULL;
    MDB_val kv;
    MDB_val dv;
    size_t cap = 0;
    int got;
    int rc = map_err(mdb_cursor_open(txn, dbi, &cur));

    *keys = NULL;
    *n = 0;
    if (rc != STORE_OK) {
        return rc;
    }
    for (got = mdb_cursor_get(cur, &kv, &dv, MDB_FIRST); got == 0;
         got = mdb_cursor_get(cur, &kv, &dv, MDB_NEXT)) {
        struct store_record_view v;
        if (kv.mv_size != STORE_KEY_BYTES ||
            store_record_parse(dv.mv_data, dv.mv_size, &v) != STORE_OK ||
            v.state != STORE_STATE_IN_PROGRESS) {
            continue;
        }
        if (*n == cap) {
            size_t ncap = cap ? cap * 2 : 64;
            uint8_t *nk = realloc(*keys, ncap * STORE_KEY_BYTES);
            if (nk == NULL) {
                rc = STORE_ENOMEM;
                break;
            }
            *keys = nk;
            cap = ncap;
        }
        memcpy(*keys + *n * STORE_KEY_BYTES, kv.mv_data, STORE_KEY_BYTES);
        (*n)++;
    }
    mdb_cursor_close(cur);
    if (rc == STORE_OK && got != MDB_NOTFOUND) {
        rc = map_err(got);
    }
    if (rc != STORE_OK) {
        free(*keys);
        *keys = NULL;
        *n = 0;
    }
    return rc;
}

/*
 * At open, in a write transaction: puts the store's leases on this
 * process's lease clock, then records the layout and the epoch.
 *  - From a layout before 3 (leases on the wall clock): every lease keeps
 *    the time it had left, and IN_PROGRESS records still in records (layout
 *    1) move to inflight, where a later epoch change finds them.
 *  - Under another epoch (the host rebooted; every process that held a
 *    lease is gone): every lease is over at once, as its holder is, except
 *    a held record's, which is kept until its TTL as before.
 * Expiry times (wall clock) do not change, so the index stays as it is.
 */
static int leases_settle(struct lmdb_store *s, MDB_txn *txn, uint32_t layout)
{
    const char *epoch = lease_epoch(s);
    int64_t wall = now_ms(s);
    int64_t lnow = lease_now_ms(s);
    bool current = false;
    int rc = leases_current(s, txn, layout, &current);

    for (int t = 0; rc == STORE_OK && !current && t < (layout < 3 ? 2 : 1); t++) {
        enum rec_table table = t == 0 ? REC_INFLIGHT : REC_RECORDS;
        uint8_t *keys = NULL;
        size_t n = 0;
        rc = in_progress_keys(txn, table_dbi(s, table), &keys, &n);
        for (size_t i = 0; rc == STORE_OK && i < n; i++) {
            const uint8_t *key = keys + i * STORE_KEY_BYTES;
            struct store_record_view v;
            struct store_record_view next;
            enum rec_table where = REC_NONE;
            bool found = false;
            rc = record_load(s, txn, key, &v, &found, &where, table == REC_INFLIGHT);
            if (rc != STORE_OK || !found || v.state != STORE_STATE_IN_PROGRESS) {
                rc = rc == STORE_ECORRUPT ? STORE_OK : rc;
                continue;
            }
            next = v; /* an IN_PROGRESS record borrows nothing */
            next.headers = NULL;
            next.headers_len = 0;
            next.body = NULL;
            next.body_len = 0;
            if (layout < 3) {
                next.lease_expires_ms = lease_to_wall(v.lease_expires_ms, wall, lnow);
            } else if (store_lease_is_held(v.lease_id) && v.expires_ms > wall) {
                /* Held (its action ran, its result could not be stored): it
                 * stays held until its TTL, as it would have without the
                 * reboot. Its expiry is that end on the wall clock (set at
                 * acquire, moved to the hold's end by purge once passed). */
                next.lease_expires_ms = lease_to_wall(v.expires_ms, wall, lnow);
            } else {
                next.lease_expires_ms = lnow;
            }
            rc = record_put(s, txn, key, &next, where);
        }
        free(keys);
    }
    if (rc == STORE_OK && layout < STORE_LAYOUT) {
        uint8_t lv[4] = {STORE_LAYOUT & 0xff, (STORE_LAYOUT >> 8) & 0xff,
                         (STORE_LAYOUT >> 16) & 0xff, STORE_LAYOUT >> 24};
        MDB_val kv = {sizeof(LAYOUT_KEY) - 1, (void *)LAYOUT_KEY};
        MDB_val dv = {sizeof(lv), lv};
        rc = map_err(mdb_put(txn, s->meta, &kv, &dv, 0));
    }
    if (rc == STORE_OK && !current && epoch != NULL) {
        MDB_val kv = {sizeof(EPOCH_KEY) - 1, (void *)EPOCH_KEY};
        MDB_val dv = {strlen(epoch), (void *)epoch};
        MDB_val sk = {sizeof(STALL_KEY) - 1, (void *)STALL_KEY};
        int drc;
        rc = map_err(mdb_put(txn, s->meta, &kv, &dv, 0));
        /* A stall's end is on the lease clock of the epoch that saw it. */
        drc = rc == STORE_OK ? mdb_del(txn, s->meta, &sk, NULL) : 0;
        if (drc != 0 && drc != MDB_NOTFOUND) {
            rc = map_err(drc);
        }
    }
    return rc;
}

/* Opens the four databases in one transaction of the given kind, and reads
 * the layout and whether the leases are on this process's clock
 * (*current); a write transaction puts them on it and writes this code's
 * layout over an older one (leases_settle). Committing keeps the handles (a
 * read-only commit writes nothing). */
/* The store's log salt (store_stats): read from meta, or, in a write
 * transaction on a store without one, made and written. A value of another
 * size is taken as none (and replaced by a writable open): the salt only
 * keys the access log's hash, and refusing the store for it would stop
 * every process on it, check-store included. */
static int log_salt_settle(struct lmdb_store *s, MDB_txn *txn, bool make)
{
    MDB_val kv = {sizeof(LOG_SALT_KEY) - 1, (void *)LOG_SALT_KEY};
    MDB_val v;
    int lrc = mdb_get(txn, s->meta, &kv, &v);
    int rc;

    if (lrc == 0 && v.mv_size == STORE_LOG_SALT_BYTES) {
        memcpy(s->log_salt, v.mv_data, STORE_LOG_SALT_BYTES);
        s->has_log_salt = true;
        return STORE_OK;
    }
    if (lrc != 0 && lrc != MDB_NOTFOUND) {
        return map_err(lrc);
    }
    s->has_log_salt = false;
    if (!make) {
        return STORE_OK;
    }
    rc = fill_random(s->log_salt, STORE_LOG_SALT_BYTES);
    if (rc == STORE_OK) {
        v.mv_size = STORE_LOG_SALT_BYTES;
        v.mv_data = s->log_salt;
        rc = map_err(mdb_put(txn, s->meta, &kv, &v, 0));
    }
    s->has_log_salt = rc == STORE_OK;
    return rc;
}

static uint64_t clamp_u64(uint64_t v, uint64_t lo, uint64_t hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

static void lmdb_close(void *impl);

/* F's directory in the store's: 0 or STORE_EINVAL (too long). */
static int inflight_dir(const struct lmdb_store *r, char *buf, size_t len, const char *file)
{
    int n = snprintf(buf, len, "%s/" INFLIGHT_DIR "%s%s", r->path, file != NULL ? "/" : "",
                     file != NULL ? file : "");
    return n < 0 || (size_t)n >= len ? STORE_EINVAL : STORE_OK;
}

/* Removes F's files: under R's writer lock, in the transaction that makes
 * the store's leases this boot's (leases_settle), before any process of
 * this boot has opened F (every one opens it only once that transaction
 * committed). F was never flushed: after a power cut it may be torn, and
 * its entries' holders died with the boot anyway. */
static int inflight_wipe(struct lmdb_store *r)
{
    static const char *const files[] = {"data.mdb", "lock.mdb"};
    char name[PATH_MAX];

    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        if (inflight_dir(r, name, sizeof(name), files[i]) != STORE_OK) {
            return STORE_EINVAL;
        }
        if (unlink(name) != 0 && errno != ENOENT) {
            return STORE_EIO;
        }
    }
    return STORE_OK;
}

/* Opens F (layout 4) beside R and sets r->fl. Read-only, a missing F is
 * none (r->fl stays NULL): nothing is in flight. Writable, F's directory
 * and environment are made when missing, committed without a flush
 * (MDB_NOSYNC: a process crash loses nothing, a power cut is a reboot,
 * and the next boot removes F). */
static int inflight_open(struct lmdb_store *r, bool read_only, char *err, size_t errlen)
{
    char dir[PATH_MAX];
    char data[PATH_MAX];
    char lock[PATH_MAX];
    struct stat sb;
    struct lmdb_store *f = NULL;
    MDB_txn *txn = NULL;
    MDB_stat est;
    unsigned int flags = MDB_NOTLS | MDB_NOSYNC;
    int dead = 0;
    int lrc = 0;
    int rc = STORE_EINVAL;

    if (inflight_dir(r, dir, sizeof(dir), NULL) != STORE_OK ||
        inflight_dir(r, data, sizeof(data), "data.mdb") != STORE_OK ||
        inflight_dir(r, lock, sizeof(lock), "lock.mdb") != STORE_OK) {
        snprintf(err, errlen, "store: path too long: %s", r->path);
        return STORE_EINVAL;
    }
    if (read_only) {
        if (stat(data, &sb) != 0 || sb.st_size == 0) {
            return STORE_OK; /* no F: nothing in flight */
        }
        flags |= MDB_RDONLY | (stat(lock, &sb) == 0 ? 0 : MDB_NOLOCK);
    } else if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        snprintf(err, errlen, "store: cannot make %s: %s", dir, strerror(errno));
        return STORE_EIO;
    }
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        snprintf(err, errlen, "store: %s is not a directory", dir);
        return STORE_EIO;
    }
    f = calloc(1, sizeof(*f));
    if (f == NULL) {
        snprintf(err, errlen, "store: out of memory");
        return STORE_ENOMEM;
    }
    if (pthread_mutex_init(&f->drop_lock, NULL) != 0) {
        free(f);
        snprintf(err, errlen, "store: cannot create a mutex");
        return STORE_ENOMEM;
    }
    f->rec = r; /* first: lmdb_close() of F goes by it */
    f->durability_fd = -1;
    f->clock = r->clock;
    f->read_only = read_only;
    f->stall_ms = r->stall_ms;
    f->shared_fs = r->shared_fs;
    f->lease_clock = r->lease_clock;
    /* F's writer lock's holds are shared in durability.lock too, after
     * R's (held_check): a stalled write of F held heartbeats up. */
    f->held = r->held != NULL ? r->held + 2 : NULL;
    f->dev = sb.st_dev;
    f->ino = sb.st_ino;
    f->pid = getpid();
    if (!open_envs_add(f)) {
        f->pid = 0;
        snprintf(err, errlen, "store: %s is already open in this process", dir);
        goto fail;
    }
    lrc = mdb_env_create(&f->env);
    if (lrc == 0) {
        lrc = mdb_env_set_mapsize(f->env, read_only ? 0 : (size_t)INFLIGHT_MAP_BYTES);
    }
    if (lrc == 0) {
        lrc = mdb_env_set_maxdbs(f->env, LMDB_MAX_DBS);
    }
    if (lrc == 0) {
        lrc = mdb_env_set_maxreaders(f->env, LMDB_MAX_READERS);
    }
    if (lrc == 0) {
        lrc = mdb_env_open(f->env, dir, flags, 0600);
    }
    if (lrc == 0) {
        lrc = mdb_reader_check(f->env, &dead);
    }
    if (lrc == 0) {
        lrc = mdb_txn_begin(f->env, NULL, read_only ? MDB_RDONLY : 0, &txn);
    }
    if (lrc == 0) {
        unsigned int dbf = read_only ? 0 : MDB_CREATE;
        lrc = mdb_dbi_open(txn, "records", dbf, &f->records);
        if (lrc == 0) {
            lrc = mdb_dbi_open(txn, "inflight", dbf, &f->inflight);
        }
        if (lrc == 0) {
            lrc = mdb_dbi_open(txn, "expiry", dbf, &f->expiry);
        }
        if (lrc == 0) {
            lrc = mdb_dbi_open(txn, "meta", dbf, &f->meta);
        }
        if (lrc == 0 && !read_only) {
            /* F's writes check its layout as R's do (write_begin). */
            uint8_t lv[4] = {STORE_LAYOUT & 0xff, (STORE_LAYOUT >> 8) & 0xff,
                             (STORE_LAYOUT >> 16) & 0xff, STORE_LAYOUT >> 24};
            MDB_val kv = {sizeof(LAYOUT_KEY) - 1, (void *)LAYOUT_KEY};
            MDB_val dv = {sizeof(lv), lv};
            lrc = mdb_put(txn, f->meta, &kv, &dv, 0);
        }
        if (lrc == 0) {
            lrc = mdb_txn_commit(txn);
        } else {
            mdb_txn_abort(txn);
        }
    }
    if (lrc == MDB_NOTFOUND && read_only) {
        rc = STORE_OK; /* made but never written: nothing in flight */
        goto fail;
    }
    if (lrc == 0) {
        lrc = mdb_env_stat(f->env, &est);
    }
    if (lrc != 0) {
        rc = map_err(lrc);
        snprintf(err, errlen, "store: cannot open the records in flight (%s): %s", dir,
                 mdb_strerror(lrc));
        goto fail;
    }
    f->readers_cleared = dead > 0 ? (uint64_t)dead : 0;
    f->page_bytes = est.ms_psize;
    f->reserve_pages = clamp_u64(INFLIGHT_MAP_BYTES / f->page_bytes / 256, RESERVE_MIN_PAGES,
                                 RESERVE_MAX_PAGES);
    f->headroom_pages = 0;
    f->answer_max_pages = 1;
    f->answer_avg_pages_x16 = 16;
    r->fl = f;
    return STORE_OK;
fail:
    lmdb_close(f);
    return rc;
}

/* Layout 3 to 4, in R's write transaction that raises the layout, with F
 * open: IN_PROGRESS records that are not held move from R's inflight table
 * to F (held ones stay: they are R's in layout 4). F's transaction commits
 * first; should R's then fail, the next open moves them again (a put over
 * the same record). */
static int inflight_move_in(struct lmdb_store *s, MDB_txn *txn)
{
    struct lmdb_store *f = s->fl;
    MDB_txn *ftxn = NULL;
    uint8_t *keys = NULL;
    size_t n = 0;
    int rc = in_progress_keys(txn, s->inflight, &keys, &n);

    if (rc != STORE_OK || n == 0) {
        free(keys);
        return rc;
    }
    rc = map_err(mdb_txn_begin(f->env, NULL, 0, &ftxn));
    for (size_t i = 0; rc == STORE_OK && i < n; i++) {
        const uint8_t *key = keys + i * STORE_KEY_BYTES;
        struct store_record_view v;
        enum rec_table where = REC_NONE;
        bool found = false;

        rc = record_load(s, txn, key, &v, &found, &where, true);
        if (rc != STORE_OK || !found || v.state != STORE_STATE_IN_PROGRESS ||
            store_lease_is_held(v.lease_id)) {
            rc = rc == STORE_ECORRUPT ? STORE_OK : rc;
            continue;
        }
        /* v borrows from R's map, which F's writes do not touch. */
        rc = record_put(f, ftxn, key, &v, REC_NONE);
        if (rc == STORE_OK) {
            rc = index_put(f, ftxn, v.expires_ms, key);
        }
        if (rc == STORE_OK) {
            rc = index_del(s, txn, v.expires_ms, key);
        }
        if (rc == STORE_OK) {
            rc = record_del(s, txn, key, where);
        }
    }
    free(keys);
    if (ftxn != NULL) {
        if (rc == STORE_OK) {
            rc = map_err(mdb_txn_commit(ftxn));
        } else {
            mdb_txn_abort(ftxn);
        }
    }
    return rc;
}

static int open_dbs_in(struct lmdb_store *s, unsigned int txn_flags, unsigned int db_flags,
                       uint32_t *layout, bool *current, int *store_rc)
{
    MDB_txn *txn = NULL;
    int lrc = mdb_txn_begin(s->env, NULL, txn_flags, &txn);
    int rc = STORE_OK;

    if (lrc == 0) {
        lrc = mdb_dbi_open(txn, "records", db_flags, &s->records);
    }
    if (lrc == 0) {
        lrc = mdb_dbi_open(txn, "inflight", db_flags, &s->inflight);
    }
    if (lrc == 0) {
        lrc = mdb_dbi_open(txn, "expiry", db_flags, &s->expiry);
    }
    if (lrc == 0) {
        lrc = mdb_dbi_open(txn, "meta", db_flags, &s->meta);
    }
    *current = false;
    if (lrc == 0) {
        rc = layout_read(s, txn, layout);
    }
    if (lrc == 0 && rc == STORE_OK && *layout <= STORE_LAYOUT) {
        rc = leases_current(s, txn, *layout, current);
    }
    if (lrc == 0 && rc == STORE_OK && *layout <= STORE_LAYOUT) {
        rc = log_salt_settle(s, txn, false);
    }
    /* Not on a newer layout, which another process may have written
     * between the read-only look and this transaction: open_dbs refuses it. */
    if (lrc == 0 && rc == STORE_OK && !(txn_flags & MDB_RDONLY) && *layout <= STORE_LAYOUT &&
        (*layout < STORE_LAYOUT || !*current)) {
        uint32_t before = *layout;
        bool was_current = *current;
        rc = leases_settle(s, txn, *layout);
        /* Layout 4: F of another boot (or of none) goes, under R's writer
         * lock, before this process or any other of this boot opens it;
         * then a store of an older layout moves its records in flight. */
        if (rc == STORE_OK && !was_current && s->fl == NULL) {
            rc = inflight_wipe(s);
        }
        if (rc == STORE_OK && s->fl == NULL) {
            char ferr[256];
            rc = inflight_open(s, false, ferr, sizeof(ferr));
        }
        if (rc == STORE_OK && before < STORE_LAYOUT) {
            rc = inflight_move_in(s, txn);
        }
        if (rc == STORE_OK) {
            *layout = STORE_LAYOUT;
            *current = true;
        }
    }
    if (lrc == 0 && rc == STORE_OK) {
        lrc = mdb_txn_commit(txn);
    } else if (txn != NULL) {
        mdb_txn_abort(txn);
    }
    *store_rc = rc;
    return lrc != 0 ? lrc : rc == STORE_ECORRUPT ? MDB_CORRUPTED : 0;
}

/* Opens the databases. An existing store of this layout is opened
 * read-only, so that opening one beside running proxies (check-store, a
 * second process) neither waits for the writer lock nor writes; a new store,
 * or one of an older layout, takes a write transaction to create what is
 * missing and record the layout. A store of a newer layout is refused. */
static int open_dbs(struct lmdb_store *s, char *err, size_t errlen)
{
    uint32_t layout = 0;
    bool current = false;
    const char *epoch = lease_epoch(s);
    int src = STORE_OK;
    int lrc;

    if (!s->read_only && epoch != NULL && epoch[0] == '\0') {
        snprintf(err, errlen,
                 "store: cannot tell this boot from another (/proc/sys/kernel/random/boot_id "
                 "unreadable), so leases left by processes before a reboot could not be told "
                 "from live ones");
        return STORE_EINVAL;
    }
    lrc = open_dbs_in(s, MDB_RDONLY, 0, &layout, &current, &src);

    if ((s->read_only || s->keep_layout) && lrc == MDB_NOTFOUND) {
        snprintf(err, errlen,
                 "no store here: its tables are missing (not an idemproxy store, or one of an "
                 "older layout, which a proxy of this version upgrades when it opens it)");
        return STORE_EINVAL;
    }
    if (s->keep_layout && lrc == 0 && layout < STORE_LAYOUT) {
        snprintf(err, errlen,
                 "store: of an older layout (%u; this idemproxy's is %u): writing to it would "
                 "upgrade it, and the older proxies running on it would stop writing. Use the "
                 "idemproxy that serves it, or start a proxy of this version on it first (it "
                 "upgrades the store)",
                 (unsigned)layout, STORE_LAYOUT);
        return STORE_EINVAL;
    }
    if (!s->read_only && (lrc == MDB_NOTFOUND || (lrc == 0 && layout <= STORE_LAYOUT &&
                                                  (layout < STORE_LAYOUT || !current)))) {
        lrc = open_dbs_in(s, 0, MDB_CREATE, &layout, &current, &src);
    }
    if (lrc == 0 && src != STORE_OK) {
        snprintf(err, errlen, "store: cannot settle the leases of the records in flight: %s",
                 store_strerror(src));
        return src;
    }
    if (lrc == MDB_CORRUPTED) {
        snprintf(err, errlen, "store: cannot open databases: the layout record is malformed");
        return STORE_ECORRUPT;
    }
    if (lrc != 0) {
        snprintf(err, errlen, "store: cannot open databases: %s", mdb_strerror(lrc));
        return map_err(lrc);
    }
    s->layout = layout;
    s->lease_clock = current ? STORE_LEASES_THIS_BOOT
                     : layout < 3 ? STORE_LEASES_WALL
                                  : STORE_LEASES_OTHER_BOOT;
    if (layout > STORE_LAYOUT) {
        snprintf(err, errlen,
                 "store: written by a newer idemproxy (store layout %u, this one knows up to "
                 "%u); run that version or newer on it",
                 (unsigned)layout, STORE_LAYOUT);
        return STORE_EINVAL;
    }
    return STORE_OK;
}


/* Before mdb_env_open (after it, closing a descriptor of lock.mdb would drop
 * this process's own LMDB locks on it): whether another process has the
 * store open. Each holds a shared lock on byte 0 of lock.mdb for as long as
 * it has the environment open (LMDB, mdb_env_setup_locks). A look that
 * fails says no. */
static bool others_have_it_open(const char *path)
{
    char lock[4096];
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    bool yes = false;
    int fd;

    if (snprintf(lock, sizeof(lock), "%s/lock.mdb", path) >= (int)sizeof(lock)) {
        return false;
    }
    fd = open(lock, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        yes = fcntl(fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
        close(fd);
    }
    return yes;
}

/* Before mdb_env_open: is there a store at path, and is its data file not
 * emptied? LMDB takes a missing or empty data.mdb for a new environment and
 * initialises it, so an emptied one would silently become an empty store
 * (every key would run again). A new store is made only where data.mdb does
 * not exist. An empty one is taken as being created only while its creator
 * holds LMDB's exclusive lock (byte 0 of lock.mdb, held from before data.mdb
 * is created until its meta pages are written); then mdb_env_open waits for
 * it. *exists tells whether data.mdb exists, *has_lock whether lock.mdb
 * does. */
static int probe_data_file(const char *path, bool read_only, bool *exists, bool *has_lock,
                           char *err, size_t errlen)
{
    char data[4096], lock[4096];
    struct stat sb;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    int fd;

    *exists = false;
    *has_lock = false;
    if (snprintf(data, sizeof(data), "%s/data.mdb", path) >= (int)sizeof(data) ||
        snprintf(lock, sizeof(lock), "%s/lock.mdb", path) >= (int)sizeof(lock)) {
        snprintf(err, errlen, "store: path too long");
        return STORE_EINVAL;
    }
    *has_lock = stat(lock, &sb) == 0;
    if (stat(data, &sb) != 0) {
        if (errno == ENOENT && !read_only) {
            return STORE_OK; /* a new store */
        }
        snprintf(err, errlen, "no store here: %s/data.mdb: %s", path, strerror(errno));
        return errno == ENOENT ? STORE_EINVAL : STORE_EIO;
    }
    *exists = true;
    if (sb.st_size != 0) {
        return STORE_OK;
    }
    fd = open(lock, O_RDONLY | O_CLOEXEC);
    if (fd >= 0 && fcntl(fd, F_GETLK, &fl) == 0 && fl.l_type == F_WRLCK) {
        close(fd);
        return STORE_OK; /* being created: mdb_env_open waits for its lock */
    }
    if (fd >= 0) {
        close(fd);
    }
    /* Its creator may have finished between the two looks. */
    if (stat(data, &sb) == 0 && sb.st_size != 0) {
        return STORE_OK;
    }
    snprintf(err, errlen,
             "store %s is damaged: data.mdb is 0 bytes, LMDB needs at least its 2 meta pages; "
             "restore it from a backup (a new store is created only where data.mdb does not "
             "exist)",
             path);
    return STORE_ECORRUPT;
}

/* After mdb_env_open, before any page beyond the meta pages is touched: a
 * data file shorter than the last page in use (LMDB maps the file and would
 * take SIGBUS reading past its end) is refused. The meta is read first, so a
 * commit by another process in between only makes the file longer (LMDB
 * writes the pages before the meta that points at them). */
static int check_data_file(struct lmdb_store *s, const char *path, char *err, size_t errlen)
{
    MDB_envinfo info;
    MDB_stat est;
    struct stat sb;
    uint64_t need;
    int fd = -1;
    int lrc = mdb_env_info(s->env, &info);

    if (lrc == 0) {
        lrc = mdb_env_stat(s->env, &est);
    }
    if (lrc == 0) {
        lrc = mdb_env_get_fd(s->env, &fd);
    }
    if (lrc != 0) {
        snprintf(err, errlen, "store: cannot stat the environment: %s", mdb_strerror(lrc));
        return map_err(lrc);
    }
    if (fstat(fd, &sb) != 0) {
        snprintf(err, errlen, "store: cannot stat %s/data.mdb: %s", path, strerror(errno));
        return STORE_EIO;
    }
    need = ((uint64_t)info.me_last_pgno + 1) * est.ms_psize;
    if ((uint64_t)sb.st_size < need) {
        snprintf(err, errlen,
                 "store %s is damaged: data.mdb is %lld bytes, LMDB needs %llu; restore it from "
                 "a backup",
                 path, (long long)sb.st_size, (unsigned long long)need);
        return STORE_ECORRUPT;
    }
    return STORE_OK;
}

static int lmdb_open(const struct store_options *opt, void **impl, char *err, size_t errlen)
{
    struct lmdb_store *s = NULL;
    uint64_t map_bytes = opt->map_size_bytes != 0 ? opt->map_size_bytes : LMDB_DEFAULT_MAP_BYTES;
    unsigned int flags = MDB_NOTLS;
    struct stat sb;
    MDB_stat est;
    bool data_exists = false, has_lock = false;
    size_t made_len = 0;
    int dead = 0;
    int lrc;
    int rc = STORE_ENOMEM;

    /* The store's callers may pass err == NULL; snprintf(NULL, 0) is fine. */
    if (err == NULL) {
        errlen = 0;
    }
    s = calloc(1, sizeof(*s));
    if (s == NULL) {
        snprintf(err, errlen, "store: out of memory");
        goto out;
    }
    s->durability_fd = -1;
    s->clock = opt->clock != NULL ? *opt->clock : store_clock_realtime;
    rc = STORE_EINVAL;
    if (s->clock.now_ms == NULL || map_bytes > SIZE_MAX) {
        snprintf(err, errlen, "store: bad clock or map size");
        goto out;
    }

    s->path = strdup(opt->path);
    if (s->path == NULL) {
        rc = STORE_ENOMEM;
        snprintf(err, errlen, "store: out of memory");
        goto out;
    }
    s->read_only = opt->read_only;
    s->keep_layout = opt->keep_layout && !opt->read_only;
    s->stall_ms = opt->stall_ms > 0 ? opt->stall_ms : 0;
    /* A read-only look (check-store) is allowed anywhere: it takes no lock
     * a writer needs, and it may be how someone finds out what is there. */
    if (!s->read_only) {
        rc = check_file_system(opt->path, opt->allow_shared_fs, &s->shared_fs, err, errlen);
        if (rc != STORE_OK) {
            goto out;
        }
        rc = s->keep_layout ? STORE_OK : make_dirs(opt->path, &made_len, err, errlen);
        if (rc != STORE_OK) {
            goto out;
        }
    }
    rc = STORE_EIO;
    if (stat(opt->path, &sb) != 0) {
        rc = errno == ENOENT ? STORE_EINVAL : STORE_EIO;
        snprintf(err, errlen, "%s%s: %s",
                 errno == ENOENT ? "no store here: " : "store: ", opt->path, strerror(errno));
        goto out;
    }
    if (!S_ISDIR(sb.st_mode)) {
        rc = STORE_EINVAL;
        snprintf(err, errlen, "store: %s is not a directory", opt->path);
        goto out;
    }
    s->dev = sb.st_dev;
    s->ino = sb.st_ino;
    s->pid = getpid();
    if (!open_envs_add(s)) {
        s->pid = 0; /* not ours to remove from the list */
        rc = STORE_EINVAL;
        snprintf(err, errlen, "store: %s is already open in this process", opt->path);
        goto out;
    }
    rc = probe_data_file(opt->path, s->read_only || s->keep_layout, &data_exists, &has_lock, err,
                         errlen);
    if (rc != STORE_OK) {
        goto out;
    }
    /* Before the environment: a sync process's lock is there before its
     * first transaction (follow_sync). keep_layout creates nothing. */
    if (!s->read_only && !s->keep_layout) {
        rc = durability_open(s, opt->path, opt->sync, err, errlen);
        if (rc != STORE_OK) {
            goto out;
        }
    }
    /* The map size: a process alone on the store maps what it was given
     * (LMDB raises it to the data's size if that is larger). Beside other
     * processes it maps at least the size the store records, the largest
     * any of them set (LMDB keeps the larger at every commit): one given a
     * smaller map_size would otherwise find its map full while the store has
     * room, and, each time another grows the file past its map, stop
     * (MDB_MAP_RESIZED) and come back as full (README, failure policy).
     * Read-only: 0, the size the store records. */
    s->map_from_store = !s->read_only && data_exists && others_have_it_open(opt->path);
    lrc = mdb_env_create(&s->env);
    if (lrc == 0) {
        lrc =
            mdb_env_set_mapsize(s->env, s->read_only || s->map_from_store ? 0 : (size_t)map_bytes);
    }
    if (lrc == 0) {
        lrc = mdb_env_set_maxdbs(s->env, LMDB_MAX_DBS);
    }
    if (lrc == 0) {
        lrc = mdb_env_set_maxreaders(s->env, LMDB_MAX_READERS);
    }
    if (lrc != 0) {
        rc = map_err(lrc);
        snprintf(err, errlen, "store: cannot create the environment: %s", mdb_strerror(lrc));
        goto out;
    }
    /* MDB_NOTLS: reads happen on many threads and read transactions are
     * pooled across them. MDB_NOSYNC when the caller syncs on an interval
     * (store_sync): a process crash loses nothing, a machine crash may lose
     * the commits since the last sync and, on a file system that does not
     * keep write order, corrupt the store (lmdb.h, MDB_NOSYNC). */
    if (!opt->sync) {
        if (s->interval && sync_process_present(s)) {
            s->following_sync = true; /* the open's own commits too */
        } else {
            flags |= MDB_NOSYNC;
        }
    }
    /* Read-only creates nothing: without a lock.mdb (which every process
     * that opens the store creates) no process has it open, and LMDB would
     * create one, so it goes without. */
    if (s->read_only) {
        flags |= MDB_RDONLY | (has_lock ? 0 : MDB_NOLOCK);
    }
    lrc = mdb_env_open(s->env, opt->path, flags, 0600);
    if (lrc == MDB_INVALID && data_exists) {
        rc = STORE_ECORRUPT;
        snprintf(err, errlen,
                 "store %s is damaged: data.mdb is too short or not an LMDB file (%s); restore "
                 "it from a backup",
                 opt->path, mdb_strerror(lrc));
        goto out;
    }
    if (lrc != 0) {
        rc = map_err(lrc);
        snprintf(err, errlen, "store: cannot open %s (its data.mdb and lock.mdb): %s", opt->path,
                 mdb_strerror(lrc));
        goto out;
    }
    rc = check_data_file(s, opt->path, err, errlen);
    if (rc != STORE_OK) {
        goto out;
    }
    if (s->map_from_store) {
        /* Mapped at the store's size; a larger one given is taken (no
         * transaction of this process is open yet, as LMDB requires). */
        MDB_envinfo info;
        lrc = mdb_env_info(s->env, &info);
        if (lrc == 0 && map_bytes > info.me_mapsize) {
            lrc = mdb_env_set_mapsize(s->env, (size_t)map_bytes);
            s->map_from_store = false;
        }
        if (lrc != 0) {
            rc = map_err(lrc);
            snprintf(err, errlen, "store: cannot set the map size: %s", mdb_strerror(lrc));
            goto out;
        }
    }
    /* A process that died inside a read transaction leaves its reader slot
     * taken, pinning old pages until someone clears it. */
    lrc = mdb_reader_check(s->env, &dead);
    if (lrc != 0) {
        rc = map_err(lrc);
        snprintf(err, errlen, "store: reader check failed: %s", mdb_strerror(lrc));
        goto out;
    }
    s->readers_cleared = dead > 0 ? (uint64_t)dead : 0;
    rc = open_dbs(s, err, errlen);
    if (rc != STORE_OK) {
        goto out;
    }
    /* Layout 4's records in flight. A writer's leases are this boot's by
     * now (open_dbs), so F, kept or just wiped, is of this boot, and made
     * if missing. A read-only look opens F only when the store's leases are
     * this boot's; otherwise F may be torn, and what it held ended with the
     * boot. */
    if (s->fl == NULL && (!s->read_only || (s->layout == STORE_LAYOUT &&
                                            s->lease_clock == STORE_LEASES_THIS_BOOT))) {
        rc = inflight_open(s, s->read_only, err, errlen);
        if (rc != STORE_OK) {
            goto out;
        }
    }
    if (!s->read_only) {
        rc = sync_at_open(s, opt->path, made_len, err, errlen);
        if (rc != STORE_OK) {
            goto out;
        }
    }
    lrc = mdb_env_stat(s->env, &est);
    if (lrc != 0) {
        rc = map_err(lrc);
        snprintf(err, errlen, "store: cannot stat the environment: %s", mdb_strerror(lrc));
        goto out;
    }
    s->page_bytes = est.ms_psize;
    /* A store without a log salt gets one in a transaction of its own, best
     * effort: a store too full for 32 more bytes still opens (its replays
     * work), and the caller hashes with a salt of its own meanwhile. */
    if (!s->read_only && !s->keep_layout && !s->has_log_salt) {
        MDB_txn *txn = NULL;
        if (mdb_txn_begin(s->env, NULL, 0, &txn) == 0) {
            if (log_salt_settle(s, txn, true) != STORE_OK) {
                mdb_txn_abort(txn);
                s->has_log_salt = false;
            } else if (mdb_txn_commit(txn) != 0) { /* frees txn either way */
                s->has_log_salt = false;
            }
        }
    }
    {
        /* The map as mapped: what the reserves below are a share of. */
        MDB_envinfo info;
        lrc = mdb_env_info(s->env, &info);
        if (lrc != 0) {
            rc = map_err(lrc);
            snprintf(err, errlen, "store: cannot stat the environment: %s", mdb_strerror(lrc));
            goto out;
        }
        map_bytes = info.me_mapsize;
    }
    s->reserve_pages =
        clamp_u64(map_bytes / s->page_bytes / 256, RESERVE_MIN_PAGES, RESERVE_MAX_PAGES);
    s->headroom_pages =
        clamp_u64(map_bytes / 64, HEADROOM_MIN_BYTES, HEADROOM_MAX_BYTES) / s->page_bytes;
    s->answer_max_pages = 1;
    s->answer_avg_pages_x16 = 16;
    *impl = s;
    s = NULL;
out:
    if (s != NULL) {
        lmdb_close(s);
    }
    return rc;
}

static void lmdb_close(void *impl)
{
    struct lmdb_store *s = impl;
    if (s != NULL) {
        if (s->fl != NULL) {
            if (!s->read_only) {
                inflight_drops_flush(s->fl);
            }
            lmdb_close(s->fl);
            s->fl = NULL;
        }
        if (s->rec != NULL) {
            free(s->drops);
            pthread_mutex_destroy(&s->drop_lock);
        }
        free(s->path);
        /* Pooled transactions hold reader slots of this environment, so
         * they go before it does. */
        for (size_t i = 0; i < LMDB_READ_POOL; i++) {
            MDB_txn *txn = atomic_load(&s->pool[i].txn);
            if (txn != NULL) {
                mdb_txn_abort(txn);
            }
        }
        if (s->env != NULL) {
            mdb_env_close(s->env);
        }
        if (s->pid != 0) {
            open_envs_remove(s);
        }
        if (s->held != NULL && s->rec == NULL) { /* F's is R's mapping */
            munmap((void *)s->held, HELD_BYTES);
        }
        if (s->durability_fd >= 0) {
            close(s->durability_fd);
        }
        OPENSSL_cleanse(s->lease_random, sizeof(s->lease_random));
        free(s);
    }
}

const struct store_ops store_lmdb_ops = {
    .name = "lmdb",
    .open = lmdb_open,
    .close = lmdb_close,
    .apply = lmdb_apply,
    .apply_purge = lmdb_apply_purge,
    .get = lmdb_get,
    .view = lmdb_view,
    .purge = lmdb_purge,
    .reader_check = lmdb_reader_check,
    .stats = lmdb_stats,
    .scan = lmdb_scan,
    .sync = lmdb_sync,
};
