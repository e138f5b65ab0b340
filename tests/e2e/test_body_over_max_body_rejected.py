#!/usr/bin/env python3
"""A body over the route's max_body is 413, whether announced by Content-Length
or sent chunked; nothing is forwarded and nothing is stored (the key stays
unused)."""

import unittest

import harness


class BodyOverMaxBody(harness.ProxyTestCase):
    def test_content_length_over_limit(self):
        proxy = self.start_proxy(max_body="1KiB")
        r = self.post(proxy, "big-cl", body=b"x" * 1025, content_type="text/plain")
        self.assertProblem(r, 413)
        self.assertEqual(self.upstream.total(), 0)
        # Nothing stored: the same key with an acceptable body executes
        # (a stored record would have made this a 422).
        self.assertExecuted(self.post(proxy, "big-cl", body=b"x" * 1024, content_type="text/plain"))
        self.assertEqual(self.upstream.total(), 1)

    def test_chunked_over_limit(self):
        proxy = self.start_proxy(max_body="1KiB")
        r = self.post(proxy, "big-chunked", body=b"y" * 3000, content_type="text/plain",
                      chunked=True)
        self.assertProblem(r, 413)
        self.assertEqual(self.upstream.total(), 0)
        self.assertExecuted(self.post(proxy, "big-chunked", body=b"y" * 1000,
                                      content_type="text/plain", chunked=True))
        self.assertEqual(self.upstream.total(), 1)

    def test_large_content_length_rejected_before_body_arrives(self):
        # 1 GiB announced, nothing sent: the 413 must not wait for the body.
        proxy = self.start_proxy(max_body="1KiB")
        with proxy.conn(timeout=5) as c:
            c.send(harness.build_request("POST", "/v1/payments", [
                ("Host", "x"), ("Idempotency-Key", "huge-cl"), ("Content-Type", "text/plain"),
                ("Content-Length", str(1 << 30))]))
            r = c.read_response()
        self.assertProblem(r, 413)
        self.assertEqual(self.upstream.total(), 0)

    def test_uncovered_request_bounded_by_largest_max_body(self):
        # The proxy buffers every body, so a request no route covers is
        # bounded too: by the largest max_body of any route, and the 413
        # says which limit it hit.
        proxy = self.start_proxy(max_body="1KiB")
        r = self.post(proxy, None, body=b"u" * 2048, content_type="text/plain",
                      path="/v1/uploads")
        self.assertProblem(r, 413)
        self.assertIn("no route covers", r.json()["detail"])
        self.assertEqual(self.upstream.total(), 0)
        ok = self.post(proxy, None, body=b"u" * 1024, content_type="text/plain",
                       path="/v1/uploads")
        self.assertEqual(ok.status, 201, ok)
        self.assertEqual(self.upstream.total(), 1)

    def test_default_max_body_is_1mib(self):
        proxy = self.start_proxy()
        self.assertProblem(self.post(proxy, "mib-over", body=b"z" * (1024 * 1024 + 1),
                                     content_type="text/plain"), 413)
        self.assertEqual(self.upstream.total(), 0)
        self.assertExecuted(self.post(proxy, "mib-ok", body=b"z" * (1024 * 1024),
                                      content_type="text/plain"))
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
