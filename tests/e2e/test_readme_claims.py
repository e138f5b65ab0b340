#!/usr/bin/env python3
"""Claims of README.md that no other scenario pinned, checked against the real
binary (the README truth audit of 2026-12-06): what a client, or an operator
reading the answer's detail at 3 a.m., is told.

- A keyed request on a route with scope_header whose header is empty gets 400
  scope-header-missing saying the header is empty (not "missing or
  repeated", which sends the operator looking for a header that is there).
- A chunked body whose chunk size is not hexadecimal, sent in the same write
  as its head, is refused by the proxy's own raw-byte check: problem+json 400
  whose detail names the framing, not "a request header could not be read".
- An HTTP/1.x version above 1.1 (HTTP/1.2) is served as HTTP/1.1, as RFC 9110
  section 2.5 says a server should; HTTP/2.0 gets libmicrohttpd's 505.
- libmicrohttpd's pool is header_memory x 1.5 + 2 KiB but at least 16 KiB:
  with header_memory 4KiB a 10 KiB head gets the proxy's problem+json 431,
  not libmicrohttpd's HTML.
- A route cannot list CONNECT (check-config refuses it).
"""

import json
import os
import subprocess
import time
import unittest

import harness


def raw(lines, body=b""):
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ReadmeClaims(harness.ProxyTestCase):
    def test_empty_scope_header_is_said_to_be_empty(self):
        proxy = self.start_proxy(scope_header="X-Tenant-Id")
        cases = [
            ("missing", [], "missing"),
            ("empty", [("X-Tenant-Id", "")], "empty"),
            ("repeated", [("X-Tenant-Id", "t1"), ("X-Tenant-Id", "t1")], "more than once"),
        ]
        for name, headers, said in cases:
            with self.subTest(name):
                r = self.post(proxy, "sh-" + name, headers=headers)
                doc = self.assertProblem(r, 400)
                self.assertEqual(doc["type"], "urn:idemproxy:problem:scope-header-missing", r)
                self.assertIn("X-Tenant-Id", doc["detail"], r)
                self.assertIn(said, doc["detail"], r)
        self.assertEqual(self.upstream.total(), 0)

    def test_bad_chunk_size_with_the_head_names_the_framing(self):
        proxy = self.start_proxy()
        data = raw(["POST /v1/payments HTTP/1.1", "Host: proxy.test", "Idempotency-Key: chunk-1",
                    "Content-Type: application/json", "Transfer-Encoding: chunked"],
                   b"5\r\n{\"a\":\r\nzz\r\n1}\r\n0\r\n\r\n")
        resp, closed, extra = harness.raw_exchange(proxy.port, data)
        self.assertIsNotNone(resp, "no answer")
        doc = self.assertProblem(resp, 400)
        self.assertNotIn("header could not be read", doc["detail"], resp)
        self.assertIn("chunk", doc["detail"], resp)
        self.assertTrue(closed, "connection left open")
        self.assertEqual(extra, b"")
        self.assertEqual(self.upstream.total(), 0)
        lines = proxy.wait_access_log(1)
        self.assertEqual(lines[-1]["outcome"], "rejected", lines)
        self.assertEqual(lines[-1]["status"], 400, lines)

    def test_http_1_2_is_served_as_http_1_1(self):
        proxy = self.start_proxy()
        r = self.post(proxy, "v12", version="HTTP/1.2")
        self.assertExecuted(r)
        self.assertEqual(r.version, "HTTP/1.1", r)
        resp, closed, _ = harness.raw_exchange(
            proxy.port, raw(["GET /v1/payments HTTP/2.0", "Host: proxy.test"]))
        self.assertIsNotNone(resp, "no answer to HTTP/2.0")
        self.assertEqual(resp.status, 505, resp)
        self.assertTrue(closed)
        self.assertEqual(self.upstream.count("v12"), 1)

    def test_small_header_memory_pool_is_at_least_16_kib(self):
        proxy = self.start_proxy(config=self.config(server={"header_memory": "4KiB"}))
        head = ["GET /v1/other HTTP/1.1", "Host: proxy.test"] + [
            "X-Big-%d: %s" % (i, "b" * 1000) for i in range(10)]
        resp, closed, _ = harness.raw_exchange(proxy.port, raw(head))
        self.assertIsNotNone(resp, "no answer")
        # 10 KiB: past header_memory (the proxy's 431), within the 16 KiB pool.
        doc = self.assertProblem(resp, 431)
        self.assertEqual(doc["type"], "urn:idemproxy:problem:headers-too-large", resp)
        self.assertTrue(closed)
        self.assertEqual(self.upstream.total(), 0)

    def test_a_route_cannot_list_connect(self):
        path = os.path.join(self.workdir, "connect.json")
        cfg = self.config(routes=[self.route(methods=["POST", "CONNECT"])],
                          listen="127.0.0.1:%d" % harness.free_port())
        with open(path, "w") as f:
            json.dump(cfg, f)
        p = subprocess.run([harness.binary(), "check-config", path], capture_output=True,
                           timeout=30)
        self.assertEqual(p.returncode, 1, p)
        self.assertIn(b"routes[0].methods: CONNECT", p.stderr, p)


if __name__ == "__main__":
    unittest.main()
