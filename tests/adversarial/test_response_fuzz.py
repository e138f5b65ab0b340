#!/usr/bin/env python3
"""Response-side fuzzer: random upstream answers through the real binary.

fuzz_upstream (libFuzzer) checks the native client's parser in process. This
test drives the whole path, with either client (`upstream.client` native or
libcurl): a raw-socket upstream in this file answers each request with bytes
chosen at random for its case, on kept-alive connections, sent whole or cut at
random places. Each case is one key, sent twice:

  * a valid answer (status 200-599 with 1xx interim answers before it or not;
    Content-Length, chunked with extensions and trailers, or read until close;
    204/304 without a body; random end-to-end fields): the client gets that
    status, that body and the case's X-R field. Below 500 the record is
    completed: the second request is a replay (Idempotent-Replayed: true,
    same status, same body, same X-R) and the upstream ran the case once. A
    5xx releases the key: the second request runs again;
  * an answer the RFC forbids (two Content-Lengths, Content-Length with
    Transfer-Encoding, a transfer coding other than one chunked, a folded
    Content-Length or Transfer-Encoding, a bad chunk size, a bad status line, a NUL or a bare LF
    in the head, a body cut short): 502 and the key released, so the second
    request runs again (on the quarter of the keys whose route has
    on_unknown "complete": that 502 stored and replayed, run once); the
    connection is never reused (a reused one would answer a later case with
    these bytes);
  * a valid answer with 1-4 random byte edits after its Connection: close
    line: what it means is unknown, so only this holds: if the first answer
    was stored (a replay follows), the replay is byte for byte the first
    answer, and the upstream ran it once;
  * a valid answer with byte edits anywhere (status lines and interim answers
    too), through a second proxy of their own: it must stay up.

Over the run: every case's answers are its own (no answer of another case
ever reaches a client: each body starts with its case's random tag), and the
proxy stays up.

ADV_FUZZ_SEED=N replays a run; ADV_FUZZ_CASES=N sets the number of keys
(default 300, 2,000 with ADV_LONG=1); ADV_FUZZ_RANGE=LO:HI sends only those
cases and ADV_FUZZ_WORKERS=N sets how many run at once (default 6).
"""

import os
import random
import socket
import threading
import time
import unittest

import adv
from adv import harness

TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
REASONS = [b"OK", b"Created", b"", b"Whatever it is", b"Teapot \xe9"]
# RFC 9112 lets a recipient refuse these or make sense of them (a bare LF
# as a line end, a NUL replaced, a line without a colon dropped, Content-Length
# with Transfer-Encoding read as chunked): a 502, or the answer as sent.
EITHER = ("cl-te", "nul-in-head", "bare-lf", "no-colon", "bad-status-sp")
VALID_STATUSES = [200, 200, 201, 201, 201, 202, 203, 204, 206, 226, 299, 301, 304, 400, 404,
                  409, 422, 429, 451, 499, 500, 502, 503, 504, 599]


def chunked(rng, body, trailers=b""):
    out, i = [], 0
    while i < len(body):
        n = min(len(body) - i, rng.randrange(1, 200))
        ext = rng.choice([b"", b"", b";a=1", b';q="x y"'])
        size = (b"%x" if rng.random() < 0.5 else b"%X") % n
        out.append(b"0" * rng.randrange(0, 3) + size + ext + b"\r\n" + body[i:i + n] + b"\r\n")
        i += n
    out.append(b"0\r\n" + trailers + b"\r\n")
    return b"".join(out)


class Recipe:
    """What the upstream sends for one case, and what the proxy must do."""

    def __init__(self, case, rng):
        self.case = case
        self.xr = "xr-%d-%s" % (case, "".join(rng.choice(TOKEN) for _ in range(8)))
        # Every body starts with this: another case's tag in an answer means
        # the answer crossed over (an edit cannot make one up).
        self.tag = b"case-%d-%s:" % (case, "".join(
            rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(10)).encode())
        self.kind = rng.choices(["valid", "invalid", "havoc", "wild"], weights=[60, 25, 10, 5])[0]
        self.status = rng.choice(VALID_STATUSES)
        if self.status in (204, 304):
            self.body = b""
        else:
            self.body = self.tag + bytes(rng.randrange(256) for _ in range(
                rng.choice([0, 1, 10, 100, 1000, 5000, 40000])))
        self.framing = rng.choice(["cl", "chunked", "close"])
        # Invalid and edited answers end their connection (Connection: close
        # in the head, then the upstream closes), as valid ones sometimes do.
        self.close_after = self.framing == "close" or self.kind != "valid" or rng.random() < 0.1
        head = [b"HTTP/1.1 %d %s" % (self.status, rng.choice(REASONS)),
                b"X-R: " + self.xr.encode()]
        for _ in range(rng.randrange(0, 6)):
            name = "X-F-" + "".join(rng.choice(TOKEN) for _ in range(rng.randrange(1, 10)))
            value = bytes(rng.choice(b"abc xyz;=,/\"\t\x80\xff") for _ in range(rng.randrange(0, 30)))
            head.append(name.encode() + b":" + rng.choice([b"", b" ", b"  "]) + value.strip(b" \t"))
        if rng.random() < 0.3:
            head.append(b"Content-Type: " + rng.choice([b"application/json", b"text/plain"]))
        if self.close_after:
            # Right after the status line, and never edited (below): an
            # answer that ends its connection must say so, or the proxy may
            # rightly pool the connection and lose the race with its close.
            head.insert(1, b"Connection: close")
        interim = b""
        if rng.random() < 0.1:
            interim = rng.choice([b"HTTP/1.1 100 Continue\r\n\r\n",
                                  b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"])
        body = self.body
        if self.status in (204, 304):
            wire = b""
            if self.framing == "cl" and self.status == 204 and rng.random() < 0.5:
                head.append(b"Content-Length: 0")
        elif self.framing == "cl":
            head.append(b"Content-Length: %d" % len(body))
            wire = body
        elif self.framing == "chunked":
            head.append(b"Transfer-Encoding: chunked")
            wire = chunked(rng, body, rng.choice([b"", b"", b"X-Trailer: 1\r\n"]))
        else:
            wire = body
        self.invalid_why = None
        if self.kind == "invalid":
            why = rng.choice(["two-cl", "cl-te", "bad-chunk", "bad-status", "nul-in-head",
                              "bare-lf", "cut-short", "no-colon", "bad-status-sp", "te-coding",
                              "folded-framing"])
            self.invalid_why = why
            self.close_after = True
            if self.status in (204, 304) or self.framing == "close":
                # Give these a framed body so each fault has something to break.
                self.status = 201
                head[0] = b"HTTP/1.1 201 Created"
                self.body = self.tag + b"x"
                head = [h for h in head if not h.lower().startswith(b"content-length")]
                head.append(b"Content-Length: %d" % len(self.body))
                wire = self.body
                self.framing = "cl"
            if why == "two-cl":
                head = [h for h in head if not h.lower().startswith((b"content-length",
                                                                     b"transfer-encoding"))]
                head += [b"Content-Length: %d" % len(self.body),
                         b"Content-Length: %d" % (len(self.body) + 1)]
                wire = self.body + b"!"
            elif why == "cl-te":
                head = [h for h in head if not h.lower().startswith((b"content-length",
                                                                     b"transfer-encoding"))]
                wire = chunked(rng, self.body)
                head += [b"Transfer-Encoding: chunked", b"Content-Length: %d" % len(wire)]
            elif why == "bad-chunk":
                head = [h for h in head if not h.lower().startswith((b"content-length",
                                                                     b"transfer-encoding"))]
                head.append(b"Transfer-Encoding: chunked")
                wire = b"zz\r\n" + self.body + b"\r\n0\r\n\r\n"
            elif why == "bad-status":
                head[0] = rng.choice([b"HTTP/1.1 2000 OK", b"HTTP/1.1 20 OK", b"HTTX/1.1 201 OK",
                                      b"HTTP/1.1 -01 OK", b"HTTP/1.1 2O1 OK"])
            elif why == "bad-status-sp":
                head[0] = b"HTTP/1.1 201"
                self.status = 201
            elif why == "nul-in-head":
                head.append(b"X-Nul: a\x00b")
            elif why == "bare-lf":
                head[1] = head[1] + b"\nX-After-Lf: 1"
            elif why == "cut-short":
                head = [h for h in head if not h.lower().startswith((b"content-length",
                                                                     b"transfer-encoding"))]
                head.append(b"Content-Length: %d" % (len(self.body) + 10))
                wire = self.body
            elif why == "no-colon":
                head.append(b"X-No-Colon")
            elif why == "te-coding":
                # A coding the proxy cannot undo (it drops the field, hop by
                # hop): the body as framed is not the answer's body.
                head = [h for h in head if not h.lower().startswith((b"content-length",
                                                                     b"transfer-encoding"))]
                head.append(rng.choice([b"Transfer-Encoding: gzip, chunked",
                                        b"Transfer-Encoding: chunked, chunked",
                                        b"Transfer-Encoding: x-custom, chunked"]))
                wire = chunked(rng, self.body)
            elif why == "folded-framing":
                # obs-fold: the folded value is the field's (RFC 9112 5.2),
                # so a reader framing on the first line alone is wrong.
                head = [h for h in head if not h.lower().startswith((b"content-length",
                                                                     b"transfer-encoding"))]
                if rng.random() < 0.5:
                    head += [b"Transfer-Encoding: chunked", rng.choice([b" , gzip", b"\tgzip"])]
                    wire = chunked(rng, self.body)
                else:
                    head += [b"Content-Length: %d" % len(self.body), b" %d" % len(self.body)]
                    wire = self.body
        self.bytes = interim + b"\r\n".join(head) + b"\r\n\r\n" + wire
        if self.kind in ("havoc", "wild"):
            data = bytearray(self.bytes)
            # Edits start after the final answer's "Connection: close" line:
            # one before it (a blank line in the status line, say) could make
            # an answer without it that the proxy rightly pools, and then
            # loses the race with the upstream's close.
            start = self.bytes.rfind(b"\r\nConnection: close\r\n") + 21
            if self.kind == "wild":
                # Anywhere, status lines and interim answers included. Such an
                # answer may lose its "Connection: close"; the proxy then
                # rightly pools a connection the upstream closes, and the
                # next request on it fails. So these keys go through a proxy
                # of their own, and only its survival is checked.
                start = 0
            for _ in range(rng.randrange(1, 5)):
                if len(data) <= start:
                    break
                at = start + rng.randrange(len(data) - start)
                op = rng.randrange(3)
                if op == 0:
                    data[at] = rng.randrange(256)
                elif op == 1:
                    data[at:at] = rng.choice([b"\r", b"\n", b"\x00", b" ", b":", b"\r\n",
                                              b"0", b"\r\n\r\n"])
                else:
                    del data[at:at + rng.randrange(1, 4)]
            self.bytes = bytes(data)
        self.cuts = sorted(rng.sample(range(1, len(self.bytes)), min(
            len(self.bytes) - 1, rng.randrange(1, 6)))) if rng.random() < 0.4 else []


class RawUpstream:
    """HTTP/1.1 on raw sockets: reads requests (Content-Length bodies, as the
    proxy sends them) and answers each with its case's recipe bytes."""

    def __init__(self, recipes):
        self.recipes = recipes
        self.runs = {}
        self.lock = threading.Lock()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.stopping = False
        threading.Thread(target=self.accept_loop, daemon=True).start()

    def stop(self):
        self.stopping = True
        try:
            self.sock.close()
        except OSError:
            pass

    def accept_loop(self):
        while not self.stopping:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c):
        buf = b""
        c.settimeout(30)
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = c.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                target = lines[0].split(b" ")[1].decode()
                length = 0
                for line in lines[1:]:
                    n, _, v = line.partition(b":")
                    if n.strip().lower() == b"content-length":
                        length = int(v.strip())
                while len(buf) < length:
                    data = c.recv(65536)
                    if not data:
                        return
                    buf += data
                buf = buf[length:]
                case = int(target.rsplit("/", 1)[1])
                r = self.recipes[case]
                with self.lock:
                    self.runs[case] = self.runs.get(case, 0) + 1
                last = 0
                for cut in r.cuts:
                    c.sendall(r.bytes[last:cut])
                    last = cut
                    time.sleep(0.001)
                c.sendall(r.bytes[last:])
                if r.close_after:
                    c.shutdown(socket.SHUT_WR)
                    return
        except (OSError, ValueError, IndexError):
            return
        finally:
            c.close()


class ResponseFuzz(adv.AdversarialCase):
    def test_random_answers(self):
        seed = int(os.environ.get("ADV_FUZZ_SEED") or random.SystemRandom().randrange(1 << 31))
        n_cases = int(os.environ.get("ADV_FUZZ_CASES") or adv.scale(short=300, long=2000))
        rng = random.Random(seed)
        recipes = [Recipe(i, rng) for i in range(n_cases)]
        up = RawUpstream(recipes)
        self.addCleanup(up.stop)
        # A quarter of the keys go to a route with on_unknown "complete": an
        # answer that cannot be taken is then stored as the key's 502.
        routes = [self.route(path="/v1/payments"),
                  self.route(path="/v1/charges", scope="charges", on_unknown="complete")]
        cfg = self.config(routes=routes, upstream_url="http://127.0.0.1:%d" % up.port,
                          timeout="5s")
        proxy = self.start_proxy(config=cfg)
        wild_proxy = self.start_proxy(config=cfg)
        started = time.monotonic()

        def complete(case):
            return case % 4 == 3

        def one(case):
            key = "rf-%d-%d" % (seed, case)
            path = "/v1/%s/%d" % ("charges" if complete(case) else "payments", case)
            out = []
            for _ in range(2):
                try:
                    port = (wild_proxy if recipes[case].kind == "wild" else proxy).port
                    out.append(harness.request(port, "POST", path,
                                               [("Idempotency-Key", key),
                                                ("Content-Type", "application/json")],
                                               b'{"case":%d}' % case, timeout=15))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return out

        # ADV_FUZZ_RANGE=LO:HI sends only those cases (the seed's recipes
        # stay the same): to narrow a failure down.
        lo, _, hi = (os.environ.get("ADV_FUZZ_RANGE") or "0:%d" % n_cases).partition(":")
        picked = range(int(lo), min(int(hi), n_cases))
        recipes = [recipes[i] for i in picked]
        results = adv.parallel(one, list(picked), workers=int(os.environ.get("ADV_FUZZ_WORKERS")
                                                                 or 6))
        failures = []
        tags = {r.tag: r.case for r in recipes}
        counts = {"valid": 0, "invalid": 0, "havoc": 0, "wild": 0, "stored": 0, "released": 0}
        for r, res in zip(recipes, results):
            runs = up.runs.get(r.case, 0)
            where = "case %d (seed %d, %s%s, status %d, %s, %d body bytes, cuts %s): %r" % (
                r.case, seed, r.kind, "/" + r.invalid_why if r.invalid_why else "", r.status,
                r.framing, len(r.body), r.cuts, r.bytes[:160])
            if isinstance(res, Exception):
                failures.append("%s: %r" % (where, res))
                continue
            counts[r.kind] += 1
            if r.kind == "wild":
                continue
            first, second = res
            if not isinstance(first, harness.Response) or not isinstance(second, harness.Response):
                failures.append("no answer: %s %s: %s" % (adv.short(first), adv.short(second),
                                                          where))
                continue
            for resp in (first, second):
                other = tags.get(resp.body[:resp.body.find(b":") + 1])
                if other is not None and other != r.case:
                    failures.append("CASE %d'S ANSWER: %s: %s" % (other, adv.short(resp), where))
            replayed = second.header("Idempotent-Replayed") == "true"
            counts["stored" if replayed else "released"] += 1
            if r.kind == "valid":
                for resp in (first, second):
                    if resp.status != r.status or resp.body != r.body or \
                            resp.header("X-R") != r.xr:
                        failures.append("answer not the upstream's: %s (X-R %r): %s" % (
                            adv.short(resp), resp.header("X-R"), where))
                        break
                want_runs = 2 if r.status >= 500 else 1
                if runs != want_runs or replayed != (r.status < 500):
                    failures.append("ran %d times, replayed=%s (want %d, %s): %s" % (
                        runs, replayed, want_runs, r.status < 500, where))
            elif r.kind == "invalid" and r.invalid_why in EITHER:
                # Refused (502: released, or stored under "complete"), or
                # taken as sent.
                if first.status == 502 and adv.is_problem(first):
                    if complete(r.case):
                        if not replayed or runs != 1 or second.body != first.body:
                            failures.append("refused, not stored under on_unknown complete "
                                            "(ran %d, replayed=%s): %s" % (runs, replayed, where))
                    elif replayed or runs != 2:
                        failures.append("refused but stored (ran %d times, replayed=%s): %s"
                                        % (runs, replayed, where))
                elif (first.status, first.body, first.header("X-R")) != (r.status, r.body, r.xr):
                    failures.append("neither refused nor passed on as sent: %s: %s" % (
                        adv.short(first), where))
                elif r.status < 500 and (not replayed or runs != 1 or (
                        second.status, second.body) != (r.status, r.body)):
                    failures.append("passed on but not stored (ran %d, replayed=%s): %s" % (
                        runs, replayed, where))
            elif r.kind == "invalid":
                if first.status != 502 or not adv.is_problem(first):
                    failures.append("a forbidden answer passed on: %s: %s" % (adv.short(first),
                                                                             where))
                if complete(r.case):
                    if not replayed or runs != 1 or (second.status, second.body) != (
                            first.status, first.body):
                        failures.append("on_unknown complete: the 502 not stored (ran %d "
                                        "times, replayed=%s): %s" % (runs, replayed, where))
                elif replayed or runs != 2:
                    failures.append("a forbidden answer stored (ran %d times, replayed=%s): %s"
                                    % (runs, replayed, where))
            else:
                if replayed:
                    if (second.status, second.body, second.header("X-R")) != (
                            first.status, first.body, first.header("X-R")):
                        failures.append("replay differs from the first answer: %s vs %s: %s" % (
                            adv.short(first), adv.short(second), where))
                    if runs != 1:
                        failures.append("stored, but ran %d times: %s" % (runs, where))
        self.assertTrue(proxy.running(), "the proxy died (seed %d)" % seed)
        self.assertTrue(wild_proxy.running(), "the proxy of the wild answers died (seed %d)"
                        % seed)
        self.summary("response-fuzz",
                     "seed %d, client %s: %d keys (%d valid, %d forbidden, %d edited answers, "
                     "%d edited anywhere); %d stored and replayed, %d released; %d failures; "
                     "%.1fs",
                     seed, os.environ.get("IDEMPROXY_UPSTREAM_CLIENT") or "native", n_cases,
                     counts["valid"], counts["invalid"], counts["havoc"], counts["wild"],
                     counts["stored"],
                     counts["released"], len(failures), time.monotonic() - started)
        self.assertEqual(failures, [], "\n".join(failures[:30]))


if __name__ == "__main__":
    unittest.main()
