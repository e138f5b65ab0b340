#!/usr/bin/env python3
"""Leases are kept on the boot clock, so a store remembers the boot its leases
were taken under. After a reboot every lease in it has ended with its holder;
the first proxy to open the store for writing settles them. check-store opens
a store read-only and settles nothing: it must still say which boot the
leases are from, and not show a time on the old boot's clock as if the dead
holder were alive. Records in flight (layout 4) live in an environment that
is never flushed and is made again by the first proxy of a new boot: after
a reboot check-store does not open it (it may be torn) and shows none of
them.

A reboot cannot happen in a test, so the test changes the boot id the store
remembers (meta "lease_epoch") with LMDB's own mdb_dump/mdb_load while no
process has the store open: to the store, the host has booted since."""

import json
import subprocess
import time
import unittest

import harness
from harness import in_thread


def check_store(path):
    p = subprocess.run([harness.binary(), "check-store", path, "--records"],
                       capture_output=True, timeout=10)
    lines = [json.loads(l) for l in p.stdout.decode().splitlines()]
    return p.returncode, lines[:-1], lines[-1]


class CheckStoreAfterReboot(harness.ProxyTestCase):
    def test_leases_of_a_previous_boot_shown_as_ended(self):
        a = self.start_proxy(name="a", lease="60s", heartbeat="1s", wait="0s")
        self.assertExecuted(self.post(a, "done"))
        in_thread(self.post, a, "mid", headers=[("X-Test-Delay-Ms", "30000")])
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("mid") == 1, 3))
        a.kill9()
        self.note("a killed mid-action")

        # This boot: the dead holder's lease is live for about a minute.
        rc, records, summary = check_store(self.store_path)
        self.assertEqual(rc, 0, summary)
        self.assertEqual(summary["leases_from"], "this_boot", summary)
        self.assertEqual((summary["in_progress"], summary["stealable"], summary["complete"]),
                         (1, 0, 1), summary)
        live = [r for r in records if r["state"] == "in_progress"]
        self.assertGreater(live[0]["lease_expires_ms"], time.time() * 1000 + 50000, live)
        # A COMPLETE record's lease is history: not shown as a time.
        done = [r for r in records if r["state"] == "complete"]
        self.assertIsNone(done[0]["lease_expires_ms"], done)

        harness.forget_boot(self.store_path)
        rc, records, summary = check_store(self.store_path)
        self.assertEqual(rc, 0, summary)
        self.assertEqual((summary["in_progress"], summary["stealable"], summary["held"],
                          summary["complete"]), (0, 0, 0, 1), summary)
        self.assertEqual(summary["leases_from"], "previous_boot", summary)
        self.assertEqual(summary["in_flight_env"], "not_this_boot", summary)
        self.assertEqual([r["state"] for r in records], ["complete"], records)

        # What check-store said is what the next proxy does: the key runs
        # again at once, not a minute later, and the result stays.
        b = self.start_proxy(name="b", lease="60s", heartbeat="1s", wait="0s")
        self.assertExecuted(self.post(b, "mid"))
        self.assertEqual(self.upstream.count("mid"), 2)
        self.assertEqual(self.upstream.count("done"), 1)
        self.assertEqual(self.post(b, "done").status, 201)
        self.assertEqual(self.upstream.count("done"), 1)
        b.stop()
        rc, _, summary = check_store(self.store_path)
        self.assertEqual(rc, 0, summary)
        self.assertEqual(summary["leases_from"], "this_boot", summary)
        self.assertEqual((summary["in_progress"], summary["complete"]), (0, 2), summary)


if __name__ == "__main__":
    unittest.main()
