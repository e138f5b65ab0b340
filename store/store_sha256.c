/*
 * store_sha256.c - SHA-256 with one fetch per process and one context per
 * thread (see store_sha256.h).
 */
#include "store_sha256.h"

#include <openssl/evp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

/* Fetched once and kept for the life of the process (a global, so
 * LeakSanitizer sees it as reachable). A failed fetch (out of memory) is
 * tried again on the next digest rather than remembered, so one failure at
 * start-up does not leave the process unable to hash for good. */
static pthread_mutex_t sha256_lock = PTHREAD_MUTEX_INITIALIZER;
static EVP_MD *_Atomic sha256_md;
static pthread_key_t sha256_ctx_key;
static bool sha256_key_ok; /* under sha256_lock until sha256_md is set */
#ifdef IDEM_FAULT_INJECTION
static int sha256_fail_fetches; /* under sha256_lock */

void store_sha256_fault_refetch(int failures)
{
    pthread_mutex_lock(&sha256_lock);
    /* Contexts hold their own reference to the digest they last used. */
    EVP_MD_free(atomic_exchange(&sha256_md, NULL));
    sha256_fail_fetches = failures;
    pthread_mutex_unlock(&sha256_lock);
}
#endif

static void ctx_destroy(void *ctx)
{
    EVP_MD_CTX_free(ctx);
}

/* The fetched digest, fetching it first if need be; NULL on failure. */
static EVP_MD *sha256_get(void)
{
    EVP_MD *md = atomic_load(&sha256_md);

    if (md != NULL) {
        return md;
    }
    pthread_mutex_lock(&sha256_lock);
    md = atomic_load(&sha256_md);
    if (md == NULL) {
        if (!sha256_key_ok) {
            sha256_key_ok = pthread_key_create(&sha256_ctx_key, ctx_destroy) == 0;
        }
        if (sha256_key_ok) {
#ifdef IDEM_FAULT_INJECTION
            if (sha256_fail_fetches > 0) {
                sha256_fail_fetches--;
            } else {
                md = EVP_MD_fetch(NULL, "SHA256", NULL);
            }
#else
            md = EVP_MD_fetch(NULL, "SHA256", NULL);
#endif
            /* Published last: a reader that sees it also sees the key. */
            atomic_store(&sha256_md, md);
        }
    }
    pthread_mutex_unlock(&sha256_lock);
    return md;
}

/* This thread's context, created on its first digest. */
static int thread_ctx(EVP_MD_CTX **out)
{
    int rc = STORE_EIO;
    EVP_MD_CTX *ctx = NULL;

    *out = NULL;
    if (sha256_get() == NULL) {
        goto out;
    }
    ctx = pthread_getspecific(sha256_ctx_key);
    if (ctx == NULL) {
        rc = STORE_ENOMEM;
        ctx = EVP_MD_CTX_new();
        if (ctx == NULL) {
            goto out;
        }
        if (pthread_setspecific(sha256_ctx_key, ctx) != 0) {
            EVP_MD_CTX_free(ctx);
            ctx = NULL;
            goto out;
        }
    }
    *out = ctx;
    rc = STORE_OK;
out:
    return rc;
}

int store_sha256(const struct store_span *parts, size_t n, uint8_t out[STORE_SHA256_BYTES])
{
    EVP_MD_CTX *ctx = NULL;
    unsigned int md_len = 0;
    int rc = thread_ctx(&ctx);

    if (rc != STORE_OK) {
        goto out;
    }
    rc = STORE_EIO;
    /* Init_ex2 on a used context resets it: whatever an earlier digest left
     * (even a failed one) does not carry over. */
    if (EVP_DigestInit_ex2(ctx, atomic_load(&sha256_md), NULL) != 1) {
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if (parts[i].len > 0 && EVP_DigestUpdate(ctx, parts[i].ptr, parts[i].len) != 1) {
            goto out;
        }
    }
    if (EVP_DigestFinal_ex(ctx, out, &md_len) != 1 || md_len != STORE_SHA256_BYTES) {
        goto out;
    }
    rc = STORE_OK;
out:
    return rc;
}
