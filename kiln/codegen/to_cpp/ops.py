"""How each loop-IR op is written in C++ (a scalar expression the compiler vectorizes in ``omp simd`` loops).

2-byte floats compute in ``float`` (a cast rounds to nearest even), as eager does; float ops keep eager's
NaN and signed-zero rules. ``PREAMBLE`` starts every unit: with ``KILN_LIBMVEC`` the math functions are
declared ``omp declare simd``; their ``kiln_s_`` aliases have none (``emit.decides``). An op without a
template raises ``Unsupported``: the kernel runs as ATen.
"""
import math
import re

import torch

from kiln.codegen.ir.loops import Unsupported, neutral_value
from kiln.codegen.text.source import VECTOR_MATH   # math functions glibc's libmvec vectorizes

# the C++ type of a value of each dtype (2-byte floats compute in float) and of its memory
VALUE = {torch.float32: "float", torch.float64: "double", torch.float16: "float", torch.bfloat16: "float",
         torch.int64: "int64_t", torch.int32: "int32_t", torch.int16: "int16_t", torch.int8: "int8_t",
         torch.uint8: "uint8_t", torch.bool: "bool"}
# bool tensors as bytes (g++ 12 vectorized ``bool`` loads badly: a masked softmax row ran 3.8x slower)
MEMORY = {**VALUE, torch.float16: "_Float16", torch.bfloat16: "uint16_t", torch.bool: "uint8_t"}


# the other C math functions the templates call; ``<math.h>`` is not included (libstdc++'s takes about 0.4 s
# of every build), so these and ``VECTOR_MATH`` are declared in the preamble
SCALAR_MATH = ("fabs", "sqrt", "floor", "ceil", "trunc", "nearbyint", "lgamma")
BINARY_MATH = ("fmod", "pow", "atan2", "hypot", "copysign")


# ops whose result jumps when an operand moves by one ulp (``decides``), and max/min, which pass on one
# operand's exact bits (that a later ``eq`` with the value computed again compares against)
DISCRETE = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum", "floor", "ceil", "trunc", "round",
                      "sign", "floordiv", "truncdiv", "remainder", "fmod", "isnan", "isinf", "signbit",
                      "logical_not", "logical_and", "logical_or", "logical_xor"})
DISCRETE_REDUCE = frozenset({"max", "min", "argmax", "argmin", "any", "all"})
SCALAR_PREFIX = "kiln_s_"   # ``kiln_s_expf``: glibc's scalar expf in every lane (no vector variant declared)


def _declare(simd: bool) -> str:
    pragma = "#pragma omp declare simd notinbranch\n" if simd else ""
    return "".join(f"{pragma}float {f}f(float);\n{pragma}double {f}(double);\n" for f in VECTOR_MATH)


def _scalar_aliases() -> str:
    """``kiln_s_<f>``: the same symbol as ``<f>`` without an ``omp declare simd`` vector variant, so a loop
    calling it runs glibc's scalar function in every lane (libmvec's vector variants may differ from it by
    an ulp or more, and a value computed in two loops must then be the same: see ``decides``)."""
    return "".join(f"float {SCALAR_PREFIX}{f}f(float) __asm__(\"{f}f\");\n"
                   f"double {SCALAR_PREFIX}{f}(double) __asm__(\"{f}\");\n" for f in VECTOR_MATH)


ZERO_ROW_BYTES = 65536   # the preamble's row of zeros: the longest inner loop a masked row pointer serves

PREAMBLE = r"""// kiln generated C++ (no torch headers: raw pointers, sizes, the C ABI; no <math.h>: see SCALAR_MATH)
#include <stdint.h>
#include <string.h>
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define signbit(x) kiln_signbit(x)
extern "C" {
""" + "".join(f"float {f}f(float);\ndouble {f}(double);\n" for f in SCALAR_MATH) + \
    "".join(f"float {f}f(float, float);\ndouble {f}(double, double);\n" for f in BINARY_MATH) + r"""
#ifdef KILN_LIBMVEC
""" + _declare(True) + "#else\n" + _declare(False) + "#endif\n" + _scalar_aliases() + r"""}
static inline float fmod(float a, float b) { return fmodf(a, b); }   // <cmath>'s float overloads
static inline float floor(float a) { return floorf(a); }
#define KILN_INLINE static inline __attribute__((always_inline))
// a masked row that does not hold reads here instead (emit.ExprWriter._row_pointer: loads stay unconditional)
[[maybe_unused]] alignas(64) static const unsigned char kiln_zero_bytes[""" + str(ZERO_ROW_BYTES) + r"""] = {0};
KILN_INLINE float kiln_bf16_load(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
KILN_INLINE uint16_t kiln_bf16_store(float f) {   // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u; memcpy(&u, &f, 4);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (f != f) ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)r;
}
KILN_INLINE float kiln_round_bf16(float f) { return kiln_bf16_load(kiln_bf16_store(f)); }
// the sign bit from the bits (g++ 12 fails on __builtin_signbit in a vectorized loop over bf16 loads:
// "unrecognizable insn", a compiler bug)
KILN_INLINE bool kiln_signbit(float x) { uint32_t u; memcpy(&u, &x, 4); return (u >> 31) != 0; }
KILN_INLINE bool kiln_signbit(double x) { uint64_t u; memcpy(&u, &x, 8); return (u >> 63) != 0; }
// a float to an integer as eager converts on x86 (cvtt*2si): NaN and values out of range give the lowest
// value; 8- and 16-bit integers through int32. A plain cast is undefined there, and with -fno-trapping-math
// g++ folds (float)(int64_t)x into truncf(x) (NaN stayed NaN)
KILN_INLINE int64_t kiln_f2i64(double x) {
  return (x >= -9223372036854775808.0 && x < 9223372036854775808.0) ? (int64_t)x : (int64_t)(-9223372036854775807LL - 1);
}
KILN_INLINE int32_t kiln_f2i32(double x) {
  return (x > -2147483649.0 && x < 2147483648.0) ? (int32_t)x : (int32_t)(-2147483647 - 1);
}
KILN_INLINE float kiln_round_f16(float f) { return (float)(_Float16)f; }
// ``keep`` (all ones or zero) ? a : b, bitwise: a select on a condition that is the same in every lane of a
// loop, written so that g++ vectorizes the loop (emit.ExprWriter._code, op "masked")
KILN_INLINE float kiln_pick_f(uint32_t keep, float a, float b) {
  uint32_t x, y; memcpy(&x, &a, 4); memcpy(&y, &b, 4); x = (x & keep) | (y & ~keep);
  float r; memcpy(&r, &x, 4); return r;
}
// two selects, not one on ``x || y``: g++ 12 vectorizes no loop holding the latter with more than one load
/* the value of v unknown to the optimizer: g++ 12 stopped vectorizing row loops (exp) nested in a loop
   it could prove runs once */
#define KILN_OPAQUE(v) __asm__("" : "+r"(v))
template <typename T> KILN_INLINE T kiln_maximum(T a, T b) { const T m = a >= b ? a : b; return a != a ? a : m; }
template <typename T> KILN_INLINE T kiln_minimum(T a, T b) { const T m = a <= b ? a : b; return a != a ? a : m; }
template <typename T> KILN_INLINE T kiln_max_nan(T a, T b) { const T m = b > a ? b : a; return b != b ? b : m; }
template <typename T> KILN_INLINE T kiln_min_nan(T a, T b) { const T m = b < a ? b : a; return b != b ? b : m; }
template <typename T> KILN_INLINE T kiln_floordiv_i(T a, T b) {
  if (b == 0) return 0;
  if (b == -1) return (T)(0 - a);
  T q = a / b; return ((a % b) != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <typename T> KILN_INLINE T kiln_truncdiv_i(T a, T b) { return b == 0 ? 0 : (b == -1 ? (T)(0 - a) : a / b); }
template <typename T> KILN_INLINE T kiln_remainder_i(T a, T b) {
  if (b == 0 || b == -1) return 0;
  T r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
template <typename T> KILN_INLINE T kiln_fmod_i(T a, T b) { return (b == 0 || b == -1) ? 0 : a % b; }
template <typename T> KILN_INLINE T kiln_remainder_f(T a, T b) {
  T r = fmod(a, b); return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
template <typename T> KILN_INLINE T kiln_floordiv_f(T a, T b) {   // eager's: from fmod, rounded as eager rounds
  if (b == 0) return a / b;
  T m = fmod(a, b);
  T d = (a - m) / b;
  if (m != 0 && ((b < 0) != (m < 0))) d -= 1;
  T f = floor(d);
  if (d - f > (T)0.5) f += 1;
  return d != 0 ? f : (a / b) * (T)0;
}
template <typename T> KILN_INLINE T kiln_sign(T x) { return x > 0 ? (T)1 : (x < 0 ? (T)-1 : (T)0); }
// random numbers as Triton draws them (philox 4x32-10, to_triton.ops' _kiln_philox): the same seed, the same
// numbers on either target; the scalar log/cos (kiln_s_) keep a value equal in every loop recomputing it
KILN_INLINE void kiln_philox(uint64_t seed, uint32_t c0, uint32_t* r0, uint32_t* r1) {
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32), c1 = 0, c2 = 0, c3 = 0;
  for (int i = 0; i < 10; i++) {
    const uint32_t a = c0, b = c2;
    c0 = (uint32_t)(((uint64_t)0xCD9E8D57u * b) >> 32) ^ c1 ^ k0;
    c2 = (uint32_t)(((uint64_t)0xD2511F53u * a) >> 32) ^ c3 ^ k1;
    c1 = b * 0xCD9E8D57u, c3 = a * 0xD2511F53u, k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
  }
  *r0 = c0, *r1 = c1;
}
KILN_INLINE float kiln_uniform(uint32_t u) { return (float)(int32_t)((int32_t)u < 0 ? ~u : u) * 4.6566127342e-10f; }
KILN_INLINE float kiln_rand(int64_t seed, uint32_t offset) {
  uint32_t a, b; kiln_philox((uint64_t)seed, offset, &a, &b); return kiln_uniform(a);
}
KILN_INLINE int64_t kiln_randint(int64_t seed, uint32_t offset) {
  uint32_t a, b; kiln_philox((uint64_t)seed, offset, &a, &b); return (int64_t)a;
}
KILN_INLINE float kiln_randn(int64_t seed, uint32_t offset) {
  uint32_t a, b; kiln_philox((uint64_t)seed, offset, &a, &b);
  const float u1 = kiln_uniform(a) > 1.0e-7f ? kiln_uniform(a) : 1.0e-7f;
  return sqrtf(-2.0f * """ + SCALAR_PREFIX + """logf(u1)) *
         """ + SCALAR_PREFIX + """cosf(6.283185307179586f * kiln_uniform(b));
}
"""

# templates over {0}, {1} (operands) and {f} ('f' for float operands, '' for double)
FLOAT_UNARY = {
    "neg": "(-{0})", "abs": "fabs{f}({0})", "sqrt": "sqrt{f}({0})", "rsqrt": "(({t})1 / sqrt{f}({0}))",
    "sigmoid": "(({t})1 / (({t})1 + exp{f}(-{0})))", "reciprocal": "(({t})1 / {0})",
    "floor": "floor{f}({0})", "ceil": "ceil{f}({0})", "trunc": "trunc{f}({0})", "round": "nearbyint{f}({0})",
    "isnan": "({0} != {0})", "isinf": "(fabs{f}({0}) == ({t})INFINITY)", "signbit": "(signbit({0}) != 0)",
    "logical_not": "({0} == 0)", "sign": "kiln_sign({0})", "lgamma": "lgamma{f}({0})",
    **{f: f + "{f}({0})" for f in VECTOR_MATH},
}
INT_UNARY = {
    "neg": "(({t})(0 - {0}))", "abs": "(({t})({0} < 0 ? 0 - {0} : {0}))", "bitwise_not": "(({t})~{0})",
    "logical_not": "({0} == 0)", "sign": "kiln_sign({0})", "isnan": "false", "isinf": "false",
    "signbit": "({0} < 0)", "floor": "{0}", "ceil": "{0}", "trunc": "{0}", "round": "{0}",
}
BOOL_UNARY = {"logical_not": "(!{0})", "bitwise_not": "(!{0})"}
BINARY = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})", "logical_and": "(({0} != 0) & ({1} != 0))",
    "logical_or": "(({0} != 0) | ({1} != 0))", "logical_xor": "(({0} != 0) != ({1} != 0))",
    "bitwise_and": "({0} & {1})", "bitwise_or": "({0} | {1})", "bitwise_xor": "({0} ^ {1})",
}
FLOAT_BINARY = {
    "truediv": "({0} / {1})", "maximum": "kiln_maximum({0}, {1})", "minimum": "kiln_minimum({0}, {1})",
    "remainder": "kiln_remainder_f({0}, {1})", "fmod": "fmod{f}({0}, {1})", "floordiv": "kiln_floordiv_f({0}, {1})",
    "pow": "pow{f}({0}, {1})", "atan2": "atan2{f}({0}, {1})", "hypot": "hypot{f}({0}, {1})",
    "copysign": "copysign{f}({0}, {1})",
}
INT_BINARY = {
    "maximum": "({0} > {1} ? {0} : {1})", "minimum": "({0} < {1} ? {0} : {1})",
    "floordiv": "kiln_floordiv_i({0}, {1})", "truncdiv": "kiln_truncdiv_i({0}, {1})",
    "remainder": "kiln_remainder_i({0}, {1})", "fmod": "kiln_fmod_i({0}, {1})",
    "lshift": "(({t})({0} << {1}))", "rshift": "({0} >> {1})",
}


def template(op: str, dtype: torch.dtype, arity: int) -> str:
    """The C++ template of ``op`` on operands of ``dtype`` (``Unsupported`` when there is none)."""
    if arity == 1:
        table = FLOAT_UNARY if dtype.is_floating_point else (BOOL_UNARY if dtype == torch.bool else INT_UNARY)
    else:
        table = {**BINARY, **(FLOAT_BINARY if dtype.is_floating_point else INT_BINARY)}
    t = table.get(op)
    if t is None:
        raise Unsupported(f"cpp: no template for {op} on {dtype}")
    return t


_VECTOR_CALL = re.compile(r"\b(" + "|".join(VECTOR_MATH) + r")\{f\}\(")


def calls_vector_math(op: str) -> bool:
    """Whether ``op``'s float template calls a ``VECTOR_MATH`` function (``exp``, ``sigmoid``, ...)."""
    return bool(_VECTOR_CALL.search(FLOAT_UNARY.get(op, "") + FLOAT_BINARY.get(op, "")))


def scalar_math(t: str) -> str:
    """Template ``t`` with its ``VECTOR_MATH`` calls through the ``SCALAR_PREFIX`` aliases."""
    return _VECTOR_CALL.sub(lambda m: f"{SCALAR_PREFIX}{m.group(1)}{{f}}(", t)


def literal(value, dtype: torch.dtype) -> str:
    """A C++ literal of ``value`` as a ``dtype`` value (floats exactly, as hex)."""
    if dtype == torch.bool:
        return "true" if value else "false"
    t = VALUE[dtype]
    if dtype.is_floating_point:
        v = float(value)
        if v != v:
            return f"(({t})NAN)"
        if math.isinf(v):
            return f"(({t})INFINITY)" if v > 0 else f"(-({t})INFINITY)"
        return f"(({t}){v.hex()})"
    if isinstance(value, float):   # an integer type's infinite bound (a neutral element)
        info = torch.iinfo(dtype)
        value = info.max if value > 0 else info.min
    v = int(value)
    if v == -2 ** 63:
        return "((int64_t)(-9223372036854775807LL - 1))"
    return f"(({t}){v}LL)"


def neutral(kind: str, dtype: torch.dtype) -> str:
    """The identity element of a reduction, as C++."""
    return literal(neutral_value(kind, dtype), dtype)


def combine(kind: str, acc: str, v: str, floating: bool) -> str:
    """C++ folding value ``v`` into accumulator ``acc`` (a max or min of floats propagates NaN)."""
    if kind == "sum":
        return f"{acc} + {v}"
    if kind == "prod":
        return f"{acc} * {v}"
    if kind in ("max", "min"):
        if floating:
            return f"kiln_{kind}_nan({acc}, {v})"
        return f"({v} {'>' if kind == 'max' else '<'} {acc} ? {v} : {acc})"
    raise Unsupported(f"cpp: no reduction {kind}")
