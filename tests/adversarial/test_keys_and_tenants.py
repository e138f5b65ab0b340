#!/usr/bin/env python3
"""Item 9, keys and tenants.

Malformed keys (empty, blank, 256 bytes, 64 KiB, CR, LF, NUL, DEL and other
controls, tab, space, non-ASCII, two Idempotency-Key headers, bad quoting...)
are answered 400 (problem+json, invalid-key) with no upstream call and no
store write (`idemproxy check-store` record count and map use unchanged). A
64 KiB key is larger than server.header_memory (16 KiB): 431 is the
documented answer there; a raw CR or LF breaks the header line itself and
may be refused by libmicrohttpd (400) before the proxy sees a key.

Tenants: a route with scope_header X-Tenant-Id; two tenants send the same N
keys (CI 200, long 1,000) with the same body. Each tenant's first request
executes (the upstream echoes the tenant in its body), each tenant's replay
is its own stored answer: no tenant ever sees the other's response."""

import time
import unittest

import adv
from adv import harness

# name, raw header value(s) as bytes, accepted statuses, must be problem+json
MALFORMED = [
    ("empty", [b""], (400,), True),
    ("blank", [b"    "], (400,), True),
    ("empty-quoted", [b'""'], (400,), True),
    ("256-bytes", [b"k" * 256], (400,), True),
    ("256-bytes-quoted", [b'"' + b"k" * 256 + b'"'], (400,), True),
    ("64-KiB", [b"k" * 65536], (400, 431), False),
    ("cr-inside", [b"a\rb"], (400,), False),
    ("lf-inside", [b"a\nb"], (400,), False),
    ("nul-inside", [b"a\x00b"], (400,), False),
    ("del-inside", [b"a\x7fb"], (400,), True),
    ("control-0x01", [b"a\x01b"], (400,), True),
    ("tab-inside", [b"a\tb"], (400,), True),
    ("space-inside", [b"a b"], (400,), True),
    ("list", [b"a, b"], (400,), True),
    ("non-ascii-utf8", ["cl\u00e9".encode("utf-8")], (400,), True),
    ("non-ascii-latin1", [b"cl\xe9"], (400,), True),
    ("two-headers", [b"key-a", b"key-b"], (400,), True),
    ("two-headers-same", [b"key-a", b"key-a"], (400,), True),
    ("unterminated-quote", [b'"abc'], (400,), True),
    ("garbage-after-quote", [b'"abc"x'], (400,), True),
    ("bad-escape", [b'"a\\qb"'], (400,), True),
    ("quoted-space", [b'"a b"'], (400,), True),
    ("sf-parameters", [b'"abc";p=1'], (400,), True),
    ("lone-quote", [b'"'], (400,), True),
    ("quoted-non-ascii", [b'"cl\xc3\xa9"'], (400,), True),
]


def raw_request(port, key_values, tenant=None):
    head = [b"POST /v1/payments HTTP/1.1", b"Host: proxy.test",
            b"Content-Type: application/json"]
    for v in key_values:
        head.append(b"Idempotency-Key: " + v)
    if tenant:
        head.append(b"X-Tenant-Id: " + tenant.encode())
    head.append(b"Content-Length: %d" % len(harness.PAYMENT_BODY))
    data = b"\r\n".join(head) + b"\r\n\r\n" + harness.PAYMENT_BODY
    with harness.Conn(port, timeout=10) as c:
        try:
            c.send(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            return c.read_response()
        except (harness.ConnectionClosed, ConnectionResetError):
            return None


class KeysAndTenants(adv.AdversarialCase):
    def test_malformed_keys_rejected_without_side_effects(self):
        proxy = self.start_proxy()
        self.assertExecuted(self.post(proxy, "a-valid-key"))  # the store exists and works
        before_records = self.store_records()
        before_map = adv.check_store(self.store_path)[1]["map_used_bytes"]
        before_exec = self.upstream.total()
        failures = []
        for name, values, statuses, problem in MALFORMED:
            resp = raw_request(proxy.port, values)
            if resp is None or resp.status not in statuses:
                failures.append("%s: %s, expected %s" % (name, adv.short(resp), statuses))
            elif problem and not adv.is_problem(resp):
                failures.append("%s: not problem+json: %s" % (name, adv.short(resp)))
            elif problem and resp.status == 400 and resp.json().get("type", "").split(":")[-1] \
                    != "invalid-key":
                failures.append("%s: problem type %r" % (name, resp.json().get("type")))
            if self.upstream.total() != before_exec:
                failures.append("%s: the upstream was called (%d executions): %r" % (
                    name, self.upstream.total() - before_exec, self.upstream.entries()[-1]))
                before_exec = self.upstream.total()
        after_records = self.store_records()
        after_map = adv.check_store(self.store_path)[1]["map_used_bytes"]
        if after_records != before_records:
            failures.append("store records %d -> %d" % (before_records, after_records))
        self.summary("malformed-keys",
                     "%d malformed keys: %d not answered 400/431 without an upstream call; "
                     "store records %d -> %d, map used %d -> %d bytes",
                     len(MALFORMED), len(failures), before_records, after_records, before_map,
                     after_map)
        self.assertEqual(failures, [], "\n".join(failures))

    def test_tenants_never_see_each_other(self):
        n = adv.scale(short=200, long=1000)
        proxy = self.start_proxy(config=self.config(
            routes=[self.route(scope_header="X-Tenant-Id")],
            server={"per_ip_connections": 0}))
        tenants = ("tenant-alpha", "tenant-beta")
        started = time.monotonic()

        def first(job):
            key, tenant = job
            return self.post(proxy, key, headers=[("X-Tenant-Id", tenant)])

        jobs = [("shared-key-%d" % i, t) for i in range(n) for t in tenants]
        firsts = adv.parallel(first, jobs, workers=16)
        replays = adv.parallel(first, jobs, workers=16)
        leaks = []
        errors = []
        for (key, tenant), a, b in zip(jobs, firsts, replays):
            for label, r, replayed in (("first", a, False), ("replay", b, True)):
                if isinstance(r, Exception) or r.status != 201 or r.replayed != replayed:
                    errors.append("%s %s %s: %s" % (key, tenant, label, adv.short(r)))
                    continue
                doc = r.json()
                if doc.get("tenant") != tenant or doc.get("idempotency_key") != key:
                    leaks.append("%s %s %s got %r" % (key, tenant, label, doc))
            if not isinstance(a, Exception) and not isinstance(b, Exception) and \
                    a.charge_id != b.charge_id:
                leaks.append("%s %s: replay %s is not its first answer %s" % (
                    key, tenant, b.charge_id, a.charge_id))
        counts = self.upstream.executions()["by_key"]
        wrong_counts = [k for k in ("shared-key-%d" % i for i in range(n)) if counts.get(k) != 2]
        missing = [r for r in (raw_request(proxy.port, [b"no-tenant"]),) if r is None or
                   r.status != 400]
        self.summary("tenant-isolation",
                     "2 tenants x %d shared keys (first + replay each, %d requests): %d answers "
                     "of the other tenant, %d errors, %d keys not executed exactly once per "
                     "tenant; %.1fs", n, 4 * n, len(leaks), len(errors), len(wrong_counts),
                     time.monotonic() - started)
        self.assertEqual(leaks, [], "\n".join(leaks[:20]))
        self.assertEqual(errors, [], "\n".join(errors[:20]))
        self.assertEqual(wrong_counts, [])
        self.assertEqual(missing, [], "a request without X-Tenant-Id was not refused 400")


if __name__ == "__main__":
    unittest.main()
