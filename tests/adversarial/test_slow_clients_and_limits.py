#!/usr/bin/env python3
"""Item 10, slow clients and resource limits.

Dribblers: 500 connections from 127.0.0.1 that send a request head one byte
at a time and never finish it, while 127.0.0.2 (a second loopback address,
bound as the source) sends N normal keyed requests (CI and long: 1,000). The
dribbling address holds at most server.per_ip_connections (64) connections
(the others are closed at once), and every normal request succeeds.

Hung upstream: 500 keyed requests at once to an upstream that reads them and
never answers are all answered 504 within upstream.timeout + 0.5 s; every
suspended connection is released: afterwards the proxy serves normally, its
open file descriptors return to their baseline (/proc/PID/fd), and the
upstream sees every one of its 500 connections closed."""

import select
import socket
import threading
import time
import unittest

import adv
from adv import harness

PER_IP = 64
DRIBBLERS = 500
HUNG = 500
TIMEOUT_S = 2.0
SLACK_S = 0.5


class Dribblers:
    """n connections from `source` that dribble a request head forever."""

    def __init__(self, port, n, source="127.0.0.1", interval=0.5):
        self.socks = []
        self.closed = set()
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((source, 0))
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            self.socks.append(s)
        self.interval = interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _poll_closed(self):
        """Marks the sockets the server closed (EOF, reset, or never connected)."""
        alive = {s.fileno(): s for s in self.socks if s.fileno() not in self.closed}
        poller = select.poll()
        for fd in alive:
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        for fd, _ev in poller.poll(0):
            s = alive[fd]
            if True:
                try:
                    if s.recv(4096) == b"":
                        self.closed.add(s.fileno())
                except BlockingIOError:
                    pass
                except OSError:
                    self.closed.add(s.fileno())

    def _run(self):
        head = b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nX-Dribble: "
        sent = 0
        while not self.stop.is_set():
            self._poll_closed()
            for s in self.socks:
                if s.fileno() in self.closed:
                    continue
                byte = head[sent:sent + 1] if sent < len(head) else b"a"
                try:
                    s.send(byte)
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self.closed.add(s.fileno())
            sent += 1
            self.stop.wait(self.interval)

    def held(self):
        self._poll_closed()
        return len(self.socks) - len(self.closed)

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


class SlowClientsAndLimits(adv.AdversarialCase):
    def test_dribblers_hold_at_most_the_per_ip_limit(self):
        n = adv.scale(short=1000, long=1000)
        proxy = self.start_proxy(config=self.config(server={"per_ip_connections": PER_IP}))
        started = time.monotonic()
        dribblers = Dribblers(proxy.port, DRIBBLERS)
        self.addCleanup(dribblers.close)
        # The proxy closes the connections over the limit as it accepts
        # them; give a loaded machine time to get through all 500.
        time.sleep(1.5)
        harness.wait_for(lambda: dribblers.held() <= PER_IP, 10)
        held_before = dribblers.held()

        def normal(i):
            return adv.timed_request(proxy.port, "POST", "/v1/payments", [
                ("Content-Type", "application/json"), ("Idempotency-Key", "normal-%d" % i)],
                harness.PAYMENT_BODY, source="127.0.0.2")

        answers = adv.parallel(normal, list(range(n)), workers=16)
        bad = [(i, adv.short(r)) for i, (r, _) in enumerate(answers)
               if isinstance(r, Exception) or r.status != 201]
        slowest = max(t for (_, t) in answers)
        held_after = dribblers.held()
        executed = self.upstream.total()
        self.summary("per-ip-dribblers",
                     "%d dribbling connections from 127.0.0.1 (per_ip_connections %d): %d held "
                     "before the run, %d held after it; %d normal requests from 127.0.0.2: %d "
                     "failed, slowest %.2fs, %d executions; %.1fs",
                     DRIBBLERS, PER_IP, held_before, held_after, n, len(bad), slowest, executed,
                     time.monotonic() - started)
        self.assertLessEqual(held_before, PER_IP)
        self.assertLessEqual(held_after, PER_IP)
        self.assertGreater(held_after, 0, "the dribblers were not accepted at all")
        self.assertEqual(bad, [], bad[:10])
        self.assertEqual(executed, n)

    def test_hung_upstream_releases_every_connection(self):
        cfg = self.config(timeout="%gs" % TIMEOUT_S, server={"per_ip_connections": 0})
        proxy = self.start_proxy(config=cfg)
        started = time.monotonic()
        self.assertExecuted(self.post(proxy, "warm-up"))
        time.sleep(0.5)
        baseline = adv.open_fds(proxy.pid)
        up_baseline = adv.open_fds(self.upstream.proc.pid)

        def hung(i):
            return adv.timed_request(proxy.port, "POST", "/v1/payments", [
                ("Content-Type", "application/json"), ("Idempotency-Key", "hung-%d" % i),
                ("X-Test-Fault", "hang")], harness.PAYMENT_BODY, timeout=TIMEOUT_S + 20)

        peak = [0]
        sampling = threading.Event()

        def sample():
            while not sampling.is_set():
                try:
                    peak[0] = max(peak[0], adv.open_fds(proxy.pid))
                except OSError:
                    pass
                sampling.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        answers = adv.parallel(hung, list(range(HUNG)), workers=HUNG)
        sampling.set()
        sampler.join()
        late = [(i, round(t, 2)) for i, (r, t) in enumerate(answers) if t > TIMEOUT_S + SLACK_S]
        wrong = [(i, adv.short(r)) for i, (r, _) in enumerate(answers)
                 if isinstance(r, Exception) or r.status != 504]
        slowest = max(t for (_, t) in answers)

        # Every suspended connection released: fds back to the baseline, in
        # the proxy and in the upstream (which held the 500 hung requests).
        settled = harness.wait_for(lambda: adv.open_fds(proxy.pid) <= baseline + 4, timeout=10)
        after = adv.open_fds(proxy.pid)
        up_settled = harness.wait_for(
            lambda: adv.open_fds(self.upstream.proc.pid) <= up_baseline + 4, timeout=10)
        up_after = adv.open_fds(self.upstream.proc.pid)
        # The proxy serves normally afterwards, and every record was released.
        normal = [self.post(proxy, "after-%d" % i) for i in range(20)]
        normal_bad = [adv.short(r) for r in normal if r.status != 201 or r.replayed]
        retry = self.post(proxy, "hung-0")
        rc, doc, _ = adv.check_store(self.store_path)
        log = proxy.wait_access_log(HUNG + 22)
        released = sum(1 for e in log if e["status"] == 504 and e["outcome"] == "released")
        self.summary("hung-upstream",
                     "%d requests to a hung upstream (timeout %.1fs): %d not 504, %d later than "
                     "%.1fs (slowest %.2fs); proxy fds baseline %d, peak %d, after %d; upstream "
                     "fds %d -> %d; %d normal requests after: %d failed; %.1fs",
                     HUNG, TIMEOUT_S, len(wrong), len(late), TIMEOUT_S + SLACK_S, slowest,
                     baseline, peak[0], after, up_baseline, up_after, len(normal), len(normal_bad),
                     time.monotonic() - started)
        self.assertEqual(wrong, [], wrong[:10])
        self.assertEqual(late, [], late[:10])
        self.assertTrue(settled, "fds did not return to the baseline %d: %d" % (baseline, after))
        self.assertTrue(up_settled, "the upstream still holds %d fds (baseline %d)" % (
            up_after, up_baseline))
        self.assertEqual(normal_bad, [])
        self.assertExecuted(retry)  # released: the retry runs
        self.assertEqual(released, HUNG, "access log: %d released 504s" % released)
        self.assertEqual(rc, 0, doc)
        self.assertEqual(doc["in_progress"], 0, doc)


if __name__ == "__main__":
    unittest.main()
