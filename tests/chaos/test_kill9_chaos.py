#!/usr/bin/env python3
"""kill -9 chaos: 32 clients send new keys one after another (upstream delay
10-80 ms) and retry each key until it is answered, while the proxy is killed
with SIGKILL at random moments (every 0.1-1 s) and restarted on the same
store. The route has a 1 s lease (heartbeat 300 ms) and a 500 ms wait, so
retries of a key left IN_PROGRESS by a dead proxy wait, get 409s, and steal
the key once its lease has run out.

What it proves:
  - after every kill (the store as the crash left it) and after every
    restart (beside the live proxy), `idemproxy check-store` exits 0 with
    "ok": true;
  - no key answered 2xx has zero executions, and the answer is one of the
    key's executions (a fresh answer: the execution of that very attempt);
  - no key has more than one execution unless its upstream call was in
    flight at a kill: every execution but (at most) one must belong to an
    attempt whose connection was dropped by the kill of the process serving
    it, and must have started before that kill (+1 s for a request the
    upstream read after the proxy died). Attempts are tagged with
    X-Test-Holder; the upstream's fsync'ed log names each execution's tag;
  - no connection is dropped except by a kill, and no attempt hangs;
  - no record stays IN_PROGRESS past its lease: the run ends with a kill;
    with the proxy down the test waits until every IN_PROGRESS record's
    lease_expires_ms is past, check-store must count them all stealable, and
    after the restart each of those keys is answered by its client's retry
    (within 3 s: they are stealable at once);
  - at the end every key is COMPLETE (no IN_PROGRESS record left), and a
    replay of every key returns the charge id its client was answered with.

CI: 20 kills; long (CHAOS_LONG=1): 200; CHAOS_KILL9_ROUNDS overrides.
"""

import random
import socket
import threading
import time
import unittest

import chaoslib
from chaoslib import harness

TEST = "kill9_chaos"
ROUNDS = chaoslib.knob("KILL9_ROUNDS", 20, 200)
CLIENTS = 32
SCOPE = "payments"


class Attempt:
    __slots__ = ("tag", "key", "gen", "start", "end", "outcome", "status", "charge", "replayed")

    def __init__(self, tag, key, gen, start):
        self.tag, self.key, self.gen, self.start = tag, key, gen, start
        self.end = self.outcome = self.status = self.charge = self.replayed = None


class Kill9Chaos(harness.ProxyTestCase):
    def test_random_kills_lose_nothing_and_execute_only_interrupted_calls_twice(self):
        rnd = chaoslib.rng(TEST)
        seed = rnd.randrange(1 << 30)
        t_start = time.monotonic()
        proxy = self.start_proxy(name="p", lease="1s", heartbeat="300ms", wait="500ms")

        lock = threading.Lock()
        current = {"gen": 0, "port": proxy.port}  # the live proxy generation
        kill_times = {}  # generation -> wall-clock time of its SIGKILL
        attempts = {}  # tag -> Attempt
        answered = {}  # key -> the Attempt that got a 201
        refused = [0]
        stop_new = threading.Event()
        abort = threading.Event()
        errors = []

        def client(c):
            crnd = random.Random(seed + c)
            conn, conn_gen = None, None
            k = 0
            try:
                while not stop_new.is_set() and not abort.is_set():
                    key = "c%d-k%d" % (c, k)
                    k += 1
                    a = 0
                    while not abort.is_set():
                        tag = "%s-a%d" % (key, a)
                        a += 1
                        headers = [("Content-Type", "application/json"),
                                   ("Idempotency-Key", key),
                                   ("X-Test-Delay-Ms", str(crnd.randint(10, 80))),
                                   ("X-Test-Holder", tag)]
                        if conn is None:
                            with lock:
                                gen, port = current["gen"], current["port"]
                            try:
                                conn, conn_gen = harness.Conn(port, timeout=10), gen
                            except OSError:
                                with lock:
                                    refused[0] += 1
                                time.sleep(0.02)
                                a -= 1  # nothing was sent: not an attempt
                                continue
                        at = Attempt(tag, key, conn_gen, time.time())
                        with lock:
                            attempts[tag] = at
                        try:
                            resp = conn.request("POST", "/v1/payments", headers,
                                                harness.PAYMENT_BODY)
                        except socket.timeout:
                            at.end, at.outcome = time.time(), "timeout"
                            conn.close()
                            conn = None
                            continue
                        except (OSError, harness.ConnectionClosed, ValueError) as e:
                            at.end, at.outcome = time.time(), "dropped:%s" % type(e).__name__
                            conn.close()
                            conn = None
                            time.sleep(0.02)
                            continue
                        at.end, at.outcome, at.status = time.time(), "answered", resp.status
                        at.charge, at.replayed = resp.charge_id, resp.replayed
                        if resp.status == 201:
                            with lock:
                                answered[key] = at
                            break
                        if resp.status == 409:
                            time.sleep(0.1)
                        else:
                            time.sleep(0.05)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append("client %d: %r" % (c, e))
            finally:
                if conn is not None:
                    conn.close()

        threads = [threading.Thread(target=client, args=(c,), daemon=True)
                   for c in range(CLIENTS)]
        for t in threads:
            t.start()

        def abort_clients():
            abort.set()
            for t in threads:
                t.join(20)
        self.addCleanup(abort_clients)

        def kill():
            with lock:  # the time the signal is sent, not when the process is gone
                kill_times[current["gen"]] = time.time()
            proxy.kill9()

        def restart():
            chaoslib.restart(proxy)
            with lock:
                current["gen"] += 1
                current["port"] = proxy.port

        checks = 0

        def check(when):
            nonlocal checks
            result = chaoslib.check_store(self.store_path)
            checks += 1
            self.assertTrue(result.ok, "check-store %s: %r" % (when, result))

        # The chaos: kill at random moments, check the store, restart.
        for r in range(ROUNDS):
            time.sleep(rnd.uniform(0.1, 1.0))
            kill()
            check("after kill %d" % (r + 1))
            if r < ROUNDS - 1:
                restart()
                check("after restart %d" % (r + 1))
        self.assertEqual(errors, [])

        # The last kill left some records IN_PROGRESS (try again until it
        # did). With the proxy down, wait until every lease has run out.
        extra_kills = 0
        while True:
            snap = chaoslib.check_store(self.store_path, records=True)
            self.assertTrue(snap.ok, repr(snap))
            stuck = {h: rec for (h, rec) in snap.records.items() if rec["state"] == "in_progress"}
            if stuck or extra_kills >= 20:
                break
            restart()
            time.sleep(rnd.uniform(0.1, 0.5))
            kill()
            extra_kills += 1
        self.assertTrue(stuck, "no kill in %d tries left a record IN_PROGRESS" % extra_kills)
        latest = max(rec["lease_expires_ms"] for rec in stuck.values())
        time.sleep(max(0.0, (latest + 300) / 1000.0 - time.time()))
        after = chaoslib.check_store(self.store_path, records=True)
        self.assertTrue(after.ok, repr(after))
        still = [rec for rec in after.records.values() if rec["state"] == "in_progress"]
        for rec in still:
            self.assertLess(rec["lease_expires_ms"], after.now_ms_before,
                            "IN_PROGRESS past its lease: %r" % rec)
        self.assertEqual(after.summary["stealable"], after.summary["in_progress"], after.summary)
        self.assertGreaterEqual(len(still), len(stuck))

        # Restart: the clients' retries must steal every one of them.
        with lock:
            hashes = {chaoslib.record_key(SCOPE, at.key): at.key for at in attempts.values()}
        stuck_keys = {hashes[h] for h in stuck}
        restart()
        t_restart = time.time()
        stop_new.set()
        for t in threads:
            t.join(120)
        self.assertEqual(errors, [])
        self.assertFalse(any(t.is_alive() for t in threads), "clients still retrying")
        for key in stuck_keys:
            self.assertIn(key, answered, "%s was IN_PROGRESS at the last kill and was never "
                          "answered after the restart" % key)
        stolen_s = max(answered[k].end for k in stuck_keys) - t_restart
        # They were stealable: nothing to wait for but the restart itself.
        self.assertLess(stolen_s, 3.0, "keys stuck at the last kill answered %.1f s after the "
                        "restart" % stolen_s)

        # The whole store: every key COMPLETE, nothing IN_PROGRESS.
        final = chaoslib.check_store(self.store_path, records=True)
        self.assertTrue(final.ok, repr(final))
        checks += 1
        self.assertEqual(final.summary["in_progress"], 0, final.summary)

        # Connections only drop at kills; nothing hangs.
        outcomes = {}
        unexplained_drops = []
        for at in attempts.values():
            kind = (at.outcome or "none").split(":")[0]
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if kind == "dropped":
                killed = kill_times.get(at.gen)
                if killed is None or killed > at.end + 0.05:
                    unexplained_drops.append((at.tag, at.gen, at.start, at.end, at.outcome))
        statuses = {}
        for at in attempts.values():
            if at.status is not None:
                statuses[at.status] = statuses.get(at.status, 0) + 1

        # Executions against answers and kills.
        execs = {}
        for e in chaoslib.execution_log(self.upstream):
            execs.setdefault(e["key"], []).append(e)
        keys = sorted({at.key for at in attempts.values()})
        problems = []
        interrupted_total = reexecuted_keys = max_execs = 0
        for key in keys:
            got = execs.get(key, [])
            max_execs = max(max_execs, len(got))
            at = answered.get(key)
            if at is None:
                problems.append("%s: never answered" % key)
                continue
            if not got:
                problems.append("%s: answered 201 with zero executions" % key)
                continue
            charges = {e["charge_id"]: e for e in got}
            if at.charge not in charges:
                problems.append("%s: answered with %s, not one of its executions %r"
                                % (key, at.charge, sorted(charges)))
            elif not at.replayed and charges[at.charge]["holder"] != at.tag:
                problems.append("%s: fresh answer %s came from %s's execution, not %s's"
                                % (key, at.charge, charges[at.charge]["holder"], at.tag))
            plain = []
            for e in got:
                src = attempts.get(e["holder"])
                killed = kill_times.get(src.gen) if src is not None else None
                if (src is not None and (src.outcome or "").startswith("dropped")
                        and killed is not None
                        and chaoslib.iso_to_epoch(e["time"]) <= killed + 1.0):
                    interrupted_total += 1
                else:
                    plain.append(e["holder"])
            if len(got) > 1:
                reexecuted_keys += 1
            if len(plain) > 1:
                problems.append("%s: %d executions not interrupted by a kill: %r"
                                % (key, len(plain), plain))

        # Every key replays what its client was told.
        replays_ok = 0
        with proxy.conn(timeout=10) as conn:
            for key in keys:
                if key not in answered:
                    continue
                r = conn.request("POST", "/v1/payments",
                                 [("Content-Type", "application/json"),
                                  ("Idempotency-Key", key), ("X-Test-Holder", "final")],
                                 harness.PAYMENT_BODY)
                if r.status == 201 and r.replayed and r.charge_id == answered[key].charge:
                    replays_ok += 1
                else:
                    problems.append("%s: final replay %r, client was answered %s"
                                    % (key, r, answered[key].charge))
        total_execs = sum(len(v) for v in execs.values())
        chaoslib.figure(
            TEST, kills=len(kill_times), clients=CLIENTS, keys=len(keys), answered=len(answered),
            attempts=len(attempts), dropped_by_kill=outcomes.get("dropped", 0),
            status_201=statuses.get(201, 0), status_409=statuses.get(409, 0),
            other_status=sum(n for (s, n) in statuses.items() if s not in (201, 409)),
            timeouts=outcomes.get("timeout", 0), unexplained_drops=len(unexplained_drops),
            executions=total_execs, reexecuted_keys=reexecuted_keys,
            executions_in_flight_at_kill=interrupted_total, max_exec_per_key=max_execs,
            in_progress_at_last_kill=len(stuck), stolen_after_restart_s=round(stolen_s, 2),
            check_store_runs=checks, final_replays_ok=replays_ok, problems=len(problems),
            test_s=round(time.monotonic() - t_start, 1))
        self.assertEqual(problems[:20], [], "%d problems" % len(problems))
        self.assertEqual(unexplained_drops[:20], [], "connections dropped without a kill")
        self.assertEqual(outcomes.get("timeout", 0), 0, "attempts that hung 10 s")
        self.assertEqual({s for s in statuses if s not in (201, 409)}, set(),
                         "unexpected statuses %r" % statuses)
        self.assertEqual(replays_ok, len(answered))
        self.assertEqual(final.summary["complete"], len(keys), final.summary)


if __name__ == "__main__":
    unittest.main()
