"""Statement families for the fuzz generator: pointwise, reductions, complex, matmul (this module) and
views, indexing, scatters, concatenation, in-place (``ops_shape``). ``FAMILIES`` maps a name to
(builder, weight); a builder takes the ``generate.Gen`` and returns a ``Spec`` or None (nothing fits).
Builders propose; eager decides (a statement eager rejects is redrawn).
"""
from __future__ import annotations

import torch

from kiln_bench.fuzz import ops_shape
from kiln_bench.fuzz.program import Spec

# (text, exactness) with {0} the operand; see generate.Spec for the exactness kinds
UNARY = [
    ("torch.neg({0})", "select"), ("torch.abs({0})", "select"), ("torch.relu({0})", "select"),
    ("torch.exp({0})", "inexact"), ("torch.log({0})", "inexact"), ("torch.sqrt({0})", "inexact"),
    ("torch.rsqrt({0})", "inexact"), ("torch.sin({0})", "inexact"), ("torch.cos({0})", "inexact"),
    ("torch.tanh({0})", "inexact"), ("torch.sigmoid({0})", "inexact"), ("torch.erf({0})", "inexact"),
    ("torch.expm1({0})", "inexact"), ("torch.log1p({0})", "inexact"), ("torch.reciprocal({0})", "inexact"),
    ("torch.square({0})", "mul"), ("torch.pow({0}, 2)", "mul"), ("torch.pow({0}, 0.5)", "inexact"),
    ("{0} ** 3", "inexact"), ("F.gelu({0})", "inexact"), ("F.gelu({0}, approximate='tanh')", "inexact"),
    ("F.silu({0})", "inexact"), ("F.softplus({0})", "inexact"), ("F.elu({0})", "inexact"),
    ("F.leaky_relu({0}, 0.125)", "mul"), ("F.hardswish({0})", "inexact"), ("F.mish({0})", "inexact"),
    ("F.hardtanh({0}, -1.5, 2.0)", "select"), ("F.relu6({0})", "select"), ("F.hardsigmoid({0})", "inexact"),
    ("torch.floor({0})", "discrete"), ("torch.ceil({0})", "discrete"), ("torch.round({0})", "discrete"),
    ("torch.trunc({0})", "discrete"), ("torch.sign({0})", "discrete"), ("torch.signbit({0})", "discrete"),
    ("torch.isnan({0})", "select"), ("torch.isinf({0})", "select"), ("torch.isfinite({0})", "select"),
    ("torch.logical_not({0})", "discrete"), ("torch.bitwise_not({0})", "select"),
    ("torch.nan_to_num({0})", "select"), ("torch.nan_to_num({0}, nan=1.5, posinf=2.0, neginf=-3.0)", "select"),
    ("{0}.to(torch.float32)", "select"), ("{0}.to(torch.bfloat16)", "select"), ("{0}.to(torch.float16)", "select"),
    ("{0}.to(torch.int64)", "discrete"), ("{0}.to(torch.int32)", "discrete"), ("{0}.to(torch.bool)", "discrete"),
    ("{0}.to(torch.complex64)", "select"), ("{0}.to(torch.float64)", "select"),
    ("torch.clamp({0}, min={c})", "select"), ("torch.clamp({0}, max={c})", "select"),
    ("torch.clamp({0}, {c}, {d})", "select"), ("torch.clamp({0}, min=1, max=3)", "select"),
    ("torch.where({0} > 0, {0}, {c})", "discrete"), ("torch.positive({0})", "select"),
]

BINARY = [
    ("torch.add({0}, {1})", "add"), ("torch.sub({0}, {1})", "add"), ("torch.mul({0}, {1})", "mul"),
    ("torch.add({0}, {1}, alpha=2)", "add"), ("{0} - {1}", "add"), ("{0} * {1}", "mul"), ("{0} + {1}", "add"),
    ("torch.div({0}, {1})", "inexact"), ("torch.div({0}, {1}, rounding_mode='floor')", "discrete"),
    ("torch.div({0}, {1}, rounding_mode='trunc')", "discrete"), ("torch.floor_divide({0}, {1})", "discrete"),
    ("torch.remainder({0}, {1})", "discrete"), ("torch.fmod({0}, {1})", "discrete"),
    ("torch.maximum({0}, {1})", "select"), ("torch.minimum({0}, {1})", "select"),
    ("torch.fmax({0}, {1})", "select"), ("torch.fmin({0}, {1})", "select"),
    ("torch.pow({0}, {1})", "inexact"), ("torch.atan2({0}, {1})", "inexact"), ("torch.hypot({0}, {1})", "inexact"),
    ("torch.eq({0}, {1})", "discrete"), ("torch.ne({0}, {1})", "discrete"), ("torch.lt({0}, {1})", "discrete"),
    ("torch.le({0}, {1})", "discrete"), ("{0} > {1}", "discrete"), ("{0} >= {1}", "discrete"),
    ("torch.logical_and({0}, {1})", "discrete"), ("torch.logical_or({0}, {1})", "discrete"),
    ("torch.logical_xor({0}, {1})", "discrete"), ("torch.bitwise_and({0}, {1})", "select"),
    ("torch.bitwise_or({0}, {1})", "select"), ("torch.bitwise_xor({0}, {1})", "select"),
    ("torch.copysign({0}, {1})", "discrete"), ("torch.xlogy({0}, {1})", "inexact"),
    ("torch.lerp({0}, {1}, 0.25)", "inexact"), ("torch.clamp({0}, min={1})", "select"),
]

REDUCE = [
    ("torch.sum({0}{dims}{keep})", "add"), ("torch.mean({0}{dims}{keep})", "inexact"),
    ("torch.amax({0}{dims}{keep})", "select"), ("torch.amin({0}{dims}{keep})", "select"),
    ("torch.argmax({0}{dim}{keep})", "discrete"), ("torch.argmin({0}{dim}{keep})", "discrete"),
    ("torch.var({0}{dims}, correction={corr}{keep})", "inexact"), ("torch.std({0}{dims}{keep})", "inexact"),
    ("torch.softmax({0}, {d})", "inexact"), ("torch.log_softmax({0}, {d})", "inexact"),
    ("torch.logsumexp({0}, {dl}{keep})", "inexact"), ("torch.prod({0}{dim}{keep})", "inexact"),
    ("torch.max({0}, {d}{keep}).values", "select"), ("torch.max({0}, {d}{keep}).indices", "discrete"),
    ("torch.min({0}, {d}{keep})[0]", "select"), ("torch.all({0}{dim}{keep})", "discrete"),
    ("torch.any({0}{dims}{keep})", "discrete"), ("torch.cumsum({0}, {d})", "add"),
    ("torch.sum({0}{dims}, dtype=torch.float32)", "add"), ("torch.linalg.vector_norm({0}{dims})", "inexact"),
    ("torch.nansum({0}{dims})", "add"), ("torch.count_nonzero({0}{dims})", "discrete"),
    ("torch.aminmax({0}{dim}{keep}).max", "select"), ("torch.var_mean({0}{dims})[1]", "inexact"),
    ("torch.amax({0})", "select"), ("torch.sum({0})", "add"), ("torch.mean({0}, {d}, True)", "inexact"),
]

COMPLEX = [
    ("torch.conj({0})", "select"), ("{0}.conj() * {0}", "mul"), ("torch.real({0})", "select"),
    ("torch.imag({0})", "select"), ("torch.abs({0})", "inexact"), ("torch.angle({0})", "inexact"),
    ("torch.view_as_real({0})", "select"), ("{0}.conj().imag", "select"),
    ("torch.resolve_conj({0}.conj()) + 0", "select"), ("{0} * 1j", "select"), ("torch.exp({0})", "inexact"),
    ("{0} * {0}.conj()", "mul"), ("torch.sgn({0})", "inexact"), ("torch.conj_physical({0})", "select"),
    ("{0}.conj().real * 2", "add"), ("torch.square({0})", "mul"),
]


def pointwise_unary(g):
    x = g.pick()
    if x is None:
        return None
    text, exact = g.choice(UNARY)
    return Spec(text.replace("{c}", g.const()).replace("{d}", g.const()), (x.name,), exact)


def pointwise_binary(g):
    x = g.pick() or g.new_input()
    text, exact = g.choice(BINARY)
    lit, y = g.operand(x)
    if lit is not None:
        return Spec(text.replace("{1}", lit), (x.name,), exact)
    return Spec(text, (y.name, x.name) if g.chance(0.2) else (x.name, y.name), exact)


def where(g):
    x = g.pick() or g.new_input()
    cond = g.pick(lambda t: t.dtype == torch.bool) if g.chance(0.5) else None
    if cond is None:
        shape = [1 if g.chance(0.3) else s for s in x.t.shape]
        cond = g.mask(shape)
    lit, y = g.operand(x, p_const=0.4)
    other = lit if lit is not None else "{2}"
    args = (cond.name, x.name) + ((y.name,) if y is not None else ())
    form = g.choice(["torch.where({0}, {1}, OTHER)", "torch.where({0}, OTHER, {1})", "{1}.masked_fill({0}, 1.5)"])
    return Spec(form.replace("OTHER", other), args, "select")


def reduction(g):
    x = g.pick(lambda t: t.dim() >= 1) or g.pick() or g.new_input()
    text, exact = g.choice(REDUCE)
    nd = x.t.dim()
    d = g.dim(x.t)
    dims = sorted({g.dim(x.t) for _ in range(g.int(1, max(nd, 1)))}) if nd else []
    form = g.choice(["", "one", "tuple"])
    dims_txt = "" if form == "" or not nd else (f", dim={d}" if form == "one" else f", dim={tuple(dims)}")
    sub = {"{dims}": dims_txt, "{dim}": f", dim={d}" if nd and g.chance(0.8) else "",
           "{keep}": ", keepdim=True" if g.chance(0.35) else "", "{d}": str(d), "{corr}": str(g.int(0, 1)),
           "{dl}": str(tuple(dims) if dims else d)}
    if "{dim}" in text and sub["{dim}"] == "":
        sub["{keep}"] = ""
    if "{dims}" in text and dims_txt == "":
        sub["{keep}"] = ""
    for k, v in sub.items():
        text = text.replace(k, v)
    return Spec(text, (x.name,), exact)


def complex_op(g):
    x = g.pick(lambda t: t.is_complex())
    if x is None or g.chance(0.3):
        x = g.new_input(dtype="complex64")
    text, exact = g.choice(COMPLEX)
    if g.chance(0.15):
        y = g.pick(lambda t: t.is_floating_point()) or g.new_input(dtype="float32")
        z = g.new_input(y.t.shape, str(y.t.dtype).replace("torch.", ""))
        return Spec(g.choice(["torch.complex({0}, {1})", "torch.polar(torch.abs({0}), {1})"]), (y.name, z.name),
                    "inexact")
    return Spec(text, (x.name,), exact)


def matmul(g):
    x = g.pick(lambda t: 1 <= t.dim() <= 3 and t.dtype != torch.bool)
    if x is None:
        x = g.new_input(g.shape(g.choice([2, 2, 3, 1])))
    dt = str(x.t.dtype).replace("torch.", "")
    dt = dt if dt in ("float32", "bfloat16", "float16", "complex64", "int64") else "float32"
    k, n = (x.t.shape[-1] if x.t.dim() else 1), g.choice([1, 2, 3, 4, 8, 16])
    form = g.choice(["matmul", "matmul", "linear", "addmm", "self", "bmm", "vec"])
    if form == "self":
        return Spec(g.choice(["{0} @ {0}.mT", "{0}.mT @ {0}", "torch.matmul({0}, {0}.transpose(-1, -2))"]),
                    (x.name,), "mul")
    if form == "vec":
        return Spec("torch.matmul({0}, {1})", (x.name, g.new_input((k,), dt).name), "mul")
    if form == "linear":
        w = g.new_input((n, k), dt)
        if g.chance(0.5):
            return Spec("F.linear({0}, {1}, {2})", (x.name, w.name, g.new_input((n,), dt).name), "inexact")
        return Spec("F.linear({0}, {1})", (x.name, w.name), "mul")
    if form == "addmm" and x.t.dim() == 2:
        y, b = g.new_input((k, n), dt), g.new_input(g.choice([(n,), (x.t.shape[0], n), (1, n)]), dt)
        return Spec("torch.addmm({2}, {0}, {1}, beta=0.5, alpha=2)", (x.name, y.name, b.name), "inexact")
    if form == "bmm" and x.t.dim() == 3:
        return Spec("torch.bmm({0}, {1})", (x.name, g.new_input((x.t.shape[0], k, n), dt).name), "mul")
    batch = tuple(1 if g.chance(0.3) else s for s in x.t.shape[:-2]) if g.chance(0.5) else ()
    y = g.new_input(batch + (k, n), dt)
    return Spec(g.choice(["torch.matmul({0}, {1})", "{0} @ {1}"]), (x.name, y.name), "mul")


FAMILIES = {
    "unary": (pointwise_unary, 5), "binary": (pointwise_binary, 5), "where": (where, 2),
    "reduce": (reduction, 5), "complex": (complex_op, 1), "matmul": (matmul, 2),
    "view": (ops_shape.view, 4), "index": (ops_shape.indexing, 3), "scatter": (ops_shape.scatter, 2),
    "cat": (ops_shape.concat, 2), "inplace": (ops_shape.inplace, 3),
}
