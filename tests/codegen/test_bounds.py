"""Bounds checks of indirect indices (issue #32, item 3): on the C++ target and Triton's interpreter, an
out-of-range index of ``x[i]``, ``embedding``, ``index_select``, ``gather`` and ``nll_loss``/``cross_entropy``
raises eager's exception with eager's message (no read out of bounds, no crash: an index of 10**12 killed
the process), in-range indices give eager's values, and indices kiln proves in range (an arange, a clamp,
a ``% n``, an argmax, ``take_along_dim``'s remainder) are not checked."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.debug import counters
from kiln.options import current
from kiln.runtime import cpp_build
from tests.codegen.util import decompositions, fuse_graph, kernels

TARGETS = ["cpp", "triton"]
NO_CXX = not cpp_build.find_compiler(current())


def _fused(fn, *args, target, mode="fake", **opts):
    if target == "cpp" and NO_CXX:
        pytest.skip("no C++ compiler")
    with torch.fx.traceback.preserve_node_meta():   # as AOTAutograd traces: nodes name the op they decompose
        gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode=mode)(*args)
    assert fuse_graph(gm, args, current(codegen=target, **opts)).kernels > 0
    return gm


def _same_error(fn, good, bad, target, **opts):
    """``fn`` fused once: eager's values on ``good`` arguments, eager's exception (type and message) on each
    of ``bad``, from the same compiled graph."""
    gm = _fused(fn, *good, target=target, **opts)
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and not hasattr(n.target, "source")], gm.code
    torch.testing.assert_close(gm(*good), fn(*good))
    for args in bad:
        with pytest.raises(Exception) as ref:
            fn(*args)
        with pytest.raises(type(ref.value)) as got:
            gm(*args)
        assert type(got.value) is type(ref.value) and str(got.value) == str(ref.value).splitlines()[0]
    return gm


X = torch.randn(5, 3)
W = torch.randn(6, 4)


@pytest.mark.parametrize("target", TARGETS)
def test_getitem(target):
    fn = lambda x, i: x[i] * 2  # noqa: E731
    _same_error(fn, (X, torch.tensor([1, -5, 4, -1])), [(X, torch.tensor([1, 10, 0, 0])),
                                                        (X, torch.tensor([0, 1, -6, 2]))], target)
    fn2 = lambda x, i: x[:, i] + 1  # noqa: E731
    _same_error(fn2, (X, torch.tensor([2, 0], dtype=torch.int32)), [(X, torch.tensor([0, 3], dtype=torch.int32))],
                target)


@pytest.mark.parametrize("target", TARGETS)
def test_embedding_and_index_select(target):
    emb = lambda w, i: F.embedding(i, w) * 2  # noqa: E731
    _same_error(emb, (W, torch.tensor([[0, 5], [3, 3]])),
                [(W, torch.tensor([[0, 6], [1, 1]])), (W, torch.tensor([[0, -1], [1, 1]])),
                 (W, torch.tensor([[0, 10 ** 12], [1, 1]]))], target)   # 10**12: the process died
    sel = lambda x, i: torch.index_select(x, 1, i) - 1  # noqa: E731
    _same_error(sel, (X, torch.tensor([2, 0, 1])), [(X, torch.tensor([2, 3, 0])), (X, torch.tensor([-1, 0, 0]))],
                target)


@pytest.mark.parametrize("target", TARGETS)
def test_gather(target):
    fn = lambda x, i: torch.gather(x, 1, i) * 2  # noqa: E731
    i = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0], [1, 2]])
    bad = i.clone()
    bad[3, 1] = 3
    neg = i.clone()
    neg[0, 0] = -1
    _same_error(fn, (X, i), [(X, bad), (X, neg)], target)


@pytest.mark.parametrize("target", TARGETS)
def test_nll_loss_and_cross_entropy(target):
    logits = torch.randn(4, 5)
    t = torch.tensor([1, 4, -100, 0])
    ce = lambda a, t: F.cross_entropy(a, t)  # noqa: E731
    _same_error(ce, (logits, t), [(logits, torch.tensor([1, 7, 0, 0])), (logits, torch.tensor([1, -3, 0, 0]))],
                target)
    nll = lambda a, t, w: F.nll_loss(a.log_softmax(1), t, weight=w, reduction="none")  # noqa: E731
    w = torch.rand(5)
    _same_error(nll, (logits, t, w), [(logits, torch.tensor([5, 0, 0, 0]), w)], target)


@pytest.mark.parametrize("target", TARGETS)
def test_scatters_raise(target):
    """Writes through an index (scatter kernels of both targets), with dynamic sizes too (Triton's write then
    runs under ``if out0.numel():``)."""
    x, v = torch.zeros(5, 3), torch.ones(2, 3)
    for fn, good, bad in [(lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True), [1, -1], [1, -6]),
                          (lambda x, i, v: torch.index_copy(x, 0, i, v), [1, 4], [1, 5]),
                          (lambda x, i, v: torch.index_add(x, 0, i, v), [1, 1], [1, -1]),
                          (lambda x, i, v: torch.scatter_add(x, 0, i.view(2, 1).expand(2, 3), v), [4, 0], [5, 0])]:
        _same_error(fn, (x, torch.tensor(good), v), [(x, torch.tensor(bad), v)], target)
    fn = lambda x, i: x.index_fill(0, i, 0.5) * 2  # noqa: E731
    gm = _fused(fn, torch.zeros(6, 3), torch.tensor([1, -1]), target=target, mode="symbolic")
    x = torch.randn(7, 2)
    torch.testing.assert_close(gm(x, torch.tensor([0, -7])), fn(x, torch.tensor([0, -7])))
    with pytest.raises(IndexError, match=r"^index 7 is out of bounds for dimension 0 with size 7$"):
        gm(x, torch.tensor([1, 7]))


@pytest.mark.parametrize("target", TARGETS)
def test_proven_indices_are_not_checked(target):
    """take_along_dim (a gather of ``index % size``: eager wraps any index), an arange, a clamp, an argmax over
    the gathered dim: eager's values, and no check (index_checks='always' checks them anyway)."""
    x = torch.randn(5, 7)
    i = torch.tensor([[1, 13, -20, 4, 0, 2, 6]])
    cases = [(lambda x, i: torch.take_along_dim(x, i, 0) * 2, (x, i)),
             (lambda x: x[torch.arange(-5, 0)] * 2, (x,)),
             (lambda x, i: x[i.clamp(0, 4)] * 2, (x, i.view(-1))),
             (lambda x: x.gather(1, x.argmax(1, keepdim=True)) * 2, (x,))]
    for fn, args in cases:
        before = counters["codegen"]["index_checks"], counters["codegen"]["index_proven"]
        gm = _fused(fn, *args, target=target)
        torch.testing.assert_close(gm(*args), fn(*args))
        assert counters["codegen"]["index_checks"] == before[0]
        assert counters["codegen"]["index_proven"] > before[1]
    before = counters["codegen"]["index_checks"]
    _fused(cases[0][0], *cases[0][1], target=target, index_checks="always")
    assert counters["codegen"]["index_checks"] == before + 1


@pytest.mark.parametrize("target", TARGETS)
def test_masked_lanes_raise_nothing(target):
    """An index read under a mask (a padded embedding, a gather concatenated with another tensor): lanes the
    mask turns off index nothing, so no error where eager has none."""
    fn = lambda w, i, z: torch.cat([F.pad(F.embedding(i + 1, w), (1, 2)), z], 0)  # noqa: E731
    args = (W, torch.tensor([0, 4, 2]), torch.randn(2, 7))
    gm = _fused(fn, *args, target=target)
    torch.testing.assert_close(gm(*args), fn(*args))
    with pytest.raises(IndexError, match="index out of range in self"):
        gm(W, torch.tensor([0, 5, 2]), args[2])


def test_compiled_function_raises_and_keeps_its_kernels():
    """Through torch.compile (C++, dynamic sizes): the first call raising eager's error does not make the kernel
    fall back to ATen for good, and the message names the size of the call."""
    if NO_CXX:
        pytest.skip("no C++ compiler")
    from kiln.runtime import kernels as kernel_cache
    kernel_cache.reset()
    fn = torch.compile(lambda x, i: x[i] * 2, backend="kiln", dynamic=True,
                       options={"codegen": "cpp", "cache": False})
    before = counters["codegen"]["runtime_fallback"]
    with pytest.raises(IndexError, match=r"^index 9 is out of bounds for dimension 0 with size 7$"):
        fn(torch.randn(7, 3), torch.tensor([1, 9]))
    x = torch.randn(8, 3)
    torch.testing.assert_close(fn(x, torch.tensor([7, -8])), x[torch.tensor([7, -8])] * 2)
    with pytest.raises(IndexError, match=r"^index -9 is out of bounds for dimension 0 with size 8$"):
        fn(x, torch.tensor([-9]))
    assert counters["codegen"]["runtime_fallback"] == before


def test_unchecked_when_asked():
    """index_checks='never': no check is emitted (the old wrapped, unchecked load)."""
    before = counters["codegen"]["index_checks"]
    gm = _fused(lambda x, i: x[i] * 2, X, torch.tensor([1, 2]), target="triton", index_checks="never")
    torch.testing.assert_close(gm(X, torch.tensor([1, -2])), X[torch.tensor([1, -2])] * 2)
    assert counters["codegen"]["index_checks"] == before


def test_a_checked_gather_still_vectorizes():
    """A gather whose index varies per element checks it in the vectorized loop: a select and an unsigned max
    per lane, the loads stay vector gathers wherever the host's compiler makes the unchecked loop's loads
    vector gathers (its tuning decides: gcc does not emit gathers for every x86-64 CPU it targets)."""
    flags = open("/proc/cpuinfo").read() if shutil.os.path.exists("/proc/cpuinfo") else ""
    if NO_CXX or " avx2" not in flags or not shutil.which("objdump"):
        pytest.skip("no C++ compiler, AVX2 host or objdump")
    x, i = torch.randn(16, 256), torch.randint(0, 256, (16, 256))

    def gathers(gm, checked):
        name = re.search(rf"cpp_build\.function\('(\w+)', \d+, \d+{', checked=True' if checked else ''}\)",
                         kernels(gm)[0].source).group(1)
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", cpp_build.library(name)], capture_output=True,
                             text=True).stdout
        mine = "\n".join(f for f in re.split(r"\n\n(?=[0-9a-f]+ <)", asm) if f"<{name}" in f.split("\n")[0])
        return bool(re.search(r"\sv\w*gather\w*\s", mine))
    plain = _fused(lambda x, i: torch.gather(x, 1, i) * 2, x, i, target="cpp", index_checks="never")
    if not gathers(plain, False):
        pytest.skip("this host's compiler makes no vector gather of the unchecked loop either")
    gm = _same_error(lambda x, i: torch.gather(x, 1, i) * 2, (x, i), [(x, i.clamp(max=255) + 1)], "cpp")
    assert gathers(gm, True), "the checked gather loop is not vectorized"


@pytest.mark.gpu
def test_cuda_kernels_assert_on_the_device():
    """On CUDA (compiled Triton): in-range indices give eager's values; an out-of-range one trips the kernel's
    device assert (as eager's CUDA kernels do), in a child process since that poisons its CUDA context."""
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F, kiln
        w = torch.randn(6, 4, device="cuda")
        fn = torch.compile(lambda w, i: F.embedding(i, w) * 2, backend="kiln", options={"cache": False})
        i = torch.tensor([0, 5, 3], device="cuda")
        torch.testing.assert_close(fn(w, i), F.embedding(i, w) * 2)
        a = torch.randn(4, 5, device="cuda")
        ce = torch.compile(lambda a, t: F.cross_entropy(a, t), backend="kiln", options={"cache": False})
        t = torch.tensor([1, 4, -100, 0], device="cuda")
        torch.testing.assert_close(ce(a, t), F.cross_entropy(a, t))
        print("VALUES OK", flush=True)
        fn(w, torch.tensor([0, 6, 3], device="cuda"))
        torch.cuda.synchronize()
        print("NO ASSERT", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "VALUES OK" in out.stdout, out.stderr[-3000:]
    assert "NO ASSERT" not in out.stdout and out.returncode != 0
    assert re.search(r"device-side assert|Assertion|index out of bounds", out.stderr), out.stderr[-3000:]

