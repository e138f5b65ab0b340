#!/usr/bin/env python3
"""upstream.py - the scriptable fake payments API behind idemproxy's tests and demo.

Every request to a path outside /__* is an *execution*: it mints a charge id
(ch_1, ch_2, ... from one global counter), is counted (in memory and, with
--log, as one fsync'ed JSON line in the execution log) and is answered, by
default, with 201 and a JSON body describing what was received. Each entry also
records the framing it arrived with (every Content-Length value received, every
Transfer-Encoding value, the body's length) and the connection it came on (the
peer's port, and conn_seq: 1 for a connection's first request, 2 for the next
one on the same keep-alive connection...). Counting
happens as soon as the request has been read, before any delay or fault, so a
checker can count executions per Idempotency-Key after any crash of the proxy.

Faults are chosen by request headers, which the proxy forwards end to end:

  X-Test-Delay-Ms: N         sleep N ms before answering
  X-Test-Status: N           answer with status N (still an execution)
  X-Test-Response-Header: H  "Name: value", added to the response (repeatable)
  X-Test-Fault: hang             read the request, never answer
                close-before     close without answering
                reset            close with SO_LINGER 0 (the peer sees a RST)
                close-mid-body   Content-Length 100, send 10 bytes, close
                drip             send the response 1 byte per X-Test-Drip-Ms (1000)
                huge             body of X-Test-Size bytes (default 20 MiB): the
                                 16-byte pattern 0123456789abcdef repeated, or the
                                 16 bytes of X-Test-Pattern; with X-Test-Pause-Ms: N
                                 it stops for N ms half way through the body (an
                                 answer still arriving), with X-Test-Chunked: 1 it
                                 is sent chunked (64 KiB chunks) instead of with a
                                 Content-Length
                big-headers      X-Test-Size bytes (default 64 KiB) of extra
                                 response headers, 1 KiB each
                bad-framing      both Transfer-Encoding: chunked and Content-Length
                bad-status-line  an unparsable status line
                two-content-lengths  two different Content-Length values
                bad-chunk-size   chunked, with a chunk size that is not hex
                hop              hop-by-hop headers in a valid chunked response
                trailers         a chunked response with trailer fields that
                                 would clash with its headers
                leading-space    white space before the first field line
                odd-fields       field lines a proxy must repair: an obs-fold
                                 continuation, an empty value, white space
                                 before the colon
                echo-headers     body: the received request headers, in order,
                                 as a JSON list of [name, value]

With --idle-close-ms N the server plays an upstream whose keep-alive timer
fires just as a request arrives: a request that comes on a connection idle for
N ms or longer (since the previous answer) is closed unanswered and not
counted, as a server closing an idle connection never reads it. A proxy that
reuses connections idle that long loses every such race.

Control endpoints (never executions):
  GET  /__executions[?key=K][&detail=1]   counts (and, with detail, every entry)
  GET  /__rejected                         requests refused as malformed (never
                                           executions): {"count": N, "reasons": [...]}
  GET  /__idle_closed                      requests dropped by --idle-close-ms:
                                           {"count": N}
  POST /__reset                            clear the counts
  GET  /__health                           200

The HTTP/1.1 server is written on raw asyncio streams on purpose: the faults
need control of the socket that an HTTP library would hide. Python 3 standard
library only.
"""

import argparse
import asyncio
import datetime
import email.utils
import hashlib
import http
import json
import os
import signal
import socket
import struct
import sys
import time
import urllib.parse

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 256 * 1024 * 1024
HUGE_DEFAULT_BYTES = 20 * 1024 * 1024
HUGE_PATTERN = b"0123456789abcdef"


def huge_body(size, pattern=HUGE_PATTERN):
    """The body `huge` sends: pattern (HUGE_PATTERN, or X-Test-Pattern)
    repeated, cut at size bytes."""
    reps = size // len(pattern) + 1
    return (pattern * reps)[:size]


class BadRequest(Exception):
    def __init__(self, status, text):
        super().__init__(text)
        self.status = status


class Request:
    def __init__(self, method, target, version, headers):
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers  # [(name, value)] as received, latin-1 text
        self.body = b""
        self.conn_seq = 0  # 1 for the first request on its connection
        self.peer_port = None

    def header_all(self, name):
        name = name.lower()
        return [v for (n, v) in self.headers if n.lower() == name]

    def header(self, name):
        values = self.header_all(name)
        if not values:
            return None
        return ", ".join(values)

    def tokens(self, name):
        out = []
        for v in self.header_all(name):
            out.extend(t.strip().lower() for t in v.split(",") if t.strip())
        return out

    def keep_alive(self):
        conn = self.tokens("connection")
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


async def read_line(reader, limit):
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError:
        raise BadRequest(400, "line too long")
    if len(line) > limit:
        raise BadRequest(400, "line too long")
    return line[:-2]


async def read_request(reader, writer):
    """Reads one request; None on a clean EOF between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise BadRequest(400, "truncated request head")
    except asyncio.LimitOverrunError:
        raise BadRequest(431, "request header block too large")
    lines = head.lstrip(b"\r\n")[:-4].split(b"\r\n")
    try:
        method, target, version = lines[0].decode("latin-1").split(" ")
    except ValueError:
        raise BadRequest(400, "bad request line")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(400, "bad version")
    headers = []
    for raw in lines[1:]:
        if raw[:1] in (b" ", b"\t"):
            raise BadRequest(400, "obsolete line folding")
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "bad header line")
        headers.append((name, value.strip(" \t")))
    req = Request(method, target, version, headers)

    te = req.tokens("transfer-encoding")
    cls = req.header_all("content-length")
    if te and cls:
        raise BadRequest(400, "both Transfer-Encoding and Content-Length")
    if te and te != ["chunked"]:
        raise BadRequest(400, "unsupported transfer coding")
    if len(set(cls)) > 1:
        raise BadRequest(400, "conflicting Content-Length")
    if "100-continue" in req.tokens("expect") and version == "HTTP/1.1":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if te:
        req.body = await read_chunked(reader)
    elif cls:
        try:
            n = int(cls[0])
        except ValueError:
            raise BadRequest(400, "bad Content-Length")
        if n < 0 or n > MAX_BODY_BYTES:
            raise BadRequest(413, "body too large")
        req.body = await reader.readexactly(n)
    return req


async def read_chunked(reader):
    parts = []
    total = 0
    while True:
        line = await read_line(reader, 4096)
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadRequest(400, "bad chunk size")
        if size == 0:
            break
        total += size
        if total > MAX_BODY_BYTES:
            raise BadRequest(413, "body too large")
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise BadRequest(400, "bad chunk terminator")
    while await read_line(reader, MAX_HEADER_BYTES):  # trailer fields: ignored
        pass
    return b"".join(parts)


def reason(status):
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Status"


def response_head(status, headers):
    out = ["HTTP/1.1 %d %s\r\n" % (status, reason(status))]
    for name, value in headers:
        out.append("%s: %s\r\n" % (name, value))
    out.append("\r\n")
    return "".join(out).encode("latin-1")


def body_allowed(method, status):
    return method != "HEAD" and status >= 200 and status not in (204, 304)


class Upstream:
    def __init__(self, log_path, idle_close_ms=None):
        self.log_file = open(log_path, "a", encoding="utf-8") if log_path else None
        self.idle_close_ms = idle_close_ms
        self.idle_closed = 0
        self.charge_counter = 0
        self.total = 0
        self.by_key = {}
        self.entries = []
        self.connections = set()
        self.rejected = []  # reasons of the requests refused as malformed

    # -- executions --------------------------------------------------------

    async def record_execution(self, req):
        self.charge_counter += 1
        charge_id = "ch_%d" % self.charge_counter
        key = req.header("idempotency-key")
        entry = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "n": self.charge_counter,
            "key": key,
            "method": req.method,
            "path": req.target,
            "body_sha256": hashlib.sha256(req.body).hexdigest(),
            "charge_id": charge_id,
            "holder": req.header("x-test-holder"),
            "fault": req.header("x-test-fault"),
            "content_length": req.header_all("content-length"),
            "transfer_encoding": req.header_all("transfer-encoding"),
            "body_len": len(req.body),
            "conn_seq": req.conn_seq,
            "peer_port": req.peer_port,
        }
        self.total += 1
        if key is not None:
            self.by_key[key] = self.by_key.get(key, 0) + 1
        self.entries.append(entry)
        if self.log_file:
            # One line per execution, on disk before any answer: a checker
            # must be able to count executions after any fault. Lines are
            # appended in order here; the fsync runs off the event loop so a
            # slow disk delays this answer only, not every connection.
            self.log_file.write(json.dumps(entry, sort_keys=True) + "\n")
            self.log_file.flush()
            await asyncio.get_running_loop().run_in_executor(None, os.fsync,
                                                             self.log_file.fileno())
        return charge_id

    # -- dispatch ----------------------------------------------------------

    async def dispatch(self, req, reader, writer):
        """Answers one request; returns whether the connection stays open."""
        path = urllib.parse.urlsplit(req.target).path
        if path.startswith("/__"):
            return await self.control(req, path, writer)

        charge_id = await self.record_execution(req)
        keep = req.keep_alive()
        delay_ms = req.header("x-test-delay-ms")
        if delay_ms:
            await asyncio.sleep(int(delay_ms) / 1000.0)
        fault = (req.header("x-test-fault") or "").strip().lower()

        status = 201
        if req.header("x-test-status"):
            status = int(req.header("x-test-status"))
            if not 200 <= status <= 599:
                status = 201

        headers = [
            ("Date", email.utils.formatdate(usegmt=True)),
            ("Content-Type", "application/json"),
            ("X-Charge-Id", charge_id),
            ("Set-Cookie", "session=abc; Path=/"),
            ("X-Upstream", "demo"),
        ]
        for extra in req.header_all("x-test-response-header"):
            name, _, value = extra.partition(":")
            headers.append((name.strip(), value.strip()))

        if fault == "echo-headers":
            body = json.dumps([[n, v] for (n, v) in req.headers]).encode()
        else:
            body = json.dumps({
                "id": charge_id,
                "method": req.method,
                "path": req.target,
                "idempotency_key": req.header("idempotency-key"),
                "body_sha256": hashlib.sha256(req.body).hexdigest(),
                "tenant": req.header("x-tenant-id"),
            }).encode()

        if fault == "hang":
            # Never answer; hold the connection until the peer goes away.
            while await reader.read(65536):
                pass
            return False
        if fault == "close-before":
            return False
        if fault == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        if fault == "close-mid-body":
            writer.write(response_head(status, headers + [("Content-Length", "100")]))
            writer.write(b"0123456789")
            await writer.drain()
            return False
        if fault == "bad-framing":
            writer.write(response_head(status, headers + [
                ("Transfer-Encoding", "chunked"), ("Content-Length", "5")]))
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            await writer.drain()
            return False
        if fault == "two-content-lengths":
            writer.write(response_head(status, headers + [
                ("Content-Length", str(len(body) + 7)), ("Content-Length", str(len(body)))]))
            writer.write(body)
            await writer.drain()
            return False
        if fault == "bad-chunk-size":
            writer.write(response_head(status, headers + [("Transfer-Encoding", "chunked")]))
            writer.write(b"zz\r\n%s\r\n0\r\n\r\n" % body)
            await writer.drain()
            return False
        if fault == "bad-status-line":
            writer.write(b"HTTP/1.1 2x1 Cr\x01ated\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            return False
        if fault == "hop":
            # Valid HTTP that carries every kind of hop-by-hop header: the
            # proxy must drop them all (RFC 9110 section 7.6.1).
            hop = headers + [
                ("Connection", "close, X-Hop"),
                ("X-Hop", "must-not-pass"),
                ("Keep-Alive", "timeout=5"),
                ("Proxy-Authenticate", 'Basic realm="upstream"'),
                ("Proxy-Connection", "keep-alive"),
                ("Trailer", "X-Checksum"),
                ("Upgrade", "h2c"),
                ("Transfer-Encoding", "chunked"),
            ]
            writer.write(response_head(status, hop))
            half = len(body) // 2
            for part in (body[:half], body[half:]):
                if part:
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return False
        if fault == "trailers":
            # Trailer fields (RFC 9110 6.5) that, merged into the header
            # section, would add a second Content-Type, a cookie, change the
            # framing or name a real header as hop-by-hop.
            writer.write(response_head(status, headers + [("X-Request-Id", "r-1"),
                                                           ("Transfer-Encoding", "chunked")]))
            writer.write(b"%x\r\n%s\r\n0\r\n" % (len(body), body))
            writer.write(b"Content-Type: text/html\r\nSet-Cookie: trailer=1\r\n"
                         b"Connection: X-Request-Id\r\nContent-Length: 1\r\n"
                         b"X-Checksum: abc\r\n\r\n")
            await writer.drain()
            return False
        if fault == "leading-space":
            # White space before the first field line (RFC 9112 section 2.2:
            # reject, or drop the line). libcurl 7.88 took it for a
            # continuation of the previous transfer's last field, freed.
            head = response_head(status, headers + [("Content-Length", str(len(body)))])
            first = head.index(b"\r\n") + 2
            writer.write(head[:first] + b" X-Leading: space\r\n" + head[first:] + body)
            await writer.drain()
            return keep
        if fault == "odd-fields":
            head = response_head(status, headers + [("Content-Length", str(len(body)))])
            extra = (b"X-Folded: first-part\r\n \t second-part\r\n"
                     b"X-Empty:\r\nX-Space : spaced\r\n")
            writer.write(head[:-2] + extra + b"\r\n" + body)
            await writer.drain()
            return keep
        if fault == "big-headers":
            size = int(req.header("x-test-size") or 64 * 1024)
            for i in range(max(1, size // 1024)):
                headers.append(("X-Big-%d" % i, "b" * (1024 - len("X-Big-%d: \r\n" % i))))
        if fault == "huge":
            size = int(req.header("x-test-size") or HUGE_DEFAULT_BYTES)
            pause_ms = int(req.header("x-test-pause-ms") or 0)
            chunked = (req.header("x-test-chunked") or "").strip() == "1"
            headers[1] = ("Content-Type", "application/octet-stream")
            framing = ("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(size))
            writer.write(response_head(status, headers + [framing]))
            if req.method != "HEAD":
                pattern = (req.header("x-test-pattern") or "").encode("latin-1")
                chunk = huge_body(64 * 1024, pattern if len(pattern) == 16 else HUGE_PATTERN)
                sent = 0
                paused = pause_ms <= 0
                while sent < size:
                    if not paused and sent >= size // 2:
                        paused = True
                        await asyncio.sleep(pause_ms / 1000.0)
                    # Pieces of up to 64 KiB, one of them ending half way;
                    # each goes on where the pattern left off.
                    at = sent % 16
                    n = min(len(chunk) - at, size - sent)
                    if not paused:
                        n = min(n, size // 2 - sent)
                    piece = chunk[at:at + n]
                    writer.write(b"%x\r\n%s\r\n" % (n, piece) if chunked else piece)
                    sent += n
                    await writer.drain()
                if chunked:
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
            return keep

        if not body_allowed(req.method, status):
            if status == 204:
                data = response_head(status, headers)
            else:
                data = response_head(status, headers + [("Content-Length", str(len(body)))])
        else:
            data = response_head(status, headers + [("Content-Length", str(len(body)))]) + body
        if not keep:
            data = data.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
        if fault == "drip":
            interval = int(req.header("x-test-drip-ms") or 1000) / 1000.0
            for i in range(len(data)):
                writer.write(data[i:i + 1])
                await writer.drain()
                if i + 1 < len(data):
                    await asyncio.sleep(interval)
            return keep
        writer.write(data)
        await writer.drain()
        return keep

    async def control(self, req, path, writer):
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(req.target).query)
        status, doc = 200, None
        if path == "/__executions" and req.method == "GET":
            if "key" in query:
                key = query["key"][0]
                doc = {"key": key, "count": self.by_key.get(key, 0)}
            else:
                doc = {"total": self.total, "by_key": self.by_key}
            if query.get("detail", ["0"])[0] not in ("0", ""):
                doc["executions"] = self.entries
        elif path == "/__reset" and req.method == "POST":
            self.total = 0
            self.by_key = {}
            self.entries = []
            doc = {"ok": True}
        elif path == "/__rejected" and req.method == "GET":
            doc = {"count": len(self.rejected), "reasons": self.rejected}
        elif path == "/__idle_closed" and req.method == "GET":
            doc = {"count": self.idle_closed}
        elif path == "/__health" and req.method in ("GET", "HEAD"):
            doc = {"ok": True}
        else:
            status, doc = 404, {"error": "no such control endpoint"}
        body = json.dumps(doc).encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        keep = req.keep_alive()
        if not keep:
            headers.append(("Connection", "close"))
        writer.write(response_head(status, headers) + (body if req.method != "HEAD" else b""))
        await writer.drain()
        return keep

    # -- connections -------------------------------------------------------

    async def handle(self, reader, writer):
        task = asyncio.current_task()
        self.connections.add(task)
        peer = writer.get_extra_info("peername")
        seq = 0
        answered_at = None  # monotonic time of the previous answer's end
        try:
            while True:
                try:
                    req = await read_request(reader, writer)
                except BadRequest as e:
                    self.rejected.append("%d %s" % (e.status, e))
                    body = (str(e) + "\n").encode()
                    writer.write(response_head(e.status, [
                        ("Content-Type", "text/plain"), ("Content-Length", str(len(body))),
                        ("Connection", "close")]) + body)
                    await writer.drain()
                    break
                if req is None:
                    break
                if (self.idle_close_ms is not None and answered_at is not None and
                        (time.monotonic() - answered_at) * 1000 >= self.idle_close_ms):
                    self.idle_closed += 1
                    break
                seq += 1
                req.conn_seq = seq
                req.peer_port = peer[1] if peer else None
                if not await self.dispatch(req, reader, writer):
                    break
                answered_at = time.monotonic()
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self.connections.discard(task)
            try:
                writer.close()
            except Exception:
                pass


def parse_listen(text):
    host, sep, port = text.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError("expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


async def main_async(args):
    up = Upstream(args.log, args.idle_close_ms)
    host, port = args.listen
    server = await asyncio.start_server(up.handle, host, port, limit=MAX_HEADER_BYTES,
                                        backlog=1024, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d\n" % bound)
        os.replace(tmp, args.port_file)
    print("upstream listening on %s:%d" % (host, bound), file=sys.stderr, flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    for task in list(up.connections):
        task.cancel()
    await asyncio.sleep(0)
    await server.wait_closed()
    if up.log_file:
        up.log_file.close()


def main():
    p = argparse.ArgumentParser(description="Fake payments API for idemproxy tests and demos.")
    p.add_argument("--listen", type=parse_listen, required=True, help="HOST:PORT (port 0: any)")
    p.add_argument("--log", help="append one JSON line per execution (fsync'ed)")
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument("--idle-close-ms", type=int, metavar="N",
                   help="drop, unanswered, a request on a connection idle N ms or longer")
    args = p.parse_args()
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
