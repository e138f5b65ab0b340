"""test_shared_fs_refused.py - a store on a network file system is refused.

LMDB's locks and shared memory map do not work on a remote file system: two
hosts mounting one NFS volume would each take the writer lock and run the
same key twice (lmdb.h, caveats). So a proxy refuses, at start and by name,
a store whose directory is on NFS, SMB/CIFS, Ceph, 9p, FUSE and the like
(store_shared_fs_name in store/store.c); a read-only `check-store` is still
allowed there.

No test can mount a network file system on this machine, so the fault build
takes the file system type statfs() would give from IDEM_FAULT_FS_TYPE
(store_lmdb.c, check_file_system); everything after statfs() is the real
path: the proxy's start, its message and its exit status. The same build
with this machine's own type (read by `stat -f`) must start.
"""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import harness  # noqa: E402


def run(args, fs_type, timeout=20):
    env = dict(os.environ)
    env["IDEM_FAULT_FS_TYPE"] = fs_type
    return subprocess.run([harness.binary()] + args, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=timeout)


class SharedFileSystemRefused(harness.ProxyTestCase):
    def cfg(self):
        path = os.path.join(self.workdir, "p.json")
        cfg = self.config()
        cfg["listen"] = "127.0.0.1:%d" % harness.free_port()
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path

    def test_network_file_systems_are_refused_at_start(self):
        cfg = self.cfg()
        for fs_type, name in (("0x6969", "NFS"), ("0xFF534D42", "CIFS"), ("0x65735546", "FUSE"),
                              ("0x00C36400", "Ceph"), ("0x01021997", "9p")):
            p = run(["--config", cfg], fs_type)
            err = p.stderr.decode("utf-8", "replace")
            self.assertNotEqual(p.returncode, 0, "%s: started (%s)" % (name, err))
            self.assertIn("is on %s (file system type" % name, err)
            self.assertIn("Put store.path on a local disk", err)
            self.assertIn("set store.require_local_fs to false", err)
            # Refused before anything was created in it.
            self.assertFalse(os.path.exists(os.path.join(self.store_path, "data.mdb")), name)

    def test_require_local_fs_false_starts_there_and_says_so(self):
        # The operator's way out, for a store only this host's processes open
        # (a FUSE or virtiofs mount in a VM or a container): it starts, works,
        # and warns once at start, naming the file system.
        cfg = self.config(store={"require_local_fs": False})
        q = harness.Proxy(self.workdir, cfg, "fuse", env=dict(os.environ,
                                                            IDEM_FAULT_FS_TYPE="0x65735546"))
        self.proxies.append(q)
        q.start()
        first = self.post(q, "k1")
        self.assertEqual(first.status, 201)
        again = self.post(q, "k1")
        self.assertEqual(again.status, 201)
        self.assertEqual(again.header("Idempotent-Replayed"), "true")
        self.assertEqual(self.upstream.count("k1"), 1)
        err = q.stderr()
        self.assertIn("warning: %s is on FUSE" % self.store_path, err)
        self.assertIn("if another host opens it, the same key can run twice", err)
        q.stop()
        # On a local file system the setting changes nothing and says nothing.
        r = harness.Proxy(self.workdir, cfg, "local-too")
        self.proxies.append(r)
        r.start()
        self.assertEqual(self.post(r, "k1").header("Idempotent-Replayed"), "true")
        r.stop()
        self.assertNotIn("warning", r.stderr())

    def test_a_local_file_system_starts_and_check_store_reads_anywhere(self):
        here = subprocess.run(["stat", "-f", "-c", "0x%t", self.workdir], capture_output=True,
                              check=True).stdout.decode().strip()
        p = self.start_proxy()  # no IDEM_FAULT_FS_TYPE: the real statfs
        self.assertEqual(self.post(p, "k1").status, 201)
        p.stop()
        # This machine's own type given back through the variable: starts.
        env = dict(os.environ, IDEM_FAULT_FS_TYPE=here)
        q = harness.Proxy(self.workdir, self.config(), "local", env=env)
        self.proxies.append(q)
        q.start()
        self.assertEqual(self.post(q, "k1").status, 201)
        q.stop()
        # check-store opens read-only: allowed on any file system.
        c = run(["check-store", self.store_path], "0x6969")
        self.assertEqual(c.returncode, 0, c.stderr)
        self.assertIn(b'"ok":true', c.stdout)

    def test_forget_key_on_a_shared_fs_only_with_allow_shared_fs(self):
        # The operator's tool follows the proxy's rule: it writes, so it is
        # refused there by name, and says how to go on; --allow-shared-fs
        # is store.require_local_fs false for it.
        cfg = self.config(store={"require_local_fs": False})
        q = harness.Proxy(self.workdir, cfg, "fuse", env=dict(os.environ,
                                                            IDEM_FAULT_FS_TYPE="0x65735546"))
        self.proxies.append(q)
        q.start()
        self.assertEqual(self.post(q, "k1").status, 201)
        q.stop()
        args = ["forget-key", self.store_path, "payments", "k1"]
        p = run(args, "0x65735546")
        err = p.stderr.decode("utf-8", "replace")
        self.assertEqual(p.returncode, 2, err)
        self.assertIn("is on FUSE (file system type", err)
        self.assertIn("give --allow-shared-fs", err)
        self.assertEqual(self.upstream.count("k1"), 1)
        p = run(args + ["--allow-shared-fs"], "0x65735546")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(json.loads(p.stdout)["was"], "complete")
        # show-key reads only: it needs no switch, and takes none.
        p = run(["show-key", self.store_path, "payments", "k1"], "0x65735546")
        self.assertEqual(p.returncode, 1, p.stderr)
        p = run(["show-key", self.store_path, "payments", "k1", "--allow-shared-fs"], "0x6969")
        self.assertEqual(p.returncode, 2, p.stderr)


if __name__ == "__main__":
    unittest.main()
