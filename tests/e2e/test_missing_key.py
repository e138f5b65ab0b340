#!/usr/bin/env python3
"""Without an Idempotency-Key: 400 on a route with require_key; otherwise the
request is forwarded unchanged and nothing is stored (every send executes)."""

import unittest

import harness


class MissingKey(harness.ProxyTestCase):
    def test_require_key_rejects_with_400(self):
        proxy = self.start_proxy(require_key=True)
        r = self.post(proxy, None)
        self.assertProblem(r, 400)
        self.assertEqual(self.upstream.total(), 0)
        # The same route with a key works.
        self.assertExecuted(self.post(proxy, "present"))

    def test_without_require_key_forwarded_and_not_stored(self):
        proxy = self.start_proxy(require_key=False)
        r1 = self.post(proxy, None)
        r2 = self.post(proxy, None)
        self.assertExecuted(r1)
        self.assertExecuted(r2)
        self.assertNotEqual(r1.charge_id, r2.charge_id)
        # Forwarded unchanged: the first response keeps every upstream header.
        self.assertEqual(r2.header_all("Set-Cookie"), ["session=abc; Path=/"])
        self.assertEqual(self.upstream.total(), 2)

    def test_require_key_defaults_to_false(self):
        route = self.route()
        route.pop("require_key", None)
        proxy = self.start_proxy(config=self.config(routes=[route]))
        self.assertExecuted(self.post(proxy, None))
        self.assertExecuted(self.post(proxy, None))
        self.assertEqual(self.upstream.total(), 2)


if __name__ == "__main__":
    unittest.main()
