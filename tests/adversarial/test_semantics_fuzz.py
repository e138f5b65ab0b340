#!/usr/bin/env python3
"""Semantics fuzzer: random traffic on few keys, checked against the record model.

The request and response fuzzers check framing; the e2e scenarios check one
rule at a time. This test composes the rules at random: two proxies on one
store (one with the native upstream client, one with libcurl), four routes
(two sharing the scope "payments"; one with on_unknown "complete" and
release_on ["5xx", 429]; one with scope_header X-Tenant-Id, release_on
["4xx", 503] and a wait of 250 ms), and a few hundred requests on a few dozen
identities, sent by 16 clients at once in bursts on the same identity. Each
request picks at random:

  * its identity's key (the same key strings in every scope and tenant, which
    must stay apart), its route and path, and its body: the identity's JSON,
    the same JSON with other key order and white space (same fingerprint), or
    another amount (another fingerprint);
  * what the upstream does with it (X-Test-* headers, outside the
    fingerprint): 201, 201 after a delay, 402, 429, 500, 503, a reset, a close
    before answering, a body cut short, or no answer (the upstream timeout);
  * the proxy, and whether the client hangs up before the answer.

Every request carries its own id (X-Test-Holder), which the upstream writes
in its execution log. What is checked, per identity (scope, tenant, key):

  * every execution is of a request that was sent, with that request's key,
    path and body, and no request runs twice;
  * at most one execution had a storable outcome (a status its route's
    release_on does not list, or any unknown outcome on the on_unknown
    "complete" route), and nothing ran
    after it: a duplicate never runs once a result is stored;
  * every replay is of that execution: the fingerprint of the stored request,
    byte for byte the same status and body (and the same charge id) as every
    other replay and as the first answer when its client read it;
  * a fresh upstream answer is the request's own execution (its charge id),
    with the status its X-Test-* headers asked for; a fresh 502/504 comes
    from a request that ran into an unknown outcome; 409 carries
    Retry-After; a 422 only when another fingerprint of the identity ran
    before; every proxy error is problem+json;
  * at the end: no record is left IN_PROGRESS, the store holds one record
    per identity with a stored outcome, each of them replays through both
    proxies, and every other identity runs again (once) when sent anew.

ADV_FUZZ_SEED=N replays a run; ADV_FUZZ_CASES=N sets the number of requests
(default 400, 4,000 with ADV_LONG=1).
"""

import hashlib
import json
import os
import random
import threading
import time
import unittest

import adv
from adv import harness

UPSTREAM_TIMEOUT_S = 2.0
WORKERS = 16

# Route path -> (scope, on_unknown "complete", tenant header, release_on,
# which statuses release).
ROUTES = {
    "/v1/payments": ("payments", False, False, None, lambda st: st >= 500),
    "/v1/refunds": ("payments", False, False, None, lambda st: st >= 500),
    "/v1/charges": ("charges", True, False, ["5xx", 429], lambda st: st >= 500 or st == 429),
    "/v1/tenant": ("tenant", False, True, ["4xx", 503], lambda st: 400 <= st < 500 or st == 503),
}
SCOPE_PATHS = {
    "payments": ["/v1/payments", "/v1/refunds"],
    "charges": ["/v1/charges"],
    "tenant": ["/v1/tenant"],
}
# Faults: their weight, the X-Test-* headers that make the upstream do them,
# and the status the client then gets fresh (None: an unknown outcome).
FAULTS = {
    "ok": (30, [], 201),
    "delay": (12, [("X-Test-Delay-Ms", "DELAY")], 201),
    "4xx": (8, [("X-Test-Status", "402")], 402),
    "429": (4, [("X-Test-Status", "429")], 429),
    "5xx": (10, [("X-Test-Status", "503")], 503),
    "500": (4, [("X-Test-Status", "500")], 500),
    "reset": (5, [("X-Test-Fault", "reset")], None),
    "close-before": (5, [("X-Test-Fault", "close-before")], None),
    "close-mid-body": (4, [("X-Test-Fault", "close-mid-body")], None),
    "hang": (3, [("X-Test-Fault", "hang")], None),
}


def canonical(body):
    return json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"))


class Op:
    def __init__(self, ident, run, i, rng, fp_choices):
        scope, tenant, key = ident
        self.id = "%s-op%d" % (run, i)
        self.ident = ident
        self.key = key
        self.tenant = tenant
        # Mostly the identity's first path and JSON: enough runs and replays
        # of one fingerprint, with the others often enough for 422s.
        paths = SCOPE_PATHS[scope]
        self.path = paths[0] if rng.random() < 0.8 else rng.choice(paths)
        doc = dict(fp_choices[0] if rng.random() < 0.85 else fp_choices[1])
        if rng.random() < 0.5:
            # Same fingerprint, other bytes: reversed key order, white space.
            self.body = ("{ " + ", ".join('"%s" : %s' % (k, json.dumps(v))
                                          for k, v in reversed(list(doc.items()))) + " }").encode()
        else:
            self.body = json.dumps(doc, separators=(",", ":")).encode()
        self.fp = (self.path, canonical(self.body))
        names = list(FAULTS)
        self.fault = rng.choices(names, weights=[FAULTS[n][0] for n in names])[0]
        self.fault_headers = [(n, str(rng.randrange(20, 200)) if v == "DELAY" else v)
                              for (n, v) in FAULTS[self.fault][1]]
        self.proxy = rng.randrange(2)
        self.hang_up = rng.random() < 0.08  # the client goes before the answer
        self.hang_up_after = rng.uniform(0.0, 0.15)
        self.resp = None  # a harness.Response, "gone", or an exception
        self.t0 = self.t1 = None

    @property
    def storable(self):
        """Whether the outcome of running this request is stored."""
        status = FAULTS[self.fault][2]
        if status is None:
            return ROUTES[self.path][1]  # on_unknown "complete"
        return not ROUTES[self.path][4](status)  # release_on

    def headers(self):
        h = [("Content-Type", "application/json"), ("Idempotency-Key", self.key),
             ("X-Test-Holder", self.id)]
        if self.tenant is not None:
            h.append(("X-Tenant-Id", self.tenant))
        return h + self.fault_headers

    def where(self):
        return "%s %s %s tenant=%s key=%s fault=%s proxy=%d%s body=%s" % (
            self.id, "POST", self.path, self.tenant, self.key, self.fault, self.proxy,
            " hang-up" if self.hang_up else "", self.body.decode())


class SemanticsFuzz(adv.AdversarialCase):
    def test_random_traffic_keeps_the_record_model(self):
        seed = int(os.environ.get("ADV_FUZZ_SEED") or random.SystemRandom().randrange(1 << 31))
        rng = random.Random(seed)
        n_ops = int(os.environ.get("ADV_FUZZ_CASES") or adv.scale(short=400, long=4000))
        run = "sf%d" % seed
        started = time.monotonic()

        # Identities: the same key strings in every scope and tenant.
        n_keys = max(4, n_ops // 16)
        keys = ["%s-k%d" % (run, i) for i in range(n_keys)]
        idents = []
        for key in keys:
            idents += [("payments", None, key), ("charges", None, key),
                       ("tenant", "t1", key), ("tenant", "t2", key)]
        # Two fingerprints' worth of JSON per identity (besides the path).
        fps = {ident: [{"amount": 100 + i, "currency": "eur", "ref": ident[2]},
                       {"amount": 900 + i, "currency": "eur", "ref": ident[2]}]
               for i, ident in enumerate(idents)}
        ops = []
        while len(ops) < n_ops:
            ident = rng.choice(idents)
            for _ in range(rng.choice([1, 1, 2, 3, 5, 8])):
                ops.append(Op(ident, run, len(ops), rng, fps[ident]))
        ops = ops[:n_ops]
        by_id = {op.id: op for op in ops}

        route = {"lease": "5s", "heartbeat": "1s", "wait": "4s"}
        # The tenant route waits only 250 ms for a running duplicate: some
        # duplicates give up (409) while their holder still runs.
        routes = [dict(route, path=p, methods=["POST"], scope=s,
                       **({"on_unknown": "complete"} if unk else {}),
                       **({"scope_header": "X-Tenant-Id", "wait": "250ms"} if tenant else {}),
                       **({"release_on": rel} if rel is not None else {}))
                  for p, (s, unk, tenant, rel, _) in ROUTES.items()]
        cfg = self.config(routes=routes, timeout="%gs" % UPSTREAM_TIMEOUT_S)
        other = "native" if os.environ.get("IDEMPROXY_UPSTREAM_CLIENT") == "libcurl" else "libcurl"
        cfg_b = json.loads(json.dumps(cfg))
        cfg_b["upstream"]["client"] = other
        proxies = [self.start_proxy(config=cfg), self.start_proxy(config=cfg_b)]

        def send(op, conns):
            p = proxies[op.proxy]
            op.t0 = time.monotonic()
            if op.hang_up:
                with harness.Conn(p.port, timeout=10) as c:
                    c.send(harness.build_request("POST", op.path, op.headers(), op.body,
                                                 host="x"))
                    time.sleep(op.hang_up_after)
                op.resp = "gone"
                op.t1 = time.monotonic()
                return
            for attempt in range(2):
                c = conns.get(op.proxy)
                fresh = c is None
                if c is None:
                    c = conns[op.proxy] = harness.Conn(p.port, timeout=30)
                try:
                    op.resp = c.request("POST", op.path, op.headers(), op.body)
                    break
                except (OSError, harness.ConnectionClosed) as e:
                    # A kept-alive connection the proxy closed meanwhile: once
                    # more on a new one (the request never arrived).
                    c.close()
                    conns.pop(op.proxy, None)
                    op.resp = e
                    if fresh:
                        break
            op.t1 = time.monotonic()
            if isinstance(op.resp, harness.Response) and \
                    (op.resp.header("Connection") or "").lower() == "close":
                conns.pop(op.proxy).close()

        lock = threading.Lock()
        it = iter(ops)

        def worker():
            conns = {}
            while True:
                with lock:
                    op = next(it, None)
                if op is None:
                    break
                try:
                    send(op, conns)
                except Exception as e:  # noqa: BLE001 - reported below
                    op.resp = e
            for c in conns.values():
                c.close()

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Requests whose client hung up may still be running (hang: up to the
        # upstream timeout); then every key is settled.
        deadline = time.monotonic() + UPSTREAM_TIMEOUT_S + 10
        while time.monotonic() < deadline:
            rc, doc, _ = adv.check_store(self.store_path)
            if rc == 0 and not doc.get("in_progress"):
                break
            time.sleep(0.2)
        traffic_s = time.monotonic() - started

        failures = []
        execs = [e for e in self.upstream.entries() if (e.get("holder") or "").startswith(run)]
        runs_of = {}
        for e in sorted(execs, key=lambda e: e["n"]):
            op = by_id.get(e["holder"])
            if op is None:
                failures.append("an execution of a request never sent: %r" % e)
                continue
            if e["key"] != op.key or e["path"] != op.path or \
                    e["body_sha256"] != hashlib.sha256(op.body).hexdigest():
                failures.append("execution %r is not what %s sent" % (e, op.where()))
            runs_of.setdefault(op.id, []).append(e)
        for op_id, es in runs_of.items():
            if len(es) > 1:
                failures.append("request ran %d times: %s" % (len(es), by_id[op_id].where()))

        # Per identity: the executions in the order the upstream read them.
        stored = {}  # ident -> (op, execution) whose outcome was stored
        for e in sorted(execs, key=lambda e: e["n"]):
            op = by_id.get(e["holder"])
            if op is None:
                continue
            prior = stored.get(op.ident)
            if prior is not None:
                failures.append("ran after a stored result (%s, charge %s): %s, charge %s" % (
                    prior[0].id, prior[1]["charge_id"], op.where(), e["charge_id"]))
                continue
            # A fresh 5xx of the proxy (a timeout of the proxy's own) on a
            # release route means this run was released after all.
            if op.storable and not (isinstance(op.resp, harness.Response) and
                                    op.resp.status >= 500 and not op.resp.replayed and
                                    not ROUTES[op.path][1] and op.resp.charge_id is None):
                stored[op.ident] = (op, e)

        ran = {e["holder"]: e for e in execs}
        replays = {}  # ident -> [(op, resp)]
        for op in ops:
            r = op.resp
            if r == "gone":
                continue
            if not isinstance(r, harness.Response):
                failures.append("no answer: %r: %s" % (r, op.where()))
                continue
            if r.replayed:
                replays.setdefault(op.ident, []).append((op, r))
                s = stored.get(op.ident)
                if s is None:
                    failures.append("replay of an identity with no stored result: %s: %s" % (
                        adv.short(r), op.where()))
                elif s[0].fp != op.fp:
                    failures.append("replay for another fingerprint (stored: %s): %s: %s" % (
                        s[0].where(), adv.short(r), op.where()))
                continue
            if r.charge_id is not None:
                # The upstream's own answer: this request's execution.
                e = ran.get(op.id)
                want = FAULTS[op.fault][2]
                if e is None or e["charge_id"] != r.charge_id:
                    failures.append("fresh answer %s is not this request's execution %r: %s" % (
                        adv.short(r), e, op.where()))
                elif want is None or r.status != want:
                    failures.append("fresh answer %d, the upstream was asked for %r: %s" % (
                        r.status, want, op.where()))
                continue
            if not adv.is_problem(r):
                failures.append("an answer that is neither the upstream's nor problem+json: "
                                "%s: %s" % (adv.short(r), op.where()))
                continue
            if r.status in (502, 504):
                if op.id not in ran or FAULTS[op.fault][2] is not None:
                    failures.append("%d without an unknown outcome of its own: %s: %s" % (
                        r.status, adv.short(r), op.where()))
            elif r.status == 409:
                ra = (r.header("Retry-After") or "").strip()
                if not ra.isdigit() or int(ra) < 1:
                    failures.append("409 without Retry-After >= 1: %s: %s" % (
                        adv.short(r), op.where()))
                if op.id in ran:
                    failures.append("409 for a request that ran: %s" % op.where())
            elif r.status == 422:
                if op.id in ran:
                    failures.append("422 for a request that ran: %s" % op.where())
                others = [e for e in execs if by_id.get(e["holder"]) is not None and
                          by_id[e["holder"]].ident == op.ident and
                          by_id[e["holder"]].fp != op.fp and by_id[e["holder"]].t0 <= op.t1]
                if not others:
                    failures.append("422 with no other fingerprint run before: %s" % op.where())
            else:
                failures.append("unexpected answer %s: %s" % (adv.short(r), op.where()))

        # Replays: all alike, and like the first answer when its client read it.
        for ident, rs in replays.items():
            s = stored.get(ident)
            if s is None:
                continue
            first = s[0].resp if isinstance(s[0].resp, harness.Response) else rs[0][1]
            for op, r in rs:
                if r.status != first.status or r.body != first.body or \
                        r.charge_id != first.charge_id:
                    failures.append("replay %s differs from the stored answer %s: %s" % (
                        adv.short(r), adv.short(first), op.where()))
            if first.charge_id is not None and first.charge_id != s[1]["charge_id"]:
                failures.append("replays name charge %s, the stored run was %s: %s" % (
                    first.charge_id, s[1]["charge_id"], s[0].where()))

        # The end state.
        rc, doc, _ = adv.check_store(self.store_path)
        if rc != 0 or doc.get("in_progress"):
            failures.append("check-store after the traffic: exit %d, %r" % (rc, doc))
        elif doc.get("complete") != len(stored):
            failures.append("the store holds %r records, %d identities have a stored result" % (
                doc.get("complete"), len(stored)))
        n_before = len(execs)
        probes_run = probes_replayed = 0
        for ident in idents:
            s = stored.get(ident)
            sample = s[0] if s is not None else next((o for o in ops if o.ident == ident), None)
            if sample is None:
                continue
            h = [(n, v) for (n, v) in sample.headers() if not n.startswith("X-Test-")]
            h.append(("X-Test-Holder", "%s-probe" % sample.id))
            answers = [proxies[i].request("POST", sample.path, h, sample.body) for i in (0, 1)]
            if s is not None:
                probes_replayed += 1
                for a in answers:
                    want = s[0].resp if isinstance(s[0].resp, harness.Response) else None
                    if not a.replayed or (want is not None and a.body != want.body):
                        failures.append("stored result not replayed at the end: %s, want %s: %s" % (
                            adv.short(a), adv.short(want), s[0].where()))
            else:
                probes_run += 1
                if a_fresh(answers[0]) is False or not answers[1].replayed or \
                        answers[1].body != answers[0].body:
                    failures.append("released identity did not run again once, then replay: "
                                    "%s, %s: %s" % (adv.short(answers[0]), adv.short(answers[1]),
                                                    sample.where()))
        after = [e for e in self.upstream.entries() if (e.get("holder") or "").startswith(run)]
        if len(after) - n_before != probes_run:
            failures.append("the end probes ran %d times, %d released identities were sent" % (
                len(after) - n_before, probes_run))
        for p in proxies:
            if not p.running():
                failures.append("proxy %s exited: %s" % (p.name, p.stderr()[-2000:]))

        answered = sum(1 for op in ops if isinstance(op.resp, harness.Response))
        self.summary("semantics-fuzz",
                     "seed %d: %d requests on %d identities (%d answered, %d hung up): "
                     "%d executions, %d identities stored, %d replays, %d 409, %d 422; end: "
                     "%d replayed, %d ran again; %d failures; %.1fs",
                     seed, len(ops), len({op.ident for op in ops}), answered,
                     sum(1 for op in ops if op.resp == "gone"), len(execs), len(stored),
                     sum(len(v) for v in replays.values()),
                     sum(1 for op in ops if isinstance(op.resp, harness.Response) and
                         op.resp.status == 409 and adv.is_problem(op.resp)),
                     sum(1 for op in ops if isinstance(op.resp, harness.Response) and
                         op.resp.status == 422),
                     probes_replayed, probes_run, len(failures), traffic_s)
        if failures:
            self.fail("seed %d (ADV_FUZZ_SEED=%d replays it): %d failures:\n  %s" % (
                seed, seed, len(failures), "\n  ".join(failures[:40])))


def a_fresh(resp):
    return resp.status == 201 and not resp.replayed and resp.charge_id is not None


if __name__ == "__main__":
    unittest.main()
