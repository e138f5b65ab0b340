#!/usr/bin/env python3
"""Found while building the smuggling corpus (item 7): the request target.

The proxy builds the upstream URL as upstream base + request target and lets
libcurl parse it. So:
  * a target that is not origin-form must never reach another host: with
    "@host:port/path" the base's authority becomes userinfo and libcurl
    connects to host:port (SSRF); absolute-form ("http://host/path") and
    asterisk-form must be forwarded to the configured upstream or refused
    with a 4xx, never sent elsewhere;
  * the path the upstream receives must be the path the proxy routed on:
    libcurl removes dot segments ("/v1/./payments" -> "/v1/payments") unless
    told not to, so a request the proxy routed as "not covered" (passthrough,
    no key checked, nothing stored) reaches the covered API path. Two
    identical keyed requests must never execute twice, and a route's
    require_key must not be bypassed.
"""

import time
import unittest

import adv
from adv import harness

DOT_VARIANTS = ["/v1/./payments", "/x/../v1/payments", "/./v1/payments",
                "/v1/payments/x/..", "/v1/payments/.", "/v1/x/../payments"]
FRAGMENT_VARIANTS = ["/v1/payments#x", "/v1/payments#", "/v1/payments?a=1#x",
                     "/v1/x#/../payments"]


class RequestTarget(adv.AdversarialCase):
    def raw(self, proxy, target, key=None, method="POST"):
        h = "Idempotency-Key: %s\r\n" % key if key else ""
        data = ("%s %s HTTP/1.1\r\nHost: proxy.test\r\nContent-Type: application/json\r\n%s"
                "Content-Length: 2\r\n\r\n{}" % (method, target, h)).encode()
        with harness.Conn(proxy.port, timeout=10) as c:
            c.send(data)
            try:
                return c.read_response()
            except (harness.ConnectionClosed, ConnectionResetError):
                return None

    def test_target_never_reaches_another_host(self):
        other = harness.Upstream(self.workdir, name="other").start()
        self.addCleanup(other.stop)
        proxy = self.start_proxy()
        authority = "127.0.0.1:%d" % other.port
        cases = [
            ("@%s/v1/payments" % authority, "t-userinfo-keyed"),
            ("@%s/elsewhere" % authority, None),
            ("http://%s/v1/payments" % authority, "t-absolute-keyed"),
            ("http://%s/elsewhere" % authority, None),
            ("//%s/v1/payments" % authority, "t-network-path"),
            ("*", None),
            ("v1/payments", "t-no-slash"),
        ]
        failures = []
        for target, key in cases:
            resp = self.raw(proxy, target, key)
            if other.total():
                failures.append("%r reached ANOTHER HOST (%s): %s" % (
                    target, authority, adv.short(resp)))
                other.reset()
            elif resp is None or not (resp.status == 201 or 400 <= resp.status < 500):
                failures.append("%r: answered %s (a target the proxy cannot route is a client "
                                "error, 4xx)" % (target, adv.short(resp)))
        self.summary("request-target-host",
                     "%d non-origin-form targets: %d reached another host or got a non-4xx "
                     "error", len(cases), len(failures))
        self.assertEqual(failures, [], "\n".join(failures))

    def test_dot_segments_do_not_bypass_the_route(self):
        self.check_no_bypass(DOT_VARIANTS, "dots", "dot-segment")

    def test_fragments_do_not_bypass_the_route(self):
        # libcurl drops "#..." from the URL it is given, so a target with a
        # fragment reached /v1/payments while the proxy matched no route on
        # "/v1/payments#x": two executions under one key, require_key
        # bypassed. A fragment has no place in origin-form: 400 bad-target.
        proxy = self.check_no_bypass(FRAGMENT_VARIANTS, "fragment", "fragment")
        for target in FRAGMENT_VARIANTS:
            resp = self.raw(proxy, target, "fragment-status")
            self.assertIsNotNone(resp, target)
            self.assertEqual(resp.status, 400, "%r: %s" % (target, adv.short(resp)))
            self.assertIn(b"bad-target", resp.body, target)

    def check_no_bypass(self, variants, prefix, what):
        proxy = self.start_proxy(require_key=True)
        failures = []
        started = time.monotonic()
        for i, target in enumerate(variants):
            key = "%s-%d" % (prefix, i)
            answers = [self.raw(proxy, target, key) for _ in range(2)]
            count = self.upstream.count(key)
            if count > 1:
                failures.append("%r with one key executed %d times (%s)" % (
                    target, count, [adv.short(a) for a in answers]))
            before = self.upstream.entries()
            unkeyed = self.raw(proxy, target)
            after = self.upstream.entries()[len(before):]
            if any(e["path"] != target for e in after):
                failures.append("%r without a key (require_key) reached the upstream as %r: %s"
                                % (target, [e["path"] for e in after], adv.short(unkeyed)))
        self.summary("request-target-%s" % prefix,
                     "%d %s targets on a require_key route: %d bypassed the route "
                     "(double execution or upstream path differs from the routed one); %.1fs",
                     len(variants), what, len(failures), time.monotonic() - started)
        self.assertEqual(failures, [], "\n".join(failures))
        return proxy


if __name__ == "__main__":
    unittest.main()
