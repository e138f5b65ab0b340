#!/usr/bin/env python3
"""Fencing: a holder frozen (SIGSTOP) past its lease loses the key to a thief;
when it wakes up its late result is refused (outcome "fenced") and never
overwrites the thief's record: every replay returns the thief's answer. The
frozen holder's own client still gets the upstream's response."""

import time
import unittest

import harness
from harness import in_thread


class StoppedOwnerFenced(harness.ProxyTestCase):
    def start_pair(self):
        a = self.start_proxy(name="a", lease="1s", heartbeat="300ms", wait="0s")
        b = self.start_proxy(name="b", lease="1s", heartbeat="300ms", wait="0s")
        return a, b

    def test_late_result_never_overwrites_the_thief(self):
        a, b = self.start_pair()
        late = in_thread(self.post, a, "fence-1", headers=[("X-Test-Delay-Ms", "3500"),
                                                          ("X-Test-Holder", "a")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("fence-1") == 1, 3))
        t0 = time.monotonic()
        time.sleep(0.2)
        a.sigstop()
        try:
            time.sleep(1.8)  # a's lease (1 s after its last heartbeat) expires
            thief = self.post(b, "fence-1", headers=[("X-Test-Holder", "b")])
            self.assertExecuted(thief)
            self.assertEqual(self.upstream.count("fence-1"), 2)
        finally:
            a.sigcont()
        self.assertLess(time.monotonic() - t0, 3.3, "the thief finished after a's upstream answer")

        # a wakes up, receives the upstream's answer to its own request and
        # tries to complete with its stale lease.
        ra = late.result(10)
        self.assertEqual(ra.status, 201, ra)
        self.assertFalse(ra.replayed, ra)
        self.assertNotEqual(ra.charge_id, thief.charge_id)

        for proxy in (a, b, a):
            again = self.post(proxy, "fence-1")
            self.assertReplayOf(again, thief)
        self.assertEqual(self.upstream.count("fence-1"), 2)
        outcomes = [e["outcome"] for e in a.wait_access_log(3)]
        self.assertIn("fenced", outcomes, a.access_log())

    def test_late_result_does_not_complete_thiefs_in_progress_record(self):
        a, b = self.start_pair()
        late = in_thread(self.post, a, "fence-2", headers=[("X-Test-Delay-Ms", "1500")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("fence-2") == 1, 3))
        time.sleep(0.2)
        a.sigstop()
        try:
            time.sleep(1.8)
            # The thief's action is slow: it is still running when a wakes up
            # and tries to complete.
            thief_f = in_thread(self.post, b, "fence-2", headers=[("X-Test-Delay-Ms", "2000")])
            self.assertTrue(harness.wait_for(lambda: self.upstream.count("fence-2") == 2, 3))
        finally:
            a.sigcont()
        ra = late.result(10)
        self.assertEqual(ra.status, 201, ra)
        # a's refused completion left b's record IN_PROGRESS: a duplicate is
        # a 409, not a replay of a's answer.
        mid = self.post(b, "fence-2")
        self.assertProblem(mid, 409)
        thief = thief_f.result(10)
        self.assertExecuted(thief)
        self.assertReplayOf(self.post(a, "fence-2"), thief)
        self.assertReplayOf(self.post(b, "fence-2"), thief)
        self.assertEqual(self.upstream.count("fence-2"), 2)


if __name__ == "__main__":
    unittest.main()
