#!/usr/bin/env python3
"""A store as the previous release (bcf26c8, same store layout 3) leaves it:
the same tables and records, but no "log_salt" in meta and no
durability.lock in its directory. A rolling upgrade opens such a store with
this version beside that release's proxies, and a rollback goes back to it,
so this version must take such a store as it is: its tools read it and
write nothing new into it, and its first proxy adds the salt and serves
every record stored before.

The store is made by this binary and then rewritten without the salt with
LMDB's own mdb_dump/mdb_load (lmdb-utils); the old binary itself is not
built in CI (the scenarios with both binaries serving one store are in
docs/reliability.md)."""

import json
import os
import shutil
import subprocess
import unittest

import harness


def strip_to_previous_release(store_path):
    """Rewrites the store, which no process has open, as the previous
    release leaves it: every table as it is, minus meta "log_salt", and no
    durability.lock. The hex format keeps every value byte for byte."""
    dump = subprocess.run(["mdb_dump", "-a", store_path], capture_output=True, check=True,
                          timeout=30).stdout.decode()
    out, in_meta, skip, dropped = [], False, False, 0
    salt_key = " " + b"log_salt".hex()
    for line in dump.splitlines(keepends=True):
        if line.startswith("database="):
            in_meta = line.strip() == "database=meta"
        if skip:  # the value line of the dropped pair
            skip = False
            continue
        if in_meta and line.rstrip("\n") == salt_key:
            skip, dropped = True, dropped + 1
            continue
        out.append(line)
    assert dropped == 1, dump
    fresh = store_path + ".previous"
    os.mkdir(fresh, 0o700)
    subprocess.run(["mdb_load", fresh], input="".join(out).encode(), capture_output=True,
                   check=True, timeout=30)
    for name in os.listdir(fresh):
        os.chmod(os.path.join(fresh, name), 0o600)
    shutil.rmtree(store_path)
    os.rename(fresh, store_path)


class UpgradeFromStoreWithoutLogSalt(harness.ProxyTestCase):
    def cli(self, *args):
        r = subprocess.run([harness.binary()] + list(args), capture_output=True, timeout=30)
        return r.returncode, r.stdout.decode(), r.stderr.decode()

    def test_tools_leave_it_as_it_is_and_a_proxy_serves_it(self):
        before = self.start_proxy(name="before")
        first = self.post(before, "up-1")
        self.assertExecuted(first)
        self.assertExecuted(self.post(before, "up-2"))
        self.assertEqual(before.stop(), 0)
        strip_to_previous_release(self.store_path)
        self.assertIsNone(harness.log_salt(self.store_path))
        lock = os.path.join(self.store_path, "durability.lock")
        self.assertFalse(os.path.exists(lock))

        # The tools of this version beside the previous release's proxies:
        # they read the store, and write nothing it did not have.
        rc, out, err = self.cli("check-store", self.store_path)
        self.assertEqual(rc, 0, err)
        summary = json.loads(out)
        self.assertEqual((summary["ok"], summary["records"]), (True, 2), summary)
        rc, out, err = self.cli("show-key", self.store_path, "payments", "up-1")
        self.assertEqual(rc, 0, err)
        shown = json.loads(out)
        self.assertEqual((shown["state"], shown["status"]), ("complete", 201), shown)
        self.assertIsNone(shown["log_key"])  # no salt yet: no hash to name
        rc, out, err = self.cli("forget-key", self.store_path, "payments", "up-2")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["log_key"], None, out)
        self.assertIsNone(harness.log_salt(self.store_path))
        self.assertFalse(os.path.exists(lock))
        rc, out, err = self.cli("check-store", self.store_path)
        self.assertEqual((rc, json.loads(out)["records"]), (0, 1), err)

        # The first proxy of this version adds the salt (and its durability
        # lock) and serves what was stored before it, byte for byte.
        after = self.start_proxy(name="after")
        salt = harness.log_salt(self.store_path)
        self.assertEqual(len(salt or b""), 32)
        self.assertTrue(os.path.exists(lock))
        self.assertReplayOf(self.post(after, "up-1"), first)
        self.assertExecuted(self.post(after, "up-2"))  # forgotten: runs again
        self.assertEqual(self.upstream.count("up-1"), 1)
        self.assertEqual(self.upstream.count("up-2"), 2)

        # Its access log hashes with the salt: not what the previous release
        # logged for the same key (the record key's first 4 bytes), but what
        # show-key of this version now names.
        # (up-1's line is the replayed one: two workers log in either order)
        logged = [e["key"] for e in after.wait_access_log(2) if e["outcome"] == "replayed"]
        self.assertEqual(len(logged), 1, after.access_log())
        self.assertEqual(logged[0], harness.log_key(self.store_path, "payments", "up-1", salt))
        self.assertNotEqual(logged[0], harness.record_key("payments", "up-1").hex()[:8])
        rc, out, err = self.cli("show-key", self.store_path, "payments", "up-1")
        self.assertEqual(json.loads(out)["log_key"], logged[0], err)

        # A second proxy takes the salt the first one made.
        second = self.start_proxy(name="second")
        self.assertReplayOf(self.post(second, "up-1"), first)
        self.assertEqual(second.wait_access_log(1)[0]["key"], logged[0])
        self.assertEqual(harness.log_salt(self.store_path), salt)
        rc, out, err = self.cli("check-store", self.store_path)
        self.assertEqual((rc, json.loads(out)["ok"]), (0, True), err)


if __name__ == "__main__":
    unittest.main()
