"""harness.py - runs the real idemproxy binary against tests/upstream/upstream.py.

Every test gets its own temporary directory, its own upstream on a port the
upstream chose itself (--port-file, no race) and its own proxy processes on
free ports, so ctest can run the scenario files in parallel.

    class MyScenario(harness.ProxyTestCase):
        def test_something(self):
            proxy = self.start_proxy()          # default config, one route
            r = self.post(proxy, "key-1")       # raw-socket HTTP request
            self.assertEqual(r.status, 201)
            self.assertEqual(self.upstream.count("key-1"), 1)

At teardown every proxy still running gets SIGTERM and must exit 0. The
binary is $IDEMPROXY_BIN or <repo>/build/idemproxy; a missing binary is a
test error, never a skip. The temporary directory (configs, stdout access
logs, stderr, the upstream's execution log, the store) is kept when a test
fails, and the logs' tails are printed; IDEMPROXY_E2E_KEEP=1 keeps it always.
"""

import atexit
import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
UPSTREAM_PY = os.path.join(REPO, "tests", "upstream", "upstream.py")

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 15.0

# Hop-by-hop headers (RFC 9110 section 7.6.1, CONTRACT.md section 3).
HOP_BY_HOP = ("connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade")


def binary():
    path = os.environ.get("IDEMPROXY_BIN") or os.path.join(REPO, "build", "idemproxy")
    if not os.access(path, os.X_OK):
        raise RuntimeError("idemproxy binary not found at %s (set IDEMPROXY_BIN)" % path)
    return path


_ports_lock = threading.Lock()
_ports_given = set()  # every port free_port() returned in this process


def free_port():
    """A port nobody listens on right now and that this process has not
    handed out before. Another test process may still take it first (the
    proxy then refuses to start and Proxy retries); two proxies of this
    process on the same store would not refuse: idemproxy lets processes of
    one store share a listen port (SO_REUSEPORT), so two threads starting
    proxies at once could both get the port the kernel just freed and split
    each other's requests."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _ports_lock:
            if port not in _ports_given:
                _ports_given.add(port)
                return port


def huge_body(n, pattern=b"0123456789abcdef"):
    """The body the upstream's `huge` fault sends for X-Test-Size: n (and
    X-Test-Pattern: pattern, 16 bytes)."""
    return (pattern * (n // len(pattern) + 1))[:n]


_closed = []


def closed_port():
    """A port on which connections are refused, and stay refused: a socket
    of this process stays bound to it without listening (a connection gets
    a reset), so no other test process can take it meanwhile."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    if not _closed:
        atexit.register(lambda: [c.close() for c in _closed])
    _closed.append(s)
    return s.getsockname()[1]


# ---------------------------------------------------------------------------
# Raw HTTP/1.1 over a socket: exact control of what is sent, and a parser that
# keeps the response headers as a list (duplicates and order preserved).
# ---------------------------------------------------------------------------

class Response:
    def __init__(self, version, status, reason, headers, body):
        self.version = version
        self.status = status
        self.reason = reason
        self.headers = headers  # [(name, value)] in order, as received
        self.body = body

    def header_all(self, name):
        name = name.lower()
        return [v for (n, v) in self.headers if n.lower() == name]

    def header(self, name):
        values = self.header_all(name)
        return values[0] if values else None

    def has(self, name):
        return bool(self.header_all(name))

    def json(self):
        return json.loads(self.body.decode("utf-8"))

    @property
    def replayed(self):
        return (self.header("Idempotent-Replayed") or "").strip().lower() == "true"

    @property
    def charge_id(self):
        return self.header("X-Charge-Id")

    def __repr__(self):
        return "<Response %d %r headers=%r body=%r>" % (
            self.status, self.reason, self.headers, self.body[:300])


class ConnectionClosed(Exception):
    pass


def build_request(method, path, headers=(), body=b"", chunked=False, host=None,
                  add_length=True, version="HTTP/1.1"):
    """The bytes of one request. Host and Content-Length are added unless the
    caller sends them (or add_length=False); chunked=True sends body chunked."""
    if isinstance(body, str):
        body = body.encode()
    headers = list(headers)
    names = [n.lower() for (n, _) in headers]
    if "host" not in names and host is not None:
        headers.insert(0, ("Host", host))
    if chunked:
        if "transfer-encoding" not in names:
            headers.append(("Transfer-Encoding", "chunked"))
    elif add_length and "content-length" not in names and (body or method in ("POST", "PUT", "PATCH")):
        headers.append(("Content-Length", str(len(body))))
    out = ["%s %s %s\r\n" % (method, path, version)]
    for n, v in headers:
        out.append("%s: %s\r\n" % (n, v))
    out.append("\r\n")
    data = "".join(out).encode("latin-1")
    if chunked:
        step = 7
        for i in range(0, len(body), step):
            part = body[i:i + step]
            data += b"%x\r\n%s\r\n" % (len(part), part)
        data += b"0\r\n\r\n"
    else:
        data += body
    return data


class Conn:
    """One client connection; several requests may be sent on it (keep-alive)."""

    def __init__(self, port, host="127.0.0.1", timeout=15.0, source=None):
        """source: the client's address (e.g. "127.0.0.2", another loopback
        address), for per-address limits; None: the kernel's choice."""
        self.port = port
        self.host = host
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        self.sock.settimeout(timeout)
        self.buf = b""

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, data):
        self.sock.sendall(data)

    def _fill(self):
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionClosed("connection closed by peer")
        self.buf += chunk

    def _until(self, sep, limit=1 << 22):
        while True:
            i = self.buf.find(sep)
            if i >= 0:
                out, self.buf = self.buf[:i], self.buf[i + len(sep):]
                return out
            if len(self.buf) > limit:
                raise ValueError("no %r within %d bytes" % (sep, limit))
            self._fill()

    def _exact(self, n):
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _rest(self):
        while True:
            try:
                self._fill()
            except ConnectionClosed:
                out, self.buf = self.buf, b""
                return out

    def read_response(self, method="POST"):
        """Reads one final response (1xx interim responses are skipped)."""
        while True:
            head = self._until(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code, _, reason = rest.partition(" ")
            status = int(code)
            headers = []
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers.append((name, value.strip(" \t")))
            if 100 <= status < 200:
                continue
            break
        resp = Response(version, status, reason, headers, b"")
        te = [t.strip().lower() for v in resp.header_all("Transfer-Encoding") for t in v.split(",")]
        if method == "HEAD" or status in (204, 304):
            return resp
        if "chunked" in te:
            parts = []
            while True:
                size = int(self._until(b"\r\n").split(b";")[0].strip(), 16)
                if size == 0:
                    while self._until(b"\r\n"):
                        pass
                    break
                parts.append(self._exact(size))
                self._exact(2)
            resp.body = b"".join(parts)
        elif resp.has("Content-Length"):
            resp.body = self._exact(int(resp.header("Content-Length")))
        else:
            resp.body = self._rest()
        return resp

    def request(self, method, path, headers=(), body=b"", chunked=False, **kw):
        data = build_request(method, path, headers, body, chunked=chunked,
                             host="%s:%d" % (self.host, self.port), **kw)
        try:
            self.send(data)
        except (BrokenPipeError, ConnectionResetError):
            # The server may answer (413, 400...) and close before reading
            # everything; its answer is still in our receive buffer.
            pass
        return self.read_response(method)

    def drain_until_closed(self, timeout=3.0):
        """Reads whatever arrives until the peer closes; returns (closed,
        bytes received) - closed is False when timeout passed first."""
        extra, self.buf = self.buf, b""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True, extra
                extra += data
        except socket.timeout:
            return False, extra
        except (ConnectionResetError, ConnectionAbortedError):
            return True, extra

    def is_closed(self, timeout=3.0):
        """True when the peer closes (or resets) the connection within timeout
        and sends nothing more."""
        self.sock.settimeout(timeout)
        if self.buf:
            return False
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return False
        except (ConnectionResetError, ConnectionAbortedError):
            return True
        if data:
            self.buf += data
            return False
        return True


def request(port, method, path, headers=(), body=b"", chunked=False, timeout=15.0,
            host="127.0.0.1", **kw):
    """One request on a fresh connection."""
    with Conn(port, host=host, timeout=timeout) as c:
        return c.request(method, path, headers, body, chunked=chunked, **kw)


def slow_post(proxy, key, headers=(), timeout=30, body=None,
              content_type="application/json"):
    """Sends a keyed POST on a connection with a small receive buffer that
    reads nothing yet: a large answer stays in the proxy until
    read_slow_post() takes it. Returns the socket."""
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    c.settimeout(timeout)
    c.connect(("127.0.0.1", proxy.port))
    c.sendall(build_request(
        "POST", "/v1/payments",
        [("Host", "x"), ("Content-Type", content_type), ("Idempotency-Key", key)]
        + list(headers), PAYMENT_BODY if body is None else body))
    return c


def read_slow_post(proxy, c):
    """The response to slow_post()'s request; closes the socket."""
    conn = Conn.__new__(Conn)
    conn.sock, conn.buf, conn.port, conn.host = c, b"", proxy.port, "127.0.0.1"
    try:
        return conn.read_response()
    finally:
        c.close()


def raw_exchange(port, data, timeout=10.0):
    """Sends raw bytes; returns (response or None, closed_afterwards, extra):
    extra is whatever the server sent after the first response before
    closing (a correct server sends nothing more)."""
    with Conn(port, timeout=timeout) as c:
        try:
            c.send(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            resp = c.read_response()
        except (ConnectionClosed, ConnectionResetError):
            return None, True, b""
        return (resp,) + c.drain_until_closed()


def sockets(pid):
    """The open sockets of process pid (listeners, client and upstream
    connections), from /proc."""
    n = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            if os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def forget_boot(path):
    """Rewrites the store's remembered boot id (meta "lease_epoch") to one that
    is not this boot's, with LMDB's own mdb_dump/mdb_load while no process has
    the store open: to the store, the host has booted since."""
    # The hex format: LMDB 0.9.24's printable one (-p) does not escape a
    # backslash, so a value holding one (the 32 random bytes of "log_salt")
    # does not load back as it was.
    dump = subprocess.run(["mdb_dump", "-s", "meta", path], capture_output=True,
                          check=True, timeout=10).stdout.decode()
    other, n = re.subn(r"(?m)^( %s\n) [0-9a-f]{72}$" % b"lease_epoch".hex(),
                       r"\1 " + b"00000000-0000-0000-0000-000000000000".hex(), dump)
    assert n == 1, dump
    subprocess.run(["mdb_load", "-s", "meta", path], input=other.encode(),
                   capture_output=True, check=True, timeout=10)


def record_key(scope, key):
    """The store's key for (scope, key), 32 bytes: SHA-256 over the
    length-prefixed scope and key (store_key_derive). Routes without
    scope_header only (with one, the scope is the route's, a NUL and the
    hex SHA-256 of the header's value)."""
    s = scope.encode() if isinstance(scope, str) else scope
    k = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(struct.pack(">Q", len(s)) + s + struct.pack(">Q", len(k)) + k).digest()


def log_salt(store_path):
    """The store's log salt (meta "log_salt", 32 bytes), read with mdb_dump
    beside running proxies; None when the store has none."""
    out = subprocess.run(["mdb_dump", "-s", "meta", store_path], capture_output=True,
                         check=True, timeout=10).stdout.decode()
    lines = out.split("HEADER=END\n", 1)[1].splitlines()
    for name, value in zip(lines[0::2], lines[1::2]):
        if name.strip() == b"log_salt".hex():
            return bytes.fromhex(value.strip())
    return None


def log_key(store_path, scope, key, salt=None):
    """The access log's "key" for (scope, key): the first 8 hex digits of
    SHA-256(the store's log salt, the record key) (idem_key_loghash)."""
    salt = log_salt(store_path) if salt is None else salt
    return hashlib.sha256(salt + record_key(scope, key)).hexdigest()[:8]


def wait_for(predicate, timeout=5.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(interval)


def in_thread(fn, *args, **kwargs):
    """Runs fn in a thread; returns a concurrent.futures.Future."""
    fut = concurrent.futures.Future()

    def run():
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return fut


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------

class Upstream:
    """tests/upstream/upstream.py in a child process."""

    def __init__(self, workdir, name="upstream", host="127.0.0.1", port=0, args=()):
        self.workdir = workdir
        self.args = list(args)  # more upstream.py options
        self.host = host  # "::1" for an IPv6 upstream
        self.want_port = port  # 0: any free port
        self.port_file = os.path.join(workdir, name + ".port")
        self.log_path = os.path.join(workdir, name + ".executions.jsonl")
        self.stderr_path = os.path.join(workdir, name + ".stderr")
        self.proc = None
        self.port = None

    @property
    def url(self):
        if ":" in self.host:
            return "http://[%s]:%d" % (self.host, self.port)
        return "http://%s:%d" % (self.host, self.port)

    def start(self):
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, UPSTREAM_PY, "--listen",
                 ("[%s]:%d" if ":" in self.host else "%s:%d") % (self.host, self.want_port),
                 "--port-file", self.port_file, "--log", self.log_path] + self.args,
                stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("upstream did not start: " + open(self.stderr_path).read())
            time.sleep(0.01)
        with open(self.port_file) as f:
            self.port = int(f.read())
        return self

    def stop(self):
        """SIGTERM; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def _get(self, path):
        return request(self.port, "GET", path, host=self.host).json()

    def executions(self):
        """{"total": N, "by_key": {key: count}}"""
        return self._get("/__executions")

    def total(self):
        return self.executions()["total"]

    def count(self, key):
        return self._get("/__executions?key=" + urllib.parse.quote(key, safe=""))["count"]

    def entries(self):
        """Every execution, in order (dicts with key, method, path, charge_id...)."""
        return self._get("/__executions?detail=1")["executions"]

    def rejected(self):
        """{"count": N, "reasons": [...]}: requests the upstream refused as
        malformed (a proxy must never forward one)."""
        return self._get("/__rejected")

    def reset(self):
        request(self.port, "POST", "/__reset")

    def idle_closed(self):
        """Requests dropped unanswered by --idle-close-ms."""
        return self._get("/__idle_closed")["count"]


class Proxy:
    """One idemproxy process: `idemproxy --config FILE`."""

    def __init__(self, workdir, config, name, args=(), env=None, preexec_fn=None):
        self.workdir = workdir
        self.env = env  # None: this process's environment
        self.preexec_fn = preexec_fn  # run in the child before exec (limits)
        self.config = json.loads(json.dumps(config))
        # IDEMPROXY_UPSTREAM_CLIENT=native|libcurl runs every scenario with
        # that upstream client (a config that names one keeps it).
        client = os.environ.get("IDEMPROXY_UPSTREAM_CLIENT")
        up = self.config.get("upstream")
        if client and isinstance(up, str):
            self.config["upstream"] = {"url": up, "client": client}
        elif client and isinstance(up, dict):
            up.setdefault("client", client)
        self.name = name
        self.args = list(args)
        self.config_path = os.path.join(workdir, name + ".json")
        self.stdout_path = os.path.join(workdir, name + ".stdout")
        self.stderr_path = os.path.join(workdir, name + ".stderr")
        self.proc = None
        self.port = None
        self.killed = False  # kill -9: no clean exit expected
        self.stop_called = False  # the test stopped it (and checks the status)

    def start(self, attempts=3):
        for attempt in range(attempts):
            self.port = free_port()
            self.config["listen"] = "127.0.0.1:%d" % self.port
            with open(self.config_path, "w") as f:
                json.dump(self.config, f, indent=2)
            out = open(self.stdout_path, "ab")
            err = open(self.stderr_path, "ab")
            self._stderr_offset = err.tell()
            try:
                self.proc = subprocess.Popen([binary(), "--config", self.config_path] + self.args,
                                             stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                             cwd=self.workdir, env=self.env,
                                             preexec_fn=self.preexec_fn)
            finally:
                out.close()
                err.close()
            if self._wait_listening():
                return self
            # Lost the port race, or the proxy refused to start: retry once
            # with another port, then report its stderr.
        raise RuntimeError("proxy %s did not start (exit %r): %s" % (
            self.name, self.proc.returncode, self.stderr()))

    def _wait_listening(self):
        """Waits for this process's own "listening on" line: a connection
        to the port could reach another test's proxy that took it first
        (this one then refuses to start)."""
        line = ("listening on 127.0.0.1:%d," % self.port).encode()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with open(self.stderr_path, "rb") as f:
                f.seek(self._stderr_offset)
                if line in f.read():
                    return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.01)
        self.proc.kill()
        self.proc.wait()
        return False

    @property
    def pid(self):
        return self.proc.pid

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout=STOP_TIMEOUT_S):
        """SIGTERM and wait; returns the exit status (None: had to be killed)."""
        if self.proc is None:
            return None
        self.stop_called = True
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot drain
            except ProcessLookupError:
                pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def terminate(self):
        """Sends one SIGTERM (a second one might mean "stop draining")."""
        self.stop_called = True
        self.proc.send_signal(signal.SIGTERM)

    def terminate_draining(self, timeout=10.0):
        """terminate(), then waits until the proxy says it drains: a test
        that times the drain counts from there, not from the signal (which
        a loaded machine may deliver late)."""
        self.terminate()
        if not wait_for(lambda: ": draining" in self.stderr(), timeout):
            raise AssertionError("no 'draining' line %.0f s after SIGTERM: %s"
                                 % (timeout, self.stderr()[-2000:]))

    def wait_exit(self, timeout=STOP_TIMEOUT_S):
        """Waits for the process to exit; returns its status, None on timeout."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill9(self):
        self.killed = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def sigstop(self):
        os.kill(self.proc.pid, signal.SIGSTOP)

    def sigcont(self):
        os.kill(self.proc.pid, signal.SIGCONT)

    def stdout(self):
        with open(self.stdout_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stderr(self):
        with open(self.stderr_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def access_log(self):
        """The JSON access-log lines written to stdout so far."""
        entries = []
        text = self.stdout()
        # Only whole lines: the proxy may be in the middle of writing one.
        for line in text[:text.rfind("\n") + 1].splitlines():
            if line.strip():
                entries.append(json.loads(line))
        return entries

    def wait_access_log(self, n, timeout=5.0):
        """Waits until at least n access-log lines are written; returns them."""
        wait_for(lambda: len(self.access_log()) >= n, timeout)
        return self.access_log()

    # Requests ---------------------------------------------------------------

    def request(self, method, path, headers=(), body=b"", **kw):
        return request(self.port, method, path, headers, body, **kw)

    def conn(self, timeout=15.0):
        return Conn(self.port, timeout=timeout)


# ---------------------------------------------------------------------------
# The base test case
# ---------------------------------------------------------------------------

PAYMENT_BODY = b'{"amount":1000,"currency":"eur"}'


class ProxyTestCase(unittest.TestCase):
    """A temp dir, a running upstream, and helpers to run proxies against it."""

    maxDiff = None

    def setUp(self):
        # notes and proxies first: _remove_workdir reads them, and an
        # upstream that fails to start must show its own error, not theirs.
        self.proxies = []
        self.notes = []
        self.workdir = tempfile.mkdtemp(prefix="idemproxy-e2e-%s-" % self._testMethodName)
        self.addCleanup(self._remove_workdir)
        self.store_path = os.path.join(self.workdir, "store")
        self.upstream = Upstream(self.workdir).start()
        self.addCleanup(self._stop_upstream)

    def note(self, fmt, *args):
        """A timestamped line printed if the test fails (timing evidence)."""
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        self.notes.append("%s %s" % (stamp, fmt % args))

    def tearDown(self):
        problems = []
        for p in self.proxies:
            if p.killed or p.stop_called or p.proc is None:
                continue
            if p.proc.poll() is not None:
                problems.append("proxy %s died during the test with status %r (stderr: %s)" % (
                    p.name, p.proc.returncode, p.stderr()[-2000:]))
                continue
            rc = p.stop()
            if rc != 0:
                problems.append("proxy %s: SIGTERM exit status %r, expected 0 (stderr: %s)" % (
                    p.name, rc, p.stderr()[-2000:]))
        if problems:
            self.fail("; ".join(problems))

    def _stop_upstream(self):
        rc = self.upstream.stop()
        if rc != 0:
            raise AssertionError("upstream exited with %r: %s" % (
                rc, open(self.upstream.stderr_path).read()[-2000:]))

    def _failed(self):
        """Whether this test has failed so far (from a cleanup function)."""
        outcome = getattr(self, "_outcome", None)
        if outcome is None:
            return False
        for _, exc_info in getattr(outcome, "errors", None) or []:  # Python <= 3.10
            if exc_info is not None:
                return True
        result = getattr(outcome, "result", None)  # Python >= 3.11 reports at once
        for test, _ in list(getattr(result, "failures", [])) + list(getattr(result, "errors", [])):
            if test is self or getattr(test, "test_case", None) is self:
                return True
        return False

    def _remove_workdir(self):
        if self._failed():
            # Keep the evidence of a failure: configs, access logs, stderr,
            # the upstream's execution log and the store.
            sys.stderr.write("\n--- %s failed; kept %s\n" % (self.id(), self.workdir))
            for line in self.notes:
                sys.stderr.write("note %s\n" % line)
            for name in sorted(os.listdir(self.workdir)):
                if name.endswith((".stderr", ".stdout")):
                    with open(os.path.join(self.workdir, name), "rb") as f:
                        tail = f.read()[-3000:].decode("utf-8", "replace")
                    sys.stderr.write("--- %s (tail)\n%s\n" % (name, tail))
            return
        if os.environ.get("IDEMPROXY_E2E_KEEP"):
            sys.stderr.write("kept %s\n" % self.workdir)
            return
        shutil.rmtree(self.workdir, ignore_errors=True)

    # Configuration ----------------------------------------------------------

    def route(self, **overrides):
        """The payments route used by most scenarios. Its lease leaves seconds
        of slack so a loaded machine (ctest -j, sanitizers) cannot make a
        lease lapse; scenarios about lease timing set short leases
        themselves."""
        r = {
            "path": "/v1/payments",
            "methods": ["POST", "PATCH"],
            "scope": "payments",
            "lease": "5s",
            "heartbeat": "1s",
            "wait": "3s",
        }
        r.update(overrides)
        return {k: v for (k, v) in r.items() if v is not None}

    def config(self, routes=None, upstream_url=None, timeout="10s", store=None, **top):
        cfg = {
            "listen": "127.0.0.1:0",
            "upstream": {
                "url": upstream_url or self.upstream.url,
                "connect_timeout": "2s",
                "timeout": timeout,
            },
            "store": {"path": self.store_path, "durability": "sync", "map_size": "64MiB"},
            "routes": routes if routes is not None else [self.route()],
        }
        if store:
            cfg["store"].update(store)
        cfg.update(top)
        return cfg

    def start_proxy(self, config=None, name=None, args=(), preexec_fn=None, **route_overrides):
        """Starts a proxy (default: config() with route(**route_overrides));
        preexec_fn runs in the child before exec (resource limits)."""
        if config is None:
            config = self.config(routes=[self.route(**route_overrides)])
        name = name or "proxy%d" % (len(self.proxies) + 1)
        p = Proxy(self.workdir, config, name, args, preexec_fn=preexec_fn)
        self.proxies.append(p)
        return p.start()

    # Requests ---------------------------------------------------------------

    def post(self, proxy, key=None, body=PAYMENT_BODY, headers=(), path="/v1/payments",
             method="POST", content_type="application/json", **kw):
        h = []
        if content_type:
            h.append(("Content-Type", content_type))
        if key is not None:
            h.append(("Idempotency-Key", key))
        h.extend(headers)
        return proxy.request(method, path, h, body, **kw)

    # Assertions -------------------------------------------------------------

    def assertProblem(self, resp, status):
        """An error produced by the proxy: RFC 9457 problem+json."""
        self.assertEqual(resp.status, status, resp)
        ctype = (resp.header("Content-Type") or "").split(";")[0].strip().lower()
        self.assertEqual(ctype, "application/problem+json", resp)
        doc = resp.json()
        self.assertIsInstance(doc, dict, resp)
        for member in ("type", "title", "status", "detail"):
            self.assertIn(member, doc, resp)
        self.assertEqual(doc["status"], status, resp)
        self.assertIsInstance(doc["type"], str)
        self.assertIsInstance(doc["title"], str)
        self.assertIsInstance(doc["detail"], str)
        self.assertFalse(resp.has("X-Charge-Id"), "proxy error carries upstream headers: %r" % resp)
        return doc

    def assertRetryAfter(self, resp, minimum=1, maximum=None):
        value = resp.header("Retry-After")
        self.assertIsNotNone(value, "no Retry-After: %r" % resp)
        self.assertTrue(value.strip().isdigit(), "Retry-After %r is not delta-seconds" % value)
        seconds = int(value)
        self.assertGreaterEqual(seconds, minimum, resp)
        if maximum is not None:
            self.assertLessEqual(seconds, maximum, resp)
        return seconds

    def assertStopsClean(self, proxy):
        """SIGTERM: the proxy exits 0 with no sanitizer report on stderr."""
        status = proxy.stop()
        err = proxy.stderr()
        self.assertNotIn("AddressSanitizer", err, err[-4000:])
        self.assertNotIn("runtime error:", err, err[-4000:])
        self.assertEqual(status, 0, err[-4000:])

    def assertExecuted(self, resp):
        """A fresh upstream answer (not a replay)."""
        self.assertEqual(resp.status, 201, resp)
        self.assertFalse(resp.replayed, resp)
        self.assertIsNotNone(resp.charge_id, resp)

    def assertReplayOf(self, resp, first, strip=("set-cookie",)):
        """resp replays first: same status, body byte for byte, the upstream's
        end-to-end headers minus strip_headers, plus Idempotent-Replayed."""
        self.assertEqual(resp.status, first.status, resp)
        self.assertTrue(resp.replayed, "no Idempotent-Replayed: true in %r" % resp)
        self.assertEqual(resp.body, first.body)
        self.assertEqual(resp.charge_id, first.charge_id)
        for name in ("Content-Type", "X-Charge-Id", "X-Upstream", "Date"):
            if name.lower() in strip:
                continue
            self.assertEqual(resp.header_all(name), first.header_all(name),
                             "header %s differs in the replay" % name)
        for name in strip:
            self.assertEqual(resp.header_all(name), [], "%s replayed: %r" % (name, resp))
