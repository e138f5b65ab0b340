#!/usr/bin/env python3
"""Diagnostics on stderr never block the proxy, and clients cannot flood them
(README, Command line). stderr may be a pipe whose reader stopped: a worker
that blocks writing libmicrohttpd's message about a client, or the store
writer blocked writing a failure, stops every request; the drain's own lines
must not hold up the exit either. And any client can make libmicrohttpd say
something ("Failed to parse `Content-Length' header"),
so those messages are rate-limited for the whole process and the rest are
counted."""

import fcntl
import json
import os
import re
import socket
import subprocess
import time
import unittest

import harness

# libmicrohttpd says two lines about each ("Failed to parse `Content-Length'
# header", "Error processing request"), answers 400 and closes.
MALFORMED = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"
PER_S = 5  # proxy/diag.h DIAG_CLIENT_PER_S


def malformed(port, n):
    """n clients that send a malformed request and read the 400."""
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(MALFORMED)
            got = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            assert got.startswith(b"HTTP/1.1 400"), got[:100]


class FullStderrProxy(harness.Proxy):
    """A proxy whose stderr is a one-page pipe that the test fills itself
    once the proxy has said it listens, and never reads again."""

    def start(self, attempts=3):
        for _ in range(attempts):
            self.port = harness.free_port()
            self.config["listen"] = "127.0.0.1:%d" % self.port
            with open(self.config_path, "w") as f:
                json.dump(self.config, f, indent=2)
            self.pipe_r, self.pipe_w = os.pipe()
            fcntl.fcntl(self.pipe_w, fcntl.F_SETPIPE_SZ, 4096)
            out = open(self.stdout_path, "ab")
            try:
                self.proc = subprocess.Popen([harness.binary(), "--config", self.config_path],
                                             stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=self.pipe_w, cwd=self.workdir)
            finally:
                out.close()
            seen = b""
            deadline = time.monotonic() + harness.START_TIMEOUT_S
            want = ("listening on 127.0.0.1:%d," % self.port).encode()
            os.set_blocking(self.pipe_r, False)
            while want not in seen and time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    seen += os.read(self.pipe_r, 4096)
                except BlockingIOError:
                    time.sleep(0.01)
            self.early = seen
            if want in seen:
                self.fill()
                return self
            self.proc.kill()
            self.proc.wait()
            os.close(self.pipe_r)
            os.close(self.pipe_w)
        raise RuntimeError("proxy %s did not start: %r" % (self.name, self.early))

    def fill(self):
        """Fills the pipe from our own end: from now on any write the proxy
        makes to stderr blocks (or fails), as with a reader that stopped."""
        # A description of our own: O_NONBLOCK on the proxy's would make
        # its writes fail instead of block, hiding what this tests.
        fd = os.open("/proc/self/fd/%d" % self.pipe_w, os.O_WRONLY | os.O_NONBLOCK)
        filled = 0
        try:
            while True:
                filled += os.write(fd, b"x" * 512)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        self.filled = filled

    def stderr(self):
        return self.early.decode(errors="replace") + "\n(stderr is a pipe the test filled)"


class UnreadStderrNeverBlocks(harness.ProxyTestCase):
    def test_full_stderr_blocks_neither_requests_nor_exit(self):
        proxy = FullStderrProxy(self.workdir, self.config(), "fullerr")
        self.proxies.append(proxy)
        proxy.start()
        self.addCleanup(os.close, proxy.pipe_r)
        self.addCleanup(os.close, proxy.pipe_w)
        self.assertGreaterEqual(proxy.filled, 4096)

        # Each of these makes libmicrohttpd say something on stderr, on
        # whichever worker the kernel gave the connection to.
        malformed(proxy.port, 40)
        time.sleep(0.5)
        # Every worker still serves: several connections, so both workers
        # (SO_REUSEPORT spreads them) get one. Generous timeouts: a blocked
        # worker never answers.
        for i in range(8):
            r = harness.request(proxy.port, "POST", "/v1/payments",
                                [("Idempotency-Key", "full-stderr-%d" % i)], b'{"amount":1}',
                                timeout=10.0)
            self.assertEqual(r.status, 201, r)
            malformed(proxy.port, 5)

        # The drain says "draining" and "stopped" on stderr: still full.
        self.assertEqual(proxy.stop(), 0)
        self.assertEqual(self.upstream.total(), 8)

    def test_messages_clients_cause_are_rate_limited(self):
        proxy = self.start_proxy()
        start = time.monotonic()
        malformed(proxy.port, 400)
        # libmicrohttpd notices each close on its next pass; give it time.
        time.sleep(1.5)
        malformed(proxy.port, 1)  # in a later second: says what was held back
        time.sleep(0.5)
        elapsed = time.monotonic() - start
        lines = [l for l in proxy.stderr().splitlines() if "libmicrohttpd:" in l]
        # At most PER_S a second (+1 for the second boundaries at each end).
        self.assertLessEqual(len(lines), PER_S * (int(elapsed) + 2), "\n".join(lines))
        self.assertGreater(len(lines), 0)
        held = [int(n) for n in re.findall(r"\((\d+) more such messages suppressed\)",
                                           "\n".join(lines))]
        self.assertTrue(held, "\n".join(lines))
        # Every message is said or counted (two per malformed request).
        self.assertGreaterEqual(len(lines) + sum(held), 2 * 400, "\n".join(lines))


if __name__ == "__main__":
    unittest.main()
