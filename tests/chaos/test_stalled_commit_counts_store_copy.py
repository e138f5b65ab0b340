#!/usr/bin/env python3
"""server.max_buffered counts the store's copy of a forwarded answer until
its commit ends, and gives it back then.

LMDB (without MDB_WRITEMAP) writes a record into dirty pages it allocates
and holds until the group commit ends: while an answer's COMPLETE is in the
disk the process holds the answer twice (the request's buffer, which
libmicrohttpd sends once the record is durable, and the store's copy).
Until 2026-12-06 only the request's buffer was counted, so with the disk
stalled on a commit of large answers the process held up to twice what the
bound said, and went on admitting replays on top.

The proxy runs under libslowdisk.so (slowdisk.c, as test_slow_disk.py):
while the stall file exists every flush of data.mdb blocks, so the writer
is stuck in the commit of the COMPLETE of an 8 MiB answer whose client
reads nothing yet. Budget 12 MiB:
  - during the stall the answer is held twice (16 MiB): a replay of a
    stored 2 MiB answer gets 503 out-of-memory (before: 201, 8 + 2 fit);
  - once the commit has ended (the answer's first bytes reach its client)
    only the request's buffer is held, the answer still unread (8 MiB): the
    same replay gets 201.
The replay is sent once slowdisk says a flush is blocked by the stall
(its stats' waiting=N): with heartbeats 15 s apart the complete's is the
only commit then, so it is submitted (counted) and cannot be handed back
before the stall ends (the answer's first bytes not having arrived is
checked as well).
Sizes: the upstream client counts the buffer it read an answer into
(the native one exactly its Content-Length, libcurl's doubling from
4 KiB), so the answer is a power of two (its buffer is exactly its size
with either). A replay of a stored 6 MiB answer is the probe that
the 8 MiB answer has arrived and is held (8 + 6 > 12; 6 alone fits): it is
refused in both phases, by the old code too.
"""

import socket
import time
import unittest

import chaoslib
from chaoslib import harness
from test_slow_disk import SlowDiskProxies

TEST = "stalled_commit_counts_store_copy"
MIB = 1 << 20
BUDGET = "12MiB"
HELD, FITS, PROBE = 8 * MIB, 2 * MIB, 6 * MIB


def answer(size):
    return [("X-Test-Fault", "huge"), ("X-Test-Size", str(size))]


class StalledCommitCountsStoreCopy(SlowDiskProxies, harness.ProxyTestCase):
    def replay(self, proxy, key, size):
        """A replay of key's stored answer of size bytes: True when it was
        sent (byte for byte), False when refused with 503 out-of-memory."""
        r = self.post(proxy, key, headers=answer(size), timeout=20)
        if r.status == 503:
            doc = self.assertProblem(r, 503)
            self.assertTrue(doc["type"].endswith(":out-of-memory"), doc)
            self.assertIn("max_buffered", doc["detail"])
            self.assertRetryAfter(r, minimum=1)
            return False
        self.assertEqual(r.status, 201, r)
        self.assertTrue(r.replayed, r)
        self.assertEqual(r.body, harness.huge_body(size))
        return True

    def test_store_copy_counted_until_commit_ends(self):
        # Heartbeats far apart: the only commit of the stall is the
        # complete's.
        proxy = self.start_slow_proxy(routes=[self.route(lease="30s", heartbeat="15s",
                                                         wait="10s")],
                                      server={"max_buffered": BUDGET})
        for key, size in (("fits", FITS), ("probe", PROBE)):
            first = self.post(proxy, key, headers=answer(size), timeout=20)
            self.assertExecuted(first)
            self.assertEqual(first.body, harness.huge_body(size))

        # The answer comes 0.5 s after the upstream sees the request (its
        # acquire committed): the disk stalls in between, so its COMPLETE
        # is the commit that waits for the disk.
        c = harness.slow_post(proxy, "held", answer(HELD) + [("X-Test-Delay-Ms", "500")],
                              timeout=20)
        try:
            self.assertTrue(harness.wait_for(lambda: self.upstream.count("held") == 1, 10))
            in_disk_s = self.during_stall(proxy, c)
            self.after_stall(proxy, c)
        finally:
            # Before the teardown stops the proxy: its drain would wait for
            # a stalled disk, or for this client to read.
            self.unstall()
            c.close()
        for key in ("fits", "probe", "held"):
            self.assertEqual(self.upstream.count(key), 1)
        self.assertGreaterEqual(int(self.stats().get("stalled", 0)), 1, "no flush was stalled")
        chaoslib.figure(TEST, budget=BUDGET, answer_mib=HELD // MIB, in_disk_after_s=in_disk_s)

    def during_stall(self, proxy, c):
        """The 8 MiB answer's complete is in the stalled disk: a 2 MiB
        replay is refused. Returns the seconds until the writer was in the
        disk."""
        self.stall()
        try:
            stalled = time.monotonic()
            # The writer is in the disk with the complete: submitted,
            # counted, and not handed back until the stall ends.
            self.assertTrue(harness.wait_for(lambda: self.flushes_waiting() >= 1, timeout=10),
                            "no commit waited for the stalled disk")
            in_disk_s = round(time.monotonic() - stalled, 3)
            self.assertFalse(self.answer_started(c, 0), "the answer was sent before the stall "
                             "held its commit: the test proves nothing")
            self.assertFalse(self.replay(proxy, "probe", PROBE), "the 8 MiB answer is not held")
            sent = self.replay(proxy, "fits", FITS)
            self.assertFalse(self.answer_started(c, 0), "the commit ended during the check")
            self.assertFalse(sent, "a 2 MiB replay was sent while an 8 MiB answer was held "
                             "twice (the request's buffer and the store's copy in the stalled "
                             "commit) under a %s budget: the store's copy is not counted"
                             % BUDGET)
            return in_disk_s
        finally:
            self.unstall()

    def after_stall(self, proxy, c):
        """The commit has ended once the answer's first bytes arrive; the
        answer stays unread, so only the request's buffer is held: the same
        replay is sent."""
        self.assertTrue(self.answer_started(c, 15), "no answer after the stall")
        self.assertTrue(self.replay(proxy, "fits", FITS),
                        "the store's copy was not given back when its commit ended")
        self.assertFalse(self.replay(proxy, "probe", PROBE),
                         "the 8 MiB answer was not held any more: the test proves nothing")
        a = harness.read_slow_post(proxy, c)
        self.assertExecuted(a)
        self.assertEqual(a.body, harness.huge_body(HELD))

    def flushes_waiting(self):
        """slowdisk's count of flushes blocked by the stall now (0 while its
        stats file is being rewritten)."""
        try:
            return int(self.stats().get("waiting", 0))
        except ValueError:
            return 0

    @staticmethod
    def answer_started(c, timeout):
        """Whether the first bytes of the answer to slow_post()'s request c
        have arrived (within timeout seconds; 0: now), without reading them."""
        c.settimeout(timeout if timeout > 0 else 0.0)
        try:
            data = c.recv(12, socket.MSG_PEEK)
        except (BlockingIOError, socket.timeout):
            return False
        finally:
            c.settimeout(20)
        if not data or not b"HTTP/1.1 201".startswith(data):
            raise AssertionError("unexpected answer: %r" % data)
        return True


if __name__ == "__main__":
    unittest.main()
