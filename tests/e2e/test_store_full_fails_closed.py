#!/usr/bin/env python3
"""When the store is full (after purging) a new key gets 503 with Retry-After
and nothing is forwarded (fail closed), while replays of stored keys keep
working. A store path that cannot be created stops the proxy at start."""

import json
import os
import subprocess
import unittest

import harness


class StoreFull(harness.ProxyTestCase):
    def test_full_store_fails_closed_and_replays_keep_working(self):
        proxy = self.start_proxy(config=self.config(store={"map_size": "1MiB"}))
        size = 256 * 1024
        stored = []
        rejected = None
        unprotected = []  # keys forwarded although their answer could not be stored
        # Fill the 1 MiB store with ever smaller answers until it refuses a
        # new key. TTLs are 24 h, so purging frees nothing.
        for i in range(200):
            key = "fill-%d" % i
            before = self.upstream.total()
            r = self.post(proxy, key, headers=[("X-Test-Fault", "huge"), ("X-Test-Size", str(size))])
            executed = self.upstream.total() - before
            if r.status == 503 and executed == 0:
                rejected = r
                break
            self.assertEqual(executed, 1, "a request was forwarded %d times: %r" % (executed, r))
            if r.status == 201:
                before = self.upstream.total()
                again = self.post(proxy, key)
                if again.replayed:
                    self.assertEqual(again.body, r.body)
                    stored.append((key, r))
                    continue
                if self.upstream.total() > before:
                    unprotected.append((key, size))
            # The answer could not be stored: try smaller ones.
            size = max(size // 2, 16)
        self.assertGreater(len(stored), 0, "nothing was stored before the store filled up")
        self.assertIsNotNone(
            rejected,
            "the full 1 MiB store never answered 503 to a new key; instead %d new keys were "
            "forwarded although their answers could not be stored (the smallest answer was "
            "%d bytes), and each one's duplicate executed the upstream again: %r" % (
                len(unprotected), min([s for _, s in unprotected] or [0]), unprotected[-3:]))

        self.assertProblem(rejected, 503)
        self.assertRetryAfter(rejected, minimum=1)
        self.assertFalse(rejected.replayed)
        # The line is written when the exchange ends, which may be just after
        # the client has read its answer: wait for this one, not for any.
        def logged():
            return (503, "unavailable") in [(e["status"], e["outcome"])
                                            for e in proxy.access_log()]
        self.assertTrue(harness.wait_for(logged), "no 503 'unavailable' line in the access "
                        "log: %r" % proxy.access_log()[-3:])

        # The operator is told why, naming the map (not a line per batch).
        def said():
            return [l for l in proxy.stderr().splitlines()
                    if "idemproxy: store: full" in l and "MDB_MAP_FULL" in l]
        self.assertTrue(harness.wait_for(lambda: said()), "no stderr line says the map is "
                        "full: %r" % proxy.stderr()[-1500:])

        # Replays of stored keys keep working, byte for byte.
        for key, first in (stored[0], stored[-1]):
            before = self.upstream.total()
            again = self.post(proxy, key)
            self.assertReplayOf(again, first)
            self.assertEqual(self.upstream.total(), before, "a replay called the upstream")

    def test_answers_larger_than_the_headroom_do_not_run_unstored(self):
        # The acquire used to leave only map/64 (here 64 KiB) for the answer
        # it leads to: once the map was nearly full, every new key with a
        # larger answer was forwarded and run, its completion failed, and the
        # key was held IN_PROGRESS for the TTL (`unstored`, retries 409), one
        # after the other, while stderr said "new keys get 503". A new key
        # must now be refused before its action runs.
        proxy = self.start_proxy(config=self.config(store={"map_size": "1MiB"}))
        answer = [("X-Test-Fault", "huge"), ("X-Test-Size", str(150 * 1000))]
        outcomes = []
        for i in range(12):
            key = "big-%d" % i
            r = self.post(proxy, key, headers=answer)
            ran = self.upstream.count(key)
            if r.status == 503:
                self.assertEqual(ran, 0, "a refused key ran: %r" % r)
                outcomes.append("refused")
                continue
            self.assertEqual((r.status, ran), (201, 1), r)
            again = self.post(proxy, key, headers=answer)
            self.assertTrue(again.replayed and again.body == r.body,
                            "key %d ran but its answer was not stored: the retry got %r"
                            % (i, again))
            outcomes.append("stored")
        self.assertIn("stored", outcomes)
        self.assertEqual(outcomes[-1], "refused", outcomes)
        harness.wait_for(lambda: len(proxy.access_log()) >= 12)
        self.assertNotIn("unstored", [e["outcome"] for e in proxy.access_log()])

    def test_map_size_below_the_data_is_said_at_start(self):
        cfg = self.config(store={"map_size": "64MiB"})
        proxy = self.start_proxy(config=cfg)
        for i in range(4):
            r = self.post(proxy, "big-%d" % i, headers=[("X-Test-Fault", "huge"),
                                                        ("X-Test-Size", str(512 * 1024))])
            self.assertEqual(r.status, 201, r)
        self.assertEqual(proxy.stop(), 0)
        # Restarted with a map smaller than the data already stored.
        smaller = self.start_proxy(config=self.config(store={"map_size": "1MiB"}))
        lines = [l for l in smaller.stderr().splitlines() if "idemproxy: store: warning: map_size" in l]
        self.assertTrue(lines, "nothing on stderr says map_size is below the store's data: %r"
                        % smaller.stderr())
        self.assertIn("MDB_MAP_FULL", lines[0])
        r = self.post(smaller, "new-key")
        self.assertProblem(r, 503)
        self.assertEqual(self.upstream.count("new-key"), 0)
        self.assertTrue(self.post(smaller, "big-0").replayed)

    def test_store_path_that_cannot_be_created_fails_at_start(self):
        blocker = os.path.join(self.workdir, "a-regular-file")
        with open(blocker, "w") as f:
            f.write("not a directory\n")
        cfg = self.config(store={"path": os.path.join(blocker, "store")})
        cfg["listen"] = "127.0.0.1:%d" % harness.free_port()
        path = os.path.join(self.workdir, "bad-store.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        try:
            p = subprocess.run([harness.binary(), "--config", path], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            self.fail("the proxy kept running with a store it cannot create")
        self.assertNotEqual(p.returncode, 0)
        self.assertTrue(p.stderr.strip(), "no error message on stderr")


if __name__ == "__main__":
    unittest.main()
