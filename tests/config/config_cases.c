/*
 * config_cases - configuration test cases as data (STYLE.md, "Tests").
 *
 *   config_cases DIR        runs every case under DIR/valid and DIR/invalid
 *   config_cases --show F   prints what loading F gives (dump or error),
 *                           to write a new case's expected file; read it
 *                           before committing it
 *
 * DIR/valid/<case>/config.json must load and pass config_validate(); its
 * dump must equal expected.json, and the dump must load back to the same
 * dump (the round trip check-config users rely on).
 * DIR/invalid/<case>/config.json must fail to load, or load and fail
 * config_validate(); the one-line error must equal the file "error".
 *
 * Each case is loaded from inside its directory as "config.json", so
 * syntax errors read "config.json:LINE:COLUMN: ..." wherever the tree is.
 * Prints one PASS/FAIL line per case and "N passed, M failed"; exits 1 on
 * any failure, and when no case was found (a run that checks nothing must
 * not pass).
 */
#include "config.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ERR_LEN 512

/* The whole file, NUL-terminated, with trailing white space removed;
 * NULL if it cannot be read. */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    char *buf = NULL;
    size_t len = 0;
    size_t cap = 0;
    size_t n;

    if (f == NULL)
        goto out;
    for (;;) {
        if (cap - len < 4096) {
            char *grown = realloc(buf, cap + 65536);
            if (grown == NULL) {
                free(buf);
                buf = NULL;
                goto out;
            }
            buf = grown;
            cap += 65536;
        }
        n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0)
            break;
    }
    if (ferror(f)) {
        free(buf);
        buf = NULL;
        goto out;
    }
    while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == ' ' || buf[len - 1] == '\r'))
        len--;
    buf[len] = '\0';
out:
    if (f != NULL)
        fclose(f);
    return buf;
}

static int is_case_dir(const struct dirent *d)
{
    return d->d_name[0] != '.';
}

static void report(bool pass, const char *kind, const char *name, const char *fmt, const char *a,
                   const char *b)
{
    printf("%s %s/%s", pass ? "PASS" : "FAIL", kind, name);
    if (!pass) {
        printf(": ");
        printf(fmt, a, b);
    }
    printf("\n");
}

static bool run_valid(const char *name)
{
    struct config *cfg = NULL;
    struct config *again = NULL;
    char err[ERR_LEN] = "";
    char *expected = slurp("expected.json");
    char *dump = NULL;
    char *dump2 = NULL;
    bool pass = false;

    if (expected == NULL) {
        report(false, "valid", name, "%s%s", "no expected.json", "");
        goto out;
    }
    if (config_load_file("config.json", &cfg, err, sizeof err) != CONFIG_OK ||
        config_validate(cfg, err, sizeof err) != CONFIG_OK) {
        report(false, "valid", name, "rejected: %s%s", err, "");
        goto out;
    }
    dump = config_dump(cfg);
    if (dump == NULL || strcmp(dump, expected) != 0) {
        report(false, "valid", name, "dump differs from expected.json:\n%s\n%s",
               dump != NULL ? dump : "(NULL)", "");
        goto out;
    }
    if (config_load_string(dump, strlen(dump), &again, err, sizeof err) != CONFIG_OK ||
        config_validate(again, err, sizeof err) != CONFIG_OK) {
        report(false, "valid", name, "dump does not load back: %s%s", err, "");
        goto out;
    }
    dump2 = config_dump(again);
    if (dump2 == NULL || strcmp(dump, dump2) != 0) {
        report(false, "valid", name, "dump of the reloaded dump differs:\n%s%s",
               dump2 != NULL ? dump2 : "(NULL)", "");
        goto out;
    }
    pass = true;
    report(true, "valid", name, "%s%s", "", "");
out:
    free(dump2);
    free(dump);
    free(expected);
    config_free(again);
    config_free(cfg);
    return pass;
}

static bool run_invalid(const char *name)
{
    struct config *cfg = NULL;
    char err[ERR_LEN] = "";
    char *expected = slurp("error");
    bool pass = false;
    int rc;

    if (expected == NULL) {
        report(false, "invalid", name, "%s%s", "no error file", "");
        goto out;
    }
    rc = config_load_file("config.json", &cfg, err, sizeof err);
    if (rc == CONFIG_OK)
        rc = config_validate(cfg, err, sizeof err);
    if (rc == CONFIG_OK) {
        report(false, "invalid", name, "%s%s", "accepted", "");
    } else if (strchr(err, '\n') != NULL || strcmp(err, expected) != 0) {
        report(false, "invalid", name, "expected \"%s\", got \"%s\"", expected, err);
    } else {
        pass = true;
        report(true, "invalid", name, "%s%s", "", "");
    }
out:
    free(expected);
    config_free(cfg);
    return pass;
}

/* Runs every case of root/kind; returns false if the directory is
 * missing. */
static bool run_kind(const char *root, const char *kind, int *passed, int *failed)
{
    struct dirent **names = NULL;
    char path[4096];
    int home = -1;
    int n;
    int i;
    bool ok = false;

    snprintf(path, sizeof path, "%s/%s", root, kind);
    n = scandir(path, &names, is_case_dir, alphasort);
    if (n < 0) {
        printf("FAIL %s: cannot read %s\n", kind, path);
        goto out;
    }
    home = open(".", O_RDONLY | O_DIRECTORY);
    if (home < 0) {
        printf("FAIL %s: cannot open the working directory\n", kind);
        goto out;
    }
    for (i = 0; i < n; i++) {
        bool pass = false;
        snprintf(path, sizeof path, "%s/%s/%s", root, kind, names[i]->d_name);
        if (chdir(path) != 0) {
            printf("FAIL %s/%s: cannot enter %s\n", kind, names[i]->d_name, path);
        } else {
            pass = strcmp(kind, "valid") == 0 ? run_valid(names[i]->d_name)
                                              : run_invalid(names[i]->d_name);
        }
        if (fchdir(home) != 0) {
            printf("FAIL cannot return to the working directory\n");
            pass = false;
        }
        *(pass ? passed : failed) += 1;
    }
    ok = true;
out:
    for (i = 0; i < n; i++)
        free(names[i]);
    free(names);
    if (home >= 0)
        close(home);
    return ok;
}

static int show(const char *path)
{
    struct config *cfg = NULL;
    char err[ERR_LEN] = "";
    char *dump = NULL;
    int rc;

    rc = config_load_file(path, &cfg, err, sizeof err);
    if (rc == CONFIG_OK)
        rc = config_validate(cfg, err, sizeof err);
    if (rc == CONFIG_OK) {
        dump = config_dump(cfg);
        printf("%s\n", dump != NULL ? dump : "(dump failed)");
    } else {
        printf("%s\n", err);
    }
    free(dump);
    config_free(cfg);
    return rc == CONFIG_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    int passed = 0;
    int failed = 0;
    int status;

    if (argc == 3 && strcmp(argv[1], "--show") == 0) {
        status = show(argv[2]);
    } else if (argc == 2) {
        if (!run_kind(argv[1], "valid", &passed, &failed))
            failed++;
        if (!run_kind(argv[1], "invalid", &passed, &failed))
            failed++;
        printf("%d passed, %d failed\n", passed, failed);
        status = failed == 0 && passed > 0 ? 0 : 1;
    } else {
        fprintf(stderr, "usage: config_cases DIR | config_cases --show FILE\n");
        status = 2;
    }
    return status;
}
