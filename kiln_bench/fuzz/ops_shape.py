"""Statement families that move data: views, indexing, scatters, concatenation and in-place updates.
Each builder takes the ``generate.Gen`` and returns a ``generate.Spec`` or None; eager decides."""
from __future__ import annotations

import math

from kiln_bench.fuzz.program import Spec


def _shape_txt(shape) -> str:
    return str(tuple(shape)) if len(shape) != 1 else f"({shape[0]},)"


def _reshape(g, shape) -> tuple:
    """Another shape of the same number of elements: split a dim, merge two, add ones, or -1."""
    shape = list(shape)
    how = g.choice(["merge", "split", "ones", "flat", "minus"])
    if how == "merge" and len(shape) >= 2:
        i = g.int(0, len(shape) - 2)
        shape[i:i + 2] = [shape[i] * shape[i + 1]]
    elif how == "split" and shape:
        i = g.int(0, len(shape) - 1)
        f = next((f for f in (2, 3, 4) if shape[i] % f == 0 and shape[i] > f), None)
        if f:
            shape[i:i + 1] = [f, shape[i] // f]
    elif how == "ones":
        shape.insert(g.int(0, len(shape)), 1)
    elif how == "flat":
        shape = [math.prod(shape)]
    elif how == "minus" and shape and 0 not in shape:
        shape[g.int(0, len(shape) - 1)] = -1
    return tuple(shape)


def view(g):
    x = g.pick() or g.new_input()
    t, nd = x.t, x.t.dim()
    d, d2 = g.dim(t), g.dim(t)
    size = t.shape[d] if nd else 1
    a, b = g.int(-2, max(size, 1)), g.int(0, size + 1)
    step = g.choice([1, 1, 2, 3])
    idx = ":, " * (d % nd if nd else 0)
    perm = list(range(nd))
    for i in range(nd - 1, 0, -1):
        j = g.int(0, i)
        perm[i], perm[j] = perm[j], perm[i]
    expand = tuple(g.choice([2, 3]) if s == 1 and g.chance(0.6) else s for s in t.shape)
    forms = [
        f"{{0}}.reshape({_shape_txt(_reshape(g, t.shape))})", f"{{0}}.view({_shape_txt(_reshape(g, t.shape))})",
        f"{{0}}.permute({tuple(perm)})", f"{{0}}.transpose({d}, {d2})", "{0}.t()", "{0}.mT",
        f"{{0}}.expand({_shape_txt(expand)})", f"{{0}}.expand({_shape_txt((g.choice([1, 2, 3]),) + tuple(t.shape))})",
        f"{{0}}[{idx}{a}:{b}:{step}]", f"{{0}}.narrow({d}, {max(a, 0)}, {max(min(b, size) - max(a, 0), 0)})",
        f"{{0}}[{idx}{g.int(-size, max(size - 1, 0))}]", f"{{0}}.select({d}, {g.int(-size, max(size - 1, 0))})",
        f"{{0}}.unsqueeze({g.int(-nd - 1, nd)})", f"{{0}}.squeeze({d})", "{0}.squeeze()",
        f"{{0}}.flip({tuple(sorted({d, d2}))})", f"{{0}}.movedim({d}, {d2})", f"{{0}}.diagonal({g.int(-1, 1)})",
        f"{{0}}.unfold({d}, {g.int(1, 2)}, {g.int(1, 2)})", f"torch.chunk({{0}}, {g.int(1, 3)}, {d})[{g.int(0, 1)}]",
        f"torch.split({{0}}, {g.int(1, 3)}, {d})[-1]", f"torch.unbind({{0}}, {d})[0]", "{0}.contiguous()",
        f"{{0}}.roll({g.int(-2, 2)}, {d})", "torch.tril({0})", f"torch.triu({{0}}, {g.int(-1, 1)})",
        f"{{0}}.repeat({_shape_txt(tuple(g.choice([1, 2]) for _ in range(nd)))})",
        f"torch.repeat_interleave({{0}}, {g.int(1, 3)}, {d})", f"F.pad({{0}}, ({g.int(0, 2)}, {g.int(0, 2)}))",
        "{0}.clone()", f"{{0}}[..., None, {':' if nd else ''}]", "{0}.T" if nd == 2 else "{0}.flatten()",
    ]
    return Spec(g.choice(forms), (x.name,), "select")


def indexing(g):
    x = g.pick(lambda t: t.dim() >= 1) or g.new_input(g.shape(g.choice([1, 2, 3])))
    t = x.t
    d = g.dim(t)
    n = t.shape[d]
    form = g.choice(["index_select", "gather", "getitem", "getitem2", "getitem_dim", "mask", "masked_fill",
                     "take_along", "index_fill"])
    if form == "index_select":
        return Spec(f"torch.index_select({{0}}, {d}, {{1}})", (x.name, g.index((g.choice([0, 1, 2, 3, 5]),), n).name),
                    "select")
    if form in ("gather", "take_along"):
        shape = tuple(g.int(0, s) if i != d % t.dim() else g.choice([1, 2, 3, 4]) for i, s in enumerate(t.shape))
        shape = t.shape if form == "take_along" or g.chance(0.3) else shape
        text = f"torch.gather({{0}}, {d}, {{1}})" if form == "gather" else f"torch.take_along_dim({{0}}, {{1}}, {d})"
        return Spec(text, (x.name, g.index(shape, n).name), "select")
    if form == "getitem":
        return Spec("{0}[{1}]", (x.name, g.index(g.shape(g.choice([1, 1, 2])), t.shape[0], "sindex").name), "select")
    if form == "getitem2" and t.dim() >= 2:
        i1 = g.index((g.choice([1, 3, 4]),), t.shape[0], "sindex")
        i2 = g.index(i1.t.shape if g.chance(0.7) else (1,), t.shape[1], "sindex")
        return Spec("{0}[{1}, {2}]", (x.name, i1.name, i2.name), "select")
    if form == "getitem_dim" and t.dim() >= 2:
        return Spec("{0}[:, {1}]", (x.name, g.index((g.choice([1, 2, 4]),), t.shape[1], "sindex").name), "select")
    if form == "mask":
        return Spec("{0}[{1}]", (x.name, g.mask(t.shape).name), "select")
    if form == "index_fill":
        return Spec(f"{{0}}.index_fill({d}, {{1}}, {g.const(t.dtype)})",
                    (x.name, g.index((g.choice([1, 2]),), n).name), "select")
    m = g.pick(lambda u: u.dtype.is_floating_point is False and str(u.dtype) == "torch.bool")
    m = m if m is not None and g.chance(0.4) else g.mask([1 if g.chance(0.3) else s for s in t.shape])
    return Spec(f"{{0}}.masked_fill({{1}}, {g.const(t.dtype)})", (x.name, m.name), "select")


def scatter(g):
    x = g.pick(lambda t: t.dim() >= 1) or g.new_input(g.shape(g.choice([1, 2, 3])))
    t = x.t
    d = g.dim(t)
    n, nd = t.shape[d], t.dim()
    dt = str(t.dtype).replace("torch.", "")
    form = g.choice(["scatter_add", "scatter_reduce", "index_add", "index_put", "index_put_unique", "index_copy",
                     "select_scatter", "slice_scatter", "scatter_unique"])
    if form in ("scatter_add", "scatter_reduce", "scatter_unique"):
        shape = tuple(g.int(1, max(s, 1)) if i != d % nd else g.choice([1, 2, 3]) for i, s in enumerate(t.shape))
        if form == "scatter_unique":   # one index along d: every target written once at most
            shape = tuple(1 if i == d % nd else s for i, s in enumerate(shape))
        src = g.new_input(shape, dt)
        idx = g.index(shape, n)
        text = {"scatter_add": f"torch.scatter_add({{0}}, {d}, {{1}}, {{2}})",
                "scatter_unique": f"torch.scatter({{0}}, {d}, {{1}}, {{2}})",
                "scatter_reduce": f"torch.scatter_reduce({{0}}, {d}, {{1}}, {{2}}, "
                                  f"{g.choice(['sum', 'amax', 'amin', 'prod', 'mean'])!r}, "
                                  f"include_self={g.choice([True, False])})"}[form]
        return Spec(text, (x.name, idx.name, src.name), "add" if form == "scatter_add" else "inexact")
    m = g.choice([1, 2, 3, 5])
    if form in ("index_add", "index_copy"):
        idx = g.index((m,), n, "index" if form == "index_add" else "perm")
        src = g.new_input(tuple(m if i == d % nd else s for i, s in enumerate(t.shape)), dt)
        text = (f"torch.index_add({{0}}, {d}, {{1}}, {{2}}, alpha={g.choice([1, 2])})" if form == "index_add"
                else f"torch.index_copy({{0}}, {d}, {{1}}, {{2}})")
        return Spec(text, (x.name, idx.name, src.name), "add")
    if form in ("index_put", "index_put_unique"):
        idx = g.index((m,), t.shape[0], "index" if form == "index_put" else "perm")
        vals = g.new_input(g.choice([(m,) + tuple(t.shape[1:]), tuple(t.shape[1:]), (1,)]), dt)
        acc = form == "index_put" or g.chance(0.3)
        return Spec(f"torch.index_put({{0}}, ({{1}},), {{2}}, accumulate={acc})", (x.name, idx.name, vals.name), "add")
    if form == "select_scatter":
        src = g.new_input(tuple(s for i, s in enumerate(t.shape) if i != d % nd), dt)
        return Spec(f"torch.select_scatter({{0}}, {{1}}, {d}, {g.int(-n, max(n - 1, 0))})", (x.name, src.name),
                    "select")
    a = g.int(0, n)
    b = g.int(a, n)
    step = g.choice([1, 1, 2])
    src = g.new_input(tuple(len(range(a, b, step)) if i == d % nd else s for i, s in enumerate(t.shape)), dt)
    return Spec(f"torch.slice_scatter({{0}}, {{1}}, {d}, {a}, {b}, {step})", (x.name, src.name), "select")


def concat(g):
    x = g.pick() or g.new_input()
    t = x.t
    d = g.dim(t) if t.dim() else 0
    if g.chance(0.3):
        return Spec(g.choice([f"torch.stack([{{0}}, {{0}}], {g.int(0, t.dim())})", f"torch.cat([{{0}}, {{0}}], {d})",
                              f"torch.cat([{{0}}, {{0}} * 2, {{0}}], {d})"]), (x.name,), "add")
    same = g.chance(0.5) or not t.dim()
    shape = tuple(t.shape) if same else tuple(g.choice([0, 1, 2, 3]) if i == d % t.dim() else s
                                              for i, s in enumerate(t.shape))
    dt = None if g.chance(0.2) else str(t.dtype).replace("torch.", "")
    y = g.pick(lambda u: u.shape == t.shape) if g.chance(0.3) else None
    y = y or g.new_input(shape, dt if dt in ("float32", "bfloat16", "float16", "int64", "int32", "bool",
                                             "complex64") else None)
    if same and g.chance(0.4):
        return Spec(f"torch.stack([{{0}}, {{1}}], {g.int(-t.dim() - 1, t.dim())})", (x.name, y.name), "select")
    return Spec(f"torch.cat([{{0}}, {{1}}], {d})" if g.chance(0.8) else f"torch.cat([{{1}}, {{0}}, {{1}}], {d})",
                (x.name, y.name), "select")


INPLACE_VIEWS = ["", "", "", "[1:]", "[::2]", ".t()", "[0]", ".diagonal()", "[..., :1]", ".view(-1)"]


def inplace(g):
    x = g.pick(lambda t: not (t.is_leaf and t.requires_grad))
    if x is None:
        x = g.new_input()
    t = x.t
    v = g.choice(INPLACE_VIEWS) if t.dim() else ""
    form = g.choice(["add_", "mul_", "copy_", "sub_", "clamp_", "masked_fill_", "zero_", "fill_", "relu_",
                     "neg_", "setitem", "index_add_", "scatter_add_", "index_put_", "div_"])
    out = g.chance(0.25) and v == ""
    if form in ("zero_", "relu_", "neg_", "fill_", "clamp_"):
        arg = {"fill_": g.const(t.dtype), "clamp_": f"min={g.const(t.dtype)}"}.get(form, "")
        return Spec(f"{{0}}{v}.{form}({arg})", (x.name,), "select", inplace=x.name, out=out)
    if form == "masked_fill_":
        m = g.mask([1 if g.chance(0.3) else s for s in t.shape])
        return Spec(f"{{0}}.masked_fill_({{1}}, {g.const(t.dtype)})", (x.name, m.name), "select", inplace=x.name,
                    out=out)
    if form in ("index_add_", "scatter_add_", "index_put_") and t.dim():
        d = g.dim(t)
        n = t.shape[d]
        if form == "scatter_add_":
            src = g.new_input(t.shape, str(t.dtype).replace("torch.", ""))
            return Spec(f"{{0}}.scatter_add_({d}, {{1}}, {{2}})", (x.name, g.index(t.shape, n).name, src.name), "add",
                        inplace=x.name)
        m = g.choice([1, 2, 4])
        if form == "index_put_":
            idx = g.index((m,), t.shape[0])
            return Spec("{0}.index_put_(({1},), {2}, accumulate=True)",
                        (x.name, idx.name, g.new_input((m,) + tuple(t.shape[1:])).name), "add", inplace=x.name)
        src = g.new_input(tuple(m if i == d % t.dim() else s for i, s in enumerate(t.shape)))
        return Spec(f"{{0}}.index_add_({d}, {{1}}, {{2}})", (x.name, g.index((m,), n).name, src.name), "add",
                    inplace=x.name)
    lit, y = g.operand(x, p_const=0.3)
    exact = {"add_": "add", "sub_": "add", "mul_": "mul", "copy_": "select", "setitem": "select"}.get(form, "inexact")
    if form == "setitem":
        idx = g.choice(["[0]", "[1:]", "[..., ::2]", "[:]"]) if t.dim() else "[...]"
        text = f"{{0}}{idx} = " + (lit if lit is not None else "{1}")
        return Spec(text, (x.name,) + ((y.name,) if y else ()), exact, inplace=x.name, out=False)
    method = form if form != "div_" else "div_"
    text = f"{{0}}{v}.{method}(" + (lit if lit is not None else "{1}") + ")"
    return Spec(text, (x.name,) + ((y.name,) if y else ()), exact, inplace=x.name, out=out)
