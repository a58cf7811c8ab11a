"""kiln's pipeline, top to bottom.

Dynamo graph -> pre-grad passes -> AOTAutograd (the target's decompositions) -> joint passes ->
[freezing] -> the target's joint passes -> partition -> per forward/backward graph: the target's passes,
post-grad passes, the target's kernels -> Python wrapper -> runtime [-> CUDA graphs]. ``Trace.stage``
times, prints, verifies and dumps each step. ``aot_compilers`` is the one AOTAutograd set-up, for
``compile_graph`` and ``kiln.memory_efficient_fusion`` alike.
"""
import hashlib
import os
import sysconfig
import traceback
import types
import warnings

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

from kiln import cache, compat, debug, logs, partition, passes
from kiln.capture.hazards import upstream_hazard
from kiln.codegen.target import Target, resolve
from kiln.codegen.wrapper import emit_wrapper
from kiln.debug import Trace, log
from kiln.options import Options, UserError, using
from kiln.partition import ops as partition_ops
from kiln.passes import freeze
from kiln.passes.registry import cache_key as registered_passes_key
from kiln.repro import write_repro
from kiln.runtime import cudagraph


def compile_graph(gm: fx.GraphModule, example_inputs: list, opts: Options):
    """Compile one Dynamo graph into a callable. When compiling raises, the graph runs as eager does, with a
    warning, unless the error is a ``UserError`` or Dynamo's, or ``on_error='raise'``."""
    as_captured = types.MethodType(type(gm).forward, gm)   # the passes rewrite gm in place
    hazard = upstream_hazard(gm, example_inputs)
    if hazard:   # torch's capture would compute it wrongly: not an error of kiln's, so on_error does not apply
        return _as_captured(as_captured, f"kiln runs a graph as eager does: {hazard}", hazard)
    with using(opts):
        trace = Trace(opts)
        try:
            with trace.timed("backend"):
                compiled = _compile_graph(gm, example_inputs, opts, trace)
        except Exception as e:
            # Dynamo's own exceptions steer its tracing (restarts, skipped frames): never caught here
            if isinstance(e, torch._dynamo.exc.TorchDynamoException):
                raise
            trace.fail(e)
            if opts.on_error == "raise" or isinstance(e, UserError):
                raise
            return _eager(as_captured, e)
        return trace.on_first_call(compiled)


def _eager(forward, error: Exception):
    """``forward``, Dynamo's graph as captured, after a warning naming ``error``; where the user's code raised
    (a custom pass, a callable option), the warning is issued there, so that its filters apply."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/kiln/" in f.filename and not f.filename.endswith("pipeline.py")]
    user = [(f, n) for f, n in traceback.walk_tb(error.__traceback__) if not f.f_code.co_filename.startswith(_NOT_USER)]
    where = (f"{user[-1][0].f_code.co_filename}:{user[-1][1]}, in {user[-1][0].f_code.co_name}" if user else
             next((f"{f.filename}:{f.lineno}" for f in reversed(ours or frames)), "?"))
    reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]} (at {where})"
    return _as_captured(forward, f"kiln could not compile a graph and runs it as eager does: {reason}. "
                                 "on_error='raise' (KILN_ON_ERROR=raise) raises instead.", reason, user[-1:])


# code that is not the user's: kiln's, the standard library's, installed packages', generated ('<...>')
_NOT_USER = ("<", *{os.path.join(p, "") for p in (os.path.dirname(__file__), *(
    sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")))})


def _as_captured(forward, warning: str, reason: str, at=()):
    """``forward`` (Dynamo's graph as captured), counted, warned about and logged: kiln's eager fallback;
    ``at``: ``[(frame, line)]`` to warn at (as its own ``warnings.warn`` would)."""
    debug.counters["fallback"]["eager_graphs"] += 1
    if at:
        (frame, line), g = at[0], at[0][0].f_globals
        warnings.warn_explicit(warning, UserWarning, frame.f_code.co_filename, line, g.get("__name__"),
                               g.setdefault("__warningregistry__", {}), g)
    else:
        warnings.warn(warning, stacklevel=3)
    log(1, f"eager fallback: {reason}")
    return forward


def _compile_graph(gm: fx.GraphModule, example_inputs: list, opts: Options, trace: Trace):
    if opts.cpp_wrapper:
        log(1, "cpp_wrapper=True: kiln has no C++ wrapper; running the Python wrapper")
    trace.show("capture", gm)
    registered = passes.snapshot()   # the backward, compiled later, runs these too
    if trace.dir is not None:
        write_repro(trace, gm, example_inputs, opts, registered)
    target = resolve(opts, example_inputs)
    freezing = freeze.applies(opts)   # warns when a training graph asks for it
    session = cache.open_graph(gm, example_inputs, opts, cache_key(opts, registered), target.cache_key(),
                               frozen=freezing, registered=registered)
    hit = session.load(trace) if session is not None else None   # a hit replays what its compile showed
    if hit is not None:
        return hit
    trace.stage("pre_grad", passes.pre_grad, gm, opts, registered)
    region = None
    if freezing:
        region = freeze.module_region(gm, example_inputs)
        if region is None:
            log(1, "freeze: no parameters or buffers in this graph; compiling without freezing")
    compilers = aot_compilers(opts, target, trace, region, registered, session)
    with trace.timed("aot"):   # AOTAutograd's time: this call less kiln's compilers in it
        compiled = compat.aot_call(aot_autograd(**compilers), gm, example_inputs, keep=logs.tracing())
    if region is not None:
        freeze.finish(region, opts)
    if session is not None:
        session.traced()
    return compiled


def aot_compilers(opts: Options, target: Target, trace: Trace, region=None, registered=None, session=None) -> dict:
    """AOTAutograd's keyword arguments for one region: kiln's compilers, partitioner and decompositions
    (``region``: a ``freeze.FrozenRegion``; ``session``: a ``cache.Session``, which records)."""
    registered = passes.snapshot() if registered is None else registered
    target.start()
    graphs = target.cuda_graphs()  # None, or the host share from which graphs are captured (0: always)
    n_user = {}
    layout: dict = {}   # names of saved values the forward produces with known strides (wrapper views)

    def fw_compiler(g, inputs):
        with trace.timed("kiln"):
            if session is not None:
                session.recorder.metadata()
                session.recorder.forward_graph(g, n_user.get("n", 0))
            return _record(session, "forward", lower(g, inputs, opts, trace, "forward", target, graphs,
                                                     n_user.get("n", 0), layout=layout, registered=registered))

    def bw_compiler(g, inputs):  # runs lazily at the first backward, maybe on another thread
        trace.phase = "backward"
        with using(opts), trace.timed("backward"):
            try:
                if session is not None:
                    session.recorder.backward_graph(g)
                compiled = _record(session, "backward", lower(g, inputs, opts, trace, "backward", target, graphs,
                                                              layout=layout, registered=registered))
            except Exception as e:   # a forward that compiled does not fall back: the error goes to the dump
                trace.fail(e)
                raise
        with using(opts):
            trace.report_backward()
        return compiled

    def inference_compiler(g, inputs):
        with trace.timed("kiln"):
            return _inference(g, inputs)

    def _inference(g, inputs):
        if region is None:
            if session is not None:
                session.recorder.metadata()
            trace.stage("joint", passes.joint, g, opts, registered)
            return _record(session, "inference", lower(g, inputs, opts, trace, "inference", target, graphs,
                                                       registered=registered))
        keep = freeze.freeze_graph(g, inputs, region, opts, target, trace, registered)
        compiled = lower(g, [inputs[i] for i in keep], opts, trace, "inference", target, graphs, positions=keep,
                         registered=registered)
        return freeze.drop_frozen(compiled, keep)

    def partition_fn(joint, joint_inputs, *, num_fwd_outputs, **kw):
        with using(opts), trace.timed("kiln"):
            n_user["n"] = num_fwd_outputs
            trace.stage("joint", passes.joint, joint, opts, registered)
            target.joint(joint, trace)
            return trace.stage("partition", partition.partition_joint, joint, joint_inputs,
                               num_fwd_outputs=num_fwd_outputs, opts=opts, **kw)

    table = target.decompositions()
    if region is not None:
        freeze.keep_whole(table)   # eval BatchNorm stays one node, so that conv-BN folding sees it
    return dict(
        fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=inference_compiler,
        partition_fn=partition_fn, decompositions=table, keep_inference_input_mutations=True)


def _record(session, kind: str, compiled):
    """Hand a compiled graph to the compile cache's session (if any); returns it."""
    if session is not None:
        session.add(kind, compiled, getattr(compiled, "units", ()))
    return compiled


def lower(gm: fx.GraphModule, inputs: list, opts: Options, trace: Trace, kind: str, target: Target,
          graphs=None, n_user: int = 0, layout=None, positions=None, registered=None):
    """Post-grad passes, fusion and wrapper of one graph; ``graphs`` (not None) replays it as a CUDA graph,
    captured when host-bound by that share (0: always). ``positions``: each input's AOTAutograd position."""
    with using(opts):
        if graphs is None:
            return _lower(gm, inputs, opts, trace, kind, target, layout, registered)
        mutated = partition_ops.mutated_inputs(gm)  # before fusion hides the writes inside kernels
        compiled = _lower(gm, inputs, opts, trace, kind, target, layout, registered)
        return cudagraph.wrap(compiled, inputs, kind=kind, n_user=n_user, mutated=mutated, positions=positions,
                              host_share=graphs)


def _lower(gm: fx.GraphModule, inputs: list, opts: Options, trace: Trace, kind: str, target: Target,
           layout=None, registered=None):
    """``layout``, shared by a forward and its backward: the saved values the forward makes with known
    strides."""
    names = None
    if layout is not None and kind == "forward":   # output names before passes: the backward's inputs
        out = gm.graph.output_node().args[0]
        names = [getattr(o, "name", None) for o in (out if isinstance(out, (tuple, list)) else (out,))]
    target.prepare(gm, kind, trace)
    trace.stage(f"post_grad_{kind}", passes.post_grad, gm, opts, registered, kind == "inference")
    fused = target.fuse(gm, inputs, kind, trace)   # code generation: the graph now calls kernel references
    _show_plans(trace, kind, fused.plans)
    trusted = layout.get("saved", frozenset()) if layout is not None and kind == "backward" else frozenset()
    wrapper = emit_wrapper(gm, f"{kind}_{trace.id}", trusted, opts, output_views=kind != "backward")
    if names is not None:
        layout["saved"] = frozenset(n for n, ok in zip(names, wrapper.known_outputs) if ok and n)
    for k in wrapper.kernels:
        log(4, f"kernel {k.name}:\n{k.source}", artifact="output_code")
        trace.dump(f"kernel_{k.name}.py", k.source)
        trace.trace(f"kiln_kernel_{k.name.removeprefix('kiln_')}", k.source)
    log(4, f"{kind} wrapper:\n{wrapper.source}", artifact="output_code")
    trace.dump(f"wrapper_{kind}.py", wrapper.source)
    trace.trace(f"kiln_wrapper_{kind}", wrapper.source)
    return target.load(gm, wrapper, fused, kind, trace)   # the runtime: kernels built and bound


def _show_plans(trace: Trace, kind: str, plans) -> None:
    """Kernel plans, printed at KILN_DEBUG=4 and written to the dump (when somebody reads them)."""
    if not plans or not debug.wanted(4, "kiln_plans") and trace.dir is None and not logs.tracing():
        return
    text = "\n\n".join(p.describe(f"kernel {i}") for i, p in enumerate(plans))
    log(4, f"{kind} kernel plans:\n{text}", artifact="kiln_plans")
    trace.dump(f"plans_{kind}.txt", text)
    trace.trace(f"kiln_plans_{kind}", text)


def cache_key(opts: Options, registered=None) -> str:
    """What a compile depends on beyond its graph: the options and the registered passes (``snapshot()``)."""
    return hashlib.sha256(f"{opts.cache_key()}|{registered_passes_key(registered)}".encode()).hexdigest()[:16]
