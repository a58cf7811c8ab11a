"""Slow eager entry points are swapped for equal fast functions in generated wrappers."""
import torch

from kiln.codegen.wrapper import broadcast_in_dim


def test_broadcast_in_dim_matches_the_prim_and_is_a_view():
    a = torch.randn(3, 5)
    for shape, dims in [((3, 4, 5), (0, 2)), ((2, 3, 5), (1, 2)), ((3, 5, 1), (0, 1))]:
        ref = torch.ops.prims.broadcast_in_dim.default(a, shape, dims)
        out = broadcast_in_dim(a, shape, dims)
        assert out.shape == ref.shape and out.stride() == ref.stride()
        torch.testing.assert_close(out, ref)
        assert out.data_ptr() == a.data_ptr()


def test_reinterpret_offset_is_relative_to_the_input():
    """Wrapper views: the C++ helper and the fallback both read ``offset`` past the input's own start."""
    from kiln.compat import _reinterpret_fallback, reinterpret_fn
    base = torch.arange(100.0)
    x = base[4:36]
    for fn in (reinterpret_fn(), _reinterpret_fallback):
        torch.testing.assert_close(fn(x, (2, 2), (2, 1), 4), torch.tensor([[8.0, 9.0], [10.0, 11.0]]))
        assert fn(x, (3,), (5,), 0).data_ptr() == x.data_ptr()


def _wrapper(code):
    return "\n".join(c for c in code if c.startswith("# kiln wrapper"))


def test_static_views_become_reinterprets_and_follow_the_input_offset():
    """Views of graph inputs, dense externs and kernel outputs are emitted as one reinterpret call;
    an input whose storage offset differs from the traced one (Dynamo does not guard offsets, so
    nothing recompiles) still gives eager's values."""
    import kiln

    def f(x, w):
        return (x.view(4, 8) @ w).permute(1, 0).reshape(-1)[3:]

    base, w = torch.randn(100), torch.randn(8, 5)
    cf = torch.compile(f, backend="kiln")
    out, code = kiln.run_and_get_code(cf, base[4:36], w)
    torch.testing.assert_close(out, f(base[4:36], w))
    src = _wrapper(code)
    assert "reinterpret(" in src and "aten_view_default" not in src and "aten_permute_default" not in src
    for start in (0, 8, 13):   # other offsets, same sizes and strides: no recompile
        x = base[start:start + 32]
        torch.testing.assert_close(cf(x, w), f(x, w))


def test_views_of_kernel_outputs_in_training(monkeypatch):
    """Forward and backward with Triton kernels (interpreter): views of kernel outputs and of the
    saved values reinterpret or stay ATen views, and values and gradients match eager."""
    import kiln

    def f(x, w):
        h = torch.nn.functional.gelu(x * 2).transpose(0, 1)
        return (h.reshape(8, 6) @ w).sum(0)

    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(6, 3, requires_grad=True)
    ref = f(x, w)
    ref.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    cf = kiln.compile(f, codegen="triton")

    def step(x, w):
        out = cf(x, w)
        out.sum().backward()
        return out
    out, code = kiln.run_and_get_code(step, x, w)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, gx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, gw, atol=1e-5, rtol=1e-5)
    assert "reinterpret(" in _wrapper(code)


def test_output_views_stay_aten_views():
    """A view that is a graph output (autograd may save it) stays a real ATen view, sharing its base's
    version counter; internal views become reinterprets (here guarded: ``x_1`` has no known layout)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kiln.codegen.wrapper import emit_wrapper
    from kiln.runtime.load import load

    def g(x):
        return x.t(), x.view(-1).sum()

    x = torch.randn(4, 6)
    src = emit_wrapper(make_fx(g, tracing_mode="fake")(x), "t").source
    assert "aten_t_default(x_1)" in src and "reinterpret(x_1, (24,), (1,), 0) if x_1.stride() == (6, 1)" in src
    t, s = load(emit_wrapper(make_fx(g, tracing_mode="fake")(x), "t"))([x])
    assert t._base is x and t._version == x._version
    torch.testing.assert_close(s, x.sum())


def test_backward_outputs_that_are_views_reinterpret_and_autograd_keeps_them():
    """A backward's outputs are gradients (autograd never checks their version counters): one that is a view
    of a kernel or mm output (a bias gradient's [1, 1, d] -> [d], a weight gradient's double transpose) is one
    reinterpret call, not an ATen view; the gradients equal eager's."""
    import kiln

    lin = torch.nn.Linear(8, 5)
    x = torch.randn(4, 3, 8)
    ref = torch.nn.functional.gelu(lin(x)).sum()
    ref.backward()
    gw, gb = lin.weight.grad.clone(), lin.bias.grad.clone()
    lin.weight.grad = lin.bias.grad = None
    f = kiln.compile(lambda x: torch.nn.functional.gelu(lin(x)).sum())
    def step(x):
        f(x).backward()
    _, code = kiln.run_and_get_code(step, x)
    backward = next(c for c in code if c.startswith("# kiln wrapper: backward"))
    ret = backward.strip().splitlines()[-1]
    outs = [a.strip() for a in ret[ret.index("(") + 1:ret.rindex(")")].split(",") if a.strip()]
    lines = {ln.split(" = ")[0].strip(): ln for ln in backward.splitlines() if " = " in ln}
    assert any("reinterpret(" in lines.get(o, "") for o in outs), backward
    assert not any("aten_view" in lines.get(o, "") or "aten_permute" in lines.get(o, "") or
                   "aten_t_" in lines.get(o, "") for o in outs), backward
    torch.testing.assert_close(lin.weight.grad, gw, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lin.bias.grad, gb, atol=1e-5, rtol=1e-5)


def test_split_with_an_output_element_keeps_the_split():
    """A split whose elements are not all reinterpreted stays in the wrapper and every element reads
    it (an element reinterpreting the split's input after that input was freed broke HF GPT-2)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kiln.codegen.wrapper import emit_wrapper
    from kiln.runtime.load import load

    def g(primals):   # a graph input of known layout (named like AOTAutograd's), so views reinterpret
        q, k, v = primals.view(2, 3, 6).split(2, -1)
        return q, (k * v).sum()

    x = torch.randn(36)
    w = emit_wrapper(make_fx(g, tracing_mode="fake")(x), "t")
    q, s = load(w)([x])
    ref_q, ref_s = g(x)
    torch.testing.assert_close(q, ref_q)
    torch.testing.assert_close(s, ref_s)
    assert "aten_split_Tensor" in w.source


def test_a_view_with_a_stale_example_value_stays_an_aten_view():
    """The wrapper replays each view on its input's example value (meta device) before it trusts the
    recorded layout: a view whose value a pass left stale runs as the ATen op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kiln.codegen.wrapper import emit_wrapper
    from kiln.runtime.load import load

    def g(primals):
        return primals[:, 2:4].reshape(2, 2, 2).sum(-1) * 1

    x = torch.randn(4, 6)
    gm = make_fx(g, tracing_mode="fake")(x)
    fresh = emit_wrapper(gm, "t").source
    assert "aten_view_default" not in fresh and "aten__unsafe_view" not in fresh
    view = next(n for n in gm.graph.nodes if n.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default))
    v = view.meta["val"]
    view.meta["val"] = v.new_empty(v.shape)   # contiguous, offset 0: not what the slice's view makes
    w = emit_wrapper(gm, "t")
    assert f"aten_{view.target._opname}_default(" in w.source
    torch.testing.assert_close(load(w)([x]), g(x))


def _fake_cuda_fused(fn, *cpu_args):
    """``fn``'s ATen graph retraced on fake CUDA tensors and fused (compiled-mode kernels)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from tests.codegen.util import fuse
    from kiln.options import Options
    from tests.codegen.util import decompositions
    gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode="fake")(*cpu_args)
    for n in gm.graph.nodes:
        if n.kwargs.get("device") in (torch.device("cpu"), "cpu"):
            n.kwargs = {**n.kwargs, "device": torch.device("cuda", 0)}
    gm.recompile()
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(a.shape, dtype=a.dtype, device="cuda") for a in cpu_args]
        gm = make_fx(gm, decomposition_table=decompositions())(*args)
    fuse(gm, args, bind=False)   # kernel references, as the wrapper emitter sees them
    return gm


def test_a_cuda_wrapper_enters_its_device_once_and_kernels_allocate_there():
    """Compiled kernels allocate (torch's C++ empty_strided_cuda) and launch on the current device,
    so a wrapper whose kernels share one GPU makes it current around its whole body."""
    from kiln.codegen.wrapper import emit_wrapper

    def f(x, w):
        return (torch.nn.functional.layer_norm(x, (64,), w) * 2).mm(w.view(64, 1)) + 1

    gm = _fake_cuda_fused(f, torch.randn(32, 64), torch.randn(64))
    src = emit_wrapper(gm, "t").source
    lines = src.splitlines()
    guard = [i for i, line in enumerate(lines) if "with cuda_device(0):" in line]
    assert len(guard) == 1, src
    calls = [i for i, line in enumerate(lines) if "= kiln_" in line]
    assert len(calls) == 2 and all(i > guard[0] and lines[i].startswith(" " * 8) for i in calls), src
    for k in {n.target for n in gm.graph.nodes if hasattr(n.target, "source")}:
        assert "launch.empty_cuda(" in k.source and "device=" not in k.source, k.source


def test_kernel_devices_names_each_compiled_kernel_with_its_gpu():
    from kiln.codegen.wrapper import _kernel_devices

    def f(x):
        return torch.sin(x) * 2

    gm = _fake_cuda_fused(f, torch.randn(8, 8))
    devs = _kernel_devices(list(gm.graph.nodes))
    assert list(devs.values()) == [0]
    for n in devs:   # another GPU in the example values: another index
        n.meta["val"] = torch.empty(8, 8, device="meta")
    assert _kernel_devices(list(gm.graph.nodes)) == {}


def test_kernels_are_called_directly_after_the_first_call():
    """After the first call the wrapper's globals hold each kernel module's ``call``, not the
    ``KernelCall`` that guards a first call with the ATen fallback; results stay eager's."""
    import kiln
    from kiln.runtime.kernels import KernelCall
    from kiln.runtime.load import Compiled

    def f(x):
        return torch.relu(x) * 3 + 1

    seen = []
    real = Compiled.__call__

    def spy(self, args):
        seen.append(self)
        return real(self, args)
    Compiled.__call__ = spy
    try:
        g = kiln.compile(f, codegen="triton")
        x = torch.randn(16)
        torch.testing.assert_close(g(x), f(x))
        torch.testing.assert_close(g(x + 1), f(x + 1))
    finally:
        Compiled.__call__ = real
    ns = seen[0].fn.__globals__
    assert not any(isinstance(v, KernelCall) for v in ns.values())
    assert any(getattr(v, "__name__", "") == "call" and getattr(v, "__module__", "").startswith("kiln_kernels")
               for v in ns.values())


def test_copy_runs_break_where_a_copy_reads_an_earlier_target():
    """Input copies batch into one foreach call only while no copy reads a value another one of the
    run writes (sequential copies would see the new value)."""
    import torch.fx as fx

    from kiln.codegen.wrapper import _copy_runs
    g = fx.Graph()
    a, b, c = (g.placeholder(n) for n in "abc")
    for p in (a, b, c):
        p.meta["val"] = torch.empty(4)
    v = g.call_function(torch.ops.aten.mul.Tensor, (a, 2))
    v.meta["val"] = torch.empty(4)
    copies = [g.call_function(torch.ops.aten.copy_.default, (a, v)),
              g.call_function(torch.ops.aten.copy_.default, (b, v)),
              g.call_function(torch.ops.aten.copy_.default, (c, b))]   # reads b, which the run writes
    g.output(None)
    runs = _copy_runs(list(g.nodes))
    assert runs[copies[0]] == copies[:2] and runs[copies[1]] == [] and copies[2] not in runs
