#!/usr/bin/env python3
"""With scope_header set, identity is (scope + hash of that header, key): the
same key from two tenants is two executions, each replaying its own answer; a
request with a key but without the header (or with it empty or repeated) is
400, while a request without a key needs no header, like any keyless covered
request; the header's value is never logged or stored."""

import os
import unittest

import harness


class ScopeHeader(harness.ProxyTestCase):
    def test_missing_scope_header_is_400(self):
        proxy = self.start_proxy(scope_header="X-Tenant-Id")
        self.assertProblem(self.post(proxy, "sh-1"), 400)
        self.assertEqual(self.upstream.total(), 0)

    def test_empty_or_repeated_scope_header_is_400(self):
        proxy = self.start_proxy(scope_header="X-Tenant-Id")
        for headers in ([("X-Tenant-Id", "")], [("X-Tenant-Id", "a"), ("X-Tenant-Id", "b")]):
            doc = self.assertProblem(self.post(proxy, "sh-2", headers=headers), 400)
            self.assertIn("scope-header-missing", doc["type"])
        self.assertEqual(self.upstream.total(), 0)

    def test_keyless_request_needs_no_scope_header(self):
        # The header only scopes a key: without a key the request is
        # forwarded unchanged and nothing is stored (every send executes).
        proxy = self.start_proxy(scope_header="X-Tenant-Id")
        self.assertExecuted(self.post(proxy, None))
        self.assertExecuted(self.post(proxy, None))
        self.assertEqual(self.upstream.total(), 2)
        # With require_key the missing key is what is reported.
        strict = self.start_proxy(name="strict", scope_header="X-Tenant-Id", require_key=True)
        doc = self.assertProblem(self.post(strict, None), 400)
        self.assertIn("key-required", doc["type"])
        self.assertEqual(self.upstream.total(), 2)

    def test_same_key_two_tenants_two_executions(self):
        proxy = self.start_proxy(scope_header="X-Tenant-Id")
        a = self.post(proxy, "shared-key", headers=[("X-Tenant-Id", "tenant-a")])
        b = self.post(proxy, "shared-key", headers=[("X-Tenant-Id", "tenant-b")])
        self.assertExecuted(a)
        self.assertExecuted(b)
        self.assertNotEqual(a.charge_id, b.charge_id)
        self.assertEqual(a.json()["tenant"], "tenant-a")
        self.assertEqual(b.json()["tenant"], "tenant-b")
        self.assertReplayOf(self.post(proxy, "shared-key", headers=[("X-Tenant-Id", "tenant-a")]), a)
        self.assertReplayOf(self.post(proxy, "shared-key", headers=[("X-Tenant-Id", "tenant-b")]), b)
        self.assertEqual(self.upstream.count("shared-key"), 2)

    def test_white_space_around_values_is_not_part_of_them(self):
        # RFC 9110 5.5: "acme " is the tenant "acme", and "ows-key\t" the
        # key "ows-key". libmicrohttpd keeps trailing white space, so the
        # retry with a trailing space used to run the payment again.
        proxy = self.start_proxy(scope_header="X-Tenant-Id")
        first = self.post(proxy, "ows-key", headers=[("X-Tenant-Id", "acme")])
        self.assertExecuted(first)
        for tenant, key in (("acme ", "ows-key"), ("acme\t", "ows-key"),
                            ("acme", "ows-key "), ("acme \t", "ows-key\t")):
            again = self.post(proxy, key, headers=[("X-Tenant-Id", tenant)])
            self.assertReplayOf(again, first)
        self.assertEqual(self.upstream.count("ows-key"), 1)

    def test_tenant_value_never_logged_or_stored(self):
        tenant = "tenant-secret-7f3a9c"
        key = "raw-key-never-logged-5521"
        proxy = self.start_proxy(scope_header="X-Tenant-Id")
        # 204: the upstream's answer carries neither the tenant nor the key,
        # so any trace of them in the store comes from the proxy.
        r = self.post(proxy, key, headers=[("X-Tenant-Id", tenant), ("X-Test-Status", "204")])
        self.assertEqual(r.status, 204, r)
        again = self.post(proxy, key, headers=[("X-Tenant-Id", tenant)])
        self.assertTrue(again.replayed, again)
        self.assertEqual(self.upstream.count(key), 1)
        proxy.wait_access_log(2)
        self.assertEqual(proxy.stop(), 0)
        logs = proxy.stdout() + proxy.stderr()
        self.assertNotIn(tenant, logs)
        self.assertNotIn(key, logs)
        stored = b""
        for root, _, files in os.walk(self.store_path):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    stored += f.read()
        self.assertGreater(len(stored), 0, "no store files under %s" % self.store_path)
        self.assertNotIn(tenant.encode(), stored, "the scope_header value is in the store")


if __name__ == "__main__":
    unittest.main()
