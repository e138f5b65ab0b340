#!/usr/bin/env python3
"""Outcome unknown (the request was sent, then the upstream timed out or the
connection was lost): 504 or 502. By default (on_unknown "release") the record
is released and a retry executes again; with on_unknown "complete" that 502/504
is stored as the key's result and replayed, and the upstream is never called
again for the key."""

import time
import unittest

import harness

UNKNOWN = (502, 504)

# Faults after which the upstream has received (and executed) the request.
LOST = ["hang", "close-before", "reset", "close-mid-body", "bad-status-line"]


class UpstreamTimeoutAndLostConnection(harness.ProxyTestCase):
    def proxy(self, **route):
        # upstream.timeout is the whole exchange, the healthy retries' too
        # (the test upstream flushes its execution log): 2 s, not less.
        return self.start_proxy(config=self.config(routes=[self.route(**route)], timeout="2s"))

    def assertUnknown(self, r):
        self.assertIn(r.status, UNKNOWN, r)
        self.assertProblem(r, r.status)
        self.assertFalse(r.replayed, r)

    def test_timeout_released_by_default(self):
        proxy = self.proxy()
        for i, fault in enumerate([("X-Test-Fault", "hang"), ("X-Test-Delay-Ms", "6000")]):
            key = "timeout-%d" % i
            with self.subTest(fault=fault):
                t0 = time.monotonic()
                r = self.post(proxy, key, headers=[fault])
                elapsed = time.monotonic() - t0
                self.assertUnknown(r)
                self.assertLess(elapsed, 4.0, "upstream.timeout 2s not applied")
                # Released: the retry executes (a second execution for the key).
                retry = self.post(proxy, key)
                self.assertExecuted(retry)
                self.assertEqual(self.upstream.count(key), 2)
                self.assertReplayOf(self.post(proxy, key), retry)

    def test_lost_connection_released_by_default(self):
        proxy = self.proxy()
        for fault in LOST:
            key = "lost-" + fault
            with self.subTest(fault=fault):
                self.assertUnknown(self.post(proxy, key, headers=[("X-Test-Fault", fault)]))
                retry = self.post(proxy, key)
                self.assertExecuted(retry)
                self.assertEqual(self.upstream.count(key), 2)

    def test_on_unknown_complete_stores_the_timeout(self):
        proxy = self.proxy(on_unknown="complete")
        r = self.post(proxy, "uc-timeout", headers=[("X-Test-Fault", "hang")])
        self.assertUnknown(r)
        for _ in range(2):
            again = self.post(proxy, "uc-timeout")
            self.assertEqual(again.status, r.status, again)
            self.assertTrue(again.replayed, again)
            self.assertEqual(again.body, r.body)
        self.assertEqual(self.upstream.count("uc-timeout"), 1)

    def test_on_unknown_complete_stores_lost_connections(self):
        proxy = self.proxy(on_unknown="complete")
        for fault in LOST:
            key = "uc-" + fault
            with self.subTest(fault=fault):
                r = self.post(proxy, key, headers=[("X-Test-Fault", fault)])
                self.assertUnknown(r)
                again = self.post(proxy, key)
                self.assertEqual(again.status, r.status, again)
                self.assertTrue(again.replayed, again)
                self.assertEqual(self.upstream.count(key), 1)

    def test_response_over_max_response_is_502_and_released(self):
        cfg = self.config()
        cfg["upstream"]["max_response"] = "100KiB"
        proxy = self.start_proxy(config=cfg)
        r = self.post(proxy, "too-big", headers=[("X-Test-Fault", "huge"), ("X-Test-Size", "200000")])
        self.assertProblem(r, 502)
        retry = self.post(proxy, "too-big", headers=[("X-Test-Fault", "huge"), ("X-Test-Size", "1000")])
        self.assertEqual(retry.status, 201, retry)
        self.assertFalse(retry.replayed, retry)
        self.assertEqual(self.upstream.count("too-big"), 2)

    def test_response_header_block_over_header_memory_is_502_and_released(self):
        # The answer must fit the client connection's memory next to the
        # request: a request of up to header_memory (16 KiB by default) and
        # an answer's header block of up to half of it. A larger upstream
        # header block used to drop the client's connection unanswered and
        # store a record that replayed as a drop too.
        proxy = self.start_proxy()
        ok = self.post(proxy, "hdr-6k", headers=[("X-Test-Fault", "big-headers"),
                                                 ("X-Test-Size", str(6 * 1024))])
        self.assertEqual(ok.status, 201, ok)
        self.assertTrue((ok.header("X-Big-5") or "").startswith("b"), ok)
        again = self.post(proxy, "hdr-6k")
        self.assertReplayOf(again, ok)
        self.assertEqual(again.header("X-Big-5"), ok.header("X-Big-5"))
        for size in (12, 40):
            key = "hdr-%dk" % size
            r = self.post(proxy, key, headers=[("X-Test-Fault", "big-headers"),
                                               ("X-Test-Size", str(size * 1024))])
            self.assertProblem(r, 502)
            self.assertIn("header_memory", r.json()["detail"])
            retry = self.post(proxy, key)
            self.assertEqual(retry.status, 201, retry)
            self.assertFalse(retry.replayed, retry)
            self.assertEqual(self.upstream.count(key), 2)

    def test_large_request_and_response_headers_are_answered(self):
        # libmicrohttpd keeps the request's header block, an entry per
        # header and a copy of the Cookie header in the same pool the
        # answer's header block is written to. A 7,000-byte Cookie with
        # 6 KiB of response headers used to be run, stored and then dropped
        # unanswered, and every retry with the same headers dropped too.
        proxy = self.start_proxy()
        cookie = ("Cookie", "s=" + "c" * 7000)
        big = [("X-Test-Fault", "big-headers"), ("X-Test-Size", str(6 * 1024))]
        first = self.post(proxy, "big-both", headers=[cookie] + big)
        self.assertEqual(first.status, 201, first)
        self.assertTrue((first.header("X-Big-5") or "").startswith("b"), first)
        again = self.post(proxy, "big-both", headers=[cookie])
        self.assertReplayOf(again, first)
        self.assertEqual(self.upstream.count("big-both"), 1)
        # A Cookie header counts twice against header_memory: the proxy's
        # own 431, nothing forwarded.
        r = self.post(proxy, "big-cookie", headers=[("Cookie", "s=" + "c" * 9000)])
        self.assertProblem(r, 431)
        self.assertEqual(self.upstream.count("big-cookie"), 0)

    def test_on_unknown_complete_does_not_store_upstream_5xx(self):
        # A 5xx the upstream answered is a known outcome: release_on applies.
        proxy = self.proxy(on_unknown="complete")
        r = self.post(proxy, "uc-500", headers=[("X-Test-Status", "500")])
        self.assertEqual(r.status, 500, r)
        self.assertExecuted(self.post(proxy, "uc-500"))
        self.assertEqual(self.upstream.count("uc-500"), 2)


if __name__ == "__main__":
    unittest.main()
