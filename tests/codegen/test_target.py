"""Code generation targets (``codegen/target.py``) and the data code generation returns: one ``Target`` per
generator, resolved once; kernels generated as values (``generate``), put into the graph by ``rewrite``,
plain data (``KernelRef``) until the runtime binds them; reductions split by the scheduler alone."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.codegen.generate import generate
from kiln.codegen.lower import Lowering
from kiln.codegen.ir.loops import Reduction
from kiln.codegen.schedule.split import split_reductions
from kiln.codegen.target import CppTarget, Target, TritonTarget, resolve
from kiln.codegen.text.source import KernelRef
from kiln.options import current
from kiln.runtime import cpp_build
from kiln.runtime.load import bind_graph
from tests.codegen.util import decompositions, fuse_graph


def _graph(fn, *args):
    return make_fx(fn, decomposition_table=decompositions(), tracing_mode="fake")(*args)


def test_resolve_gives_one_target_per_generator():
    x = torch.randn(4)
    assert type(resolve(current(codegen="aten"), [x])) is Target
    assert type(resolve(current(codegen="triton"), [x])) is TritonTarget
    assert type(resolve(current(codegen="cpp"), [x])) is CppTarget
    auto = resolve(current(codegen="auto"), [x])   # CPU inputs: C++ where a compiler works, else ATen
    assert auto.name == ("cpp" if not cpp_build.unusable(current()) else "aten")
    assert resolve(current(codegen="auto", cpp_compiler="/nonexistent/c++"), [x]).name == "aten"


def test_targets_own_their_decompositions_flags_and_cache_key():
    aten, triton, cpp = (resolve(current(codegen=c), []) for c in ("aten", "triton", "cpp"))
    layer_norm = torch.ops.aten.native_layer_norm.default
    assert layer_norm not in aten.decompositions() and layer_norm in triton.decompositions()
    assert triton.decompositions().keys() == cpp.decompositions().keys()
    assert (aten.fuses, triton.fuses, cpp.fuses) == (False, True, True)
    assert (aten.mkldnn, triton.mkldnn, cpp.mkldnn) == (True, False, True)   # freezing's CPU convolutions
    assert aten.cache_key() == "aten" and triton.cache_key() == "triton"
    assert cpp.cache_key().startswith("cpp|cxx=") and cpp_build.host_isa() in cpp.cache_key()
    plan = type("P", (), {"device": torch.device("cpu")})()
    assert triton.flags(plan).interpret and not TritonTarget(current(emit_for="cuda")).flags(plan).interpret
    assert not triton.cuda_graphs() and not aten.cuda_graphs()


def test_generation_returns_data_and_leaves_the_graph_alone():
    x = torch.randn(8, 32)
    gm = _graph(lambda x: torch.softmax(x * 2, -1) + 1, x)
    before = gm.code
    target = TritonTarget(current(codegen="triton"))
    code = generate(gm, target.opts, lambda plans, on_cuda: target.emit(plans, target.opts, on_cuda))
    assert gm.code == before and code.kernels and code.unit is None
    assert all(isinstance(k.target, KernelRef) and k.target.name in k.target.source for k in code.kernels)
    assert all(not isinstance(n.target, KernelRef) for n in gm.graph.nodes)


def test_kernel_nodes_are_data_until_the_runtime_binds_them():
    x = torch.randn(8, 32)
    gm = _graph(lambda x: torch.sigmoid(x) * x, x)
    assert fuse_graph(gm, [x], current(codegen="triton"), bind=False).kernels == 1
    (ref,) = [n.target for n in gm.graph.nodes if isinstance(n.target, KernelRef)]
    with pytest.raises(RuntimeError, match="is not bound"):
        gm(x)
    assert bind_graph(gm) == 1 and not any(isinstance(n.target, KernelRef) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), torch.sigmoid(x) * x)


def test_lowering_emits_whole_reductions_and_the_scheduler_splits_them():
    """A long full sum and a column sum: lowering makes one reduction each; the scheduler cuts them (a
    partial buffer before each final, which keeps its buffer)."""
    x = torch.randn(512, 64)
    gm = _graph(lambda x: (x.sum(), x.sum(0)), x)
    tuning = current(tuning=dict(split_min_r=32, split_min_numel=256, split_min_chunk_outer=8, fold="never")).tuning
    lw = Lowering(gm, current()).run()
    reds = [b for b in lw.computed if isinstance(b.compute, Reduction)]
    assert len(reds) == 2 and not any(b.compute.split or b.compute.fold for b in reds)
    assert split_reductions(lw, tuning) == 2
    for b in reds:
        assert b.compute.split and lw.computed[lw.computed.index(b) - 1].compute.reduced


def test_interpreted_bf16_scatter_add_is_declined_by_the_triton_target():
    """numpy has no bf16 atomics: Triton's target (not the lowering) leaves that scatter to ATen."""
    idx, src = torch.tensor([0, 2, 2]), torch.randn(3, 4, dtype=torch.bfloat16)

    def fn(base, idx, src):
        return base.index_add(0, idx, src * 2)
    base = torch.zeros(4, 4, dtype=torch.bfloat16)
    gm = _graph(fn, base, idx, src)
    fuse_graph(gm, [base, idx, src], current(codegen="triton"))
    torch.testing.assert_close(gm(base, idx, src), fn(base, idx, src))
    assert not any("atomic_add" in getattr(n.target, "source", "") for n in gm.graph.nodes)
    # lowered, then declined: its ATen nodes back in the graph itself (no fallback module called per run)
    assert not any(type(n.target).__name__ == "Fallback" for n in gm.graph.nodes)
    assert any(n.target is torch.ops.aten.index_put.default for n in gm.graph.nodes), gm.code
