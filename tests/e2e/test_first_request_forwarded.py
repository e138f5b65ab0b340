#!/usr/bin/env python3
"""A first request with a key is forwarded once; the upstream's status,
headers (Set-Cookie included) and body reach the client unchanged, and the
record is completed (CONTRACT.md section 3, first row)."""

import hashlib
import unittest

import harness


class FirstRequestForwarded(harness.ProxyTestCase):
    def test_upstream_answer_reaches_client(self):
        proxy = self.start_proxy()
        r = self.post(proxy, "first-1", headers=[("X-Tenant-Id", "acme")])
        self.assertExecuted(r)
        self.assertEqual(r.header("Content-Type"), "application/json")
        self.assertEqual(r.header("X-Upstream"), "demo")
        # The first response passes the upstream's headers; strip_headers only
        # applies to what is stored and replayed.
        self.assertEqual(r.header_all("Set-Cookie"), ["session=abc; Path=/"])
        self.assertFalse(r.has("Idempotent-Replayed"), r)
        doc = r.json()
        self.assertEqual(doc["id"], r.charge_id)
        self.assertEqual(doc["method"], "POST")
        self.assertEqual(doc["path"], "/v1/payments")
        self.assertEqual(doc["idempotency_key"], "first-1")
        self.assertEqual(doc["body_sha256"], hashlib.sha256(harness.PAYMENT_BODY).hexdigest())
        self.assertEqual(self.upstream.count("first-1"), 1)
        self.assertEqual(self.upstream.total(), 1)

    def test_non_2xx_below_500_is_passed_and_completed(self):
        proxy = self.start_proxy()
        for status in (200, 202, 400, 402, 404, 409, 422):
            key = "status-%d" % status
            r = self.post(proxy, key, headers=[("X-Test-Status", str(status))])
            self.assertEqual(r.status, status, r)
            self.assertFalse(r.replayed)
            again = self.post(proxy, key)
            self.assertReplayOf(again, r)
            self.assertEqual(self.upstream.count(key), 1, key)

    def test_204_without_body_is_completed(self):
        proxy = self.start_proxy()
        r = self.post(proxy, "no-content", headers=[("X-Test-Status", "204")])
        self.assertEqual(r.status, 204, r)
        again = self.post(proxy, "no-content")
        self.assertEqual(again.status, 204, again)
        self.assertTrue(again.replayed, again)
        self.assertEqual(again.charge_id, r.charge_id)
        self.assertEqual(self.upstream.count("no-content"), 1)

    def test_large_response_body_forwarded_intact(self):
        proxy = self.start_proxy()
        size = 300 * 1024
        r = self.post(proxy, "big-answer", headers=[("X-Test-Fault", "huge"),
                                                     ("X-Test-Size", str(size))])
        self.assertEqual(r.status, 201, r)
        self.assertEqual(r.body, harness.huge_body(size))
        again = self.post(proxy, "big-answer")
        self.assertTrue(again.replayed, again)
        self.assertEqual(again.body, r.body)

    def test_keep_alive_connection_serves_several_requests(self):
        proxy = self.start_proxy()
        with proxy.conn() as c:
            h = [("Content-Type", "application/json"), ("Idempotency-Key", "ka-1")]
            r1 = c.request("POST", "/v1/payments", h, harness.PAYMENT_BODY)
            r2 = c.request("POST", "/v1/payments", h, harness.PAYMENT_BODY)
            r3 = c.request("POST", "/v1/payments",
                           [("Content-Type", "application/json"), ("Idempotency-Key", "ka-2")],
                           harness.PAYMENT_BODY)
        self.assertExecuted(r1)
        self.assertReplayOf(r2, r1)
        self.assertExecuted(r3)
        self.assertNotEqual(r1.charge_id, r3.charge_id)
        self.assertEqual(self.upstream.total(), 2)

    def test_path_and_query_reach_upstream_under_its_base_path(self):
        proxy = self.start_proxy(config=self.config(upstream_url=self.upstream.url + "/api"))
        r = self.post(proxy, "base-1", path="/v1/payments?expand=customer&x=%20y")
        self.assertExecuted(r)
        self.assertEqual(r.json()["path"], "/api/v1/payments?expand=customer&x=%20y")

    def test_chunked_request_body_forwarded(self):
        proxy = self.start_proxy()
        body = b'{"amount":1000,"currency":"eur","note":"' + b"x" * 5000 + b'"}'
        r = self.post(proxy, "chunked-1", body=body, chunked=True)
        self.assertExecuted(r)
        self.assertEqual(r.json()["body_sha256"], hashlib.sha256(body).hexdigest())
        # The same body sent with Content-Length is the same request.
        again = self.post(proxy, "chunked-1", body=body)
        self.assertReplayOf(again, r)
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
