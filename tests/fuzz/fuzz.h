/*
 * fuzz.h - what every fuzz target shares: the libFuzzer entry point (also
 * called by replay_main.c, so the corpus runs in every ctest) and FUZZ_CHECK,
 * an assertion that stays on in release builds and crashes the way libFuzzer
 * recognises (abort), naming the broken invariant.
 */
#ifndef IDEM_FUZZ_H
#define IDEM_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: invariant broken: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#endif
