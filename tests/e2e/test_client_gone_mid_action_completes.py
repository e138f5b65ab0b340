#!/usr/bin/env python3
"""A client that goes away while its action runs does not change the record's
fate: the upstream's answer (below 500) is still stored, so the client's retry
gets the replay instead of running the action a second time."""

import time
import unittest

import harness


class ClientGoneMidAction(harness.ProxyTestCase):
    def test_answer_stored_after_client_disconnects(self):
        proxy = self.start_proxy()
        c = proxy.conn()
        c.send(harness.build_request("POST", "/v1/payments", [
            ("Host", "x"), ("Content-Type", "application/json"), ("Idempotency-Key", "gone-1"),
            ("X-Test-Delay-Ms", "1000")], harness.PAYMENT_BODY))
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("gone-1") == 1, 3))
        c.close()
        time.sleep(1.5)
        retry = self.post(proxy, "gone-1")
        self.assertEqual(retry.status, 201, retry)
        self.assertTrue(retry.replayed, "the retry ran the action again: %r" % retry)
        self.assertEqual(retry.charge_id, self.upstream.entries()[0]["charge_id"])
        self.assertEqual(self.upstream.count("gone-1"), 1)

    def test_retry_during_the_action_waits_for_it(self):
        # The client times out and retries at once while the first attempt
        # still runs: the retry must not start a second execution.
        proxy = self.start_proxy(wait="5s")
        c = proxy.conn()
        c.send(harness.build_request("POST", "/v1/payments", [
            ("Host", "x"), ("Content-Type", "application/json"), ("Idempotency-Key", "gone-2"),
            ("X-Test-Delay-Ms", "1200")], harness.PAYMENT_BODY))
        self.assertTrue(harness.wait_for(lambda: self.upstream.count("gone-2") == 1, 3))
        c.close()
        retry = self.post(proxy, "gone-2")
        self.assertEqual(retry.status, 201, retry)
        self.assertTrue(retry.replayed, retry)
        self.assertEqual(self.upstream.count("gone-2"), 1)


if __name__ == "__main__":
    unittest.main()
