"""adv.py - what the adversarial tests share, on top of tests/e2e/harness.py.

    import adv
    class MyAttack(adv.AdversarialCase):
        def test_it(self):
            n = adv.scale(short=10, long=50)    # ADV_LONG=1 picks the long figure
            ...
            self.summary("my-attack", "%d requests, %d bad", n, bad)

Short (CI) mode is the default; ADV_LONG=1 (tests/adversarial/run-long) runs
the figures the hardening issue asks for. Every test prints one summary line
"ADV <name>: <figure>" on stdout (and appends it to $ADV_SUMMARY_FILE when
set), so a ctest log or run-long's output shows the figures at a glance.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "e2e"))

import harness  # noqa: E402  (tests/e2e/harness.py)

LONG = os.environ.get("ADV_LONG", "") not in ("", "0")
MODE = "long" if LONG else "ci"


def scale(short, long):
    return long if LONG else short


def summary(name, fmt, *args):
    line = "ADV %s [%s]: %s" % (name, MODE, fmt % args if args else fmt)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    path = os.environ.get("ADV_SUMMARY_FILE")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class Conn(harness.Conn):
    """harness.Conn that can bind a source address (127.0.0.2: a second
    client address on loopback)."""

    def __init__(self, port, host="127.0.0.1", timeout=15.0, source=None):
        if source is None:
            super().__init__(port, host, timeout)
            return
        self.port = port
        self.host = host
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                             source_address=(source, 0))
        self.sock.settimeout(timeout)
        self.buf = b""


def timed_request(port, method, path, headers=(), body=b"", source=None, timeout=15.0):
    """One request on a fresh connection: (response or the exception, seconds
    from the moment the connection was established and the request about to
    be sent, to the end of the answer)."""
    t0 = time.monotonic()
    try:
        with Conn(port, timeout=timeout, source=source) as c:
            t0 = time.monotonic()
            resp = c.request(method, path, headers, body)
    except Exception as e:  # noqa: BLE001 - reported by the caller
        resp = e
    return resp, time.monotonic() - t0


def parallel(fn, items, workers=16):
    """fn(item) for every item on `workers` threads; results in item order."""
    results = [None] * len(items)
    lock = threading.Lock()
    it = iter(range(len(items)))

    def run():
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except Exception as e:  # noqa: BLE001
                results[i] = e

    threads = [threading.Thread(target=run, daemon=True) for _ in range(min(workers, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def check_store(path, records=False):
    """`idemproxy check-store PATH`: (exit status, summary dict, record dicts)."""
    args = [harness.binary(), "check-store", path] + (["--records"] if records else [])
    p = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    lines = [json.loads(l) for l in p.stdout.decode().splitlines() if l.strip()]
    summary_doc = lines[-1] if lines else {}
    return p.returncode, summary_doc, lines[:-1]


def open_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def short(resp):
    """A response (or an exception) in one short line, for failure lists."""
    if not isinstance(resp, harness.Response):
        return repr(resp)[:200]
    return "<%d %s body=%r>" % (resp.status, ",".join(n for (n, _) in resp.headers),
                                resp.body[:120])


def is_problem(resp):
    ctype = (resp.header("Content-Type") or "").split(";")[0].strip().lower()
    return ctype == "application/problem+json"


class AdversarialCase(harness.ProxyTestCase):
    """harness.ProxyTestCase plus the summary line and timing notes."""

    def summary(self, name, fmt, *args):
        summary(name, fmt, *args)

    def store_records(self):
        rc, doc, _ = check_store(self.store_path)
        self.assertEqual(rc, 0, "check-store failed: %r" % doc)
        return doc["records"]
