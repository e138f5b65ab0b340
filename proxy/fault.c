/*
 * fault.c - allocation fault injection and the fault report (see fault.h).
 * Compiled only with IDEM_FAULT_INJECTION.
 *
 * The __wrap_ functions are what our objects call instead of malloc & co
 * (ld --wrap); __real_malloc is the C library's (or AddressSanitizer's)
 * malloc. Nothing here allocates through them.
 */
#define _GNU_SOURCE /* dladdr */
#include "fault.h"

#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "store_fault.h"

#if defined(__SANITIZE_ADDRESS__)
#define FAULT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FAULT_ASAN 1
#endif
#endif
#ifdef FAULT_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#define STACK_FRAMES 24

void *__real_malloc(size_t size);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t size);
char *__real_strdup(const char *s);
void *__wrap_malloc(size_t size);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t size);
char *__wrap_strdup(const char *s);

static atomic_bool armed;
static uint64_t alloc_nth;
static const char *count_file;
static atomic_uint_fast64_t alloc_calls;

/* The one failed allocation (one-shot, so written once). */
static const char *_Atomic alloc_failed_fn;
static void *alloc_stack[STACK_FRAMES];
static atomic_int alloc_stack_len;
static const void *exe_base; /* where the executable is loaded */

static void report_alloc_failure(const char *fn, uint64_t k)
{
    char line[128];
    int n = snprintf(line, sizeof(line), "idemproxy: fault: failing %s, allocation %" PRIu64 "\n",
                     fn, k);
    int frames = backtrace(alloc_stack, STACK_FRAMES);

    atomic_store(&alloc_failed_fn, fn);
    atomic_store(&alloc_stack_len, frames);
    if (n > 0 && write(STDERR_FILENO, line, (size_t)n) < 0) {
        n = 0; /* stderr gone: the count file still says it */
    }
#ifdef FAULT_ASAN
    __sanitizer_print_stack_trace();
#else
    backtrace_symbols_fd(alloc_stack, frames, STDERR_FILENO);
#endif
}

static bool alloc_fails(const char *fn)
{
    uint64_t k;
    bool fail = false;

    if (atomic_load_explicit(&armed, memory_order_acquire)) {
        k = atomic_fetch_add(&alloc_calls, 1) + 1;
        if (alloc_nth != 0 && k == alloc_nth) {
            report_alloc_failure(fn, k);
            fail = true;
        }
    }
    return fail;
}

void *__wrap_malloc(size_t size)
{
    if (alloc_fails("malloc")) {
        errno = ENOMEM;
        return NULL;
    }
    return __real_malloc(size);
}

void *__wrap_calloc(size_t n, size_t size)
{
    if (alloc_fails("calloc")) {
        errno = ENOMEM;
        return NULL;
    }
    return __real_calloc(n, size);
}

/* A failed realloc leaves the block alone, as the real one does. */
void *__wrap_realloc(void *p, size_t size)
{
    if (alloc_fails("realloc")) {
        errno = ENOMEM;
        return NULL;
    }
    return __real_realloc(p, size);
}

char *__wrap_strdup(const char *s)
{
    if (alloc_fails("strdup")) {
        errno = ENOMEM;
        return NULL;
    }
    return __real_strdup(s);
}

/* Writes s as a JSON string (the strings here are our own identifiers and
 * C expressions: only quotes and backslashes need escaping). */
static void put_json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s != NULL && *s != '\0'; s++) {
        if (*s == '"' || *s == '\\') {
            fputc('\\', f);
        }
        fputc(*s, f);
    }
    fputc('"', f);
}

static void write_report(void)
{
    const char *func = NULL;
    const char *call = NULL;
    FILE *f;
    int frames = atomic_load(&alloc_stack_len);
    const char *fn = atomic_load(&alloc_failed_fn);

    store_fault_lmdb_failed(&func, &call);
    if (func != NULL) {
        fprintf(stderr, "idemproxy: fault: failed LMDB call %s in %s\n", call, func);
    }
    if (count_file == NULL || (f = fopen(count_file, "w")) == NULL) {
        return;
    }
    fprintf(f, "{\"alloc_calls\":%" PRIu64 ",\"lmdb_calls\":%" PRIu64
               ",\"lmdb_write_calls\":%" PRIu64 ",\"lmdb_failed\":",
            (uint64_t)atomic_load(&alloc_calls), store_fault_lmdb_calls(),
            store_fault_lmdb_write_calls());
    if (func != NULL) {
        fputc('[', f);
        put_json_string(f, func);
        fputc(',', f);
        put_json_string(f, call);
        fputc(']', f);
    } else {
        fputs("null", f);
    }
    fputs(",\"alloc_failed\":", f);
    if (fn != NULL) {
        put_json_string(f, fn);
    } else {
        fputs("null", f);
    }
    /* Frames in the executable as offsets from its load address, which is
     * what addr2line -e idemproxy takes for a PIE; others are skipped. */
    fputs(",\"alloc_stack\":[", f);
    for (int i = 0, n = 0; i < frames; i++) {
        Dl_info info;
        if (dladdr(alloc_stack[i], &info) == 0 || info.dli_fbase != exe_base) {
            continue;
        }
        /* A return address is one past the call: step back into it. */
        fprintf(f, "%s\"0x%" PRIxPTR "\"", n++ > 0 ? "," : "",
                (uintptr_t)alloc_stack[i] - (uintptr_t)info.dli_fbase - 1);
    }
    fputs("]}\n", f);
    fclose(f);
}

static atomic_int deliver_pause_ms;

void idem_fault_deliver_pause(int evfd)
{
    int ms = atomic_load_explicit(&deliver_pause_ms, memory_order_relaxed);
    uint64_t one = 1;

    if (ms <= 0)
        return;
    if (write(evfd, &one, sizeof(one)) < 0) {
        /* a full counter already means "wake" */
    }
    usleep((useconds_t)ms * 1000);
}

void idem_fault_arm(void)
{
    const char *a = getenv("IDEM_FAULT_ALLOC_NTH");
    const char *pause = getenv("IDEM_FAULT_DELIVER_PAUSE_MS");
    void *warm[1];
    Dl_info self;

    if (pause != NULL)
        atomic_store(&deliver_pause_ms, atoi(pause));
    count_file = getenv("IDEM_FAULT_COUNT_FILE");
    if (a == NULL && getenv("IDEM_FAULT_LMDB_NTH") == NULL && count_file == NULL) {
        return;
    }
    /* backtrace() loads its unwinder on first use: do it now, not inside
     * the failing allocation. */
    backtrace(warm, 1);
    if (dladdr((const void *)(uintptr_t)idem_fault_arm, &self) != 0) {
        exe_base = self.dli_fbase;
    }
    alloc_nth = a != NULL ? strtoull(a, NULL, 10) : 0;
    atexit(write_report);
    store_fault_arm();
    atomic_store_explicit(&armed, true, memory_order_release);
}
