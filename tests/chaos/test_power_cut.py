#!/usr/bin/env python3
"""A power cut: every answer the proxy gave is on disk, and the store opens.

The contract says that with `durability: "sync"` a record is on disk before
the client gets its answer. A SIGKILL cannot check that: the page cache
survives the process, so a proxy that answered before its flush would still
pass test_answer_after_durable_commit. This test keeps what a power cut would
leave instead.

The proxy runs under `libpowercut.so` (powercut.c, LD_PRELOAD), which keeps
an image of the store's data.mdb holding only what was flushed: writes are
copied into it when an fdatasync()/fsync() of the file returns, or at once
when they went through an O_DSYNC descriptor. Eight clients send POSTs with
new keys, and the proxy is SIGKILLed, in turn: at a random moment; by the
library right after a random page write, so the cut falls inside a commit,
between its writes and its flush; or by the library 30 ms into a random
flush, before it runs, so that whatever the proxy would answer before a
flush has gone out (a proxy that answered, then flushed, loses those). The
image, plus a random half of the pages written but never flushed (a device
may have written some of them before the power went), replaces data.mdb.
data.mdb's directory must have been flushed after the file was opened (else
the file itself need not survive). Then:

  - `check-store` passes on it (LMDB's integrity with our write pattern);
  - the store is made to remember another boot (a power cut is a reboot), and
    a proxy started on it (without the library) replays every key whose
    answer any client received, with the same charge id, and the upstream's
    execution log shows each such key run once;
  - a key that was in flight at the cut runs at once when retried (its lease
    ended with the boot): replayed if its result is on disk, with one run,
    otherwise run again, two runs at most.

A control round runs the same with `durability: "interval"` and a
`sync_interval` of an hour (nothing flushed after the open, no O_DSYNC
writes, no unflushed page added) and must lose every answered record: it
shows that the test can tell a proxy that answers before its flush from one
that does not. (With a 100 ms interval the control lost only the answers
since the last sync, 6 to 179 per run, and a cut right after a sync could
lose none, so that is not asserted.)

CI: 3 rounds and the control; long (CHAOS_LONG=1): 20; CHAOS_POWERCUT_ROUNDS
overrides.

The other tests say what they prove in their docstrings. One of them,
test_a_key_order_purge_pass_cut_anywhere, cuts the power while the store
purges a large backlog in key order: 9 cuts in CI, 36 long;
CHAOS_POWERCUT_SWEEP_CUTS overrides.
"""

import errno
import json
import os
import re
import shutil
import subprocess
import struct
import threading
import time
import unittest

import chaoslib
from chaoslib import harness

TEST = "power_cut"
ROUNDS = chaoslib.knob("POWERCUT_ROUNDS", 3, 20)
CLIENTS = 8
PAGE = 4096
# The key-order purge pass (test_a_key_order_purge_pass_cut_anywhere): the
# store starts one when at least 20,000 index entries are due
# (store_lmdb.c, SWEEP_MIN_DUE) after 16 index-order purges in a row left
# some, and those 16 may take up to ~12,000 (1,024 each at most, writer.c).
SWEEP_CUTS = chaoslib.knob("POWERCUT_SWEEP_CUTS", 9, 36)
SWEEP_OLD = 36000  # expired records, filled
SWEEP_LIVE = 4000  # live records filled beside them (TTL a day)
SWEEP_PAID = 200   # live records answered through the proxy (charge ids)


def library():
    path = os.environ.get("POWERCUT_LIB")
    if not path:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "..", "..", "build", "tests", "chaos", "libpowercut.so")
    return os.path.abspath(path)


def pending_writes(path):
    """The pending log's whole records: [(offset, bytes)]. A record cut by the
    SIGKILL is not one."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i + 20 <= len(data):
        if data[i:i + 4] != b"PCW1":
            raise AssertionError("pending log: bad record at %d" % i)
        off, length = struct.unpack_from("<QQ", data, i + 4)
        if i + 20 + length > len(data):
            break
        out.append((off, data[i + 20:i + 20 + length]))
        i += 20 + length
    return out


def read_stats(path):
    with open(path) as f:
        return {k: int(v) for (k, v) in (p.split("=") for p in f.read().split())}


def fill_store_tool():
    """bench/fill_store.c, built beside libpowercut.so (tests/chaos/CMakeLists.txt)."""
    path = os.environ.get("FILL_STORE")
    if not path:
        path = os.path.join(os.path.dirname(library()), "fill_store")
    return os.path.abspath(path)


def table_entries(store):
    """{named database: entries} (LMDB's mdb_stat, which reads beside a
    running proxy)."""
    out = subprocess.run(["mdb_stat", "-a", store], capture_output=True, check=True,
                         timeout=30).stdout.decode()
    entries = {}
    for part in out.split("Status of ")[1:]:
        entries[part.split("\n", 1)[0].strip()] = int(re.search(r"Entries: (\d+)", part).group(1))
    return entries


def dump_pairs(env, table):
    """(key bytes, value bytes) of one table, with LMDB's mdb_dump (hex); []
    when the environment or the table is not there."""
    if not os.path.exists(os.path.join(env, "data.mdb")):
        return []
    p = subprocess.run(["mdb_dump", "-s", table, env], capture_output=True, timeout=60)
    if p.returncode != 0:
        return []
    out = p.stdout.decode()
    lines = out.split("HEADER=END\n", 1)[1].split("DATA=END", 1)[0].split("\n")
    return [(bytes.fromhex(k.strip()), bytes.fromhex(v.strip()))
            for k, v in zip(lines[0:-1:2], lines[1::2])]


def raw_expiries(env):
    """{record key hex: expires_ms} of the records one environment holds
    (records and inflight tables), read from the encoding (record.c: version,
    state, lease id, lease expiry, then the expiry, 8 bytes little-endian)."""
    out = {}
    for table in ("records", "inflight"):
        for k, v in dump_pairs(env, table):
            if len(k) == 32 and len(v) >= 34:
                t = int.from_bytes(v[26:34], "little")
                out[k.hex()] = t - (1 << 64) if t >= 1 << 63 else t
    return out


def index_entries(store, both=True):
    """The expiry index as a set of (time ms, record key hex): store_lmdb.c
    index_key(), 8 bytes big-endian with the sign bit flipped, then the key.
    With both, both environments' (layout 4: the records in flight have
    theirs in inflight/), as check-store reads both within the boot they were
    made in; else the one at store alone."""
    entries = set()
    for env in ((store, os.path.join(store, "inflight")) if both else (store,)):
        if env != store and not os.path.exists(os.path.join(env, "data.mdb")):
            continue
        out = subprocess.run(["mdb_dump", "-s", "expiry", env], capture_output=True,
                             check=True, timeout=60).stdout.decode()
        lines = out.split("HEADER=END\n", 1)[1].split("DATA=END", 1)[0].split("\n")
        for line in lines[0:-1:2]:  # key, value (empty), key, value, ..., ""
            k = bytes.fromhex(line.strip())
            assert len(k) == 40, line
            t = int.from_bytes(k[:8], "big") ^ (1 << 63)
            entries.add((t - (1 << 64) if t >= 1 << 63 else t, k[8:].hex()))
    return entries


class PowerCut(harness.ProxyTestCase):
    def traffic(self, proxy, tag, rnd, sent, answered, stop):
        """CLIENTS threads of keep-alive POSTs with new keys until `stop` is
        set or the connection dies; every key goes into `sent` before it is
        sent, and every whole answer into `answered` (key -> (status, charge
        id))."""
        delays = [rnd.choice((0, 0, 1, 3)) for _ in range(64)]

        sent_keys = sent

        def client(n):
            sent = 0
            try:
                with harness.Conn(proxy.port, timeout=10) as conn:
                    while not stop.is_set():
                        key = "%s-c%d-%d" % (tag, n, sent)
                        sent_keys.add(key)
                        resp = conn.request(
                            "POST", "/v1/payments",
                            [("Content-Type", "application/json"), ("Idempotency-Key", key),
                             ("X-Test-Delay-Ms", str(delays[(n * 7 + sent) % 64]))],
                            harness.PAYMENT_BODY)
                        sent += 1
                        answered[key] = (resp.status, resp.charge_id)
            except (harness.ConnectionClosed, OSError, ValueError):
                pass  # the proxy was killed

        threads = [threading.Thread(target=client, args=(n,), daemon=True)
                   for n in range(CLIENTS)]
        for t in threads:
            t.start()
        return threads

    def start_cut_proxy(self, tag, durability, sync_interval="100ms", kill_at_write=None,
                        kill_at_flush=None, fail_dsync_at=None, second=False, template=None,
                        store_options=None, arm_file=None):
        """A proxy on a new store under libpowercut.so; second=True: another
        process on the store of `tag` (sharing its image, with a pending log
        and stats of its own); template: the new store is a copy of that one;
        store_options: more of the config's "store"; arm_file: the kill
        counters run once it exists. Returns (proxy, store path, image path,
        pending log path, stats path)."""
        store = os.path.join(self.workdir, "store-" + tag)
        if template is not None:
            shutil.copytree(template, store)
        elif not second:
            os.makedirs(store)
        image = store + ".image"
        pending, stats = (store + ".2.pending", store + ".2.stats") if second else (
            store + ".pending", store + ".stats")
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(filter(None, [library(), env.get("LD_PRELOAD")]))
        env["POWERCUT_FILE"] = os.path.realpath(os.path.join(store, "data.mdb"))
        env["POWERCUT_IMAGE"] = image
        env["POWERCUT_PENDING"] = pending
        env["POWERCUT_STATS"] = stats
        if kill_at_write:
            env["POWERCUT_KILL_AT_WRITE"] = str(kill_at_write)
        if kill_at_flush:
            env["POWERCUT_KILL_AT_FLUSH"] = str(kill_at_flush)
        if fail_dsync_at:
            env["POWERCUT_FAIL_DSYNC_AT"] = str(fail_dsync_at)
        if arm_file:
            env["POWERCUT_ARM_FILE"] = arm_file
        # A sanitizer build wants its runtime first among the libraries.
        env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"),
                                                      "verify_asan_link_order=0"]))
        st = {"path": store, "durability": durability}
        if durability == "interval":
            st["sync_interval"] = sync_interval
        st.update(store_options or {})
        proxy = harness.Proxy(self.workdir, self.config(store=st),
                              "cut-" + tag + ("-2" if second else ""), env=env)
        self.proxies.append(proxy)
        proxy.start()
        return proxy, store, image, pending, stats

    def one_round(self, rnd, tag, durability, cut="random", sync_interval="100ms"):
        """One cut: "random", the test SIGKILLs the proxy at a random moment;
        "write", the library does, right after a random unflushed page write
        (between a commit's writes and its flush); "flush", the library does,
        30 ms into a random flush, before it (whatever the proxy would answer
        before that flush has gone out by then)."""
        kill_at_write = rnd.randint(200, 4000) if cut == "write" else None
        kill_at_flush = rnd.randint(5, 300) if cut == "flush" else None
        proxy, store, image, pending, stats = self.start_cut_proxy(
            tag, durability, sync_interval=sync_interval, kill_at_write=kill_at_write,
            kill_at_flush=kill_at_flush)

        sent, answered, stop = set(), {}, threading.Event()
        threads = self.traffic(proxy, tag, rnd, sent, answered, stop)
        if cut != "random":
            try:
                rc = proxy.proc.wait(timeout=60)
            finally:
                proxy.killed = True
            self.assertEqual(rc, -9, "%s: the proxy exited with %r, not by the library's "
                             "SIGKILL" % (tag, rc))
        else:
            want = rnd.randint(150, 600)
            self.assertTrue(harness.wait_for(lambda: len(answered) >= want, timeout=60),
                            "%s: %d answers of %d in 60 s" % (tag, len(answered), want))
            time.sleep(rnd.uniform(0, 0.3))
            proxy.kill9()
        stop.set()
        for t in threads:
            t.join(timeout=20)
        self.assertFalse(any(t.is_alive() for t in threads), "%s: a client hung" % tag)
        cut_stats = read_stats(stats)
        self.assertEqual(cut_stats["dir_flushed"], 1,
                         "%s: data.mdb's directory was never flushed: after a power cut the "
                         "file need not exist" % tag)

        # The disk after the cut: the image, and (sync rounds) a random half
        # of the pages that were written but not flushed.
        applied = 0
        with open(image, "r+b") as disk:
            if durability == "sync":
                for off, data in pending_writes(pending):
                    for p in range(0, len(data), PAGE):
                        if rnd.random() < 0.5:
                            disk.seek(off + p)
                            disk.write(data[p:p + PAGE])
                            applied += 1
        shutil.copyfile(image, os.path.join(store, "data.mdb"))

        check = chaoslib.check_store(store)
        self.assertTrue(check.ok, "%s: check-store after the power cut: %r" % (tag, check))
        # A power cut is a reboot: the leases in the store are of a boot
        # that is over, and the next proxy settles them when it opens it.
        harness.forget_boot(store)
        check = chaoslib.check_store(store)
        self.assertTrue(check.ok, "%s: check-store after the reboot: %r" % (tag, check))
        self.assertEqual(check.summary.get("leases_from"), "previous_boot", check)

        after = self.start_proxy(config=self.config(store={"path": store}),
                                 name="after-" + tag)
        ok = {k: v for (k, v) in answered.items() if v[0] == 201}
        self.assertEqual([k for (k, v) in ok.items() if not v[1]], [],
                         "%s: answers without a charge id" % tag)
        self.assertEqual(len(ok), len(answered),
                         "%s: answers other than 201 before the cut: %r" % (
                             tag, {k: v for (k, v) in answered.items() if v[0] != 201}))
        lost, replayed = [], 0
        with after.conn() as conn:
            for key, (_, charge) in sorted(ok.items()):
                retry = conn.request("POST", "/v1/payments",
                                     [("Content-Type", "application/json"),
                                      ("Idempotency-Key", key), ("X-Test-Holder", "retry")],
                                     harness.PAYMENT_BODY)
                if retry.status == 201 and retry.replayed and retry.charge_id == charge:
                    replayed += 1
                else:
                    lost.append((key, retry.status, retry.replayed))
        # The keys in flight at the cut: their leases ended with the boot, so
        # a retry runs at once. It replays only a run whose result is on
        # disk; otherwise it runs again (the first run may or may not have
        # reached the upstream: the execution counts are checked at the end).
        in_flight = {}
        with after.conn() as conn:
            for key in sorted(sent - set(answered)):
                retry = conn.request("POST", "/v1/payments",
                                     [("Content-Type", "application/json"),
                                      ("Idempotency-Key", key), ("X-Test-Holder", "retry")],
                                     harness.PAYMENT_BODY)
                self.assertEqual(retry.status, 201, "%s: in flight at the cut, its retry after "
                                 "the reboot: %r" % (key, retry))
                in_flight[key] = retry.replayed
        after.stop()
        return {"answered": len(ok), "replayed": replayed, "lost": lost, "in_flight": in_flight,
                "pages_applied": applied, "flushes": cut_stats["flushes"],
                "dsync_writes": cut_stats["dsync_writes"], "keys": set(ok)}

    def test_a_new_store_is_on_disk_before_its_first_sync(self):
        """A power cut right after a first start, before any interval sync:
        the store must open again. LMDB creates data.mdb and writes its meta
        pages without a flush; the store flushes a store it created (and its
        directory) at once. Without that the image here is 0 bytes and the
        next start refuses the store as damaged."""
        proxy, store, image, _, stats = self.start_cut_proxy("new", "interval",
                                                             sync_interval="1h")
        resp = self.post(proxy, "new-store-key")
        self.assertEqual(resp.status, 201, resp)
        proxy.kill9()
        self.assertGreater(read_stats(stats)["flushes"], 0, "no flush of the new store")
        self.assertGreaterEqual(os.path.getsize(image), 2 * PAGE, "the meta pages never flushed")
        shutil.copyfile(image, os.path.join(store, "data.mdb"))
        check = chaoslib.check_store(store)
        self.assertTrue(check.ok, "check-store after a power cut on a new store: %r" % (check,))
        # A power cut is a reboot: the records in flight (never flushed) go
        # with it, as the key's lease did.
        harness.forget_boot(store)
        after = self.start_proxy(config=self.config(store={"path": store}), name="after-new")
        # Answered, never flushed ("interval"): it runs again, as that
        # durability allows.
        self.assertEqual(self.post(after, "new-store-key").status, 201)

    def preload_env(self, **powercut):
        """The environment for a proxy under libpowercut.so with the given
        POWERCUT_* settings (names without the prefix, lower case)."""
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(filter(None, [library(), env.get("LD_PRELOAD")]))
        env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"),
                                                      "verify_asan_link_order=0"]))
        for k, v in powercut.items():
            env["POWERCUT_" + k.upper()] = str(v)
        return env

    def test_every_directory_a_first_start_made_is_flushed(self):
        """A store whose path did not exist: the first start makes every
        missing directory (mkdir -p), and a power cut must not take any of
        their entries away, so each one, and the directory the topmost one
        was made in, is flushed before the proxy serves."""
        top = os.path.join(os.path.realpath(self.workdir), "made")
        store = os.path.join(top, "a", "b", "store")
        dirlog = os.path.join(self.workdir, "dirs.log")
        proxy = harness.Proxy(self.workdir, self.config(store={"path": store}), "mkdirs",
                              env=self.preload_env(dirlog=dirlog))
        self.proxies.append(proxy)
        proxy.start()
        self.assertEqual(self.post(proxy, "made-dirs").status, 201)
        with open(dirlog) as f:
            flushed = set(f.read().split("\n"))
        proxy.stop()
        for d in (store, os.path.join(top, "a", "b"), os.path.join(top, "a"), top,
                  os.path.dirname(top)):
            self.assertIn(d, flushed, "%s was not flushed at the first start" % d)
        # A second start made nothing: the store's directory and its parent.
        os.remove(dirlog)
        again = harness.Proxy(self.workdir, self.config(store={"path": store}), "mkdirs-again",
                              env=self.preload_env(dirlog=dirlog))
        self.proxies.append(again)
        again.start()
        with open(dirlog) as f:
            flushed = set(f.read().split())
        again.stop()
        self.assertEqual(flushed, {store, os.path.join(top, "a", "b")})

    def test_a_directory_flush_that_cannot_be_done_or_fails(self):
        """A file system that does not flush directories (EINVAL) is passed
        over: the proxy starts and serves. A directory flush that fails to
        write (EIO) refuses the start, naming the directory: the store's
        entry may not be on the disk."""
        store = os.path.join(self.workdir, "store-einval")
        proxy = harness.Proxy(self.workdir, self.config(store={"path": store}), "dir-einval",
                              env=self.preload_env(dir_fsync_errno=errno.EINVAL))
        self.proxies.append(proxy)
        proxy.start()
        self.assertEqual(self.post(proxy, "einval").status, 201)
        proxy.stop()
        for path in (store, os.path.join(self.workdir, "store-eio")):
            p = subprocess.run(
                [harness.binary(), "--config", self.write_config(path)],
                env=self.preload_env(dir_fsync_errno=errno.EIO), stdin=subprocess.DEVNULL,
                capture_output=True, timeout=30)
            err = p.stderr.decode("utf-8", "replace")
            self.assertEqual(p.returncode, 1, err)
            self.assertIn("cannot flush the directory", err)
            self.assertIn("Input/output error", err)

    def write_config(self, store):
        cfg = self.config(store={"path": store})
        cfg["listen"] = "127.0.0.1:%d" % harness.free_port()
        path = os.path.join(self.workdir, "cfg-%s.json" % os.path.basename(store))
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path

    def test_a_failed_meta_write_stops_the_proxy_and_a_restart_recovers(self):
        """A commit whose meta page cannot be written (EIO) leaves LMDB
        refusing every transaction, reads too (MDB_PANIC), until the store is
        opened again. The proxy used to stay up answering 503 to everything
        until someone restarted it; now it stops with exit status 75, and a
        new process on the same store picks up where it left off:
          - a key answered 201 and stored replays;
          - a key answered 503 (its acquire failed: nothing forwarded) runs
            once when retried;
          - a key whose action ran but whose result the failed commit did not
            store (the access log's "unstored", answered with the upstream's
            201) is an unknown outcome, as after a crash: while its lease
            lasts a retry gets 409, after it the route's on_unknown
            ("release") lets it run again; it never replays something else."""
        rnd = chaoslib.rng(TEST + "_meta_eio")
        proxy, store, _, _, _ = self.start_cut_proxy("eio", "sync",
                                                     fail_dsync_at=rnd.randint(8, 40))
        answers = {}
        for n in range(200):
            key = "eio-%d" % n
            try:
                resp = self.post(proxy, key, timeout=5)
            except (harness.ConnectionClosed, OSError):
                break
            answers[key] = resp
            if resp.status != 201:
                self.assertProblem(resp, 503)
        rc = proxy.proc.wait(timeout=30)
        proxy.stop_called = True
        self.assertEqual(rc, 75, "exit status after the failed meta write (stderr: %s)"
                         % proxy.stderr()[-2000:])
        self.assertIn("MDB_PANIC", proxy.stderr())
        outcome = {line["key"]: line["outcome"] for line in chaoslib.access_log(proxy)}
        stored, unstored, refused = [], [], []
        salt = harness.log_salt(store)
        for key, resp in answers.items():
            o = outcome.get(harness.log_key(store, "payments", key, salt))
            if resp.status == 503:
                refused.append(key)
            elif o == "unstored":
                unstored.append(key)
            else:
                self.assertEqual((resp.status, o), (201, "forwarded"), key)
                stored.append(key)
        self.assertTrue(stored, "nothing was stored before the failure")
        self.assertLessEqual(len(unstored), 1, unstored)  # one commit failed, one request at a time

        check = chaoslib.check_store(store)
        self.assertTrue(check.ok, "check-store after MDB_PANIC: %r" % (check,))
        after = self.start_proxy(config=self.config(store={"path": store}), name="after-eio")
        for key in stored:
            retry = self.post(after, key)
            self.assertEqual((retry.status, retry.replayed, retry.charge_id),
                             (201, True, answers[key].charge_id), key)
            self.assertEqual(self.upstream.count(key), 1, key)
        for key in refused:
            self.assertEqual(self.post(after, key).status, 201, key)
            self.assertEqual(self.upstream.count(key), 1, key)
        for key in unstored:
            retry = self.post(after, key)
            self.assertIn(retry.status, (201, 409), retry)
            self.assertFalse(retry.replayed, retry)
            self.assertLessEqual(self.upstream.count(key), 2, key)
        chaoslib.figure(TEST + "_meta_eio", stored=len(stored), unstored=len(unstored),
                        refused_503=len(refused), exit_status=rc)

    def test_two_processes_on_one_store_through_a_power_cut(self):
        """Two proxies share one store (as two workers of a service would),
        each under the library with the image shared and a pending log of
        its own; half the clients go to each. Both are cut at once, and the
        same checks as for one process hold: check-store passes, every
        answered key replays and ran once, a key in flight runs at once. Here
        the writer lock moves between processes from commit to commit."""
        rnd = chaoslib.rng(TEST + "_two")
        rounds = max(1, ROUNDS // 2)
        answered_total = in_flight_total = 0
        answered_keys = set()
        for i in range(rounds):
            tag = "two%d" % i
            p1, store, image, pend1, stats1 = self.start_cut_proxy(tag, "sync")
            p2, _, _, pend2, stats2 = self.start_cut_proxy(tag, "sync", second=True)
            sent, answered, stop = set(), {}, threading.Event()
            threads = (self.traffic(p1, tag + "a", rnd, sent, answered, stop) +
                       self.traffic(p2, tag + "b", rnd, sent, answered, stop))
            want = rnd.randint(200, 800)
            self.assertTrue(harness.wait_for(lambda: len(answered) >= want, timeout=60),
                            "%s: %d answers of %d in 60 s" % (tag, len(answered), want))
            time.sleep(rnd.uniform(0, 0.3))
            for p in (p1, p2):  # one power supply
                p.killed = True
                p.proc.send_signal(9)
            for p in (p1, p2):
                p.proc.wait()
            stop.set()
            for t in threads:
                t.join(timeout=20)
            self.assertFalse(any(t.is_alive() for t in threads), "%s: a client hung" % tag)
            for st in (stats1, stats2):
                self.assertEqual(read_stats(st)["dir_flushed"], 1, st)
                self.assertGreater(read_stats(st)["flushes"], 1, "%s: no commit of its own" % st)
            with open(image, "r+b") as disk:
                for pend in (pend1, pend2):
                    for off, data in pending_writes(pend):
                        for pg in range(0, len(data), PAGE):
                            if rnd.random() < 0.5:
                                disk.seek(off + pg)
                                disk.write(data[pg:pg + PAGE])
            shutil.copyfile(image, os.path.join(store, "data.mdb"))
            check = chaoslib.check_store(store)
            self.assertTrue(check.ok, "%s: check-store after the power cut: %r" % (tag, check))
            harness.forget_boot(store)
            after = self.start_proxy(config=self.config(store={"path": store}),
                                     name="after-" + tag)
            with after.conn() as conn:
                for key, (status, charge) in sorted(answered.items()):
                    self.assertEqual(status, 201, key)
                    retry = conn.request("POST", "/v1/payments",
                                         [("Content-Type", "application/json"),
                                          ("Idempotency-Key", key)], harness.PAYMENT_BODY)
                    self.assertEqual((retry.status, retry.replayed, retry.charge_id),
                                     (201, True, charge), "%s: answered before the cut" % key)
                for key in sorted(sent - set(answered)):
                    retry = conn.request("POST", "/v1/payments",
                                         [("Content-Type", "application/json"),
                                          ("Idempotency-Key", key)], harness.PAYMENT_BODY)
                    self.assertEqual(retry.status, 201, "%s: in flight: %r" % (key, retry))
            after.stop()
            answered_total += len(answered)
            answered_keys |= set(answered)
            in_flight_total += len(sent - set(answered))
        execs = {}
        for e in chaoslib.execution_log(self.upstream):
            execs[e["key"]] = execs.get(e["key"], 0) + 1
        self.assertEqual(sorted(k for (k, n) in execs.items() if n > 2), [])
        self.assertEqual(sorted(k for k in answered_keys if execs.get(k) != 1), [],
                         "answered keys the upstream ran other than once")
        chaoslib.figure(TEST + "_two", rounds=rounds, answered=answered_total,
                        in_flight=in_flight_total)

    def test_answered_records_survive_a_power_cut(self):
        rnd = chaoslib.rng(TEST)
        t_start = time.monotonic()
        lib = library()
        self.assertTrue(os.path.exists(lib), "no %s: build the powercut target" % lib)

        totals = {"answered": 0, "replayed": 0, "pages_applied": 0, "flushes": 0}
        keys, in_flight = set(), {}
        for i in range(ROUNDS):
            r = self.one_round(rnd, "sync%d" % i, "sync", cut=("random", "write", "flush")[i % 3])
            self.assertGreater(r["flushes"], 0, "the library saw no flush: is it preloaded?")
            # Each durable commit: its pages flushed, then its meta page
            # through O_DSYNC. The open's own flush of the file has no meta
            # write after it.
            self.assertLessEqual(r["flushes"] - r["dsync_writes"], 2,
                                 "commits whose meta page skipped O_DSYNC: %r" % (r,))
            self.assertEqual(r["lost"], [], "round %d: answered before on disk (key, status "
                             "of the retry, replayed): %d of %d" % (i, len(r["lost"]),
                                                                     r["answered"]))
            for k in totals:
                totals[k] += r[k]
            keys |= r["keys"]
            in_flight.update(r["in_flight"])

        control = self.one_round(rnd, "interval", "interval", sync_interval="1h")
        self.assertEqual(control["dsync_writes"], 0)

        execs = {}
        for e in chaoslib.execution_log(self.upstream):
            execs[e["key"]] = execs.get(e["key"], 0) + 1
        twice = sorted(k for k in keys if execs.get(k) != 1)
        # In flight at the cut: a replay is of the one run; a run after the
        # reboot is the second at most.
        bad_flight = sorted((k, rep, execs.get(k, 0)) for (k, rep) in in_flight.items()
                            if (execs.get(k, 0) != 1 if rep else not 1 <= execs.get(k, 0) <= 2))
        chaoslib.figure(TEST, rounds=ROUNDS, answered=totals["answered"],
                        replayed=totals["replayed"], run_twice=len(twice),
                        in_flight=len(in_flight),
                        in_flight_replayed=sum(1 for v in in_flight.values() if v),
                        unflushed_pages_applied=totals["pages_applied"],
                        flushes=totals["flushes"], control_answered=control["answered"],
                        control_lost=len(control["lost"]),
                        test_s=round(time.monotonic() - t_start, 1))
        self.assertEqual(twice, [], "answered keys the upstream ran other than once")
        self.assertEqual(bad_flight, [], "keys in flight at a cut (key, replayed after the "
                         "reboot, executions)")
        self.assertGreater(control["answered"], 0)
        self.assertEqual(len(control["lost"]), control["answered"],
                         "the control (durability interval, no sync after the open) kept "
                         "answers: the test cannot tell an answer before the flush from one "
                         "after")

    # The key-order purge pass ----------------------------------------------

    def sweep_template(self):
        """A store with a backlog large enough for a key-order pass:
        SWEEP_OLD COMPLETE records already expired and SWEEP_LIVE live ones,
        filled through the store API (fill_store), and SWEEP_PAID live ones
        answered through a proxy that does not purge. Returns (its path,
        {paid key: charge id})."""
        template = os.path.join(self.workdir, "sweep-template")
        tool = fill_store_tool()
        self.assertTrue(os.path.exists(tool), "no %s: build the chaos_fill_store target" % tool)
        for prefix, count, ttl_ms in (("old", SWEEP_OLD, 1), ("live", SWEEP_LIVE, 86400000)):
            p = subprocess.run([tool, "--store", template, "--count", str(count), "--ttl-ms",
                                str(ttl_ms), "--scope", "payments", "--prefix", prefix,
                                "--map-size", str(64 << 20), "--batch", "1000"],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr.decode("utf-8", "replace"))
        proxy = self.start_proxy(config=self.config(store={"path": template,
                                                           "purge_interval": "1h"}),
                                 name="sweep-fill")
        paid = {}
        with proxy.conn() as conn:
            for i in range(SWEEP_PAID):
                key = "paid-%d" % i
                resp = conn.request("POST", "/v1/payments",
                                    [("Content-Type", "application/json"),
                                     ("Idempotency-Key", key)], harness.PAYMENT_BODY)
                self.assertEqual(resp.status, 201, resp)
                paid[key] = resp.charge_id
        self.assertEqual(proxy.stop(), 0)
        return template, paid

    def sweep_check(self, store, tag, old, live, final=False):
        """What a store must hold at any point of a purge: check-store passes
        (every record decodes, no key twice); every live record is there,
        COMPLETE; every record has its index entry, at its expiry; and every
        other entry is one a key-order pass left behind, of an expired record
        it deleted. final: the purge is over, so nothing expired is left and
        no entry is stale. Returns (expired records left, stale entries,
        whether every stale key sorts before every expired record left: the
        pass walks in key order)."""
        check = chaoslib.check_store(store, records=True)
        self.assertTrue(check.ok, "%s: check-store: %r" % (tag, check))
        recs = check.records
        lost = sorted(k for k in live if recs.get(k, {}).get("state") != "complete")
        self.assertEqual(lost, [], "%s: live records lost (of %d)" % (tag, len(live)))
        idx = index_entries(store)
        self.assertEqual(sorted(k for (k, d) in recs.items() if (d["expires_ms"], k) not in idx),
                         [], "%s: records without their index entry" % tag)
        # Stale: an entry whose own environment's record (check-store shows
        # one record a key, and a complete's entry left in flight, under the
        # COMPLETE's lease, has its own index entry) has another expiry.
        stale = []
        for env in (store, os.path.join(store, "inflight")):
            if os.path.exists(os.path.join(env, "data.mdb")):
                held = raw_expiries(env)
                stale += [k for (t, k) in index_entries(env, both=False) if held.get(k) != t]
        stale.sort()
        self.assertEqual([k for k in stale if k not in old], [],
                         "%s: stale index entries of records that were not expired" % tag)
        left = sorted(k for k in recs if k in old)
        if final:
            self.assertEqual((len(left), len(stale)), (0, 0),
                             "%s: expired records and stale entries after the purge" % tag)
        return len(left), len(stale), not stale or not left or stale[-1] < left[0]

    def sweep_cut(self, rnd, tag, kind, traffic, template, paid, old, live):
        """One cut of a purge on a copy of the template, once the test sees
        the key-order pass under way (fewer records than index entries: the
        pass leaves the entries of what it deletes) and a random 0-50 ms
        later: "flush", the library SIGKILLs the proxy 30 ms into one of its
        next flushes (that commit's pages written, not flushed, its meta page
        not written); "write", right after one of its next page writes; or
        "kill", the test does. traffic: clients send new keys meanwhile (the
        purge then also rides in their batches). Then the disk as the cut
        left it (the image, plus none, a random half or all of the unflushed
        pages) is checked, rebooted, served and purged to the end. Returns
        (the phase the cut fell in, keys answered, keys in flight)."""
        arm = os.path.join(self.workdir, tag + ".arm")
        n = rnd.randint(1, 12) if kind == "flush" else rnd.randint(1, 200)
        proxy, store, image, pending, _ = self.start_cut_proxy(
            tag, "sync", template=template, arm_file=arm,
            store_options={"purge_interval": "50ms"},
            kill_at_flush=n if kind == "flush" else None,
            kill_at_write=n if kind == "write" else None)
        sent, answered, stop = set(), {}, threading.Event()
        threads = self.traffic(proxy, tag, rnd, sent, answered, stop) if traffic else []

        def under_way():
            e = table_entries(store)
            return e["records"] + e["inflight"] < e["expiry"]
        self.assertTrue(harness.wait_for(under_way, timeout=60, interval=0.002),
                        "%s: no key-order pass seen: %r" % (tag, table_entries(store)))
        time.sleep(rnd.uniform(0, 0.05))
        if kind == "kill":
            proxy.kill9()
        else:
            open(arm, "w").close()
            # A purge over before the library's cut (a fast disk: few, large
            # transactions) gets requests to make more flushes and writes.
            start, nudges = time.monotonic(), 0
            while proxy.proc.poll() is None and time.monotonic() < start + 60:
                if table_entries(store)["expiry"] > len(live) + len(sent):
                    time.sleep(0.01)
                    continue
                key = "%s-nudge-%d" % (tag, nudges)
                nudges += 1
                sent.add(key)
                try:
                    resp = self.post(proxy, key, timeout=5)
                    answered[key] = (resp.status, resp.charge_id)
                except (harness.ConnectionClosed, OSError):
                    pass
            proxy.killed = True
            self.assertEqual(proxy.proc.poll(), -9, "%s: the proxy was not killed by the "
                             "library" % tag)
        stop.set()
        for t in threads:
            t.join(timeout=20)
        self.assertFalse(any(t.is_alive() for t in threads), "%s: a client hung" % tag)

        mode = rnd.choice(("none", "half", "all"))
        with open(image, "r+b") as disk:
            for off, data in pending_writes(pending):
                for p in range(0, len(data), PAGE):
                    if mode == "all" or (mode == "half" and rnd.random() < 0.5):
                        disk.seek(off + p)
                        disk.write(data[p:p + PAGE])
        shutil.copyfile(image, os.path.join(store, "data.mdb"))
        ok = {k: v for (k, v) in answered.items() if v[0] == 201}
        self.assertEqual(len(ok), len(answered), "%s: answers other than 201" % tag)
        left, stale, key_order = self.sweep_check(
            store, tag, old, live | {chaoslib.record_key("payments", k) for k in ok})
        phase = ("before" if not stale and left else "pass" if stale and left else
                 "cleanup" if stale else "done")
        if phase == "pass":
            self.assertTrue(key_order, "%s: the pass deleted records after ones it kept" % tag)

        # A power cut is a reboot. The proxy after it syncs at an interval:
        # its durability is not what is tested, and the rest of the purge
        # takes a tenth of the time without a flush per transaction.
        harness.forget_boot(store)
        after = self.start_proxy(config=self.config(store={
            "path": store, "purge_interval": "50ms", "durability": "interval",
            "sync_interval": "1s"}), name="after-" + tag)
        with after.conn() as conn:
            for key, charge in sorted(list(paid.items()) + [(k, v[1]) for (k, v) in ok.items()]):
                retry = conn.request("POST", "/v1/payments",
                                     [("Content-Type", "application/json"),
                                      ("Idempotency-Key", key)], harness.PAYMENT_BODY)
                self.assertEqual((retry.status, retry.replayed, retry.charge_id),
                                 (201, True, charge), "%s: %s, answered before the cut" % (tag, key))
            for key in sorted(sent - set(ok)):
                retry = conn.request("POST", "/v1/payments",
                                     [("Content-Type", "application/json"),
                                      ("Idempotency-Key", key)], harness.PAYMENT_BODY)
                self.assertEqual(retry.status, 201, "%s: %s, in flight at the cut: %r" % (
                    tag, key, retry))
        # Over when no more entries are left than one per record that should
        # be there (sweep_check then says which records are there).
        want = len(live) + len(sent)
        done = harness.wait_for(lambda: table_entries(store)["expiry"] <= want, timeout=120,
                                interval=0.05)
        self.assertEqual(after.stop(), 0)
        self.assertTrue(done, "%s: the purge did not finish after the restart: %r" % (
            tag, table_entries(store)))
        self.sweep_check(store, tag + " after the restart", old,
                         live | {chaoslib.record_key("payments", k) for k in sent}, final=True)
        return phase, set(ok), sent - set(ok)

    def test_a_key_order_purge_pass_cut_anywhere(self):
        """A power cut while the store purges a large backlog in key order
        (store_lmdb.c, sweep_steps: many write transactions, each deleting
        the due records of a stretch of the key space and leaving their
        index entries behind). Each cut, on a fresh copy of a store with
        36,000 expired records, falls once the pass is under way: at a flush
        or a page write (the library's counters armed then), or at a SIGKILL,
        half of them with clients sending new keys. After each (sweep_check):
        the store opens and check-store passes; no live record is lost (4,000
        filled, 200 answered through the proxy, every key answered before the
        cut); every record has its index entry and every other entry belongs
        to an expired record the pass deleted; what the pass deleted lies
        before what it kept, in key order. Rebooted, the proxy replays every
        answered key with its charge id (the upstream ran it once), runs a
        key in flight at once, and its purge ends with nothing expired and
        one entry per record. Most cuts must fall inside the pass (expired
        records left and stale entries), or the test did not test it."""
        rnd = chaoslib.rng(TEST + "_sweep")
        t_start = time.monotonic()
        template, paid = self.sweep_template()
        old = {chaoslib.record_key("payments", "old-%d" % i) for i in range(SWEEP_OLD)}
        live = {chaoslib.record_key("payments", "live-%d" % i) for i in range(SWEEP_LIVE)}
        live |= {chaoslib.record_key("payments", k) for k in paid}

        phases, answered, in_flight = {}, set(), set()
        for i in range(SWEEP_CUTS):
            kind, traffic = ("flush", "write", "kill")[i % 3], i % 2 == 1
            phase, ok, flight = self.sweep_cut(rnd, "sweep%d" % i, kind, traffic, template,
                                               paid, old, live)
            self.note("cut %d: %s%s -> %s", i, kind, " with traffic" if traffic else "", phase)
            phases[phase] = phases.get(phase, 0) + 1
            answered |= ok
            in_flight |= flight

        execs = {}
        for e in chaoslib.execution_log(self.upstream):
            execs[e["key"]] = execs.get(e["key"], 0) + 1
        chaoslib.figure(TEST + "_sweep", cuts=SWEEP_CUTS,
                        **{"cut_" + p: phases.get(p, 0) for p in ("before", "pass", "cleanup",
                                                                  "done")},
                        answered=len(answered), in_flight=len(in_flight),
                        test_s=round(time.monotonic() - t_start, 1))
        self.assertEqual(sorted(k for k in list(paid) + sorted(answered) if execs.get(k) != 1),
                         [], "answered keys the upstream ran other than once")
        self.assertEqual(sorted(k for k in in_flight if not 1 <= execs.get(k, 0) <= 2), [],
                         "keys in flight at a cut run other than once or twice")
        self.assertGreaterEqual(phases.get("pass", 0), (SWEEP_CUTS + 1) // 2,
                                "cuts inside the key-order pass: %r" % (phases,))

if __name__ == "__main__":
    unittest.main()
