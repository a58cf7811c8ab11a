"""What the compile cache knows a Dynamo graph by, the same text in every process: the code of its subgraphs
and the identity of each callable and custom operator it calls. torch's and Python's objects go by name, a
user's function by its code, defaults, closure and globals (recursively), a custom op by its Python
functions, a value by repr, a small tensor by its bytes, an object by ``uuid()``; else ``Unkeyable``.
"""
import dataclasses
import dis
import enum
import functools
import hashlib
import os
import sys
import sysconfig
import types

import torch

# operator namespaces whose kernels ship with torch (its version is in the key)
TORCH_NAMESPACES = frozenset({
    "aten", "prims", "rngprims", "higher_order", "debugprims", "inductor", "inductor_prims", "profiler", "_native",
    "quantized", "_quantized", "quantized_decomposed", "quantization", "c10d", "c10d_functional",
    "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "symm_mem", "mkl", "mkldnn", "mkldnn_prepacked",
    "onednn", "sparse", "export", "static_runtime", "debug_mode_ops", "_test"})
_LIBRARIES = ("torch", "kiln", "triton", "numpy", "sympy", "functorch", "builtins")
_RUNTIME_KEYS = ("CPU", "CUDA", "XPU", "MPS", "HIP", "PrivateUse1")   # kernels tracing does not run
_OPDEF_SKIP = ("_lib", "_opoverload", "_init_fn", "_backend_fns", "_used_triton_kernels")   # run, not traced
_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), torch.dtype, torch.device,
            torch.layout, torch.memory_format)
MAX_TENSOR_BYTES = 1 << 16


class Unkeyable(Exception):
    """A graph calls something whose identity kiln cannot write the same way in every process; the
    message names it (give the object a ``uuid()`` method, or a custom op ``torch.library.custom_op``)."""


def graph_identity(gm: torch.fx.GraphModule) -> str:
    """The text the cache key hashes for ``gm`` beyond its top-level code (raises ``Unkeyable``)."""
    ids = _Ids()
    out = []
    for name, mod in gm.named_modules():
        if isinstance(mod, torch.fx.GraphModule):
            out.append(f"[{name}]\n{mod.code if name else ''}")
            for k in sorted(getattr(mod, "meta", {})):
                if k.startswith("_checkpoint"):
                    out.append(f"meta {k}={ids.value(mod.meta[k], f'{name}.meta[{k}]')}")
            for node in mod.graph.nodes:
                out.extend(ids.node(node, mod))
        elif name:
            out.append(f"[{name}] {ids.value(type(mod), name)} training={mod.training} {mod!r}")
    return "\n".join(out)


@functools.lru_cache(maxsize=None)
def _library(module) -> bool:
    """Whether ``module`` ships with torch, kiln or Python (their versions key it), or a library of theirs;
    a module of the user's named like one of Python's (``test``) is not Python's."""
    top = (module or "").split(".")[0]
    if top in _LIBRARIES:
        return True
    if top not in getattr(sys, "stdlib_module_names", ()):
        return False
    path = getattr(sys.modules.get(top), "__file__", None)
    return path is None or os.path.abspath(path).startswith(sysconfig.get_paths()["stdlib"])


def _name(obj) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _const(c) -> str:
    """A code object's constant, the same text in every process (sets sorted, nested code hashed)."""
    if isinstance(c, types.CodeType):
        return _code(c)
    if isinstance(c, (tuple, list)):
        return "(" + ",".join(_const(x) for x in c) + ")"
    if isinstance(c, (frozenset, set)):
        return "{" + ",".join(sorted(_const(x) for x in c)) + "}"
    return repr(c)


@functools.lru_cache(maxsize=4096)
def _code(co: types.CodeType) -> str:
    text = "|".join([co.co_code.hex(), _const(co.co_consts), repr(co.co_names), repr(co.co_varnames),
                     repr(co.co_freevars), repr(co.co_cellvars), f"{co.co_argcount},{co.co_kwonlyargcount},{co.co_flags}"])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _reads(co: types.CodeType, globals_: set, attrs: set) -> None:
    """The global names and attribute names ``co`` (and the code nested in it) reads."""
    for ins in dis.get_instructions(co):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            globals_.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"):
            attrs.add(ins.argval)
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            _reads(c, globals_, attrs)


class _Ids:
    """Identities of one graph's objects (functions met twice are written once)."""

    def __init__(self):
        self.done: dict = {}   # id(function or class) -> its identity ('...' while in progress)

    def node(self, node, owner) -> list:
        out = []
        if node.op == "call_function":
            out.append(f"{node.name}: {self.value(node.target, node.name)}")
            if isinstance(node.target, torch._ops.HigherOrderOperator) and \
                    node.target.name().startswith("triton_kernel_wrapper"):
                out.append(self._user_triton(node))
        elif node.op == "get_attr":
            obj = functools.reduce(lambda o, a: getattr(o, a, None), node.target.split("."), owner)
            if not isinstance(obj, torch.nn.Module):
                out.append(f"{node.name}: {self.value(obj, node.target)}")
        leaves = []
        torch.fx.node.map_aggregate((node.args, node.kwargs), leaves.append)
        return out + [f"{node.name} arg: {self.value(a, node.name)}" for a in leaves
                      if not isinstance(a, (torch.fx.Node, slice, range) + _SCALARS)]

    def _user_triton(self, node) -> str:
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        consts = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
        return f"triton {self.value(kernel, node.name)} {self.value(consts, node.name)}"

    def value(self, v, where: str, depth: int = 0) -> str:
        if depth > 12:
            raise Unkeyable(f"{where}: objects nested too deeply to key")

        def sub(x):
            return self.value(x, where, depth + 1)
        if isinstance(v, _SCALARS) or isinstance(v, (slice, range)):
            return repr(v)
        if isinstance(v, enum.Enum) or hasattr(type(v), "__members__") and _library(type(v).__module__):
            return f"{_name(type(v))}.{v.name}"   # Python's enums, torch's (pybind11) ones
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"{type(v).__name__}({v.node.expr})"
        if isinstance(v, torch.Size):
            return repr(tuple(v))
        if isinstance(v, (tuple, list)):
            return type(v).__name__ + "(" + ",".join(sub(x) for x in v) + ")"
        if isinstance(v, (set, frozenset)):
            return "{" + ",".join(sorted(sub(x) for x in v)) + "}"
        if isinstance(v, dict):
            return "{" + ",".join(sorted(f"{sub(k)}:{sub(x)}" for k, x in v.items())) + "}"
        if isinstance(v, torch._ops.OpOverload):
            return self.op(v)
        if isinstance(v, torch._ops.OpOverloadPacket):
            return ";".join(self.op(getattr(v, o)) for o in sorted(v.overloads()))
        if isinstance(v, torch._ops.HigherOrderOperator):
            return f"hop:{v.name()}"
        if isinstance(v, torch.Tensor):
            return self.tensor(v, where)
        if isinstance(v, types.ModuleType):
            return f"module:{v.__name__}"
        uuid = getattr(v, "uuid", None) if not isinstance(v, type) else None
        if callable(uuid):
            return f"uuid:{uuid()}"
        if hasattr(v, "cache_hash") and not isinstance(v, type):   # Inductor's convention for a context_fn
            return f"cache_hash:{v.cache_hash}"
        if isinstance(v, types.FunctionType):
            return self.function(v, depth)
        if isinstance(v, types.MethodType):
            return f"method {sub(v.__func__)} of {sub(v.__self__)}"
        if isinstance(v, functools.partial):
            return f"partial({sub(v.func)},{sub(v.args)},{sub(v.keywords)})"
        if isinstance(v, (staticmethod, classmethod)):
            return f"{type(v).__name__}({sub(v.__func__)})"
        if isinstance(v, property):
            return f"property({sub(v.fget)})"
        if isinstance(v, type):
            return self.klass(v, depth)
        if type(v).__name__ in ("JITFunction", "Autotuner", "Heuristics") and _library(type(v).__module__):
            return self.triton(v, where, depth)
        if callable(v) and not hasattr(v, "__dict__") and _library(getattr(v, "__module__", None) or type(v).__module__):
            return f"builtin:{_name(v)}"   # a C function, a method descriptor
        if dataclasses.is_dataclass(v) and _library(type(v).__module__):   # a pytree spec, a config
            return f"{_name(type(v))}({sub(dataclasses.asdict(v))})"
        raise Unkeyable(f"{where} uses a {type(v).__module__}.{type(v).__qualname__} object, which has no identity "
                        f"that holds across processes (give it a uuid() method returning a string that "
                        f"changes when its behaviour does)")

    def tensor(self, t: torch.Tensor, where: str) -> str:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_quantized:
            raise Unkeyable(f"{where} holds a tensor kiln cannot key ({type(t).__name__}, {t.layout})")
        n = t.numel() * t.element_size()
        if n > MAX_TENSOR_BYTES:
            raise Unkeyable(f"{where} holds a constant tensor of {n} bytes (keyed up to {MAX_TENSOR_BYTES})")
        data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes() if n else b""
        return (f"tensor({t.dtype},{tuple(t.shape)},{t.stride()},{t.device.type},{t.requires_grad},"
                f"{hashlib.sha256(data).hexdigest()[:24]})")

    def _hashed(self, obj, prefix: str, parts) -> str:
        """``prefix`` and a hash of ``parts(where)``, once per object (met again while in progress: its name)."""
        key = id(obj)
        if key not in self.done:
            self.done[key] = "..."
            self.done[key] = prefix + hashlib.sha256("|".join(parts(_name(obj))).encode()).hexdigest()[:24]
        return self.done[key] if self.done[key] != "..." else f"recursive:{_name(obj)}"

    def function(self, fn: types.FunctionType, depth: int) -> str:
        return f"fn:{_name(fn)}" if _library(fn.__module__) else \
            self._hashed(fn, "fn:", lambda where: self._function_parts(fn, where, depth))

    def _function_parts(self, fn, where: str, depth: int) -> list:
        parts = [where, _code(fn.__code__), self.value(fn.__defaults__, where, depth + 1),
                 self.value(fn.__kwdefaults__, where, depth + 1)]
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                parts.append(f"{name}={self.value(cell.cell_contents, f'{where} (closure {name})', depth + 1)}")
            except ValueError:   # an empty cell
                parts.append(f"{name}=<empty>")
        names, attrs = set(), set()
        _reads(fn.__code__, names, attrs)
        for name in sorted(n for n in names if n in fn.__globals__):
            obj = fn.__globals__[name]
            parts.append(f"{name}={self.value(obj, f'{where} (global {name})', depth + 1)}")
            if isinstance(obj, types.ModuleType) and not _library(obj.__name__):
                parts += [f"{name}.{a}={self.value(getattr(obj, a), f'{name}.{a}', depth + 1)}"
                          for a in sorted(attrs) if hasattr(obj, a)]   # a helper read from a module of the user's
        return parts

    def klass(self, cls: type, depth: int) -> str:
        if _library(cls.__module__):
            return f"class:{_name(cls)}"

        def parts(where):
            out = [where] + [self.value(b, where, depth + 1) for b in cls.__bases__]
            for k, v in sorted(vars(cls).items()):
                code = isinstance(v, (types.FunctionType, staticmethod, classmethod, property))
                if not (k.startswith("__") and k.endswith("__") and not code or k == "_abc_impl"):
                    out.append(f"{k}={self.value(v, f'{where}.{k}', depth + 1)}")   # not what Python fills in
            return out
        return self._hashed(cls, "class:", parts)

    def triton(self, k, where: str, depth: int) -> str:
        if type(k).__name__ == "JITFunction":
            return f"triton:{k.cache_key}"
        configs = sorted(str(c) for c in getattr(k, "configs", None) or ())
        return f"{type(k).__name__}({self.triton(k.fn, where, depth + 1)},{configs})"

    def op(self, op: torch._ops.OpOverload) -> str:
        """A custom operator's identity: its schema and the Python functions tracing runs of it."""
        if op.namespace in TORCH_NAMESPACES:
            return f"op:{op.name()}"
        from torch._library import custom_ops, simple_registry
        where = f"custom op {op.name()}"
        qual = f"{op.namespace}::{op._opname}"
        parts = [op.name(), str(op._schema)]
        opdef = custom_ops.OPDEFS.get(qual)
        if opdef is not None:
            parts += [f"{k}={self.value(v, where)}" for k, v in sorted(vars(opdef).items()) if k not in _OPDEF_SKIP]
        else:
            seen = set()
            for name in {qual, op.name()}:
                entry = simple_registry.singleton.get(name)
                if entry is not None:
                    kernel = entry.fake_impl.kernel
                    parts.append(f"fake={self.value(getattr(kernel, 'func', None), where)}")
                    parts.append(f"dispatch={self.value(dict(entry.torch_dispatch_rules._data), where)}")
                    seen |= {"Meta"} if kernel is not None else set()
            from torch.library import _impls
            for key in sorted(_impls):
                ns, name, dk = key.split("/", 2)
                if ns == op.namespace and name in (op._opname, f"{op._opname}.{op._overloadname}") and \
                        dk not in _RUNTIME_KEYS and dk not in seen:
                    raise Unkeyable(f"{where} has a Python kernel for {dk} registered with torch.library "
                                    f"(Library.impl, register_autograd), which kiln cannot read back to key; "
                                    f"define the op with torch.library.custom_op")
        parts += [f"py {k}={self.value(v, where)}" for k, v in sorted(op.py_kernels.items(), key=lambda kv: str(kv[0]))]
        return "op:" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
