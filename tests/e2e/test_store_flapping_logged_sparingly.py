#!/usr/bin/env python3
"""A store that flaps between full and not full (a small map whose records
expire while new keys keep coming: each purge frees a little room, which
new keys take at once) is said on stderr sparingly: at most about one line
per second for the full condition and one for its recovery, each naming the
cause, not a pair of lines per write batch."""

import collections
import threading
import time
import unittest

import harness

RUN_S = 6.0
THREADS = 8


class FlappingStore(harness.ProxyTestCase):
    def test_flapping_full_store_logs_at_most_about_a_line_per_second(self):
        cfg = self.config(routes=[self.route(ttl="1s", wait="0s")],
                          store={"map_size": "1MiB", "purge_interval": "200ms"},
                          server={"per_ip_connections": 0})
        proxy = self.start_proxy(config=cfg)
        statuses = collections.Counter()
        lock = threading.Lock()
        stop = time.monotonic() + RUN_S

        def load(t):
            i = 0
            while time.monotonic() < stop:
                i += 1
                try:
                    r = self.post(proxy, "flap-%d-%d" % (t, i),
                                  headers=[("X-Test-Fault", "huge"), ("X-Test-Size", "2048")])
                    st = r.status
                except Exception:  # noqa: BLE001 - counted, not fatal
                    st = "error"
                with lock:
                    statuses[st] += 1

        started = time.monotonic()
        threads = [threading.Thread(target=load, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        lines = [l for l in proxy.stderr().splitlines() if "idemproxy: store:" in l]
        self.assertGreater(statuses[503], 0, "the store never filled up: %r" % statuses)
        self.assertGreater(statuses[201], 0, "nothing stored: %r" % statuses)
        self.assertTrue([l for l in lines if "MDB_MAP_FULL" in l],
                        "no line names the full map: %r" % lines[:6])
        # One line per second per condition (full; recovered), with slack.
        self.assertLessEqual(len(lines), 2 * int(elapsed + 1) + 4,
                             "%d store lines in %.1fs (%r): %r" % (
                                 len(lines), elapsed, dict(statuses), lines[:10]))


if __name__ == "__main__":
    unittest.main()
