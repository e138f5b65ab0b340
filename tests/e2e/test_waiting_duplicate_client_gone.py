#!/usr/bin/env python3
"""A duplicate that waits for an IN_PROGRESS holder and whose client then
closes its connection is dropped within about a second (README, limits):
libmicrohttpd does not read a suspended connection, so before, the proxy
kept such a waiter for the route's whole `wait`, holding its connection
slot and per-IP count, and when the holder released the key, the waiter
acquired it and ran the action for a client that was gone."""

import socket
import time
import unittest

import harness
from harness import in_thread


def leave_waiting(port, key, n):
    """n duplicates of key sent on their own connections, then closed."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(harness.build_request(
            "POST", "/v1/payments",
            [("Content-Type", "application/json"), ("Idempotency-Key", key)],
            harness.PAYMENT_BODY, host="127.0.0.1:%d" % port))
        socks.append(s)
    time.sleep(1.0)  # they are waiting now (parsed, even on a loaded machine)
    for s in socks:
        s.close()


class WaitingDuplicateClientGone(harness.ProxyTestCase):
    def test_gone_waiters_free_their_connections(self):
        cfg = self.config(routes=[self.route(wait="20s")],
                          server={"per_ip_connections": 14})
        proxy = self.start_proxy(config=cfg)
        first = in_thread(self.post, proxy, "gone-1", headers=[("X-Test-Delay-Ms", "8000")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        time.sleep(0.2)
        before = harness.sockets(proxy.pid)
        leave_waiting(proxy.port, "gone-1", 12)
        # The sweep runs once a second; before the fix they stayed 20 s.
        self.assertTrue(harness.wait_for(lambda: harness.sockets(proxy.pid) <= before, timeout=4),
                        "%d sockets open, %d before" % (harness.sockets(proxy.pid), before))
        # Their per-IP counts are back too: 12 new connections fit next to
        # the holder's under a limit of 14.
        conns = [harness.Conn(proxy.port) for _ in range(12)]
        try:
            for i, c in enumerate(conns):
                r = c.request("POST", "/v1/payments", [("Idempotency-Key", "other-%d" % i)],
                              b"{}")
                self.assertEqual(r.status, 201, r)
        finally:
            for c in conns:
                c.close()
        self.assertExecuted(first.result(15))
        self.assertEqual(self.upstream.count("gone-1"), 1)
        aborted = [l for l in proxy.access_log() if l.get("outcome") == "aborted"]
        self.assertEqual(len(aborted), 12, proxy.access_log())
        # Dropping them is not an error of the proxy's.
        self.assertNotIn("internal error", proxy.stderr())

    def test_gone_waiter_does_not_run_when_holder_releases(self):
        proxy = self.start_proxy(wait="10s")
        first = in_thread(self.post, proxy, "gone-2",
                          headers=[("X-Test-Delay-Ms", "4000"), ("X-Test-Status", "500")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        leave_waiting(proxy.port, "gone-2", 3)
        self.assertEqual(first.result(10).status, 500)
        time.sleep(1.5)
        # Before: one of the waiters acquired the released key and ran the
        # action with nobody left to receive its answer.
        self.assertEqual(self.upstream.count("gone-2"), 1)
        retry = self.post(proxy, "gone-2")
        self.assertExecuted(retry)
        self.assertEqual(self.upstream.count("gone-2"), 2)

    def test_waiter_still_connected_is_kept(self):
        proxy = self.start_proxy(wait="10s")
        first = in_thread(self.post, proxy, "kept-1", headers=[("X-Test-Delay-Ms", "2500")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        dup = self.post(proxy, "kept-1")
        self.assertReplayOf(dup, first.result(10))
        self.assertEqual(self.upstream.count("kept-1"), 1)


if __name__ == "__main__":
    unittest.main()
