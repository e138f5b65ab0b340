"""bench/run's exit status: 0 only when every target was met with the
targets' own settings; 3 when one was missed; 4 when every one was met but
with --durability interval or --header-memory, which the targets do not use;
a smoke run judges nothing. A --header-memory that is the proxy's
default, in any of its spellings, is a run with the targets' settings."""
import os
import shutil
import tempfile
import types
import unittest

from bench_module import load_bench


class BenchExitStatus(unittest.TestCase):
    def setUp(self):
        self.status = load_bench().exit_status

    def test_targets_settings(self):
        self.assertEqual(self.status(False, [], "sync", None), (0, None))
        code, why = self.status(False, ["unique / nginx_proxy (req/s)"], "sync", None)
        self.assertEqual(code, 3)
        self.assertIn("unique / nginx_proxy", why)

    def test_other_settings_never_exit_0(self):
        for durability, header_memory, named in (("interval", None, "--durability interval"),
                                                 ("sync", "8KiB", "--header-memory 8KiB")):
            code, why = self.status(False, [], durability, header_memory)
            self.assertEqual(code, 4)
            self.assertIn(named, why)
        # A miss still says 3, whatever the settings.
        self.assertEqual(self.status(False, ["x"], "interval", "8KiB")[0], 3)

    def test_smoke_judges_nothing(self):
        self.assertEqual(self.status(True, ["x"], "interval", "8KiB"), (0, None))


class BenchDefaultHeaderMemory(unittest.TestCase):
    """bench/run asks the real proxy (check-config) what a --header-memory
    amounts to, and drops one that is the default."""

    def setUp(self):
        self.bench = load_bench()
        work = tempfile.mkdtemp(prefix="bench-hm.")
        self.addCleanup(shutil.rmtree, work, True)
        self.ctx = types.SimpleNamespace(idemproxy=os.environ["IDEMPROXY_BIN"], work=work,
                                         durability="sync")

    def effective(self, header_memory):
        return self.bench.effective_header_memory(self.ctx, header_memory)

    def test_default_in_other_spellings(self):
        default = self.effective(None)
        for spelling in ("16KiB", "16384", "16384B"):
            self.assertEqual(self.effective(spelling), default, spelling)

    def test_other_sizes_differ(self):
        self.assertNotEqual(self.effective("8KiB"), self.effective(None))

    def test_refused_size_fails_the_run(self):
        with self.assertRaises(self.bench.BenchError):
            self.effective("bogus")


if __name__ == "__main__":
    unittest.main()
