#!/usr/bin/env python3
"""An invalid Idempotency-Key is 400 and never reaches the upstream: empty,
longer than max_key_length (default 255), characters outside visible ASCII,
or the header repeated."""

import unittest

import harness


class InvalidKeyRejected(harness.ProxyTestCase):
    def send(self, proxy, key_headers):
        h = [("Content-Type", "application/json")] + [("Idempotency-Key", k) for k in key_headers]
        return proxy.request("POST", "/v1/payments", h, harness.PAYMENT_BODY)

    def test_empty_key(self):
        proxy = self.start_proxy()
        self.assertProblem(self.send(proxy, [""]), 400)
        self.assertProblem(self.send(proxy, ['""']), 400)  # empty structured-field string
        self.assertEqual(self.upstream.total(), 0)

    def test_key_length_limit_default_255(self):
        proxy = self.start_proxy()
        self.assertProblem(self.send(proxy, ["k" * 256]), 400)
        self.assertProblem(self.send(proxy, ["k" * 5000]), 400)
        self.assertEqual(self.upstream.total(), 0)
        self.assertExecuted(self.send(proxy, ["k" * 255]))
        self.assertEqual(self.upstream.total(), 1)

    def test_key_length_limit_configurable(self):
        proxy = self.start_proxy(max_key_length=8)
        self.assertProblem(self.send(proxy, ["123456789"]), 400)
        self.assertEqual(self.upstream.total(), 0)
        self.assertExecuted(self.send(proxy, ["12345678"]))

    def test_characters_outside_visible_ascii(self):
        proxy = self.start_proxy()
        # All of these are legal HTTP field values, so the proxy itself must
        # reject them: space, tab, and UTF-8 bytes (obs-text).
        for key in ("a b", "a\tb", "caf\xc3\xa9", "\xff\xfe"):
            with self.subTest(key=key):
                self.assertProblem(self.send(proxy, [key]), 400)
        self.assertEqual(self.upstream.total(), 0)

    def test_repeated_header(self):
        proxy = self.start_proxy()
        self.assertProblem(self.send(proxy, ["rep-1", "rep-2"]), 400)
        self.assertProblem(self.send(proxy, ["rep-1", "rep-1"]), 400)
        self.assertEqual(self.upstream.total(), 0)
        # The rejected requests stored nothing: the key is still unused.
        self.assertExecuted(self.send(proxy, ["rep-1"]))
        self.assertEqual(self.upstream.total(), 1)

    def test_bare_key_with_inner_quote_is_valid(self):
        # '"' is visible ASCII; a key that does not start with '"' is bare.
        proxy = self.start_proxy()
        first = self.send(proxy, ['ord"42'])
        self.assertExecuted(first)
        again = self.send(proxy, ['ord"42'])
        self.assertTrue(again.replayed, again)
        self.assertEqual(self.upstream.total(), 1)

    def test_every_visible_ascii_character_is_accepted(self):
        proxy = self.start_proxy()
        visible = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != '"')
        self.assertExecuted(self.send(proxy, [visible]))
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
