#!/usr/bin/env python3
"""The command line: check-config prints the effective configuration and exits
0, or exits 1 with an error naming the field; a bad config stops `--config`
at start; --help and --version exit 0; `idemproxy --upstream URL` alone runs
with every default; --listen/--upstream/--store override the file; a listen
address ":PORT" binds every IPv4 address (0.0.0.0) and "[::]:PORT" IPv6 (and
IPv4 too where the system is dual-stack); check-store exits 0 on a sound
store and 1 on one holding a key twice."""

import json
import os
import pwd
import shutil
import subprocess
import unittest

import harness


class CliAndConfig(harness.ProxyTestCase):
    def run_bin(self, *args, timeout=10):
        return subprocess.run([harness.binary()] + list(args), stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=timeout, cwd=self.workdir)

    def write(self, name, doc):
        path = os.path.join(self.workdir, name)
        with open(path, "w") as f:
            f.write(doc if isinstance(doc, str) else json.dumps(doc))
        return path

    def check_invalid(self, doc, field):
        p = self.run_bin("check-config", self.write("bad.json", doc))
        out = (p.stdout + p.stderr).decode("utf-8", "replace")
        self.assertEqual(p.returncode, 1, out)
        self.assertIn(field, out, "the error does not name %s" % field)
        return out

    def test_check_config_valid_prints_effective_config(self):
        path = self.write("good.json", {"upstream": "http://127.0.0.1:9",
                                        "routes": [{"path": "/v1/payments"}]})
        p = self.run_bin("check-config", path)
        self.assertEqual(p.returncode, 0, p.stderr)
        eff = json.loads(p.stdout)
        route = eff["routes"][0]
        # Every default spelled out.
        for field in ("match", "methods", "scope", "ttl", "lease", "heartbeat", "wait",
                      "require_key", "fingerprint", "max_body", "max_key_length",
                      "release_on", "on_unknown", "strip_headers"):
            self.assertIn(field, route, "effective route lacks %s" % field)
        self.assertEqual(route["methods"], ["POST", "PATCH"])
        self.assertEqual(route["max_key_length"], 255)
        self.assertEqual(route["require_key"], False)
        self.assertEqual(route["on_unknown"], "release")
        self.assertEqual(route["fingerprint"], "auto")
        self.assertEqual([h.lower() for h in route["strip_headers"]], ["set-cookie"])
        self.assertIn("path", eff["store"])
        self.assertIs(eff["store"]["require_local_fs"], True)

    def test_check_config_names_the_bad_field(self):
        base = {"upstream": "http://127.0.0.1:9"}
        self.check_invalid(dict(base, routes=[{"path": "/p", "ttl": "forever"}]), "routes[0].ttl")
        self.check_invalid(dict(base, routes=[{"path": "/p", "max_body": "1MB"}]),
                           "routes[0].max_body")
        self.check_invalid(dict(base, routes=[{"path": "/p", "require_key": "yes"}]),
                           "routes[0].require_key")
        out = self.check_invalid(dict(base, routes=[{"path": "/p"}, {"path": "/q", "lease": "1s",
                                                                     "heartbeat": "1s"}]),
                                 "routes[1].")
        self.assertIn("heartbeat", out)
        self.check_invalid(dict(base, routes=[{"path": "/p", "scope": ""}]), "routes[0].scope")
        self.check_invalid(dict(base, routes=[{"path": "/p", "scope": "s" * 129}]),
                           "routes[0].scope")
        self.check_invalid(dict(base, routes=[{"path": "/p", "on_unknown": "retry"}]),
                           "routes[0].on_unknown")
        self.check_invalid(dict(base, bogus=1), "bogus")
        self.check_invalid(dict(base, routes=[{"path": "/p", "colour": "red"}]), "colour")
        self.check_invalid(dict(base, store={"map_size": "big"}), "store.map_size")
        self.check_invalid(dict(base, store={"require_local_fs": "no"}), "store.require_local_fs")
        self.check_invalid({"upstream": 42}, "upstream")
        self.check_invalid("{ not json", "")

    def test_check_config_without_upstream_exits_1_unless_given(self):
        # The proxy cannot run without an upstream: check-config must not
        # say the file is fine when `idemproxy --config FILE` would stop.
        path = self.write("noup.json", {"routes": [{"path": "/v1/payments"}]})
        p = self.run_bin("check-config", path)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn(b"upstream", p.stderr)
        self.assertEqual(p.stdout, b"")
        run = self.run_bin("--config", path)
        self.assertEqual(run.returncode, 1)
        # With the overrides the proxy would get, the effective
        # configuration is checked and printed.
        p = self.run_bin("check-config", path, "--upstream", "http://127.0.0.1:9",
                         "--listen", "127.0.0.1:9001", "--store", os.path.join(self.workdir, "s"))
        self.assertEqual(p.returncode, 0, p.stderr)
        eff = json.loads(p.stdout)
        self.assertEqual(eff["upstream"]["url"], "http://127.0.0.1:9")
        self.assertEqual(eff["listen"], "127.0.0.1:9001")
        self.assertEqual(eff["store"]["path"], os.path.join(self.workdir, "s"))
        # An override is checked like the file's own value.
        p = self.run_bin("check-config", path, "--upstream", "ftp://x")
        self.assertEqual(p.returncode, 1)
        self.assertIn(b"--upstream", p.stderr)
        p = self.run_bin("check-config", path, "--config", path)
        self.assertEqual(p.returncode, 2)

    def test_check_config_missing_file_exits_1(self):
        p = self.run_bin("check-config", os.path.join(self.workdir, "nope.json"))
        self.assertEqual(p.returncode, 1)
        self.assertTrue((p.stdout + p.stderr).strip())

    def test_run_with_bad_config_fails_at_start(self):
        path = self.write("bad-run.json", {"listen": "127.0.0.1:%d" % harness.free_port(),
                                           "upstream": self.upstream.url,
                                           "routes": [{"path": "/p", "ttl": "forever"}]})
        p = self.run_bin("--config", path)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("routes[0].ttl", p.stderr.decode("utf-8", "replace"))

    def test_store_path_that_is_a_file_is_named_once(self):
        # The message said the path, and "store", twice: "store X: store:
        # X is not a directory".
        path = self.write("not-a-dir", {})
        p = self.run_bin("--upstream", self.upstream.url, "--store", path,
                         "--listen", "127.0.0.1:%d" % harness.free_port())
        err = p.stderr.decode("utf-8", "replace")
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("is not a directory", err)
        self.assertEqual(err.count(path), 1, err)
        self.assertEqual(err.count("store:") + err.count("store /"), 1, err)

    def test_check_config_looks_at_the_store_path_without_making_it(self):
        """check-config exited 0 for a store.path the proxy then could not
        use (a file, a path under a file, a damaged data file, a directory
        it may not write in), so a deploy gated on it failed at start. It
        now exits 1 naming the problem, and makes nothing: a store not made
        yet stays unmade."""
        cfg = self.write("st.json", {"upstream": "http://127.0.0.1:9"})

        def check(store):
            p = self.run_bin("check-config", cfg, "--store", store)
            return p.returncode, p.stderr.decode("utf-8", "replace")

        a_file = self.write("a-file", "x")
        rc, err = check(a_file)
        self.assertEqual(rc, 1, err)
        self.assertIn("%s is not a directory" % a_file, err)
        rc, err = check(os.path.join(a_file, "st"))
        self.assertEqual(rc, 1, err)
        self.assertIn("Not a directory", err)
        damaged = os.path.join(self.workdir, "damaged")
        os.mkdir(damaged)
        open(os.path.join(damaged, "data.mdb"), "wb").close()
        rc, err = check(damaged)
        self.assertEqual(rc, 1, err)
        self.assertIn("is damaged: data.mdb is 0 bytes", err)
        # Not made yet: fine, and still not made (nor its parents).
        new = os.path.join(self.workdir, "new", "deeper", "st")
        rc, err = check(new)
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(os.path.join(self.workdir, "new")))
        # An existing store (made by a proxy) is fine too.
        proxy = self.start_proxy()
        self.assertExecuted(self.post(proxy, "k1"))
        rc, err = check(self.store_path)
        self.assertEqual(rc, 0, err)
        # A dangling symbolic link: the proxy's mkdir finds it, and fails.
        link = os.path.join(self.workdir, "dangling")
        os.symlink(os.path.join(self.workdir, "nowhere", "st"), link)
        rc, err = check(link)
        self.assertEqual(rc, 1, err)
        self.assertIn("symbolic link to a path that does not exist", err)
        self.assertFalse(os.path.exists(os.path.join(self.workdir, "nowhere")))
        # Permissions, as the checking user. As root (CI), whom permissions
        # do not stop, the checks run as "nobody", from a copy of the binary
        # that user may run.
        ro = os.path.join(self.workdir, "ro")
        os.mkdir(ro)
        os.chmod(ro, 0o555)
        wx = os.path.join(self.workdir, "wx")  # write and search, no listing
        os.mkdir(wx)
        os.chmod(self.workdir, 0o755)
        os.chmod(cfg, 0o644)
        run_as = {}
        binary = harness.binary()
        if os.geteuid() == 0:
            binary = os.path.join(self.workdir, "idemproxy-copy")
            shutil.copy(harness.binary(), binary)
            os.chmod(binary, 0o755)
            nobody = pwd.getpwnam("nobody")
            os.chown(wx, nobody.pw_uid, nobody.pw_gid)
            run_as = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
        os.chmod(wx, 0o300)
        # A store directory the user may use, whose data file it may not
        # write (made by another user, say root).
        files = os.path.join(self.workdir, "files")
        os.mkdir(files)
        with open(os.path.join(files, "data.mdb"), "wb") as f:
            f.write(b"\0" * 8192)
        os.chmod(os.path.join(files, "data.mdb"), 0o400)
        if os.geteuid() == 0:
            os.chown(files, nobody.pw_uid, nobody.pw_gid)
        # The same for the records in flight (store layout 4: inflight/,
        # whose files the proxy writes, and removes after a reboot).
        fl_files = os.path.join(self.workdir, "fl-files")
        os.makedirs(os.path.join(fl_files, "inflight"))
        with open(os.path.join(fl_files, "inflight", "data.mdb"), "wb") as f:
            f.write(b"\0" * 8192)
        os.chmod(os.path.join(fl_files, "inflight", "data.mdb"), 0o400)
        if os.geteuid() == 0:
            os.chown(fl_files, nobody.pw_uid, nobody.pw_gid)
            os.chown(os.path.join(fl_files, "inflight"), nobody.pw_uid, nobody.pw_gid)
        fl_file = os.path.join(self.workdir, "fl-file")
        os.mkdir(fl_file)
        with open(os.path.join(fl_file, "inflight"), "w") as f:
            f.write("x")

        def check_as(store, cwd="/"):
            p = subprocess.run([binary, "check-config", cfg, "--store", store],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=10,
                               cwd=cwd, **run_as)
            return p.returncode, p.stderr.decode("utf-8", "replace")

        rc, err = check_as(os.path.join(ro, "st"))
        self.assertEqual(rc, 1, err)
        self.assertIn("no permission to write in %s" % ro, err)
        self.assertFalse(os.path.exists(os.path.join(ro, "st")))
        # A relative path is looked at from the working directory, and the
        # message says which.
        rc, err = check_as("st", cwd=ro)
        self.assertEqual(rc, 1, err)
        self.assertIn("store.path is relative: looked at from this working directory, %s" % ro,
                      err)
        # The proxy needs to write in and search its directory, not list it.
        rc, err = check_as(wx)
        self.assertEqual(rc, 0, err)
        rc, err = check_as(files)
        self.assertEqual(rc, 1, err)
        self.assertIn("cannot read and write %s" % os.path.join(files, "data.mdb"), err)
        rc, err = check_as(fl_files)
        self.assertEqual(rc, 1, err)
        self.assertIn("cannot read and write %s" % os.path.join(fl_files, "inflight", "data.mdb"),
                      err)
        rc, err = check(fl_file)
        self.assertEqual(rc, 1, err)
        self.assertIn("%s is not a directory" % os.path.join(fl_file, "inflight"), err)

    def test_check_store_finds_a_key_stored_twice(self):
        proxy = self.start_proxy()
        self.assertExecuted(self.post(proxy, "twice-1"))
        self.assertExecuted(self.post(proxy, "twice-2"))
        self.assertEqual(proxy.stop(), 0, proxy.stderr())
        p = self.run_bin("check-store", self.store_path)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        doc = json.loads(p.stdout)
        self.assertEqual((doc["ok"], doc["complete"], doc["duplicate_keys"]), (True, 2, 0), doc)

        # Each COMPLETE record copied into the in-flight table as well, with
        # LMDB's own tools: every key is now in both of the record tables.
        dump = subprocess.run(["mdb_dump", "-s", "records", self.store_path],
                              capture_output=True, check=True, timeout=10).stdout
        # mdb_load takes the table named in the dump's header over -s.
        dump = b"".join(l for l in dump.splitlines(True) if not l.startswith(b"database="))
        subprocess.run(["mdb_load", "-s", "inflight", self.store_path], input=dump,
                       check=True, timeout=10)
        p = self.run_bin("check-store", self.store_path)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        doc = json.loads(p.stdout)
        self.assertEqual((doc["ok"], doc["duplicate_keys"], doc["bad"]), (False, 2, 2), doc)

    def test_help_and_version(self):
        h = self.run_bin("--help")
        self.assertEqual(h.returncode, 0, h.stderr)
        text = (h.stdout + h.stderr).decode()
        for word in ("--config", "--listen", "--upstream", "--store", "check-config"):
            self.assertIn(word, text)
        v = self.run_bin("--version")
        self.assertEqual(v.returncode, 0, v.stderr)
        self.assertRegex((v.stdout + v.stderr).decode(), r"\d+\.\d+\.\d+")
        # Built from a git checkout (as every build of this repository is),
        # it names the commit: two builds of one release told apart.
        head = subprocess.run(["git", "-C", harness.REPO, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True)
        if head.returncode == 0:
            self.assertRegex(v.stdout.decode(), r"^idemproxy \d+\.\d+\.\d+ \(\S*%s\S*\)\n$"
                             % head.stdout.strip())

    def test_upstream_alone_runs_with_defaults(self):
        port = harness.free_port()
        proc = subprocess.Popen([harness.binary(), "--upstream", self.upstream.url,
                                 "--listen", "127.0.0.1:%d" % port],
                                cwd=self.workdir, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            self.assertTrue(harness.wait_for(lambda: _listening(port) or proc.poll() is not None, 10))
            self.assertIsNone(proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
            h = [("Idempotency-Key", "defaults-1"), ("Content-Type", "application/json")]
            first = harness.request(port, "POST", "/any/path", h, b"{}")
            self.assertExecuted(first)
            again = harness.request(port, "POST", "/any/path", h, b"{}")
            self.assertReplayOf(again, first)
            self.assertEqual(self.upstream.count("defaults-1"), 1)
            # The default store path is ./idemproxy-data.
            self.assertTrue(os.path.isdir(os.path.join(self.workdir, "idemproxy-data")))
        finally:
            proc.terminate()
            rc = proc.wait(10)
        self.assertEqual(rc, 0)

    def test_command_line_overrides_the_file(self):
        dead = "http://127.0.0.1:%d" % harness.closed_port()
        cfg = self.config(upstream_url=dead)
        store = os.path.join(self.workdir, "override-store")
        proxy = self.start_proxy(config=cfg, args=["--upstream", self.upstream.url,
                                                   "--store", store])
        self.assertExecuted(self.post(proxy, "override-1"))
        self.assertTrue(os.path.isdir(store), "--store not used")
        self.assertFalse(os.path.exists(self.store_path), "the file's store path was used")

    def start_listening(self, listen, port):
        """Starts a proxy on --listen and returns (process, address it
        reports), once its "listening on" line is out."""
        err_path = os.path.join(self.workdir, "listen-%d.stderr" % port)
        with open(err_path, "wb") as err:
            proc = subprocess.Popen([harness.binary(), "--upstream", self.upstream.url,
                                     "--listen", listen, "--store",
                                     os.path.join(self.workdir, "listen-store")],
                                    cwd=self.workdir, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
        self.addCleanup(lambda: (proc.terminate(), proc.wait(10)))

        def stderr():
            with open(err_path, "rb") as f:
                return f.read().decode("utf-8", "replace")

        def line():
            return next((l for l in stderr().splitlines() if "listening on " in l), None)
        self.assertTrue(harness.wait_for(lambda: line() or proc.poll() is not None, 10))
        self.assertIsNone(proc.poll(), stderr())
        return proc, line().split("listening on ", 1)[1].split(",", 1)[0]

    def test_listen_empty_host_is_ipv4_any_and_brackets_for_ipv6(self):
        port = harness.free_port()
        _, addr = self.start_listening(":%d" % port, port)
        self.assertEqual(addr, "0.0.0.0:%d" % port)
        self.assertTrue(_listening(port))
        if not _ipv6_loopback():
            self.skipTest("no IPv6 loopback here")
        self.assertFalse(_listening(port, "::1"), '":PORT" accepted IPv6')
        port = harness.free_port()
        _, addr = self.start_listening("[::]:%d" % port, port)
        self.assertEqual(addr, ":::%d" % port)
        self.assertTrue(_listening(port, "::1"))
        with open("/proc/sys/net/ipv6/bindv6only") as f:
            dual_stack = f.read().strip() == "0"
        self.assertEqual(_listening(port), dual_stack)

    def test_missing_upstream_is_an_error(self):
        p = self.run_bin("--listen", "127.0.0.1:%d" % harness.free_port())
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("upstream", (p.stdout + p.stderr).decode("utf-8", "replace"))

    def test_option_given_twice_is_an_error(self):
        # Not the last one silently winning: a wrapper that adds its own
        # --store would otherwise run the proxy on a store nobody chose.
        a, b = os.path.join(self.workdir, "a"), os.path.join(self.workdir, "b")
        p = self.run_bin("--upstream", "http://127.0.0.1:9", "--listen",
                         "127.0.0.1:%d" % harness.free_port(), "--store", a, "--store", b)
        out = (p.stdout + p.stderr).decode("utf-8", "replace")
        self.assertEqual(p.returncode, 2, out)
        self.assertIn("--store: given twice", out)
        self.assertFalse(os.path.exists(a) or os.path.exists(b), "a store was created")

    def test_usage_error_is_one_line_and_a_short_usage(self):
        # A mistake on the command line: exit 2, one line naming it, the
        # command's usage line and where the rest is; not the whole --help
        # text (40 lines) burying that one line.
        for args, says in (
                ((), "give --config FILE or --upstream URL"),
                (("--bogus",), "--bogus: unknown option"),
                (("frobnicate",), "frobnicate: unknown command"),
                (("--config", "c.json", "extra"), "extra: unexpected argument"),
                (("--config",), "--config: needs a value"),
                (("--config", "--upstream", "http://127.0.0.1:9"), "--config: needs a value"),
                (("--listen=127.0.0.1:1",), "--listen VALUE"),
                (("check-config",), "check-config: needs FILE"),
                (("check-config", "--bogus"), "check-config: needs FILE"),
                (("check-config", "a.json", "b.json"), "b.json: unexpected argument"),
                (("check-config", "a.json", "--bogus"), "--bogus: unknown option"),
                (("check-config", "a.json", "--config", "b.json"),
                 "--config: not with check-config"),
                (("check-store",), "check-store: needs PATH"),
                (("check-store", "--records", "st"), "check-store: needs PATH"),
                (("check-store", "st", "other"), "other: unexpected argument"),
                (("check-store", "st", "--records", "--records"), "--records: given twice"),
                (("show-key",), "needs PATH SCOPE KEY"),
                (("show-key", "st", "payments"), "KEY missing"),
                (("show-key", "st", "payments", "k", "--force"), "--force: only with forget-key"),
                (("show-key", "st", "payments", "k", "--scope-header-value"),
                 "--scope-header-value: needs a value"),
                (("show-key", "st", "payments", "k", "extra"), "extra: unexpected argument"),
                (("forget-key", "st", "--force", "payments", "k"),
                 "--force: the options come after PATH SCOPE KEY"),
                (("forget-key", "st", "payments", "k", "--force", "--force"),
                 "--force: given twice"),
                (("forget-key", "st", "payments", "k", "--bogus"), "--bogus: unknown option")):
            p = self.run_bin(*args)
            err = p.stderr.decode("utf-8", "replace")
            self.assertEqual(p.returncode, 2, (args, err))
            self.assertEqual(p.stdout, b"", args)
            lines = err.splitlines()
            self.assertTrue(lines[0].startswith("idemproxy: "), (args, err))
            self.assertIn(says, lines[0], (args, err))
            self.assertTrue(lines[1].startswith("usage: idemproxy "), (args, err))
            self.assertEqual(lines[-1], "Try 'idemproxy --help' for more information.", args)
            self.assertLessEqual(len(lines), 5, (args, err))
        # Nothing was created on the way.
        self.assertFalse(os.path.exists(os.path.join(self.workdir, "st")))
        self.assertFalse(os.path.exists(os.path.join(self.workdir, "idemproxy-data")))

    def test_config_file_that_cannot_be_a_configuration_is_named(self):
        os.mkdir(os.path.join(self.workdir, "a-dir"))
        for name, content, says in (
                ("", None, "the configuration file's name is empty"),
                ("a-dir", None, "a-dir: Is a directory"),
                ("nope.json", None, "nope.json: No such file or directory"),
                ("empty.json", "", "empty.json: the file is empty"),
                ("blank.json", " \n\t\n", "blank.json: the file is empty"),
                ("array.json", '["http://127.0.0.1:9"]', "top level: must be an object"),
                ("trailing.json", '{"upstream": "http://127.0.0.1:9"} x',
                 "trailing.json:1:36: end of file expected"),
                ("nul.json", '{"upstream": "http://127.0.0.1:9\\u0000"}',
                 "a string holds \\u0000")):
            if content is not None:
                self.write(name, content)
            for args in (("check-config", name), ("--config", name)):
                p = self.run_bin(*args)
                err = p.stderr.decode("utf-8", "replace")
                self.assertEqual(p.returncode, 1, (args, err))
                self.assertTrue(err.startswith("idemproxy: "), (args, err))
                self.assertEqual(err.count("\n"), 1, (args, err))  # one line
                self.assertIn(says, err, args)
                self.assertNotIn("JSON_ALLOW_NUL", err)
        if os.geteuid() != 0:  # root reads any file
            path = self.write("unreadable.json", {"upstream": "http://127.0.0.1:9"})
            os.chmod(path, 0)
            p = self.run_bin("check-config", path)
            self.assertEqual(p.returncode, 1)
            self.assertIn("unreadable.json: Permission denied", p.stderr.decode())

    def test_key_tools_refuse_a_scope_no_route_can_have(self):
        # A scope with a space (or a control byte) is refused by
        # check-config, so no record has one: "no such key" (exit 1) would
        # send the operator looking for a key that cannot exist.
        proxy = self.start_proxy()
        self.assertEqual(proxy.stop(), 0, proxy.stderr())
        for scope in ("pay ments", "pay\tments", "", "s" * 129):
            for cmd in ("show-key", "forget-key"):
                p = self.run_bin(cmd, self.store_path, scope, "k-1")
                self.assertEqual(p.returncode, 2, (cmd, scope, p.stdout, p.stderr))
                self.assertIn(b"SCOPE: ", p.stderr)
                self.assertEqual(p.stdout, b"")
        p = self.run_bin("show-key", self.store_path, "payments", "k-1")
        self.assertEqual(p.returncode, 1, p.stderr)

    def test_values_and_keys_that_start_with_dashes_are_still_taken(self):
        # A key may be "--force" (a client may send any visible key) and a
        # store directory "--data": the usage errors of 6c2480d refused both,
        # taking them for misplaced options or a missing value.
        proxy = self.start_proxy()
        self.assertExecuted(self.post(proxy, "--force"))
        self.assertEqual(proxy.stop(), 0, proxy.stderr())
        p = self.run_bin("show-key", self.store_path, "payments", "--force")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(json.loads(p.stdout)["found"])
        p = self.run_bin("forget-key", self.store_path, "payments", "--force", "--force")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(json.loads(p.stdout)["forgotten"])
        for key in ("--scope-header-value", "--allow-shared-fs"):
            p = self.run_bin("show-key", self.store_path, "payments", key)
            self.assertEqual(p.returncode, 1, (key, p.stderr))  # none: looked up
        # An option in PATH, SCOPE or KEY's place is still said as that
        # when the command line is wrong either way.
        for args in (("show-key", self.store_path, "--force"),
                     ("forget-key", self.store_path, "--force", "payments", "k"),
                     ("forget-key", self.store_path, "payments", "--force", "k")):
            p = self.run_bin(*args)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertIn(b"--force: the options come after PATH SCOPE KEY", p.stderr, args)
        path = self.write("up.json", {"upstream": "http://127.0.0.1:9"})
        p = self.run_bin("check-config", path, "--store", "--data")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('"path": "--data"', p.stdout.decode())
        # A value that is no URL is said as that, not as a missing value.
        p = self.run_bin("check-config", path, "--upstream", "--x")
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(b'"--x" is not an http:// URL', p.stderr)
        for args in (("--config", "--store", "st"), ("check-config", path, "--store", "--help"),
                     ("--upstream", "--version")):
            p = self.run_bin(*args)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertIn(b": needs a value", p.stderr, args)

    def test_running_without_upstream_says_how_to_give_one(self):
        path = self.write("noup.json", {"routes": [{"path": "/v1/payments"}]})
        p = self.run_bin("--config", path)
        err = p.stderr.decode("utf-8", "replace")
        self.assertEqual(p.returncode, 1, err)
        self.assertIn("upstream: is required", err)
        self.assertIn("--upstream URL", err)

    def test_listen_and_upstream_errors_say_what_is_wrong(self):
        path = self.write("up.json", {"upstream": "http://127.0.0.1:9"})
        for listen, says in (("[::1]", "has no port"),
                             ("127.0.0.1:", "has no port"),
                             ("localhost", "has no port"),
                             ("", "must not be empty"),
                             ("host:99999", "has a port outside 1..65535"),
                             ("127.0.0.1:80x", "has an invalid port"),
                             ("::1:8080", "an IPv6 address goes in brackets"),
                             ("127.1:8080", "four decimal numbers")):
            p = self.run_bin("check-config", path, "--listen", listen)
            err = p.stderr.decode("utf-8", "replace")
            self.assertEqual(p.returncode, 1, (listen, err))
            self.assertIn("--listen: ", err)
            self.assertIn(says, err, listen)
            p = self.check_invalid({"upstream": "http://127.0.0.1:9", "listen": listen}, "listen")
            self.assertIn(says, p, listen)
        self.assertEqual(self.run_bin("check-config", path, "--listen", ":8080").returncode, 0)
        for url, says in (("https://pay.example", "TLS to the upstream is not supported"),
                          ("ftp://x", "is not an http:// URL"),
                          ("127.0.0.1:9000", "is not an http:// URL"),
                          ("http://", "has no host"),
                          ("http://h:99999", "has a port outside 1..65535"),
                          ("http://h:x", "has an invalid port"),
                          ("http://u:pw@h", "has an invalid host"),
                          ("http://h/?a=1", "must not have a query")):
            p = self.run_bin("check-config", path, "--upstream", url)
            err = p.stderr.decode("utf-8", "replace")
            self.assertEqual(p.returncode, 1, (url, err))
            self.assertIn("--upstream: ", err)
            self.assertIn(says, err, url)


def _listening(port, host="127.0.0.1"):
    import socket
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _ipv6_loopback():
    import socket
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


if __name__ == "__main__":
    unittest.main()
