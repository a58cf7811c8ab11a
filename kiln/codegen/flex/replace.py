"""The graph edit: each FlexAttention op becomes one call of a kiln kernel (``lower_flex``).

For every ``flex_attention`` / ``flex_attention_backward`` node: parse it (``hop.parse``), write its
kernel module (Triton: ``triton_module``; C++: ``cpp``, whose translation unit ``build`` compiles), and
put a ``call_function`` node whose target is ``load_kernel(source, fallback)`` in its place, with the
same result structure, so that its ``getitem`` users stay as they are. The fallback is a small graph
running the op itself (its dense implementation) on the same arguments: it runs if the kernel fails on
its first call. A node kiln cannot write (``Unsupported``: an op in a score_mod without a translation,
a block size no tile fits, the backward on the C++ target) keeps the op, with the reason logged and
counted in ``counters['fallback']['flex_attention']`` (or ``..._backward``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from kiln.codegen.fallback import Fallback
from kiln.codegen.flex.cpp import cpp_forward
from kiln.codegen.flex.hop import FlexCall, hop_name, parse
from kiln.codegen.flex.translate import Unsupported
from kiln.codegen.flex.triton_module import backward_module, forward_module, operands
from kiln.codegen.schedule.plan import KernelSource
from kiln.codegen.to_cpp.module import CppUnit
from kiln.debug import counters, log

OUTPUTS = {"flex": ("out", "lse", "max_scores"), "flex_decode": ("out", "lse", "max_scores"),
           "flex_backward": ("dq", "dk", "dv", "grads"), "flex_cpp": ("out", "lse", "max_scores")}


class HopFallback(Fallback):
    """The fallback of a FlexAttention kernel: the op on the kernel's arguments (its subgraphs copied
    from the graph as submodules)."""

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


def _source(call: FlexCall, opts, build):
    """(``KernelSource``, kind) of ``call``'s kernel module for the target ``opts.codegen`` names."""
    device = call.val(call.q).device
    if opts.codegen == "cpp":
        if call.backward:
            raise Unsupported("flex: kiln has no C++ FlexAttention backward (torch refuses FlexAttention's "
                              "backward on the CPU)")
        if build is None:
            raise Unsupported("flex: codegen='cpp' without a build function")
        source, fname, text = cpp_forward(call)
        build(CppUnit(source, (fname,)), opts)
        kind, interpret = "flex_cpp", None
    else:
        interpret = device.type != "cuda" and opts.emit_for != "cuda"
        if call.dtype == torch.float64:
            raise Unsupported("flex: float64 on the Triton target (its kernels accumulate in float32)")
        if call.backward:
            text, kind = backward_module(call, interpret)
        else:
            text, kind = forward_module(call, interpret, opts.tuning.flex_decode_q)
    return KernelSource(text, (), OUTPUTS[kind], (), kind, (), interpret), kind


def lower_flex(gm: fx.GraphModule, opts, load_kernel, build=None) -> int:
    """Replace ``gm``'s FlexAttention ops by kernels, in place (see the module docstring); returns how many.
    An error other than ``Unsupported`` (a kiln bug) also keeps the op, unless ``opts.on_error='raise'``."""
    graph, done = gm.graph, 0
    for node in list(graph.nodes):
        kind = hop_name(node)
        if not kind:
            continue
        try:
            call = parse(gm, node)
            source, sub = _source(call, opts, build)
            ops = operands(call)
            target = load_kernel(source, _fallback(gm, node, ops))
        except Exception as e:
            if not isinstance(e, Unsupported) and opts.on_error == "raise":
                raise
            counters["fallback"][kind] += 1
            log(1, f"flex: {node.name} runs FlexAttention's dense implementation ({type(e).__name__}: {e})")
            continue
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
    return done


__all__ = ["lower_flex"]
