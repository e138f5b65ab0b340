#!/usr/bin/env python3
"""The upstream's host name is looked up again (upstream.resolve_interval),
so new connections follow a changed DNS answer without a restart, and a
name that did not resolve at start (DNS not ready yet) starts working once
it does. Before, the native client resolved once at start: a moved upstream
got 502s until a restart, and one unresolvable at start stayed so.

The name is a line of /etc/hosts, which getaddrinfo reads on every lookup:
appended for the test, its last address byte rewritten in place to move it
(127.0.0.2 -> 127.0.0.3, two upstreams on one port), the file cut back to
its old length at the end. This needs root, as CI and the Quick start have;
without it the test fails and says so rather than skipping."""

import os
import time
import unittest

import harness
import hosts_file


class NameResolvedAgain(harness.ProxyTestCase):
    def setUp(self):
        super().setUp()
        self.hosts = hosts_file.entry_for(self, self._testMethodName[-8:])

    def proxy_for(self, port, interval="1s", workers=None):
        cfg = self.config(upstream_url="http://%s:%d" % (self.hosts.name, port))
        cfg["upstream"]["resolve_interval"] = interval
        if workers is not None:
            cfg["server"] = {"workers": workers}
        return self.start_proxy(config=cfg)

    def two_upstreams_on_one_port(self):
        """An upstream on 127.0.0.2 and one on 127.0.0.3 with the same port:
        the kernel's pick for the first, which some other socket of this
        host (the tests run in parallel) may hold on 127.0.0.3. Such a
        collision is retried with another port, a few times."""
        for attempt in range(5):
            old = harness.Upstream(self.workdir, "old-%d" % attempt, host="127.0.0.2").start()
            try:
                new = harness.Upstream(self.workdir, "new-%d" % attempt, host="127.0.0.3",
                                       port=old.port).start()
            except RuntimeError as e:
                old.stop()
                if "address already in use" not in str(e) or attempt == 4:
                    raise
                continue
            self.addCleanup(old.stop)
            self.addCleanup(new.stop)
            return old, new
        raise AssertionError("unreachable")

    def test_new_connections_follow_a_moved_name(self):
        old, new = self.two_upstreams_on_one_port()
        self.hosts.add(2)
        proxy = self.proxy_for(old.port)

        first = self.post(proxy, "before-move")
        self.assertEqual(first.status, 201, first)
        self.assertEqual(old.count("before-move"), 1)

        # The name moves; a few resolve intervals later the old instance
        # goes away (its connections close). The next request needs a new
        # connection, which goes to the new address at once: no 502.
        self.hosts.move(3)
        time.sleep(3.0)
        old.stop()
        time.sleep(0.5)  # the proxy sees the pooled connections close
        after = self.post(proxy, "after-move")
        self.assertEqual(after.status, 201, "the first request after the move: %r" % after)
        self.assertEqual(new.count("after-move"), 1)
        self.assertEqual(new.count("before-move"), 0)
        self.assertTrue(self.post(proxy, "before-move").replayed)
        self.assertTrue(proxy.running())

    def test_pooled_connections_leave_a_moved_name(self):
        """The old address still answers after the move: connections pooled
        to it, and one busy on it during the move, are not used again, so
        traffic follows the name rather than staying where it was."""
        old, new = self.two_upstreams_on_one_port()
        self.hosts.add(2)
        proxy = self.proxy_for(old.port, workers=1)
        for i in range(4):
            self.assertEqual(self.post(proxy, "pooled-%d" % i).status, 201)
        self.assertEqual(old.total(), 4)
        if os.environ.get("IDEMPROXY_UPSTREAM_CLIENT") != "libcurl":
            # Lookups that give the same addresses leave connections alone
            # (libcurl renews its connections every resolve interval).
            time.sleep(2.5)
            self.assertEqual(self.post(proxy, "still-pooled").status, 201)
            seq = [e["conn_seq"] for e in old.entries() if e["key"] == "still-pooled"]
            self.assertEqual(seq, [5], "a connection was dropped though the name did not move")
        busy = harness.in_thread(self.post, proxy, "busy",
                                 headers=[("X-Test-Delay-Ms", "2500")])
        self.assertTrue(harness.wait_for(lambda: old.count("busy") == 1, 3.0))

        self.hosts.move(3)
        self.assertEqual(busy.result(10).status, 201)  # finished where it began
        time.sleep(0.5)  # (2.5 s after the move: the name was looked up again)
        for i in range(6):
            key = "moved-%d" % i
            self.assertEqual(self.post(proxy, key).status, 201)
            self.assertEqual((old.count(key), new.count(key)), (0, 1),
                             "%s went to the old address" % key)

    def test_literal_address_keeps_its_connections(self):
        """An upstream given as an IP address cannot move: its pooled
        connections are reused across resolve intervals (libcurl used to
        renew them every interval all the same)."""
        cfg = self.config()  # the upstream at 127.0.0.1
        cfg["upstream"]["resolve_interval"] = "1s"
        cfg["server"] = {"workers": 1}  # (one pool)
        proxy = self.start_proxy(config=cfg)
        for i in range(3):
            if i:
                time.sleep(1.6)  # past the interval, within idle_timeout (4 s)
            self.assertEqual(self.post(proxy, "literal-%d" % i).status, 201)
        seqs = [e["conn_seq"] for e in self.upstream.entries()
                if e["key"].startswith("literal-")]
        self.assertEqual(seqs, [1, 2, 3], "a connection to a literal address was renewed")

    def test_name_that_resolves_late_starts_working(self):
        up = harness.Upstream(self.workdir, "late", host="127.0.0.2").start()
        self.addCleanup(up.stop)
        proxy = self.proxy_for(up.port)  # the name is not in /etc/hosts yet
        # The name is looked up at start, and the proxy says it is missing.
        self.assertTrue(harness.wait_for(lambda: "does not resolve" in proxy.stderr()),
                        "no warning at start: %r" % proxy.stderr()[-500:])
        early = self.post(proxy, "too-early")
        self.assertProblem(early, 502)
        self.assertEqual(up.count("too-early"), 0)

        self.hosts.add(2)
        # A lookup already under way (a DNS server that is slow to say
        # "no such name") finishes first: allow for the resolver's timeout.
        deadline = time.monotonic() + 40.0
        r = None
        while time.monotonic() < deadline:
            r = self.post(proxy, "too-early")  # released: the same key may run
            if r.status == 201:
                break
            self.assertEqual(r.status, 502, r)
            time.sleep(0.2)
        self.assertEqual(r.status, 201, "the name resolved, the proxy never used it: %r" % r)
        self.assertEqual(up.count("too-early"), 1)

    def test_unresolved_name_is_tried_every_second(self):
        """With no traffic at all to ask for it, a name that did not resolve
        at start is looked up again every second, not every interval: the
        first request after DNS is ready already gets through."""
        up = harness.Upstream(self.workdir, "quiet", host="127.0.0.2").start()
        self.addCleanup(up.stop)
        proxy = self.proxy_for(up.port, interval="1h")
        self.assertTrue(harness.wait_for(lambda: "does not resolve" in proxy.stderr()),
                        "no warning at start: %r" % proxy.stderr()[-500:])
        self.hosts.add(2)
        time.sleep(2.5)
        r = self.post(proxy, "first-ever")
        self.assertEqual(r.status, 201, "the first request after the name resolved: %r" % r)
        self.assertEqual(up.count("first-ever"), 1)


if __name__ == "__main__":
    unittest.main()
