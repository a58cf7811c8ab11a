"""Package conventions (#20): project metadata, the bench extra, the supported torch range, the time
``import kiln`` takes, and the public API."""
import inspect
import os
import subprocess
import sys
import tomllib
import warnings

import pytest

import kiln
from kiln import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]


def _python(code: str, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


# -- import time -------------------------------------------------------------------------------------
def test_import_kiln_takes_under_0_3_s_after_torch():
    from importlib.metadata import entry_points
    if "kiln" not in entry_points(group="torch_dynamo_backends").names:
        pytest.skip("kiln is not pip-installed here: without its entry point, import kiln registers the "
                    "backend itself, which imports Dynamo")
    code = ("import sys, time, torch\n"
            "t = time.perf_counter()\n"
            "import kiln\n"
            "print(time.perf_counter() - t, 'torch._dynamo' in sys.modules)\n")
    runs = []
    for _ in range(3):
        r = _python(code)
        assert r.returncode == 0, r.stderr[-3000:]
        seconds, dynamo = r.stdout.split()
        assert dynamo == "False", "import kiln imported torch._dynamo (about a second)"
        runs.append(float(seconds))
    assert min(runs) < 0.3, runs
