#!/usr/bin/env python3
"""Concurrent replays of one stored answer share one copy of it.

A replay copies the stored answer out of the store (LMDB's values live only
as long as the read transaction) and holds the copy until it is sent. Each
replay had its own: 250 clients replaying one 10 MiB answer held 2.5 GiB,
and under server.max_buffered all but a few of them were refused 503. Now
the replays of one record share one immutable copy, counted once against
max_buffered, and every one of them gets the stored answer byte for byte.

The copy belongs to one version of the record: a key that is forgotten, or
whose TTL ends and which runs again, is never replayed from the copy of its
earlier answer, even while clients are still reading that one.
"""

import socket
import subprocess
import time
import unittest

import harness

MIB = 1 << 20


def answer_size():
    """6 MiB, or more where the kernel's TCP send buffer could take a whole
    answer (net.ipv4.tcp_wmem's max, 4 MiB on Debian 12): the copy must stay
    in the proxy while the slow clients read nothing."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            wmem_max = int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        wmem_max = 4 * MIB
    return max(6 * MIB, (wmem_max // MIB + 2) * MIB)


def answered(conns, timeout=15):
    """Waits until the answer to each slow_post() request in conns has
    started to arrive (its status line), without reading it: the proxy has
    made each one's answer. (A fixed sleep was a guess at how long that
    takes on a loaded machine.)"""
    for c in conns:
        c.settimeout(timeout)
        head = c.recv(12, socket.MSG_PEEK | socket.MSG_WAITALL)
        c.settimeout(30)
        if not head.startswith(b"HTTP/1.1 "):
            raise AssertionError("no answer within %gs: %r" % (timeout, head))


def without_date(resp):
    return [(n, v) for (n, v) in resp.headers if n.lower() != "date"]


class ConcurrentReplaysShareOneCopy(harness.ProxyTestCase):
    def huge(self, size, pattern=b"0123456789abcdef"):
        return [("X-Test-Fault", "huge"), ("X-Test-Size", str(size)),
                ("X-Test-Pattern", pattern.decode())]

    def test_many_slow_replays_of_one_answer_fit_where_one_copy_does(self):
        # 8 MiB of buffer and a 6 MiB answer (scaled with answer_size()):
        # one copy fits, two do not. Twelve clients replay it at once and
        # read nothing for 2 s: with a copy each, eleven were refused 503
        # out-of-memory.
        size = answer_size()
        budget = "%dMiB" % ((size + size // 3) // MIB)
        proxy = self.start_proxy(config=self.config(routes=[self.route()],
                                                    server={"max_buffered": budget}))
        hdrs = self.huge(size)
        first = self.post(proxy, "big", headers=hdrs, timeout=30)
        self.assertEqual(first.status, 201, first)
        self.assertEqual(first.body, harness.huge_body(size))
        other = self.post(proxy, "other", headers=hdrs, timeout=30)
        self.assertEqual(other.status, 201, other)
        # What a replay is, one at a time: the reference. "other"'s 6 MiB
        # answer is counted until libmicrohttpd reports it sent, which can
        # be just after this client has read it: until then a replay does
        # not fit (8 MiB), so a 503 out-of-memory is retried.
        def reference():
            r = self.post(proxy, "big", headers=hdrs, timeout=30)
            if r.status == 503:
                self.assertTrue(self.assertProblem(r, 503)["type"].endswith(":out-of-memory"))
                return None
            return r
        ref = harness.wait_for(reference, timeout=10, interval=0.1)
        self.assertIsNotNone(ref, "a lone replay of the stored answer was refused for 10 s")
        self.assertEqual(ref.status, 201, ref)
        self.assertTrue(ref.replayed, ref)

        conns = [harness.slow_post(proxy, "big", hdrs) for _ in range(12)]
        # Every replay answered (its first bytes here), none read yet.
        answered(conns)
        # The shared copy is counted: a 6 MiB replay of another record does
        # not fit next to it.
        late = self.post(proxy, "other", headers=hdrs, timeout=30)
        doc = self.assertProblem(late, 503)
        self.assertTrue(doc["type"].endswith(":out-of-memory"), doc)
        self.assertRetryAfter(late, minimum=1)

        replies = [harness.read_slow_post(proxy, c) for c in conns]
        self.note("statuses %s", [r.status for r in replies])
        for r in replies:
            self.assertEqual(r.status, 201, r)
            self.assertTrue(r.replayed, r)
            self.assertEqual(r.body, ref.body)
            self.assertEqual(without_date(r), without_date(ref))
        self.assertEqual(self.upstream.count("big"), 1)
        # Given back once the last of them is sent: the other record's
        # replay fits again.
        harness.wait_for(lambda: self.post(proxy, "other", headers=hdrs,
                                           timeout=30).status == 201, timeout=10)
        self.assertEqual(self.upstream.count("other"), 1)

    def test_forgotten_or_expired_key_never_replayed_from_the_old_copy(self):
        # Slow readers hold the copy of the key's first answer while the key
        # is forgotten and runs again, then while its TTL ends and it runs a
        # third time. Each new answer is as long as the first (another
        # pattern): replays made after each change get the new one, and the
        # slow readers still get the answer they were replayed.
        proxy = self.start_proxy(ttl="3s")
        size = answer_size()
        pat = [b"AAAAAAAAAAAAAAAA", b"BBBBBBBBBBBBBBBB", b"CCCCCCCCCCCCCCCC"]

        def run(i):
            r = self.post(proxy, "k", headers=self.huge(size, pat[i]), timeout=30)
            self.assertEqual(r.status, 201, r)
            self.assertFalse(r.replayed, r)
            self.assertEqual(r.body, harness.huge_body(size, pat[i]))
            return r

        def replays_give(i, answer):
            # Whatever the request's own pattern: the replay is the stored one.
            r = self.post(proxy, "k", headers=self.huge(size, pat[(i + 1) % 3]), timeout=30)
            self.assertEqual(r.status, 201, r)
            self.assertTrue(r.replayed, r)
            self.assertEqual(r.charge_id, answer.charge_id)
            self.assertEqual(r.body, harness.huge_body(size, pat[i]))

        answers = [run(0)]
        held = [[harness.slow_post(proxy, "k", self.huge(size, pat[0])) for _ in range(3)]]
        answered(held[0])  # replayed from the first answer's copy
        rc = subprocess.run([harness.binary(), "forget-key", self.store_path,
                                     "payments", "k"], capture_output=True, timeout=30)
        self.assertEqual(rc.returncode, 0, rc.stderr)
        answers.append(run(1))
        self.assertEqual(self.upstream.count("k"), 2)
        held.append([harness.slow_post(proxy, "k", self.huge(size, pat[0])) for _ in range(3)])
        answered(held[1])  # before the TTL of the second answer ends
        replays_give(1, answers[1])

        time.sleep(3.5)  # the TTL of the second answer ends
        answers.append(run(2))
        self.assertEqual(self.upstream.count("k"), 3)
        replays_give(2, answers[2])

        for i, conns in enumerate(held):
            for c in conns:
                r = harness.read_slow_post(proxy, c)
                self.assertEqual(r.status, 201, r)
                self.assertTrue(r.replayed, r)
                self.assertEqual(r.charge_id, answers[i].charge_id)
                self.assertEqual(r.body, harness.huge_body(size, pat[i]))


if __name__ == "__main__":
    unittest.main()
