#!/usr/bin/env python3
"""A pooled upstream connection idle for upstream.idle_timeout is closed, never
reused, so no request is written into a connection the upstream is closing.

Upstream servers close idle keep-alive connections on their own timer (Node.js,
uvicorn and Apache after 5 s, gunicorn after 2 s). A request written into such
a connection at that moment is never read; for a keyed POST the proxy cannot
know that, so it may not send it again: the client gets 502 and has to retry.
The upstream here plays that race deterministically (upstream.py
--idle-close-ms): a request on a connection idle 3 s or longer is closed
unanswered. The proxy's idle_timeout is 2 s, the least libcurl takes."""

import os
import time
import unittest

import harness

UPSTREAM_IDLE_CLOSE_MS = 3000


def established_to(port):
    """Established TCP connections to 127.0.0.1:port, from /proc/net/tcp."""
    n = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[2] == "0100007F:%04X" % port and fields[3] == "01":
                n += 1
    return n


class IdleConnectionNotReused(harness.ProxyTestCase):
    def setUp(self):
        super().setUp()
        self.closer = harness.Upstream(self.workdir, name="closer",
                                       args=["--idle-close-ms", str(UPSTREAM_IDLE_CLOSE_MS)])
        self.closer.start()
        self.addCleanup(self.closer.stop)

    def proxy(self, idle_timeout, name):
        cfg = self.config(upstream_url=self.closer.url, server={"workers": 1})
        cfg["upstream"]["idle_timeout"] = idle_timeout
        return self.start_proxy(config=cfg, name=name)

    def executed_on(self, key):
        """conn_seq of key's execution: 1 on a new upstream connection."""
        found = [e for e in self.closer.entries() if e["key"] == key]
        self.assertEqual(len(found), 1, found)
        return found[0]["conn_seq"]

    def test_idle_connection_closed_before_the_upstream_does(self):
        p = self.proxy("2s", "short")
        self.assertExecuted(self.post(p, "idle-a"))
        self.assertExecuted(self.post(p, "idle-b"))
        # Within the idle timeout the pooled connection is reused.
        self.assertEqual(self.executed_on("idle-b"), 2)

        time.sleep(UPSTREAM_IDLE_CLOSE_MS / 1000 + 0.5)
        r = self.post(p, "idle-c")
        self.assertExecuted(r)
        self.assertEqual(self.executed_on("idle-c"), 1)  # a new connection
        self.assertEqual(self.closer.idle_closed(), 0)

        if self.proxy_client() == "native":
            # Closed by the proxy's own sweep, without a request asking.
            self.assertEqual(established_to(self.closer.port), 1)
            self.assertTrue(harness.wait_for(lambda: established_to(self.closer.port) == 0, 4.0),
                            "the idle upstream connection is still open")

    def test_longer_than_the_upstreams_timeout_loses_the_race(self):
        # What the setting prevents: a keyed POST written into a connection
        # the upstream drops is an unknown outcome, answered 502 and
        # released, so the client's retry runs it, once.
        p = self.proxy("30s", "long")
        self.assertExecuted(self.post(p, "race-a"))
        time.sleep(UPSTREAM_IDLE_CLOSE_MS / 1000 + 0.5)
        r = self.post(p, "race-b")
        self.assertProblem(r, 502)
        self.assertEqual(self.closer.idle_closed(), 1)
        retry = self.post(p, "race-b")
        self.assertExecuted(retry)
        self.assertEqual(self.closer.count("race-b"), 1)

    def proxy_client(self):
        return os.environ.get("IDEMPROXY_UPSTREAM_CLIENT") or "native"


if __name__ == "__main__":
    unittest.main()
