#!/usr/bin/env python3
"""Soak: a steady rate of keyed requests for a long time, 90 % new keys and
10 % replays of keys answered 1-5 s earlier, against one proxy.

What it proves:
  - executions == new keys: every new key runs exactly once (the upstream's
    fsync'ed log), no replay runs, and every replay returns the charge id its
    key was first answered with;
  - no memory growth: after the warm-up, the proxy's VmRSS (sampled from
    /proc/PID/status every second) never exceeds its value at the end of the
    warm-up by more than 10 %;
  - no descriptor leak: once the load stops and the clients have closed their
    connections, the proxy's descriptors (/proc/PID/fd) are those it had
    before the load, plus at most one idle upstream keep-alive connection
    per client (libcurl's connection cache, reused by the next request);
  - check-store passes at the end, with no record left IN_PROGRESS.

The route's TTL is 10 s and the store purges every second, so the store has
a steady size (about rate x TTL records). The warm-up starts with a burst:
every client sends flat out until 1.5 x that many requests have been sent,
so the high-water marks that concurrency and store size set (connection
pools, libcurl handles, group commits, the LMDB pages mapped) are reached
before the baseline is taken, however slow the machine. Then the load is
steady: a client that falls behind (a stalled machine) skips the missed
slots instead of bursting to catch up. The baseline is the highest VmRSS of
the warm-up (the burst and the first WARMUP seconds of steady load); after it
nothing may grow more than 10 % unless something leaks.
Under AddressSanitizer the allocator's quarantine is capped at 16 MiB for this
proxy (ASan's default, 256 MiB, fills over minutes and would read as growth).

CI: 60 s of steady load (the first 20 s are warm-up) at 150 requests/s, after
the burst; long (CHAOS_LONG=1): 30 min (5 min warm-up). CHAOS_SOAK_SECONDS, CHAOS_SOAK_WARMUP and CHAOS_SOAK_RATE
override; CHAOS_SOAK_SAMPLES=1 prints every sample.
"""

import os
import random
import threading
import time
import unittest

import chaoslib
from chaoslib import harness

TEST = "soak"
SECONDS = chaoslib.knob("SOAK_SECONDS", 60.0, 1800.0)
WARMUP = chaoslib.knob("SOAK_WARMUP", 20.0, 300.0)
RATE = chaoslib.knob("SOAK_RATE", 150.0, 150.0)
CLIENTS = 8
TTL_S = 10
# The warm-up starts with a burst: every client flat out until the store
# holds 1.5 x its steady size.
BURST_REQUESTS = int(RATE * TTL_S * 1.5)
MAX_LAG_S = 0.5
RSS_GROWTH_MAX = 0.10


class Soak(harness.ProxyTestCase):
    def test_steady_load_executes_new_keys_once_and_holds_memory_and_fds(self):
        rnd = chaoslib.rng(TEST)
        seed = rnd.randrange(1 << 30)
        t_start = time.monotonic()
        asan = os.environ.get("ASAN_OPTIONS")
        os.environ["ASAN_OPTIONS"] = (asan + ":" if asan else "") + "quarantine_size_mb=16"
        try:
            proxy = self.start_proxy(config=self.config(
                routes=[self.route(ttl="%ds" % TTL_S, lease="5s", heartbeat="1s", wait="3s")],
                store={"purge_interval": "1s"}))
        finally:
            if asan is None:
                del os.environ["ASAN_OPTIONS"]
            else:
                os.environ["ASAN_OPTIONS"] = asan
        pid = proxy.pid
        data_mdb = os.path.join(self.store_path, "data.mdb")
        time.sleep(0.5)  # the harness's "is it listening" connection is closed
        fds_before = chaoslib.fd_count(pid)

        lock = threading.Lock()
        nxt = [0]
        stop = threading.Event()
        steady = [None]  # when the steady load started (after the burst)
        answered = []  # (monotonic time, key, charge) of new keys, in order
        counts = {"new": 0, "replay": 0, "skipped": 0}
        max_lag = [0.0]
        problems = []

        def client(c):
            crnd = random.Random(seed + c)
            conn = None
            try:
                while not stop.is_set():
                    lag = 0.0
                    with lock:
                        i = nxt[0]
                        nxt[0] += 1
                        if i >= BURST_REQUESTS:
                            if steady[0] is None:
                                steady[0] = time.monotonic()
                            lag = time.monotonic() - (steady[0] + (i - BURST_REQUESTS) / RATE)
                            if lag > MAX_LAG_S:
                                # Behind: skip the missed slots, do not burst.
                                skip = int(lag * RATE)
                                nxt[0] += skip
                                counts["skipped"] += skip
                            max_lag[0] = max(max_lag[0], lag)
                    if lag < 0:
                        time.sleep(-lag)
                    if stop.is_set():
                        break
                    now = time.monotonic()
                    old = None
                    if crnd.random() < 0.10:
                        with lock:  # a key answered 1 to TTL/2 s ago
                            pool = [a for a in answered[-int(RATE * TTL_S):]
                                    if 1.0 <= now - a[0] <= TTL_S / 2.0]
                        if pool:
                            old = crnd.choice(pool)
                    key = old[1] if old else "soak-%d" % i
                    if conn is None:
                        conn = proxy.conn(timeout=10)
                    r = conn.request("POST", "/v1/payments",
                                     [("Content-Type", "application/json"),
                                      ("Idempotency-Key", key), ("X-Test-Delay-Ms", "5")],
                                     harness.PAYMENT_BODY)
                    if old:
                        with lock:
                            counts["replay"] += 1
                        if not (r.status == 201 and r.replayed and r.charge_id == old[2]):
                            problems.append("replay of %s: %r (first answer %s)"
                                            % (key, r, old[2]))
                    else:
                        with lock:
                            counts["new"] += 1
                            answered.append((time.monotonic(), key, r.charge_id))
                        if not (r.status == 201 and not r.replayed):
                            problems.append("new key %s: %r" % (key, r))
            except BaseException as e:  # noqa: BLE001 - reported below
                problems.append("client %d: %r" % (c, e))
            finally:
                if conn is not None:
                    conn.close()

        threads = [threading.Thread(target=client, args=(c,), daemon=True)
                   for c in range(CLIENTS)]
        for t in threads:
            t.start()
        self.addCleanup(stop.set)

        # Samples: (seconds since the steady load started - negative in the
        # burst -, VmRSS, RssAnon, RssFile, fds, data.mdb KiB).
        samples = []
        t_burst = time.monotonic()
        while len(problems) <= 20:
            now = time.monotonic()
            elapsed = now - steady[0] if steady[0] is not None else -1.0
            if elapsed >= SECONDS or now - t_burst > SECONDS + 120:
                break
            st = chaoslib.proc_status(pid)
            samples.append((elapsed, st["VmRSS"], st.get("RssAnon", 0), st.get("RssFile", 0),
                            chaoslib.fd_count(pid), os.path.getsize(data_mdb) // 1024))
            time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        self.assertEqual(problems[:10], [], "%d problems" % len(problems))
        self.assertIsNotNone(steady[0], "the burst never ended")
        load_s = time.monotonic() - steady[0]
        burst_s = steady[0] - t_burst
        warm = [s for s in samples if s[0] < WARMUP]
        after = [s for s in samples if s[0] >= WARMUP]
        self.assertTrue(warm and after, "too few samples: %r" % samples)
        # The baseline: the high-water marks of the warm-up (burst included).
        baseline = tuple(max(s[n] for s in warm) for n in range(len(warm[0])))

        # The clients are gone. What is left beyond the descriptors from
        # before the load may only be idle upstream connections.
        def leftover():
            peers = chaoslib.tcp_peers(pid)
            upstream = [fd for (fd, p) in peers.items() if p[1] == self.upstream.port]
            return chaoslib.fd_count(pid) - len(upstream), len(upstream)
        harness.wait_for(lambda: leftover()[0] <= fds_before, 15, interval=0.2)
        fds_other, fds_upstream = leftover()
        st_end = chaoslib.proc_status(pid)

        execs = {}
        for e in chaoslib.execution_log(self.upstream):
            execs[e["key"]] = execs.get(e["key"], 0) + 1
        not_once = {k: n for (k, n) in execs.items() if n != 1}
        check = chaoslib.check_store(self.store_path)

        peak = max(s[1] for s in after)
        growth = (peak - baseline[1]) / float(baseline[1])
        anon_growth = (max(s[2] for s in after) - baseline[2]) / float(max(baseline[2], 1))
        total = counts["new"] + counts["replay"]
        steady_requests = total - BURST_REQUESTS
        chaoslib.figure(
            TEST, burst_requests=BURST_REQUESTS, burst_s=round(burst_s, 1),
            seconds=round(load_s), warmup_s=WARMUP, target_rate=RATE,
            achieved_rate=round(steady_requests / load_s, 1), max_lag_s=round(max_lag[0], 2),
            skipped_slots=counts["skipped"], requests=total, new_keys=counts["new"],
            replays=counts["replay"], executions=sum(execs.values()),
            keys_not_once=len(not_once), rss_warm_kib=baseline[1], rss_peak_kib=peak,
            rss_end_kib=st_end["VmRSS"], rss_growth_pct=round(100 * growth, 1),
            anon_growth_pct=round(100 * anon_growth, 1),
            data_mdb_kib_warm=baseline[5], data_mdb_kib_end=samples[-1][5],
            fds_before=fds_before, fds_peak=max(s[4] for s in samples),
            fds_end=fds_other + fds_upstream, fds_end_idle_upstream=fds_upstream,
            store_records=check.summary and check.summary["records"],
            asan=chaoslib.sanitized(pid), test_s=round(time.monotonic() - t_start, 1))
        if os.environ.get("CHAOS_SOAK_SAMPLES"):
            for s in samples:
                print("sample t=%.0f rss=%d anon=%d file=%d fds=%d data_mdb_kib=%d" % s)
        self.assertEqual(not_once, {}, "keys executed other than once")
        self.assertEqual(sum(execs.values()), counts["new"], "executions != new keys")
        self.assertGreater(counts["replay"], 0)
        self.assertLessEqual(growth, RSS_GROWTH_MAX,
                             "VmRSS grew %.1f %% after the warm-up (%d -> %d KiB)"
                             % (100 * growth, baseline[1], peak))
        self.assertLessEqual(fds_other, fds_before,
                         "descriptors other than idle upstream connections: %d after the load, "
                         "%d before it: %r" % (fds_other, fds_before, chaoslib.fd_targets(pid)))
        self.assertLessEqual(fds_upstream, CLIENTS, "idle upstream connections")
        self.assertTrue(check.ok, repr(check))
        self.assertEqual(check.summary["in_progress"], 0, check.summary)
        self.assertGreaterEqual(steady_requests / load_s, 0.8 * RATE,
                                "the client could not keep the rate")


if __name__ == "__main__":
    unittest.main()
