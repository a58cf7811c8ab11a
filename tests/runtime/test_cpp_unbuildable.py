"""A C++ target that cannot build never degrades silently (kiln/runtime/cpp_build.py): bad ``cpp_flags``, a
``cpp_compiler`` that does not exist, a machine without g++ each warn once per process, naming the option or
the missing program, the compiler's first error line and that the graphs run ATen kernels instead; results
stay right. Each test uses names of its own (a flag, a path), so that "once per process" holds across tests."""
import uuid
import warnings

import pytest
import torch

import kiln
from kiln.options import current
from kiln.runtime import cpp_build

HAS_CXX = bool(cpp_build.find_compiler(current()))


def _run_twice(**options):
    """Two different graphs compiled with ``options``: the RuntimeWarnings of each, and the results checked."""
    caught = []
    for i in range(2):
        torch._dynamo.reset()
        x = torch.randn(6)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = kiln.compile(lambda x: torch.sigmoid(x) * x + i, **options)(x)
        torch.testing.assert_close(out, torch.sigmoid(x) * x + i)
        caught.append([str(m.message) for m in w if m.category is RuntimeWarning and "C++" in str(m.message)])
    return caught


@pytest.mark.skipif(not HAS_CXX, reason="needs a C++ compiler")
@pytest.mark.parametrize("codegen", ["auto", "cpp"])
def test_bad_cpp_flags_warn_once_with_the_compilers_error(codegen):
    flag = f"-fnot-a-flag-{uuid.uuid4().hex[:8]}"
    kiln.counters["codegen"].clear()
    first, second = _run_twice(codegen=codegen, cpp_flags=f"-O1 {flag}")
    assert len(first) == 1 and second == [], (first, second)
    (msg,) = first
    assert f"cpp_flags='-O1 {flag}'" in msg and "error" in msg and flag in msg.split("error", 1)[1], msg
    assert "run ATen kernels instead" in msg if codegen == "auto" else "kernels run as ATen instead" in msg
    # 'auto' resolves to the ATen target (no kernel generated); 'cpp' generates its kernels, whose build fails,
    # and the compiled graph runs its ATen graph instead (the values above)
    assert kiln.counters["codegen"]["kernels"] == 0 or codegen == "cpp"
    assert kiln.counters["codegen"]["cpp_build_failed"] == (2 if codegen == "cpp" else 0)


@pytest.mark.parametrize("codegen", ["auto", "cpp"])
def test_a_cpp_compiler_that_does_not_exist_warns_once(codegen):
    path = f"/nonexistent/g++-{uuid.uuid4().hex[:8]}"
    first, second = _run_twice(codegen=codegen, cpp_compiler=path)
    assert len(first) == 1 and second == [], (first, second)
    assert f"cpp_compiler={path!r} is not a program" in first[0] and "ATen" in first[0], first[0]
    assert "codegen='aten'" in first[0]   # how to choose ATen kernels without the warning


def test_a_machine_without_a_cpp_compiler_warns_once(monkeypatch, tmp_path):
    cxx = f"c++-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PATH", str(tmp_path))   # nothing on it: no g++, no clang++
    monkeypatch.setenv("CXX", cxx)
    first, second = _run_twice()
    assert len(first) == 1 and second == [], (first, second)
    assert f"$CXX={cxx!r}, g++ and clang++ are not on PATH" in first[0] and "ATen kernels instead" in first[0]
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # codegen='aten' asks for ATen: nothing to warn about
        kiln.compile(lambda x: x.cos(), codegen="aten")(torch.randn(3))
