#!/usr/bin/env python3
"""A duplicate arriving while the first request is IN_PROGRESS waits up to the
route's `wait` and then gets the replay; if the holder releases, the waiter
runs the action itself; with `wait` 0 (or once `wait` is over) it gets 409 with
Retry-After (seconds left on the holder's lease, at least 1)."""

import time
import unittest

import harness
from harness import in_thread


class InProgressDuplicate(harness.ProxyTestCase):
    def test_duplicate_waits_then_replays(self):
        proxy = self.start_proxy(wait="5s")
        first = in_thread(self.post, proxy, "wait-1", headers=[("X-Test-Delay-Ms", "1200")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        t0 = time.monotonic()
        dup = self.post(proxy, "wait-1")
        waited = time.monotonic() - t0
        r1 = first.result(10)
        self.assertExecuted(r1)
        self.assertReplayOf(dup, r1)
        self.assertGreater(waited, 0.5, "the duplicate did not wait for the holder")
        self.assertLess(waited, 4.5, "the duplicate waited far longer than the action")
        self.assertEqual(self.upstream.count("wait-1"), 1)

    def test_duplicate_runs_itself_when_holder_releases(self):
        proxy = self.start_proxy(wait="5s")
        # The holder's upstream call fails with a 503: the record is released
        # and the waiting duplicate acquires the key and runs the action.
        first = in_thread(self.post, proxy, "wait-rel",
                          headers=[("X-Test-Delay-Ms", "800"), ("X-Test-Status", "503")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        dup = self.post(proxy, "wait-rel")
        r1 = first.result(10)
        self.assertEqual(r1.status, 503, r1)
        self.assertExecuted(dup)
        self.assertNotEqual(dup.charge_id, r1.charge_id)
        self.assertEqual(self.upstream.count("wait-rel"), 2)
        self.assertReplayOf(self.post(proxy, "wait-rel"), dup)

    def test_waiters_hold_no_thread(self):
        # One worker; 40 duplicates wait on a slow holder. If each waiter
        # held the worker, an unrelated request could not be served.
        proxy = self.start_proxy(config=self.config(
            routes=[self.route(wait="8s")], server={"workers": 1}))
        first = in_thread(self.post, proxy, "many-wait", headers=[("X-Test-Delay-Ms", "5000")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        waiters = [in_thread(self.post, proxy, "many-wait") for _ in range(40)]
        time.sleep(0.5)
        t0 = time.monotonic()
        other = self.post(proxy, "unrelated")
        self.assertExecuted(other)
        # Blocked, it would have waited for the holder (5 s); the bound
        # leaves a loaded machine room for the request's two commits.
        self.assertFalse(first.done(), "the holder finished first: the test proves nothing")
        self.assertLess(time.monotonic() - t0, 2.5, "waiters blocked an unrelated request")
        r1 = first.result(10)
        for w in waiters:
            self.assertReplayOf(w.result(10), r1)
        self.assertEqual(self.upstream.count("many-wait"), 1)

    def test_wait_zero_gives_409_with_retry_after(self):
        proxy = self.start_proxy(wait="0s", lease="5s", heartbeat="1s")
        first = in_thread(self.post, proxy, "conflict-1", headers=[("X-Test-Delay-Ms", "1500")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        t0 = time.monotonic()
        dup = self.post(proxy, "conflict-1")
        self.assertLess(time.monotonic() - t0, 1.0, "wait 0 must answer at once")
        self.assertProblem(dup, 409)
        # Seconds left on the holder's 5 s lease: at least 1, at most 5.
        self.assertRetryAfter(dup, minimum=1, maximum=5)
        r1 = first.result(10)
        self.assertExecuted(r1)
        self.assertReplayOf(self.post(proxy, "conflict-1"), r1)
        self.assertEqual(self.upstream.count("conflict-1"), 1)

    def test_holder_in_another_process_finishing_just_before_the_wait_ends(self):
        """A waiter polls a holder in another process every 10-200 ms. If the
        holder completes after the last poll but before the wait ends, the
        waiter looks once more at its deadline and replays, rather than
        answering 409 for a record that is already COMPLETE. Holders that
        finish in that gap (their client has its answer before the waiter's
        wait can have ended) must be replayed; a 409 is right only when the
        holder finished about when the wait ended, or after."""
        # Polls at about 10, 30, 70, 150, 310, 510, 710, 910 ms, then 1,110:
        # with a 1.1 s wait the last poll before the deadline is ~190 ms
        # before it, so a holder done at ~1 s leaves a wide margin either
        # way on a loaded machine.
        cfg = self.config(routes=[self.route(wait="1100ms")])
        a = self.start_proxy(config=cfg, name="holder")
        b = self.start_proxy(config=cfg, name="waiter")
        in_gap = 0
        for i, delay in enumerate((960, 990, 1020)):
            key = "gap-%d" % i

            def hold(key=key, delay=delay):
                r = self.post(a, key, headers=[("X-Test-Delay-Ms", str(delay))])
                return r, time.monotonic()

            holder = in_thread(hold)
            self.assertTrue(harness.wait_for(lambda: self.upstream.count(key) == 1, 3))
            t_sent = time.monotonic()
            w = self.post(b, key)
            h, t_holder = holder.result(10)
            self.assertExecuted(h)
            # The waiter's wait starts after t_sent, so its last look is at
            # t_sent + 1.1 s or later; a holder whose client had the answer
            # (its COMPLETE committed) before then was seen by that look.
            # Counted from the send, not from the waiter's answer, which a
            # loaded machine may deliver late after a right 409.
            if t_holder < t_sent + 1.1 - 0.02:
                in_gap += 1
                self.assertTrue(w.status == 201 and w.replayed,
                                "%s: holder answered %.0f ms before the waiter's wait ended: "
                                "%r" % (key, 1000 * (t_sent + 1.1 - t_holder), w))
            else:
                self.assertIn(w.status, (201, 409), w)
            self.assertEqual(self.upstream.count(key), 1)
        self.note("holders finished in the last poll gap: %d of 3", in_gap)

    def test_wait_expires_into_409(self):
        proxy = self.start_proxy(wait="500ms", lease="3s", heartbeat="500ms")
        first = in_thread(self.post, proxy, "conflict-2", headers=[("X-Test-Delay-Ms", "2500")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        t0 = time.monotonic()
        dup = self.post(proxy, "conflict-2")
        waited = time.monotonic() - t0
        self.assertProblem(dup, 409)
        self.assertRetryAfter(dup, minimum=1, maximum=3)
        self.assertGreaterEqual(waited, 0.4, "answered 409 before `wait` was over")
        self.assertLess(waited, 2.0, "waited past `wait`")
        self.assertExecuted(first.result(10))
        self.assertEqual(self.upstream.count("conflict-2"), 1)


if __name__ == "__main__":
    unittest.main()
