"""bench/run reports two latency figures per leg: wrk's own, which wrk 4.1.0
corrects for coordinated omission before anyone sees them, and "as sent",
the latencies of the requests wrk actually sent, which bench/run gets back by
taking the correction out of wrk's histogram (uncorrect(), as_sent()). These
tests run the real wrk with the bench's scripts against a server whose every
20th answer takes 300 ms, and check that the figures as sent are the
server's: every answer accounted for once, the slow ones at their share,
while wrk's own histogram carries extra samples for them."""
import http.server
import json
import os
import re
import socketserver
import subprocess
import tempfile
import threading
import time
import types
import unittest

from bench_module import ROOT, load_bench
SLOW_EVERY = 20
SLOW_S = 0.300
# Well apart from both: a fast answer takes milliseconds even on a loaded host.
SLOW_FROM_US = 200_000
FAST_BELOW_US = 100_000
CONNS = 2


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The head and the body go out in two writes: without this, the second
    # waits for the client's delayed ACK (40 ms), and every answer is slow.
    disable_nagle_algorithm = True
    lock = threading.Lock()
    answered = 0
    slow = 0

    def do_GET(self):
        with Handler.lock:
            Handler.answered += 1
            n = Handler.answered
        if n % SLOW_EVERY == 0:
            time.sleep(SLOW_S)
            with Handler.lock:
                Handler.slow += 1
        body = b'{"ok":true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


class WrkLatencyAsSent(unittest.TestCase):
    def setUp(self):
        self.bench = load_bench()
        Handler.answered = Handler.slow = 0
        self.srv = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = "http://127.0.0.1:%d" % self.srv.server_address[1]

    def tearDown(self):
        self.srv.shutdown()
        self.srv.server_close()

    def check_counts(self, answers):
        # The server answered every request wrk counted, and at most one
        # more per connection (cut off at the end of the run).
        self.assertGreater(answers, 100)
        self.assertGreaterEqual(Handler.answered, answers)
        self.assertLessEqual(Handler.answered, answers + CONNS)

    def test_histogram_uncorrected(self):
        out = subprocess.run(
            [os.environ.get("WRK", "wrk"), "-t1", "-c%d" % CONNS, "-d3s", "--timeout", "5s",
             "-s", os.path.join(ROOT, "bench", "get.lua"), self.url, "--", "/"],
            env=dict(os.environ, BENCH_HIST="1"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=60).stdout
        res = json.loads(re.search(r"^BENCH_RESULT (\{.*\})$", out, re.M).group(1))
        hist = {}
        for pair in re.search(r"^BENCH_HIST (.*)$", out, re.M).group(1).split(","):
            v, c = pair.split(":")
            hist[int(v)] = hist.get(int(v), 0) + int(c)
        answers = res["requests"]
        self.check_counts(answers)
        self.assertEqual(res["err_timeout"] + res["err_read"] + res["err_connect"], 0, out)
        self.assertIsNotNone(re.search(r"^BENCH_HIST_CPU [\d.]+$", out, re.M), out)

        # wrk's own histogram has more samples than answers: the correction
        # (each 300 ms answer adds one per mean cycle of a connection).
        self.assertGreater(sum(hist.values()), answers, out)

        raw = self.bench.uncorrect(hist, answers, CONNS, res["duration_us"])
        self.assertIsNotNone(raw, "the correction could not be taken out")
        self.assertEqual(sum(raw.values()), answers)
        # The slow answers as sent: as many as the server made, but those cut
        # off at the end (any answer that slow is one of them: the others
        # take milliseconds).
        slow_raw = sum(c for v, c in raw.items() if v >= SLOW_FROM_US)
        self.assertGreaterEqual(slow_raw, Handler.slow - CONNS)
        self.assertLessEqual(slow_raw, Handler.slow)
        # The histogram read back is the one wrk's percentiles come from (p50:
        # a rank with no rounding in doubt).
        self.assertEqual(self.bench.percentile(hist, sum(hist.values()), 50), res["p50_us"])

    def test_bench_reports_as_sent(self):
        # bench/run's own path: wrk(), then as_sent(), as measure() does.
        with tempfile.TemporaryDirectory() as work:
            ctx = types.SimpleNamespace(threads=1, work=work)
            r = self.bench.wrk(ctx, self.url, "get.lua", ["/"], CONNS, 3, "test", hist=True)
            self.assertGreaterEqual(r["hist_cpu_s"], 0.0)
            self.bench.as_sent(r, CONNS)
        self.check_counts(r["requests"])
        self.assertNotIn("hist", r)
        self.assertIsNotNone(r["p90_raw_us"], "no figures as sent")
        # 1 answer in 20 is slow: as sent, p90 is a fast answer and p99 a slow
        # one; in wrk's corrected figures the slow answers weigh far more.
        self.assertLess(r["p50_raw_us"], FAST_BELOW_US)
        self.assertLess(r["p90_raw_us"], FAST_BELOW_US)
        self.assertGreaterEqual(r["p99_raw_us"], SLOW_FROM_US)
        self.assertGreaterEqual(r["p90_us"], FAST_BELOW_US,
                                "wrk's p90 %d us: no correction seen" % r["p90_us"])


if __name__ == "__main__":
    unittest.main()
