#!/usr/bin/env python3
"""A damaged store is refused at start-up, not served (README, Store): the
proxy exits 1 with a line on stderr naming the store, the data file's size and
the size LMDB needs. A data.mdb cut short used to kill the proxy with SIGBUS
(LMDB maps the file and read a page past its end); one cut to 0 bytes was
silently reinitialised as an empty store, so every stored key would have run
again. The store here is written by the proxy and stopped with SIGTERM before
it is cut."""

import json
import os
import signal
import subprocess
import unittest

import harness


class DamagedStoreRefused(harness.ProxyTestCase):
    def written_store(self):
        cfg = self.config()
        proxy = self.start_proxy(config=cfg, name="writer")
        first = self.post(proxy, "damaged-1")
        self.assertExecuted(first)
        self.assertExecuted(self.post(proxy, "damaged-2"))
        self.assertEqual(proxy.stop(), 0, proxy.stderr())
        return cfg, first

    def lmdb_needs(self):
        """The bytes of data.mdb in use, as `idemproxy check-store` says."""
        p = subprocess.run([harness.binary(), "check-store", self.store_path],
                           capture_output=True, timeout=60)
        self.assertEqual(p.returncode, 0, p)
        return json.loads(p.stdout.decode().splitlines()[-1])["map_used_bytes"]

    def start_on(self, cfg, name):
        """Runs a proxy on the store and returns (exit status, stderr) once it
        exits; one still running after the start timeout is a failure."""
        p = harness.Proxy(self.workdir, cfg, name)
        self.proxies.append(p)
        p.stop_called = True  # it is expected to exit by itself
        try:
            p.start(attempts=1)
        except RuntimeError:
            pass
        rc = p.wait_exit(timeout=harness.START_TIMEOUT_S)
        if rc is None:
            p.stop()
            self.fail("proxy %s served a damaged store: %s" % (name, p.stderr()))
        return rc, p.stderr()

    def test_truncated_store_refused(self):
        cfg, _ = self.written_store()
        path = os.path.join(self.store_path, "data.mdb")
        need = self.lmdb_needs()
        # Keep the two meta pages (LMDB's page is 4 KiB here): every tree
        # page is gone.
        os.truncate(path, 8192)
        rc, err = self.start_on(cfg, "cut")
        self.assertNotEqual(rc, -signal.SIGBUS, "SIGBUS: %s" % err)
        self.assertEqual(rc, 1, err)
        self.assertIn("idemproxy: store %s is damaged: data.mdb is 8192 bytes, LMDB needs %d; "
                      "restore it from a backup" % (self.store_path, need), err)
        self.assertEqual(os.path.getsize(path), 8192, "the proxy changed the damaged file")
        self.assertEqual(self.upstream.total(), 2)

    def test_emptied_store_refused_not_reinitialised(self):
        cfg, _ = self.written_store()
        path = os.path.join(self.store_path, "data.mdb")
        os.truncate(path, 0)
        rc, err = self.start_on(cfg, "emptied")
        self.assertEqual(rc, 1, err)
        self.assertIn("idemproxy: store %s is damaged: data.mdb is 0 bytes" % self.store_path, err)
        self.assertEqual(os.path.getsize(path), 0, "the proxy reinitialised an emptied store")

    def test_restored_store_serves_again(self):
        # The advice works: the backup taken before the damage replays.
        cfg, first = self.written_store()
        path = os.path.join(self.store_path, "data.mdb")
        need = self.lmdb_needs()
        with open(path, "rb") as f:
            backup = f.read()
        # Half of what LMDB uses (the file itself is grown ahead of that).
        os.truncate(path, need // 2)
        rc, err = self.start_on(cfg, "half")
        self.assertEqual(rc, 1, err)
        self.assertIn("is damaged", err)
        with open(path, "wb") as f:
            f.write(backup)
        again = self.start_proxy(config=cfg, name="restored")
        self.assertReplayOf(self.post(again, "damaged-1"), first)
        self.assertEqual(self.upstream.total(), 2)


if __name__ == "__main__":
    unittest.main()
