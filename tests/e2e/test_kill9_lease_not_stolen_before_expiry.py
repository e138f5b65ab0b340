#!/usr/bin/env python3
"""A holder killed with SIGKILL mid-action leaves an IN_PROGRESS record. Before
its lease expires nobody may steal the key (a duplicate gets 409); once the
lease has expired the next request steals it, executes once more and
completes (seed 000, "Steal")."""

import json
import subprocess
import time
import unittest

import harness
from harness import in_thread


class Kill9LeaseSteal(harness.ProxyTestCase):
    def test_not_stolen_before_expiry_stolen_after(self):
        a = self.start_proxy(name="a", lease="2s", heartbeat="300ms", wait="0s")
        b = self.start_proxy(name="b", lease="2s", heartbeat="300ms", wait="0s")
        in_thread(self.post, a, "k9", headers=[("X-Test-Delay-Ms", "5000"),
                                              ("X-Test-Holder", "a")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("k9") == 1, 3))
        self.note("a's request reached the upstream")
        time.sleep(0.4)  # a heartbeat or two
        a.kill9()
        killed_at = time.monotonic()
        self.note("a killed")

        # The 2 s lease was extended within the last 300 ms: it is live for
        # at least ~1.7 s more (less if a loaded machine delayed the
        # heartbeats), so an answer within 0.8 s of the kill is about a live
        # lease.
        early = self.post(b, "k9")
        self.note("b answered %d", early.status)
        self.assertLess(time.monotonic() - killed_at, 0.8, "too slow to test the live lease")
        self.assertProblem(early, 409)
        self.assertRetryAfter(early, minimum=1, maximum=2)
        self.assertEqual(self.upstream.count("k9"), 1, "the key was stolen from a live lease")

        # check-store shows the dead holder's lease as a wall-clock time
        # (leases are kept on the boot clock): live, ending within the 2 s
        # lease of the last heartbeat.
        before_ms = time.time() * 1000
        p = subprocess.run([harness.binary(), "check-store", self.store_path, "--records"],
                           capture_output=True, timeout=10)
        self.assertEqual(p.returncode, 0, p)
        held = [d for d in map(json.loads, p.stdout.decode().splitlines())
                if d.get("state") == "in_progress"]
        self.assertEqual(len(held), 1, p.stdout)
        self.assertGreater(held[0]["lease_expires_ms"], before_ms, held[0])
        self.assertLess(held[0]["lease_expires_ms"], before_ms + 2100, held[0])

        # Past the lease (2 s after the last possible heartbeat, plus slack).
        time.sleep(max(0.0, killed_at + 2.6 - time.monotonic()))
        stolen = self.post(b, "k9")
        self.assertExecuted(stolen)
        self.assertEqual(self.upstream.count("k9"), 2)
        self.assertReplayOf(self.post(b, "k9"), stolen)
        self.assertEqual(self.upstream.count("k9"), 2)

        # A new process on the same store sees the thief's result too.
        c = self.start_proxy(name="c", lease="2s", heartbeat="300ms", wait="0s")
        self.assertReplayOf(self.post(c, "k9"), stolen)

    def test_waiting_duplicate_never_runs_while_lease_is_live(self):
        a = self.start_proxy(name="a", lease="3s", heartbeat="500ms", wait="0s")
        b = self.start_proxy(name="b", lease="3s", heartbeat="500ms", wait="800ms")
        in_thread(self.post, a, "k9-wait", headers=[("X-Test-Delay-Ms", "5000")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("k9-wait") == 1, 3))
        a.kill9()
        # b waits 800 ms, less than the ~2.5 s left on the dead holder's lease.
        r = self.post(b, "k9-wait")
        self.assertProblem(r, 409)
        self.assertRetryAfter(r, minimum=1, maximum=3)
        self.assertEqual(self.upstream.count("k9-wait"), 1)


if __name__ == "__main__":
    unittest.main()
