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


# -- the supported torch range -----------------------------------------------------------------------
@pytest.mark.parametrize("version,ok", [("2.10.2", False), ("2.11.0", True), ("2.13.0+cpu", True),
                                        ("2.14.1+cu128", True), ("2.14.0a0+gitabc", True),
                                        ("2.15.0.dev20260301", False), ("3.0.0", False)])
def test_torch_outside_the_supported_range_warns(version, ok):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert compat.check_torch_version(version) is ok
    if ok:
        assert not seen
    else:
        assert len(seen) == 1 and seen[0].category is UserWarning
        msg = str(seen[0].message)
        assert f"this is torch {version}" in msg and "torch>=2.11,<2.15" in msg and "2.11 to 2.14" in msg, msg


def test_import_kiln_warns_once_for_an_unsupported_torch():
    r = _python("import importlib, warnings, torch\n"
                "warnings.simplefilter('always')\n"
                "torch.__version__ = '2.10.0'\n"   # torch's, in this child process only
                "import kiln\n"
                "import kiln\n"
                "assert kiln.compat.TORCH_VERSION == (2, 10)\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("kiln supports torch>=2.11,<2.15") == 1, r.stderr


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
