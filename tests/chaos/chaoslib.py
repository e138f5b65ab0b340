"""chaoslib.py - what the chaos tests share, on top of tests/e2e/harness.py.

The processes (idemproxy, the test upstream), the raw HTTP client and the base
test case are harness.py's; this module adds what only long, randomised runs
need:

  - the run's size: knob("ROUNDS", ci=20, long=200) is the CI value, the long
    value under CHAOS_LONG=1, and CHAOS_ROUNDS=N overrides both;
  - figure(): the one summary line every test prints (and appends to
    $CHAOS_FIGURES when set, which tests/chaos/run-long uses);
  - check_store(): `idemproxy check-store PATH [--records]`, parsed;
  - record_key(): the store key of a key (the access log's is harness.log_key());
  - RawConn: a keep-alive connection that also returns the exact bytes of
    each response;
  - /proc readings: VmRSS and friends, open descriptors;
  - the upstream's fsync'ed execution log, read from its file (it survives
    anything that happens to the proxy).
"""

import datetime
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))

import harness  # noqa: E402  (tests/e2e/harness.py)

LONG = os.environ.get("CHAOS_LONG", "") not in ("", "0")
MODE = "long" if LONG else "ci"


def knob(name, ci, long):
    """The size of a run: `ci`, or `long` under CHAOS_LONG=1; the environment
    variable CHAOS_<NAME> overrides both (same type as `ci`)."""
    value = os.environ.get("CHAOS_" + name)
    if value:
        return type(ci)(value)
    return long if LONG else ci


def rng(test):
    """A random.Random seeded from CHAOS_SEED or the clock; the seed is
    printed so a failing run can be repeated."""
    seed = int(os.environ.get("CHAOS_SEED") or time.time_ns() % 1000000007)
    print("CHAOS %s seed=%d (CHAOS_SEED=%d repeats this run)" % (test, seed, seed), flush=True)
    return random.Random(seed)


def figure(test, **figures):
    """Prints the test's one summary line: CHAOS <test> <mode>: name=value ..."""
    parts = []
    for name, value in figures.items():
        if isinstance(value, float):
            value = "%.3g" % value if abs(value) < 100 else "%.0f" % value
        parts.append("%s=%s" % (name, value))
    line = "CHAOS %s %s: %s" % (test, MODE, " ".join(parts))
    print(line, flush=True)
    path = os.environ.get("CHAOS_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return line


# ---------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------

def record_key(scope, key):
    """The store's key for (scope, key) as hex: SHA-256 over the length-
    prefixed scope and key (store_key_derive). The access log's "key" is
    harness.log_key(). Routes without scope_header only."""
    if isinstance(scope, str):
        scope = scope.encode()
    if isinstance(key, str):
        key = key.encode()
    h = hashlib.sha256()
    h.update(struct.pack(">Q", len(scope)) + scope + struct.pack(">Q", len(key)) + key)
    return h.hexdigest()


class StoreCheck:
    """One run of `idemproxy check-store PATH [--records]`."""

    def __init__(self, path, records=False):
        args = [harness.binary(), "check-store", path] + (["--records"] if records else [])
        self.now_ms_before = int(time.time() * 1000)
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        self.now_ms_after = int(time.time() * 1000)
        self.returncode = proc.returncode
        self.stdout = proc.stdout.decode("utf-8", "replace")
        self.stderr = proc.stderr.decode("utf-8", "replace")
        self.summary = None
        self.records = {}  # record key hex -> record line
        for line in self.stdout.splitlines():
            if not line.strip():
                continue
            doc = json.loads(line)
            if "ok" in doc:
                self.summary = doc
            else:
                self.records[doc["key"]] = doc

    @property
    def ok(self):
        return self.returncode == 0 and self.summary is not None and self.summary.get("ok") is True

    def __repr__(self):
        return "<check-store exit %d: %s %s>" % (self.returncode, self.stdout[-2000:],
                                                  self.stderr[-2000:])


def check_store(path, records=False):
    return StoreCheck(path, records)


# ---------------------------------------------------------------------------
# Raw responses
# ---------------------------------------------------------------------------

class RawConn(harness.Conn):
    """harness.Conn that also keeps the exact bytes of each response."""

    def __init__(self, port, host="127.0.0.1", timeout=15.0):
        super().__init__(port, host, timeout)
        self._log = bytearray()

    def _fill(self):
        before = len(self.buf)
        super()._fill()
        self._log += self.buf[before:]

    def exchange(self, data, method="POST"):
        """Sends one request's bytes; returns (Response, the response's raw
        bytes). One request at a time (no pipelining)."""
        self._log = bytearray(self.buf)
        self.send(data)
        resp = self.read_response(method)
        return resp, bytes(self._log[:len(self._log) - len(self.buf)])


REPLAYED_LINE = b"Idempotent-Replayed: true\r\n"


def without_replayed_marker(raw):
    """A replay's bytes minus its one `Idempotent-Replayed: true` header line
    (None if the head does not hold exactly one)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    head += b"\r\n"
    if head.count(REPLAYED_LINE) != 1:
        return None
    return head.replace(REPLAYED_LINE, b"")[:-2] + sep + body


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------

def proc_status(pid):
    """VmRSS, RssAnon, RssFile... of /proc/PID/status, in KiB."""
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            name, _, value = line.partition(":")
            if name.startswith(("Vm", "Rss")):
                out[name] = int(value.split()[0])
            elif name == "Threads":
                out[name] = int(value)
    return out


def fd_count(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def fd_targets(pid):
    """What each open descriptor points at (for failure messages)."""
    out = {}
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            out[int(fd)] = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            pass
    return out


def tcp_peers(pid):
    """{fd: (local port, remote port, TCP state hex)} for the process's TCP
    sockets (IPv4 and IPv6), from /proc/PID/net/tcp*."""
    by_inode = {}
    for name in ("tcp", "tcp6"):
        try:
            with open("/proc/%d/net/%s" % (pid, name)) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                    by_inode[inode] = (int(local.rsplit(":", 1)[1], 16),
                                       int(remote.rsplit(":", 1)[1], 16), state)
        except OSError:
            continue
    out = {}
    for fd, target in fd_targets(pid).items():
        if target.startswith("socket:["):
            inode = target[len("socket:["):-1]
            if inode in by_inode:
                out[fd] = by_inode[inode]
    return out


def sanitized(pid):
    """Whether the process runs with AddressSanitizer (its runtime mapped)."""
    with open("/proc/%d/maps" % pid) as f:
        return any("libasan" in line or "libclang_rt.asan" in line for line in f)


def restart(proxy):
    """Starts a proxy again after kill9() (harness.Proxy.start picks a new
    port); teardown then SIGTERMs it and expects exit 0 again."""
    proxy.killed = False
    return proxy.start()


def access_log(proxy):
    """The proxy's access log lines; a line cut by a SIGKILL is skipped."""
    out = []
    for line in proxy.stdout().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def execution_log(upstream):
    """Every execution the upstream logged (fsync'ed before its answer), in
    order; read from the file, so it needs no HTTP and survives anything the
    proxy does."""
    out = []
    with open(upstream.log_path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
    return out


def iso_to_epoch(text):
    """The upstream's entry "time" (ISO 8601, UTC) as seconds since the epoch."""
    return datetime.datetime.fromisoformat(text).timestamp()
