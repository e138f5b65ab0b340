/*
 * fuzz_wire.c - the strict framing of raw client bytes (proxy/wire_check.c)
 * on arbitrary streams.
 *
 * Input: the first byte seeds how the rest is cut into pieces; the rest is
 * the stream a client sends on one connection.
 *
 * Invariants:
 *   - the stream fed whole, fed in pieces and fed one byte at a time frames
 *     the same requests: the same head verdicts, the same framed requests
 *     with the same body lengths, in the same order (a verdict that depended
 *     on where recv() happened to cut the bytes would be a hole, or a valid
 *     request refused under load; one byte at a time, the checker never
 *     takes its one-pass runs through a line, so it is the reference for
 *     them);
 *   - no framed body is longer than the stream;
 *   - a request after a refused one is refused too.
 */
#include "fuzz.h"

#include <stdbool.h>

#include "wire_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct wire_check *whole, *cut, *bytes;
    uint32_t seed;
    size_t off = 0;
    bool refused = false;

    if (size < 1)
        return 0;
    seed = data[0] * 2654435761u + 1;
    data++;
    size--;
    whole = wire_check_new();
    cut = wire_check_new();
    bytes = wire_check_new();
    FUZZ_CHECK(whole != NULL && cut != NULL && bytes != NULL);
    wire_check_feed(whole, (const char *)data, size);
    for (size_t i = 0; i < size; i++)
        wire_check_feed(bytes, (const char *)data + i, 1);
    while (off < size) {
        size_t piece;
        seed = seed * 1103515245u + 12345u;
        piece = 1 + (seed >> 16) % 17;
        if (piece > size - off)
            piece = size - off;
        wire_check_feed(cut, (const char *)data + off, piece);
        off += piece;
    }
    for (int i = 0; i < 64; i++) {
        uint64_t b1 = 0, b2 = 0, b3 = 0;
        bool h1 = wire_check_head(whole), h2 = wire_check_head(cut), h3 = wire_check_head(bytes);
        bool f1 = wire_check_framed(whole, &b1), f2 = wire_check_framed(cut, &b2);
        bool f3 = wire_check_framed(bytes, &b3);
        FUZZ_CHECK(h1 == h2 && h1 == h3);
        FUZZ_CHECK(f1 == f2 && f1 == f3);
        FUZZ_CHECK(!f1 || (b1 == b2 && b1 == b3));
        FUZZ_CHECK(!f1 || b1 <= size);
        FUZZ_CHECK(!f1 || h1);
        FUZZ_CHECK(!refused || (!h1 && !f1));
        if (!h1)
            refused = true;
        if (!f1)
            break;
        wire_check_done(whole);
        wire_check_done(cut);
        wire_check_done(bytes);
    }
    wire_check_free(whole);
    wire_check_free(cut);
    wire_check_free(bytes);
    return 0;
}
