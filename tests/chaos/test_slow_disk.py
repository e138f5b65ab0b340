#!/usr/bin/env python3
"""A stalling disk (a cloud volume's fdatasync taking seconds): a live lease
must not be stolen by the proxy's own duplicates.

The proxy runs under libslowdisk.so (slowdisk.c): while a stall file exists,
every flush of the store's data.mdb (fdatasync, and LMDB's O_DSYNC meta page
write) blocks. The store writer is then stuck in one commit; every heartbeat
of the process queues behind it, and a lease committed by that transaction
(an extend, or the acquire itself) was computed when the transaction began,
so when the stall outlasts `lease` it is already over once it is durable.

Before 2026-12-06 a duplicate that arrived during such a stall read the
record, found the lease expired, and its acquire, committed right after the
stall, stole the key from a holder of the same process that was alive and
waiting for its heartbeat to commit: the upstream ran the action twice.
A process now never steals a lease one of its own requests holds (writer.c).

The same held across processes on one store until 2026-12-07: the duplicate
sent to a second proxy waited for LMDB's writer lock behind the stalled
commit, then stole the key (6 of 6 trials). Every process now takes a wait
for the writer lock, or a hold of it, longer than half a route's margin
between heartbeat and lease for a stall of the write path, notes its end in
the store, and no process steals an expired lease until a full lease after
it (store_lmdb.c, stall_credit).

Four cases, each with a stall of 2.5 s against a 1 s lease (heartbeat
100 ms, the minimum settings), the duplicate sent to the holder's proxy or to
a second proxy on the same store (both under the same stalled disk):
  holder_heartbeat  the holder's action is running; its heartbeat is the
                    stalled commit;
  holder_acquire    the holder's acquire is the stalled commit.
Each: the duplicate must get the holder's answer (a replay), and the
upstream must see the key once.
"""

import os
import time
import unittest

import chaoslib
from chaoslib import harness
from harness import in_thread

TEST = "slow_disk"
LEASE = "1s"
HEARTBEAT = "100ms"
STALL_S = 2.5


def slowdisk_lib():
    path = os.environ.get("SLOWDISK_LIB")
    if not path:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(os.path.dirname(os.path.dirname(here)), "build", "tests", "chaos",
                            "libslowdisk.so")
    if not os.path.exists(path):
        raise RuntimeError("libslowdisk.so not found at %s (set SLOWDISK_LIB)" % path)
    return path


class SlowDiskProxies:
    """Proxies under libslowdisk.so sharing one stall file (one disk), for a
    harness.ProxyTestCase: start_slow_proxy(), stall(), unstall(), stats()."""

    def start_slow_proxy(self, name="slow", routes=None, store=None, **top):
        self.stall_file = os.path.join(self.workdir, "stall")
        self.stats_file = os.path.join(self.workdir, "slowdisk.stats")
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(filter(None, [slowdisk_lib(), env.get("LD_PRELOAD")]))
        env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"),
                                                      "verify_asan_link_order=0"]))
        env["SLOWDISK_STALL_FILE"] = self.stall_file
        env["SLOWDISK_STATS"] = self.stats_file
        config = self.config(routes=routes or [self.route(lease=LEASE, heartbeat=HEARTBEAT,
                                                          wait="10s")],
                             timeout="20s", store=store, **top)
        p = harness.Proxy(self.workdir, config, name, env=env)
        self.proxies.append(p)
        return p.start()

    def stall(self):
        with open(self.stall_file, "w"):
            pass
        self.note("stall begins")

    def unstall(self):
        """Ends the stall (if one is on)."""
        try:
            os.unlink(self.stall_file)
            self.note("stall ends")
        except FileNotFoundError:
            pass

    def stats(self):
        """slowdisk's counters, rewritten when a delayed flush ends ({} before)."""
        if not os.path.exists(self.stats_file):
            return {}
        with open(self.stats_file) as f:
            return dict(kv.split("=") for kv in f.read().split())


class SlowDisk(SlowDiskProxies, harness.ProxyTestCase):
    def check(self, key, first, dup):
        first, dup = first.result(30), dup.result(30)
        self.assertExecuted(first)
        runs = self.upstream.count(key)
        self.assertEqual(runs, 1, "the action ran %d times: a live lease was stolen during "
                         "the stall (first %r, duplicate %r)" % (runs, first, dup))
        self.assertReplayOf(dup, first)
        self.assertGreaterEqual(int(self.stats().get("stalled", 0)), 1, "no flush was stalled")
        return runs

    def holder_heartbeat_stalled(self, figure, other_process=True, dup_after_s=1.5,
                                 store=None, dup_store=None):
        """The holder's action is running and its heartbeat is the stalled
        commit (or flush); the duplicate is sent dup_after_s into the
        stall, to the holder's proxy or to a second one."""
        proxy = self.start_slow_proxy(store=store)
        dup_proxy = (self.start_slow_proxy("slow2", store=dup_store or store)
                     if other_process else proxy)
        key = "slow-hb"
        first = in_thread(self.post, proxy, key, headers=[("X-Test-Delay-Ms", "4500")],
                          timeout=30)
        self.assertTrue(harness.wait_for(lambda: self.upstream.count(key) == 1, 5))
        time.sleep(0.3)  # a few heartbeats committed
        self.stall()
        started = time.monotonic()
        time.sleep(dup_after_s)  # past the lease: the last committed extend is over
        dup = in_thread(self.post, dup_proxy, key, timeout=30)
        time.sleep(max(0, STALL_S - (time.monotonic() - started)))
        self.unstall()
        runs = self.check(key, first, dup)
        chaoslib.figure(TEST + figure, stall_s=STALL_S, lease=LEASE, heartbeat=HEARTBEAT,
                        executions=runs)

    def holder_acquire_stalled(self, other_process):
        proxy = self.start_slow_proxy()
        dup_proxy = self.start_slow_proxy("slow2") if other_process else proxy
        key = "slow-acq"
        self.stall()
        started = time.monotonic()
        first = in_thread(self.post, proxy, key, headers=[("X-Test-Delay-Ms", "1500")],
                          timeout=30)
        time.sleep(0.3)  # the first's acquire is the stalled commit
        dup = in_thread(self.post, dup_proxy, key, timeout=30)
        time.sleep(STALL_S - (time.monotonic() - started))
        self.unstall()
        runs = self.check(key, first, dup)
        chaoslib.figure(TEST + "_acquire" + ("_2proc" if other_process else ""),
                        stall_s=STALL_S, lease=LEASE, heartbeat=HEARTBEAT, executions=runs)

    def test_stall_seen_in_one_process_holds_steals_off_in_another(self):
        """The end of a stall goes through the store: a process that saw no
        stall itself (its duplicate came after it) still takes an expired
        lease as live until a lease after the stall ended. The holder is
        killed, so the key is stolen in the end, only not at once."""
        lease_s = 3.0
        stall_s = 4.0
        routes = [self.route(lease="%gs" % lease_s, heartbeat=HEARTBEAT, wait="10s")]
        holder = self.start_slow_proxy("holder", routes=routes)
        witness = self.start_slow_proxy("witness", routes=routes)
        taker = self.start_slow_proxy("taker", routes=routes)
        key = "slow-dead"
        first = in_thread(self.post, holder, key, headers=[("X-Test-Delay-Ms", "8000")],
                          timeout=30)
        self.assertTrue(harness.wait_for(lambda: self.upstream.count(key) == 1, 5))
        holder.kill9()  # its lease ends lease_s after its last heartbeat
        with self.assertRaises(Exception):  # the connection dies with it
            first.result(30)
        self.stall()
        # The witness's acquire is the stalled commit; its completion, once
        # the disk is back, writes the stall's end to the store.
        other = in_thread(self.post, witness, "slow-other", timeout=30)
        time.sleep(stall_s)
        self.unstall()
        unstalled = time.monotonic()
        self.assertExecuted(other.result(30))
        sent = time.monotonic()
        self.assertLess(sent - unstalled, lease_s / 2, "the witness answered too late to tell")
        dup = self.post(taker, key, timeout=30)
        answered = time.monotonic()
        self.assertExecuted(dup)
        self.assertEqual(self.upstream.count(key), 2)
        self.note("duplicate sent %.3f s after the stall, answered %.3f s after it",
                  sent - unstalled, answered - unstalled)
        self.assertGreaterEqual(answered - unstalled, lease_s - 0.1,
                                "the key was stolen %.3f s after a stall the taker did not see; "
                                "no steal may come before a lease (%g s) after it" %
                                (answered - unstalled, lease_s))
        chaoslib.figure(TEST + "_stall_shared", stall_s=stall_s, lease=lease_s,
                        steal_after_s=round(answered - unstalled, 3))

    def test_duplicate_in_other_process_late_in_the_stall(self):
        """The duplicate reaches the second proxy 0.15 s before the disk is
        back: its writer waits for the lock less than a stall's length
        (450 ms here), so it learns of the holder's long hold only from the
        store's shared record of it (durability.lock, held_check): before
        that, it took the key 3 of 3 times."""
        self.holder_heartbeat_stalled("_late_2proc", dup_after_s=STALL_S - 0.15)

    def test_interval_flush_stalled_duplicate_in_other_process(self):
        """Durability "interval": the holder's writer thread is stuck in its
        periodic flush, which took no lock, so no process saw a stall while
        the holder's heartbeats queued behind it; the other proxy took the
        key 2 of 2 times. The flush now holds the writer lock."""
        store = {"durability": "interval", "sync_interval": "200ms"}
        self.holder_heartbeat_stalled("_interval_2proc", store=store,
                                      dup_store=dict(store, sync_interval="60s"))

    def test_holder_heartbeat_stalled(self):
        self.holder_heartbeat_stalled("_heartbeat", other_process=False)

    def test_holder_acquire_stalled(self):
        self.holder_acquire_stalled(other_process=False)

    def test_holder_heartbeat_stalled_duplicate_in_other_process(self):
        self.holder_heartbeat_stalled("_heartbeat_2proc")

    def test_holder_acquire_stalled_duplicate_in_other_process(self):
        self.holder_acquire_stalled(other_process=True)


if __name__ == "__main__":
    unittest.main()
