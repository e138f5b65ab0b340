/*
 * powercut.c - an LD_PRELOAD library that keeps, next to one file, the image
 * that file would have on disk after a power cut: what was flushed, and
 * nothing else. test_power_cut.py runs idemproxy under it and, after a
 * SIGKILL, puts that image in place of the store's data.mdb.
 *
 * A write to the watched file (pwrite, write, writev, through any descriptor
 * open on it) reaches the page cache only. It is copied into the image
 *  - when a later fdatasync() or fsync() of the file returns: every write
 *    that returned before the flush began is then on disk, whichever
 *    descriptor made it (a flush covers the file, POSIX fsync()), or
 *  - when it returns, if the descriptor was opened with O_DSYNC or O_SYNC
 *    (LMDB writes its meta page that way, and only that write is durable).
 * A write still waiting for a flush is also appended to a pending log, so the
 * test can add any subset of them to the image: on a real power cut the
 * device may have written some of them already.
 *
 * The image is updated after the real call returns and before the caller
 * goes on, so anything the process did after a flush (say, answering a
 * client) happened after the image holds it. A SIGKILL between the two only
 * leaves the image behind the disk, never ahead of it.
 *
 * Environment:
 *   POWERCUT_FILE     absolute path of the watched file (the store's data.mdb)
 *   POWERCUT_IMAGE    path of the image (created; an existing watched file is
 *                     copied into it first, as flushed). Several processes on
 *                     one store share it (see open_image)
 *   POWERCUT_PENDING  path of the pending log: records "PCW1", offset (8
 *                     bytes, little endian), length (8), then the bytes
 *   POWERCUT_STATS    optional: rewritten after every flush with
 *                     "flushes=N dsync_writes=N applied_bytes=N"
 *   POWERCUT_KILL_AT_WRITE  optional N: the process SIGKILLs itself right
 *                     after its Nth unflushed write to the file, so the cut
 *                     lands inside a commit, between its page writes and
 *                     its flush
 *   POWERCUT_FAIL_DSYNC_AT  optional N: the Nth write through an O_DSYNC
 *                     descriptor (LMDB's meta page) fails with EIO and writes
 *                     nothing, as a failing device would
 *   POWERCUT_KILL_AT_FLUSH  optional N: at the start of the Nth flush of the
 *                     file the calling thread sleeps 30 ms (so whatever the
 *                     other threads would send before that flush is sent)
 *                     and then SIGKILLs the process
 *   POWERCUT_ARM_FILE  optional path: the two above count only the writes
 *                     and flushes made once this file exists (looked for
 *                     at each of them until it does), so a test can cut at
 *                     a point it sees coming, say a purge under way
 *
 *   POWERCUT_DIRLOG   optional: every directory the process flushes (an
 *                     fsync() or fdatasync() of a directory that returned 0)
 *                     is appended to this file, its path and a newline.
 *                     Works without POWERCUT_FILE too
 *   POWERCUT_DIR_FSYNC_ERRNO  optional N: every flush of a directory fails
 *                     with errno N and flushes nothing, as on a file system
 *                     that does not flush directories (EINVAL) or a failing
 *                     device (EIO)
 *
 * The file's directory entry: "dir_flushed=1" in the stats once an fsync()
 * of the file's directory has returned after the file was opened (POSIX
 * wants that for a new file to survive; LMDB never does it). The test
 * requires it; it does not model a file that vanished.
 *
 * Not modelled: writes through mmap (the store does not use MDB_WRITEMAP).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_FDS 16

struct pending {
    unsigned long long seq; /* order of the writes, from 1 */
    off_t off;
    size_t len;
    unsigned char *data;
};

static struct {
    pthread_once_t once;
    pthread_mutex_t lock;
    int (*open)(const char *, int, ...);
    int (*open64)(const char *, int, ...);
    int (*openat)(int, const char *, int, ...);
    int (*close)(int);
    ssize_t (*pwrite)(int, const void *, size_t, off_t);
    ssize_t (*pwrite64)(int, const void *, size_t, off_t);
    ssize_t (*write)(int, const void *, size_t);
    ssize_t (*writev)(int, const struct iovec *, int);
    int (*fdatasync)(int);
    int (*fsync)(int);
    const char *file;
    const char *image_path;
    const char *pending_path;
    const char *stats_path;
    int image_fd;
    int pending_fd;
    char dir[PATH_MAX];   /* the watched file's directory */
    int fds[MAX_FDS];     /* descriptors open on the watched file, -1 free */
    int dsync[MAX_FDS];
    int dir_fds[MAX_FDS]; /* descriptors open on its directory, -1 free */
    int dir_flushed;
    struct pending *pend;
    size_t npend, cap;
    unsigned long long flushes, dsync_writes, applied_bytes;
    unsigned long long writes, kill_at_write, kill_at_flush, seq;
    const char *arm_path;
    int armed;
    unsigned long long flushes_unarmed; /* flushes before the arm file appeared */
    unsigned long long dsync_calls, fail_dsync_at;
    const char *dirlog_path;
    int dir_fsync_errno;
} pc = {.once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER};

/* Any failure here would make the image wrong without anyone knowing: stop
 * the process instead (the test then fails on the proxy's exit). */
static void die(const char *what)
{
    char msg[256];
    int n = snprintf(msg, sizeof msg, "powercut: %s: %s\n", what, strerror(errno));
    if (n > 0 && pc.write) {
        (void)!pc.write(2, msg, (size_t)n);
    }
    abort();
}

/* The next definition of `name` (libc's, or a sanitizer's interceptor),
 * stored into the function pointer at `slot` (POSIX allows the conversion
 * through memcpy; ISO C has no cast for it). */
static void real(void *slot, size_t size, const char *name)
{
    void *f = dlsym(RTLD_NEXT, name);
    if (f == NULL || size != sizeof f) {
        abort();
    }
    memcpy(slot, &f, sizeof f);
}

#define REAL(field, name) real(&pc.field, sizeof pc.field, name)

static void write_all(int fd, const void *buf, size_t len, off_t off)
{
    const unsigned char *p = buf;
    while (len > 0) {
        ssize_t w = pc.pwrite(fd, p, len, off);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            die("writing the image");
        }
        p += w;
        len -= (size_t)w;
        off += w;
    }
}

static void append_all(int fd, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    while (len > 0) {
        ssize_t w = pc.write(fd, p, len);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            die("writing the pending log");
        }
        p += w;
        len -= (size_t)w;
    }
}

static void init(void)
{
    REAL(open, "open");
    REAL(open64, "open64");
    REAL(openat, "openat");
    REAL(close, "close");
    REAL(pwrite, "pwrite");
    REAL(pwrite64, "pwrite64");
    REAL(write, "write");
    REAL(writev, "writev");
    REAL(fdatasync, "fdatasync");
    REAL(fsync, "fsync");
    pc.file = getenv("POWERCUT_FILE");
    pc.image_path = getenv("POWERCUT_IMAGE");
    pc.pending_path = getenv("POWERCUT_PENDING");
    pc.stats_path = getenv("POWERCUT_STATS");
    if (getenv("POWERCUT_KILL_AT_WRITE") != NULL) {
        pc.kill_at_write = strtoull(getenv("POWERCUT_KILL_AT_WRITE"), NULL, 10);
    }
    if (getenv("POWERCUT_FAIL_DSYNC_AT") != NULL) {
        pc.fail_dsync_at = strtoull(getenv("POWERCUT_FAIL_DSYNC_AT"), NULL, 10);
    }
    if (getenv("POWERCUT_KILL_AT_FLUSH") != NULL) {
        pc.kill_at_flush = strtoull(getenv("POWERCUT_KILL_AT_FLUSH"), NULL, 10);
    }
    pc.arm_path = getenv("POWERCUT_ARM_FILE");
    pc.armed = pc.arm_path == NULL;
    pc.dirlog_path = getenv("POWERCUT_DIRLOG");
    if (getenv("POWERCUT_DIR_FSYNC_ERRNO") != NULL) {
        pc.dir_fsync_errno = atoi(getenv("POWERCUT_DIR_FSYNC_ERRNO"));
    }
    pc.image_fd = -1;
    pc.pending_fd = -1;
    for (int i = 0; i < MAX_FDS; i++) {
        pc.fds[i] = -1;
        pc.dir_fds[i] = -1;
    }
    if (pc.file == NULL || pc.image_path == NULL || pc.pending_path == NULL ||
        strlen(pc.file) >= sizeof(pc.dir) || strrchr(pc.file, '/') == NULL) {
        pc.file = NULL; /* nothing to watch */
    } else {
        size_t n = (size_t)(strrchr(pc.file, '/') - pc.file);
        memcpy(pc.dir, pc.file, n);
        pc.dir[n > 0 ? n : 1] = '\0';
        if (n == 0) {
            pc.dir[0] = '/';
        }
    }
}

static void write_stats(void);

/* Whether the kill counters run: always without POWERCUT_ARM_FILE, else
 * from when the file exists. Lock held. */
static int armed(void)
{
    if (!pc.armed && access(pc.arm_path, F_OK) == 0) {
        pc.armed = 1;
        pc.flushes_unarmed = pc.flushes;
    }
    return pc.armed;
}

static void setup(void)
{
    (void)pthread_once(&pc.once, init);
}

/* Opens the image and the pending log the first time the watched file is
 * opened. The first process creates the image, taking an existing file as
 * flushed; another process on the same store (same POWERCUT_IMAGE, its own
 * pending log) keeps the image as it is. That is exact for LMDB: a commit's
 * writes and its flush are made by one process, under the writer lock.
 * Called with the lock held. */
static void open_image(int fd)
{
    struct stat st;
    unsigned char buf[65536];
    off_t off = 0;

    if (pc.image_fd >= 0) {
        return;
    }
    pc.pending_fd = pc.open(pc.pending_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC,
                            0600);
    pc.image_fd = pc.open(pc.image_path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (pc.image_fd < 0 && errno == EEXIST) {
        pc.image_fd = pc.open(pc.image_path, O_RDWR | O_CLOEXEC);
        if (pc.image_fd < 0 || pc.pending_fd < 0) {
            die("opening the image");
        }
        write_stats();
        return;
    }
    if (pc.image_fd < 0 || pc.pending_fd < 0) {
        die("opening the image");
    }
    if (fstat(fd, &st) != 0) {
        die("fstat");
    }
    while (off < st.st_size) {
        ssize_t r = pread(fd, buf, sizeof buf, off);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            die("copying the watched file");
        }
        write_all(pc.image_fd, buf, (size_t)r, off);
        off += r;
    }
    write_stats();
}

static int slot_in(const int *fds, int fd)
{
    for (int i = 0; i < MAX_FDS; i++) {
        if (fds[i] == fd) {
            return i;
        }
    }
    return -1;
}

static int slot_of(int fd)
{
    return slot_in(pc.fds, fd);
}

static int watched(int fd)
{
    int i;
    if (pc.file == NULL || fd < 0) {
        return -1;
    }
    pthread_mutex_lock(&pc.lock);
    i = slot_of(fd);
    pthread_mutex_unlock(&pc.lock);
    return i;
}

static void after_open(const char *path, int flags, int fd)
{
    char abs[PATH_MAX];
    int i;

    if (pc.file == NULL || fd < 0) {
        return;
    }
    if (realpath(path, abs) == NULL) {
        return;
    }
    if (strcmp(abs, pc.dir) == 0) {
        pthread_mutex_lock(&pc.lock);
        i = slot_in(pc.dir_fds, -1);
        if (i < 0) {
            errno = EMFILE;
            die("too many descriptors on the watched file's directory");
        }
        pc.dir_fds[i] = fd;
        pthread_mutex_unlock(&pc.lock);
        return;
    }
    if (strcmp(abs, pc.file) != 0) {
        return;
    }
    pthread_mutex_lock(&pc.lock);
    i = slot_of(-1);
    if (i < 0) {
        errno = EMFILE;
        die("too many descriptors on the watched file");
    }
    open_image(fd);
    pc.fds[i] = fd;
    pc.dsync[i] = (flags & (O_DSYNC | O_SYNC)) != 0;
    pthread_mutex_unlock(&pc.lock);
}

static void append_record(const struct pending *p)
{
    unsigned char head[20];
    uint64_t o = (uint64_t)p->off, l = (uint64_t)p->len;
    memcpy(head, "PCW1", 4);
    for (int k = 0; k < 8; k++) {
        head[4 + k] = (unsigned char)(o >> (8 * k));
        head[12 + k] = (unsigned char)(l >> (8 * k));
    }
    append_all(pc.pending_fd, head, sizeof head);
    append_all(pc.pending_fd, p->data, p->len);
}

/* The pending log rewritten to hold exactly pc.pend. Lock held. */
static void rewrite_pending_log(void)
{
    if (ftruncate(pc.pending_fd, 0) != 0) {
        die("truncating the pending log");
    }
    for (size_t i = 0; i < pc.npend; i++) {
        append_record(&pc.pend[i]);
    }
}

/* A write that returned: durable now on an O_DSYNC descriptor, else pending.
 * Called with the lock held. A durable write also replaces its bytes in the
 * pending writes it overlaps: the page cache holds only the newer bytes, so a
 * later flush, or a device that wrote the page early, can only put those
 * there. */
static void record(int slot, const void *buf, size_t len, off_t off)
{
    if (pc.dsync[slot]) {
        int patched = 0;
        write_all(pc.image_fd, buf, len, off);
        pc.dsync_writes++;
        pc.applied_bytes += len;
        for (size_t i = 0; i < pc.npend; i++) {
            struct pending *p = &pc.pend[i];
            off_t lo = p->off > off ? p->off : off;
            off_t hi = p->off + (off_t)p->len < off + (off_t)len ? p->off + (off_t)p->len
                                                                  : off + (off_t)len;
            if (lo < hi) {
                memcpy(p->data + (lo - p->off), (const unsigned char *)buf + (lo - off),
                       (size_t)(hi - lo));
                patched = 1;
            }
        }
        if (patched) {
            rewrite_pending_log();
        }
        return;
    }
    if (pc.npend == pc.cap) {
        size_t cap = pc.cap ? pc.cap * 2 : 256;
        struct pending *np = realloc(pc.pend, cap * sizeof *np);
        if (np == NULL) {
            die("realloc");
        }
        pc.pend = np;
        pc.cap = cap;
    }
    struct pending *p = &pc.pend[pc.npend];
    p->data = malloc(len ? len : 1);
    if (p->data == NULL) {
        die("malloc");
    }
    memcpy(p->data, buf, len);
    p->seq = ++pc.seq;
    p->off = off;
    p->len = len;
    pc.npend++;
    append_record(p);
    if (pc.kill_at_write != 0 && armed() && ++pc.writes == pc.kill_at_write) {
        raise(SIGKILL);
    }
}

/* The counters, replaced whole (written aside, then renamed) so that a
 * SIGKILL never leaves a cut file. Lock held. */
static void write_stats(void)
{
    char line[160], tmp[PATH_MAX];
    int fd, n;
    if (pc.stats_path == NULL) {
        return;
    }
    n = snprintf(line, sizeof line,
                 "flushes=%llu dsync_writes=%llu applied_bytes=%llu dir_flushed=%d\n",
                 pc.flushes, pc.dsync_writes, pc.applied_bytes, pc.dir_flushed);
    if (n <= 0 || snprintf(tmp, sizeof tmp, "%s.tmp", pc.stats_path) >= (int)sizeof tmp) {
        die("the stats path");
    }
    fd = pc.open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        die("writing the stats");
    }
    append_all(fd, line, (size_t)n);
    pc.close(fd);
    if (rename(tmp, pc.stats_path) != 0) {
        die("renaming the stats");
    }
}

/* A flush of the watched file returned: the pending writes up to sequence
 * number `upto` (the ones that returned before it began) are on disk. By
 * number, not position, so that two flushes that overlap (two threads) each
 * apply only what came before their own start. */
static void flushed(int fd, unsigned long long upto)
{
    struct stat st;
    size_t kept = 0;

    pthread_mutex_lock(&pc.lock);
    for (size_t i = 0; i < pc.npend; i++) {
        if (pc.pend[i].seq <= upto) {
            write_all(pc.image_fd, pc.pend[i].data, pc.pend[i].len, pc.pend[i].off);
            pc.applied_bytes += pc.pend[i].len;
            free(pc.pend[i].data);
        } else {
            pc.pend[kept++] = pc.pend[i];
        }
    }
    pc.npend = kept;
    /* The file's size is flushed too (posix_fallocate grows it ahead). */
    if (fstat(fd, &st) == 0) {
        struct stat ist;
        if (fstat(pc.image_fd, &ist) != 0) {
            die("fstat of the image");
        }
        if (st.st_size > ist.st_size && ftruncate(pc.image_fd, st.st_size) != 0) {
            die("growing the image");
        }
    }
    /* The pending log keeps only what is still pending. */
    rewrite_pending_log();
    pc.flushes++;
    write_stats();
    pthread_mutex_unlock(&pc.lock);
}

/* A flush of any directory: failed on request (POWERCUT_DIR_FSYNC_ERRNO),
 * logged when it returns 0 (POWERCUT_DIRLOG). */
static int dir_flush(int (*fn)(int), int fd)
{
    char link[64], path[PATH_MAX + 1];
    ssize_t n;
    int rc;

    if (pc.dir_fsync_errno != 0) {
        errno = pc.dir_fsync_errno;
        return -1;
    }
    rc = fn(fd);
    if (rc != 0 || pc.dirlog_path == NULL) {
        return rc;
    }
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, path, PATH_MAX);
    if (n <= 0) {
        die("reading a flushed directory's path");
    }
    path[n++] = '\n';
    pthread_mutex_lock(&pc.lock);
    int log = pc.open(pc.dirlog_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (log < 0 || pc.write(log, path, (size_t)n) != n) {
        die("writing the directory log");
    }
    pc.close(log);
    pthread_mutex_unlock(&pc.lock);
    return rc;
}

static int do_flush(int (*fn)(int), int fd)
{
    unsigned long long upto;
    struct stat sb;
    int rc;

    setup();
    if (pc.file != NULL && fd >= 0) {
        pthread_mutex_lock(&pc.lock);
        int dir = slot_in(pc.dir_fds, fd) >= 0;
        pthread_mutex_unlock(&pc.lock);
        if (dir) {
            rc = dir_flush(fn, fd);
            pthread_mutex_lock(&pc.lock);
            if (rc == 0 && pc.image_fd >= 0 && !pc.dir_flushed) {
                pc.dir_flushed = 1; /* the file was open, so its entry existed */
                write_stats();
            }
            pthread_mutex_unlock(&pc.lock);
            return rc;
        }
    }
    if ((pc.dirlog_path != NULL || pc.dir_fsync_errno != 0) && fstat(fd, &sb) == 0 &&
        S_ISDIR(sb.st_mode)) {
        return dir_flush(fn, fd);
    }
    if (watched(fd) < 0) {
        return fn(fd);
    }
    pthread_mutex_lock(&pc.lock);
    upto = pc.seq;
    if (pc.kill_at_flush != 0 && armed() &&
        pc.flushes - pc.flushes_unarmed + 1 == pc.kill_at_flush) {
        pthread_mutex_unlock(&pc.lock);
        struct timespec pause = {0, 30 * 1000 * 1000};
        nanosleep(&pause, NULL);
        raise(SIGKILL);
    }
    pthread_mutex_unlock(&pc.lock);
    rc = fn(fd);
    if (rc == 0) {
        flushed(fd, upto);
    }
    return rc;
}

/* The interposed functions. */

/* open()'s third argument is there only when the flags ask for one (glibc's
 * __OPEN_NEEDS_MODE: O_TMPFILE holds O_DIRECTORY's bit, so it is compared
 * whole). */
#define OPEN_MODE(flags, mode)                                                              \
    do {                                                                                    \
        if (((flags) & O_CREAT) != 0 || ((flags) & O_TMPFILE) == O_TMPFILE) {               \
            va_list ap;                                                                     \
            va_start(ap, flags);                                                            \
            (mode) = (mode_t)va_arg(ap, int);                                               \
            va_end(ap);                                                                     \
        }                                                                                   \
    } while (0)

int open(const char *path, int flags, ...)
{
    mode_t mode = 0;
    int fd;
    setup();
    OPEN_MODE(flags, mode);
    fd = pc.open(path, flags, mode);
    after_open(path, flags, fd);
    return fd;
}

int open64(const char *path, int flags, ...)
{
    mode_t mode = 0;
    int fd;
    setup();
    OPEN_MODE(flags, mode);
    fd = pc.open64(path, flags, mode);
    after_open(path, flags, fd);
    return fd;
}

int openat(int dirfd, const char *path, int flags, ...)
{
    mode_t mode = 0;
    int fd;
    setup();
    OPEN_MODE(flags, mode);
    fd = pc.openat(dirfd, path, flags, mode);
    if (path[0] == '/' || dirfd == AT_FDCWD) {
        after_open(path, flags, fd);
    }
    return fd;
}

int close(int fd)
{
    setup();
    if (pc.file != NULL && fd >= 0) {
        pthread_mutex_lock(&pc.lock);
        int i = slot_of(fd);
        if (i >= 0) {
            pc.fds[i] = -1;
        }
        i = slot_in(pc.dir_fds, fd);
        if (i >= 0) {
            pc.dir_fds[i] = -1;
        }
        pthread_mutex_unlock(&pc.lock);
    }
    return pc.close(fd);
}

static ssize_t do_pwrite(ssize_t (*fn)(int, const void *, size_t, off_t), int fd,
                         const void *buf, size_t len, off_t off)
{
    ssize_t w;
    int i;
    setup();
    i = watched(fd);
    if (i < 0) {
        return fn(fd, buf, len, off);
    }
    pthread_mutex_lock(&pc.lock);
    if (pc.dsync[i] && pc.fail_dsync_at != 0 && ++pc.dsync_calls == pc.fail_dsync_at) {
        pthread_mutex_unlock(&pc.lock);
        errno = EIO;
        return -1;
    }
    w = fn(fd, buf, len, off);
    if (w > 0) {
        record(i, buf, (size_t)w, off);
    }
    pthread_mutex_unlock(&pc.lock);
    return w;
}

ssize_t pwrite(int fd, const void *buf, size_t len, off_t off)
{
    setup();
    return do_pwrite(pc.pwrite, fd, buf, len, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t len, off_t off)
{
    setup();
    return do_pwrite(pc.pwrite64, fd, buf, len, off);
}

ssize_t write(int fd, const void *buf, size_t len)
{
    ssize_t w;
    off_t off;
    int i;
    setup();
    i = watched(fd);
    if (i < 0) {
        return pc.write(fd, buf, len);
    }
    pthread_mutex_lock(&pc.lock);
    off = lseek(fd, 0, SEEK_CUR);
    w = pc.write(fd, buf, len);
    if (w > 0) {
        if (off < 0) {
            die("lseek");
        }
        record(i, buf, (size_t)w, off);
    }
    pthread_mutex_unlock(&pc.lock);
    return w;
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt)
{
    ssize_t w;
    off_t off;
    int i;
    setup();
    i = watched(fd);
    if (i < 0) {
        return pc.writev(fd, iov, iovcnt);
    }
    pthread_mutex_lock(&pc.lock);
    off = lseek(fd, 0, SEEK_CUR);
    w = pc.writev(fd, iov, iovcnt);
    if (w > 0) {
        size_t left = (size_t)w;
        if (off < 0) {
            die("lseek");
        }
        for (int k = 0; k < iovcnt && left > 0; k++) {
            size_t n = iov[k].iov_len < left ? iov[k].iov_len : left;
            record(i, iov[k].iov_base, n, off);
            off += (off_t)n;
            left -= n;
        }
    }
    pthread_mutex_unlock(&pc.lock);
    return w;
}

int fdatasync(int fd)
{
    setup();
    return do_flush(pc.fdatasync, fd);
}

int fsync(int fd)
{
    setup();
    return do_flush(pc.fsync, fd);
}
