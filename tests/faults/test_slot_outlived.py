"""test_slot_outlived.py - a request that outlives its answer never reads its
connection's freed slot.

A keyed request's heartbeat goes to the store's in-flight lane, its complete
to the records' lane; the client is answered when the complete is back, and
the request object lives on until its heartbeat is back too. Meanwhile the
client may send its next request on the same connection and close it, which
frees the connection's slot. The older request, still pointing at that slot,
read it when it was finally freed: a use after free, found by reading the
code.

IDEM_FAULT_DELIVER_PAUSE_MS (fault builds only) makes that order certain:
the in-flight lane sleeps after handing over the acquire, so the heartbeat
submitted during the action waits in its queue, while the records' lane
commits the complete and the client is answered. Under AddressSanitizer
the old code aborts when the heartbeat comes back; this test wants the
proxy alive, no sanitizer report, and a clean exit.
"""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import harness  # noqa: E402

PAUSE_MS = 800


class SlotOutlived(harness.ProxyTestCase):
    def test_a_request_answered_before_its_heartbeat_is_back(self):
        env = dict(os.environ, IDEM_FAULT_DELIVER_PAUSE_MS=str(PAUSE_MS))
        cfg = self.config(routes=[self.route(lease="5s", heartbeat="100ms")],
                          server={"workers": 1})
        proxy = harness.Proxy(self.workdir, cfg, "proxy1", env=env)
        self.proxies.append(proxy)
        proxy.start()

        body = harness.PAYMENT_BODY
        head = [("Content-Type", "application/json"), ("Idempotency-Key", "outlived")]
        with harness.Conn(proxy.port) as c:
            # The action takes 300 ms: heartbeats are due after 100 ms, and
            # the first waits behind the in-flight lane's pause after the
            # acquire (800 ms), past the answer.
            start = time.monotonic()
            first = c.request("POST", "/v1/payments",
                              head + [("X-Test-Delay-Ms", "300")], body)
            self.assertExecuted(first)
            self.assertLess(time.monotonic() - start, PAUSE_MS / 1000.0,
                            "answered after the in-flight lane's pause: the heartbeat "
                            "could not be outstanding")
            # The next request on the same connection (a replay: no store
            # write), then the connection closes, all before the heartbeat.
            again = c.request("POST", "/v1/payments", head, body)
            self.assertReplayOf(again, first)
        # The heartbeat comes back, and the request is freed.
        time.sleep(2 * PAUSE_MS / 1000.0)
        self.assertTrue(proxy.running(), proxy.stderr()[-4000:])
        self.assertReplayOf(self.post(proxy, "outlived"), first)

        self.assertStopsClean(proxy)


if __name__ == "__main__":
    unittest.main()
