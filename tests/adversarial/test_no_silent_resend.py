#!/usr/bin/env python3
"""Item 6, libcurl's silent resend: when a REUSED upstream connection dies
before any response byte, libcurl resends the request on a new connection,
POST included. The upstream below executes the request and then drops the
connection (fault close-before) on a keep-alive connection that earlier
requests established, so the first send did run the action: a resend would
be a double execution. For keyed requests, and for unkeyed requests whose
method is not idempotent (a POST on a pass-through route), the proxy refuses
the resend (README failure policy): 0 double executions in N (CI 1,000, long
5,000) keyed, and in the unkeyed POST run.

The test proves it tested what it says: the upstream's log shows every
dropped request arrived on a reused connection (conn_seq > 1), and a control
run of unkeyed GETs, for which the proxy keeps libcurl's behaviour (GET is
idempotent), shows libcurl does resend in this very setting."""

import time
import unittest

import adv
from adv import harness


class NoSilentResend(adv.AdversarialCase):
    def post(self, proxy, key, path="/v1/payments", fault=None, method="POST"):
        h = [("Content-Type", "application/json")]
        if key is not None:
            h.append(("Idempotency-Key", key))
        if fault:
            h.append(("X-Test-Fault", fault))
        return proxy.request(method, path, h, harness.PAYMENT_BODY if method == "POST" else b"")

    def run_drops(self, proxy, n, keyed, path, method="POST", statuses=(502,)):
        """n times: a healthy request (leaves a pooled keep-alive connection),
        then one the upstream executes and drops. Returns the drop keys."""
        drops = []
        for i in range(n):
            tag = "%s-%d" % ("keyed" if keyed else "unkeyed", i)
            warm = self.post(proxy, "warm-" + tag if keyed else None, path, method=method)
            self.assertEqual(warm.status, 201, warm)
            # The upstream counts by Idempotency-Key; an unkeyed request is
            # told apart by its path.
            if keyed:
                r = self.post(proxy, "drop-" + tag, path, fault="close-before")
            else:
                r = self.post(proxy, None, path + "/drop-" + tag, fault="close-before",
                              method=method)
            self.assertIn(r.status, statuses, r)
            drops.append("drop-" + tag)
        return drops

    def unkeyed_doubles(self, proxy, n, method, statuses):
        self.upstream.reset()
        self.run_drops(proxy, n, keyed=False, path="/v1/other", method=method,
                       statuses=statuses)
        paths = {}
        for e in self.upstream.entries():
            paths[e["path"]] = paths.get(e["path"], 0) + 1
        return sum(1 for p, c in paths.items() if "/drop-" in p and c > 1)

    def test_reused_connection_dropped_after_execution_is_not_resent(self):
        n = adv.scale(short=1000, long=5000)
        started = time.monotonic()
        # One worker: one libcurl connection pool, so the healthy request's
        # connection is the one the next request reuses.
        proxy = self.start_proxy(config=self.config(timeout="5s", server={"workers": 1}))
        drops = self.run_drops(proxy, n, keyed=True, path="/v1/payments")
        entries = self.upstream.entries()
        by_key = {}
        for e in entries:
            by_key.setdefault(e["key"], []).append(e)
        doubles = [k for k in drops if len(by_key.get(k, [])) > 1]
        missing = [k for k in drops if not by_key.get(k)]
        reused = sum(1 for k in drops if by_key.get(k) and by_key[k][0]["conn_seq"] > 1)

        # Unkeyed POSTs on a pass-through route: not idempotent, not resent.
        control_n = adv.scale(short=20, long=100)
        post_doubles = self.unkeyed_doubles(proxy, control_n, "POST", (502,))
        # Control: unkeyed GETs keep libcurl's resend (the resent GET is
        # answered; a second drop of the fresh connection would be a 502).
        control_doubles = self.unkeyed_doubles(proxy, control_n, "GET", (201, 502))

        self.summary("no-silent-resend",
                     "%d keyed requests executed then dropped on a reused upstream connection "
                     "(%d of them on conn_seq > 1): double executions: %d, never reached: %d; "
                     "unkeyed passthrough POST: %d of %d executed twice; "
                     "control, unkeyed GET: libcurl resent %d of %d; %.1fs",
                     n, reused, len(doubles), len(missing), post_doubles, control_n,
                     control_doubles, control_n, time.monotonic() - started)
        self.assertEqual(doubles, [], "keyed requests executed twice")
        self.assertEqual(missing, [], "dropped requests never reached the upstream")
        self.assertEqual(post_doubles, 0, "unkeyed POSTs executed twice")
        self.assertEqual(reused, n, "not every dropped request came on a reused connection")
        self.assertGreater(control_doubles, 0,
                           "libcurl never resent an unkeyed GET: the scenario does not "
                           "exercise the resend at all")


if __name__ == "__main__":
    unittest.main()
