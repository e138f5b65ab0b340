#!/usr/bin/env python3
"""Identity is (scope, key), never the key alone: routes with different scopes
are separate key spaces, routes sharing a scope are one key space, and routes
are tried in order (the first match wins)."""

import unittest

import harness


class RouteScopes(harness.ProxyTestCase):
    def test_different_scopes_are_separate_key_spaces(self):
        proxy = self.start_proxy(config=self.config(routes=[
            self.route(path="/v1/payments", scope="payments"),
            self.route(path="/v1/refunds", scope="refunds"),
        ]))
        p = self.post(proxy, "same-key", path="/v1/payments")
        r = self.post(proxy, "same-key", path="/v1/refunds")
        self.assertExecuted(p)
        self.assertExecuted(r)
        self.assertReplayOf(self.post(proxy, "same-key", path="/v1/payments"), p)
        self.assertReplayOf(self.post(proxy, "same-key", path="/v1/refunds"), r)
        self.assertEqual(self.upstream.count("same-key"), 2)

    def test_shared_scope_is_one_key_space(self):
        proxy = self.start_proxy(config=self.config(routes=[
            self.route(path="/v1/payments", scope="money"),
            self.route(path="/v1/refunds", scope="money"),
        ]))
        self.assertExecuted(self.post(proxy, "shared", path="/v1/payments"))
        # Same key, same scope, another path: a different request for the key.
        self.assertProblem(self.post(proxy, "shared", path="/v1/refunds"), 422)
        self.assertEqual(self.upstream.count("shared"), 1)

    def test_first_matching_route_wins(self):
        proxy = self.start_proxy(config=self.config(routes=[
            self.route(path="/v1/payments/slow", scope="slow", require_key=True),
            self.route(path="/v1/payments", scope="payments"),
        ]))
        # The first route requires a key; the second does not.
        self.assertProblem(self.post(proxy, None, path="/v1/payments/slow"), 400)
        self.assertExecuted(self.post(proxy, None, path="/v1/payments/other"))
        self.assertEqual(self.upstream.total(), 1)

    def test_no_routes_means_one_catch_all_route(self):
        cfg = self.config()
        del cfg["routes"]
        proxy = self.start_proxy(config=cfg)
        first = self.post(proxy, "catch-all", path="/anything/at/all")
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "catch-all", path="/anything/at/all"), first)
        self.assertEqual(self.upstream.count("catch-all"), 1)
        # Default methods are POST and PATCH only.
        self.assertExecuted(self.post(proxy, "catch-all-get", method="GET", body=b"",
                                      content_type=None))
        self.assertExecuted(self.post(proxy, "catch-all-get", method="GET", body=b"",
                                      content_type=None))
        self.assertEqual(self.upstream.count("catch-all-get"), 2)


if __name__ == "__main__":
    unittest.main()
