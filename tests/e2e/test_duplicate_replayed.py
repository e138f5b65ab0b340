#!/usr/bin/env python3
"""A duplicate of a COMPLETE record is answered from the store, byte for byte,
with Idempotent-Replayed: true, and the upstream is not called again. The
structured-field form "abc" and the bare form abc are the same key."""

import unittest

import harness


class DuplicateReplayed(harness.ProxyTestCase):
    def test_replay_byte_for_byte_without_upstream_call(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "dup-1", headers=[
            ("X-Test-Response-Header", "Link: </a>; rel=next"),
            ("X-Test-Response-Header", "Link: </b>; rel=prev"),
            ("X-Test-Response-Header", "Cache-Control: no-store")])
        self.assertExecuted(first)
        for _ in range(3):
            again = self.post(proxy, "dup-1")
            self.assertReplayOf(again, first)
            # Every end-to-end header the upstream sent (Set-Cookie excepted)
            # comes back with the same values, repeated headers in order.
            self.assertEqual(again.header_all("Link"), ["</a>; rel=next", "</b>; rel=prev"])
            self.assertEqual(again.header_all("Cache-Control"), ["no-store"])
        self.assertEqual(self.upstream.count("dup-1"), 1)
        self.assertEqual(self.upstream.total(), 1)

    def test_set_cookie_is_not_replayed(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "cookie-1")
        self.assertEqual(first.header_all("Set-Cookie"), ["session=abc; Path=/"])
        again = self.post(proxy, "cookie-1")
        self.assertTrue(again.replayed, again)
        self.assertEqual(again.header_all("Set-Cookie"), [])

    def test_strip_headers_configurable(self):
        proxy = self.start_proxy(strip_headers=["X-Upstream", "Set-Cookie"])
        first = self.post(proxy, "strip-1")
        self.assertEqual(first.header("X-Upstream"), "demo")
        again = self.post(proxy, "strip-1")
        self.assertReplayOf(again, first, strip=("set-cookie", "x-upstream"))

    def test_empty_strip_headers_replays_set_cookie(self):
        proxy = self.start_proxy(strip_headers=[])
        first = self.post(proxy, "nostrip-1")
        again = self.post(proxy, "nostrip-1")
        self.assertReplayOf(again, first, strip=())
        self.assertEqual(again.header_all("Set-Cookie"), ["session=abc; Path=/"])

    def test_structured_field_string_equals_bare_key(self):
        proxy = self.start_proxy()
        first = self.post(proxy, '"abc"')
        self.assertExecuted(first)
        bare = self.post(proxy, "abc")
        self.assertReplayOf(bare, first)
        quoted = self.post(proxy, '"abc"')
        self.assertReplayOf(quoted, first)
        # And the other way round, on a fresh key.
        first2 = self.post(proxy, "xyz-1")
        self.assertReplayOf(self.post(proxy, '"xyz-1"'), first2)
        self.assertEqual(self.upstream.total(), 2)

    def test_structured_field_escapes_are_unescaped(self):
        # RFC 8941 sf-string: \\ is a backslash, \" a quote.
        proxy = self.start_proxy()
        first = self.post(proxy, '"back\\\\slash"')
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "back\\slash"), first)
        self.assertEqual(self.upstream.total(), 1)

    def test_header_name_is_case_insensitive(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "case-1")
        again = proxy.request("POST", "/v1/payments", [("content-type", "application/json"),
                                                       ("idempotency-key", "case-1")],
                              harness.PAYMENT_BODY)
        self.assertReplayOf(again, first)

    def test_replay_after_patch_on_same_route(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "patch-1", method="PATCH")
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "patch-1", method="PATCH"), first)
        self.assertEqual(self.upstream.total(), 1)

    def test_keys_are_case_sensitive(self):
        proxy = self.start_proxy()
        a = self.post(proxy, "Key-A")
        b = self.post(proxy, "key-a")
        self.assertExecuted(a)
        self.assertExecuted(b)
        self.assertNotEqual(a.charge_id, b.charge_id)
        self.assertEqual(self.upstream.total(), 2)


if __name__ == "__main__":
    unittest.main()
