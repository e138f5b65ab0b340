"""test_deliver_race.py - the writer never reads a result it has handed over.

The store writer hands each job's result to the job's worker through the
worker's inbox. The job lives inside its request, and once it is in the
inbox the worker may run it, answer the client and free the request. A
writer preempted right after the hand-over used to read the job again (to
tell waiting duplicates that its key was settled): a use after free, found
once by the ASan run of chaos_kill9_chaos.

IDEM_FAULT_DELIVER_PAUSE_MS (fault builds only, proxy/fault.h) makes that
preemption certain: after each hand-over the writer wakes the worker and
sleeps. A duplicate waiting on a slow key makes every delivery one that
tells the waiters about settled keys. Under AddressSanitizer the old code
aborts on the first such delivery; this test wants every request answered,
no sanitizer report, and a clean exit.
"""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import harness  # noqa: E402

PAUSE_MS = 50


class DeliverRace(harness.ProxyTestCase):
    def test_results_handed_over_are_not_read_again(self):
        env = dict(os.environ, IDEM_FAULT_DELIVER_PAUSE_MS=str(PAUSE_MS))
        proxy = harness.Proxy(self.workdir, self.config(routes=[self.route(wait="20s")]),
                              "proxy1", env=env)
        self.proxies.append(proxy)
        proxy.start()

        # A slow key held IN_PROGRESS, and a duplicate waiting for it: from
        # now on every delivery also tells the waiters about settled keys.
        holder = harness.in_thread(self.post, proxy, "slow",
                                   headers=[("X-Test-Delay-Ms", "4000")], timeout=30)
        harness.wait_for(lambda: self.upstream.count("slow") == 1, timeout=10)
        waiter = harness.in_thread(self.post, proxy, "slow", timeout=30)
        time.sleep(0.3)

        for i in range(8):
            start = time.monotonic()
            resp = self.post(proxy, "fast-%d" % i)
            took = time.monotonic() - start
            self.assertExecuted(resp)
            # Each writer lane pauses after every delivery (the records in
            # flight's after the acquire, the records' after the complete:
            # store layout 4), so each request but the first waits for the
            # pauses that followed the previous one's deliveries (a request
            # takes ~5 ms without them).
            if i > 0:
                self.assertGreaterEqual(took, PAUSE_MS / 2000.0,
                                        "the deliver pause did not happen: not a fault build?")
        self.assertExecuted(holder.result(timeout=30))
        replay = waiter.result(timeout=30)
        self.assertEqual(replay.status, 201, replay)
        self.assertEqual(self.upstream.count("slow"), 1)

        self.assertStopsClean(proxy)


if __name__ == "__main__":
    unittest.main()
