#!/usr/bin/env python3
"""Only origin-form request targets of visible ASCII are forwarded: the
target is appended to the upstream URL as sent, so an absolute-form target
(a client using the proxy as a forward proxy) or one holding a space would
make a different URL. Such requests get 400, the connection is closed and
nothing reaches the upstream; an ordinary path with a query still passes.

CONNECT asks for a tunnel, which a reverse proxy does not make: it gets 501
problem+json with the connection closed, even on a route that lists it, and
nothing is forwarded or stored. Forwarded, the upstream's answer came back
without framing on a connection left open."""

import unittest

import harness


def raw(line):
    return (line + "\r\nHost: proxy.test\r\nIdempotency-Key: t-1\r\nContent-Length: 2\r\n\r\n{}").encode(
        "latin-1")


class RequestTarget(harness.ProxyTestCase):
    def test_non_origin_form_targets_rejected(self):
        proxy = self.start_proxy()
        for line in ("POST http://evil.test/v1/payments HTTP/1.1",
                     "POST /v1/pay ments HTTP/1.1",
                     "OPTIONS * HTTP/1.1"):
            with self.subTest(line=line):
                resp, closed, _extra = harness.raw_exchange(proxy.port, raw(line))
                self.assertIsNotNone(resp, "no answer")
                self.assertEqual(resp.status, 400, resp)
                self.assertProblem(resp, 400)
                self.assertTrue(closed, "connection left open")
        self.assertEqual(self.upstream.total(), 0)

    def test_connect_refused_nothing_forwarded_or_stored(self):
        # A route cannot cover CONNECT (refused at start since babfcb7,
        # tests/config/invalid/methods_connect); it is refused whatever the
        # routes say.
        proxy = self.start_proxy(methods=["POST"])
        for line in ("CONNECT /v1/payments HTTP/1.1", "CONNECT /elsewhere HTTP/1.1",
                     "CONNECT proxy.test:443 HTTP/1.1"):
            with self.subTest(line=line):
                resp, closed, extra = harness.raw_exchange(proxy.port, raw(line))
                self.assertIsNotNone(resp, "no answer")
                self.assertProblem(resp, 501)
                self.assertTrue(resp.has("Content-Length"), "unframed answer: %r" % resp)
                self.assertTrue(closed, "connection left open")
                self.assertEqual(extra, b"", "bytes after the answer")
        self.assertEqual(self.upstream.total(), 0)
        # Nothing was stored under the key: the POST runs, neither a replay
        # nor a 422 for a different fingerprint.
        resp = self.post(proxy, key="t-1", body=b"{}")
        self.assertExecuted(resp)
        self.assertEqual(self.upstream.total(), 1)

    def test_path_with_query_is_forwarded_as_sent(self):
        proxy = self.start_proxy()
        resp, _closed, _extra = harness.raw_exchange(proxy.port,
                                                     raw("POST /v1/payments?x=%41&y=1 HTTP/1.1"))
        self.assertEqual(resp.status, 201, resp)
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
