#!/usr/bin/env python3
"""A request that is not covered (no route matches its path, or its method is
not in the route's methods) is forwarded unchanged and nothing is stored, even
with an Idempotency-Key; require_key does not apply to it."""

import hashlib
import unittest

import harness


class NotCoveredPassthrough(harness.ProxyTestCase):
    def twice(self, proxy, **kw):
        r1 = self.post(proxy, **kw)
        r2 = self.post(proxy, **kw)
        for r in (r1, r2):
            self.assertExecuted(r)
            self.assertFalse(r.has("Idempotent-Replayed"), r)
        self.assertNotEqual(r1.charge_id, r2.charge_id)
        return r1, r2

    def test_method_not_in_route_methods(self):
        proxy = self.start_proxy(require_key=True)
        self.twice(proxy, key="get-key", method="GET", body=b"", content_type=None)
        self.twice(proxy, key="put-key", method="PUT")
        self.twice(proxy, key=None, method="DELETE", body=b"", content_type=None)
        self.assertEqual(self.upstream.count("get-key"), 2)
        self.assertEqual(self.upstream.count("put-key"), 2)
        self.assertEqual(self.upstream.total(), 6)

    def test_bodiless_answers_keep_the_upstream_content_length(self):
        # To HEAD, and in a 304, Content-Length is the size a GET would get
        # (RFC 9110 8.6, 9.3.2). The proxy wrote 0 instead; and nothing may
        # follow the header block on the kept-alive connection.
        proxy = self.start_proxy()
        with proxy.conn() as c:
            for method, status in (("HEAD", None), ("GET", "304")):
                h = [("Host", "x")] + ([("X-Test-Status", status)] if status else [])
                r = c.request(method, "/v1/other", h)
                self.assertEqual(r.status, int(status or 201), r)
                self.assertEqual(r.body, b"", r)
                self.assertEqual(len(r.header_all("Content-Length")), 1, r)
                self.assertGreater(int(r.header("Content-Length")), 100, r)
            after = c.request("GET", "/v1/other", [("Host", "x")])
            self.assertEqual(after.status, 201, after)
            self.assertEqual(len(after.body), int(after.header("Content-Length")), after)
        self.assertEqual(self.upstream.total(), 3)

    def test_unmatched_path(self):
        proxy = self.start_proxy(require_key=True)
        r1, _ = self.twice(proxy, key="other-key", path="/v2/refunds")
        # Forwarded unchanged: upstream headers including Set-Cookie, the body
        # as sent, the path as sent.
        self.assertEqual(r1.header_all("Set-Cookie"), ["session=abc; Path=/"])
        doc = r1.json()
        self.assertEqual(doc["path"], "/v2/refunds")
        self.assertEqual(doc["body_sha256"], hashlib.sha256(harness.PAYMENT_BODY).hexdigest())
        self.assertEqual(self.upstream.count("other-key"), 2)

    def test_prefix_matches_on_segment_boundary(self):
        proxy = self.start_proxy()
        self.twice(proxy, key="boundary", path="/v1/paymentsx")
        self.assertEqual(self.upstream.count("boundary"), 2)
        # Below the prefix is covered.
        first = self.post(proxy, "below", path="/v1/payments/abc/capture")
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "below", path="/v1/payments/abc/capture"), first)
        self.assertEqual(self.upstream.count("below"), 1)

    def test_exact_match(self):
        proxy = self.start_proxy(match="exact")
        first = self.post(proxy, "exact", path="/v1/payments")
        self.assertReplayOf(self.post(proxy, "exact", path="/v1/payments"), first)
        self.twice(proxy, key="exact-below", path="/v1/payments/sub")
        self.assertEqual(self.upstream.total(), 3)

    def test_invalid_key_on_uncovered_request_is_forwarded(self):
        # Not covered means forwarded unchanged: the key is not even looked at.
        proxy = self.start_proxy()
        r = self.post(proxy, "", path="/v2/elsewhere")
        self.assertExecuted(r)
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
