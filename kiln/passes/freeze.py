"""Inference freezing (``freezing=True`` under ``torch.no_grad()``): module state becomes constants, then
folds (``module_region``, ``freeze_graph``, ``drop_frozen``, ``finish``: the pipeline's order). Frozen values
are snapshots, as under Inductor; ``freezing_discard_parameters`` erases the originals (``ErasedTensor``).
"""
import gc
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from kiln.debug import counters, log
from kiln.passes import binary_fold, channels_last, concat_linear, conv_bn, joint
from kiln.passes.constant_fold import add_constant, drop_unused_constants, fold_constants, protect_outputs
from kiln.passes.patterns.mkldnn import pack_conv_weights

aten = torch.ops.aten
MAX_FOLD_ROUNDS = 4


@dataclass
class FrozenRegion:
    """One compiled region's freezing state, from ``module_region`` to ``finish``."""
    real: list                                 # the real value of each AOT flat input
    state: set                                 # positions holding module state (freeze candidates)
    frozen: list = field(default_factory=list)  # positions turned into constants
    lifted: int = 0                            # leading inputs AOTAutograd lifted from the graph module
    sources: list = field(default_factory=list)  # Dynamo's source of each input (None when lifted)


# -- which inputs are module state --------------------------------------------------------------------
def _source(n: fx.Node):
    src = getattr(n, "_dynamo_source", None)
    if src is None and n.meta.get("grapharg") is not None:
        src = getattr(n.meta["grapharg"], "source", None)
    return src


def _source_text(source) -> str:
    """A Dynamo source's name, like ``L['self']._modules['conv']._parameters['weight']``."""
    name = getattr(source, "name", "")
    return name() if callable(name) else str(name)


def module_state(gm: fx.GraphModule, example_inputs) -> set:
    """Positions of Dynamo's placeholders that are parameters, buffers or module tensor attributes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {i for i, (n, ex) in enumerate(zip(placeholders, example_inputs)) if isinstance(ex, torch.Tensor) and (
        isinstance(ex, torch.nn.Parameter) or "._parameters[" in _source_text(_source(n))
        or "._buffers[" in _source_text(_source(n))
        or n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") is not None)}


# -- placeholders -> constants ------------------------------------------------------------------------
def _kept_by_aot_metadata() -> "set | None":
    """Input positions that must stay inputs: mutated ones and bases of outputs that alias an input."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if meta is None:
        return None
    keep = {i for i, info in enumerate(meta.input_info)
            if info.mutates_data or info.mutates_metadata or getattr(info, "mutates_storage_metadata", False)}
    return keep | {o.base_idx for o in meta.output_info
                   if o.output_type.name in ("alias_of_input", "is_input") and o.base_idx is not None}


def _freezable(t, val) -> bool:
    """A plain tensor (not fake, not erased) of static shape."""
    symbolic = isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in val.shape)
    return type(t) in (torch.Tensor, torch.nn.Parameter) and not symbolic


def freeze_placeholders(gm: fx.GraphModule, region: FrozenRegion, fake_mode=None) -> int:
    """Replace each freezable module-state placeholder of ``gm`` with a constant (``region.frozen``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    keep = _kept_by_aot_metadata()
    if keep is None or len(placeholders) != len(region.real):
        log(1, f"freeze: nothing frozen (AOT metadata {'missing' if keep is None else 'present'}, "
               f"{len(placeholders)} placeholders for {len(region.real)} inputs)")
        return 0
    by_id: dict = {}
    for i in sorted(region.state - keep):
        t, ph = region.real[i], placeholders[i]
        if not _freezable(t, ph.meta.get("val")):
            continue
        if id(t) not in by_id:
            by_id[id(t)] = add_constant(gm, t, fake_mode)
        ph.replace_all_uses_with(by_id[id(t)])
        gm.graph.erase_node(ph)
        region.frozen.append(i)
    gm.recompile()
    counters["kiln"]["frozen_params"] += len(region.frozen)
    return len(region.frozen)


# -- the freezing passes ------------------------------------------------------------------------------
def _mkldnn_rewrite(gm: fx.GraphModule, target, inputs, opts=None) -> int:
    """Seed 002's CPU pattern (``target.mkldnn``): prepacked mkldnn convolutions, the graph channels-last
    first with ``layout_optimization`` (they write channels-last: a contiguous graph paid two copies each)."""
    on_cpu = all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in inputs)
    if not target.mkldnn or not on_cpu or not torch.backends.mkldnn.is_available():
        return 0
    if opts is not None and opts.layout_optimization:
        channels_last.to_channels_last(gm, opts.replace(layout_devices="any"))
    return pack_conv_weights(gm)   # it and to_channels_last recompile what they change


def freezing_passes(gm: fx.GraphModule, opts, target, trace, fake_mode=None, inputs=()) -> dict:
    """Fold the constants of ``gm`` in place; returns the statistics (also in counters['kiln'])."""
    stats = {"layout": trace.stage("freeze_layout", channels_last.convert_conv_weights, gm, opts)}
    stats.update(constant_folded=0, conv_bn_folded=0, binary_folded=0)
    for _ in range(MAX_FOLD_ROUNDS):
        stats["constant_folded"] += trace.stage("constant_fold", fold_constants, gm, fake_mode)
        cb = trace.stage("conv_bn", conv_bn.fold_conv_bn, gm, fake_mode)
        bf = trace.stage("binary_fold", binary_fold.fold_binary, gm, fake_mode)
        stats["conv_bn_folded"] += cb
        stats["binary_folded"] += bf
        if not (cb or bf):
            break
    stats["concat_linear"] = trace.stage("concat_linear", concat_linear.concat_linears, gm, fake_mode)
    if target.fuses:   # a BatchNorm left unfolded fuses as mul-add
        stats["bn_affine"] = trace.stage("bn_to_affine", conv_bn.bn_to_affine, gm, fake_mode)
    stats["constant_folded"] += fold_constants(gm, fake_mode)
    stats["mkldnn"] = trace.stage("mkldnn", _mkldnn_rewrite, gm, target, inputs, opts)
    if stats["mkldnn"]:
        trace.stage("pin_strides", channels_last.pin_eager_strides, gm, fake_mode)
    drop_unused_constants(gm)
    protect_outputs(gm)
    stats["constants"] = sum(1 for n in gm.graph.nodes if n.op == "get_attr")
    for k in ("constant_folded", "conv_bn_folded", "binary_folded", "concat_linear"):
        counters["kiln"][k] += stats[k]
    counters["kiln"]["frozen_constants"] += stats["constants"]  # constants the compiled graph reads
    return stats


# -- the compiled region (kiln/pipeline.py calls these in order) -----------------------------------
def applies(opts) -> bool:
    """Whether this graph freezes (``freezing=True``, grad disabled); a training graph warns."""
    if opts.freezing and torch.is_grad_enabled():
        counters["kiln"]["freezing_skipped_training"] += 1
        warnings.warn("kiln: freezing=True froze nothing in a graph traced with grad enabled (a training graph): "
                      "freezing applies to inference graphs only. Call the compiled model under torch.no_grad() "
                      "or torch.inference_mode() (after model.eval()) to freeze its parameters.", stacklevel=2)
    return opts.freezing and not torch.is_grad_enabled()


def module_region(gm: fx.GraphModule, example_inputs: list) -> "FrozenRegion | None":
    """Which AOT inputs of Dynamo's graph ``gm`` are module state that can be guarded (None: none are)."""
    lifted = list({**dict(gm.named_parameters(remove_duplicate=False)),   # in the order AOTAutograd lifts them
                   **dict(gm.named_buffers(remove_duplicate=False))}.values())
    sources = [None] * len(lifted) + [_source(n) for n in gm.graph.nodes if n.op == "placeholder"]
    state = {len(lifted) + i for i in module_state(gm, example_inputs)}
    unguarded = {i for i in state if sources[i] is None} if _dynamo_guards() is not None else state
    if unguarded:
        log(1, f"freeze: {len(unguarded)} module tensors not frozen: Dynamo cannot guard their identity")
    state = set(range(len(lifted))) | (state - unguarded)
    if not state:
        return None
    return FrozenRegion(real=lifted + list(example_inputs), state=state, lifted=len(lifted), sources=sources)


def keep_whole(decompositions: dict) -> None:
    """Take eval BatchNorm out of AOTAutograd's decomposition table, so that conv-BN folding sees it."""
    for op in (aten._native_batch_norm_legit_no_training.default, aten.native_batch_norm.default):
        decompositions.pop(op, None)


def freeze_graph(gm: fx.GraphModule, inputs: list, region: FrozenRegion, opts, target, trace, registered=None) -> list:
    """Freeze ``gm`` in place (constants, joint and folding passes); returns the positions of the inputs left."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    fake_mode = detect_fake_mode(inputs)
    with unset_fake_temporarily():  # folding computes with the real tensors
        trace.stage("freeze", freeze_placeholders, gm, region, fake_mode)
        trace.stage("joint", joint, gm, opts, registered)
        stats = freezing_passes(gm, opts, target, trace, fake_mode, inputs)
    log(2, f"freezing: {len(region.frozen)} params frozen, {stats['constant_folded']} nodes folded, "
           f"{stats['conv_bn_folded']} conv-bn folds, {stats['binary_folded']} binary folds, "
           f"{stats['concat_linear']} linears concatenated, {stats['constants']} constants")
    frozen = set(region.frozen)
    return [i for i in range(len(inputs)) if i not in frozen]


def drop_frozen(compiled, keep: list):
    """A boxed callable taking every AOT input that passes only the kept ones to ``compiled``."""
    def run(args):
        kept = [args[i] for i in keep]
        args.clear()
        return compiled(kept)
    run._boxed_call = True
    run.compiled = compiled
    return run


def finish(region: FrozenRegion, opts) -> None:
    """After AOTAutograd compiled the region: guard the frozen inputs, release the originals and the real inputs."""
    if opts.freezing_discard_parameters and region.frozen:
        _release(region)
    guard_identity(region)
    region.real = []


def _dynamo_guards():
    """The guards Dynamo installs when this compile returns (None outside a Dynamo compile)."""
    ctx = torch._guards.TracingContext.try_get()
    return getattr(getattr(ctx, "guards_context", None), "dynamo_guards", None)


def guard_identity(region: FrozenRegion) -> int:
    """Guard the identity (ID_MATCH) of each frozen Dynamo input and its local module (Dynamo guards
    parameters by shape only: instances of a class shared frozen weights); returns how many."""
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.source import LocalSource
    todo = [region.sources[i] for i in region.frozen if i >= region.lifted]   # module_region: all guardable
    for source in todo:
        root = source.get_base() if hasattr(source, "get_base") else None
        path = _source_text(source)[len(_source_text(root)):] if isinstance(root, LocalSource) else ""
        for s in (source, root) if path.startswith(("._modules[", "._parameters[", "._buffers[")) else (source,):
            _dynamo_guards().add(s.make_guard(GuardBuilder.ID_MATCH))
    return len(todo)


# -- discarding the originals -----------------------------------------------------------------------
ERASED_MESSAGE = ("Trying to run Pytorch Eager Module after Dynamo Freezing. The original parameters have "
                  "been discarded for memory efficiency ({where}). Call the compiled module instead, or "
                  "compile with freezing_discard_parameters=False to keep them.")


def _unguard(source) -> bool:
    """Drop Dynamo's pending guards on frozen input ``source`` (they fail once it is erased); False if impossible."""
    guards = _dynamo_guards()
    if source is None or guards is None or not hasattr(guards, "inner"):
        return False
    name = _source_text(source)

    def on_source(g) -> bool:  # guards on the source itself or on anything read through it
        n = _source_text(g.originating_source)
        return n == name or n.startswith((name + ".", name + "["))

    try:
        if hasattr(guards, "remove_guards_with_source"):
            guards.remove_guards_with_source(source)
        if any(on_source(g) for g in guards.inner):  # older versions match sources differently
            guards.inner = type(guards.inner)(g for g in guards.inner if not on_source(g))
            if hasattr(guards, "source_to_guards"):
                guards.source_to_guards.clear()
                for g in guards.inner:
                    guards.track_guard_by_source(g)
    except Exception as e:  # Dynamo internals changed: keep the original rather than break the guards
        log(1, f"freeze: cannot drop the guards on {name}: {e}")
        return False
    return not any(on_source(g) for g in guards.inner)


def _release(region: FrozenRegion) -> None:
    ctx = torch._guards.TracingContext.try_get()
    params_flat = getattr(ctx, "params_flat", None) if ctx is not None else None
    release = []
    for i in region.frozen:
        if i < region.lifted:  # a graph-module attribute: Dynamo guards its module, not the tensor
            if params_flat is not None and i < len(params_flat):
                params_flat[i] = None  # AOTAutograd's runtime then passes None; the region ignores it
            release.append(region.real[i])
        elif _unguard(region.sources[i]):
            release.append(region.real[i])
        else:
            log(1, f"freeze: input {i} kept: its Dynamo guards could not be dropped")
    erased = discard_parameters(release)
    log(1, f"freeze: discarded {erased} original parameters and buffers")


class ErasedTensor(torch.Tensor):
    """A parameter dropped by ``freezing_discard_parameters``: meta device (the module still prints); ops raise."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, name: str, owner):
        meta = torch.empty_strided(elem.shape, elem.stride(), dtype=elem.dtype, device="meta")
        t = torch.Tensor._make_subclass(cls, meta, elem.requires_grad)
        t.erased_name = f"{type(owner).__name__}.{name}"
        if isinstance(elem, torch.nn.Parameter):
            t._is_param = True  # still passes isinstance(t, nn.Parameter) for module bookkeeping
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a.erased_name for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, ErasedTensor)]
        raise RuntimeError(ERASED_MESSAGE.format(where=f"{func} on {', '.join(names)}"))

    def __repr__(self):
        return f"ErasedTensor({self.erased_name}, shape={list(self.shape)}, dtype={self.dtype})"


def discard_parameters(tensors) -> int:
    """Swap each of ``tensors`` for an ErasedTensor in every nn.Module holding it; returns the swap count."""
    ids = {id(t) for t in tensors}
    count = 0
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.nn.Module):
                continue
        except Exception:  # objects with odd __class__ properties
            continue
        for store in (obj.__dict__.get("_parameters", {}), obj.__dict__.get("_buffers", {}), obj.__dict__):
            for name, t in list(store.items()):
                if isinstance(t, torch.Tensor) and id(t) in ids and type(t) in (torch.Tensor, torch.nn.Parameter):
                    store[name] = ErasedTensor(t, name, obj)
                    count += 1
    return count
