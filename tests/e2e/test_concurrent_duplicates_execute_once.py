#!/usr/bin/env python3
"""Many concurrent requests with the same key run the upstream exactly once;
the others get the stored answer (with `wait`) or 409 with Retry-After
(`wait` 0). Many keys at once: one execution per key."""

import threading
import unittest

import harness
from harness import in_thread


def burst(fn, n):
    """Calls fn(i) from n threads released at the same moment."""
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait(10)
        return fn(i)

    futs = [in_thread(run, i) for i in range(n)]
    return [f.result(30) for f in futs]


class ConcurrentDuplicates(harness.ProxyTestCase):
    def test_twenty_duplicates_with_wait_share_one_execution(self):
        proxy = self.start_proxy(wait="8s")
        results = burst(lambda i: self.post(proxy, "burst-1", headers=[("X-Test-Delay-Ms", "800")]), 20)
        self.assertEqual(self.upstream.count("burst-1"), 1)
        for r in results:
            self.assertEqual(r.status, 201, r)
        self.assertEqual(len({r.charge_id for r in results}), 1, results)
        self.assertEqual(len({r.body for r in results}), 1)
        fresh = [r for r in results if not r.replayed]
        self.assertEqual(len(fresh), 1, "expected one forwarded answer, %d" % len(fresh))

    def test_twenty_duplicates_with_wait_zero_get_409(self):
        proxy = self.start_proxy(wait="0s", lease="5s", heartbeat="1s")
        results = burst(lambda i: self.post(proxy, "burst-2", headers=[("X-Test-Delay-Ms", "4000")]), 20)
        self.assertEqual(self.upstream.count("burst-2"), 1)
        winners = [r for r in results if r.status == 201]
        losers = [r for r in results if r.status != 201]
        self.assertEqual(len(winners), 1, results)
        self.assertFalse(winners[0].replayed)
        self.assertEqual(len(losers), 19)
        for r in losers:
            self.assertProblem(r, 409)
            self.assertRetryAfter(r, minimum=1, maximum=5)

    def test_many_keys_many_duplicates(self):
        proxy = self.start_proxy(wait="10s")
        keys, dups = 25, 6
        results = burst(lambda i: (i % keys, self.post(proxy, "many-%d" % (i % keys),
                                                       headers=[("X-Test-Delay-Ms", "300")])),
                        keys * dups)
        ex = self.upstream.executions()
        self.assertEqual(ex["total"], keys, ex)
        self.assertEqual(set(ex["by_key"].values()), {1})
        by_key = {}
        for k, r in results:
            self.assertEqual(r.status, 201, r)
            by_key.setdefault(k, set()).add(r.charge_id)
        for k, ids in by_key.items():
            self.assertEqual(len(ids), 1, "key many-%d got answers %r" % (k, ids))


if __name__ == "__main__":
    unittest.main()
