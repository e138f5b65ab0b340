#!/usr/bin/env python3
"""An upstream answer is counted against server.max_buffered while it arrives.

The native client used to count an answer only once all of it had arrived:
while large answers trickled in, the process held far more than the bound
and the budget still read low, so new requests were admitted on a false
figure (two 12 MiB answers half in, a 4 MiB bound: the next request was
forwarded). Now the answer's buffer is counted as it grows (with a
Content-Length, all of it once the header block is in), forced, since the
action ran: those answers are delivered whole, and a new keyed request gets
503 out-of-memory with nothing forwarded and its key unused, until they have
been sent. The count then goes back to what it was: the same request runs,
and the process exits with nothing left counted.
"""

import unittest

import harness

MIB = 1 << 20
SIZE = 12 * MIB  # each answer; half of it (6 MiB) arrives, then a pause
PAUSE_MS = 5000


class ArrivingAnswersCounted(harness.ProxyTestCase):
    def check(self, chunked):
        proxy = self.start_proxy(config=self.config(
            routes=[self.route()], server={"max_buffered": "4MiB"}))
        hdrs = [("X-Test-Fault", "huge"), ("X-Test-Size", str(SIZE)),
                ("X-Test-Pause-Ms", str(PAUSE_MS))]
        if chunked:
            hdrs.append(("X-Test-Chunked", "1"))
        keys = ["arriving-%d" % i for i in range(2)]
        answers = [harness.in_thread(self.post, proxy, key, headers=hdrs, timeout=30)
                   for key in keys]
        # Both forwarded (the upstream counts a request before answering);
        # then its header block and half of each body reach the proxy in
        # far less than a second, and the rest comes PAUSE_MS later.
        harness.wait_for(lambda: all(self.upstream.count(k) == 1 for k in keys), timeout=10)
        # Before the keyed request, which would run if admitted: wait until
        # the halves are counted, seen by a request that runs nothing that
        # matters (a GET no route covers, refused by the same bound). A fixed
        # second here could lose that race on a loaded machine. Within 3 s, well
        # before the rest comes: counted only once whole, they never would be.
        probes = []

        def refused():
            r = proxy.request("GET", "/probe")
            probes.append(r.status)
            if r.status != 503:
                return False
            doc = self.assertProblem(r, 503)  # the bound's 503, not another one
            self.assertTrue(doc["type"].endswith(":out-of-memory"), doc)
            self.assertIn("max_buffered", doc["detail"])
            return True

        self.assertTrue(harness.wait_for(refused, timeout=3.0, interval=0.05),
                        "nothing refused within 3 s of both requests reaching the upstream, "
                        "while half of each 12 MiB answer arrives: %r" % probes[-5:])
        self.note("answers half in (%d probes)", len(probes))

        late = self.post(proxy, "late", timeout=20)
        self.note("late: %s", late.status)
        doc = self.assertProblem(late, 503)
        self.assertTrue(doc["type"].endswith(":out-of-memory"), doc)
        self.assertIn("max_buffered", doc["detail"])
        self.assertRetryAfter(late, minimum=1)
        self.assertEqual(self.upstream.count("late"), 0)

        # The answers that were arriving are never cut: each is whole.
        for key, a in zip(keys, answers):
            r = a.result()
            self.assertEqual(r.status, 201, (key, r))
            self.assertFalse(r.replayed, r)
            self.assertEqual(len(r.body), SIZE)
            self.assertEqual(r.body, harness.huge_body(SIZE))
        self.note("answers read")

        # Sent and read: given back. The refused key was never acquired, so
        # it runs now, once (a 503 meanwhile would be the answers' requests
        # still being freed or their store copy still committing).
        seen = []

        def runs():
            r = self.post(proxy, "late", timeout=20)
            seen.append(r.status)
            if r.status == 503:
                self.assertTrue(self.assertProblem(r, 503)["type"].endswith(":out-of-memory"))
                return False
            self.assertExecuted(r)
            return True

        harness.wait_for(runs, timeout=5, interval=0.1)
        self.note("late retried: %s", seen)
        self.assertEqual(self.upstream.count("late"), 1)
        for key in keys:
            self.assertEqual(self.upstream.count(key), 1)

        # Nothing left counted once every request is freed (a debug build
        # aborts on it; any build says so on stderr).
        self.assertEqual(proxy.stop(), 0, proxy.stderr()[-2000:])
        self.assertNotIn("still counted against server.max_buffered", proxy.stderr())

    def test_answer_with_content_length_counted_from_its_head(self):
        self.check(chunked=False)

    def test_chunked_answer_counted_as_it_grows(self):
        self.check(chunked=True)


if __name__ == "__main__":
    unittest.main()
