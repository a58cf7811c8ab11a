"""A compiled optimizer step (issue 36 item 4): SGD with momentum, Adam and AdamW equal eager's after several
steps on both CPU targets; the kernels write parameters and optimizer state straight into the tensors the
step updates (``KernelPlan.reusable``, ``wrapper._Emitter._land``: no copy back, nothing allocated) and the
per-parameter updates over one shape run as one kernel (``Scheduler._merge_updates``). Where a kernel may not
write a mutated input in place (its old value is read later, or the new value is returned), it does not."""
import re

import pytest
import torch
import torch.nn as nn

import kiln

CODEGENS = ["cpp", "triton"]
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    # the multi-tensor steps (torch.optim's default on CUDA): _foreach_* ops, decomposed per tensor to fuse
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
}


def _train(name, dtype=torch.float32, steps=4, **options):
    """(parameters and state after ``steps`` steps, the step, its first call's generated sources); compiled
    with kiln's ``options`` unless there are none. Each step sets new gradients (the same in every run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)).to(dtype)
    opt = OPTIMIZERS[name](list(model.parameters()))

    def step():
        opt.step()
    fn = kiln.compile(step, **options) if options else step
    code = []
    for i in range(steps):
        gen = torch.Generator().manual_seed(i)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        if i == 1 and options:   # SGD makes its momentum buffers at the first step: the second is the steady one
            code = kiln.run_and_get_code(fn)[1]
        else:
            fn()
    state = [p.detach() for p in model.parameters()]
    state += [v for p in model.parameters() for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return state, fn, "\n".join(c for c in code if c.startswith("# kiln wrapper"))


def _assert_equals_eager(name, got, src):
    """Elementwise updates: each value within a few float32 roundings per step of the float64 one, as eager's."""
    ref, _, _ = _train(name)
    exact, _, _ = _train(name, torch.float64)
    assert len(got) == len(ref) == len(exact) and "into=" in src and "aten__foreach" not in src, src
    for g, r, e in zip(got, ref, exact):
        bound = 2 * (r.double() - e).abs() + 64 * torch.finfo(torch.float32).eps * (1 + e.abs())
        assert ((g.double() - e).abs() <= bound).all(), (name, (g.double() - e).abs().max(), bound.min())


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"adam"}))   # adam: the in-place test below, same compile
def test_compiled_step_equals_eager(name, codegen):
    got, _, src = _train(name, codegen=codegen)
    _assert_equals_eager(name, got, src)


def _kernel_calls(src):
    return re.findall(r"= (kiln_\w+)\(", src)


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "copyback"])
def test_adam_writes_in_place_in_one_kernel_per_shape(codegen, inplace):
    """Adam over three Linear layers (weights 8x8, 8x8, 4x8; biases 8, 8, 4): the steps (scalars), the 8x8
    weights, the 4x8 weight and each bias shape: 5 kernels, no copy of state or parameters, no allocation
    (C++: ATen runs nothing at all). Without ``write_mutations``/``merge_updates``/``group_kernels``: 2 kernels
    per parameter and every new value copied back. In place (the default options): values as eager's too (the
    compile ``test_compiled_step_equals_eager`` would repeat for adam)."""
    options = {"codegen": codegen, "tuning.write_mutations": inplace, "tuning.merge_updates": 4096 * inplace,
               "tuning.group_kernels": inplace}
    got, step, src = _train("adam", **options)
    if inplace:   # before the profiled step below, which moves the parameters on
        _assert_equals_eager("adam", got, src)
    calls = _kernel_calls(src)
    copies = [ln.strip() for ln in src.splitlines() if "copy" in ln and not ln.strip().startswith("del ")]
    if not inplace:
        assert len(calls) == 12 and any("foreach_copy" in c for c in copies), src
        return
    assert len(calls) == 5, src
    # what is left of the copies: each runs only if its kernel refused the input (another layout)
    assert len(copies) == 24 and all(re.match(r"if (\w+) is not (\w+): aten_copy__default\(\2, \1\)$", c)
                                     for c in copies), copies
    if codegen == "cpp":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        assert not [e.name for e in prof.events() if e.name.startswith("aten::")], prof.events()


def _compile_and_compare(fn, make, codegen):
    """``fn`` compiled on ``codegen`` and eager on the inputs ``make()`` returns (and copies): outputs and
    inputs equal after each of two calls; returns the wrapper source."""
    torch._dynamo.reset()
    a = make()
    b = tuple(t.clone() for t in a)
    compiled = kiln.compile(fn, codegen=codegen)
    with torch.no_grad():
        out, code = kiln.run_and_get_code(compiled, *a)
        ref = fn(*b)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(compiled(*a), fn(*b))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    return "\n".join(c for c in code if c.startswith("# kiln wrapper"))


@pytest.mark.parametrize("codegen", CODEGENS)
def test_an_input_read_after_its_update_is_not_overwritten_early(codegen):
    """The new ``x`` comes from a kernel; a later kernel (a softmax of ``x`` flipped, read at other elements)
    still reads the old ``x``: the first kernel writes a new buffer, copied back at the end."""
    def fn(x, w):
        old = x.clone()
        x.mul_(2).add_(w)
        return torch.softmax(old.flip(-1) * 3, -1)
    src = _compile_and_compare(fn, lambda: (torch.randn(8, 16), torch.randn(8, 16)), codegen)
    assert "into=" not in src or "copy_" in src, src


@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_returned_new_value_is_not_written_into_the_input(codegen):
    """The graph returns the value it also copies into ``x``: written in place, the output would share ``x``'s
    memory, and a later change of ``x`` would show in it."""
    def fn(x):
        y = x * 2 + 1
        x.copy_(y)
        return y
    torch._dynamo.reset()
    x = torch.randn(16)
    with torch.no_grad():
        y = kiln.compile(fn, codegen=codegen)(x)
    torch.testing.assert_close(x, y)
    x.zero_()
    assert y.abs().sum() > 0 and y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("codegen", CODEGENS)
def test_updates_through_views_and_of_aliased_inputs(codegen):
    """A row of ``y`` updated through a view, and ``x`` updated while ``x.t()`` (the same memory, another
    layout) is read: values as eager's."""
    def fn(x, y):
        y[1].mul_(3)
        z = x.t() * 1.0
        x.add_(1)
        return z + y.sum()
    _compile_and_compare(fn, lambda: (torch.arange(16.0).reshape(4, 4), torch.ones(3, 4)), codegen)


def _wrapper_of(case, **options):
    """The wrapper of a hand-made fused graph: kernel ``A`` computes ``x``'s new value (output 0 may overwrite
    its argument 0), which the graph copies into ``x``; ``case`` adds what forbids writing it in place."""
    import torch.fx as fx
    from kiln.codegen.text.source import KernelRef
    from kiln.codegen.wrapper import emit_wrapper
    from kiln.options import current
    aten = torch.ops.aten
    own = (lambda *a: None) if case != "no_fallback" else None
    a = KernelRef("kiln_pw_a", "", False, ((1,),) if case == "other_position" else ((0,),), own)
    b = KernelRef("kiln_pw_b", "", False, (), lambda *a: None)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    view = g.call_function(aten.t.default, (x,)) if case == "view_alive" else None
    new = g.call_function(a, (x, y))
    out = g.call_function(b, (view if view is not None else x,)) if case in ("read_after", "view_alive") else \
        g.call_function(b, (y,))
    g.call_function(aten.copy_.default, (x, new))
    g.output((out, new) if case == "returned" else (out,))
    for n, v in zip(g.nodes, [torch.ones(4, 4)] * 2):
        n.meta["val"] = v
    return emit_wrapper(fx.GraphModule(torch.nn.Module(), g), "w", opts=current(**options))


def test_an_input_is_written_in_place_beside_a_kernel_without_fallback():
    """A kernel without an ATen fallback of its own no longer stops the write in place: the wrapper lists the
    input it writes (``Wrapper.written``) for the graph fallback to restore."""
    w = _wrapper_of("no_fallback")
    assert re.search(r"\w+ = \w+\(x, y, into=\(x,\)\)", w.source) and w.written == [0], w.source


@pytest.mark.parametrize("case", ["read_after", "view_alive", "returned", "other_position", "option_off"])
def test_the_wrapper_writes_an_input_in_place_only_where_safe(case):
    src = _wrapper_of("plain").source   # the control: written in place, the copy left only for a refused ``into``
    m = re.search(r"(\w+) = \w+\(x, y, into=\(x,\)\)", src)
    assert m and f"if {m[1]} is not x: aten_copy__default(x, {m[1]})" in src, src
    src = _wrapper_of(case, **({"tuning.write_mutations": False} if case == "option_off" else {})).source
    assert "into=" not in src and re.search(r"^\s+\w+ = aten_copy__default\(x, ", src, re.M), src


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_cuda_step_equals_eager_in_few_kernels(name):
    """On the GPU (Triton): 3 x Linear(64, 64) plus Linear(64, 8): values as eager's after 3 steps; the updates
    write in place (no copy back) in one kernel per shape (steps, 64x64 weights, 8x64 weight, 64 and 8 biases)."""
    def run(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)], nn.Linear(64, 8)).cuda()
        opt = OPTIMIZERS[name](list(model.parameters()))
        fn = kiln.compile(opt.step) if compiled else opt.step
        code = []
        for i in range(3):
            gen = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).cuda()
            code = kiln.run_and_get_code(fn)[1] if compiled and i == 1 else code
            if not (compiled and i == 1):
                fn()
        return [p.detach() for p in model.parameters()], "\n".join(c for c in code if c.startswith("# kiln wrapper"))
    got, src = run(True)
    ref, _ = run(False)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert "foreach_copy" not in src and "into=" in src, src
    assert len(_kernel_calls(src)) <= 5, src
