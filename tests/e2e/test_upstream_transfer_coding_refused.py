#!/usr/bin/env python3
"""An upstream answer framed with a transfer coding the proxy cannot undo
("gzip, chunked", "gzip"), or whose Transfer-Encoding or Content-Length is
folded over two lines (obs-fold, RFC 9112 section 5.2: the folded value is
the field's value), is a 502 with the key released, never a body. The proxy
drops Transfer-Encoding (hop by hop), so gzip bytes passed on would be
stored and replayed as the answer's body, under a status that says it ran.

The native client's parser decides framing again on a folded value. libcurl
7.88 frames the answer on the first line alone ("chunked") and hands the
continuation to the header callback as its own line, so its path must refuse
the folded field itself; and it answered "gzip, chunked" with an empty body,
which the proxy stored as a 201. Run with both upstream clients
(tests/e2e/CMakeLists.txt)."""

import socket
import threading
import unittest

import harness

BODY = b'{"id":"ch_1","amount":100}'
GZIP_BYTES = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03"


def chunk(data):
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)


CASES = {
    # name: (head lines after the status line, body bytes, framed as it says)
    "folded-te": ([b"Transfer-Encoding: chunked", b" , gzip"], chunk(GZIP_BYTES)),
    "folded-te-tab": ([b"Transfer-Encoding: chunked", b"\tgzip"], chunk(GZIP_BYTES)),
    "gzip-chunked": ([b"Transfer-Encoding: gzip, chunked"], chunk(GZIP_BYTES)),
    "gzip-alone": ([b"Transfer-Encoding: gzip", b"Connection: close"], GZIP_BYTES),
    "te-twice": ([b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"],
                 chunk(GZIP_BYTES)),
    "folded-cl": ([b"Content-Length: %d" % len(BODY), b" %d" % len(BODY)], BODY),
}


class RawUpstream:
    """Answers every request with the bytes of its X-Case, then closes."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.runs = {}
        self.closed = False
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.one, args=(conn,), daemon=True).start()

    def one(self, conn):
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            head, _, rest = data.partition(b"\r\n\r\n")
            fields = {}
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                fields[name.strip().lower()] = value.strip()
            need = int(fields.get(b"content-length", b"0"))
            while len(rest) < need:
                more = conn.recv(65536)
                if not more:
                    return
                rest += more
            key = fields.get(b"idempotency-key", b"").decode()
            with self.lock:
                self.runs[key] = self.runs.get(key, 0) + 1
            case = fields.get(b"x-case", b"plain").decode()
            if case == "plain":
                lines, body = [b"Content-Length: %d" % len(BODY)], BODY
            else:
                lines, body = CASES[case]
            conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n" +
                         b"".join(l + b"\r\n" for l in lines) + b"Connection: close\r\n\r\n" +
                         body)

    def count(self, key):
        with self.lock:
            return self.runs.get(key, 0)

    def close(self):
        self.closed = True
        self.sock.close()


class UpstreamTransferCodingRefused(harness.ProxyTestCase):
    def test_codings_the_proxy_cannot_undo_are_refused(self):
        up = RawUpstream()
        self.addCleanup(up.close)
        proxy = self.start_proxy(config=self.config(
            upstream_url="http://127.0.0.1:%d" % up.port))
        ok = self.post(proxy, "plain")
        self.assertEqual((ok.status, ok.body), (201, BODY), ok)
        self.assertTrue(self.post(proxy, "plain").replayed)
        for case in CASES:
            key = "k-" + case
            r = self.post(proxy, key, headers=[("X-Case", case)])
            self.assertEqual(r.status, 502, "%s: %r" % (case, r))
            self.assertProblem(r, 502)
            self.assertNotIn(GZIP_BYTES, r.body, "%s: encoded bytes passed on" % case)
            # Released, not stored: the retry runs again (a plain answer).
            again = self.post(proxy, key)
            self.assertEqual((again.status, again.body), (201, BODY), "%s: %r" % (case, again))
            self.assertFalse(again.replayed, "%s: a refused answer was stored" % case)
            self.assertEqual(up.count(key), 2, case)
        self.assertTrue(proxy.running())


if __name__ == "__main__":
    unittest.main()
