"""test_stale_reader.py - a reader slot left by a killed process is cleared.

A process killed inside an LMDB read transaction leaves its slot in the
reader table, which pins the snapshot it read: writers cannot reuse any page
freed since, so the map fills. While another process keeps the environment
open (a running proxy) nothing resets the table, so the slot stays until a
reader check (mdb_reader_check) finds its process gone. idemproxy runs one
when a store is opened (so `idemproxy check-store` clears it) and every 10
seconds in each proxy's writer thread.

tests/faults/hold_reader ($HOLD_READER_BIN) takes the slot: it opens the
store, begins a read transaction, prints "ready" and sleeps until SIGKILL.
The reader table is read with `mdb_stat -r` (lmdb-utils), which lists it and
clears nothing.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import harness  # noqa: E402

WRITER_READER_CHECK_S = 10  # READER_CHECK_EVERY_MS in proxy/writer.c


def hold_reader_bin():
    path = os.environ.get("HOLD_READER_BIN") or os.path.join(
        harness.REPO, "build", "tests", "faults", "hold_reader")
    if not os.access(path, os.X_OK):
        raise RuntimeError("hold_reader not found at %s (set HOLD_READER_BIN)" % path)
    return path


def reader_pids(store_path):
    """The pids in the store's reader table."""
    # mdb_stat -r exits 1 after printing the table (it skips the database
    # statistics): its output, not its status, says whether it worked.
    run = subprocess.run(["mdb_stat", "-r", store_path], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, timeout=30)
    out = run.stdout.decode()
    if "Reader Table Status" not in out:
        raise RuntimeError("mdb_stat -r %s: %s%s" % (store_path, out, run.stderr.decode()))
    pids = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0].isdigit():
            pids.add(int(fields[0]))
    return pids


class StaleReaderCleared(harness.ProxyTestCase):

    def setUp(self):
        super().setUp()
        if shutil.which("mdb_stat") is None:
            raise RuntimeError("mdb_stat not found (install lmdb-utils)")

    def killed_reader(self):
        """Runs hold_reader on the store, waits for its read transaction,
        kills it with SIGKILL; returns its pid, whose slot is now stale."""
        proc = subprocess.Popen([hold_reader_bin(), self.store_path], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            line = proc.stdout.readline().decode().strip()
            if line != "ready":
                self.fail("hold_reader did not start: %r %s" % (line, proc.stderr.read().decode()))
            self.assertIn(proc.pid, reader_pids(self.store_path), "the reader has no slot")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        self.assertEqual(proc.returncode, -signal.SIGKILL)
        # The proxy keeps the environment open, so nothing resets the table:
        # the slot is stale, not gone.
        self.assertIn(proc.pid, reader_pids(self.store_path),
                      "the killed reader's slot vanished by itself: the test proves nothing")
        return proc.pid

    def test_check_store_clears_a_killed_readers_slot(self):
        proxy = self.start_proxy()
        pid = self.killed_reader()
        cs = subprocess.run([harness.binary(), "check-store", self.store_path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        self.assertEqual(cs.returncode, 0, cs.stderr.decode())
        summary = json.loads(cs.stdout.decode().splitlines()[-1])
        self.assertTrue(summary["ok"], summary)
        self.assertIn("stale_readers_cleared", summary)
        self.assertNotIn(pid, reader_pids(self.store_path), "check-store left the stale slot")
        # And the proxy, which saw none of this, still works.
        self.assertEqual(self.post(proxy, "after-reader-check").status, 201)

    def test_running_proxy_clears_a_killed_readers_slot(self):
        proxy = self.start_proxy()
        pid = self.killed_reader()
        gone = harness.wait_for(lambda: pid not in reader_pids(self.store_path),
                                timeout=WRITER_READER_CHECK_S + 10, interval=0.5)
        self.assertTrue(gone, "the proxy's writer did not clear the stale slot within %ds" % (
            WRITER_READER_CHECK_S + 10))
        self.assertEqual(self.post(proxy, "after-reader-check").status, 201)


if __name__ == "__main__":
    unittest.main()
