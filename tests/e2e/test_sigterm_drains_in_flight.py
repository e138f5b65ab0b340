#!/usr/bin/env python3
"""SIGTERM: the proxy stops accepting, lets the requests in flight finish
(completing their records, waiters getting the holder's answer), and exits 0; with an action that never ends it still
exits 0 once server.drain_timeout is over."""

import socket
import time
import unittest

import harness
from harness import in_thread


class SigtermDrains(harness.ProxyTestCase):
    def test_in_flight_request_finishes_and_completes(self):
        cfg = self.config(server={"drain_timeout": "10s"})
        proxy = self.start_proxy(config=cfg, name="old")
        flight = in_thread(self.post, proxy, "drain-1", headers=[("X-Test-Delay-Ms", "1500")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("drain-1") == 1, 3))
        proxy.terminate_draining()
        time.sleep(0.3)

        # Stopped accepting: a new request is refused, dropped or answered
        # without reaching the upstream.
        try:
            r = self.post(proxy, "drain-new", timeout=5)
            self.assertNotEqual(r.status // 100, 2, r)
        except (OSError, harness.ConnectionClosed, socket.timeout):
            pass

        r = flight.result(10)
        self.assertExecuted(r)
        rc = proxy.wait_exit(5)
        self.assertEqual(rc, 0, "exit status after the drain: %r; %s" % (rc, proxy.stderr()))
        self.assertEqual(self.upstream.count("drain-new"), 0)

        # The record was completed before exit.
        new = self.start_proxy(config=cfg, name="new")
        self.assertReplayOf(self.post(new, "drain-1"), r)
        self.assertEqual(self.upstream.count("drain-1"), 1)

    def test_waiting_duplicate_finishes_during_drain(self):
        # A duplicate waiting on the holder is in flight too: it gets the
        # holder's answer, not a shutdown error.
        proxy = self.start_proxy(config=self.config(routes=[self.route(wait="5s")],
                                                    server={"drain_timeout": "10s"}))
        holder = in_thread(self.post, proxy, "drain-wait", headers=[("X-Test-Delay-Ms", "1500")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("drain-wait") == 1, 3))
        waiter = in_thread(self.post, proxy, "drain-wait")
        time.sleep(0.3)
        proxy.terminate()
        first = holder.result(10)
        self.assertExecuted(first)
        self.assertReplayOf(waiter.result(10), first)
        self.assertEqual(proxy.wait_exit(10), 0, proxy.stderr())
        self.assertEqual(self.upstream.count("drain-wait"), 1)

    def test_drain_is_bounded(self):
        cfg = self.config(server={"drain_timeout": "1s"}, timeout="60s")
        proxy = self.start_proxy(config=cfg)
        stuck = in_thread(self.post, proxy, "drain-stuck", headers=[("X-Test-Fault", "hang")],
                          timeout=30)
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("drain-stuck") == 1, 3))
        t0 = time.monotonic()
        proxy.terminate()
        rc = proxy.wait_exit(10)
        elapsed = time.monotonic() - t0
        self.assertEqual(rc, 0, proxy.stderr())
        self.assertLess(elapsed, 5.0, "drain_timeout 1s not honoured")
        # The client is told the proxy's stop cut it, not the upstream's
        # slowness (the upstream timeout is 60 s).
        r = stuck.result(10)
        self.assertProblem(r, 504)
        self.assertTrue(r.json()["type"].endswith(":drain-timeout"), r)
        self.assertIn("drain_timeout", r.json()["detail"])

    def test_pass_through_completed_after_the_deadline_is_not_forwarded(self):
        """A client still sending its body at the drain's deadline finishes
        it in the grace second before the stop: forwarding it then would run
        an action whose answer the stop cuts. It gets 503 shutting-down,
        nothing forwarded, and its access-log line is written."""
        cfg = self.config(server={"drain_timeout": "1s"})
        proxy = self.start_proxy(config=cfg)
        body = b'{"amount":1}'
        head = ("POST /v1/other HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: %d\r\n\r\n" % len(body)).encode()
        s = socket.create_connection(("127.0.0.1", proxy.port))
        self.addCleanup(s.close)
        s.sendall(head + body[:3])
        time.sleep(0.3)
        proxy.terminate_draining()
        time.sleep(1.3)  # past drain_timeout, inside the grace
        s.sendall(body[3:])
        s.settimeout(8)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        self.assertEqual(proxy.wait_exit(10), 0, proxy.stderr())
        self.assertTrue(data.startswith(b"HTTP/1.1 503"), data[:200])
        self.assertIn(b"shutting-down", data)
        self.assertEqual(self.upstream.total(), 0)
        self.assertIn((503, "/v1/other"), [(e["status"], e["path"]) for e in proxy.access_log()])

    def test_a_request_the_stop_cuts_is_logged(self):
        """A client that never finishes its body is closed by the stop, and
        its access-log line is still written."""
        cfg = self.config(server={"drain_timeout": "500ms"})
        proxy = self.start_proxy(config=cfg)
        s = socket.create_connection(("127.0.0.1", proxy.port))
        self.addCleanup(s.close)
        s.sendall(b"POST /v1/other HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        time.sleep(0.3)
        proxy.terminate()
        self.assertEqual(proxy.wait_exit(10), 0, proxy.stderr())
        self.assertIn("/v1/other", [e["path"] for e in proxy.access_log()])

    def test_sigint_also_exits_0(self):
        proxy = self.start_proxy()
        self.assertExecuted(self.post(proxy, "int-1"))
        proxy.stop_called = True
        proxy.proc.send_signal(harness.signal.SIGINT)
        self.assertEqual(proxy.proc.wait(10), 0, proxy.stderr())


if __name__ == "__main__":
    unittest.main()
