"""The ``kiln`` command: versions, ``python -m kiln``, help and unknown commands."""
import subprocess
import sys

import torch

from kiln import __version__
from kiln.cli import main


def test_version_names_kiln_and_torch(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kiln {__version__} (torch {torch.__version__}")


def test_python_dash_m_kiln_runs_the_command():
    res = subprocess.run([sys.executable, "-m", "kiln", "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("kiln "), res.stderr[-2000:]


def test_help_and_unknown_commands(capsys):
    assert main(["options", "--help"]) == 0
    assert "usage: kiln options" in capsys.readouterr().out   # not the options themselves
    assert main(["cache", "--help"]) == 0 and "usage: kiln cache" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and "usage: kiln demo" in err
    assert main(["--help"]) == 0 and "usage:" in capsys.readouterr().out


def test_readme_quick_start_runs_as_written(tmp_path):
    """The README's Quick start block runs as it stands (it named an undefined ``MyModel``)."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "README.md")).read()
    block = text[text.index("## Quick start"):]
    start = block.index("```python") + len("```python")
    code = block[start:block.index("```", start)]
    script = tmp_path / "quick_start.py"
    script.write_text(code + "\nprint('ok', len(sources), len(stages))\n")
    env = {**os.environ, "PYTHONPATH": root, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-3000:]


def _child(code: str, *args) -> subprocess.CompletedProcess:
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args, *(["-c", code] if code else [])], capture_output=True, text=True,
                          timeout=300, env=env, cwd=root)


def test_tool_commands_load_kiln_bench_when_they_run():
    """The tools live beside kiln (kiln_bench): ``import kiln`` and its command line load none of them;
    ``kiln bench`` imports kiln_bench's bench and nothing else of the tools."""
    r = _child("import sys, kiln, kiln.cli\n"
               "assert not [m for m in sys.modules if m.startswith('kiln_bench')]\n"
               "assert kiln.cli.main(['bench', '--list', '--suite', 'micro']) == 0\n"
               "assert 'kiln_bench.cli' in sys.modules and 'kiln_bench.demo' not in sys.modules\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "swish" in r.stdout


def test_a_tool_command_without_the_tools_says_how_to_get_them():
    r = _child("import sys\n"
               "sys.modules['kiln_bench'] = None\n"   # as where only kiln is installed
               "from kiln.cli import main\n"
               "assert main(['demo']) == 1\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kiln demo: the tools (the kiln_bench package) are not installed" in r.stderr, r.stderr


def test_python_dash_m_kiln_bench_is_kiln_bench():
    r = _child(None, "-m", "kiln_bench", "--help")
    assert r.returncode == 0 and "--suite" in r.stdout, r.stderr[-3000:]


def test_options_name_shows_that_option(capsys):
    """``kiln options NAME``: help, default, environment variable and choices; ``tuning.<name>`` too; an unknown
    name exits 2 with the nearest names; no name lists every option."""
    assert main(["options", "codegen"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("codegen: ") and "default:     'auto'" in out and "KILN_CODEGEN" in out
    assert "choices:     'auto', 'aten', 'triton', 'cpp'" in out and "freezing" not in out
    assert main(["options", "tuning.persistent_max"]) == 0
    out = capsys.readouterr().out
    assert "KILN_TUNING_PERSISTENT_MAX" in out and "choices" not in out
    assert main(["options", "pre_grad_custom_pass"]) == 0
    out = capsys.readouterr().out
    assert "environment: - (set in code)" in out and "choices:     None, a callable" in out
    assert main(["options", "freezng"]) == 2
    assert "no option 'freezng'; did you mean freezing?" in capsys.readouterr().err
    assert main(["options", "persistent_max"]) == 2
    assert "did you mean tuning.persistent_max?" in capsys.readouterr().err
    assert main(["options"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) > 40 and any(ln.startswith("freezing ") for ln in listed)


def test_version_is_fast_and_imports_no_torch():
    """The ``kiln`` console script (pyproject's [project.scripts]) answers --version without importing torch
    or kiln: under 0.5 s of CPU for the whole process (CPU time, not wall time: the test machine is shared),
    with the same line as ``kiln.cli``'s."""
    import os
    import resource
    import tomllib
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        module, func = tomllib.load(fh)["project"]["scripts"]["kiln"].split(":")
    code = (f"import sys\nfrom {module} import {func} as main\nrc = main(['--version'])\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'kiln')]\n"
            "assert rc == 0 and not heavy, (len(heavy), heavy[:5])\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _child(code)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.returncode == 0, r.stderr[-3000:]
    from kiln.cli import version
    assert r.stdout.strip() == version()
    assert cpu < 0.5, f"kiln --version took {cpu:.2f} s of CPU"
