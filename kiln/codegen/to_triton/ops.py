"""How each loop-IR op is written in Triton, for GPUs and for the CPU interpreter (no libdevice there:
``tl`` primitives or ``HELPERS``). An op without a template raises ``Unsupported``.
"""
import re

import torch

from kiln.codegen.ir.loops import neutral_value

TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
    torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}

# op -> template over {0}, {1}, {d} (result dtype); a (gpu, interpret) pair where they differ
# float neg is a product: Triton's -x is 0 - x, which makes +0.0 of +0.0
FLOAT_UNARY = {
    "neg": "({0} * -1.0)", "abs": "tl.abs({0})", "exp": "tl.exp({0})", "exp2": "tl.exp2({0})",
    "log": "tl.log({0})", "log2": "tl.log2({0})", "log10": "(tl.log({0}) * 0.4342944819032518)",
    "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})",
    "sigmoid": ("tl.sigmoid({0})", "(1.0 / (1.0 + tl.exp(-{0})))"), "erf": "tl.erf({0})", "erfc": "(1.0 - tl.erf({0}))",
    "floor": "tl.floor({0})", "ceil": "tl.ceil({0})", "reciprocal": "(1.0 / {0})",
    "isnan": "({0} != {0})", "isinf": "(tl.abs({0}) == float('inf'))",
    "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, 0.0)).to({d})",
    "logical_not": "({0} == 0)",
    "log1p": ("libdevice.log1p({0})", "tl.where({0} == 0, {0}, tl.log(1.0 + {0}))"),
    "expm1": ("libdevice.expm1({0})", "tl.where({0} == 0, {0}, (tl.exp({0}) - 1.0))"),
    "tanh": ("libdevice.tanh({0})", "tl.where({0} == 0, {0}, (2.0 / (1.0 + tl.exp(-2.0 * {0})) - 1.0))"),
    "tan": ("libdevice.tan({0})", "(tl.sin({0}) / tl.cos({0}))"),
    "sinh": ("libdevice.sinh({0})", "tl.where({0} == 0, {0}, ((tl.exp({0}) - tl.exp(-{0})) * 0.5))"),
    "cosh": ("libdevice.cosh({0})", "((tl.exp({0}) + tl.exp(-{0})) * 0.5)"),
    "asinh": ("libdevice.asinh({0})", "tl.where({0} == 0, {0}, _kiln_asinh({0}))"),
    "acosh": ("libdevice.acosh({0})", "tl.log({0} + tl.sqrt({0} * {0} - 1.0))"),
    "atanh": ("libdevice.atanh({0})", "tl.where({0} == 0, {0}, (0.5 * tl.log((1.0 + {0}) / (1.0 - {0}))))"),
    "trunc": ("libdevice.trunc({0})", "tl.where({0} < 0, tl.ceil({0}), tl.floor({0}))"),
    "round": ("libdevice.nearbyint({0})", "_kiln_rint({0})"),
    "signbit": ("libdevice.signbit({0}) != 0", "({0} < 0)"),
    "asin": ("libdevice.asin({0})", None), "acos": ("libdevice.acos({0})", None),
    "atan": ("libdevice.atan({0})", None), "lgamma": ("libdevice.lgamma({0})", None),
}
INT_UNARY = {
    "neg": "-{0}", "abs": "tl.abs({0})", "bitwise_not": "~{0}", "logical_not": "({0} == 0)",
    "sign": "tl.where({0} > 0, 1, tl.where({0} < 0, -1, 0)).to({d})", "isnan": "({0} != {0})",
    "isinf": "({0} != {0})", "signbit": "({0} < 0)", "floor": "{0}", "ceil": "{0}", "trunc": "{0}",
    "round": "{0}",
}
BOOL_UNARY = {"logical_not": "({0} == 0)", "bitwise_not": "({0} == 0)"}
BINARY = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "truediv": "({0} / {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})", "logical_and": "(({0} != 0) & ({1} != 0))",
    "logical_or": "(({0} != 0) | ({1} != 0))", "logical_xor": "(({0} != 0) ^ ({1} != 0))",
    "bitwise_and": "({0} & {1})", "bitwise_or": "({0} | {1})", "bitwise_xor": "({0} ^ {1})",
    "lshift": "({0} << {1})", "rshift": "({0} >> {1})",
}
FLOAT_BINARY = {
    # eager's maximum/minimum: NaN if either is, else the first operand unless the second is greater (less)
    "maximum": "tl.where(({0} >= {1}) | ({0} != {0}), {0}, {1})",
    "minimum": "tl.where(({0} <= {1}) | ({0} != {0}), {0}, {1})",
    # remainder, fmod and floor division as eager computes them: from fmod, adjusted / rounded down
    "remainder": ("_kiln_remainder_f(libdevice.fmod({0}, {1}), {1})", "_kiln_remainder_f(_kiln_fmod({0}, {1}), {1})"),
    "fmod": ("libdevice.fmod({0}, {1})", "_kiln_fmod({0}, {1})"),
    "floordiv": ("_kiln_floordiv_f({0}, {1}, libdevice.fmod({0}, {1}))",
                 "_kiln_floordiv_f({0}, {1}, _kiln_fmod({0}, {1}))"),
    "pow": ("libdevice.pow({0}, {1})", "_kiln_pow({0}, {1})"),
    "atan2": ("libdevice.atan2({0}, {1})", None),
    "hypot": ("libdevice.hypot({0}, {1})", "_kiln_hypot({0}, {1})"),
    "copysign": ("libdevice.copysign({0}, {1})", "tl.where({1} < 0, -tl.abs({0}), tl.abs({0}))"),
}
INT_BINARY = {
    "maximum": "tl.maximum({0}, {1})", "minimum": "tl.minimum({0}, {1})",
    "floordiv": "_kiln_floordiv({0}, {1})", "truncdiv": "({0} // {1})",
    "remainder": "_kiln_remainder({0}, {1})", "fmod": "({0} % {1})",
}

HELPERS = {
    "_kiln_floordiv": '''@triton.jit
def _kiln_floordiv(a, b):
    q = a // b
    return tl.where(((a % b) != 0) & ((a < 0) != (b < 0)), q - 1, q)
''',
    "_kiln_remainder": '''@triton.jit
def _kiln_remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
''',
    "_kiln_trunc": '''@triton.jit
def _kiln_trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))
''',
    "_kiln_fmod": '''@triton.jit
def _kiln_fmod(a, b):
    r = tl.where((tl.abs(b) == float('inf')) & (tl.abs(a) != float('inf')), a, a - b * _kiln_trunc(a / b))
    return tl.where(r == 0, a * 0.0, r)
''',
    # the interpreter's hypot (no libdevice): scaled, so it overflows no sooner than the result, and
    # +inf when either operand is infinite, the other NaN included (as eager; fuzz seed 10 #9422)
    "_kiln_hypot": '''@triton.jit
def _kiln_hypot(a, b):
    x = tl.abs(a)
    y = tl.abs(b)
    big = tl.maximum(x, y)
    small = tl.minimum(x, y)
    q = small / tl.where(big == 0, 1.0, big)
    h = big * tl.sqrt(1.0 + q * q)
    return tl.where((x == float('inf')) | (y == float('inf')), float('inf'), h)
''',
    "_kiln_remainder_f": '''@triton.jit
def _kiln_remainder_f(r, b):
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
''',
    "_kiln_floordiv_f": '''@triton.jit
def _kiln_floordiv_f(a, b, m):
    d = (a - m) / b
    d = tl.where((m != 0) & ((b < 0) != (m < 0)), d - 1.0, d)
    f = tl.floor(d)
    f = tl.where(d - f > 0.5, f + 1.0, f)
    q = tl.where(d != 0, f, (a / b) * 0.0)
    return tl.where(b == 0, a / b, q)
''',
    "_kiln_rint": '''@triton.jit
def _kiln_rint(x):
    r = tl.floor(x + 0.5)
    r = tl.where((r - x == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
    return tl.where(r == 0, x * 0.0, r)
''',
    "_kiln_asinh": '''@triton.jit
def _kiln_asinh(x):
    a = tl.abs(x)
    r = tl.log(a + tl.sqrt(a * a + 1.0))
    return tl.where(x < 0, -r, r)
''',
    # C's pow (libdevice's, eager's): the sign of a negative base (-0.0 and -inf too) to an odd integer, NaN
    # for a finite negative base to a finite non-integer, 1 for 1 to anything and -1 to an infinity
    "_kiln_pow": '''@triton.jit
def _kiln_pow(a, b):
    r = tl.exp(b * tl.log(tl.abs(a)))
    bi = tl.floor(b)
    odd = tl.where(bi == b, (bi - 2.0 * tl.floor(bi * 0.5)) == 1.0, False)
    neg = (a < 0) | ((a == 0) & ((1.0 / a) < 0))
    r = tl.where(neg & odd, r * -1.0, r)   # (not -r: 0 - r, which drops the sign of a zero)
    r = tl.where((a < 0) & (a > float('-inf')) & (bi != b) & (tl.abs(b) < float('inf')), float('nan'), r)
    r = tl.where((tl.abs(a) == 1.0) & (tl.abs(b) == float('inf')), 1.0, r)
    return tl.where((b == 0) | (a == 1.0), 1.0, r)
''',
    "_kiln_prod": '''@triton.jit
def _kiln_prod(a, b):
    return a * b
''',
    "_kiln_max_nan": '''@triton.jit
def _kiln_max_nan(a, b):
    return tl.maximum(a, b, tl.PropagateNan.ALL)
''',
    "_kiln_min_nan": '''@triton.jit
def _kiln_min_nan(a, b):
    return tl.minimum(a, b, tl.PropagateNan.ALL)
''',
    "_kiln_philox": '''@triton.jit
def _kiln_philox(seed, offset):
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = offset.to(tl.uint32)
    c1 = c0 * 0
    c2 = c0 * 0
    c3 = c0 * 0
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0
        c2 = tl.umulhi(0xD2511F53, _c0) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1
''',
    # fp32 -> bf16 rounded to nearest even, as eager and Triton on GPUs do (``convert``)
    "_kiln_bf16": '''@triton.jit
def _kiln_bf16(x):
    x = x.to(tl.float32)
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
''',
    "_kiln_uniform": '''@triton.jit
def _kiln_uniform(x):
    x = x.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return x * 4.6566127342e-10
''',
    "_kiln_rand": '''@triton.jit
def _kiln_rand(seed, offset):
    a, b = _kiln_philox(seed, offset)
    return _kiln_uniform(a)
''',
    "_kiln_randint": '''@triton.jit
def _kiln_randint(seed, offset):
    a, b = _kiln_philox(seed, offset)
    return a
''',
    "_kiln_randn": '''@triton.jit
def _kiln_randn(seed, offset):
    a, b = _kiln_philox(seed, offset)
    u1 = tl.maximum(1.0e-7, _kiln_uniform(a))
    th = 6.283185307179586 * _kiln_uniform(b)
    r = tl.sqrt(-2.0 * tl.log(u1))
    return r * tl.cos(th)
''',
}
HELPER_DEPS = {"_kiln_rand": ["_kiln_philox", "_kiln_uniform"], "_kiln_randn": ["_kiln_philox", "_kiln_uniform"],
               "_kiln_randint": ["_kiln_philox"],
               "_kiln_fmod": ["_kiln_trunc"]}


def helpers_in(code: str) -> set:
    """The ``HELPERS`` that Triton source ``code`` calls, with the helpers they call."""
    out, todo = set(), [h for h in re.findall(r"\b_kiln_\w+", code) if h in HELPERS]
    while todo:
        h = todo.pop()
        if h not in out:
            out.add(h)
            todo += HELPER_DEPS.get(h, [])
    return out


def combine(kind: str, acc: str, v: str, floating: bool = False) -> str:
    """Triton source folding ``v`` into accumulator ``acc`` (a max or min of floats propagates NaN)."""
    if floating and kind in ("max", "min"):
        return f"tl.{kind}imum({acc}, {v}, tl.PropagateNan.ALL)"
    return {"sum": f"{acc} + {v}", "prod": f"{acc} * {v}",
            "max": f"tl.maximum({acc}, {v})", "min": f"tl.minimum({acc}, {v})"}[kind]


def reduce_code(kind: str, x: str, interpret: bool, axis: int = 1, floating: bool = False) -> str:
    """Triton source reducing 2-D ``x`` over ``axis`` (kept; a max or min of floats propagates NaN)."""
    keep = "[:, None]" if axis == 1 else "[None, :]"
    if kind == "prod":
        return f"tl.reduce({x}, {axis}, _kiln_prod){keep}"
    if floating and kind in ("max", "min") and not interpret:
        return f"tl.reduce({x}, {axis}, _kiln_{kind}_nan){keep}"
    if floating and kind in ("max", "min"):   # numpy's nanmax/nanmin, NaN where a NaN was (not element by element)
        return (f"tl.where(tl.reduce(({x} != {x}).to(tl.int32), {axis}, tl.standard._sum_combine) > 0, "
                f"float('nan'), tl.reduce({x}, {axis}, tl.standard._elementwise_{kind})){keep}")
    if interpret:  # the interpreter has numpy fast paths for these standard combine functions
        comb = {"sum": "_sum_combine", "max": "_elementwise_max", "min": "_elementwise_min"}[kind]
        return f"tl.reduce({x}, {axis}, tl.standard.{comb}){keep}"
    return f"tl.{kind}({x}, {axis}){keep}"


def convert(code: str, src: torch.dtype, dst: torch.dtype, interpret: bool) -> str:
    """Triton source converting ``code`` (``src`` values) to ``dst``; Triton 3.6's interpreter truncates to
    bf16, so there it rounds to nearest even by hand (``_kiln_bf16``)."""
    if interpret and dst == torch.bfloat16 and src != torch.bfloat16:   # (the helper takes any dtype via fp32)
        return f"_kiln_bf16({code})"
    return f"{code}.to({TL_DTYPE[dst]})"


# the integer type of a float's bits (the sign of a zero is only there)
BITS = {torch.float64: "tl.int64", torch.float32: "tl.int32", torch.float16: "tl.int16", torch.bfloat16: "tl.int16"}


def template(op: str, dtype: torch.dtype, interpret: bool, arity: int):
    """The Triton template for ``op`` on operands of ``dtype`` (None if it cannot be written)."""
    if interpret and op in ("signbit", "copysign") and dtype in BITS:   # no libdevice: read the sign bit
        negative = f"({{{arity - 1}}}.to({BITS[dtype]}, bitcast=True) < 0)"
        return negative if op == "signbit" else f"tl.where({negative}, tl.abs({{0}}) * -1.0, tl.abs({{0}}))"
    if arity == 1:
        table = FLOAT_UNARY if dtype.is_floating_point else (BOOL_UNARY if dtype == torch.bool else INT_UNARY)
        t = table.get(op)
    else:
        t = BINARY.get(op)
        if t is None:
            t = (FLOAT_BINARY if dtype.is_floating_point else INT_BINARY).get(op)
    if isinstance(t, tuple):
        t = t[1] if interpret else t[0]
    return t


def neutral(kind: str, dtype: torch.dtype) -> str:
    """The identity element of a reduction, as Triton source."""
    v = neutral_value(kind, dtype)
    if isinstance(v, float):
        return "float('inf')" if v > 0 else "float('-inf')"
    return str(v)
