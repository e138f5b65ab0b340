#!/usr/bin/env python3
"""What a client sends never reaches the operator's logs as it was sent:

- stderr: libmicrohttpd's messages quote the request's path as it decoded it,
  so "%0a" is a line end and "%1b" an ESC. Any client could write a line of
  its own into stderr ("idemproxy: store: ..." forged, read by an alerting
  rule) or send escape sequences to an operator's terminal. Control
  characters are written as \\xNN.
- the raw Idempotency-Key and the raw scope_header value (here the caller's
  Authorization, the header that binds stored answers to a caller) appear in
  neither stdout, stderr nor the store's files, on the error paths too
  (mismatch, 5xx released, connection lost, invalid key, in progress); and a
  second caller with the same key and body runs its own request instead of
  getting the first caller's stored answer.
"""

import hashlib
import json
import os
import socket
import struct
import subprocess
import time
import unittest

import harness

FORGED = "idemproxy: store: FORGED"


def store_bytes(path):
    out = b""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out += f.read()
    return out


class PrivacyLogsAndStore(harness.ProxyTestCase):
    def test_client_bytes_cannot_forge_stderr_lines(self):
        proxy = self.start_proxy()
        path = "/v1/other/%0aidemproxy:%20store:%20FORGED%1b[31mred"
        said = False
        for _ in range(10):
            # The client resets the connection before the answer: sending it
            # fails, and libmicrohttpd says so, naming the path.
            s = socket.create_connection(("127.0.0.1", proxy.port))
            s.sendall(("GET %s?token=query-secret-31 HTTP/1.1\r\nHost: x\r\n"
                       "X-Test-Delay-Ms: 200\r\n\r\n" % path).encode())
            time.sleep(0.05)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            if harness.wait_for(lambda: "FORGED" in proxy.stderr(), timeout=1.5):
                said = True
                break
        self.assertTrue(said, "libmicrohttpd never named the path: %r" % proxy.stderr())
        err = proxy.stderr()
        for line in err.splitlines():
            self.assertFalse(line.startswith(FORGED), "a client wrote a line of its own: %r" % err)
        self.assertNotIn("\x1b", err)
        self.assertIn("\\x0aidemproxy: store: FORGED\\x1b[31mred", err)
        self.assertNotIn("query-secret-31", err + proxy.stdout())

    def test_raw_key_and_credential_never_logged_or_stored(self):
        key = "order-key-5f0c7a21"
        alice = "Bearer alice-token-93be1d"
        bob = "Bearer bob-token-44c0aa"
        proxy = self.start_proxy(scope_header="Authorization", wait="0s")
        quiet = ("X-Test-Status", "204")  # nothing of the request in the answer

        first = self.post(proxy, key, headers=[("Authorization", alice), quiet])
        self.assertEqual(first.status, 204, first)
        self.assertTrue(self.post(proxy, key, headers=[("Authorization", alice), quiet]).replayed)
        # Same key and body, another caller: its own execution, not Alice's answer.
        other = self.post(proxy, key, headers=[("Authorization", bob), quiet])
        self.assertEqual(other.status, 204, other)
        self.assertFalse(other.replayed, other)
        self.assertNotEqual(other.charge_id, first.charge_id)
        self.assertEqual(self.upstream.count(key), 2)

        # Error paths.
        self.assertProblem(self.post(proxy, key, body=b'{"amount":1}',
                                     headers=[("Authorization", alice)]), 422)
        self.assertEqual(self.post(proxy, key + "-5xx", headers=[
            ("Authorization", alice), ("X-Test-Status", "500")]).status, 500)
        self.assertProblem(self.post(proxy, key + "-reset", headers=[
            ("Authorization", alice), ("X-Test-Fault", "reset")]), 502)
        self.assertProblem(self.post(proxy, '"' + key + "-unterminated",
                                     headers=[("Authorization", alice)]), 400)
        slow = harness.in_thread(self.post, proxy, key + "-slow", headers=[
            ("Authorization", alice), ("X-Test-Delay-Ms", "2000"), quiet])
        # Held once the upstream has it (the acquire is committed first): a
        # fixed 0.2 s could end before a loaded machine's fsync did.
        self.assertTrue(harness.wait_for(lambda: self.upstream.count(key + "-slow") == 1, 10))
        self.assertProblem(self.post(proxy, key + "-slow", headers=[("Authorization", alice)]),
                           409)
        self.assertEqual(slow.result(10).status, 204)
        proxy.wait_access_log(9)
        self.assertEqual(proxy.stop(), 0)

        logs = proxy.stdout() + proxy.stderr()
        stored = store_bytes(self.store_path)
        self.assertGreater(len(stored), 0)
        for secret in (key, "alice-token-93be1d", "bob-token-44c0aa"):
            self.assertNotIn(secret, logs)
            self.assertNotIn(secret.encode(), stored)

    def test_log_key_hash_is_keyed_by_the_store_and_the_tenant(self):
        # The access log's key hash was the first 4 bytes of SHA-256 over
        # the route scope and the key: anyone could try order numbers
        # against it (10 million in 12 s), and one key of two tenants
        # logged alike. It is now keyed with the store's own random salt,
        # over the whole scope (tenant included).
        p = self.start_proxy(scope_header="X-Tenant-Id")
        for tenant in ("acme", "globex"):
            self.assertExecuted(self.post(p, "order-1001", headers=[("X-Tenant-Id", tenant)]))
        log = [e["key"] for e in p.wait_access_log(2)]
        salt = harness.log_salt(self.store_path)
        self.assertEqual(len(salt or b""), 32)
        plain = harness.record_key("payments", "order-1001").hex()[:8]
        self.assertNotIn(plain, log)
        self.assertEqual(len(set(log)), 2, log)  # two tenants, two hashes
        expected = {}
        for tenant in ("acme", "globex"):
            scope = b"payments\0" + hashlib.sha256(tenant.encode()).hexdigest().encode()
            expected[tenant] = harness.log_key(self.store_path, scope, "order-1001")
        # (the two lines in either order: two workers log as their answers end)
        self.assertCountEqual(log, expected.values())
        # A second process on the store logs the same key alike (one salt
        # per store), and show-key names it so.
        q = self.start_proxy(scope_header="X-Tenant-Id", name="second")
        self.assertEqual(self.post(q, "order-1001", headers=[("X-Tenant-Id", "acme")]).status,
                         201)
        self.assertEqual(q.wait_access_log(1)[0]["key"], expected["acme"])
        self.assertEqual(harness.log_salt(self.store_path), salt)
        shown = subprocess.run([harness.binary(), "show-key", self.store_path, "payments",
                                "order-1001", "--scope-header-value", "acme"],
                               capture_output=True, timeout=30)
        self.assertEqual(json.loads(shown.stdout)["log_key"], expected["acme"], shown.stderr)


if __name__ == "__main__":
    unittest.main()
