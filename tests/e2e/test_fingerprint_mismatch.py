#!/usr/bin/env python3
"""The same key with a different request (method, path with query, or body)
is 422 and never reaches the upstream. With fingerprint "auto" a JSON body is
canonicalised first, so key order and white space are not a mismatch; with
"raw" they are."""

import time
import unittest

import harness
from harness import in_thread


class FingerprintMismatch(harness.ProxyTestCase):
    def test_different_body_is_422(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "fp-1", body=b'{"amount":1000}')
        self.assertExecuted(first)
        r = self.post(proxy, "fp-1", body=b'{"amount":9999}')
        self.assertProblem(r, 422)
        self.assertFalse(r.replayed)
        # The record is untouched: the original request still replays.
        self.assertReplayOf(self.post(proxy, "fp-1", body=b'{"amount":1000}'), first)
        self.assertEqual(self.upstream.count("fp-1"), 1)

    def test_different_path_query_or_method_is_422(self):
        proxy = self.start_proxy()
        self.assertExecuted(self.post(proxy, "fp-2", path="/v1/payments"))
        self.assertProblem(self.post(proxy, "fp-2", path="/v1/payments?capture=false"), 422)
        self.assertProblem(self.post(proxy, "fp-2", path="/v1/payments/refunds"), 422)
        self.assertProblem(self.post(proxy, "fp-2", method="PATCH"), 422)
        self.assertEqual(self.upstream.total(), 1)

    def test_query_is_part_of_the_request(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "fp-q", path="/v1/payments?a=1")
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "fp-q", path="/v1/payments?a=1"), first)
        self.assertProblem(self.post(proxy, "fp-q", path="/v1/payments?a=2"), 422)
        self.assertEqual(self.upstream.total(), 1)

    def test_auto_json_key_order_and_whitespace_are_not_a_mismatch(self):
        proxy = self.start_proxy()  # fingerprint defaults to "auto"
        first = self.post(proxy, "fp-json", body=b'{"amount":1000,"currency":"eur","meta":{"a":1,"b":[1,2]}}')
        self.assertExecuted(first)
        same = self.post(proxy, "fp-json",
                         body=b'{ "meta" : {"b":[1, 2], "a":1},\n  "currency":"eur", "amount":1000 }')
        self.assertReplayOf(same, first)
        # Canonical JSON still tells different values apart.
        self.assertProblem(self.post(proxy, "fp-json",
                                     body=b'{"amount":1000,"currency":"eur","meta":{"a":1,"b":[2,1]}}'), 422)
        self.assertEqual(self.upstream.total(), 1)

    def test_auto_applies_to_plus_json_media_types(self):
        proxy = self.start_proxy()
        ctype = "application/vnd.api+json; charset=utf-8"
        first = self.post(proxy, "fp-plus", body=b'{"a":1,"b":2}', content_type=ctype)
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "fp-plus", body=b'{"b":2,"a":1}', content_type=ctype),
                            first)
        self.assertEqual(self.upstream.total(), 1)

    def test_auto_does_not_canonicalise_non_json(self):
        proxy = self.start_proxy()
        self.assertExecuted(self.post(proxy, "fp-text", body=b'{"a":1,"b":2}',
                                      content_type="text/plain"))
        self.assertProblem(self.post(proxy, "fp-text", body=b'{"b":2,"a":1}',
                                     content_type="text/plain"), 422)
        self.assertEqual(self.upstream.total(), 1)

    def test_two_content_types_on_a_keyed_request_are_refused(self):
        # Content-Type decides how the body is compared. With two, the
        # proxy compared by the first while the upstream may read the
        # last: text bodies in another key order replayed as one request.
        proxy = self.start_proxy()
        for types in (("application/json", "text/plain"), ("text/plain", "application/json")):
            r = self.post(proxy, "fp-two-ct", body=b'{"a":1,"b":2}', content_type=None,
                          headers=[("Content-Type", t) for t in types])
            self.assertProblem(r, 400)
            self.assertIn("Content-Type", r.json()["detail"])
        self.assertEqual(self.upstream.total(), 0)
        # Without a key nothing is compared: forwarded as sent.
        r = self.post(proxy, None, body=b'{"a":1}', content_type=None,
                      headers=[("Content-Type", "application/json"),
                               ("Content-Type", "application/json")])
        self.assertEqual(r.status, 201, r)

    def test_raw_fingerprint_key_order_is_a_mismatch(self):
        proxy = self.start_proxy(fingerprint="raw")
        self.assertExecuted(self.post(proxy, "fp-raw", body=b'{"a":1,"b":2}'))
        self.assertProblem(self.post(proxy, "fp-raw", body=b'{"b":2,"a":1}'), 422)
        self.assertEqual(self.upstream.total(), 1)

    def test_mismatch_while_in_progress_is_422_without_waiting(self):
        proxy = self.start_proxy(wait="5s")
        first = in_thread(self.post, proxy, "fp-busy", body=b'{"amount":1}',
                          headers=[("X-Test-Delay-Ms", "1500")])
        harness.wait_for(lambda: self.upstream.total() == 1, 3)
        t0 = time.monotonic()
        r = self.post(proxy, "fp-busy", body=b'{"amount":2}')
        self.assertProblem(r, 422)
        self.assertLess(time.monotonic() - t0, 1.0, "a mismatch must not wait for the holder")
        self.assertExecuted(first.result(10))
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
