/*
 * slowdisk.c - an LD_PRELOAD library that makes the store's disk slow, or
 * stall, as a cloud volume does (an EBS or PD hiccup): every flush of a
 * matching file takes longer before it happens.
 *
 * A flush is fdatasync(), fsync() or msync() (MS_SYNC), and a write through
 * a descriptor opened with O_DSYNC or O_SYNC (LMDB writes its meta page that
 * way with durability "sync": its pwrite blocks until the device has it).
 * The delay is taken before the real call, on the calling thread only, as a
 * device queue would.
 *
 * Environment:
 *   SLOWDISK_MATCH       optional substring of the file's path (default
 *                        "data.mdb"); "" matches every file
 *   SLOWDISK_MS          optional: every flush sleeps this many ms
 *   SLOWDISK_STALL_FILE  optional path: while this file exists, every flush
 *                        blocks (polled every 2 ms) until it is removed: a
 *                        stall a test starts and ends when it wants
 *   SLOWDISK_STATS       optional path: rewritten after every delayed flush
 *                        with "flushes=N stalled=N max_ms=N waiting=N", and
 *                        when a flush starts to wait for the stall file
 *                        (waiting: the flushes blocked by the stall now, so
 *                        a test can tell the store writer is in the disk)
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static struct {
    pthread_once_t once;
    pthread_mutex_t lock;
    const char *match;
    long ms;
    const char *stall_file;
    const char *stats;
    unsigned long long flushes;
    unsigned long long stalled;
    unsigned long long waiting;
    long long max_ms;
    int (*fdatasync)(int);
    int (*fsync)(int);
    int (*msync)(void *, size_t, int);
    ssize_t (*pwrite)(int, const void *, size_t, off_t);
    ssize_t (*pwrite64)(int, const void *, size_t, off_t);
    ssize_t (*write)(int, const void *, size_t);
    ssize_t (*writev)(int, const struct iovec *, int);
    ssize_t (*pwritev)(int, const struct iovec *, int, off_t);
} sd = {.once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER};

static void real(void *slot, size_t size, const char *name)
{
    void *f = dlsym(RTLD_NEXT, name);
    if (f == NULL || size != sizeof f) {
        abort();
    }
    memcpy(slot, &f, sizeof f);
}

#define REAL(field, name) real(&sd.field, sizeof sd.field, name)

static void init(void)
{
    const char *ms = getenv("SLOWDISK_MS");
    REAL(fdatasync, "fdatasync");
    REAL(fsync, "fsync");
    REAL(msync, "msync");
    REAL(pwrite, "pwrite");
    REAL(pwrite64, "pwrite64");
    REAL(write, "write");
    REAL(writev, "writev");
    REAL(pwritev, "pwritev");
    sd.match = getenv("SLOWDISK_MATCH");
    if (sd.match == NULL) {
        sd.match = "data.mdb";
    }
    sd.ms = ms != NULL ? strtol(ms, NULL, 10) : 0;
    sd.stall_file = getenv("SLOWDISK_STALL_FILE");
    sd.stats = getenv("SLOWDISK_STATS");
}

static void setup(void)
{
    pthread_once(&sd.once, init);
}

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static int matches_fd(int fd)
{
    char link[64];
    char path[PATH_MAX];
    ssize_t n;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, path, sizeof path - 1);
    if (n < 0) {
        return 0;
    }
    path[n] = '\0';
    return strstr(path, sd.match) != NULL;
}

static int dsync_fd(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & (O_DSYNC | O_SYNC)) != 0;
}

static void write_stats(void)
{
    char buf[128];
    int n;
    int fd;
    if (sd.stats == NULL) {
        return;
    }
    n = snprintf(buf, sizeof buf, "flushes=%llu stalled=%llu max_ms=%lld waiting=%llu\n",
                 sd.flushes, sd.stalled, sd.max_ms, sd.waiting);
    fd = open(sd.stats, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
        (void)!sd.write(fd, buf, (size_t)n);
        close(fd);
    }
}

/* The delay of one flush: SLOWDISK_MS, then as long as the stall file is
 * there. */
static void delay(void)
{
    int errno_saved = errno;
    long long start = mono_ms();
    int stalled = 0;
    long long took;
    if (sd.ms > 0) {
        sleep_ms(sd.ms);
    }
    while (sd.stall_file != NULL && access(sd.stall_file, F_OK) == 0) {
        if (!stalled) {
            pthread_mutex_lock(&sd.lock);
            sd.waiting++;
            write_stats();
            pthread_mutex_unlock(&sd.lock);
        }
        stalled = 1;
        sleep_ms(2);
    }
    took = mono_ms() - start;
    pthread_mutex_lock(&sd.lock);
    sd.flushes++;
    sd.stalled += (unsigned long long)stalled;
    sd.waiting -= (unsigned long long)stalled;
    if (took > sd.max_ms) {
        sd.max_ms = took;
    }
    write_stats();
    pthread_mutex_unlock(&sd.lock);
    errno = errno_saved;
}

static void flush_delay(int fd)
{
    if (matches_fd(fd)) {
        delay();
    }
}

static void write_delay(int fd)
{
    if (dsync_fd(fd) && matches_fd(fd)) {
        delay();
    }
}

int fdatasync(int fd)
{
    setup();
    flush_delay(fd);
    return sd.fdatasync(fd);
}

int fsync(int fd)
{
    setup();
    flush_delay(fd);
    return sd.fsync(fd);
}

int msync(void *addr, size_t len, int flags)
{
    setup();
    if ((flags & MS_SYNC) != 0) {
        delay(); /* no descriptor to match: LMDB's only msync is of its map */
    }
    return sd.msync(addr, len, flags);
}

ssize_t pwrite(int fd, const void *buf, size_t len, off_t off)
{
    setup();
    write_delay(fd);
    return sd.pwrite(fd, buf, len, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t len, off_t off)
{
    setup();
    write_delay(fd);
    return sd.pwrite64(fd, buf, len, off);
}

ssize_t write(int fd, const void *buf, size_t len)
{
    setup();
    write_delay(fd);
    return sd.write(fd, buf, len);
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt)
{
    setup();
    write_delay(fd);
    return sd.writev(fd, iov, iovcnt);
}

ssize_t pwritev(int fd, const struct iovec *iov, int iovcnt, off_t off)
{
    setup();
    write_delay(fd);
    return sd.pwritev(fd, iov, iovcnt, off);
}
