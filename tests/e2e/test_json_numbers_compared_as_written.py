#!/usr/bin/env python3
"""With fingerprint "auto" a JSON body is canonicalised (sorted keys, no
white space) with every number kept as written: two amounts that one double
cannot tell apart are different requests, so the same key gets 422 and the
upstream runs once. Before, the canonical form went through doubles and the
second amount was answered with the first one's stored result."""

import unittest

import harness


class JsonNumbersComparedAsWritten(harness.ProxyTestCase):
    # Pairs that were one double, hence one fingerprint.
    COLLIDING = [
        (b'{"amount":1.000000000000000001,"currency":"eth"}',
         b'{"amount":1.000000000000000002,"currency":"eth"}'),
        (b'{"amount":9007199254740993.0}', b'{"amount":9007199254740992.0}'),
        (b'{"amount":1.50}', b'{"amount":1.5}'),
        (b'{"amount":1.0}', b'{"amount":1}'),
    ]

    def test_amounts_one_double_apart_are_422(self):
        proxy = self.start_proxy()  # fingerprint defaults to "auto"
        for i, (first_body, second_body) in enumerate(self.COLLIDING):
            key = "num-%d" % i
            with self.subTest(first=first_body, second=second_body):
                first = self.post(proxy, key, body=first_body)
                self.assertExecuted(first)
                r = self.post(proxy, key, body=second_body)
                self.assertProblem(r, 422)
                self.assertFalse(r.replayed)
                # The record is untouched: the first amount still replays.
                self.assertReplayOf(self.post(proxy, key, body=first_body), first)
                self.assertEqual(self.upstream.count(key), 1)
        self.assertEqual(self.upstream.total(), len(self.COLLIDING))

    def test_reals_still_ignore_key_order_and_whitespace(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "num-order",
                          body=b'{"amount":1.000000000000000001,"currency":"eth","fee":2.50}')
        self.assertExecuted(first)
        same = self.post(proxy, "num-order",
                         body=b'{ "fee" : 2.50,\n "currency" : "eth", "amount" : 1.000000000000000001 }')
        self.assertReplayOf(same, first)
        self.assertEqual(self.upstream.total(), 1)

    def test_integers_past_int64_ignore_key_order(self):
        # jansson refused these, so such a body used to be hashed as sent.
        proxy = self.start_proxy()
        first = self.post(proxy, "num-big", body=b'{"wei":100000000000000000000001,"to":"x"}')
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "num-big",
                                      body=b'{"to":"x", "wei":100000000000000000000001}'), first)
        self.assertProblem(self.post(proxy, "num-big",
                                     body=b'{"to":"x","wei":100000000000000000000002}'), 422)
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
