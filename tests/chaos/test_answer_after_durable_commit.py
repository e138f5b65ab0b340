#!/usr/bin/env python3
"""Answer only after a durable commit: a client that has seen the first byte
of a first request's answer can retry after any crash and get the replay,
never a second execution.

Each round sends a new key, reads until the status line has arrived, and
SIGKILLs the proxy at once (within microseconds: the kill is the next thing
the client does). A proxy that answered before its complete was committed
would, in some rounds, die with the record still IN_PROGRESS (or absent):
the retry would then wait out the lease and run the action again, or 409.
The proxy is restarted on the same store, and the retry must be a replay
(`Idempotent-Replayed: true`, the same charge id whenever the first answer's
headers arrived whole) with the upstream's execution count still 1, and
`check-store` must pass. The upstream delay varies (0-30 ms) so the kill
lands on differently timed group commits.

CI: 100 rounds; long (CHAOS_LONG=1): 1,000; CHAOS_DURABLE_ROUNDS overrides.
"""

import os
import signal
import socket
import time
import unittest

import chaoslib
from chaoslib import harness

TEST = "answer_after_durable_commit"
ROUNDS = chaoslib.knob("DURABLE_ROUNDS", 100, 1000)


class AnswerAfterDurableCommit(harness.ProxyTestCase):
    def first_bytes_then_kill(self, proxy, key, delay_ms):
        """Sends a first request; SIGKILLs the proxy as soon as the status
        line is in. Returns (status, charge id or None, bytes seen)."""
        data = harness.build_request(
            "POST", "/v1/payments",
            [("Content-Type", "application/json"), ("Idempotency-Key", key),
             ("X-Test-Delay-Ms", str(delay_ms)), ("X-Test-Holder", "first")],
            harness.PAYMENT_BODY, host="127.0.0.1:%d" % proxy.port)
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=15)
        buf = b""
        try:
            sock.sendall(data)
            while b"\r\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
            # The status line is in: kill now, before anything else.
            os.kill(proxy.pid, signal.SIGKILL)
            proxy.killed = True
            proxy.proc.wait()
            try:  # whatever the kernel still delivers
                sock.settimeout(1)
                while b"\r\n\r\n" not in buf:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
            except OSError:
                pass
        finally:
            sock.close()
        self.assertIn(b"\r\n", buf, "%s: no status line before the connection closed" % key)
        status = int(buf.split(b" ", 2)[1])
        charge = None
        head = buf.partition(b"\r\n\r\n")
        if head[1]:
            for line in head[0].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"x-charge-id":
                    charge = value.strip().decode()
        return status, charge, len(buf)

    def test_killed_right_after_first_byte_the_retry_replays(self):
        rnd = chaoslib.rng(TEST)
        t_start = time.monotonic()
        proxy = self.start_proxy(name="p", lease="5s", heartbeat="1s", wait="0s")
        replayed = same_charge = checks_ok = 0
        whole_heads = 0
        kill_to_restart = []
        for i in range(ROUNDS):
            key = "durable-%d" % i
            delay = rnd.choice((0, 0, 1, 5, 10, 30))
            status, charge, _ = self.first_bytes_then_kill(proxy, key, delay)
            self.assertEqual(status, 201, "%s: first answer %d" % (key, status))
            if charge is not None:
                whole_heads += 1
            t_kill = time.monotonic()
            chaoslib.restart(proxy)
            kill_to_restart.append(time.monotonic() - t_kill)
            check = chaoslib.check_store(self.store_path)
            self.assertTrue(check.ok, "%s: %r" % (key, check))
            checks_ok += 1

            retry = self.post(proxy, key, headers=[("X-Test-Holder", "retry")])
            self.assertEqual(retry.status, 201,
                             "%s (round %d, delay %d ms): the retry after the kill got %r"
                             % (key, i, delay, retry))
            self.assertTrue(retry.replayed,
                            "%s (round %d, delay %d ms): the retry was executed again, not "
                            "replayed: the answer went out before its commit" % (key, i, delay))
            replayed += 1
            if charge is not None:
                self.assertEqual(retry.charge_id, charge, key)
                same_charge += 1
            self.assertEqual(self.upstream.count(key), 1, key)

        execs = {}
        for e in chaoslib.execution_log(self.upstream):
            execs[e["key"]] = execs.get(e["key"], 0) + 1
        twice = {k: n for (k, n) in execs.items() if n != 1}
        chaoslib.figure(TEST, rounds=ROUNDS, killed_after_status_line=ROUNDS,
                        retries_replayed=replayed, reexecuted=len(twice),
                        replay_charge_matched=same_charge, check_store_ok=checks_ok,
                        restart_ms_max=round(max(kill_to_restart) * 1000),
                        test_s=round(time.monotonic() - t_start, 1))
        self.assertEqual(twice, {})
        self.assertEqual(len(execs), ROUNDS)


if __name__ == "__main__":
    unittest.main()
