/*
 * fuzz_wire.c - the strict framing of raw client bytes (proxy/wire_check.c)
 * on arbitrary streams.
 *
 * Input: the first byte seeds how the rest is cut into pieces; the rest is
 * the stream a client sends on one connection.
 *
 * Invariants:
 *   - the stream fed whole and fed in pieces frames the same requests: the
 *     same head verdicts, the same framed requests with the same body
 *     lengths, in the same order (a verdict that depended on where recv()
 *     happened to cut the bytes would be a hole, or a valid request refused
 *     under load);
 *   - no framed body is longer than the stream;
 *   - a request after a refused one is refused too.
 */
#include "fuzz.h"

#include <stdbool.h>

#include "wire_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct wire_check *whole, *cut;
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
    FUZZ_CHECK(whole != NULL && cut != NULL);
    wire_check_feed(whole, (const char *)data, size);
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
        uint64_t b1 = 0, b2 = 0;
        bool h1 = wire_check_head(whole), h2 = wire_check_head(cut);
        bool f1 = wire_check_framed(whole, &b1), f2 = wire_check_framed(cut, &b2);
        FUZZ_CHECK(h1 == h2);
        FUZZ_CHECK(f1 == f2);
        FUZZ_CHECK(!f1 || b1 == b2);
        FUZZ_CHECK(!f1 || b1 <= size);
        FUZZ_CHECK(!f1 || h1);
        FUZZ_CHECK(!refused || (!h1 && !f1));
        if (!h1)
            refused = true;
        if (!f1)
            break;
        wire_check_done(whole);
        wire_check_done(cut);
    }
    wire_check_free(whole);
    wire_check_free(cut);
    return 0;
}
