#!/usr/bin/env python3
"""SIGTERM while the store's disk stalls for longer than server.drain_timeout:
the stop is still bounded, no client is told a result the store does not
hold, and the store opens cleanly afterwards.

The proxy runs under libslowdisk.so (slowdisk.c, as test_slow_disk.py): while
the stall file exists, every flush of data.mdb blocks, so the store writer
is stuck inside one commit and every store write of the process queues
behind it. Two requests are in flight when SIGTERM comes:
  complete  its action is running at the upstream; its answer comes during
            the drain and its complete queues behind the stalled commit;
  acquire   a new key sent during the stall. Until layout 4 its acquire
            queued behind the stalled commit and nothing was forwarded; now
            acquires go to the environment of the records in flight, which
            is never flushed, so it is forwarded at once and its complete
            queues behind the stall like the first's.

Before 2026-12-06 the workers waited for every store write they had queued
and the main thread for the writer, so the process exited only once the
disk came back (drain_timeout 2 s, SIGTERM 0.3 s into the stall): 5.7 s
after SIGTERM with a 6 s stall, 9.7 s with a 10 s one, never while the
stall lasted (ended by the test 30 s in); an idle proxy with durability
"interval" whose periodic sync stalled, likewise. Now:
  - a second past the drain's deadline, every client still waiting for the
    store gets 503 shutting-down; the one whose action ran is told so, and
    that its result may not be stored (under durability "sync" an answer
    goes out only once the store holds it: a 2xx here would be a result a
    retry might not find);
  - the process exits a second after that, with the writer still in the
    disk: without closing the store (LMDB forbids mdb_env_close while a
    transaction is live) and with exit status 75, as when the store stops
    taking transactions (the stuck commit is lost or whole, as after a
    crash, which LMDB survives): 4.0 s after SIGTERM;
  - the store checks clean afterwards; a record left IN_PROGRESS is freed
    when its lease ends.
Timing is asserted only as generous upper bounds (drain_timeout + 5 s): the
stall of the first case outlasts that bound, so the old code fails it.
"""

import os
import threading
import time
import unittest

import chaoslib
from chaoslib import harness
from harness import in_thread
from test_slow_disk import SlowDiskProxies

TEST = "stall_outlasts_drain"
DRAIN_S = 2.0
# The drain's bound plus the grace seconds the README gives the exit, plus
# slack for a loaded machine or a sanitizer build: an upper bound only.
EXIT_BOUND_S = DRAIN_S + 5.0
# How long the test waits, beyond the bound, to measure an exit that the
# stall holds up (then ends the stall, so the process can go).
MEASURE_S = 30.0
EXIT_STORE = 75


class StallOutlastsDrain(SlowDiskProxies, harness.ProxyTestCase):
    def start_drain_proxy(self, store=None, **server):
        return self.start_slow_proxy(
            routes=[self.route(lease="5s", heartbeat="1s", wait="10s")], store=store,
            server=dict({"drain_timeout": "%gs" % DRAIN_S}, **server))

    def stalled_flushes(self):
        """Flushes that ended after a stall (the count is written when one
        ends: a process that exits mid-stall leaves none)."""
        return int(self.stats().get("stalled", 0))

    def assertStallHeld(self, proxy, rc, still_stalled):
        """The stall is what the exit met: the process exited mid-stall
        saying so (75), or a flush of it waited for the stall's end and the
        stop was clean (0). still_stalled: the stall had not ended when the
        exit was seen (so it had not at the exit either)."""
        if still_stalled:
            self.assertEqual(rc, EXIT_STORE, "exit status with a commit still in the disk: "
                             "%r; %s" % (rc, proxy.stderr()[-2000:]))
        self.assertIn(rc, (0, EXIT_STORE), proxy.stderr()[-2000:])
        if rc == EXIT_STORE:
            self.assertIn("did not finish", proxy.stderr())
        else:
            self.assertGreaterEqual(self.stalled_flushes(), 1, "no flush was stalled")

    def wait_exit(self, proxy, t0):
        """The exit status and the seconds from SIGTERM to the exit; an exit
        the stall holds up is measured up to MEASURE_S, then the stall is
        ended (the assertion on the bound comes after)."""
        rc = proxy.wait_exit(EXIT_BOUND_S)
        if rc is None:
            rc = proxy.wait_exit(MEASURE_S - EXIT_BOUND_S)
        if rc is None:
            self.note("still running %.1f s after SIGTERM: ending the stall", MEASURE_S)
            self.unstall()
            rc = proxy.wait_exit(15)
        return rc, time.monotonic() - t0

    def sigterm_during_stall(self, stall_s):
        """stall_s: the stall's length from its start; None: it lasts until
        the process has exited."""
        proxy = self.start_drain_proxy()
        done_key, new_key = "stall-complete", "stall-acquire"
        done = in_thread(self.post, proxy, done_key, headers=[("X-Test-Delay-Ms", "1500")],
                         timeout=60)
        self.assertTrue(harness.wait_for(lambda: self.upstream.count(done_key) == 1, 5))
        self.stall()
        stalled_at = time.monotonic()
        if stall_s is not None:
            timer = threading.Timer(stall_s, self.unstall)
            timer.start()
            self.addCleanup(timer.cancel)
        self.addCleanup(self.unstall)
        new = in_thread(self.post, proxy, new_key, timeout=60)
        time.sleep(0.3)  # forwarded; its complete waits behind the stalled commit
        t0 = time.monotonic()
        proxy.terminate()
        self.note("SIGTERM")
        rc, exit_s = self.wait_exit(proxy, t0)
        still_stalled = os.path.exists(self.stall_file)
        self.unstall()
        done_r, new_r = done.result(30), new.result(30)
        self.note("exit %r after %.2f s; complete: %d, acquire: %d", rc, exit_s, done_r.status,
                  new_r.status)

        check = chaoslib.check_store(self.store_path, records=True)
        records = check.records
        done_rec = records.get(chaoslib.record_key("payments", done_key))
        new_rec = records.get(chaoslib.record_key("payments", new_key))
        chaoslib.figure(TEST + ("_stall%gs" % stall_s if stall_s is not None else "_endless"),
                        drain_s=DRAIN_S, exit_s=round(exit_s, 2), status=rc,
                        complete=done_r.status, acquire=new_r.status,
                        complete_record=done_rec["state"] if done_rec else "absent",
                        acquire_record=new_rec["state"] if new_rec else "absent")

        self.assertLess(exit_s, EXIT_BOUND_S,
                        "SIGTERM during a stall: exit after %.1f s, drain_timeout %g s" %
                        (exit_s, DRAIN_S))
        self.assertStallHeld(proxy, rc, still_stalled)
        self.assertTrue(check.ok, check)

        # Both keys' actions ran: the new key's acquire does not wait for
        # the disk (the records in flight are never flushed, layout 4), so
        # it was forwarded at once, and its complete queued behind the stall
        # as the other's did. Each gets its answer only if the store holds
        # it (durability "sync"); else 503, saying that it ran. Neither
        # record is gone, or a retry would run it again at once.
        for key, resp, rec in ((done_key, done_r, done_rec), (new_key, new_r, new_rec)):
            self.assertEqual(self.upstream.count(key), 1, key)
            if resp.status == 201:
                self.assertExecuted(resp)
                self.assertEqual((rec or {}).get("state"), "complete",
                                 "%s: the client got the upstream's answer, the store does not "
                                 "hold it" % key)
            else:
                self.assertProblem(resp, 503)
                self.assertTrue(resp.json()["type"].endswith(":shutting-down"), resp)
                self.assertIn("the action ran", resp.json()["detail"])
            self.assertIsNotNone(rec, "%s: the running action's record is gone: a retry would "
                                 "run it again at once" % key)

    def test_answers_in_the_second_before_the_stop(self):
        """Requests around the second between the 503s and the stop, on one
        event loop (server.workers 1), the disk stalled throughout, while a
        complete waits behind the stall (stored: its answer came during the
        drain), so the stop gives up on it and the process stays that second:
          released  its upstream answered 500 during the drain: it gets that
                    500, not a 503 "retry" that hid that it had been sent
                    (until layout 4 its release waited behind the stall too;
                    now it goes to the records in flight, never flushed);
          late      a new key sent on a connection kept alive from before
                    SIGTERM, after the 503s: 503 shutting-down at once, where
                    its acquire used to queue behind the stall and the stop
                    closed its connection unanswered."""
        proxy = self.start_drain_proxy(workers=1)
        conn = harness.Conn(proxy.port, timeout=30)
        self.addCleanup(conn.close)
        json_key = [("Content-Type", "application/json")]
        self.assertExecuted(conn.request("POST", "/v1/payments",
                                         json_key + [("Idempotency-Key", "keep-alive")],
                                         harness.PAYMENT_BODY))
        released = in_thread(self.post, proxy, "stall-500",
                             headers=[("X-Test-Delay-Ms", "1500"), ("X-Test-Status", "500")],
                             timeout=60)
        stored = in_thread(self.post, proxy, "stall-stored",
                           headers=[("X-Test-Delay-Ms", "1500")], timeout=60)
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("stall-500") == 1 and
                                         self.upstream.count("stall-stored") == 1, 5))
        self.stall()
        self.addCleanup(self.unstall)
        t0 = time.monotonic()
        proxy.terminate()
        self.note("SIGTERM")
        time.sleep(DRAIN_S + 1.4 - (time.monotonic() - t0))  # the 503s came at +3 s
        late = conn.request("POST", "/v1/payments",
                            json_key + [("Idempotency-Key", "stall-late")], harness.PAYMENT_BODY)
        late_s = time.monotonic() - t0
        rc, exit_s = self.wait_exit(proxy, t0)
        self.unstall()
        released = released.result(30)
        stored = stored.result(30)
        self.note("late answered at %.2f s; exit %r at %.2f s; released: %d, stored: %d", late_s,
                  rc, exit_s, released.status, stored.status)
        chaoslib.figure(TEST + "_last_second", late_s=round(late_s, 2), exit_s=round(exit_s, 2),
                        status=rc, released=released.status, late=late.status)
        self.assertEqual(released.status, 500, released)
        self.assertFalse(released.replayed, released)
        self.assertProblem(stored, 503)
        self.assertIn("the action ran", stored.json()["detail"])
        self.assertProblem(late, 503)
        self.assertIn(b"shutting-down", late.body)
        self.assertLess(late_s, DRAIN_S + 2.0 + 0.5, "the late request waited for the stop")
        self.assertEqual(self.upstream.count("stall-late"), 0)
        self.assertLess(exit_s, EXIT_BOUND_S)

    def test_stall_ends_after_the_bound(self):
        self.sigterm_during_stall(EXIT_BOUND_S + 3.0)

    def test_stall_ends_while_the_stop_gives_up(self):
        """The stall ends after the requests waiting for the store were
        answered and before the process stops: the writes land late, the
        writer stops, and the answers already sent stand."""
        self.sigterm_during_stall(0.3 + DRAIN_S + 1.5)

    def test_stall_that_does_not_end(self):
        self.sigterm_during_stall(None)

    def test_nothing_in_flight_interval_sync_stalled(self):
        """durability "interval": the writer's periodic sync is the stalled
        flush, and nothing is in flight. The stop used to wait for it."""
        proxy = self.start_drain_proxy(store={"durability": "interval",
                                             "sync_interval": "200ms"})
        self.assertExecuted(self.post(proxy, "stall-before"))
        self.stall()
        self.addCleanup(self.unstall)
        time.sleep(0.6)  # the next periodic sync waits for the disk
        t0 = time.monotonic()
        proxy.terminate()
        rc, exit_s = self.wait_exit(proxy, t0)
        still_stalled = os.path.exists(self.stall_file)
        self.unstall()
        chaoslib.figure(TEST + "_interval_idle", drain_s=DRAIN_S, exit_s=round(exit_s, 2),
                        status=rc)
        self.assertLess(exit_s, EXIT_BOUND_S)
        self.assertStallHeld(proxy, rc, still_stalled)
        check = chaoslib.check_store(self.store_path)
        self.assertTrue(check.ok, check)


if __name__ == "__main__":
    unittest.main()
