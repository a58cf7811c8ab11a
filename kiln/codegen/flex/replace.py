"""The graph edit: each FlexAttention op becomes one call of a kiln kernel (``lower_flex``), whose fallback
runs the op itself; an op kiln cannot write (``Unsupported``) stays, the reason logged and counted.
"""
import torch
import torch.fx as fx

from kiln.codegen.fallback import Fallback
from kiln.codegen.flex.cpp import cpp_forward
from kiln.codegen.flex.hop import FlexCall, hop_name, parse
from kiln.codegen.flex.translate import Unsupported
from kiln.codegen.flex.triton_module import backward_module, forward_module, operands
from kiln.codegen.text.source import KernelSource, named
from kiln.debug import counters, log


class HopFallback(Fallback):
    """The op on the kernel's arguments, its subgraphs copied from the graph as submodules."""

    def __init__(self, gm: fx.GraphModule, graph: fx.Graph):
        super().__init__(graph)
        self._gm = fx.GraphModule(gm, graph, class_name="KilnFlexFallback")


def _fallback(gm, node, ops):
    g = fx.Graph()
    env = {}
    for i, o in enumerate(ops):
        p = g.placeholder(f"arg{i}")
        if isinstance(o, fx.Node) and o not in env:
            env[o] = p
    for a in node.all_input_nodes:
        if a.op == "get_attr" and a not in env:
            env[a] = g.get_attr(a.target)
    if any(a not in env for a in node.all_input_nodes):
        return None
    g.output(g.node_copy(node, lambda a: env[a]))
    return HopFallback(gm, g)


def _source(call: FlexCall, opts, cpp: bool):
    """(``KernelSource``, kind, C++ ``Unit`` or None) of ``call``'s kernel module on the target."""
    unit = None
    if cpp:
        if call.backward:
            raise Unsupported("flex: kiln has no C++ FlexAttention backward (torch refuses FlexAttention's "
                              "backward on the CPU)")
        unit, fname, text = cpp_forward(call)
        kind, interpret = "flex_cpp", None
    else:
        interpret = call.val(call.q).device.type != "cuda" and opts.emit_for != "cuda"
        if call.dtype == torch.float64:
            raise Unsupported("flex: float64 on the Triton target (its kernels accumulate in float32)")
        text, kind = backward_module(call, interpret) if call.backward else \
            forward_module(call, interpret, opts.tuning.flex_decode_q)
    outputs = ("dq", "dk", "dv", "grads") if call.backward else ("out", "lse", "max_scores")
    return KernelSource(text, (), outputs, (), kind, (), interpret), kind, unit


def lower_flex(gm: fx.GraphModule, opts, cpp: bool) -> tuple:
    """Replace ``gm``'s FlexAttention ops by kernel references, in place (see the module docstring); returns
    (how many, the C++ units to build). An error other than ``Unsupported`` (a kiln bug) also keeps the op,
    unless ``opts.on_error='raise'``."""
    graph, done, units = gm.graph, 0, []
    for node in list(graph.nodes):
        kind = hop_name(node)
        if not kind:
            continue
        try:
            call = parse(gm, node)
            source, sub, unit = _source(call, opts, cpp)
            ops = operands(call)
            target = named(source, _fallback(gm, node, ops))
        except Exception as e:
            if not isinstance(e, Unsupported) and opts.on_error == "raise":
                raise
            counters["fallback"][kind] += 1
            log(1, f"flex: {node.name} runs FlexAttention's dense implementation ({type(e).__name__}: {e})")
            continue
        units += [unit] if unit is not None else []
        with graph.inserting_before(node):
            new = graph.call_function(target, tuple(ops), {})
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        inputs = node.all_input_nodes
        graph.erase_node(node)
        for a in inputs:   # the subgraphs' get_attr nodes, now unused
            if a.op == "get_attr" and not a.users:
                graph.erase_node(a)
        counters["flex"][sub] += 1
        log(2, f"flex: {node.name} -> kernel {target.name} ({sub})")
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done, tuple(units)
