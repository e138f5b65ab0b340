"""bench/run reports two latency figures per leg: wrk's own, which wrk 4.1.0
corrects for coordinated omission before anyone sees them, and "as sent",
the latencies of the requests wrk actually sent, which bench/run gets back by
taking the correction out of wrk's histogram (uncorrect()). This runs the real
wrk with bench/report.lua against a server whose every 20th answer takes
100 ms, and checks that the figures as sent are the server's: every answer
accounted for once, the slow ones at their share, while wrk's own histogram
carries extra samples for them."""
import http.server
import importlib.machinery
import importlib.util
import json
import os
import re
import socketserver
import subprocess
import threading
import time
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SLOW_EVERY = 20
SLOW_S = 0.100


def load_bench():
    spec = importlib.util.spec_from_loader(
        "bench_run", importlib.machinery.SourceFileLoader(
            "bench_run", os.path.join(ROOT, "bench", "run")))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    def test_correction_taken_back_out(self):
        bench = load_bench()
        srv = Server(("127.0.0.1", 0), Handler)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        conns = 2
        try:
            url = "http://127.0.0.1:%d" % srv.server_address[1]
            out = subprocess.run(
                [os.environ.get("WRK", "wrk"), "-t1", "-c%d" % conns, "-d3s", "--timeout", "5s",
                 "-s", os.path.join(ROOT, "bench", "get.lua"), url, "--", "/"],
                env=dict(os.environ, BENCH_HIST="1"), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, timeout=60).stdout
        finally:
            srv.shutdown()
            srv.server_close()
        res = json.loads(re.search(r"^BENCH_RESULT (\{.*\})$", out, re.M).group(1))
        hist = {}
        for pair in re.search(r"^BENCH_HIST (.*)$", out, re.M).group(1).split(","):
            v, c = pair.split(":")
            hist[int(v)] = hist.get(int(v), 0) + int(c)
        answers = res["requests"]
        self.assertGreater(answers, 200, out)
        self.assertEqual(res["err_timeout"] + res["err_read"] + res["err_connect"], 0, out)
        # The server answered every request wrk counted, and at most one more
        # per connection (cut off at the end of the run).
        self.assertGreaterEqual(Handler.answered, answers)
        self.assertLessEqual(Handler.answered, answers + conns)

        # wrk's own histogram has more samples than answers: the correction.
        self.assertGreater(sum(hist.values()), answers * 1.2)

        raw = bench.uncorrect(hist, answers, conns, res["duration_us"])
        self.assertIsNotNone(raw, "the correction could not be taken out")
        self.assertEqual(sum(raw.values()), answers)
        # The slow answers, as sent: at least 100 ms each, as many as the
        # server made (but those cut off at the end).
        slow_raw = sum(c for v, c in raw.items() if v >= SLOW_S * 1e6)
        self.assertGreaterEqual(slow_raw, Handler.slow - conns)
        self.assertLessEqual(slow_raw, Handler.slow)
        # In wrk's histogram they weigh far more than their 1 in 20.
        p90_raw = bench.percentile(raw, answers, 90)
        self.assertLess(p90_raw, SLOW_S * 1e6 / 2, "p90 as sent: %d us" % p90_raw)
        self.assertGreaterEqual(res["p90_us"], SLOW_S * 1e6 / 2,
                                "wrk's p90 %d us: no correction seen" % res["p90_us"])
        # The histogram read back is the one wrk's percentiles come from (p50:
        # a rank with no rounding in doubt).
        self.assertEqual(bench.percentile(hist, sum(hist.values()), 50), res["p50_us"])


if __name__ == "__main__":
    unittest.main()
