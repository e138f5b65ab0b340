#!/usr/bin/env python3
"""A body over the route's max_body is 413, whether announced by Content-Length
or sent chunked; nothing is forwarded and nothing is stored (the key stays
unused)."""

import threading
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

    def test_chunked_body_far_over_limit_still_answered(self):
        # Far past the limit (here 4 MiB against 1 KiB) the proxy stops
        # reading the body; the client must still read the 413, not a
        # reset, while it is still sending.
        proxy = self.start_proxy(max_body="1KiB")
        part = b"%x\r\n%s\r\n" % (65536, b"y" * 65536)
        head = harness.build_request("POST", "/v1/payments", [
            ("Host", "x"), ("Idempotency-Key", "far-over"), ("Content-Type", "text/plain"),
            ("Transfer-Encoding", "chunked")], add_length=False)
        c = proxy.conn(timeout=10)
        self.addCleanup(c.close)

        def send():
            try:
                c.sock.sendall(head + part * 64 + b"0\r\n\r\n")
            except OSError:
                pass  # the proxy may close once it has answered

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        r = c.read_response()
        doc = self.assertProblem(r, 413)
        self.assertEqual(doc["type"], "urn:idemproxy:problem:body-too-large", r)
        self.assertEqual((r.header("Connection") or "").lower(), "close", r)
        sender.join(15)
        closed, _ = c.drain_until_closed(10)
        self.assertTrue(closed, "connection left open after the 413")
        self.assertEqual(self.upstream.total(), 0)
        # Nothing stored: the key still runs with an acceptable body.
        self.assertExecuted(self.post(proxy, "far-over", body=b"y" * 100,
                                      content_type="text/plain", chunked=True))

    def test_uncovered_large_content_length_rejected_before_body_arrives(self):
        # A request no route covers is bounded too, and its Content-Length
        # is checked from the headers like a covered one: 1 GiB announced,
        # nothing sent, the 413 comes at once.
        proxy = self.start_proxy(max_body="1KiB")
        with proxy.conn(timeout=5) as c:
            c.send(harness.build_request("POST", "/v1/uploads", [
                ("Host", "x"), ("Content-Type", "text/plain"),
                ("Content-Length", str(1 << 30))]))
            r = c.read_response()
            self.assertTrue(c.is_closed(5), "connection left open after the 413")
        self.assertProblem(r, 413)
        self.assertIn("no route covers", r.json()["detail"])
        self.assertEqual((r.header("Connection") or "").lower(), "close", r)
        self.assertEqual(self.upstream.total(), 0)

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
