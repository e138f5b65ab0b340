/*
 * replay_main.c - runs a fuzz target's LLVMFuzzerTestOneInput over files,
 * without libFuzzer, so the committed corpus (and any reproducer added to
 * it) is replayed by ctest with any compiler, and under ASan+UBSan in the
 * sanitizer build.
 *
 *   fuzz_replay_<target> PATH...
 *
 * A PATH that is a directory contributes every regular file in it, in name
 * order so runs are reproducible. Each input is copied into a buffer of
 * exactly its size, so an over-read is an ASan error as it is under
 * libFuzzer. A crash or a broken FUZZ_CHECK aborts, failing the test; an
 * unreadable path or an empty corpus fails it too.
 */
#include "fuzz.h"

#include <dirent.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

static int replay_file(const char *path)
{
    int rc = -1;
    FILE *f = NULL;
    uint8_t *buf = NULL;
    struct stat st;
    size_t len;

    f = fopen(path, "rb");
    if (f == NULL || fstat(fileno(f), &st) != 0) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        goto out;
    }
    len = (size_t)st.st_size;
    /* malloc(0) may return NULL; libFuzzer never passes NULL. */
    buf = malloc(len > 0 ? len : 1);
    if (buf == NULL) {
        fprintf(stderr, "%s: out of memory\n", path);
        goto out;
    }
    if (len > 0 && fread(buf, 1, len, f) != len) {
        fprintf(stderr, "%s: short read\n", path);
        goto out;
    }
    LLVMFuzzerTestOneInput(buf, len);
    rc = 0;
out:
    free(buf);
    if (f != NULL)
        fclose(f);
    return rc;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Replays every regular file of dir; *count grows by their number. */
static int replay_dir(const char *dir, size_t *count)
{
    int rc = -1;
    DIR *d = NULL;
    struct dirent *e;
    char **names = NULL;
    size_t n = 0;
    size_t cap = 0;

    d = opendir(dir);
    if (d == NULL) {
        fprintf(stderr, "%s: %s\n", dir, strerror(errno));
        goto out;
    }
    while ((e = readdir(d)) != NULL) {
        char *path;
        struct stat st;
        size_t plen = strlen(dir) + 1 + strlen(e->d_name) + 1;

        if (e->d_name[0] == '.')
            continue;
        path = malloc(plen);
        if (path == NULL)
            goto out;
        snprintf(path, plen, "%s/%s", dir, e->d_name);
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
            free(path);
            continue;
        }
        if (n == cap) {
            size_t ncap = cap ? 2 * cap : 64;
            char **nn = realloc(names, ncap * sizeof(*nn));
            if (nn == NULL) {
                free(path);
                goto out;
            }
            names = nn;
            cap = ncap;
        }
        names[n++] = path;
    }
    if (n > 0)
        qsort(names, n, sizeof(*names), by_name);
    for (size_t i = 0; i < n; i++) {
        if (replay_file(names[i]) != 0)
            goto out;
        (*count)++;
    }
    rc = 0;
out:
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    if (d != NULL)
        closedir(d);
    return rc;
}

int main(int argc, char **argv)
{
    size_t count = 0;

    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE-OR-DIRECTORY...\n", argv[0]);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "%s: %s\n", argv[i], strerror(errno));
            return 1;
        }
        if (S_ISDIR(st.st_mode) ? replay_dir(argv[i], &count) != 0 : replay_file(argv[i]) != 0)
            return 1;
        if (!S_ISDIR(st.st_mode))
            count++;
    }
    if (count == 0) {
        fprintf(stderr, "no inputs: an empty corpus replays nothing\n");
        return 1;
    }
    printf("replayed %zu inputs\n", count);
    return 0;
}
