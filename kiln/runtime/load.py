"""A generated wrapper as a callable, its kernel references bound to kernels; sources kept for kiln.run_and_get_code."""
import contextlib
import hashlib
import linecache

from kiln.codegen.text.source import KernelRef, Wrapper
from kiln.debug import counters, log
from kiln.runtime.kernels import KernelCall, KernelFailed, bind

# Lists that collect generated sources while a run_and_get_code scope is active. A plain list, not a
# context variable: the backward is compiled lazily, on autograd's device threads on GPU.
_SOURCE_SINKS: list = []


class Compiled:
    """A loaded wrapper: ``compiled(args_list)`` runs it (boxed, so AOTAutograd can free inputs).
    ``fallback``: the graph's ATen nodes, run from its inputs (now and from then on) when a kernel without
    an ATen fallback of its own fails on the first call (the inputs kernels wrote in place restored first)."""

    def __init__(self, wrapper: Wrapper, fn, fallback=None):
        # An instance attribute: Dynamo's disable() wrapper copies __dict__, not class attributes.
        self._boxed_call = True
        self.wrapper, self.fn, self.fallback = wrapper, fn, fallback
        self.source, self.name, self._direct = wrapper.source, wrapper.name, False

    def __call__(self, args):
        if self._direct:
            return self.fn(args)
        saved = list(args) if self.fallback is not None else None
        kept = [saved[i].clone() for i in self.wrapper.written] if saved is not None else ()
        try:
            out = self.fn(args)
        except KernelFailed as e:
            if saved is None:
                raise
            counters["codegen"]["graph_fallback"] += 1
            log(1, f"codegen: {self.name} runs its ATen graph from now on ({e})")
            self.fn = _boxed(self.fallback)
            self._direct = True
            for i, value in zip(self.wrapper.written, kept):
                saved[i].copy_(value)
            return self.fn(saved)
        self._direct = True
        direct_kernel_calls(self.fn.__globals__)
        return out

    def __repr__(self):
        return f"<kiln.Compiled {self.name}>"


def direct_kernel_calls(namespace: dict) -> None:
    """After a first call: bind each kernel that ran to its module's ``call``."""
    for name, obj in list(namespace.items()):
        if isinstance(obj, KernelCall) and obj.kernel.ran and obj.kernel._call is not None:
            namespace[name] = obj.kernel._call


def _boxed(gm):
    """``gm`` called with a boxed argument list (cleared, so that inputs can be freed)."""
    def run(args):
        values = list(args)
        args.clear()
        return gm(*values)
    return run


def load(wrapper: Wrapper, fallback=None, units=()) -> Compiled:
    """Compile the wrapper source into a function; tracebacks show the generated lines. ``units``: the
    C++ translation units its kernels were built from (shown to ``collect_sources``)."""
    digest = hashlib.sha256(wrapper.source.encode()).hexdigest()[:12]
    filename = f"<kiln {wrapper.name} {digest}>"
    linecache.cache[filename] = (len(wrapper.source), None, wrapper.source.splitlines(True), filename)
    namespace = {k: bind(v) if isinstance(v, KernelRef) else v for k, v in wrapper.globals.items()}
    exec(compile(wrapper.source, filename, "exec"), namespace)
    for sink in list(_SOURCE_SINKS):   # the active ``collect_sources`` scopes
        sink.extend([u.source for u in units] + [k.source for k in wrapper.kernels] + [wrapper.source])
    return Compiled(wrapper, namespace["call"], fallback)


def load_aten(wrapper: Wrapper, gm) -> Compiled:
    """A compiled graph running ``gm`` (unfused) in place of ``wrapper``, whose kernels failed to build."""
    compiled = Compiled(wrapper, _boxed(gm))
    compiled._direct = True
    return compiled


def bind_graph(gm) -> int:
    """Bind the kernel references of fused GraphModule ``gm`` in place (tests, tools); returns how many."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, KernelRef)]
    for n in nodes:
        n.target = bind(n.target)
    gm.recompile()
    return len(nodes)


@contextlib.contextmanager
def collect_sources():
    """The source of every wrapper and kernel generated inside the scope, as a list."""
    sources: list[str] = []
    _SOURCE_SINKS.append(sources)
    try:
        yield sources
    finally:
        _SOURCE_SINKS.remove(sources)
