"""test_fault_loops.py - SQLite-style fault loops against the real binary.

Needs a build with -DIDEM_FAULT_INJECTION=ON (proxy/fault.h). For each mode

  lmdb       the Nth LMDB call after startup fails with EIO (a commit aborts
             its transaction first, as a failing commit does)
  lmdb-full  the Nth LMDB put or delete fails with MDB_MAP_FULL
  alloc      the Nth malloc/calloc/realloc/strdup made by our own code
             (config, store, proxy; not the libraries') returns NULL

and N = 1..K, where K is what one fault-free run of the scenario counts
(IDEM_FAULT_COUNT_FILE), a fresh proxy on a fresh store runs one fixed
scenario: a keyed first request, its replay, the same key with another body
(mismatch), an upstream 500 that releases its key and the retry of that key,
a pass-through GET, and a duplicate that waits for a running first request.
Then it gets SIGTERM, and `idemproxy check-store` scans the store.

Each run must show: no crash (the proxy is alive until SIGTERM, then exits
0; under AddressSanitizer a leak makes that exit non-zero and is reported
apart), no hang, every answer either the correct one for the state the
earlier answers left or a documented 5xx (500/502/503/504 problem+json; in
the alloc mode always out-of-memory, 503 with Retry-After before anything
was sent: a failed allocation blamed on the upstream, the store or the
record sends an operator the wrong way), the
upstream never running a request more often than it was forwarded, and the
invariant scan passing. The correct answers allow for what a fault may
legitimately do (README, Failure policy): a result that could not be stored
(logged "unstored") is held until its TTL after the client got it, so its
retry gets a 409, never a second run; a release that could not be written
leaves the record held until its lease expires, so its retry gets a 409
too. An answer below 500 that released its key is wrong: the action ran.

Runs go IDEM_FAULTS_JOBS (default 3) at a time. Every N is run up to
IDEM_FAULTS_DENSE (default 200) per mode; past it, every Nth with a stride
that keeps a mode at about IDEM_FAULTS_MAX_RUNS (default 300) runs, plus the
last one. The summary line says which N ran.
"""

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import harness  # noqa: E402

JOBS = int(os.environ.get("IDEM_FAULTS_JOBS", "3"))
DENSE = int(os.environ.get("IDEM_FAULTS_DENSE", "200"))
MAX_RUNS = int(os.environ.get("IDEM_FAULTS_MAX_RUNS", "300"))
# Debugging aids: a comma-separated subset of the modes, and one line per run.
ONLY_MODES = [m for m in os.environ.get("IDEM_FAULTS_MODES", "").split(",") if m]
VERBOSE = os.environ.get("IDEM_FAULTS_VERBOSE") == "1"
REQUEST_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 25.0

BODY1 = b'{"amount":1000,"currency":"eur"}'
BODY2 = b'{"amount":2000,"currency":"eur"}'
DOCUMENTED_5XX = (500, 502, 503, 504)

MODES = (
    # mode, environment, which count gives K
    ("lmdb", {"IDEM_FAULT_LMDB_ERR": "eio"}, "IDEM_FAULT_LMDB_NTH", "lmdb_calls"),
    ("lmdb-full", {"IDEM_FAULT_LMDB_ERR": "full"}, "IDEM_FAULT_LMDB_NTH", "lmdb_write_calls"),
    ("alloc", {}, "IDEM_FAULT_ALLOC_NTH", "alloc_calls"),
)


# Open issues the loops found, by the function that made the failed call.
# A run failing only at one of these sites is reported, not failed, so that
# the loops keep guarding everything else; IDEM_FAULTS_STRICT=1 fails them
# too. An entry that no full (unsampled) loop hits any more must go.
STRICT = os.environ.get("IDEM_FAULTS_STRICT") == "1"
# None open: the five the allocation loops found (collect_header,
# response_from_upstream, on_uri, append_body, curl_sock_at) are fixed, and
# their runs must now answer correctly or with a documented 5xx.
KNOWN_ISSUES = ()


def sample(k):
    """The N to run for a count k (see the module docstring)."""
    if k <= DENSE:
        return list(range(1, k + 1))
    stride = max(1, (k - DENSE) // max(1, MAX_RUNS - DENSE))
    ns = list(range(1, DENSE + 1)) + list(range(DENSE + stride, k + 1, stride))
    if ns[-1] != k:
        ns.append(k)
    return ns


class FaultProxy(harness.Proxy):
    """harness.Proxy with its own environment (the fault variables)."""

    def __init__(self, workdir, config, name, env):
        super().__init__(workdir, config, name, env=env)


# ---------------------------------------------------------------------------
# One answer
# ---------------------------------------------------------------------------

class Answer:
    """What the client saw for one request: a response, or "dropped" (the
    connection closed without one), or "timeout"."""

    def __init__(self, step, key, resp=None, failure=None):
        self.step = step
        self.key = key
        self.resp = resp
        self.failure = failure  # None, "dropped" or "timeout"
        self.verdict = None  # "correct", "5xx" or "wrong: ..."

    def is_problem_5xx(self):
        r = self.resp
        if r is None or r.status not in DOCUMENTED_5XX:
            return False
        ctype = (r.header("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/problem+json":
            return False
        try:
            doc = r.json()
        except ValueError:
            return False
        return (isinstance(doc, dict) and doc.get("status") == r.status and
                all(isinstance(doc.get(m), str) for m in ("type", "title", "detail")))

    def problem_type(self):
        """The last segment of a problem+json answer's type ("out-of-memory")."""
        try:
            return str(self.resp.json().get("type", "")).rsplit(":", 1)[-1]
        except (ValueError, AttributeError):
            return ""

    def is_fresh(self, status=201):
        """An answer of the upstream, whole: status, its headers, its body."""
        r = self.resp
        if r is None or r.status != status or r.replayed or r.charge_id is None:
            return False
        if (r.header("Content-Type") or "") != "application/json":
            return False
        try:
            return r.json().get("id") == r.charge_id
        except ValueError:
            return False

    def is_replay_of(self, first):
        r, f = self.resp, first.resp
        return (r is not None and r.replayed and r.status == f.status and r.body == f.body and
                r.charge_id == f.charge_id and
                r.header_all("Content-Type") == f.header_all("Content-Type") and
                not r.has("Set-Cookie"))

    def is_conflict(self):
        r = self.resp
        return (r is not None and r.status == 409 and r.header("Retry-After") is not None and
                (r.header("Content-Type") or "").startswith("application/problem+json"))

    def is_mismatch(self):
        r = self.resp
        return (r is not None and r.status == 422 and
                (r.header("Content-Type") or "").startswith("application/problem+json"))

    def describe(self):
        if self.resp is None:
            return "%s %s: %s" % (self.step, self.key, self.failure)
        return "%s %s: %d%s %r" % (self.step, self.key, self.resp.status,
                                   " replayed" if self.resp.replayed else "",
                                   self.resp.body[:160])


def send(proxy, step, key, path, body, headers=(), method="POST"):
    h = [("Content-Type", "application/json")]
    if key is not None:
        h.append(("Idempotency-Key", key))
    h.extend(headers)
    try:
        resp = proxy.request(method, path, h, body, timeout=REQUEST_TIMEOUT_S)
        return Answer(step, key, resp=resp)
    except socket.timeout:
        return Answer(step, key, failure="timeout")
    except (harness.ConnectionClosed, ConnectionError, ValueError):
        return Answer(step, key, failure="dropped")


# ---------------------------------------------------------------------------
# The scenario. Each answer gets a first verdict here from what the earlier
# answers showed; run_one() then checks, per key, what needs the access log
# and the upstream's count (a second execution needs a result that could not
# be stored).
# ---------------------------------------------------------------------------

HELD = "held?"


def verdict_same_body(a, earlier_fresh):
    """A request with its key's first body: the upstream's answer, or the
    replay of an earlier one."""
    if a.failure is not None:
        return "wrong: " + a.failure
    if a.is_problem_5xx():
        return "5xx"
    if a.is_fresh():
        return "correct"
    if a.resp.replayed and any(a.is_replay_of(f) for f in earlier_fresh):
        return "correct"
    if a.is_conflict():
        # Correct only where a result could not be stored: its record is
        # held IN_PROGRESS until the TTL (README, Failure policy); run_one
        # checks the access log.
        return HELD
    return "wrong: expected the upstream's answer or a replay of it"


def run_scenario(proxy, tag):
    """Runs the scenario; returns the answers (with verdicts) in order."""
    a_key, c_key, d_key = tag + "-a", tag + "-c", tag + "-d"
    answers = []

    def fresh_of(key, step=None):
        return [a for a in answers if a.key == key and a.is_fresh() and
                (step is None or a.step == step)]

    def add(a, verdict):
        a.verdict = verdict
        answers.append(a)

    # S1 a keyed first request, S2 its duplicate.
    for step in ("first", "replay"):
        a = send(proxy, step, a_key, "/v1/payments", BODY1)
        add(a, verdict_same_body(a, fresh_of(a_key)))
    # S3 the same key with another body: 422 once a result was stored; when
    # none was (the attempts failed, or their results were not stored) it
    # simply runs (run_one checks the log for the latter).
    a = send(proxy, "mismatch", a_key, "/v1/payments", BODY2)
    if a.failure is not None:
        v = "wrong: " + a.failure
    elif a.is_problem_5xx():
        v = "5xx"
    elif a.is_mismatch():
        v = "correct" if fresh_of(a_key) else "wrong: 422 although nothing ran"
    elif a.is_fresh():
        v = "correct"
    else:
        v = "wrong: expected 422"
    add(a, v)
    # S4 an upstream 500 is passed on and releases the key; S5 its retry
    # runs again, or, if the release could not be written, finds the record
    # held (409 at once: the route's wait is 0; run_one checks the store).
    a = send(proxy, "upstream-500", c_key, "/v1/refunds", BODY1, [("X-Test-Status", "500")])
    if a.failure is not None:
        v = "wrong: " + a.failure
    elif a.is_problem_5xx() and not a.resp.has("X-Charge-Id"):
        v = "5xx"
    elif a.is_fresh(500):
        v = "correct"
    else:
        v = "wrong: expected the upstream's 500"
    add(a, v)
    a = send(proxy, "retry-after-500", c_key, "/v1/refunds", BODY1)
    if a.failure is not None:
        v = "wrong: " + a.failure
    elif a.is_problem_5xx():
        v = "5xx"
    elif a.is_fresh() or a.is_conflict():
        v = "correct"
    else:
        v = "wrong: expected a new execution"
    add(a, v)
    # S6 not covered (GET): forwarded as it is.
    a = send(proxy, "passthrough", None, "/v1/payments/" + tag, b"", method="GET")
    if a.failure is not None:
        v = "wrong: " + a.failure
    elif a.is_problem_5xx() or a.is_fresh():
        v = "5xx" if a.is_problem_5xx() else "correct"
    else:
        v = "wrong: expected the upstream's answer"
    add(a, v)
    # S7 a duplicate that arrives while the first runs waits, then replays
    # the first's answer (or runs itself if the first released the key).
    f1 = harness.in_thread(send, proxy, "holder", d_key, "/v1/payments", BODY1,
                           [("X-Test-Delay-Ms", "400")])
    time.sleep(0.15)
    d2 = send(proxy, "waiter", d_key, "/v1/payments", BODY1)
    d1 = f1.result(REQUEST_TIMEOUT_S + 5)
    fresh = [a for a in (d1, d2) if a.is_fresh()]
    for a in (d1, d2):
        add(a, verdict_same_body(a, fresh))
    return answers


class FaultLoops(harness.ProxyTestCase):

    def job_config(self, store_path):
        return {
            "listen": "127.0.0.1:0",
            "upstream": {"url": self.upstream.url, "connect_timeout": "2s", "timeout": "10s"},
            "store": {"path": store_path, "durability": "sync", "map_size": "64MiB",
                      "purge_interval": "1h"},
            # Two workers: the wake-up of a waiting duplicate goes to each.
            "server": {"workers": 2, "drain_timeout": "5s"},
            "routes": [
                # The waiting duplicate must outwait its holder (400 ms) on
                # a loaded machine too: a 409 after the wait is a correct
                # answer this scenario does not expect.
                {"path": "/v1/payments", "methods": ["POST", "PATCH"], "scope": "payments",
                 "lease": "5s", "heartbeat": "2s", "wait": "10s"},
                {"path": "/v1/refunds", "methods": ["POST"], "scope": "refunds",
                 "lease": "5s", "heartbeat": "2s", "wait": "0"},
            ],
        }

    def run_one(self, mode, n, env_extra):
        """One proxy, one scenario, one fault. Returns a result dict."""
        tag = "%s-%d" % (mode, n)
        jobdir = os.path.join(self.workdir, tag)
        os.makedirs(jobdir)
        store_path = os.path.join(jobdir, "store")
        env = dict(os.environ)
        for var in ("IDEM_FAULT_LMDB_NTH", "IDEM_FAULT_ALLOC_NTH", "IDEM_FAULT_LMDB_ERR"):
            env.pop(var, None)
        env.update(env_extra)
        env["IDEM_FAULT_COUNT_FILE"] = os.path.join(jobdir, "counts.json")
        res = {"mode": mode, "n": n, "tag": tag, "dir": jobdir, "problems": [],
               "answers": [], "crash": False, "leak": False, "hang": False}
        proxy = FaultProxy(jobdir, self.job_config(store_path), "proxy", env)
        proxy.start()
        try:
            answers = run_scenario(proxy, tag)
        finally:
            alive = proxy.running()
            rc = proxy.stop(timeout=STOP_TIMEOUT_S)
        err = proxy.stderr()
        res["answers"] = answers
        res["stderr"] = err
        if "LeakSanitizer" in err:
            res["leak"] = True
            res["problems"].append("leak")
        if not alive or "AddressSanitizer" in err or "runtime error:" in err:
            res["crash"] = True
            res["problems"].append("crash (exit %r)" % rc)
        elif rc is None:
            res["hang"] = True
            res["problems"].append("no exit within %.0fs of SIGTERM" % STOP_TIMEOUT_S)
        elif rc != 0 and not res["leak"]:
            res["crash"] = True
            res["problems"].append("exit status %r after SIGTERM" % rc)
        try:
            log = proxy.access_log()
        except ValueError as e:
            log = []
            res["problems"].append("access log unreadable: %s" % e)
        # Keys whose result could not be stored: their records are held
        # IN_PROGRESS until the TTL, so their retries get 409.
        unstored_keys = set()
        salt = harness.log_salt(store_path)
        for key, scope in ((tag + "-a", "payments"), (tag + "-c", "refunds"),
                           (tag + "-d", "payments")):
            h = harness.log_key(store_path, scope, key, salt)
            if any(e.get("key") == h and e.get("outcome") == "unstored" for e in log):
                unstored_keys.add(key)
        # A failed allocation is the proxy's own want of memory: its 5xx
        # must say so (out-of-memory; 503 with Retry-After when nothing was
        # sent), not blame the upstream (502 upstream-*), the store (503
        # store-unavailable) or the record (500 corrupt-record), which sends
        # an operator to the wrong place, or to delete a good record.
        if mode == "alloc":
            for a in answers:
                if a.verdict != "5xx":
                    continue
                if a.problem_type() != "out-of-memory":
                    res["problems"].append("%s: a failed allocation answered as %r" % (
                        a.describe(), a.problem_type()))
                elif a.resp.status == 503 and a.resp.header("Retry-After") is None:
                    res["problems"].append("%s: 503 out-of-memory without Retry-After" % (
                        a.describe(),))
        for a in answers:
            if a.verdict == HELD:
                a.verdict = ("correct" if a.key in unstored_keys else
                             "wrong: 409 although no result was left unstored")
            if a.failure == "timeout":
                res["hang"] = True
            if a.verdict.startswith("wrong"):
                res["problems"].append("%s -> %s" % (a.describe(), a.verdict))
        # The log and the upstream: a fresh answer repeated for one key
        # needs a result that could not be stored; nothing runs more often
        # than it was forwarded.
        held_seen = False
        for key, scope in ((tag + "-a", "payments"), (tag + "-c", "refunds"),
                           (tag + "-d", "payments")):
            h = harness.log_key(store_path, scope, key, salt)
            mine = [a for a in answers if a.key == key]
            unstored = [e for e in log if e.get("key") == h and e.get("status", 0) < 500 and
                        e.get("outcome") == "unstored"]
            # No route here releases on a status below 500: such an answer
            # released is an action that ran with its key let go.
            if any(e.get("key") == h and e.get("status", 0) < 500 and
                   e.get("outcome") == "released" for e in log):
                res["problems"].append("%s: an answer below 500 released its key" % key)
            first_body = [a for a in mine if a.is_fresh() and a.step != "mismatch"]
            if len(first_body) > 1 + len(unstored):
                res["problems"].append(
                    "%s: ran %d times with one body, %d result(s) logged as not stored" % (
                        key, len(first_body), len(unstored)))
            if any(a.step == "mismatch" and a.is_fresh() for a in mine) and \
                    len(first_body) > len(unstored):
                res["problems"].append("%s: another body ran although a result was stored" % key)
            held_seen = held_seen or any(a.is_conflict() for a in mine)
            forwarded = [a for a in mine if not (a.resp is not None and (
                a.resp.replayed or a.resp.status in (409, 422)))]
            count = self.upstream.count(key)
            if count > len(forwarded):
                res["problems"].append("%s: %d executions for %d forwarded requests" % (
                    key, count, len(forwarded)))
        # The invariant scan.
        cs = subprocess.run([harness.binary(), "check-store", store_path, "--records"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith("IDEM_FAULT_")})
        res["held"] = 0
        if cs.returncode != 0:
            res["problems"].append("check-store exit %d: %s %s" % (
                cs.returncode, cs.stdout.decode()[-500:], cs.stderr.decode()[-1500:]))
        else:
            for line in cs.stdout.decode().splitlines():
                doc = json.loads(line)
                if doc.get("state") == "in_progress":
                    res["held"] += 1
            # After a drained stop every request has settled its record;
            # only a release that could not be written leaves one held, and
            # then its retry saw the 409, or a result that could not be
            # stored (held until its TTL, logged "unstored").
            if held_seen and res["held"] == 0:
                res["problems"].append("a 409 although no record is held")
            if res["held"] > len(unstored_keys) and not held_seen:
                res["problems"].append("%d record(s) left IN_PROGRESS" % res["held"])
        try:
            with open(env["IDEM_FAULT_COUNT_FILE"]) as f:
                res["counts"] = json.load(f)
        except (OSError, ValueError):
            res["counts"] = None
            if not res["crash"]:
                res["problems"].append("no fault report written at exit")
        return res

    def symbolize(self, res):
        """What was failed: (text, function names innermost first). An LMDB
        fault names its call; a failed allocation's stack is resolved with
        addr2line (the count file has it as offsets into the executable)."""
        counts = res.get("counts") or {}
        if counts.get("lmdb_failed"):
            func, call = counts["lmdb_failed"]
            return "%s: %s" % (func, call), [func]
        stack = counts.get("alloc_stack") or []
        if not stack or shutil.which("addr2line") is None:
            return "?", []
        out = subprocess.run(["addr2line", "-f", "-s", "-e", harness.binary()] + stack,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode()
        lines = out.splitlines()
        frames = [(lines[i], lines[i + 1]) for i in range(0, len(lines) - 1, 2)
                  if not lines[i + 1].startswith("fault.c:")]
        text = " < ".join("%s (%s)" % f for f in frames)[:600]
        return "%s %s" % (counts.get("alloc_failed"), text), [f[0] for f in frames]

    def known_issue(self, res, functions):
        """The KNOWN_ISSUES entry a failed run is, if any: never a crash or
        a leak, and only in its mode, at its site."""
        if res["crash"] or res["leak"]:
            return None
        for mode, site, _ in KNOWN_ISSUES:
            if mode == res["mode"] and site in functions:
                return site
        return None

    def test_fault_loops(self):
        harness.binary()
        base = self.run_one("baseline", 0, {})
        self.assertEqual(base["problems"], [], "the scenario fails without any fault: %r" % (
            base["problems"],))
        self.assertIsNotNone(base["counts"], "no count file: is this an "
                             "IDEM_FAULT_INJECTION build?")
        for a in base["answers"]:
            self.assertEqual(a.verdict, "correct", a.describe())
        self.assertEqual(base["held"], 0)

        jobs = []
        ranges = {}
        for mode, env, var, count_name in MODES:
            if ONLY_MODES and mode not in ONLY_MODES:
                continue
            k = base["counts"][count_name]
            self.assertGreater(k, 0, "%s: nothing counted" % mode)
            ns = sample(k)
            ranges[mode] = (k, ns)
            for n in ns:
                e = dict(env)
                e[var] = str(n)
                jobs.append((mode, n, e))

        results = []
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
            futs = [pool.submit(self.run_one, mode, n, e) for (mode, n, e) in jobs]
            for f in futs:
                results.append(f.result())
        elapsed = time.monotonic() - started

        failed, known = [], {}
        report = []
        for r in results:
            text, functions = self.symbolize(r)
            r["fault"] = text
            r["known"] = None
            if not r["problems"]:
                continue
            r["known"] = None if STRICT else self.known_issue(r, functions)
            if r["known"] is not None:
                known.setdefault(r["known"], []).append(r)
            else:
                failed.append(r)
                report.append("--- %s N=%d (%s): %s\n    fault: %s" % (
                    r["mode"], r["n"], r["dir"], "; ".join(r["problems"]), text))
        if VERBOSE:
            for r in results:
                report.append("%s N=%d held=%d [%s] %s" % (
                    r["mode"], r["n"], r["held"], r["fault"],
                    " ".join("%s:%s%s" % (a.step, a.resp.status if a.resp else a.failure,
                                          ":" + a.problem_type() if a.is_problem_5xx() else "")
                             for a in r["answers"] if a.verdict != "correct")))
        for mode, site, why in KNOWN_ISSUES:
            runs = known.get(site, [])
            if runs:
                report.append("known open issue (%s at %s), N=%s: %s" % (
                    mode, site, ",".join(str(r["n"]) for r in runs), why))
            elif mode in ranges and len(ranges[mode][1]) == ranges[mode][0]:
                failed.append(None)
                report.append("known issue (%s at %s) no longer seen: remove it from "
                              "KNOWN_ISSUES" % (mode, site))

        def count(pred, runs=results):
            return sum(1 for r in runs for a in r["answers"] if pred(r, a))

        crashes = sum(1 for r in results if r["crash"])
        leaks = sum(1 for r in results if r["leak"])
        hangs = sum(1 for r in results if r["hang"] and r["known"] is None)
        n5xx = count(lambda r, a: a.verdict == "5xx")
        ncorrect = count(lambda r, a: a.verdict == "correct")
        nwrong = count(lambda r, a: a.verdict.startswith("wrong") and r["known"] is None)
        nknown = sum(len(v) for v in known.values())
        held = sum(1 for r in results if r["held"])
        parts = []
        for mode in ranges:
            k, ns = ranges[mode]
            parts.append("%s N=1..%d%s" % (mode, k, "" if len(ns) == k else
                                          " (%d sampled: every N to %d, then a stride)" % (
                                              len(ns), min(k, DENSE))))
        summary = ("faults: %s: %d crashes, %d leaks, %d hangs, %d documented 5xx, %d correct, "
                   "%d wrong; %d runs at known open issues; %d runs left a record held until "
                   "its lease expired; %d runs in %.0fs" % (
                       ", ".join(parts), crashes, leaks, hangs, n5xx, ncorrect, nwrong, nknown,
                       held, len(results), elapsed))
        sys.stderr.write("\n".join(report + [summary]) + "\n")
        if failed:
            self.fail("%d of %d fault runs failed (see above)" % (len(failed), len(results)))


if __name__ == "__main__":
    unittest.main()
