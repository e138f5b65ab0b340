#!/usr/bin/env python3
"""Well-formed client HTTP variants work like any request: Expect:
100-continue (the body follows the interim answer), pipelined requests on one
connection (answered in order; the second is the first's duplicate) and
HTTP/1.0."""

import hashlib
import unittest

import harness


class ClientHttpVariants(harness.ProxyTestCase):
    def test_expect_100_continue(self):
        proxy = self.start_proxy()
        body = b'{"pad":"' + b"x" * 500000 + b'"}'
        with proxy.conn() as c:
            c.send(harness.build_request("POST", "/v1/payments", [
                ("Host", "x"), ("Content-Type", "application/json"), ("Idempotency-Key", "expect-1"),
                ("Expect", "100-continue"), ("Content-Length", str(len(body)))]))
            interim = c._until(b"\r\n\r\n")
            self.assertTrue(interim.startswith(b"HTTP/1.1 100"), interim)
            c.send(body)
            r = c.read_response()
        self.assertExecuted(r)
        self.assertEqual(r.json()["body_sha256"], hashlib.sha256(body).hexdigest())
        self.assertReplayOf(self.post(proxy, "expect-1", body=body), r)
        self.assertEqual(self.upstream.total(), 1)

    def test_pipelined_duplicate_is_answered_in_order(self):
        proxy = self.start_proxy()
        h = [("Host", "x"), ("Content-Type", "application/json"), ("Idempotency-Key", "pipe-1")]
        with proxy.conn() as c:
            c.send(harness.build_request("POST", "/v1/payments", h + [("X-Test-Delay-Ms", "300")], b"{}") +
                   harness.build_request("POST", "/v1/payments", h, b"{}") +
                   harness.build_request("POST", "/v1/payments",
                                         [("Host", "x"), ("Idempotency-Key", "pipe-2")], b"{}"))
            first, second, third = c.read_response(), c.read_response(), c.read_response()
        self.assertExecuted(first)
        self.assertReplayOf(second, first)
        self.assertExecuted(third)
        self.assertNotEqual(third.charge_id, first.charge_id)
        self.assertEqual(self.upstream.total(), 2)

    def test_http_1_0(self):
        proxy = self.start_proxy()
        h = [("Idempotency-Key", "h10"), ("Content-Type", "application/json")]
        first = harness.request(proxy.port, "POST", "/v1/payments", h, b"{}", version="HTTP/1.0")
        self.assertExecuted(first)
        again = harness.request(proxy.port, "POST", "/v1/payments", h, b"{}", version="HTTP/1.0")
        self.assertReplayOf(again, first)
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
