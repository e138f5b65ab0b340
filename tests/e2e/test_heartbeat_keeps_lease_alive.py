#!/usr/bin/env python3
"""The heartbeat extends a live holder's lease, so a slow action (5 s with a
1.5 s lease) is never stolen: duplicates sent to a second process at t=2, 3
and 4.2 s get 409 instead of running the action again, and the holder
completes."""

import time
import unittest

import harness
from harness import in_thread


class HeartbeatKeepsLease(harness.ProxyTestCase):
    def test_slow_action_not_stolen(self):
        a = self.start_proxy(name="a", lease="1500ms", heartbeat="300ms", wait="0s")
        b = self.start_proxy(name="b", lease="1500ms", heartbeat="300ms", wait="0s")
        first = in_thread(self.post, a, "hb-1", headers=[("X-Test-Delay-Ms", "5000")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("hb-1") == 1, 3))
        t0 = time.monotonic()
        for at in (2.0, 3.0, 4.2):
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            dup = self.post(b, "hb-1")
            self.assertProblem(dup, 409)
            self.assertRetryAfter(dup, minimum=1, maximum=2)
            self.assertEqual(self.upstream.count("hb-1"), 1,
                             "lease stolen at t=%.1fs although its holder is alive" % at)
        r1 = first.result(10)
        self.assertExecuted(r1)
        self.assertReplayOf(self.post(b, "hb-1"), r1)
        self.assertReplayOf(self.post(a, "hb-1"), r1)
        self.assertEqual(self.upstream.count("hb-1"), 1)
        outcomes = [e["outcome"] for e in a.wait_access_log(2)]
        self.assertIn("forwarded", outcomes)
        self.assertNotIn("fenced", outcomes)

    def test_waiter_in_same_process_sees_completion(self):
        a = self.start_proxy(name="a", lease="1500ms", heartbeat="300ms", wait="6s")
        first = in_thread(self.post, a, "hb-2", headers=[("X-Test-Delay-Ms", "3000")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("hb-2") == 1, 3))
        dup = self.post(a, "hb-2")
        r1 = first.result(10)
        self.assertExecuted(r1)
        self.assertReplayOf(dup, r1)
        self.assertEqual(self.upstream.count("hb-2"), 1)


if __name__ == "__main__":
    unittest.main()
