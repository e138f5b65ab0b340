#!/usr/bin/env python3
"""A process with `durability: "interval"` does not void the promise of a
process with `durability: "sync"` on the same store.

Several processes may share one store, and `store.durability` is each one's
own setting. LMDB's MDB_NOSYNC (what "interval" is) writes a commit's pages
and then its meta page without a flush between them, so after a power cut
the device may hold the meta page and not the pages it points to: the store
then opens on a tree that was never written. Its own records since the last
sync are not the only ones at stake: the meta page with the highest
transaction id wins, so every record any process stored, each answer the
sync process gave after its flush included, is behind a broken tree.

The test runs a sync proxy and an interval proxy (an hour's sync_interval)
on one store under libpowercut.so (tests/chaos/powercut.c), which keeps the
image a power cut leaves. The sync proxy answers keys (each on disk before
its answer), then the interval proxy answers keys of its own, then both are
cut. The disk is the image plus, of the writes nobody flushed, those to the
file's first two pages, its meta pages (a writeback that went through the
file in page order and lost the power after its first pages). Then every key
the sync proxy answered must replay after the reboot, with its charge id,
the store must pass check-store, and no answered key may have run twice.

While a sync process has the store open, an interval process's commits are
durable too (store_lmdb.c, follow_sync): before that, the store did not open
after this cut, or lost the sync proxy's answers.
"""

import os
import shutil
import time
import unittest

import chaoslib
from chaoslib import harness

import test_power_cut
from test_power_cut import PAGE, pending_writes, read_stats

TEST = "mixed_durability"
KEYS = chaoslib.knob("MIXED_DURABILITY_KEYS", 20, 200)


class MixedDurability(harness.ProxyTestCase):
    start_cut_proxy = test_power_cut.PowerCut.start_cut_proxy

    def answer(self, proxy, keys):
        out = {}
        with proxy.conn() as conn:
            for key in keys:
                r = conn.request("POST", "/v1/payments",
                                 [("Content-Type", "application/json"),
                                  ("Idempotency-Key", key)], harness.PAYMENT_BODY)
                self.assertEqual(r.status, 201, r)
                out[key] = r.charge_id
        return out

    def test_interval_process_beside_a_sync_one_through_a_power_cut(self):
        t_start = time.monotonic()
        lib = test_power_cut.library()
        self.assertTrue(os.path.exists(lib), "no %s: build the powercut target" % lib)
        tag = "mix"
        p_sync, store, image, pend_sync, stats_sync = self.start_cut_proxy(tag, "sync")
        p_int, _, _, pend_int, stats_int = self.start_cut_proxy(
            tag, "interval", sync_interval="1h", second=True)

        # The interval process says, once, that it flushes for the other.
        self.assertIn('durability is "interval", but a process with "sync" has this store '
                      'open', p_int.stderr())
        self.assertNotIn("flushes every commit too", p_sync.stderr())
        synced = self.answer(p_sync, ["sync-%d" % i for i in range(KEYS)])
        interval = self.answer(p_int, ["interval-%d" % i for i in range(KEYS)])
        for p in (p_sync, p_int):  # one power supply
            p.killed = True
            p.proc.send_signal(9)
        for p in (p_sync, p_int):
            p.proc.wait()
        for st in (stats_sync, stats_int):
            self.assertEqual(read_stats(st)["dir_flushed"], 1, st)

        # The disk: what was flushed, plus the unflushed writes to the meta
        # pages, in the order they were made (the sync proxy was idle, so
        # nothing of its own is pending).
        meta_writes = 0
        with open(image, "r+b") as disk:
            for pend in (pend_sync, pend_int):
                for off, data in pending_writes(pend):
                    if off < 2 * PAGE:
                        disk.seek(off)
                        disk.write(data[:2 * PAGE - off])
                        meta_writes += 1
        shutil.copyfile(image, os.path.join(store, "data.mdb"))

        check = chaoslib.check_store(store)
        self.assertTrue(check.ok, "check-store after the power cut (%d unflushed meta page "
                        "writes on disk): %r" % (meta_writes, check))
        harness.forget_boot(store)
        after = self.start_proxy(config=self.config(store={"path": store}), name="after")
        lost, interval_kept = [], 0
        with after.conn() as conn:
            for key, charge in sorted(synced.items()):
                r = conn.request("POST", "/v1/payments",
                                 [("Content-Type", "application/json"),
                                  ("Idempotency-Key", key)], harness.PAYMENT_BODY)
                if not (r.status == 201 and r.replayed and r.charge_id == charge):
                    lost.append((key, r.status, r.replayed))
            for key, charge in sorted(interval.items()):
                r = conn.request("POST", "/v1/payments",
                                 [("Content-Type", "application/json"),
                                  ("Idempotency-Key", key)], harness.PAYMENT_BODY)
                interval_kept += r.status == 201 and r.replayed and r.charge_id == charge
        after.stop()
        execs = {}
        for e in chaoslib.execution_log(self.upstream):
            execs[e["key"]] = execs.get(e["key"], 0) + 1
        chaoslib.figure(TEST, sync_answered=len(synced), sync_lost=len(lost),
                        interval_answered=len(interval), interval_kept=interval_kept,
                        unflushed_meta_writes=meta_writes,
                        interval_flushes=read_stats(stats_int)["flushes"],
                        test_s=round(time.monotonic() - t_start, 1))
        self.assertEqual(lost, [], "keys the sync proxy answered, lost after the power cut "
                         "(key, status of the retry, replayed)")
        self.assertEqual(sorted(k for k in synced if execs.get(k) != 1), [],
                         "keys the sync proxy answered that ran other than once")


if __name__ == "__main__":
    unittest.main()
