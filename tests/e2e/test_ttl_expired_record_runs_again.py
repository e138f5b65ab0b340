#!/usr/bin/env python3
"""A COMPLETE record past its TTL is treated as absent: the next request with
the key executes again (seed 000, "Purge"). TTL counts from completion."""

import time
import unittest

import harness


class TtlExpired(harness.ProxyTestCase):
    def test_expired_record_runs_again(self):
        proxy = self.start_proxy(ttl="2s")
        first = self.post(proxy, "ttl-1")
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "ttl-1"), first)
        time.sleep(2.4)
        second = self.post(proxy, "ttl-1")
        self.assertExecuted(second)
        self.assertNotEqual(second.charge_id, first.charge_id)
        self.assertReplayOf(self.post(proxy, "ttl-1"), second)
        self.assertEqual(self.upstream.count("ttl-1"), 2)

    def test_ttl_counts_from_completion(self):
        # The action takes 2 s of a 3 s TTL; 1.5 s after completion the record
        # is 3.5 s old but only 1.5 s past completion: it must still replay.
        proxy = self.start_proxy(ttl="3s", lease="2s", heartbeat="500ms")
        first = self.post(proxy, "ttl-2", headers=[("X-Test-Delay-Ms", "2000")])
        self.assertExecuted(first)
        time.sleep(1.5)
        self.assertReplayOf(self.post(proxy, "ttl-2"), first)
        self.assertEqual(self.upstream.count("ttl-2"), 1)


if __name__ == "__main__":
    unittest.main()
