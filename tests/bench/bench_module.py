"""bench/run (a script without a .py suffix) loaded as a module, for the
tests of its own code."""
import importlib.machinery
import importlib.util
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def load_bench():
    spec = importlib.util.spec_from_loader(
        "bench_run", importlib.machinery.SourceFileLoader(
            "bench_run", os.path.join(ROOT, "bench", "run")))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
