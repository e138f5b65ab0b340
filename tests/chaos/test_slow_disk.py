#!/usr/bin/env python3
"""A stalling disk (a cloud volume's fdatasync taking seconds): a live lease
must not be stolen, and a key must not run twice, because a commit waits.

The proxy runs under libslowdisk.so (slowdisk.c): while a stall file exists,
every flush of the store's data.mdb (fdatasync, and LMDB's O_DSYNC meta page
write) blocks.

Until layout 4 every store write of a process went through one writer, so a
stalled commit held the process's heartbeats up: a lease it extended ran out
while the holder was alive, and duplicates stole it (the action ran twice)
until a process never stole a lease of its own (writer.c) and every process
took a long wait for, or hold of, the writer lock as a stall and gave
expired leases a lease of credit after it (store_lmdb.c, stall_credit).

Since layout 4 acquires, releases and heartbeats go to the environment of
the records in flight, which is never flushed: a stall no longer holds them
up. What a stall still holds up is a complete (the records environment is
flushed): the holder's action has answered, its heartbeats have stopped,
and its lease runs out while its complete waits for the disk. A duplicate
that finds it expired may not take it over before that complete is in: the
takeover (a steal) takes the records environment's writer lock first, so it
comes after a complete that holds it, and finds the COMPLETE; and when the
complete only queues behind another stalled commit, the steal, which then
gets the lock first, takes the stall as a stall (its wait, or the long hold
before it in durability.lock) and the lease as live for a lease after it.

The cases, each with a stall of 2.5 s against a 1 s lease (heartbeat
100 ms, the minimum settings), the duplicate sent to the holder's proxy or
to a second proxy on the same store (both under the same stalled disk):
  complete          the holder's complete is the stalled commit;
  queued            another request's complete is the stalled commit, and
                    the holder's queues behind it in its writer;
  acquire           the stall begins before the holder's request: its
                    acquire goes through, its complete stalls.
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

    def holder_complete_stalled(self, figure, other_process=True, dup_after_s=1.8,
                                queued=False, store=None, dup_store=None):
        """The holder's action answers 0.3 s into the stall, so its
        complete is the stalled commit, or (queued) waits in the holder's
        writer behind another request's complete, which is; its heartbeats
        stop with the answer and its lease (1 s) runs out during the stall.
        The duplicate is sent dup_after_s into the stall, to the holder's
        proxy or to a second one."""
        proxy = self.start_slow_proxy(store=store)
        dup_proxy = (self.start_slow_proxy("slow2", store=dup_store or store)
                     if other_process else proxy)
        key = "slow-complete"
        first = in_thread(self.post, proxy, key, headers=[("X-Test-Delay-Ms", "800")],
                          timeout=30)
        self.assertTrue(harness.wait_for(lambda: self.upstream.count(key) == 1, 5))
        time.sleep(0.3)  # a few heartbeats committed
        self.stall()
        started = time.monotonic()
        blocker = None
        if queued:
            # Its complete takes the stalled commit before the holder's.
            blocker = in_thread(self.post, proxy, "slow-blocker", timeout=30)
            self.assertTrue(harness.wait_for(
                lambda: self.upstream.count("slow-blocker") == 1, 5))
        time.sleep(max(0, dup_after_s - (time.monotonic() - started)))
        dup = in_thread(self.post, dup_proxy, key, timeout=30)
        time.sleep(max(0, STALL_S - (time.monotonic() - started)))
        self.unstall()
        runs = self.check(key, first, dup)
        if blocker is not None:
            self.assertExecuted(blocker.result(30))
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
        time.sleep(0.3)  # acquired (never flushed); its complete will stall
        dup = in_thread(self.post, dup_proxy, key, timeout=30)
        time.sleep(STALL_S - (time.monotonic() - started))
        self.unstall()
        runs = self.check(key, first, dup)
        chaoslib.figure(TEST + "_acquire" + ("_2proc" if other_process else ""),
                        stall_s=STALL_S, lease=LEASE, heartbeat=HEARTBEAT, executions=runs)

    def test_stall_seen_in_one_process_holds_steals_off_in_another(self):
        """The end of a stall goes through the store: a process that saw no
        stall itself (its duplicate came after it) still takes an expired
        lease as live until a lease after the stall ended (conservative
        since layout 4, where a stall no longer holds heartbeats up, but a
        steal may not tell a lease whose complete waited from one whose
        holder died). The holder is killed, so the key is stolen in the
        end, only not at once."""
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
        # The witness's complete is the stalled commit (its acquire goes
        # to the records in flight, never flushed); its long hold of the
        # writer lock is in durability.lock once the disk is back.
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
        back: its writer waits for the lock less than a stall's length, so
        it learns of the holder's long hold only from the store's shared
        record of it (durability.lock, held_check)."""
        self.holder_complete_stalled("_late_2proc", dup_after_s=STALL_S - 0.15, queued=True)

    def test_interval_flush_stalled_duplicate_in_other_process(self):
        """Durability "interval": the holder's writer is stuck in its
        periodic flush (under the writer lock, so every process sees the
        hold) when its complete comes."""
        store = {"durability": "interval", "sync_interval": "200ms"}
        self.holder_complete_stalled("_interval_2proc", store=store,
                                     dup_store=dict(store, sync_interval="60s"))

    def test_holder_complete_stalled(self):
        self.holder_complete_stalled("_complete", other_process=False)

    def test_holder_complete_stalled_duplicate_in_other_process(self):
        self.holder_complete_stalled("_complete_2proc")

    def test_holder_complete_queued_behind_a_stall_duplicate_in_other_process(self):
        """The holder's complete is not the stalled commit but waits behind
        it in the holder's writer: the duplicate's steal, waiting on the
        writer lock, gets it first once the disk is back, and must take
        the stall for one."""
        self.holder_complete_stalled("_queued_2proc", queued=True)

    def test_holder_acquire_stalled(self):
        self.holder_acquire_stalled(other_process=False)

    def test_holder_acquire_stalled_duplicate_in_other_process(self):
        self.holder_acquire_stalled(other_process=True)


if __name__ == "__main__":
    unittest.main()
