/*
 * store_sha256.h - SHA-256 for the hot path: the record key
 * (store_key_derive), the request fingerprints and the scope-header hash
 * (proxy/policy.c) all hash a few short spans per request.
 *
 * OpenSSL's low-level SHA256_Init/Update/Final, not EVP. Under OpenSSL 3
 * every EVP digest goes through a provider: the first fetch loads the
 * default provider (about 2 MiB more of libcrypto resident in every
 * process, measured on Debian 12's 3.0), and each EVP_DigestInit_ex2()
 * sets up the provider's context again (134 ns for a 96-byte digest here,
 * against 107-113 ns). The low-level functions are deprecated since 3.0,
 * still there in OpenSSL 3 (Debian 12 ships 3.0), and are what OpenSSL's
 * own provider runs underneath (the same assembly, SHA-NI where the CPU
 * has it). No state outlives a call.
 *
 * Thread-safe.
 */
#ifndef IDEM_STORE_SHA256_H
#define IDEM_STORE_SHA256_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"

#define STORE_SHA256_BYTES 32

/*
 * Writes SHA-256 over the concatenation of parts[0..n) to out. A part with
 * len 0 may have a NULL ptr. Returns 0, or STORE_EIO if OpenSSL fails (it
 * does not with valid arguments); out is then unspecified.
 */
int store_sha256(const struct store_span *parts, size_t n, uint8_t out[STORE_SHA256_BYTES]);

#endif
