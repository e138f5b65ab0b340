#!/usr/bin/env python3
"""A worker keeps the last replay answer it made, and replays of the same
record version get that answer without building another. Each replay still
reads its record first: the kept answer is used only for the version just
read, so a key forgotten and run again is replayed with its new answer at
once, never with the kept one; and a request whose own headers leave no
room for the stored header block still gets 431, not a dropped connection.

One worker (server.workers 1), so every replay after the first meets the
kept answer."""

import subprocess
import time
import unittest

import harness

ONE_WORKER = {"workers": 1}


class ReplayKeptAnswer(harness.ProxyTestCase):
    def forget(self, key):
        p = subprocess.run([harness.binary(), "forget-key", self.store_path, "payments", key],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        self.assertEqual(p.returncode, 0, p)

    def test_a_key_run_again_is_replayed_with_its_new_answer(self):
        proxy = self.start_proxy(config=self.config(server=ONE_WORKER))
        first = self.post(proxy, "kept-1", headers=[("X-Test-Response-Header", "X-Run: one")])
        self.assertExecuted(first)
        for _ in range(3):
            self.assertReplayOf(self.post(proxy, "kept-1"), first)
        # Forgotten beside the running proxy while its answer is kept, and
        # run again with another answer: another version of the record.
        self.forget("kept-1")
        second = self.post(proxy, "kept-1", headers=[("X-Test-Response-Header", "X-Run: two")])
        self.assertExecuted(second)
        self.assertNotEqual(second.charge_id, first.charge_id)
        for _ in range(3):
            again = self.post(proxy, "kept-1")
            self.assertReplayOf(again, second)
            self.assertEqual(again.header_all("X-Run"), ["two"])
        self.assertEqual(self.upstream.count("kept-1"), 2)
        # Another key in between, and back: each replay is its own record's.
        other = self.post(proxy, "kept-2")
        self.assertExecuted(other)
        for key, want in (("kept-2", other), ("kept-1", second), ("kept-2", other),
                          ("kept-1", second)):
            self.assertReplayOf(self.post(proxy, key), want)

    def test_a_request_with_no_room_for_the_stored_headers_gets_431(self):
        # A 20 KiB header block, stored by a proxy whose header_memory
        # (64 KiB) allows answers up to 32 KiB of them; the default 16 KiB
        # allows 8 KiB more than the request's own head, so the same store
        # behind a default proxy can replay it only to requests with small
        # heads.
        big = "X-Big: " + "b" * 20000
        proxy = self.start_proxy(config=self.config(server={"header_memory": "64KiB",
                                                            "workers": 1}))
        first = self.post(proxy, "big-head", headers=[("X-Test-Response-Header", big)])
        self.assertExecuted(first)
        self.assertEqual(proxy.stop(), 0)
        proxy = self.start_proxy(config=self.config(server=ONE_WORKER))
        padding = [("X-Pad-%d" % i, "p" * 1000) for i in range(6)]
        for _ in range(2):
            for _ in range(2):
                again = self.post(proxy, "big-head")
                self.assertReplayOf(again, first)
                self.assertEqual(again.header("X-Big"), "b" * 20000)
            for _ in range(2):
                refused = self.post(proxy, "big-head", headers=padding)
                doc = self.assertProblem(refused, 431)
                self.assertEqual(doc["type"], "urn:idemproxy:problem:headers-too-large")
        self.assertEqual(self.upstream.count("big-head"), 1)

    def test_a_kept_answer_counts_in_max_buffered_until_let_go(self):
        # A 60,000-byte answer, kept after its replay: with max_buffered at
        # 1 MiB, a 1 MiB body does not fit beside it (503, nothing
        # forwarded), and does once the answer is let go: 1-2 s after its
        # last replay (the worker's once-a-second sweep finds it unused).
        proxy = self.start_proxy(config=self.config(server={"workers": 1,
                                                            "max_buffered": "1MiB"}))
        first = self.post(proxy, "kept-60k", headers=[("X-Test-Fault", "huge"),
                                                      ("X-Test-Size", "60000")])
        self.assertEqual((first.status, len(first.body)), (201, 60000), first)
        again = self.post(proxy, "kept-60k")
        self.assertTrue(again.replayed, again)
        self.assertEqual(again.body, first.body)
        body = b"x" * (1 << 20)
        refused = self.post(proxy, "mib-body", body=body,
                            content_type="application/octet-stream")
        doc = self.assertProblem(refused, 503)
        self.assertEqual(doc["type"], "urn:idemproxy:problem:out-of-memory")
        self.assertEqual(self.upstream.count("mib-body"), 0)
        deadline = time.monotonic() + 5
        while True:
            time.sleep(0.25)
            r = self.post(proxy, "mib-body", body=body, content_type="application/octet-stream")
            if r.status != 503 or time.monotonic() > deadline:
                break
        self.assertExecuted(r)
        self.assertEqual(self.upstream.count("mib-body"), 1)

    def test_one_answer_serves_http_1_0_and_1_1_clients_alike(self):
        proxy = self.start_proxy(config=self.config(server=ONE_WORKER))
        first = self.post(proxy, "versions")
        self.assertExecuted(first)
        for version in ("HTTP/1.1", "HTTP/1.0", "HTTP/1.1", "HTTP/1.0"):
            again = self.post(proxy, "versions", version=version)
            self.assertReplayOf(again, first)
        self.assertEqual(self.upstream.count("versions"), 1)


if __name__ == "__main__":
    unittest.main()
