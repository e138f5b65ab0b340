#!/usr/bin/env python3
"""A proxy started with stdin, stdout or stderr closed (`idemproxy ... >&-`)
works as if it were /dev/null: the store's files never take descriptor 0, 1
or 2 (the access log or a diagnostic would be written into lock.mdb or
data.mdb), requests are answered, replays work, SIGTERM exits 0 and
`check-store` finds the store sound."""

import json
import os
import subprocess
import time
import unittest

import harness

KEYS = ["closed-fd-key-%d" % i for i in range(3)]


def listening(pid, port):
    """Whether process pid holds a TCP socket listening on port (its stderr
    may be closed: no "listening on" line to wait for, and a connection to
    the port could reach another test's proxy that took it first)."""
    inodes = set()
    try:
        names = os.listdir("/proc/%d/fd" % pid)
    except OSError:
        return False
    for name in names:
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, name))
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:
                return True
    return False


class ClosedFdProxy(harness.Proxy):
    """A proxy whose descriptor closed_fd is closed when it starts."""

    def __init__(self, workdir, config, name, closed_fd):
        super().__init__(workdir, config, name)
        self.closed_fd = closed_fd

    def start(self, attempts=3):
        fd = self.closed_fd
        for _ in range(attempts):
            self.port = harness.free_port()
            self.config["listen"] = "127.0.0.1:%d" % self.port
            with open(self.config_path, "w") as f:
                json.dump(self.config, f, indent=2)
            out = open(self.stdout_path, "ab")
            err = open(self.stderr_path, "ab")
            try:
                # preexec_fn runs in the child after stdin/stdout/stderr
                # are set up and before exec: the binary starts with fd
                # closed, as under `sh -c 'exec idemproxy ... >&-'`.
                self.proc = subprocess.Popen(
                    [harness.binary(), "--config", self.config_path],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=self.workdir,
                    preexec_fn=lambda: os.close(fd))
            finally:
                out.close()
                err.close()
            deadline = time.monotonic() + harness.START_TIMEOUT_S
            while time.monotonic() < deadline and self.proc.poll() is None:
                if listening(self.proc.pid, self.port):
                    return self
                time.sleep(0.02)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        raise RuntimeError("proxy %s (fd %d closed) did not start (exit %r): %s" % (
            self.name, fd, self.proc.returncode, self.stderr()))


class ClosedStdFdsReopened(harness.ProxyTestCase):
    def run_with_closed(self, fd):
        proxy = ClosedFdProxy(self.workdir, self.config(), "closed%d" % fd, fd)
        self.proxies.append(proxy)
        proxy.start()

        target = os.readlink("/proc/%d/fd/%d" % (proxy.pid, fd))
        self.assertEqual(target, "/dev/null", "fd %d of the proxy is %s" % (fd, target))
        for std in (0, 1, 2):
            link = os.readlink("/proc/%d/fd/%d" % (proxy.pid, std))
            self.assertFalse(link.startswith(self.store_path), "fd %d is %s" % (std, link))

        firsts = {}
        for k in KEYS:
            r = self.post(proxy, k)
            self.assertExecuted(r)
            firsts[k] = r
        for k in KEYS:
            self.assertReplayOf(self.post(proxy, k), firsts[k])
            self.assertEqual(self.upstream.count(k), 1)

        self.assertEqual(proxy.stop(), 0, proxy.stderr()[-2000:])

        check = subprocess.run([harness.binary(), "check-store", self.store_path],
                               capture_output=True, timeout=30)
        self.assertEqual(check.returncode, 0, check)
        summary = json.loads(check.stdout)
        self.assertTrue(summary["ok"], summary)
        self.assertEqual(summary["complete"], len(KEYS), summary)
        for name in ("lock.mdb", "data.mdb"):
            with open(os.path.join(self.store_path, name), "rb") as f:
                data = f.read()
            for text in (b'"outcome"', b"idemproxy:"):
                self.assertNotIn(text, data, "%r written into %s" % (text, name))

    def test_stdin_closed(self):
        self.run_with_closed(0)

    def test_stdout_closed(self):
        self.run_with_closed(1)

    def test_stderr_closed(self):
        self.run_with_closed(2)


if __name__ == "__main__":
    unittest.main()
