#!/usr/bin/env python3
"""A stdout nobody reads (a pipe whose reader stopped) never blocks request
handling or the SIGTERM exit: access-log lines that cannot be written are
dropped, counted, and the count is said on stderr ("access log: N lines
dropped, stdout not being read"); every line is either written whole or
counted."""

import concurrent.futures
import fcntl
import json
import os
import re
import subprocess
import time
import unittest

import harness

THREADS = 4
PER_THREAD = 400  # with the long paths, several times what stdout and the buffer hold
PATH = "/v1/not-covered/" + "p" * 400
DROPPED = re.compile(r"access log: (\d+) lines dropped, stdout not being read \((\d+) in total\)")


class UnreadStdoutProxy(harness.Proxy):
    """A proxy whose stdout is a small pipe that the test never reads."""

    def start(self, attempts=3):
        for _ in range(attempts):
            self.port = harness.free_port()
            self.config["listen"] = "127.0.0.1:%d" % self.port
            with open(self.config_path, "w") as f:
                json.dump(self.config, f, indent=2)
            self.pipe_r, pipe_w = os.pipe()
            # One page: a few lines fill it (64 KiB by default).
            fcntl.fcntl(pipe_w, fcntl.F_SETPIPE_SZ, 4096)
            err = open(self.stderr_path, "ab")
            self._stderr_offset = err.tell()
            try:
                self.proc = subprocess.Popen([harness.binary(), "--config", self.config_path],
                                             stdin=subprocess.DEVNULL, stdout=pipe_w, stderr=err,
                                             cwd=self.workdir)
            finally:
                os.close(pipe_w)
                err.close()
            if self._wait_listening():
                return self
            os.close(self.pipe_r)
        raise RuntimeError("proxy %s did not start (exit %r): %s" % (
            self.name, self.proc.returncode, self.stderr()))

    def read_pipe(self):
        """What the proxy wrote to stdout (once it has exited)."""
        os.set_blocking(self.pipe_r, False)
        data = b""
        try:
            while True:
                chunk = os.read(self.pipe_r, 65536)
                if not chunk:
                    break
                data += chunk
        except BlockingIOError:
            pass
        return data


class UnreadStdoutNeverBlocks(harness.ProxyTestCase):
    def test_requests_and_sigterm_go_on_and_drops_are_counted(self):
        proxy = UnreadStdoutProxy(self.workdir, self.config(), "unread")
        self.proxies.append(proxy)
        proxy.start()
        self.addCleanup(os.close, proxy.pipe_r)

        def client(n):
            statuses = []
            # Generous: an answer takes milliseconds; a blocked worker never answers.
            with proxy.conn(timeout=20.0) as c:
                for _ in range(n):
                    r = c.request("GET", PATH, [("Host", "x")])
                    statuses.append(r.status)
            return statuses

        with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
            results = list(pool.map(client, [PER_THREAD] * THREADS))
        total = THREADS * PER_THREAD
        statuses = [s for r in results for s in r]
        self.assertEqual(len(statuses), total)
        self.assertEqual(set(statuses), {201})

        # Operators are told, while it happens.
        self.assertTrue(harness.wait_for(lambda: DROPPED.search(proxy.stderr()), 10),
                        proxy.stderr()[-2000:])

        # SIGTERM still drains and exits, stdout still unread (the stop gives
        # the log a couple of seconds; STOP_TIMEOUT_S leaves ample slack).
        self.assertEqual(proxy.stop(), 0, proxy.stderr()[-2000:])

        # Each line was either written whole or counted as dropped: the last
        # report's total plus the whole lines in the pipe is every request.
        reports = DROPPED.findall(proxy.stderr())
        self.assertTrue(reports)
        self.assertEqual(sum(int(n) for n, _ in reports), int(reports[-1][1]), reports)
        dropped = int(reports[-1][1])
        data = proxy.read_pipe()
        whole = data[:data.rfind(b"\n") + 1].splitlines()
        for line in whole:
            entry = json.loads(line)
            self.assertEqual(entry["status"], 201, entry)
        self.assertGreater(dropped, 0)
        self.assertEqual(len(whole) + dropped, total,
                         "%d lines written, %d dropped, %d requests" % (len(whole), dropped, total))


if __name__ == "__main__":
    unittest.main()
