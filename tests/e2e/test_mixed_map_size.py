#!/usr/bin/env python3
"""Processes sharing a store with different store.map_size values.

LMDB raises a map below the data's size to the data's size, and refuses a
process's transactions (MDB_MAP_RESIZED) once another has grown the file
past its map. So a proxy given a smaller map_size than the others sharing
its store used to map only the data: every new key got 503 "store full"
while the store had room, and each time another process grew the file it
stopped (exit 75) and came back just as full, a crash loop under a
supervisor. A process that opens a store others have open now maps at least
the size the store records (the largest any of them set), and says so."""

import unittest

import harness

BIG = [("X-Test-Fault", "huge"), ("X-Test-Size", "60000")]


class MixedMapSize(harness.ProxyTestCase):
    def test_a_smaller_map_size_beside_a_larger_one_takes_the_larger(self):
        big = self.start_proxy(config=self.config(store={"map_size": "64MiB"}), name="big")
        for i in range(110):  # about 6.6 MB of answers: past the small map
            self.assertEqual(self.post(big, "big-%d" % i, headers=BIG).status, 201)

        small = self.start_proxy(config=self.config(store={"map_size": "4MiB"}), name="small")
        r = self.post(small, "small-1")
        self.assertEqual(r.status, 201, r.body[:300])
        again = self.post(small, "big-3", headers=BIG)
        self.assertEqual((again.status, again.header("Idempotent-Replayed")), (201, "true"))
        self.assertIn("is smaller than the 67108864 bytes the other processes sharing the store "
                      "map; this process maps 67108864 too", small.stderr())

        # The big one grows the file further: the small one neither stops
        # (MDB_MAP_RESIZED, exit 75) nor fills up.
        for i in range(110, 200):
            self.assertEqual(self.post(big, "big-%d" % i, headers=BIG).status, 201)
        for i in range(2, 12):
            r = self.post(small, "small-%d" % i, headers=BIG)
            self.assertEqual(r.status, 201, r.body[:300])
        self.assertTrue(small.running(), small.stderr()[-2000:])
        self.assertEqual(self.upstream.count("small-1"), 1)

    def test_a_process_alone_maps_what_it_was_given(self):
        # Alone on the store, a lowered map_size is honoured (the cap on the
        # file's growth), not overridden by the size a previous run set.
        p = self.start_proxy(config=self.config(store={"map_size": "64MiB"}), name="first")
        self.assertEqual(self.post(p, "k1").status, 201)
        self.assertEqual(p.stop(), 0)
        q = self.start_proxy(config=self.config(store={"map_size": "8MiB"}), name="second")
        self.assertEqual(self.post(q, "k2").status, 201)
        self.assertNotIn("other processes sharing the store", q.stderr())
        self.assertEqual(q.stop(), 0)


if __name__ == "__main__":
    unittest.main()
