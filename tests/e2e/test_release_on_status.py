#!/usr/bin/env python3
"""An upstream status listed in release_on (default: every 5xx) is passed to
the client as the upstream sent it, and the record is released so the retry
executes again; a status not listed is stored and replayed."""

import unittest

import harness


class ReleaseOn(harness.ProxyTestCase):
    def test_default_releases_every_5xx(self):
        proxy = self.start_proxy()
        for status in (500, 502, 503, 504, 599):
            key = "rel-%d" % status
            with self.subTest(status=status):
                r = self.post(proxy, key, headers=[("X-Test-Status", str(status))])
                # Passed to the client: the upstream's own answer, not a
                # proxy-made problem document.
                self.assertEqual(r.status, status, r)
                self.assertEqual(r.header("Content-Type"), "application/json", r)
                self.assertIsNotNone(r.charge_id, r)
                self.assertEqual(r.json()["id"], r.charge_id)
                self.assertFalse(r.replayed)
                retry = self.post(proxy, key)
                self.assertExecuted(retry)
                self.assertNotEqual(retry.charge_id, r.charge_id)
                self.assertEqual(self.upstream.count(key), 2)

    def test_explicit_list_stores_other_5xx(self):
        proxy = self.start_proxy(release_on=["503"])
        r500 = self.post(proxy, "only503-500", headers=[("X-Test-Status", "500")])
        self.assertEqual(r500.status, 500, r500)
        again = self.post(proxy, "only503-500")
        self.assertReplayOf(again, r500)
        self.assertEqual(self.upstream.count("only503-500"), 1)

        r503 = self.post(proxy, "only503-503", headers=[("X-Test-Status", "503")])
        self.assertEqual(r503.status, 503, r503)
        self.assertExecuted(self.post(proxy, "only503-503"))
        self.assertEqual(self.upstream.count("only503-503"), 2)

    def test_release_on_can_name_a_4xx(self):
        proxy = self.start_proxy(release_on=["5xx", "429"])
        r = self.post(proxy, "rel-429", headers=[("X-Test-Status", "429")])
        self.assertEqual(r.status, 429, r)
        self.assertExecuted(self.post(proxy, "rel-429"))
        self.assertEqual(self.upstream.count("rel-429"), 2)
        # Other 4xx are still stored.
        r409 = self.post(proxy, "keep-409", headers=[("X-Test-Status", "409")])
        self.assertReplayOf(self.post(proxy, "keep-409"), r409)
        self.assertEqual(self.upstream.count("keep-409"), 1)


if __name__ == "__main__":
    unittest.main()
