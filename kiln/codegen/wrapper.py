"""The Python wrapper emitter: an FX GraphModule becomes the source of a plain Python function.

``call(args)`` takes AOTAutograd's boxed argument list (cleared, so inputs can be freed), calls each node's
target (bound once as module globals), deletes every buffer after its last use and returns the outputs.
Static views become one ``reinterpret`` call where ``views.ViewPlan`` allows. Each line carries the node's
shape, dtype and strides as a comment.
"""
import builtins
import keyword
import math
import operator
import re

import torch
import torch.fx as fx

from kiln.codegen.text.source import Wrapper
from kiln.codegen.views import SPLITS, ViewPlan, is_kernel, is_view_op
from kiln.compat import reinterpret_fn
from kiln.options import Tuning

_PY_OPS = {
    operator.getitem: "{0}[{1}]", operator.add: "{0} + {1}", operator.sub: "{0} - {1}",
    operator.mul: "{0} * {1}", operator.floordiv: "{0} // {1}", operator.truediv: "{0} / {1}",
    operator.mod: "{0} % {1}", operator.pow: "{0} ** {1}", operator.neg: "-{0}",
    operator.eq: "{0} == {1}", operator.ne: "{0} != {1}", operator.lt: "{0} < {1}",
    operator.le: "{0} <= {1}", operator.gt: "{0} > {1}", operator.ge: "{0} >= {1}",
}


def broadcast_in_dim(a, shape, broadcast_dimensions):
    """``prims.broadcast_in_dim`` as views (the prim runs its Python reference, about 60 us a call)."""
    for d in range(len(shape)):
        if d not in broadcast_dimensions:
            a = a.unsqueeze(d)
    return a.expand(shape)


# ops whose eager entry point is slow Python, replaced by an equal fast function at run time
RUNTIME = {torch.ops.prims.broadcast_in_dim.default: broadcast_in_dim}


def describe_val(val) -> str:
    """'f32[4, 8] (8, 1) cpu' for a tensor, 'sym s0' for a SymInt, '' otherwise."""
    if isinstance(val, torch.Tensor):
        dt = str(val.dtype).replace("torch.", "")
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                 "int64": "i64", "int32": "i32", "bool": "b8", "uint8": "u8", "int8": "i8"}.get(dt, dt)
        try:
            stride = tuple(val.stride())
        except RuntimeError:
            stride = "?"
        return f"{short}{list(val.shape)} {stride} {val.device.type}"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym {val}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(describe_val(v) for v in val) + ")"
    return ""


class _Emitter:
    def __init__(self, gm: fx.GraphModule, name: str, trusted=frozenset(), tuning: Tuning = Tuning(),
                 output_views: bool = True):
        self.gm, self.tuning, self.output_views = gm, tuning, output_views
        self.views = ViewPlan(trusted)
        self.outputs: set = set()
        self.skipped: set = set()   # splits not run: each of their elements reinterprets the input
        self.w = Wrapper(name=name, source="")
        self.names: dict[fx.Node, str] = {}
        self.global_ids: dict[int, str] = {}
        self.local_names = {self._fresh(n.name) for n in gm.graph.nodes}
        self.last_use: dict = {}   # value -> the node that reads it last (set by ``emit``)
        self.into: dict = {}       # kernel node -> per output, the argument it is written into (or None)
        self.landed: set = set()   # copy_ nodes of graph inputs a kernel wrote in place (``_land``)

    def bind(self, obj, hint: str) -> str:
        """Bind ``obj`` as a module global and return its name (one name per object)."""
        key = id(obj)
        if key in self.global_ids:
            return self.global_ids[key]
        base = re.sub(r"\W+", "_", hint).strip("_") or "g"
        if base[0].isdigit() or keyword.iskeyword(base) or hasattr(builtins, base):
            base = "k_" + base
        name, i = base, 0
        while name in self.w.globals or name in self.local_names:
            i += 1
            name = f"{base}_{i}"
        self.w.globals[name] = obj
        self.global_ids[key] = name
        if is_kernel(obj) and obj.name not in {k.name for k in self.w.kernels}:
            self.w.kernels.append(obj)  # one entry per kernel, however many call sites share it
        return name

    def target_name(self, target) -> str:
        target = RUNTIME.get(target, target)
        if isinstance(target, torch._ops.OpOverload):
            # a plain overload's __call__ only forwards to its C++ handle: bind the handle (a Python
            # frame less per call); subclasses (TorchBind ops) keep their own __call__
            fn = getattr(target, "_op", target) if type(target) is torch._ops.OpOverload else target
            name = self.bind(fn, f"{target.namespace}_{target._opname}_{target._overloadname}")
            if fn is not target:
                self.w.handles[name] = target   # the compile cache stores the overload, not its handle
            return name
        name = getattr(target, "name", None)   # a higher-order op's ``name`` is a method
        return self.bind(target, name if isinstance(name, str) else getattr(target, "__name__", None) or "fn")

    def lit(self, a) -> str:
        if isinstance(a, fx.Node):
            return self.names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.lit(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else (f"({inner},)" if len(a) == 1 else f"({inner})")
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self.lit(v)}" for k, v in a.items()) + "}"
        if a is None or isinstance(a, (bool, str, int)) or (isinstance(a, float) and math.isfinite(a)):
            return repr(a)
        if isinstance(a, slice):
            return f"slice({self.lit(a.start)}, {self.lit(a.stop)}, {self.lit(a.step)})"
        if isinstance(a, torch.dtype):
            return self.bind(a, str(a).replace("torch.", ""))
        if isinstance(a, torch.device):
            return self.bind(a, f"dev_{a.type}{a.index if a.index is not None else ''}")
        return self.bind(a, type(a).__name__.lower())

    def emit(self) -> Wrapper:
        g = self.gm.graph
        nodes = list(g.nodes)
        out = nodes[-1].args[0] if nodes and nodes[-1].op == "output" else ()
        self.outputs = {o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, fx.Node)}
        self.skipped = skipped = {n for n in nodes if n.op == "call_function" and n.target in SPLITS and n.users
                                  and all(self.views.static(u) and u not in self.outputs for u in n.users)}
        last_use: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            if n in skipped:
                continue
            reads = n.all_input_nodes
            if n.op == "call_function" and n.target is operator.getitem and n.args[0] in skipped:
                reads = n.args[0].all_input_nodes
            for inp in reads:
                last_use[inp] = n
        self.last_use = last_use
        self._land(nodes)
        if self.tuning.reuse_inputs:
            self.into.update((n, self._into(n, self.into.get(n))) for n in nodes if _reusing(n))
        frees: dict[fx.Node, list[fx.Node]] = {}
        out_node = next(n for n in reversed(nodes) if n.op == "output")
        for value, user in last_use.items():
            if user is not out_node:
                frees.setdefault(user, []).append(value)

        body: list[str] = []
        placeholders = [n for n in nodes if n.op == "placeholder"]
        self.w.written = sorted(placeholders.index(c.args[0]) for c in self.landed)
        self.names.update((n, self._fresh(n.name)) for n in placeholders)
        if placeholders:
            lhs = ", ".join(self.names[n] for n in placeholders)
            body.append(f"{lhs}, = args" if len(placeholders) == 1 else f"{lhs} = args")
        body.append("args.clear()")
        unread = [self.names[n] for n in placeholders if n not in last_use]   # e.g. a saved value a backward drops
        if unread:
            body.append("del " + ", ".join(unread))
        guard = _kernel_devices(nodes)
        shared = len(set(guard.values())) == 1
        if shared:   # every compiled kernel runs on one GPU: enter it once (kernels allocate and launch there)
            body.append(f"with {self.bind(torch.cuda.device, 'cuda_device')}({next(iter(guard.values()))}):")
        start = len(body)
        runs = _copy_runs([n for n in nodes if n not in self.landed])   # (a landed copy aliases none of them)
        for n in nodes:
            if n.op == "placeholder" or n in skipped:
                continue
            if n.op == "output":
                body.append(f"return {self.lit(n.args[0])}")
                outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
                self.w.known_outputs = [isinstance(o, fx.Node) and self.views.known(o) is not None for o in outs]
                continue
            run = runs.get(n)
            if n in self.landed:   # the kernel wrote the input unless it refused ``into`` (another layout)
                body.append(f"if {self.lit(n.args[1])} is not {self.lit(n.args[0])}: {self._call(n)}")
            elif run is None:
                line = self._node_line(n)
                if n in guard and not shared:
                    line = f"with {self.bind(torch.cuda.device, 'cuda_device')}({guard[n]}): {line}"
                body.append(line)
            elif run:   # the first of consecutive input copies: one foreach call for all of them
                dsts = ", ".join(self.names[c.args[0]] for c in run)
                srcs = ", ".join(self.names[c.args[1]] for c in run)
                body.append(f"{self.bind(torch._foreach_copy_, 'foreach_copy_')}([{dsts}], [{srcs}])"
                            f"  # {len(run)} input mutations")
            dead = [self.names[v] for v in frees.get(n, []) if v.op != "get_attr"]
            if not n.users and n.op == "call_function" and run is None and n not in self.landed:
                dead.append(self.names[n])
            if dead:
                body.append("del " + ", ".join(dead))
        if shared:
            body[start:] = ["    " + b for b in body[start:]]
        self.w.source = (f"# kiln wrapper: {self.w.name} ({len(nodes)} nodes)\n"
                         f"# globals: targets, constants and kernels bound at load time\n"
                         "def call(args):\n" + "\n".join("    " + b for b in body) + "\n")
        return self.w

    def _fresh(self, base: str) -> str:
        base = re.sub(r"\W+", "_", base)
        if keyword.iskeyword(base) or hasattr(builtins, base) or base in ("args", "call"):
            base = base + "_"
        return base

    def _node_line(self, n: fx.Node) -> str:
        name = self.names[n] = self._fresh(n.name)
        comment = describe_val(n.meta.get("val"))
        comment = f"  # {comment}" if comment else ""
        if n.op == "get_attr":
            return f"{name} = {self.bind(operator.attrgetter(n.target)(self.gm), n.target)}{comment}"
        if n.op == "call_method":
            return f"{name} = {self.lit(n.args[0])}.{n.target}({', '.join(self._args(n, 1))}){comment}"
        if n.op == "call_module":
            mod = self.gm.get_submodule(n.target)
            return f"{name} = {self.bind(mod, n.target)}({', '.join(self._args(n))}){comment}"
        # a graph output stays an ATen view (``output_views``, all but backward graphs): autograd may save it, and
        # only a real view shares its base's version counter (an in-place change of the base must be detected);
        # a backward's outputs are gradients, which autograd accumulates and never checks
        split_kept = n.target is operator.getitem and n.args[0] not in self.skipped   # plain split[i]
        kept = split_kept or (self.output_views and n in self.outputs)
        if self.views.static(n, need_known=False) and not kept:
            val, base = n.meta["val"], self.views.base(n)
            src = base.meta["val"]
            # the offset is relative to the input's own: an input's offset is not guarded by Dynamo
            view = (f"{self.bind(reinterpret_fn(), 'reinterpret')}({self.lit(base)}, {self.lit(tuple(val.shape))}, "
                    f"{self.lit(tuple(val.stride()))}, {val.storage_offset() - src.storage_offset()})")
            if self.views.known(base) is not None:
                return f"{name} = {view}{comment}"
            if is_view_op(n.target):   # an input of unknown layout: reinterpret when its strides are the example's
                return f"{name} = {view} if {self.lit(base)}.stride() == {self.lit(tuple(src.stride()))} " \
                       f"else {self._call(n)}{comment}"
        return f"{name} = {self._call(n)}{comment}"

    def _call(self, n: fx.Node) -> str:
        fmt = _PY_OPS.get(n.target)
        if fmt is not None and not n.kwargs:
            return fmt.format(*[self.lit(a) for a in n.args])
        args = self._args(n)
        if any(a is not None for a in self.into.get(n, ())):
            args.append(f"into={self.lit(tuple(self.into[n]))}")
        if is_kernel(n.target) and self._known_layouts(n):
            args.append("known=True")
        return f"{self.target_name(n.target)}({', '.join(args)})"

    def _known_layouts(self, n: fx.Node) -> bool:
        """Whether each input kernel node ``n`` checks (``KernelRef.layouts``) has the layout it checks for at run
        time: its recorded one (``ViewPlan.known``), equal to the kernel's."""
        layouts = getattr(n.target, "layouts", ())
        if not layouts:
            return False
        for a, layout in zip(n.args, layouts):
            if layout is None:
                continue
            val = a.meta.get("val") if isinstance(a, fx.Node) else None
            if not isinstance(val, torch.Tensor) or self.views.known(a) is None or \
                    (tuple(val.shape), tuple(val.stride())) != layout:
                return False
        return True

    def _args(self, n: fx.Node, skip: int = 0) -> list:
        return [self.lit(a) for a in n.args[skip:]] + [f"{k}={self.lit(v)}" for k, v in n.kwargs.items()]

    def _land(self, nodes) -> None:
        """Kernels write graph inputs' new values in place: for output ``v`` of kernel ``n`` that the graph
        copies into input ``d`` (AOTAutograd's input mutation, ``copy_(d, v)``), ``d`` is ``n``'s argument at a
        position output ``v`` may overwrite (``KernelPlan.reusable``), ``v`` is not returned, and every other
        reader of ``d`` is a kernel or an op with a fresh result (no view) at or before ``n`` (``Wrapper.written``
        lists such inputs: a graph fallback restores them)."""
        if not self.tuning.write_mutations:
            return
        order = {n: i for i, n in enumerate(nodes)}
        copy = torch.ops.aten.copy_.default
        fresh = lambda u: u.op == "call_function" and (is_kernel(u.target) or _fresh_result(u.target))  # noqa: E731
        for n in filter(_reusing, nodes):
            multi = isinstance(n.meta.get("val"), (tuple, list))
            values = [u for u in n.users if u.target is operator.getitem] if multi else [n]
            into = [None] * len(n.target.reuse)
            for v in values:
                i = v.args[1] if v is not n else 0
                copies = [u for u in v.users if u.target is copy and u.args[1] is v]
                d = copies[0].args[0] if len(copies) == 1 and not copies[0].users else None
                if d is None or v in self.outputs or d.op != "placeholder" or n.args.count(d) != 1 \
                        or n.args.index(d) not in n.target.reuse[i]:
                    continue
                if all(u is n or u is copies[0] or (fresh(u) and order[u] < order[n]) for u in d.users) and \
                        all(u is copies[0] or fresh(u) for u in v.users) and \
                        sum(u.target is copy for u in d.users) == 1:
                    into[i] = d
                    self.landed.add(copies[0])
            self.into[n] = into

    def _into(self, n: fx.Node, into=None) -> list:
        """Per output of kernel node ``n``, an argument it may be written into (``KernelPlan.reusable``):
        the input ``_land`` chose, or a value that dies at ``n``, owns its storage (not a view, not a graph
        input, output or constant) and is read by kernels only (no view or library call holds it)."""
        into = list(into or [None] * len(n.target.reuse))
        for i, positions in enumerate(n.target.reuse):
            for p in positions if into[i] is None else ():
                a = n.args[p] if p < len(n.args) else None
                if not isinstance(a, fx.Node) or a.op != "call_function" or a in self.outputs or a in into \
                        or self.last_use.get(a) is not n or not all(is_kernel(u.target) for u in a.users):
                    continue
                owner = a.args[0] if a.target is operator.getitem else a
                if owner is not a and (owner.op != "call_function" or owner in self.skipped):
                    continue
                if is_kernel(owner.target) or (_fresh_result(owner.target) and not is_view_op(owner.target)):
                    into[i] = a   # (``_unsafe_view``'s schema does not say that it aliases: is_view_op does)
                    break
        return into


def _reusing(n) -> bool:
    """Whether ``n`` calls a kernel that may write an output into an input."""
    return n.op == "call_function" and is_kernel(n.target) and bool(getattr(n.target, "reuse", ()))


def _fresh_result(target) -> bool:
    """An ATen op whose results are new tensors (no result aliases an input, no input is mutated)."""
    schema = getattr(target, "_schema", None)
    return isinstance(target, torch._ops.OpOverload) and schema is not None and not schema.is_mutable \
        and not any(r.alias_info is not None for r in schema.returns)


def _copy_runs(nodes) -> dict:
    """{copy node: run} for runs of two or more consecutive ``copy_`` nodes writing distinct graph inputs
    (AOTAutograd's input mutations) that no copy of the run reads, from values of the same shape, dtype
    and device: the first maps to the run (one ``torch._foreach_copy_``), the others to []."""
    out, run = {}, []

    def close():
        if len(run) >= 2:
            out[run[0]] = list(run)
            out.update({c: [] for c in run[1:]})
        run.clear()

    for n in nodes:
        ok = n.op == "call_function" and n.target is torch.ops.aten.copy_.default and not n.users \
            and len(n.args) == 2 and not n.kwargs and all(isinstance(a, fx.Node) for a in n.args) \
            and n.args[0].op == "placeholder"
        if ok:
            d, s = n.args[0].meta.get("val"), n.args[1].meta.get("val")
            ok = isinstance(d, torch.Tensor) and isinstance(s, torch.Tensor) and d.shape == s.shape \
                and d.dtype == s.dtype and d.device == s.device
        if ok and run:
            dsts, srcs = {c.args[0] for c in run}, {c.args[1] for c in run}
            if n.args[0] in dsts | srcs or n.args[1] in dsts or d.device != run[0].args[0].meta["val"].device:
                close()
        if ok:
            run.append(n)
        else:
            close()
    close()
    return out


def _kernel_devices(nodes) -> dict:
    """{kernel node: CUDA device index} for a graph's compiled kernels (they use the current device)."""
    out = {}
    for n in nodes:
        if n.op != "call_function" or not is_kernel(n.target) or getattr(n.target, "interpret", True):
            continue
        vals = n.meta.get("val")
        for v in (vals if isinstance(vals, (tuple, list)) else (vals,)):
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                out[n] = v.device.index or 0
                break
    return out


def emit_wrapper(gm: fx.GraphModule, name: str, trusted=frozenset(), opts=None, output_views=True) -> Wrapper:
    """The Python wrapper of ``gm``. ``trusted``: placeholders whose run-time strides are their examples';
    ``output_views``: outputs that are views stay ATen views (False for a backward: see ``_node_line``)."""
    return _Emitter(gm, name, trusted, opts.tuning if opts is not None else Tuning(), output_views).emit()
