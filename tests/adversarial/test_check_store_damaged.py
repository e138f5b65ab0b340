#!/usr/bin/env python3
"""`idemproxy check-store` on stores that are missing, damaged or odd (README,
Command line). Every store here is written by the real proxy, stopped with
SIGTERM, and then damaged from outside:

  - a path that does not exist, or holds no store, fails the check and
    check-store creates nothing there (it opens stores read-only);
  - a data.mdb cut short (LMDB maps the file: reading a page past its end
    was SIGBUS) or cut to 0 bytes (LMDB would take it for a new store and
    silently start an empty one) fails the check with exit 1, a JSON summary
    that says the store is damaged, and the file left as it was;
  - every corrupt record is counted, not just the first, and the first few
    are named by key;
  - stale_readers_cleared counts the reader slots of dead processes that the
    check cleared, and map_size_bytes is the store's own map size.
"""

import json
import os
import subprocess
import sys
import unittest

import adv
from adv import harness

MAP_SIZE = 64 << 20  # harness.ProxyTestCase.config(): "map_size": "64MiB"


def data_file(store_path):
    return os.path.join(store_path, "data.mdb")


def mdb_put_text(store_path, table, key, value):
    """Writes key -> value into one of the store's LMDB tables with LMDB's own
    mdb_load (lmdb-utils), behind idemproxy's back: bytes given as Python
    bytes, written as mdb_load's backslash-hex text."""
    def esc(b):
        return "".join("\\%02x" % c for c in b)
    text = "%s\n%s\n" % (esc(key), esc(value))
    subprocess.run(["mdb_load", "-T", "-s", table, store_path], input=text.encode(),
                   check=True, timeout=10)


# A child process that opens the store with liblmdb (ctypes), begins a read
# transaction and exits without ending it: its reader slot stays taken in
# lock.mdb, as after a process killed mid-read. With "hold" it begins none
# and waits for its stdin to close: LMDB resets the reader table when the
# first process opens a store, so stale slots exist only while some live
# process (a proxy, here this holder) has it open.
LMDB_CHILD = r"""
import ctypes, os, sys
lib = ctypes.CDLL("liblmdb.so.0")
env = ctypes.c_void_p()
txn = ctypes.c_void_p()
assert lib.mdb_env_create(ctypes.byref(env)) == 0
assert lib.mdb_env_set_maxdbs(env, 4) == 0
assert lib.mdb_env_open(env, sys.argv[1].encode(), 0x20000, 0o600) == 0  # MDB_RDONLY
if sys.argv[2] == "hold":
    print("ready", flush=True)
    sys.stdin.read()
else:
    assert lib.mdb_txn_begin(env, None, 0x20000, ctypes.byref(txn)) == 0
os._exit(0)
"""


def leave_stale_reader(store_path):
    subprocess.run([sys.executable, "-c", LMDB_CHILD, store_path, "die"], check=True, timeout=30)


def hold_open(store_path):
    p = subprocess.Popen([sys.executable, "-c", LMDB_CHILD, store_path, "hold"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if p.stdout.readline() != b"ready\n":
        p.kill()
        p.wait()
        raise AssertionError("the LMDB holder did not start")
    return p


class CheckStoreDamaged(adv.AdversarialCase):
    def written_store(self, n=6):
        """A store with n COMPLETE records written by the proxy, which is then
        stopped (SIGTERM, exit 0). Returns the bytes LMDB says it uses."""
        proxy = self.start_proxy()
        answers = {}
        for i in range(n):
            key = "damaged-%d" % i
            answers[key] = self.post(proxy, key)
            self.assertExecuted(answers[key])
        self.assertEqual(proxy.stop(), 0, proxy.stderr())
        rc, doc, _ = adv.check_store(self.store_path)
        self.assertEqual((rc, doc.get("records")), (0, n), doc)
        return doc["map_used_bytes"]

    def run_check(self, path, *extra):
        p = subprocess.run([harness.binary(), "check-store", path] + list(extra),
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        return p.returncode, p.stdout.decode(), p.stderr.decode()

    def assertFailedCheck(self, rc, out, err):
        """Exit 1 (not a signal: a negative returncode is one) and a JSON
        summary saying not ok."""
        self.assertEqual(rc, 1, "exit status %r, stdout %r, stderr %r" % (rc, out, err))
        docs = [json.loads(l) for l in out.splitlines() if l.strip()]
        self.assertTrue(docs, "no JSON summary on stdout; stderr %r" % err)
        self.assertIs(docs[-1].get("ok"), False, docs[-1])
        return docs[-1]

    # 2. Read-only: nothing is created.

    def test_missing_path_fails_and_creates_nothing(self):
        missing = os.path.join(self.workdir, "no", "such", "store")
        doc = self.assertFailedCheck(*self.run_check(missing))
        self.assertIn("no store here", doc.get("error", ""), doc)
        self.assertFalse(os.path.exists(os.path.join(self.workdir, "no")),
                         "check-store created directories for a store that did not exist")

    def test_directory_without_store_fails_and_stays_empty(self):
        empty = os.path.join(self.workdir, "empty")
        os.mkdir(empty)
        rc, out, err = self.run_check(empty)
        doc = self.assertFailedCheck(rc, out, err)
        self.assertIn("no store here", doc.get("error", ""), doc)
        self.assertIn("no store here", err)
        self.assertEqual(os.listdir(empty), [], "check-store wrote files into a non-store")

    def test_check_writes_nothing_to_a_store(self):
        self.written_store(n=2)
        os.remove(os.path.join(self.store_path, "lock.mdb"))
        files = sorted(os.listdir(self.store_path))
        before = os.stat(data_file(self.store_path))
        rc, doc, _ = adv.check_store(self.store_path)
        self.assertEqual((rc, doc.get("records")), (0, 2), doc)
        after = os.stat(data_file(self.store_path))
        self.assertEqual((before.st_size, before.st_mtime_ns), (after.st_size, after.st_mtime_ns))
        self.assertEqual(sorted(os.listdir(self.store_path)), files,
                         "check-store created files in the store")

    # 1. Truncated data files.

    def test_truncated_data_file_is_a_failed_check_not_sigbus(self):
        need = self.written_store()
        path = data_file(self.store_path)
        self.assertGreaterEqual(os.path.getsize(path), need)
        for cut in (8192, need // 2 // 4096 * 4096, need - 4096):
            with self.subTest(cut=cut):
                os.truncate(path, cut)
                rc, out, err = self.run_check(self.store_path)
                doc = self.assertFailedCheck(rc, out, err)
                self.assertIn("is damaged: data.mdb is %d bytes, LMDB needs %d" % (cut, need),
                              doc.get("error", ""), doc)
                self.assertIn("restore it from a backup", err)
                self.assertEqual(os.path.getsize(path), cut, "check-store changed the file")
        self.summary("check_store_damaged", "truncated data.mdb: %d cuts (8 KiB to %d of %d "
                     "bytes) all a failed check, exit 1, no SIGBUS", 3, need - 4096, need)

    def test_emptied_data_file_is_not_taken_for_a_new_store(self):
        self.written_store()
        path = data_file(self.store_path)
        os.truncate(path, 0)
        rc, out, err = self.run_check(self.store_path)
        doc = self.assertFailedCheck(rc, out, err)
        self.assertIn("is damaged: data.mdb is 0 bytes", doc.get("error", ""), doc)
        self.assertEqual(os.path.getsize(path), 0, "check-store initialised an emptied store")

    # 3. Every corrupt record is counted.

    def test_every_corrupt_record_is_counted(self):
        self.written_store(n=8)
        rc, _, records = adv.check_store(self.store_path, records=True)
        self.assertEqual(rc, 0)
        keys = sorted(r["key"] for r in records)
        self.assertEqual(len(keys), 8)
        spoiled = [keys[1], keys[4], keys[6]]  # not the first one only
        for k in spoiled:
            mdb_put_text(self.store_path, "records", bytes.fromhex(k), b"\x01\x07junk")
        rc, doc, _ = adv.check_store(self.store_path)
        self.assertEqual(rc, 1, doc)
        self.assertIs(doc["ok"], False, doc)
        # The scan goes on past the first corrupt record: all 8 are seen.
        self.assertEqual((doc.get("records"), doc.get("complete"), doc.get("corrupt")),
                         (8, 5, 3), doc)
        self.assertEqual(sorted(c["key"] for c in doc["corrupt_first"]), sorted(spoiled), doc)
        for c in doc["corrupt_first"]:
            self.assertEqual((c["table"], c["value_bytes"]), ("records", 6), c)

    def test_corrupt_records_named_up_to_five(self):
        self.written_store(n=8)
        _, _, records = adv.check_store(self.store_path, records=True)
        for r in records:
            mdb_put_text(self.store_path, "records", bytes.fromhex(r["key"]), b"\x09")
        # An entry whose key is not a record key at all.
        mdb_put_text(self.store_path, "records", b"\x00short", b"\x09")
        rc, doc, _ = adv.check_store(self.store_path)
        self.assertEqual(rc, 1, doc)
        self.assertEqual((doc.get("records"), doc.get("corrupt")), (9, 9), doc)
        self.assertEqual(len(doc["corrupt_first"]), 5, doc)
        self.assertIn({"key": b"\x00short".hex(), "key_bytes": 6, "table": "records",
                       "value_bytes": 1, "detail": "the key is not a 32-byte record key"},
                      doc["corrupt_first"], doc)

    # 4. The real reader count and map size.

    def test_stale_readers_and_map_size_are_the_stores(self):
        self.written_store(n=2)
        holder = hold_open(self.store_path)
        self.addCleanup(holder.stdout.close)
        self.addCleanup(holder.wait, 30)
        self.addCleanup(holder.stdin.close)
        leave_stale_reader(self.store_path)
        leave_stale_reader(self.store_path)
        rc, doc, _ = adv.check_store(self.store_path)
        self.assertEqual(rc, 0, doc)
        self.assertEqual(doc["stale_readers_cleared"], 2, doc)
        self.assertEqual(doc["map_size_bytes"], MAP_SIZE, doc)
        rc, doc, _ = adv.check_store(self.store_path)
        self.assertEqual((rc, doc["stale_readers_cleared"]), (0, 0), doc)


if __name__ == "__main__":
    unittest.main()
