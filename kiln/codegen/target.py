"""Code generation targets: one ``Target`` per generator (ATen, Triton, C++), resolved once per graph
(``resolve``). The pipeline asks the target, never ``opts.codegen``: its decompositions, graph passes,
kernels (``fuse``: data, nothing built), how the runtime builds and loads them (``load``), its flags and
its share of the compile cache's key. A new generator is a new subclass.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from kiln.capture.decomp import decomposition_table
from kiln.codegen.flex import lower_flex
from kiln.codegen.generate import generate, on_cuda
from kiln.codegen.rewrite import random_nodes, rewrite
from kiln.codegen.schedule.group import GroupPlan
from kiln.codegen.schedule.plan import ScatterPlan
from kiln.codegen.text.source import declined
from kiln.codegen.to_cpp.module import write_unit
from kiln.codegen.to_triton.emit import Flags
from kiln.codegen.to_triton.group import write_group
from kiln.codegen.to_triton.module import write_module
from kiln.debug import counters, log
from kiln.options import Options
from kiln.passes.channels_last import CONVS, to_channels_last
from kiln.passes.constant_fold import fold_constants
from kiln.passes.conv_bias import split_conv_bias
from kiln.runtime import cpp_build, precompile
from kiln.runtime.load import load, load_aten


@dataclass(frozen=True, eq=False)
class Fused:
    """What ``Target.fuse`` made of a graph: its number of kernel nodes, the graph as it was when some
    kernel has no ATen fallback of its own (``fallback``), the C++ units to build and the kernel plans."""
    kernels: int = 0
    fallback: Optional[fx.GraphModule] = None
    units: tuple = ()
    plans: tuple = ()


def _stage(trace, name, fn, *args):
    return trace.stage(name, fn, *args) if trace is not None else fn(*args)


class Target:
    """The ATen target: composite ops kept whole (fewer, faster library calls), no kernels of kiln's."""
    name = "aten"
    fuses = False    # lowers ATen ops into kernels of its own
    mkldnn = True    # a CPU target: freezing prepacks convolutions for oneDNN

    def __init__(self, opts: Options):
        self.opts = opts

    def decompositions(self) -> dict:
        return decomposition_table(fusion=self.fuses)

    def start(self) -> None:
        """Work begun while AOTAutograd traces."""

    def cuda_graphs(self):
        """None (no CUDA graphs), or the host share of GPU time from which a graph is captured (0: always);
        CUDA graphs need the Triton target on CUDA."""
        if self.opts.graphs_asked:
            log(1, f"CUDA graphs (mode / cuda_graphs) need the Triton target on CUDA (target {self.name})")
        return None

    def joint(self, joint: fx.GraphModule, trace) -> None:
        """The target's passes on a training graph's joint graph, before partitioning."""

    def prepare(self, gm: fx.GraphModule, kind: str, trace) -> None:
        """The target's passes on a forward/backward/inference graph before the post-grad passes."""

    def fuse(self, gm: fx.GraphModule, inputs, kind: str = "inference", trace=None, strict: bool = False) -> Fused:
        """Replace the ATen nodes of ``gm`` the target fuses by its kernels, in place (see ``Fused``). Any
        failure leaves the graph unchanged, logged (``strict=True`` raises instead)."""
        return Fused()

    def build(self, gm: fx.GraphModule, fused: Fused, kind: str = "inference", trace=None) -> bool:
        """Make ``fused``'s kernels ready to run (``gm``: the fused graph); False when they cannot run."""
        return True

    def load(self, gm, wrapper, fused: Fused, kind: str, trace):
        """The compiled graph of ``wrapper``, its kernels built then bound (else the unfused graph)."""
        built = self.build(gm, fused, kind, trace)
        compiled = load(wrapper, fused.fallback, fused.units) if built else load_aten(wrapper, fused.fallback)
        compiled.units = fused.units
        return compiled

    def cache_key(self) -> str:
        return self.name


def _convolves(gm) -> bool:
    """Whether ``gm`` has a convolution (the layout stage runs, and is dumped, only then)."""
    return any(n.target in CONVS for n in gm.graph.nodes)


class _Fusing(Target):
    """A target with kernels of its own (``emit``: plans -> sources)."""
    fuses = True

    auto_layout = "cuda"   # what layout_devices='auto' means for this target's graphs
    groups = False         # launches independent pointwise kernels as one (``schedule.group``)

    def joint(self, joint, trace):
        if self.opts.layout_optimization and _convolves(joint):
            _stage(trace, "channels_last", to_channels_last, joint, self._layout_opts())

    def prepare(self, gm, kind, trace):
        if kind == "inference" and self.opts.layout_optimization and _convolves(gm):
            _stage(trace, "channels_last", to_channels_last, gm, self._layout_opts())
        if self.opts.fold_constants:
            _stage(trace, f"fold_{kind}", fold_constants, gm)

    def _layout_opts(self) -> Options:
        auto = self.opts.layout_devices == "auto"
        return self.opts.replace(layout_devices=self.auto_layout) if auto else self.opts

    def emit(self, plans, opts: Options, on_cuda: bool) -> tuple:
        """``([KernelSource per plan], Unit or None)``; a plan the emitter declines gets a source without text."""
        raise NotImplementedError

    def tuned(self, kind: str) -> Options:
        """The options the scheduler gets for a ``kind`` graph: inference graphs recompute fewer loads."""
        t = self.opts.tuning
        return self.opts.replace(**{"tuning.cheap_loads": t.cheap_loads_inference}) \
            if kind == "inference" and t.cheap_loads != t.cheap_loads_inference else self.opts

    def fuse(self, gm, inputs, kind="inference", trace=None, strict=False) -> Fused:
        fused = _stage(trace, f"fuse_{kind}", self._fuse, gm, self.tuned(kind), strict)
        if trace is not None:
            trace.show(f"fuse_{kind}", gm, note=f"{fused.kernels} kernels")
        return fused

    def _fuse(self, gm, opts, strict) -> Fused:
        gm.graph.eliminate_dead_code()
        try:
            code = generate(gm, opts, lambda plans, on_cuda: self.emit(plans, opts, on_cuda), self.groups)
        except Exception as e:
            if strict:
                raise
            counters["codegen"]["fallback"] += 1
            counters["random"]["aten"] += len(random_nodes(gm.graph))
            log(1, f"codegen: graph stays ATen ({type(e).__name__}: {e})")
            code = None
        kernels = rewrite(gm, code) if code is not None else 0
        # FlexAttention's ops, which the lowering keeps: kernels of their own (the unfused graph keeps the op)
        flex, units = lower_flex(gm, opts, self.name == "cpp")
        if code is None:
            return Fused(flex, None, units)
        units = ((code.unit,) if code.unit is not None else ()) + units
        return Fused(kernels + flex, code.unfused, units, tuple(code.plans))


class TritonTarget(_Fusing):
    """Triton kernels: compiled for CUDA, or run in Triton's CPU interpreter (unless ``emit_for='cuda'``)."""
    name = "triton"
    mkldnn = False
    groups = True

    def start(self):
        precompile.start(self.opts)   # the workers start while AOTAutograd traces

    def cuda_graphs(self):
        if not self.opts.graphs_asked:
            return None
        if not torch.cuda.is_available():
            log(1, "CUDA graphs (mode / cuda_graphs) need the Triton target on CUDA (no CUDA here)")
            return None
        return self.opts.tuning.graph_host_share if self.opts.cuda_graphs == "auto" else 0.0

    def fuse(self, gm, inputs, kind="inference", trace=None, strict=False):
        # cuDNN adds a bias in a pass of its own; oneDNN adds it in the convolution
        _stage(trace, f"conv_bias_{kind}", split_conv_bias, gm)
        return super().fuse(gm, inputs, kind, trace, strict)

    def build(self, gm, fused, kind="inference", trace=None):
        _stage(trace, f"precompile_{kind}", precompile.warm, gm, self.opts)   # GPU kernels, in worker processes
        return True

    def flags(self, plan, opts: Options = None) -> Flags:
        """What ``plan``'s kernel is written for: the interpreter for CPU tensors, autotuning on a GPU."""
        opts = opts or self.opts
        device = (plan.copy if isinstance(plan, ScatterPlan) else plan).device
        interpret = device.type != "cuda" and opts.emit_for != "cuda"
        autotune = opts.max_autotune or opts.mode in ("max-autotune", "max-autotune-no-cudagraphs")
        return Flags(interpret, autotune and not interpret, opts.tuning)

    def interpreted(self, plan, graph_on_cuda: bool) -> bool:
        """Whether ``plan``'s kernel would run in Triton's interpreter inside a graph with CUDA values (a
        CPU 0-dim constant): milliseconds a launch there, microseconds as ATen, which runs such plans."""
        return graph_on_cuda and self.flags(plan).interpret

    def writes(self, plan, graph_on_cuda: bool) -> bool:
        """Whether the emitter writes ``plan`` (else its ATen nodes run): not an ``interpreted`` kernel, nor
        an interpreted atomic add of bf16 values (numpy has no bf16)."""
        add = isinstance(plan, ScatterPlan) and plan.write.scatter.mode == "add"
        bf16_add = add and plan.write.scatter.buffer.dtype == torch.bfloat16 and self.flags(plan).interpret
        return not (bf16_add or self.interpreted(plan, graph_on_cuda))

    def emit(self, plans, opts, on_cuda):
        return [(write_group if isinstance(p, GroupPlan) else write_module)(p, self.flags(p, opts))
                if self.writes(p, on_cuda) else declined(p) for p in plans], None


class CppTarget(_Fusing):
    """C++/OpenMP kernels for CPU tensors: one translation unit per graph, built by the system compiler."""
    name = "cpp"
    auto_layout = "any"   # oneDNN's CPU convolutions run NHWC about twice as fast as NCHW (ResNet-style blocks)

    def fuse(self, gm, inputs, kind="inference", trace=None, strict=False):
        if on_cuda(gm):
            return Fused()   # C++ kernels run on CPU tensors only
        return super().fuse(gm, inputs, kind, trace, strict)

    def tuned(self, kind):
        """... and column reductions of short rows fold at any size (``tuning.fold_min_r`` 0: 1), since a fold
        costs no program here and saves a kernel, in at most as many chunks as a reduction over all rows."""
        opts = super().tuned(kind)
        t = opts.tuning
        chunks = min(t.fold_programs, 1 << (t.cpp_outer_chunks.bit_length() - 1))   # a power of two
        return opts.replace(**{"tuning.fold_min_r": t.fold_min_r or 1, "tuning.fold_programs": chunks})

    def emit(self, plans, opts, on_cuda):
        unit, sources = write_unit(plans, opts.tuning)
        return sources, unit

    def build(self, gm, fused, kind="inference", trace=None):
        """Build (or find built) and load each unit, its source shown first; False when one fails."""
        for unit in fused.units:
            log(4, f"{kind} C++ kernels:\n{unit.source}", artifact="output_code")
            if trace is not None:
                trace.dump(f"kernels_{kind}.cpp", unit.source)
                trace.trace(f"kiln_kernels_{kind}_cpp", unit.source)
            try:
                cpp_build.build(unit, self.opts)
            except cpp_build.CppBuildError:
                return False
        return True

    def cache_key(self):
        cxx = cpp_build.find_compiler(self.opts)
        return f"cpp|cxx={cpp_build.compiler_version(cxx) if cxx else ''}|isa={cpp_build.host_isa()}"


TARGETS = {t.name: t for t in (Target, TritonTarget, CppTarget)}


def triton_available() -> str:
    """Why Triton kernels cannot be generated here ('' when they can)."""
    try:
        import triton  # noqa: F401  (importable is all that is asked)
    except ImportError as e:
        return str(e)
    return ""


def resolve(opts: Options, example_inputs) -> Target:
    """The target of a graph ('auto': Triton for CUDA inputs, C++ for CPU ones, when usable, else ATen)."""
    name = opts.codegen
    if name == "auto":
        cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)
        why = triton_available() if cuda else cpp_build.unusable(opts)
        name = "aten" if why else ("triton" if cuda else "cpp")
        if why:
            log(1, f"codegen: {'Triton' if cuda else 'C++'} target unavailable ({why}); running ATen kernels")
    return TARGETS[name](opts)
