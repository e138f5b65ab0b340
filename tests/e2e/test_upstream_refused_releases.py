#!/usr/bin/env python3
"""When the upstream refuses the connection (nothing was sent) the client gets
502 and the record is released: a retry once the upstream is up executes the
action exactly once."""

import unittest

import harness


class UpstreamRefused(harness.ProxyTestCase):
    def test_refused_is_502_and_released(self):
        dead = "http://127.0.0.1:%d" % harness.closed_port()
        down = self.start_proxy(config=self.config(upstream_url=dead), name="down")
        r = self.post(down, "refused-1")
        self.assertProblem(r, 502)
        self.assertFalse(r.replayed)
        # Released, not stored: the same proxy answers 502 again (a stored
        # 502 would come back with Idempotent-Replayed).
        r2 = self.post(down, "refused-1")
        self.assertProblem(r2, 502)
        self.assertFalse(r2.replayed, r2)

        # The same store behind a proxy whose upstream is up: the retry runs
        # as if the key had never been used, once.
        up = self.start_proxy(name="up")
        first = self.post(up, "refused-1")
        self.assertExecuted(first)
        self.assertReplayOf(self.post(up, "refused-1"), first)
        self.assertReplayOf(self.post(down, "refused-1"), first)
        self.assertEqual(self.upstream.count("refused-1"), 1)

    def test_refused_even_with_on_unknown_complete_is_released(self):
        # Nothing was sent, so the outcome is known: on_unknown does not apply.
        dead = "http://127.0.0.1:%d" % harness.closed_port()
        down = self.start_proxy(config=self.config(
            upstream_url=dead, routes=[self.route(on_unknown="complete")]), name="down")
        self.assertProblem(self.post(down, "refused-2"), 502)
        up = self.start_proxy(name="up", on_unknown="complete")
        self.assertExecuted(self.post(up, "refused-2"))
        self.assertEqual(self.upstream.count("refused-2"), 1)


if __name__ == "__main__":
    unittest.main()
