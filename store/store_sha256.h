/*
 * store_sha256.h - SHA-256 for the hot path: the record key
 * (store_key_derive), the request fingerprints and the scope-header hash
 * (proxy/policy.c) all hash a few short spans per request.
 *
 * OpenSSL 3 resolves EVP_sha256() to a provider implementation on every
 * EVP_DigestInit_ex() (an implicit fetch, under a lock), and a fresh
 * EVP_MD_CTX per call is an allocation more. Here the SHA256 EVP_MD is
 * fetched once per process, and each thread keeps one EVP_MD_CTX that it
 * re-initialises for every digest; the context is freed when the thread
 * exits (a pthread key destructor).
 *
 * Thread-safe: every thread uses its own context.
 */
#ifndef IDEM_STORE_SHA256_H
#define IDEM_STORE_SHA256_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"

#define STORE_SHA256_BYTES 32

/*
 * Writes SHA-256 over the concatenation of parts[0..n) to out. A part with
 * len 0 may have a NULL ptr. Returns 0, STORE_ENOMEM when this thread's
 * context cannot be allocated, or STORE_EIO when OpenSSL fails otherwise
 * (no SHA256 implementation available); out is then unspecified.
 */
int store_sha256(const struct store_span *parts, size_t n, uint8_t out[STORE_SHA256_BYTES]);

#ifdef IDEM_FAULT_INJECTION
/* Tests only, with no other thread hashing: forget the fetched digest and
 * make the next `failures` fetches fail as an out-of-memory one would. */
void store_sha256_fault_refetch(int failures);
#endif

#endif
