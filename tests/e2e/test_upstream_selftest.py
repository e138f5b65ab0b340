#!/usr/bin/env python3
"""The test upstream itself does what the scenarios rely on (no proxy here):
executions are counted per key, faults do what they say, and the HTTP/1.1
server handles keep-alive, chunked bodies, 100-continue and many clients."""

import hashlib
import json
import socket
import time
import unittest

import harness
from harness import Conn, ConnectionClosed, request


class UpstreamSelfTest(harness.ProxyTestCase):
    def up(self, method="POST", path="/v1/payments", headers=(), body=b"", **kw):
        return request(self.upstream.port, method, path, headers, body, **kw)

    def test_execution_answer_and_counts(self):
        r = self.up(headers=[("Idempotency-Key", "k1"), ("X-Tenant-Id", "t1"),
                             ("X-Test-Holder", "h1")], body=b'{"a":1}')
        self.assertEqual(r.status, 201)
        self.assertEqual(r.header("Content-Type"), "application/json")
        self.assertEqual(r.header("X-Charge-Id"), "ch_1")
        self.assertTrue(r.header("Set-Cookie").startswith("session=abc"))
        self.assertEqual(r.header("X-Upstream"), "demo")
        doc = r.json()
        self.assertEqual(doc, {"id": "ch_1", "method": "POST", "path": "/v1/payments",
                               "idempotency_key": "k1", "tenant": "t1",
                               "body_sha256": hashlib.sha256(b'{"a":1}').hexdigest()})
        self.up(method="GET", path="/anything?x=1")
        self.assertEqual(self.upstream.executions(), {"total": 2, "by_key": {"k1": 1}})
        self.assertEqual(self.upstream.count("k1"), 1)
        self.assertEqual(self.upstream.count("nope"), 0)
        entries = self.upstream.entries()
        self.assertEqual([e["charge_id"] for e in entries], ["ch_1", "ch_2"])
        self.assertEqual(entries[0]["holder"], "h1")
        with open(self.upstream.log_path) as f:
            logged = [json.loads(line) for line in f]
        self.assertEqual([e["key"] for e in logged], ["k1", None])
        self.upstream.reset()
        self.assertEqual(self.upstream.executions(), {"total": 0, "by_key": {}})
        self.assertEqual(self.up().header("X-Charge-Id"), "ch_3")  # ids never repeat

    def test_framing_and_connection_recorded_per_execution(self):
        with Conn(self.upstream.port) as c:
            c.request("POST", "/f1", [("Idempotency-Key", "f1")], b"abcd")
            c.request("POST", "/f2", [("Idempotency-Key", "f2")], b"xyz" * 5, chunked=True)
        e1, e2 = self.upstream.entries()
        self.assertEqual((e1["content_length"], e1["transfer_encoding"], e1["body_len"]),
                         (["4"], [], 4))
        self.assertEqual((e2["content_length"], e2["transfer_encoding"], e2["body_len"]),
                         ([], ["chunked"], 15))
        self.assertEqual((e1["conn_seq"], e2["conn_seq"]), (1, 2))
        self.assertEqual(e1["peer_port"], e2["peer_port"])
        self.assertEqual(self.upstream.rejected()["count"], 0)
        resp, _, _ = harness.raw_exchange(self.upstream.port, b"POST /bad HTTP/1.1\r\nHost: x\r\n"
                                          b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab")
        self.assertEqual(resp.status, 400)
        self.assertEqual(self.upstream.rejected(), {"count": 1,
                                                    "reasons": ["400 conflicting Content-Length"]})
        self.assertEqual(self.upstream.total(), 2)

    def test_control_endpoints_are_not_executions(self):
        self.assertEqual(self.up(method="GET", path="/__health").status, 200)
        self.assertEqual(self.up(method="GET", path="/__nope").status, 404)
        self.assertEqual(self.upstream.total(), 0)

    def test_status_delay_and_response_headers(self):
        t0 = time.monotonic()
        r = self.up(headers=[("X-Test-Status", "503"), ("X-Test-Delay-Ms", "300"),
                             ("X-Test-Response-Header", "Link: <a>"),
                             ("X-Test-Response-Header", "Link: <b>")])
        self.assertGreaterEqual(time.monotonic() - t0, 0.3)
        self.assertEqual(r.status, 503)
        self.assertEqual(r.header_all("Link"), ["<a>", "<b>"])
        self.assertEqual(self.up(headers=[("X-Test-Status", "204")]).status, 204)
        self.assertEqual(self.upstream.total(), 2)

    def test_keep_alive_chunked_and_expect_continue(self):
        body = bytes(range(256)) * 40
        with Conn(self.upstream.port) as c:
            r1 = c.request("POST", "/a", [("Idempotency-Key", "c")], body, chunked=True)
            self.assertEqual(r1.json()["body_sha256"], hashlib.sha256(body).hexdigest())
            c.send(harness.build_request("POST", "/b", [("Expect", "100-continue"),
                                                        ("Content-Length", "3")], host="x"))
            head = c._until(b"\r\n\r\n")
            self.assertTrue(head.startswith(b"HTTP/1.1 100"), head)
            c.send(b"abc")
            r2 = c.read_response()
            self.assertEqual(r2.json()["body_sha256"], hashlib.sha256(b"abc").hexdigest())
        self.assertEqual(self.upstream.total(), 2)

    def test_echo_headers_keeps_order_and_duplicates(self):
        r = self.up(headers=[("X-Test-Fault", "echo-headers"), ("X-A", "1"), ("x-a", "2")])
        pairs = r.json()
        self.assertIn(["X-A", "1"], pairs)
        self.assertLess(pairs.index(["X-A", "1"]), pairs.index(["x-a", "2"]))

    def test_connection_faults(self):
        for fault in ("close-before", "reset"):
            with Conn(self.upstream.port) as c:
                c.send(harness.build_request("POST", "/f", [("X-Test-Fault", fault)], b"x",
                                             host="x"))
                with self.assertRaises((ConnectionClosed, ConnectionResetError)):
                    c.read_response()
        with Conn(self.upstream.port, timeout=1.0) as c:
            c.send(harness.build_request("POST", "/f", [("X-Test-Fault", "hang")], b"x",
                                         host="x"))
            with self.assertRaises(socket.timeout):
                c.read_response()
        with Conn(self.upstream.port) as c:
            c.send(harness.build_request("POST", "/f", [("X-Test-Fault", "close-mid-body")],
                                         b"x", host="x"))
            with self.assertRaises(ConnectionClosed):
                c.read_response()
        self.assertEqual(self.upstream.total(), 4)

    def test_response_framing_faults(self):
        with Conn(self.upstream.port) as c:
            c.send(harness.build_request("POST", "/f", [("X-Test-Fault", "two-content-lengths")],
                                         b"x", host="x"))
            head = c._until(b"\r\n\r\n").decode("latin-1").lower()
            self.assertEqual(head.count("content-length:"), 2, head)
        with Conn(self.upstream.port) as c:
            c.send(harness.build_request("POST", "/f", [("X-Test-Fault", "bad-chunk-size")],
                                         b"x", host="x"))
            self.assertIn("transfer-encoding: chunked", c._until(b"\r\n\r\n").decode().lower())
            self.assertEqual(c._until(b"\r\n"), b"zz")
        self.assertEqual(self.upstream.total(), 2)

    def test_huge_drip_hop(self):
        r = self.up(headers=[("X-Test-Fault", "huge"), ("X-Test-Size", "100000")])
        self.assertEqual(len(r.body), 100000)
        self.assertEqual(r.body, harness.huge_body(100000))
        t0 = time.monotonic()
        with Conn(self.upstream.port) as c:
            c.send(harness.build_request("POST", "/d", [("X-Test-Fault", "drip"),
                                                        ("X-Test-Drip-Ms", "2")], host="x"))
            r = c.read_response()
        self.assertEqual(r.status, 201)
        self.assertGreater(time.monotonic() - t0, 0.2)
        r = self.up(headers=[("X-Test-Fault", "hop")])
        self.assertEqual(r.header("X-Hop"), "must-not-pass")
        self.assertEqual(r.header("Transfer-Encoding"), "chunked")
        self.assertEqual(r.json()["method"], "POST")

    def test_huge_paused_half_way_and_chunked(self):
        # X-Test-Pause-Ms stops half way through the body; X-Test-Chunked
        # sends the same bytes chunked.
        for chunked in (False, True):
            hdrs = [("X-Test-Fault", "huge"), ("X-Test-Size", "100001"),
                    ("X-Test-Pause-Ms", "300")]
            if chunked:
                hdrs.append(("X-Test-Chunked", "1"))
            t0 = time.monotonic()
            r = self.up(headers=hdrs)
            self.assertGreater(time.monotonic() - t0, 0.25)
            self.assertEqual(r.has("Transfer-Encoding"), chunked, r)
            self.assertEqual(r.header("Content-Length"), None if chunked else "100001", r)
            self.assertEqual(r.body, harness.huge_body(100001))

    def test_many_concurrent_connections(self):
        conns = [Conn(self.upstream.port) for _ in range(300)]
        try:
            for i, c in enumerate(conns):
                c.send(harness.build_request("POST", "/m", [("Idempotency-Key", "k%d" % i),
                                                            ("X-Test-Delay-Ms", "200")],
                                             b"{}", host="x"))
            for c in conns:
                self.assertEqual(c.read_response().status, 201)
        finally:
            for c in conns:
                c.close()
        self.assertEqual(self.upstream.total(), 300)
        self.assertEqual(len(self.upstream.executions()["by_key"]), 300)


if __name__ == "__main__":
    unittest.main()
