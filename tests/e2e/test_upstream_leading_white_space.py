#!/usr/bin/env python3
"""An answer with white space before its first field line (RFC 9112 section
2.2: a recipient rejects it or drops that line) on upstream connections and
client handles that served ordinary answers before: the proxy stays up and
answers each such request with a 502 (the key released, so a retry runs) or
with the answer minus that line (stored, and replayed).

libcurl 7.88 (Debian 12) kept a pointer to the previous transfer's last field
in a reused easy handle after freeing it, and took such a line for a
continuation of that field: a use-after-free (curl issue #11620), found by
tests/adversarial/test_response_fuzz.py. Run with both upstream clients
(tests/e2e/CMakeLists.txt); under AddressSanitizer the old code aborts."""

import unittest

import harness

ROUNDS = 20


class UpstreamLeadingWhiteSpace(harness.ProxyTestCase):
    def test_leading_white_space_after_ordinary_answers(self):
        proxy = self.start_proxy()
        outcomes = {"refused": 0, "dropped-line": 0}
        for i in range(ROUNDS):
            # An ordinary answer first, on each worker's handles and pooled
            # connections (new client connections spread over the workers).
            ok = self.post(proxy, "plain-%d" % i)
            self.assertEqual(ok.status, 201, ok)
            key = "lead-%d" % i
            r = self.post(proxy, key, headers=[("X-Test-Fault", "leading-space")])
            self.assertTrue(proxy.running(), "the proxy died on round %d" % i)
            again = self.post(proxy, key)
            if r.status == 502:
                self.assertProblem(r, 502)
                # Released: the retry ran (an ordinary answer this time).
                self.assertEqual(again.status, 201, again)
                self.assertFalse(again.replayed, again)
                self.assertEqual(self.upstream.count(key), 2)
                outcomes["refused"] += 1
            else:
                self.assertEqual(r.status, 201, r)
                self.assertIsNone(r.header("X-Leading"), r)
                self.assertTrue(again.replayed, again)
                self.assertEqual(again.body, r.body)
                self.assertEqual(self.upstream.count(key), 1)
                outcomes["dropped-line"] += 1
        self.assertTrue(proxy.running())
        self.note("outcomes: %r", outcomes)


if __name__ == "__main__":
    unittest.main()
