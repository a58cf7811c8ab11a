"""kiln's pipeline, top to bottom.

Dynamo graph -> pre-grad passes -> [freezing] -> AOTAutograd (kiln's decompositions) -> joint passes ->
[channels-last, Triton target] -> partition -> post-grad passes on forward and backward -> fusion and
kernel precompile (Triton target) -> Python wrapper -> runtime [-> CUDA graphs, mode="reduce-overhead"].

Each step runs through ``Trace.stage``, which times it, prints it (KILN_DEBUG), verifies it and dumps
it (KILN_DUMP). Inference under ``torch.no_grad()`` takes AOTAutograd's inference path: the joint passes
run on the inference graph and there is no backward.
"""
from __future__ import annotations


import torch
import torch.fx as fx

from kiln import compat, passes
from kiln.capture.decomp import decomposition_table
from kiln.codegen.wrapper import emit_wrapper
from kiln.debug import Trace, log
from kiln.options import Options, using
from kiln.runtime import load


def compile_graph(gm: fx.GraphModule, example_inputs: list, opts: Options):
    """Compile one Dynamo graph; returns a callable taking the same inputs."""
    with using(opts):
        return _compile_graph(gm, example_inputs, opts)


def _compile_graph(gm: fx.GraphModule, example_inputs: list, opts: Options):
    trace = Trace(opts)
    if opts.cpp_wrapper and not (opts.freezing and not torch.is_grad_enabled()):
        log(1, "cpp_wrapper=True: kiln has no C++ wrapper yet; running the Python wrapper")
    trace.show("capture", gm)
    if opts.dump_dir:
        from kiln.repro import write_repro
        write_repro(trace, gm, example_inputs, opts)
    trace.stage("pre_grad", passes.pre_grad, gm, opts)
    if opts.freezing and not torch.is_grad_enabled():
        from kiln.passes.freeze import compile_frozen
        return compile_frozen(gm, example_inputs, opts, trace, _aot)
    return _aot(gm, example_inputs, opts, trace)


def _aot(gm: fx.GraphModule, example_inputs: list, opts: Options, trace: Trace):
    """Hand the graph to AOTAutograd with kiln's compilers, partitioner and decompositions."""
    from torch._dynamo.backends.common import aot_autograd

    target = resolve_target(opts, example_inputs)
    if target == "triton":   # precompile workers start while AOTAutograd traces
        from kiln.codegen.precompile import start
        start(opts)
    graphs = cudagraphs_apply(opts, target)  # mode="reduce-overhead"
    n_user = {}

    layout: dict = {}   # names of saved values the forward produces with known strides (wrapper views)

    def fw_compiler(g, inputs):
        return lower(g, inputs, opts, trace, "forward", target, graphs, n_user.get("n", 0), layout=layout)

    def bw_compiler(g, inputs):  # runs lazily at the first backward, maybe on another thread
        return lower(g, inputs, opts, trace, "backward", target, graphs, layout=layout)

    def inference_compiler(g, inputs):
        trace.stage("joint", passes.joint, g, opts)
        return lower(g, inputs, opts, trace, "inference", target, graphs)

    def partition_fn(joint, joint_inputs, *, num_fwd_outputs, **kw):
        from kiln import partition
        n_user["n"] = num_fwd_outputs
        trace.stage("joint", passes.joint, joint, opts)
        if target == "triton" and opts.layout_optimization:
            from kiln.passes.channels_last import to_channels_last
            trace.stage("channels_last", to_channels_last, joint)
        return trace.stage("partition", partition.partition_joint, joint, joint_inputs,
                           num_fwd_outputs=num_fwd_outputs, opts=opts, **kw)

    aot = aot_autograd(**compat.aot_autograd_kwargs(
        fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=inference_compiler,
        partition_fn=partition_fn, decompositions=decomposition_table(target),
        keep_inference_input_mutations=True))
    return aot(gm, example_inputs)


def lower(gm: fx.GraphModule, inputs: list, opts: Options, trace: Trace, kind: str, target: str,
          graphs: bool = False, n_user: int = 0, layout=None):
    """Post-grad passes, fusion and wrapper generation for one forward/backward/inference graph;
    with ``graphs`` the result replays as a CUDA graph (runtime/cudagraph.py)."""
    with using(opts):
        if not graphs:
            return _lower(gm, inputs, opts, trace, kind, target, layout)
        from kiln.runtime import cudagraph
        mutated = cudagraph.mutated_inputs(gm)  # before fusion hides the writes inside kernels
        compiled = _lower(gm, inputs, opts, trace, kind, target, layout)
        return cudagraph.wrap(compiled, inputs, kind=kind, n_user=n_user, mutated=mutated)


def cudagraphs_apply(opts: Options, target: str) -> bool:
    """Whether ``mode="reduce-overhead"`` applies: CUDA graphs need the Triton target on CUDA."""
    if opts.mode != "reduce-overhead":
        return False
    if target != "triton" or not torch.cuda.is_available():
        log(1, f"mode='reduce-overhead': CUDA graphs need the Triton target on CUDA (target {target})")
        return False
    return True


def _lower(gm: fx.GraphModule, inputs: list, opts: Options, trace: Trace, kind: str, target: str,
           layout=None):
    """``layout``: shared by a forward and its backward; the forward records which saved values it
    produces with known strides, and the backward's wrapper reinterprets views of those."""
    names = None
    if layout is not None and kind == "forward":   # output names before passes: the backward's inputs
        out = gm.graph.output_node().args[0]
        names = [getattr(o, "name", None) for o in (out if isinstance(out, (tuple, list)) else (out,))]
    if kind == "inference" and target == "triton" and opts.layout_optimization:
        from kiln.passes.channels_last import to_channels_last
        trace.stage("channels_last", to_channels_last, gm)
    trace.stage(f"post_grad_{kind}", passes.post_grad, gm, opts)
    if target == "triton":
        from kiln.codegen.fuse import fuse_graph
        from kiln.passes.conv_bias import split_conv_bias
        trace.stage(f"conv_bias_{kind}", split_conv_bias, gm)
        trace.stage(f"fuse_{kind}", fuse_graph, gm, inputs, opts)
        from kiln.codegen.precompile import warm
        trace.stage(f"precompile_{kind}", warm, gm, opts)
    trusted = layout.get("saved", frozenset()) if layout is not None and kind == "backward" else frozenset()
    wrapper = emit_wrapper(gm, f"{kind}_{trace.id}", trusted)
    if names is not None:
        layout["saved"] = frozenset(n for n, ok in zip(names, wrapper.known_outputs) if ok and n)
    log(4, f"{kind} wrapper:\n{wrapper.source}")
    for k in wrapper.kernels:
        log(4, f"kernel {k.name}:\n{k.source}")
        trace.dump(f"kernel_{k.name}.py", k.source)
    trace.dump(f"wrapper_{kind}.py", wrapper.source)
    return load(wrapper)


def resolve_target(opts: Options, example_inputs) -> str:
    """'aten' or 'triton': 'auto' picks Triton when inputs live on CUDA and Triton is usable."""
    if opts.codegen != "auto":
        return opts.codegen
    on_cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)
    if not on_cuda:
        return "aten"
    try:
        import triton  # noqa: F401
        from kiln.codegen import fuse  # noqa: F401
    except ImportError as e:
        log(1, f"codegen: Triton target unavailable ({e}); running ATen kernels")
        return "aten"
    return "triton"
