#!/usr/bin/env python3
"""Duplicate storm: 1,000 keys, each sent as 16 identical requests at the same
moment over 64 keep-alive connections (4 keys in flight at a time, each key's
16 copies on 16 different connections), the upstream taking 50 ms per action
(X-Test-Delay-Ms: 50), the route waiting up to 10 s for a running first
request.

What it proves:
  - every key is executed exactly once (the upstream's fsync'ed execution log);
  - per key, exactly one answer is the upstream's own (forwarded) and the 15
    others are replays that are byte for byte that answer plus the one line
    `Idempotent-Replayed: true` - status line, every header in order (the
    upstream's Date and Set-Cookie included) and body;
  - no duplicate gets a 409: a 50 ms action is far inside the 10 s wait, so a
    409 here would be a waiter that was never woken;
  - the storm really was concurrent: most duplicates arrived while the first
    was running (they took at least half the action's time to answer).

Why strip_headers is [] here: by default a replay drops Set-Cookie (a replay
must not hand one client's session to another) while the first answer passes
the upstream's headers unchanged, so the two differ by design. With nothing
stripped, the stored payload is the whole first answer and "byte-identical to
the first" can be asserted literally. Stripping itself is tested in tests/e2e.

CI and long runs are the same size (CHAOS_STORM_KEYS overrides 1,000).
"""

import threading
import time
import unittest

import chaoslib
from chaoslib import harness

TEST = "duplicate_storm"
KEYS = chaoslib.knob("STORM_KEYS", 1000, 1000)
DUPS = 16
CONNS = 64
DELAY_MS = 50


class DuplicateStorm(harness.ProxyTestCase):
    def test_storm_executes_each_key_once_and_replays_byte_identical(self):
        t_start = time.monotonic()
        proxy = self.start_proxy(config=self.config(
            routes=[self.route(wait="10s", lease="5s", heartbeat="1s", strip_headers=[])]))
        groups = CONNS // DUPS
        answers = {}  # key -> [(status, replayed, raw, seconds)]
        lock = threading.Lock()
        errors = []
        barriers = [threading.Barrier(DUPS) for _ in range(groups)]

        def request_bytes(key):
            return harness.build_request(
                "POST", "/v1/payments",
                [("Content-Type", "application/json"), ("Idempotency-Key", key),
                 ("X-Test-Delay-Ms", str(DELAY_MS))],
                harness.PAYMENT_BODY, host="127.0.0.1:%d" % proxy.port)

        def client(group, slot):
            barrier = barriers[group]
            try:
                with chaoslib.RawConn(proxy.port, timeout=30) as conn:
                    for k in range(group, KEYS, groups):
                        key = "storm-%d" % k
                        data = request_bytes(key)
                        barrier.wait(60)
                        t0 = time.monotonic()
                        resp, raw = conn.exchange(data)
                        took = time.monotonic() - t0
                        with lock:
                            answers.setdefault(key, []).append(
                                (resp.status, resp.replayed, raw, took))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append("client %d/%d: %r" % (group, slot, e))
                barrier.abort()

        threads = [threading.Thread(target=client, args=(g, s), daemon=True)
                   for g in range(groups) for s in range(DUPS)]
        t_storm = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        storm_s = time.monotonic() - t_storm
        self.assertEqual(errors, [], "client errors (first of %d): %s" % (len(errors), errors[:3]))

        # Executions, from the upstream's fsync'ed log.
        execs = {}
        for e in chaoslib.execution_log(self.upstream):
            execs[e["key"]] = execs.get(e["key"], 0) + 1
        not_once = {k: n for (k, n) in execs.items() if n != 1}
        missing = ["storm-%d" % k for k in range(KEYS) if "storm-%d" % k not in execs]

        forwarded = replays = identical = conflicts = waited = 0
        problems = []
        for k in range(KEYS):
            key = "storm-%d" % k
            got = answers.get(key, [])
            if len(got) != DUPS:
                problems.append("%s: %d answers, expected %d" % (key, len(got), DUPS))
                continue
            firsts = [a for a in got if a[0] != 409 and not a[1]]
            dups = [a for a in got if a[0] != 409 and a[1]]
            conflicts += sum(1 for a in got if a[0] == 409)
            forwarded += len(firsts)
            replays += len(dups)
            if len(firsts) != 1 or firsts[0][0] != 201:
                problems.append("%s: %d forwarded answers (statuses %r), expected one 201" % (
                    key, len(firsts), [a[0] for a in got]))
                continue
            first_raw = firsts[0][2]
            for status, _, raw, took in dups:
                if chaoslib.without_replayed_marker(raw) == first_raw:
                    identical += 1
                elif len(problems) < 5:
                    problems.append("%s: replay differs from the first answer:\n first  %r\n replay %r"
                                    % (key, first_raw, raw))
                else:
                    problems.append(key)
                if took >= DELAY_MS / 2000.0:
                    waited += 1

        total = sum(len(v) for v in answers.values())
        chaoslib.figure(
            TEST, keys=KEYS, dups_per_key=DUPS, connections=CONNS, requests=total,
            executions=sum(execs.values()), keys_not_once=len(not_once) + len(missing),
            forwarded=forwarded, replays=replays, replays_byte_identical=identical,
            conflicts_409=conflicts, dups_that_waited=waited,
            storm_s=round(storm_s, 1), req_per_s=round(total / storm_s),
            test_s=round(time.monotonic() - t_start, 1))

        self.assertEqual(not_once, {}, "keys executed more than once")
        self.assertEqual(missing, [], "keys never executed")
        self.assertEqual(sum(execs.values()), KEYS)
        self.assertEqual(problems, [], "%d problems" % len(problems))
        self.assertEqual(conflicts, 0, "409s with a 10 s wait and a 50 ms action")
        self.assertEqual(forwarded, KEYS)
        self.assertEqual(identical, KEYS * (DUPS - 1))
        # A storm in which duplicates mostly arrive after the first finished
        # would test replays, not concurrent duplicates.
        self.assertGreaterEqual(waited, KEYS * (DUPS - 1) // 2,
                                "too few duplicates arrived while the first was running")


if __name__ == "__main__":
    unittest.main()
