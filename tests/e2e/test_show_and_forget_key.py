#!/usr/bin/env python3
"""An operator's look at one key, and its removal, beside a running proxy.

`idemproxy show-key PATH SCOPE KEY` prints the key's record as JSON (state,
times, the stored answer) from a read-only open; `forget-key` deletes it, so
the key runs again when next sent. A request running now (a live lease) is
not forgotten without --force. Keys are given as a client sends them (bare
or as a structured-field string), and a route's scope_header value with
--scope-header-value."""

import json
import subprocess
import threading
import unittest

import harness


class ShowAndForgetKey(harness.ProxyTestCase):
    def tool(self, *args):
        p = subprocess.run([harness.binary()] + list(args), stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=30)
        out = p.stdout.decode("utf-8", "replace").strip()
        return p.returncode, (json.loads(out) if out else None), p.stderr.decode("utf-8",
                                                                                 "replace")

    def test_show_then_forget_a_completed_key(self):
        proxy = self.start_proxy()
        first = self.post(proxy, "order-7", headers=[
            ("X-Test-Response-Header", "Location: /v1/payments/7")])
        self.assertExecuted(first)

        rc, doc, err = self.tool("show-key", self.store_path, "payments", "order-7")
        self.assertEqual(rc, 0, err)
        self.assertTrue(doc["found"])
        self.assertEqual(doc["state"], "complete")
        self.assertEqual(doc["status"], 201)
        self.assertEqual(doc["body"].encode(), first.body)
        self.assertIn(["Location", "/v1/payments/7"], doc["headers"])
        self.assertEqual(doc["body_bytes"], len(first.body))
        # The same short hash as the access log's "key".
        # (The log is written a little after the answer.)
        logged = [e["key"] for e in proxy.wait_access_log(1) if e.get("outcome") == "forwarded"]
        self.assertEqual(logged, [doc["log_key"]])
        # The structured-field form is the same key, as for the proxy.
        rc, again, _ = self.tool("show-key", self.store_path, "payments", '"order-7"')
        self.assertEqual((rc, again["record_key"]), (0, doc["record_key"]))
        # Another scope, another key: none.
        rc, none, _ = self.tool("show-key", self.store_path, "refunds", "order-7")
        self.assertEqual(rc, 1)
        self.assertFalse(none["found"])

        rc, res, err = self.tool("forget-key", self.store_path, "payments", "order-7")
        self.assertEqual(rc, 0, err)
        self.assertEqual(res, {"forgotten": True, "outcome": "done", "was": "complete",
                               "log_key": doc["log_key"]})
        # The running proxy sees it gone: the key runs again.
        self.assertExecuted(self.post(proxy, "order-7"))
        self.assertEqual(self.upstream.count("order-7"), 2)
        rc, res, _ = self.tool("forget-key", self.store_path, "payments", "nobody")
        self.assertEqual((rc, res["outcome"]), (1, "not_found"))

    def test_a_header_value_that_is_not_utf8_is_shown(self):
        # obs-text (RFC 9110 section 5.5): the upstream's byte 0xE9 is stored
        # and replayed; show-key used to leave the whole header out.
        proxy = self.start_proxy()
        first = self.post(proxy, "latin-1", headers=[
            ("X-Test-Response-Header", "X-Name: caf\u00e9")])
        self.assertExecuted(first)
        self.assertEqual(first.header("X-Name"), "caf\u00e9")
        rc, doc, err = self.tool("show-key", self.store_path, "payments", "latin-1")
        self.assertEqual(rc, 0, err)
        self.assertIn(["X-Name", "caf\u00e9"], doc["headers"])
        self.assertIn(["X-Charge-Id", "ch_1"], doc["headers"])

    def test_a_running_request_is_forgotten_only_with_force(self):
        proxy = self.start_proxy()
        answers = {}

        def slow():
            answers["first"] = self.post(proxy, "slow-1",
                                         headers=[("X-Test-Delay-Ms", "5000")])

        t = threading.Thread(target=slow)
        t.start()
        harness.wait_for(lambda: self.upstream.count("slow-1") == 1, timeout=10)
        rc, doc, _ = self.tool("show-key", self.store_path, "payments", "slow-1")
        self.assertEqual((rc, doc["state"], doc["held"]), (0, "in_progress", False))
        rc, res, err = self.tool("forget-key", self.store_path, "payments", "slow-1")
        self.assertEqual((rc, res["outcome"]), (3, "busy"))
        self.assertIn("--force", err)
        rc, res, err = self.tool("forget-key", self.store_path, "payments", "slow-1", "--force")
        self.assertEqual((rc, res["outcome"], res["was"]), (0, "done", "in_progress"), err)
        t.join()
        # Its client still gets the upstream's answer; it is not stored (its
        # holder was fenced out), so the key runs again when sent.
        self.assertExecuted(answers["first"])
        self.assertEqual([e["outcome"] for e in proxy.wait_access_log(1)], ["fenced"])
        rc, _, _ = self.tool("show-key", self.store_path, "payments", "slow-1")
        self.assertEqual(rc, 1)
        self.assertExecuted(self.post(proxy, "slow-1"))
        self.assertEqual(self.upstream.count("slow-1"), 2)

    def test_scope_header_value_and_bad_arguments(self):
        proxy = self.start_proxy(scope_header="X-Tenant-Id")
        self.assertExecuted(self.post(proxy, "t-1", headers=[("X-Tenant-Id", "acme")]))
        rc, doc, _ = self.tool("show-key", self.store_path, "payments", "t-1",
                               "--scope-header-value", "acme")
        self.assertEqual((rc, doc["state"]), (0, "complete"))
        for args in ((), ("--scope-header-value", "other")):
            rc, _, _ = self.tool("show-key", self.store_path, "payments", "t-1", *args)
            self.assertEqual(rc, 1, args)
        for args, says in (((self.store_path, "payments"), "usage"),
                           ((self.store_path, "payments", "bad key"), "KEY:"),
                           ((self.store_path, "", "k"), "SCOPE"),
                           ((self.store_path, "payments", "k", "--force"), "--force"),
                           ((self.store_path + "-missing", "payments", "k"), "store")):
            rc, _, err = self.tool("show-key", *args)
            self.assertEqual(rc, 2, args)
            self.assertIn(says, err, args)

    def test_scope_header_value_from_stdin(self):
        # "-" reads the value from stdin: a credential used as the scope
        # header (Authorization) stays off the command line, where ps shows
        # it to every local user.
        proxy = self.start_proxy(scope_header="Authorization")
        token = "Bearer sk_live_secret"
        self.assertExecuted(self.post(proxy, "t-9", headers=[("Authorization", token)]))

        def tool_stdin(text, *args):
            p = subprocess.run([harness.binary()] + list(args), input=text.encode(),
                               capture_output=True, timeout=30)
            out = p.stdout.decode().strip()
            return p.returncode, (json.loads(out) if out else None), p.stderr.decode()

        args = ("show-key", self.store_path, "payments", "t-9", "--scope-header-value", "-")
        rc, doc, err = tool_stdin(token + "\n", *args)
        self.assertEqual((rc, doc["state"]), (0, "complete"), err)
        rc, doc, _ = tool_stdin(token, *args)  # no newline at the end: the same
        self.assertEqual(rc, 0)
        rc, doc, _ = tool_stdin("Bearer other\n", *args)
        self.assertEqual(rc, 1)
        rc, _, err = tool_stdin("", *args)
        self.assertEqual(rc, 2)
        self.assertIn("no line on stdin", err)
        # As the proxy reads a header: white space around it is not part of
        # the value, and an empty one matches no record (the proxy 400s it).
        rc, doc, err = tool_stdin(" \t" + token + " \n", *args)
        self.assertEqual(rc, 0, err)
        for empty in (" \n", "\n"):
            rc, _, err = tool_stdin(empty, *args)
            self.assertEqual(rc, 2, empty)
            self.assertIn("--scope-header-value: empty", err)
        rc, _, err = tool_stdin("", "show-key", self.store_path, "payments", "t-9",
                                "--scope-header-value", "")
        self.assertEqual(rc, 2)
        self.assertIn("--scope-header-value: empty", err)
        rc, doc, err = tool_stdin(token + "\r\n", "forget-key", self.store_path, "payments",
                                  "t-9", "--scope-header-value", "-")
        self.assertEqual((rc, doc["forgotten"]), (0, True), err)

    def test_an_older_layout_is_refused_not_upgraded(self):
        # Raising a store's layout stops the older proxies running on it
        # from writing (every new key 503): forget-key is the operator's
        # tool, not an upgrade, so it refuses and leaves the store as it is.
        proxy = self.start_proxy()
        self.assertExecuted(self.post(proxy, "old-1"))
        self.assertEqual(proxy.stop(), 0, proxy.stderr())
        subprocess.run(["mdb_load", "-T", "-s", "meta", self.store_path],
                       input=b"layout\n\\03\\00\\00\\00\n", check=True, timeout=10)
        rc, res, err = self.tool("forget-key", self.store_path, "payments", "old-1")
        self.assertEqual(rc, 2, (res, err))
        self.assertIn("of an older layout (3; this idemproxy's is 4)", err)
        self.assertIn("start a proxy of this version on it first", err)
        dump = subprocess.run(["mdb_dump", "-s", "meta", self.store_path], capture_output=True,
                              check=True, timeout=10).stdout.decode()
        self.assertIn(" 6c61796f7574\n 03000000\n", dump)  # "layout": 3, as it was
        rc, doc, _ = self.tool("show-key", self.store_path, "payments", "old-1")
        self.assertEqual((rc, doc["state"]), (0, "complete"))

    def test_help_is_not_taken_for_a_store(self):
        for cmd in ("check-store", "show-key", "forget-key", "check-config"):
            p = subprocess.run([harness.binary(), cmd, "--help"], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=30)
            self.assertEqual(p.returncode, 0, (cmd, p.stderr))
            self.assertIn(b"usage: idemproxy", p.stdout, cmd)
            self.assertNotIn(b"--help", p.stderr, cmd)


if __name__ == "__main__":
    unittest.main()
