#!/usr/bin/env python3
"""Item 5, the upstream fault matrix: for every way an upstream can fail
(refused, accept-and-hang, hang after reading, close before responding, reset
after reading, close mid-body, 500/502/503/504, a 1 byte/s drip, a response
over upstream.max_response, bad framing and an unparsable status line), N
keyed requests at once are each answered within upstream.timeout + 0.5 s with
the status the README's failure policy documents, the upstream executed each
exactly once (libcurl never resent one), and the record ends in the
documented state: released (a healthy retry executes) under on_unknown
"release", or the 502/504 stored and replayed under on_unknown "complete"
(upstream 5xx answers are released either way: release_on).

The retry goes through a second proxy on the same store with a healthy
upstream, so the faults that live in the upstream's address (refused,
accept-and-hang) are checked the same way as the header-driven ones."""

import collections
import socket
import threading
import time
import unittest

import adv
from adv import harness

TIMEOUT_S = 1.0
SLACK_S = 0.5
MAX_RESPONSE = 64 * 1024

# name, which proxy, request headers, expected status, kind:
#   "unknown"   the outcome is unknown: released, or stored under "complete"
#   "unsent"    nothing was sent: released in both modes
#   "upstream"  the upstream's own 5xx: passed on, released in both modes
#   "te-and-cl" Transfer-Encoding: chunked and Content-Length together. RFC 9112
#               section 6.3 lets an intermediary either treat it as an error
#               (502, unknown outcome) or forward it framed by the chunked
#               coding, the Content-Length removed; both are accepted here, the
#               second only with the full chunked body, one Content-Length
#               equal to it, and the record COMPLETE (replayed)
FAULTS = [
    ("refused", "refused", [], 502, "unsent"),
    ("accept-and-hang", "blackhole", [], 504, "unknown"),
    ("hang-after-reading", "main", [("X-Test-Fault", "hang")], 504, "unknown"),
    ("close-before-responding", "main", [("X-Test-Fault", "close-before")], 502, "unknown"),
    ("reset-after-reading", "main", [("X-Test-Fault", "reset")], 502, "unknown"),
    ("close-mid-body", "main", [("X-Test-Fault", "close-mid-body")], 502, "unknown"),
    ("status-500", "main", [("X-Test-Status", "500")], 500, "upstream"),
    ("status-502", "main", [("X-Test-Status", "502")], 502, "upstream"),
    ("status-503", "main", [("X-Test-Status", "503")], 503, "upstream"),
    ("status-504", "main", [("X-Test-Status", "504")], 504, "upstream"),
    ("drip-1-byte-per-s", "main", [("X-Test-Fault", "drip"), ("X-Test-Drip-Ms", "1000")], 504,
     "unknown"),
    ("over-max-response", "main", [("X-Test-Fault", "huge"), ("X-Test-Size", str(4 * MAX_RESPONSE))],
     502, "unknown"),
    ("bad-framing-two-content-lengths", "main", [("X-Test-Fault", "two-content-lengths")], 502,
     "unknown"),
    ("bad-framing-chunk-size", "main", [("X-Test-Fault", "bad-chunk-size")], 502, "unknown"),
    ("bad-framing-te-and-cl", "main", [("X-Test-Fault", "bad-framing")], 502, "te-and-cl"),
    ("bad-status-line", "main", [("X-Test-Fault", "bad-status-line")], 502, "unknown"),
]

ROUTES = {"release": "/v1/payments", "complete": "/v1/charges"}


class Blackhole:
    """Accepts connections and never reads from them nor answers."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.port = self.sock.getsockname()[1]
        self.held = []
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.sock.settimeout(0.2)
        while not self.stopped:
            try:
                c, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.held.append(c)

    def close(self):
        self.stopped = True
        self.thread.join()
        self.sock.close()
        for c in self.held:
            c.close()


class UpstreamFaultMatrix(adv.AdversarialCase):
    def test_fault_matrix(self):
        n = adv.scale(short=10, long=50)
        routes = [
            self.route(path=ROUTES["release"], scope="pay", on_unknown="release", wait="0s"),
            self.route(path=ROUTES["complete"], scope="charge", on_unknown="complete", wait="0s"),
        ]

        def cfg(url):
            c = self.config(routes=routes, upstream_url=url, timeout="%gs" % TIMEOUT_S,
                            server={"per_ip_connections": 0})
            c["upstream"]["connect_timeout"] = "%gs" % TIMEOUT_S
            c["upstream"]["max_response"] = MAX_RESPONSE
            return c

        blackhole = Blackhole()
        self.addCleanup(blackhole.close)
        proxies = {
            "main": self.start_proxy(cfg(self.upstream.url), name="main"),
            "refused": self.start_proxy(cfg("http://127.0.0.1:%d" % harness.closed_port()),
                                        name="refused"),
            "blackhole": self.start_proxy(cfg("http://127.0.0.1:%d" % blackhole.port),
                                          name="blackhole"),
        }
        healthy = proxies["main"]

        failures = []
        stale = []  # answered 502 without an execution: a stale pooled connection
        by_fault = {}
        worst = 0.0
        total = 0
        started = time.monotonic()
        for name, which, headers, status, kind in FAULTS:
            proxy = proxies[which]
            jobs = [(mode, "%s-%s-%d" % (name, mode, i)) for mode in ROUTES for i in range(n)]
            before = self.upstream.total()

            def send(job, proxy=proxy, headers=headers):
                mode, key = job
                return adv.timed_request(proxy.port, "POST", ROUTES[mode], [
                    ("Content-Type", "application/json"), ("Idempotency-Key", key)] + headers,
                    harness.PAYMENT_BODY, timeout=TIMEOUT_S + 10)

            answers = adv.parallel(send, jobs, workers=len(jobs))
            total += len(jobs)
            executed_here = which == "main"
            for (mode, key), (resp, took) in zip(jobs, answers):
                worst = max(worst, took)
                where = "%s %s" % (name, key)
                if isinstance(resp, Exception):
                    failures.append("%s: no answer (%r) after %.2fs" % (where, resp, took))
                    continue
                if took > TIMEOUT_S + SLACK_S:
                    failures.append("%s: answered after %.2fs (> %.1fs)" % (
                        where, took, TIMEOUT_S + SLACK_S))
                if kind == "te-and-cl" and resp.status == 201:
                    body = resp.body
                    ok = (resp.header_all("Content-Length") == [str(len(body))] and
                          not resp.has("Transfer-Encoding") and
                          resp.json().get("idempotency_key") == key)
                    if not ok:
                        failures.append("%s: TE+CL answer misframed: %r" % (where, adv.short(resp)))
                    continue
                if resp.status != status:
                    failures.append("%s: status %d, expected %d: %r" % (where, resp.status,
                                                                         status, adv.short(resp)))
                    continue
                if kind == "upstream":
                    if resp.charge_id is None:
                        failures.append("%s: not the upstream's own answer: %r" % (where, adv.short(resp)))
                elif not adv.is_problem(resp):
                    failures.append("%s: proxy error is not problem+json: %r" % (where, adv.short(resp)))
            # Never twice (libcurl's resend is refused), and once unless the
            # request went out on a pooled connection the upstream had closed
            # right after its previous answer: that one dies before any
            # response byte, and the README's failure policy answers it 502
            # (unknown outcome) without resending.
            counts = self.upstream.executions()["by_key"]
            for (mode, key), (resp, _) in zip(jobs, answers):
                got = counts.get(key, 0)
                if not executed_here:
                    if got:
                        failures.append("%s %s: executed %d times" % (name, key, got))
                elif got > 1:
                    failures.append("%s %s: executed %d times" % (name, key, got))
                elif got == 0:
                    stale.append("%s %s" % (name, key))
                    if getattr(resp, "status", None) != 502:
                        failures.append("%s %s: never executed, answered %r" % (name, key, adv.short(resp)))

            # The record's final state, checked by a retry without the fault
            # (through the healthy proxy: same store, same fingerprint).
            def retry(job):
                mode, key = job
                return adv.timed_request(healthy.port, "POST", ROUTES[mode], [
                    ("Content-Type", "application/json"), ("Idempotency-Key", key)],
                    harness.PAYMENT_BODY)

            before = self.upstream.total()
            retries = adv.parallel(retry, jobs, workers=16)
            stored = 0
            for (mode, key), (first, _), (again, _) in zip(jobs, answers, retries):
                where = "%s %s retry" % (name, key)
                if isinstance(again, Exception):
                    failures.append("%s: %r" % (where, adv.short(again)))
                    continue
                first_status = getattr(first, "status", None)
                if (mode == "complete" and kind in ("unknown", "te-and-cl")) or (
                        kind == "te-and-cl" and first_status == 201):
                    stored += 1
                    ok = (not isinstance(first, Exception) and again.status == first.status and
                          again.replayed and again.body == first.body)
                    if not ok:
                        failures.append("%s: expected the stored %s replayed, got %r" % (
                            where, first_status, adv.short(again)))
                elif again.status != 201 or again.replayed:
                    failures.append("%s: expected a released record (fresh 201), got %r" % (
                        where, again))
            executed = self.upstream.total() - before
            if executed != len(jobs) - stored:
                failures.append("%s: %d retries executed, expected %d" % (
                    name, executed, len(jobs) - stored))
            self.note("%s done, worst latency so far %.2fs", name, worst)
            by_fault[name] = len(failures) - sum(by_fault.values())

        rc, doc, _ = adv.check_store(self.store_path)
        if rc != 0 or doc.get("in_progress"):
            failures.append("store after the matrix: rc %d %r" % (rc, doc))
        self.summary("upstream-fault-matrix",
                     "%d faults x %d requests x 2 on_unknown modes = %d requests, %d failures; "
                     "slowest answer %.2fs (limit %.1fs); answered 502 unexecuted (stale "
                     "pooled connection): %s; failing faults %s; %.1fs",
                     len(FAULTS), n, total, len(failures), worst, TIMEOUT_S + SLACK_S,
                     dict(collections.Counter(x.split()[0] for x in stale)) if stale else 0,
                     {k: v for k, v in by_fault.items() if v} or "none",
                     time.monotonic() - started)
        self.assertEqual(failures, [], "\n".join(failures[:40]))


if __name__ == "__main__":
    unittest.main()
