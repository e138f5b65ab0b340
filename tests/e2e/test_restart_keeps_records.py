#!/usr/bin/env python3
"""Records live in the store, not in the process: after SIGTERM (exit 0) a new
process on the same store replays what the old one completed. A store a
newer idemproxy has upgraded is not written by an older process still
running on it, and the operator is told why."""

import json
import os
import re
import subprocess
import unittest

import harness

UPGRADED = "the store was upgraded by a newer idemproxy; stop this process"


def set_layout(store_path, layout):
    """Writes a store layout (4 bytes little-endian under "layout" in the
    meta table), as a newer idemproxy does on open, with LMDB's own mdb_load
    (lmdb-utils), beside the running proxy."""
    text = "layout\n%s\n" % "".join("\\%02x" % b for b in layout.to_bytes(4, "little"))
    subprocess.run(["mdb_load", "-T", "-s", "meta", store_path], input=text.encode(),
                   check=True, timeout=10)


class RestartKeepsRecords(harness.ProxyTestCase):
    def test_restart_replays(self):
        cfg = self.config()
        old = self.start_proxy(config=cfg, name="before")
        first = self.post(old, "restart-1")
        self.assertExecuted(first)
        mismatch_seed = self.post(old, "restart-2", body=b'{"amount":7}')
        self.assertExecuted(mismatch_seed)
        self.assertEqual(old.stop(), 0, old.stderr())

        new = self.start_proxy(config=cfg, name="after")
        self.assertReplayOf(self.post(new, "restart-1"), first)
        self.assertProblem(self.post(new, "restart-2", body=b'{"amount":8}'), 422)
        self.assertEqual(self.upstream.total(), 2)

    def test_restart_keeps_records_with_interval_durability(self):
        # "interval" may lose the last moments on a crash, not on a clean stop.
        cfg = self.config(store={"durability": "interval", "sync_interval": "10s"})
        old = self.start_proxy(config=cfg, name="before")
        first = self.post(old, "restart-int")
        self.assertExecuted(first)
        self.assertEqual(old.stop(), 0, old.stderr())
        new = self.start_proxy(config=cfg, name="after")
        self.assertReplayOf(self.post(new, "restart-int"), first)
        self.assertEqual(self.upstream.total(), 1)

    def test_store_upgraded_behind_a_running_process(self):
        cfg = self.config()
        old = self.start_proxy(config=cfg, name="old")
        first = self.post(old, "upgraded-1")
        self.assertExecuted(first)
        set_layout(self.store_path, 5)

        # New keys are refused before anything is forwarded, and say why.
        for i in range(3):
            doc = self.assertProblem(self.post(old, "upgraded-new-%d" % i), 503)
            self.assertIn("upgraded by a newer idemproxy", doc["detail"])
            self.assertEqual(self.upstream.count("upgraded-new-%d" % i), 0)
        # What is stored is still answered.
        self.assertReplayOf(self.post(old, "upgraded-1"), first)
        # stderr says it once, not once per request.
        self.assertTrue(harness.wait_for(lambda: UPGRADED in old.stderr(), 5), old.stderr())
        self.assertEqual(old.stderr().count(UPGRADED), 1, old.stderr())

        # Once writes go through again (here: the layout put back, as a
        # stand-in for a store that recovers), stderr says so, with how many
        # failures it did not print one by one.
        set_layout(self.store_path, 4)
        self.assertExecuted(self.post(old, "upgraded-after"))
        self.assertTrue(harness.wait_for(lambda: "writes succeed again" in old.stderr(), 5),
                        old.stderr())
        m = re.search(r"writes succeed again \((\d+) failed transactions", old.stderr())
        self.assertIsNotNone(m, old.stderr())
        self.assertGreaterEqual(int(m.group(1)), 2, old.stderr())
        set_layout(self.store_path, 5)
        self.assertEqual(old.stop(), 0, old.stderr())

        # And this version refuses to start on it.
        cfg["listen"] = "127.0.0.1:%d" % harness.free_port()
        path = os.path.join(self.workdir, "again.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        p = subprocess.run([harness.binary(), "--config", path], stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=10)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(b"written by a newer idemproxy (store layout 5", p.stderr)


if __name__ == "__main__":
    unittest.main()
