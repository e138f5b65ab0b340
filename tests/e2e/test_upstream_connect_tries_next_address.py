#!/usr/bin/env python3
"""A connect that gets no answer (a host that is down drops it, and the
connect waits for upstream.connect_timeout) goes on to the name's next
address, as a refused one always did; nothing was sent, so the request
loses only the timeout. Before, it was answered 502 and released, even when
the next address would have answered: with a name that gives several
addresses (DNS round robin) and one of them down, a share of the requests
failed.

"Down" is played by a listener whose accept queue is full: the kernel drops
further connects to it without an answer, as for a host that is gone. The
name lives in /etc/hosts (hosts_file.py: needs root, as CI has). The
proxies here use the native upstream client whatever
IDEMPROXY_UPSTREAM_CLIENT says: libcurl does not do this (README.md)."""

import os
import socket
import time
import unittest

import harness
import hosts_file


class Unanswered:
    """host:port where connects get no answer: a listener that never accepts,
    its queue (of one) filled, so the kernel drops the SYNs that follow."""

    def __init__(self, host, port):
        self.ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind((host, port))
        self.ls.listen(0)
        self.fillers = []
        for _ in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex((host, port))
            self.fillers.append(s)
        time.sleep(0.1)
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect((host, port))
        except socket.timeout:
            pass
        else:
            self.close()
            raise RuntimeError("%s:%d still answers connects: the test cannot play a "
                               "host that is down" % (host, port))
        finally:
            probe.close()

    def close(self):
        for s in self.fillers:
            s.close()
        self.ls.close()


class ConnectTriesNextAddress(harness.ProxyTestCase):
    def setUp(self):
        super().setUp()
        self.hosts = hosts_file.entry_for(self, self._testMethodName[-8:])
        self.up = harness.Upstream(self.workdir, "up", host="127.0.0.3").start()
        self.addCleanup(self.up.stop)
        self.down = Unanswered("127.0.0.2", self.up.port)
        self.addCleanup(self.down.close)

    def proxy_for(self, connect_timeout, resolve_interval="30s"):
        cfg = self.config(upstream_url="http://%s:%d" % (self.hosts.name, self.up.port))
        cfg["upstream"]["connect_timeout"] = connect_timeout
        cfg["upstream"]["resolve_interval"] = resolve_interval
        # The native client's behaviour. libcurl 7.88, driven by socket
        # events as the proxy drives it, goes on to a name's next address
        # only once the whole connect_timeout has passed, and then fails.
        cfg["upstream"]["client"] = "native"
        return self.start_proxy(config=cfg)

    def test_connect_timeout_goes_on_to_the_next_address(self):
        self.hosts.add(2, 3)  # the first address is down
        got = [a[4][0] for a in socket.getaddrinfo(self.hosts.name, self.up.port,
                                                   type=socket.SOCK_STREAM)]
        self.assertEqual(got, ["127.0.0.2", "127.0.0.3"],
                         "getaddrinfo does not give the addresses in file order here")
        proxy = self.proxy_for("4s")
        for i in range(3):
            key = "round-robin-%d" % i
            t0 = time.monotonic()
            r = self.post(proxy, key)
            took = time.monotonic() - t0
            self.assertEqual(r.status, 201, "%s: %r" % (key, r))
            self.assertEqual(self.up.count(key), 1)
            if i == 0:
                # The down address was tried first (else this test shows
                # nothing): the answer came after its connect timeout.
                self.assertGreaterEqual(took, 0.9, "the first address was not tried first")
        self.assertTrue(self.post(proxy, "round-robin-0").replayed)

        # The down address is tried last for a while, by every worker: new
        # connections (three requests at once, each holding one for 0.5 s)
        # do not wait for its connect timeout again.
        t0 = time.monotonic()
        busy = [harness.in_thread(self.post, proxy, "at-once-%d" % i,
                                  headers=[("X-Test-Delay-Ms", "500")]) for i in range(3)]
        for i, b in enumerate(busy):
            self.assertEqual(b.result(15).status, 201)
            self.assertEqual(self.up.count("at-once-%d" % i), 1)
        # (waiting for it would take 4.5 s; the rest is room for a loaded machine)
        self.assertLess(time.monotonic() - t0, 3.0,
                        "a new connection waited for the down address's connect timeout")
        new_conns = [e for e in self.up.entries()
                     if e["key"].startswith("at-once-") and e["conn_seq"] == 1]
        self.assertGreaterEqual(len(new_conns), 1, "the requests needed no new connection")

    def test_connect_timeout_goes_on_to_a_moved_name(self):
        """The name moves while a connect to its old address waits for an
        answer: when that connect times out, the request goes to the new
        address, not back to the client as 502."""
        self.hosts.add(2)
        proxy = self.proxy_for("3s", resolve_interval="1s")
        pending = harness.in_thread(self.post, proxy, "mid-move")
        time.sleep(0.5)
        self.hosts.move(3)  # looked up again within a second
        r = pending.result(15)
        self.assertEqual(r.status, 201, "the request whose connect outlived the move: %r" % r)
        self.assertEqual(self.up.count("mid-move"), 1)


if __name__ == "__main__":
    unittest.main()
