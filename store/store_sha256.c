/*
 * store_sha256.c - SHA-256 with OpenSSL's low-level functions (see
 * store_sha256.h for why not EVP).
 */
/* SHA256_Init() and friends are deprecated since OpenSSL 3.0 in favour of
 * EVP, but still there in OpenSSL 3. They are used on purpose: see the
 * header. */
#define OPENSSL_SUPPRESS_DEPRECATED 1

#include "store_sha256.h"

#include <openssl/sha.h>

int store_sha256(const struct store_span *parts, size_t n, uint8_t out[STORE_SHA256_BYTES])
{
    SHA256_CTX ctx;

    /* They cannot fail with valid arguments; checked all the same, so that
     * a library that did fail would not leave out unwritten. */
    if (SHA256_Init(&ctx) != 1)
        return STORE_EIO;
    for (size_t i = 0; i < n; i++) {
        if (parts[i].len > 0 && SHA256_Update(&ctx, parts[i].ptr, parts[i].len) != 1)
            return STORE_EIO;
    }
    if (SHA256_Final(out, &ctx) != 1)
        return STORE_EIO;
    return STORE_OK;
}
