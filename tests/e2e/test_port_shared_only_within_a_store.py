#!/usr/bin/env python3
"""The listen port is shared only by processes on the same store. Listeners
use SO_REUSEPORT, so a second process could join the port and the kernel
would split new connections between them: with another store behind it, a
client's retry landing there runs the request again. A second idemproxy on
another store, or a foreign SO_REUSEPORT listener, makes idemproxy refuse to
start; a second idemproxy on the same store shares the port (rolling
restarts), and the port is released for any store once it stops."""

import json
import os
import socket
import subprocess
import time
import unittest

import harness


class PortSharedOnlyWithinAStore(harness.ProxyTestCase):
    def run_second(self, port, store, timeout=10):
        """Starts idemproxy with the tests' configuration on port and store;
        returns the process and its stderr (running, or refused)."""
        cfg_path = os.path.join(self.workdir, "second.json")
        with open(cfg_path, "w") as f:
            json.dump(self.config(listen="127.0.0.1:%d" % port), f)
        err_path = os.path.join(self.workdir, "second.stderr")
        self.second_log = os.path.join(self.workdir, "second.stdout")
        err = open(err_path, "wb")
        out = open(self.second_log, "wb")
        proc = subprocess.Popen([harness.binary(), "--config", cfg_path,
                                 "--listen", "127.0.0.1:%d" % port, "--store", store],
                                cwd=self.workdir, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err)
        err.close()
        out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            with open(err_path, "rb") as f:
                if b"listening on" in f.read():
                    break
            time.sleep(0.02)
        with open(err_path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        return proc, text

    def stop_second(self, proc):
        if proc.poll() is None:
            proc.terminate()
        return proc.wait(15)

    def keys_all_executed_once(self, proxy, prefix, n):
        for i in range(n):
            key = "%s-%d" % (prefix, i)
            self.assertExecuted(self.post(proxy, key))
            self.assertEqual(self.upstream.count(key), 1)

    def test_another_store_on_the_port_is_refused(self):
        first = self.start_proxy()
        other_store = os.path.join(self.workdir, "other-store")
        proc, text = self.run_second(first.port, other_store)
        if proc.poll() is None:
            self.stop_second(proc)
            self.fail("a proxy on another store joined port %d: %s" % (first.port, text))
        self.assertNotEqual(proc.returncode, 0, text)
        self.assertIn("already in use", text)
        self.assertIn(other_store, text)
        # Every new connection still reaches the first proxy and its store:
        # each key runs once, and its retry replays.
        for i in range(40):
            key = "after-refusal-%d" % i
            r = self.post(first, key)
            self.assertExecuted(r)
            self.assertReplayOf(self.post(first, key), r)
            self.assertEqual(self.upstream.count(key), 1)

    def test_a_foreign_reuseport_listener_is_refused(self):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.addCleanup(sock.close)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        proc, text = self.run_second(port, self.store_path)
        if proc.poll() is None:
            self.stop_second(proc)
            self.fail("idemproxy joined a foreign SO_REUSEPORT listener: %s" % text)
        self.assertNotEqual(proc.returncode, 0, text)
        self.assertIn("already in use", text)

    def test_the_same_store_shares_the_port_and_takes_over(self):
        first = self.start_proxy()
        r = self.post(first, "shared-0")
        self.assertExecuted(r)
        second, text = self.run_second(first.port, self.store_path)
        self.assertIsNone(second.poll(), "a proxy on the same store did not start: %s" % text)
        try:
            # Connections now land on either process; both read one store.
            for i in range(30):
                self.assertReplayOf(self.post(first, "shared-0"), r)
            self.assertEqual(self.upstream.count("shared-0"), 1)
            self.assertTrue(harness.wait_for(lambda: os.path.getsize(self.second_log) > 0),
                            "the kernel sent the second process no connection")
            # The first one leaves (rolling restart); the port keeps answering.
            self.assertEqual(first.stop(), 0)
            self.assertReplayOf(self.post(first, "shared-0"), r)
            self.keys_all_executed_once(first, "after-handover", 10)
        finally:
            self.assertEqual(self.stop_second(second), 0)

    def test_the_port_is_free_for_another_store_after_stop(self):
        first = self.start_proxy()
        port = first.port
        self.assertEqual(first.stop(), 0)
        other_store = os.path.join(self.workdir, "other-store")
        proc, text = self.run_second(port, other_store)
        self.assertIsNone(proc.poll(), "port %d not released at stop: %s" % (port, text))
        self.assertEqual(self.stop_second(proc), 0)


if __name__ == "__main__":
    unittest.main()
