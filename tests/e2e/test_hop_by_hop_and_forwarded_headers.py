#!/usr/bin/env python3
"""Forwarding: hop-by-hop headers (Connection and every header it names,
Keep-Alive, Proxy-*, TE, Trailer, Transfer-Encoding, Upgrade) are dropped both
ways; X-Forwarded-For, X-Forwarded-Proto and X-Forwarded-Host are added; the
Idempotency-Key and every end-to-end header reach the upstream."""

import hashlib
import unittest

import harness


def names(pairs):
    return [n.lower() for (n, _) in pairs]


def values(pairs, name):
    return [v for (n, v) in pairs if n.lower() == name.lower()]


class HopByHop(harness.ProxyTestCase):
    def echo(self, proxy, key, extra, **kw):
        r = self.post(proxy, key, headers=[("X-Test-Fault", "echo-headers")] + extra, **kw)
        self.assertEqual(r.status, 201, r)
        return r, r.json()

    def test_request_hop_by_hop_dropped_and_forwarded_added(self):
        proxy = self.start_proxy()
        hop = [
            ("Connection", "keep-alive, X-Conn-Named, x-other-named"),
            ("X-Conn-Named", "must-not-pass"),
            ("X-Other-Named", "must-not-pass"),
            ("Keep-Alive", "timeout=30"),
            ("Proxy-Authorization", "Basic Zm9vOmJhcg=="),
            ("Proxy-Connection", "keep-alive"),
            ("TE", "trailers"),
            ("Trailer", "X-Trailer"),
            ("Upgrade", "websocket"),
            ("X-End-To-End", "kept"),
            ("Authorization", "Bearer token-1"),
        ]
        r, seen = self.echo(proxy, "hop-req", hop)
        got = names(seen)
        for name in ("connection", "x-conn-named", "x-other-named", "keep-alive",
                     "proxy-authorization", "proxy-connection", "te", "trailer", "upgrade"):
            self.assertNotIn(name, got, "%s forwarded to the upstream: %r" % (name, seen))
        self.assertEqual(values(seen, "X-End-To-End"), ["kept"])
        self.assertEqual(values(seen, "Authorization"), ["Bearer token-1"])
        self.assertEqual(values(seen, "Content-Type"), ["application/json"])
        self.assertEqual(values(seen, "Idempotency-Key"), ["hop-req"])
        self.assertEqual(values(seen, "X-Forwarded-For"), ["127.0.0.1"])
        self.assertEqual(values(seen, "X-Forwarded-Proto"), ["http"])
        self.assertEqual(values(seen, "X-Forwarded-Host"), ["127.0.0.1:%d" % proxy.port])

    def test_forwarded_for_is_each_connections_own_client(self):
        # The address is made into text once per connection: every request
        # on a kept-alive connection carries its client's, whatever other
        # connections of the same worker came from.
        proxy = self.start_proxy(config=self.config(server={"workers": 1}))
        conns = {src: harness.Conn(proxy.port, source=src)
                 for src in ("127.0.0.2", "127.0.0.3")}
        try:
            for i in range(3):
                for src, c in conns.items():
                    key = "xff-%s-%d" % (src, i)
                    r = c.request("POST", "/v1/payments", [
                        ("Content-Type", "application/json"), ("Idempotency-Key", key),
                        ("X-Test-Fault", "echo-headers")], harness.PAYMENT_BODY)
                    self.assertEqual(r.status, 201, r)
                    self.assertEqual(values(r.json(), "X-Forwarded-For"), [src], key)
        finally:
            for c in conns.values():
                c.close()

    def test_forwarded_host_is_the_client_host(self):
        proxy = self.start_proxy()
        _, seen = self.echo(proxy, "hop-host", [("Host", "api.example.com")])
        self.assertEqual(values(seen, "X-Forwarded-Host"), ["api.example.com"])

    def test_chunked_request_is_reframed(self):
        proxy = self.start_proxy()
        body = b'{"amount":1,"pad":"' + b"p" * 3000 + b'"}'
        r = self.post(proxy, "hop-chunked", body=body, chunked=True)
        self.assertExecuted(r)
        self.assertEqual(r.json()["body_sha256"], hashlib.sha256(body).hexdigest())
        _, seen = self.echo(proxy, "hop-chunked-echo", [], body=body, chunked=True)
        te = [v.lower() for v in values(seen, "Transfer-Encoding")]
        # Either re-chunked by the proxy or sent with a Content-Length, never both.
        self.assertFalse(te and values(seen, "Content-Length"), seen)

    def test_passthrough_also_drops_hop_by_hop(self):
        proxy = self.start_proxy()
        r = proxy.request("GET", "/v1/other", [
            ("X-Test-Fault", "echo-headers"), ("Connection", "X-Named"), ("X-Named", "no"),
            ("Keep-Alive", "timeout=1"), ("Proxy-Authorization", "Basic eA==")])
        self.assertEqual(r.status, 201, r)
        got = names(r.json())
        for name in ("x-named", "keep-alive", "proxy-authorization"):
            self.assertNotIn(name, got)
        self.assertIn("x-forwarded-for", got)

    def test_response_hop_by_hop_dropped_first_and_replay(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "hop-resp", headers=[("X-Test-Fault", "hop")])
        self.assertEqual(first.status, 201, first)
        self.assertEqual(first.json()["idempotency_key"], "hop-resp")  # body intact
        again = self.post(proxy, "hop-resp")
        self.assertTrue(again.replayed, again)
        self.assertEqual(again.body, first.body)
        for resp, label in ((first, "first response"), (again, "replay")):
            for name in ("X-Hop", "Keep-Alive", "Proxy-Authenticate", "Proxy-Connection",
                         "Trailer", "Upgrade"):
                self.assertFalse(resp.has(name), "%s in the %s: %r" % (name, label, resp))
            for v in resp.header_all("Connection"):
                self.assertNotIn("x-hop", v.lower(), "upstream Connection passed on: %r" % resp)
            self.assertEqual(resp.header("X-Upstream"), "demo")
        self.assertEqual(self.upstream.count("hop-resp"), 1)

    def test_response_trailers_are_not_merged_into_headers(self):
        # libcurl hands trailer fields to the header callback; merged into
        # the header section (RFC 9110 6.5.1 forbids it) they added a second
        # Content-Type and a cookie, removed X-Request-Id (a trailer
        # "Connection: X-Request-Id") and turned a valid answer into a 502
        # (a trailer Content-Length) whose retry ran the action again.
        proxy = self.start_proxy()
        first = self.post(proxy, "trailers", headers=[("X-Test-Fault", "trailers")])
        self.assertEqual(first.status, 201, first)
        again = self.post(proxy, "trailers")
        self.assertReplayOf(again, first)
        for r in (first, again):
            self.assertEqual(r.header_all("Content-Type"), ["application/json"], r)
            self.assertEqual(r.header_all("X-Request-Id"), ["r-1"], r)
            self.assertNotIn("trailer=1", " ".join(r.header_all("Set-Cookie")), r)
            self.assertFalse(r.has("X-Checksum"), r)
            self.assertEqual(r.json()["idempotency_key"], "trailers")
        self.assertEqual(self.upstream.count("trailers"), 1)

    def test_response_field_lines_are_repaired_not_lost(self):
        # RFC 9112 5.1 and 5.2: a proxy removes white space before the colon
        # and replaces an obs-fold with a space; an empty value is a value.
        # They used to be dropped (or, for the fold, cut short).
        proxy = self.start_proxy()
        first = self.post(proxy, "odd-fields", headers=[("X-Test-Fault", "odd-fields")])
        self.assertEqual(first.status, 201, first)
        again = self.post(proxy, "odd-fields")
        self.assertReplayOf(again, first)
        for r in (first, again):
            self.assertEqual(r.header_all("X-Folded"), ["first-part second-part"], r)
            self.assertEqual(r.header_all("X-Empty"), [""], r)
            self.assertEqual(r.header_all("X-Space"), ["spaced"], r)
        self.assertEqual(self.upstream.count("odd-fields"), 1)


if __name__ == "__main__":
    unittest.main()
