#!/usr/bin/env python3
"""Records live in the store, not in the process: after SIGTERM (exit 0) a new
process on the same store replays what the old one completed."""

import unittest

import harness


class RestartKeepsRecords(harness.ProxyTestCase):
    def test_restart_replays(self):
        cfg = self.config()
        old = self.start_proxy(config=cfg, name="before")
        first = self.post(old, "restart-1")
        self.assertExecuted(first)
        mismatch_seed = self.post(old, "restart-2", body=b'{"amount":7}')
        self.assertExecuted(mismatch_seed)
        self.assertEqual(old.stop(), 0, old.stderr())

        new = self.start_proxy(config=cfg, name="after")
        self.assertReplayOf(self.post(new, "restart-1"), first)
        self.assertProblem(self.post(new, "restart-2", body=b'{"amount":8}'), 422)
        self.assertEqual(self.upstream.total(), 2)

    def test_restart_keeps_records_with_interval_durability(self):
        # "interval" may lose the last moments on a crash, not on a clean stop.
        cfg = self.config(store={"durability": "interval", "sync_interval": "10s"})
        old = self.start_proxy(config=cfg, name="before")
        first = self.post(old, "restart-int")
        self.assertExecuted(first)
        self.assertEqual(old.stop(), 0, old.stderr())
        new = self.start_proxy(config=cfg, name="after")
        self.assertReplayOf(self.post(new, "restart-int"), first)
        self.assertEqual(self.upstream.total(), 1)


if __name__ == "__main__":
    unittest.main()
