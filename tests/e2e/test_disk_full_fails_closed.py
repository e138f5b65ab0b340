#!/usr/bin/env python3
"""A full file system fails closed, as a full map does: once an action ran, a
retry of its key never runs it again; new keys get 503 (nothing forwarded)
as soon as the store cannot grow; and the store recovers once its records
expire. The file system is made "full" without root: RLIMIT_FSIZE on the
proxy (with SIGXFSZ ignored, a write past it fails with EFBIG, a real
kernel limit) caps the data file at 4 MiB while map_size is 64 MiB, and
every answer is 8 KiB, so small acquires fit long after completions need
the file to grow (README, Failure policy)."""

import json
import resource
import signal
import subprocess
import time
import unittest

import harness

FILE_LIMIT_BYTES = 4 << 20
KEYS = 700
BODY_BYTES = 8192
TTL_S = 8.0


def limit_file_size():
    """In the proxy's child process, before exec."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT_BYTES, FILE_LIMIT_BYTES))


class DiskFull(harness.ProxyTestCase):
    def big(self, proxy, key):
        return self.post(proxy, key, headers=[("X-Test-Fault", "huge"),
                                              ("X-Test-Size", str(BODY_BYTES))])

    def test_full_file_system_never_runs_an_action_twice(self):
        cfg = self.config(routes=[self.route(ttl="%gs" % TTL_S, wait="0s")],
                          store={"map_size": "64MiB", "purge_interval": "1s"})
        proxy = self.start_proxy(config=cfg, preexec_fn=limit_file_size)
        keys = ["disk-%d" % i for i in range(KEYS)]
        first = {}
        sent = {}
        for k in keys:
            sent[k] = time.monotonic()
            first[k] = self.big(proxy, k)
        # Judged now: in the second pass below, a key refused here is a new
        # key and may run once the purge has made room.
        after_first = self.upstream.executions()["by_key"]
        # Every key once more: a replay, a 409/503, never a second run --
        # while its record can still be alive. On a slow (sanitizer) build
        # the pass can outlast the TTL of the first keys, and a key whose
        # record expired may run again by contract; those are not judged.
        again = {}
        judged = []
        for k in keys:
            again[k] = self.big(proxy, k)
            if time.monotonic() < sent[k] + TTL_S:
                judged.append(k)
        self.assertGreater(len(judged), KEYS // 2,
                           "too few retries came within the TTL to judge")
        executed = self.upstream.executions()["by_key"]
        twice = [k for k in judged if executed.get(k, 0) > 1]
        statuses = sorted(set(r.status for r in first.values()))
        self.assertFalse(twice, "%d of %d keys ran twice once the file system was full, "
                         "e.g. %r (first answers: %r)" % (len(twice), KEYS, twice[:5], statuses))
        refused = [k for k in keys if first[k].status == 503]
        self.assertTrue(refused, "the 4 MiB file never filled up: %r" % statuses)
        for k in refused:
            self.assertProblem(first[k], 503)
            self.assertRetryAfter(first[k], minimum=1)
            self.assertEqual(after_first.get(k, 0), 0, "%s was answered 503 but forwarded" % k)
        stored = [k for k in keys if first[k].status == 201 and again[k].replayed]
        self.assertTrue(stored, "nothing was stored before the file system filled up")
        for k in stored[:5] + stored[-5:]:
            self.assertReplayOf(again[k], first[k])
        self.assertTrue(proxy.running(), "the proxy died: %s" % proxy.stderr()[-2000:])

        # Every record expires; the periodic purge must then make room again
        # although the file cannot grow (a store is only "full after purging").
        deadline = time.monotonic() + TTL_S + 60.0
        fresh = None
        n = 0
        while time.monotonic() < deadline:
            time.sleep(1.0)
            n += 1
            fresh = self.big(proxy, "after-ttl-%d" % n)
            if fresh.status == 201:
                break
        self.assertIsNotNone(fresh)
        self.assertEqual(fresh.status, 201, "the store stayed full after every record "
                         "expired: %r" % fresh)
        # The purge frees room in time-bounded shares, so right after the
        # first fresh 201 a new key may still meet a 503 for a moment (a
        # slow sanitizer build, an acquire that also leaves room for the
        # answers in flight): each key gets 201 within a few seconds of
        # retries, never runs before, and runs once.
        for i in range(50):
            k = "after-ttl-more-%d" % i
            until = time.monotonic() + 15.0
            while True:
                r = self.big(proxy, k)
                if r.status != 503 or time.monotonic() > until:
                    break
                self.assertEqual(self.upstream.count(k), 0, "%s: 503 but forwarded" % k)
                time.sleep(0.2)
            self.assertEqual(r.status, 201, "%s after the TTL: %r" % (k, r))
            self.assertEqual(self.upstream.count(k), 1)

    def test_answer_that_cannot_be_stored_holds_its_key(self):
        """An answer larger than the room an acquire claims (headroom: 1 MiB
        for a 64 MiB map) on a file system that cannot take it: the action
        ran, so the record is held IN_PROGRESS, never released."""
        limit = 2 << 20
        def small_file():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        cfg = self.config(routes=[self.route(ttl="1h", wait="0s")],
                          store={"map_size": "64MiB"})
        proxy = self.start_proxy(config=cfg, preexec_fn=small_file)
        size = 3 << 20
        first = self.post(proxy, "too-big", headers=[("X-Test-Fault", "huge"),
                                                      ("X-Test-Size", str(size))])
        # The client still gets the upstream's answer.
        self.assertEqual(first.status, 201, first)
        self.assertEqual(len(first.body), size)
        self.assertTrue(harness.wait_for(lambda: any(
            e.get("outcome") == "unstored" for e in proxy.access_log())),
            "not logged unstored: %r" % proxy.access_log()[-3:])
        for _ in range(3):
            again = self.post(proxy, "too-big", headers=[("X-Test-Fault", "huge"),
                                                          ("X-Test-Size", str(size))])
            self.assertProblem(again, 409)
            self.assertRetryAfter(again, minimum=60)
        self.assertEqual(self.upstream.count("too-big"), 1,
                         "the action of a key whose answer could not be stored ran again")
        # Smaller answers still fit: the store is not jammed.
        ok = self.post(proxy, "small", headers=[("X-Test-Fault", "huge"),
                                                ("X-Test-Size", "8192")])
        self.assertEqual(ok.status, 201, ok)
        self.assertTrue(self.post(proxy, "small").replayed)

    def test_held_key_is_answered_at_once(self):
        """A key held after its result could not be stored: duplicates
        (one already waiting, and later retries) get 409
        request-unstored at once, not after the route's whole wait, with
        Retry-After the TTL's end; the action ran once."""
        limit = 2 << 20
        def small_file():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        wait_s = 10.0
        cfg = self.config(routes=[self.route(ttl="1h", wait="%gs" % wait_s)],
                          store={"map_size": "64MiB"})
        proxy = self.start_proxy(config=cfg, preexec_fn=small_file)
        size = 3 << 20
        hdrs = [("X-Test-Fault", "huge"), ("X-Test-Size", str(size)),
                ("X-Test-Delay-Ms", "1000")]
        first = harness.in_thread(self.post, proxy, "held", headers=hdrs)
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("held") == 1),
                        "the first request never reached the upstream")
        t0 = time.monotonic()
        waiter = self.post(proxy, "held", headers=hdrs)
        waited = time.monotonic() - t0
        self.assertEqual(first.result(timeout=30).status, 201)
        doc = self.assertProblem(waiter, 409)
        self.assertTrue(doc["type"].endswith(":request-unstored"), doc)
        self.assertLess(waited, wait_s / 2,
                        "the waiting duplicate waited %.1f s for a key that was held" % waited)
        self.assertRetryAfter(waiter, minimum=3000)
        for _ in range(3):
            t0 = time.monotonic()
            again = self.post(proxy, "held", headers=hdrs[:2])
            took = time.monotonic() - t0
            doc = self.assertProblem(again, 409)
            self.assertTrue(doc["type"].endswith(":request-unstored"), doc)
            self.assertLess(took, wait_s / 4, "a retry of a held key waited %.1f s" % took)
            self.assertRetryAfter(again, minimum=3000)
        self.assertEqual(self.upstream.count("held"), 1)
        self.assertTrue(harness.wait_for(lambda: len(
            [e for e in proxy.access_log() if e.get("problem") == "request-unstored"]) == 4),
            "access log: %r" % proxy.access_log()[-5:])
        for e in [e for e in proxy.access_log() if e.get("problem") == "request-unstored"]:
            self.assertEqual(e["outcome"], "conflict", e)
        # Operators can see it: check-store counts the held record.
        out = subprocess.run([harness.binary(), "check-store", self.store_path],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        summary = json.loads(out.stdout.decode().splitlines()[-1])
        self.assertEqual(summary.get("held"), 1, summary)

    def test_full_file_system_is_said_once_on_stderr(self):
        """Operators see why new keys get 503: one line naming the file
        system (EFBIG here, ENOSPC on a full disk), not a line per batch,
        and not "I/O error"."""
        cfg = self.config(routes=[self.route(ttl="1h", wait="0s")],
                          store={"map_size": "64MiB"})
        proxy = self.start_proxy(config=cfg, preexec_fn=limit_file_size)
        started = time.monotonic()
        statuses = set()
        for i in range(500):
            statuses.add(self.big(proxy, "said-%d" % i).status)
        elapsed = time.monotonic() - started
        self.assertIn(503, statuses, "the 4 MiB file never filled up")
        store_lines = [l for l in proxy.stderr().splitlines() if "idemproxy: store:" in l]
        full = [l for l in store_lines if "EFBIG" in l and "file size limit" in l]
        self.assertTrue(full, "no stderr line names the full file system (EFBIG): %r" %
                        store_lines[:6])
        self.assertFalse([l for l in store_lines if "I/O error" in l],
                         "a full file system said as an I/O error: %r" % store_lines[:6])
        # At most about one line per second per condition (full, recovered),
        # with slack for a slow machine.
        self.assertLessEqual(len(store_lines), 2 * int(elapsed + 1) + 4,
                             "%d store lines in %.1fs: %r" % (len(store_lines), elapsed,
                                                             store_lines[:8]))


if __name__ == "__main__":
    unittest.main()
