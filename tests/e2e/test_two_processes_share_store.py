#!/usr/bin/env python3
"""Several proxy processes may share one store path: a duplicate sent to the
second process is replayed from the first one's record, and a duplicate that
arrives at the second process while the first holds the key waits for it."""

import time
import unittest

import harness
from harness import in_thread


class TwoProcessesShareStore(harness.ProxyTestCase):
    def test_duplicate_to_second_process_is_replayed(self):
        a = self.start_proxy(name="a")
        b = self.start_proxy(name="b")
        first = self.post(a, "two-1")
        self.assertExecuted(first)
        self.assertReplayOf(self.post(b, "two-1"), first)
        self.assertReplayOf(self.post(a, "two-1"), first)
        # And the other direction.
        first_b = self.post(b, "two-2")
        self.assertExecuted(first_b)
        self.assertReplayOf(self.post(a, "two-2"), first_b)
        self.assertEqual(self.upstream.total(), 2)

    def test_mismatch_seen_across_processes(self):
        a = self.start_proxy(name="a")
        b = self.start_proxy(name="b")
        self.assertExecuted(self.post(a, "two-mm", body=b'{"amount":1}'))
        self.assertProblem(self.post(b, "two-mm", body=b'{"amount":2}'), 422)
        self.assertEqual(self.upstream.total(), 1)

    def test_duplicate_to_second_process_waits_for_holder(self):
        a = self.start_proxy(name="a", wait="5s")
        b = self.start_proxy(name="b", wait="5s")
        first = in_thread(self.post, a, "two-wait", headers=[("X-Test-Delay-Ms", "1000")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        t0 = time.monotonic()
        dup = self.post(b, "two-wait")
        waited = time.monotonic() - t0
        r1 = first.result(10)
        self.assertExecuted(r1)
        self.assertReplayOf(dup, r1)
        self.assertLess(waited, 4.0, "the other process's completion was noticed late")
        self.assertEqual(self.upstream.count("two-wait"), 1)

    def test_concurrent_first_requests_on_two_processes_execute_once(self):
        a = self.start_proxy(name="a", wait="5s")
        b = self.start_proxy(name="b", wait="5s")
        futs = []
        for i in range(10):
            proxy = a if i % 2 == 0 else b
            futs.append(in_thread(self.post, proxy, "two-race", headers=[("X-Test-Delay-Ms", "300")]))
        results = [f.result(15) for f in futs]
        self.assertEqual(self.upstream.count("two-race"), 1)
        ids = {r.charge_id for r in results}
        self.assertEqual(len(ids), 1, results)
        self.assertEqual(sum(1 for r in results if not r.replayed), 1, results)
        for r in results:
            self.assertEqual(r.status, 201, r)


if __name__ == "__main__":
    unittest.main()
