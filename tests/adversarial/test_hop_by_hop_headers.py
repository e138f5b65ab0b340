#!/usr/bin/env python3
"""Item 8, hop-by-hop and forwarding headers: 30+ request cases (Connection
naming X-Forwarded-For and custom headers, Proxy-Authorization, TE, Upgrade,
Expect, spoofed X-Forwarded-*, Keep-Alive, Trailer, HTTP/1.0, a second client
address...) and 10 response cases.

Request side, for every case: the upstream (fault echo-headers: it answers
with the headers it received) receives none of the hop-by-hop headers
(Connection, every header Connection names, Keep-Alive, Proxy-*, TE, Trailer,
Transfer-Encoding, Upgrade, and Expect), no X-Forwarded-* header the client
sent, exactly one X-Forwarded-For equal to the client's address, exactly one
X-Forwarded-Proto and X-Forwarded-Host (the client's Host), exactly one
Content-Length equal to the body, and the end-to-end headers unchanged.

Response side: hop-by-hop headers the upstream sends (X-Test-Response-Header,
fault hop) reach neither the client's first response nor the store (checked
on the replay, which is the stored payload)."""

import time
import unittest

import adv
from adv import harness

HOP = {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "expect"}
BODY = b'{"amount":1000,"currency":"eur"}'


def request_cases():
    c = []

    def add(name, headers, **kw):
        c.append(dict(name=name, headers=headers, **kw))

    add("connection-names-xff", [("Connection", "X-Forwarded-For"), ("X-Forwarded-For", "6.6.6.6")])
    add("connection-close-names-xff", [("Connection", "close, X-Forwarded-For")])
    add("connection-names-xfh-xfp", [("Connection", "X-Forwarded-Host, X-Forwarded-Proto")])
    add("connection-names-content-length", [("Connection", "Content-Length")])
    add("connection-custom", [("Connection", "X-A, X-B"), ("X-A", "1"), ("X-B", "2"),
                              ("X-C", "kept")], kept={"X-C": "kept"}, named=["x-a", "x-b"])
    add("connection-odd-spacing", [("Connection", "  x-a ,X-B  ,, "), ("X-A", "1"), ("x-b", "2")],
        named=["x-a", "x-b"])
    add("connection-two-lines", [("Connection", "X-A"), ("Connection", "X-B"), ("X-A", "1"),
                                 ("X-B", "2")], named=["x-a", "x-b"])
    add("connection-names-te-keep-alive", [("Connection", "TE, Keep-Alive"), ("TE", "trailers"),
                                           ("Keep-Alive", "timeout=1")])
    add("connection-names-mixed-case", [("Connection", "X-Secret-Hop"), ("x-SECRET-hop", "v")],
        named=["x-secret-hop"])
    add("connection-keep-alive", [("Connection", "keep-alive"), ("Keep-Alive", "timeout=5, max=9")])
    add("proxy-authorization", [("Proxy-Authorization", "Basic Zm9vOmJhcg==")])
    add("proxy-connection", [("Proxy-Connection", "keep-alive")])
    add("proxy-custom", [("Proxy-Foo", "bar"), ("PROXY-BAR", "baz")])
    add("proxy-authenticate-in-request", [("Proxy-Authenticate", "Basic realm=x")])
    add("te-trailers", [("TE", "trailers")])
    add("te-list", [("TE", "gzip, deflate;q=0.5, trailers")])
    add("te-chunked", [("TE", "chunked")])
    add("trailer", [("Trailer", "X-Checksum")])
    add("upgrade-websocket", [("Connection", "Upgrade"), ("Upgrade", "websocket"),
                              ("Sec-WebSocket-Version", "13")], kept={"Sec-WebSocket-Version": "13"})
    add("upgrade-h2c", [("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c"),
                        ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA")], named=["http2-settings"])
    add("upgrade-without-connection", [("Upgrade", "websocket")])
    add("expect-100-continue", [("Expect", "100-continue")])
    add("xff-spoofed", [("X-Forwarded-For", "1.2.3.4")])
    add("xff-spoofed-twice", [("X-Forwarded-For", "1.2.3.4"),
                              ("X-Forwarded-For", "5.6.7.8, 9.9.9.9")])
    add("xff-spoofed-odd-case", [("x-FORWARDED-for", "1.2.3.4")])
    add("xff-spoofed-empty", [("X-Forwarded-For", "")])
    add("xfp-spoofed", [("X-Forwarded-Proto", "https")])
    add("xfh-spoofed", [("X-Forwarded-Host", "evil.test")])
    add("xf-other-spoofed", [("X-Forwarded-Port", "443"), ("X-Forwarded-Server", "evil")])
    add("http10-keep-alive", [("Connection", "keep-alive"), ("Keep-Alive", "timeout=5")],
        version="HTTP/1.0")
    add("second-client-address", [("X-Forwarded-For", "127.0.0.1")], source="127.0.0.2")
    add("passthrough-route", [("Connection", "X-A"), ("X-A", "1"), ("Proxy-Authorization", "x"),
                              ("X-Forwarded-For", "1.2.3.4")], path="/elsewhere", named=["x-a"])
    add("all-at-once", [("Connection", "close, X-A, X-Forwarded-For"), ("X-A", "1"),
                        ("Keep-Alive", "1"), ("TE", "trailers"), ("Trailer", "X"),
                        ("Upgrade", "h2c"), ("Proxy-Authorization", "x"),
                        ("Proxy-Connection", "close"), ("X-Forwarded-For", "1.1.1.1"),
                        ("X-Forwarded-Proto", "https"), ("X-Forwarded-Host", "evil")],
        named=["x-a"])
    return c


RESPONSE_CASES = [
    ("resp-connection-named", ["Connection: X-Resp-Named", "X-Resp-Named: secret"]),
    ("resp-connection-close-named", ["Connection: close, X-Resp-Named", "X-Resp-Named: s"]),
    ("resp-keep-alive", ["Keep-Alive: timeout=5"]),
    ("resp-proxy-authenticate", ["Proxy-Authenticate: Basic realm=x"]),
    ("resp-proxy-connection", ["Proxy-Connection: keep-alive"]),
    ("resp-proxy-custom", ["Proxy-Foo: bar"]),
    ("resp-trailer", ["Trailer: X-Checksum"]),
    ("resp-upgrade", ["Upgrade: h2c"]),
    ("resp-te", ["TE: trailers"]),
    ("resp-fault-hop", None),  # upstream fault hop: all of them, chunked
]
RESP_BANNED = {"x-resp-named", "x-hop", "keep-alive", "trailer", "upgrade", "te"}


class HopByHopHeaders(adv.AdversarialCase):
    def send(self, proxy, case, key):
        headers = [("Content-Type", "application/json"), ("X-Test-Fault", "echo-headers"),
                   ("X-End-To-End", "kept")] + case["headers"]
        path = case.get("path", "/v1/payments")
        if path == "/v1/payments":
            headers.insert(0, ("Idempotency-Key", key))
        source = case.get("source")
        with adv.Conn(proxy.port, source=source) as c:
            data = harness.build_request("POST", path, headers, BODY,
                                         host="127.0.0.1:%d" % proxy.port,
                                         version=case.get("version", "HTTP/1.1"))
            c.send(data)
            return c.read_response()

    def check_request_case(self, proxy, case, resp):
        problems = []
        if resp.status != 201:
            return ["answered %s" % adv.short(resp)]
        seen = resp.json()
        names = [n.lower() for (n, _) in seen]

        def values(name):
            return [v for (n, v) in seen if n.lower() == name.lower()]

        for n in names:
            if n in HOP or n.startswith("proxy-"):
                problems.append("hop-by-hop %s forwarded" % n)
        for n in case.get("named", []):
            if n in names:
                problems.append("%s (named by Connection) forwarded" % n)
        client = case.get("source") or "127.0.0.1"
        if values("X-Forwarded-For") != [client]:
            problems.append("X-Forwarded-For %r, expected [%r]" % (values("X-Forwarded-For"), client))
        if values("X-Forwarded-Proto") != ["http"]:
            problems.append("X-Forwarded-Proto %r" % values("X-Forwarded-Proto"))
        if values("X-Forwarded-Host") != ["127.0.0.1:%d" % proxy.port]:
            problems.append("X-Forwarded-Host %r" % values("X-Forwarded-Host"))
        for n in set(names):
            if n.startswith("x-forwarded-") and n not in (
                    "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"):
                problems.append("client's %s forwarded" % n)
        if values("Content-Length") != [str(len(BODY))]:
            problems.append("Content-Length %r for a %d-byte body" % (
                values("Content-Length"), len(BODY)))
        if values("X-End-To-End") != ["kept"]:
            problems.append("end-to-end header lost: %r" % values("X-End-To-End"))
        for name, value in case.get("kept", {}).items():
            if values(name) != [value]:
                problems.append("end-to-end %s lost: %r" % (name, values(name)))
        return problems

    def check_response(self, resp):
        problems = []
        for n, v in resp.headers:
            ln = n.lower()
            if ln in RESP_BANNED or ln.startswith("proxy-"):
                problems.append("%s: %s passed on" % (n, v))
            if ln == "connection" and any(t.strip().lower() not in ("close", "keep-alive")
                                          for t in v.split(",")):
                problems.append("the upstream's Connection %r passed on" % v)
            if ln == "transfer-encoding" and v.strip().lower() != "chunked":
                problems.append("Transfer-Encoding %r passed on" % v)
        if resp.header("X-Upstream") != "demo":
            problems.append("end-to-end X-Upstream lost")
        return problems

    def test_hop_by_hop_both_ways(self):
        proxy = self.start_proxy(config=self.config(server={"per_ip_connections": 0}))
        started = time.monotonic()
        failures = []
        cases = request_cases()
        for case in cases:
            key = "hop-" + case["name"]
            try:
                resp = self.send(proxy, case, key)
            except Exception as e:  # noqa: BLE001
                failures.append("%s: %r" % (case["name"], e))
                continue
            for p in self.check_request_case(proxy, case, resp):
                failures.append("request %s: %s" % (case["name"], p))

        for name, extra in RESPONSE_CASES:
            key = "hop-" + name
            h = [("X-Test-Fault", "hop")] if extra is None else [
                ("X-Test-Response-Header", x) for x in extra]
            first = self.post(proxy, key, headers=h)
            again = self.post(proxy, key, headers=h)
            if first.status != 201 or not again.replayed or again.body != first.body:
                failures.append("response %s: no 201 and replay: %s / %s" % (
                    name, adv.short(first), adv.short(again)))
                continue
            for label, resp in (("first response", first), ("replay (store)", again)):
                for p in self.check_response(resp):
                    failures.append("response %s, %s: %s" % (name, label, p))
            if self.upstream.count(key) != 1:
                failures.append("response %s: executed %d times" % (name, self.upstream.count(key)))

        self.summary("hop-by-hop-headers",
                     "%d request cases + %d response cases (first response and replay): "
                     "%d violations; %.1fs", len(cases), len(RESPONSE_CASES), len(failures),
                     time.monotonic() - started)
        self.assertEqual(failures, [], "\n".join(failures))

    def test_connection_naming_too_many_fields_is_the_clients_400(self):
        # The forwarding rules drop what Connection names and track 32
        # names: past that the request cannot be forwarded as asked. It is
        # the client's 400, refused before a key is taken; it was a 502
        # upstream-request-failed (blaming the upstream) after an acquire.
        proxy = self.start_proxy()
        names = ", ".join("x-n%d" % i for i in range(33))
        for key in ("hop-many-names", None):
            hdrs = [("Connection", names)]
            resp = (self.post(proxy, key, headers=hdrs) if key else
                    proxy.request("GET", "/v1/payments", headers=hdrs))
            self.assertEqual(resp.status, 400, adv.short(resp))
            self.assertEqual(resp.json()["type"], "urn:idemproxy:problem:bad-request")
            self.assertIn("names more than 32 fields", resp.json()["detail"])
        self.assertEqual(self.upstream.total(), 0)
        log = proxy.wait_access_log(2)
        self.assertEqual([e["outcome"] for e in log], ["rejected", "rejected"])
        # 32 names is still forwarded, each named field dropped.
        names = ", ".join("x-n%d" % i for i in range(32))
        resp = self.post(proxy, "hop-32-names", headers=[("Connection", names), ("X-N5", "1")])
        self.assertEqual(resp.status, 201, adv.short(resp))


if __name__ == "__main__":
    unittest.main()
