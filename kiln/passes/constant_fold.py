"""Constant folding on an ATen graph whose frozen parameters are ``get_attr`` constants: a node reading only
constants folds unless ``NEVER_FOLD`` refuses it (computed once, eagerly, new constants where still read);
also the helpers the other folding passes share (``add_constant``, ``constant_value``, ``infer_val`` ...).
"""
import contextlib

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils import _pytree as pytree

from kiln.debug import log

aten = torch.ops.aten

PREFIX = "_frozen_param"
# A fold may allocate at most this beyond twice the storage it reads (no large expanded tensor eager lacks)
GROWTH_SLACK_BYTES = 4096
UNINITIALIZED = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                 aten.new_empty.default, aten.new_empty_strided.default}


def val(n):
    """``meta['val']`` of an FX node; None for anything else."""
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _symbolic(n: fx.Node) -> bool:
    out = n.meta.get("val")
    return any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) or
               isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape)
               for v in (out if isinstance(out, (tuple, list)) else (out,)))


# (reason, predicate(node) -> True when the node must stay in the graph)
NEVER_FOLD = [
    ("random", lambda n: torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())),
    ("side effect", lambda n: getattr(getattr(n.target, "_schema", None), "is_mutable", False) or n.is_impure()),
    ("higher-order op", lambda n: isinstance(n.target, torch._ops.HigherOrderOperator)),
    ("uninitialized", lambda n: n.target in UNINITIALIZED),                 # empty: no value to keep
    ("symbolic shape", _symbolic),
]


def refusal(n: fx.Node):
    """The reason ``n`` may never fold, or None."""
    return next((reason for reason, pred in NEVER_FOLD if pred(n)), None)


# -- constants -----------------------------------------------------------------------------------
def constant_value(gm: fx.GraphModule, n) -> "torch.Tensor | None":
    """The tensor a ``get_attr`` node holds, or None when ``n`` is not a tensor constant."""
    if not isinstance(n, fx.Node) or n.op != "get_attr":
        return None
    obj = gm
    for part in n.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def add_constant(gm: fx.GraphModule, value: torch.Tensor, fake_mode=None) -> fx.Node:
    """A new ``get_attr`` node (after the placeholders, with a fake value) reading ``value`` (``_frozen_paramN``)."""
    k = getattr(gm, "_kiln_constant_count", 0)
    while hasattr(gm, f"{PREFIX}{k}"):
        k += 1
    name = f"{PREFIX}{k}"
    gm._kiln_constant_count = k + 1
    with unset_fake_temporarily():
        gm.register_buffer(name, value.detach(), persistent=False)
    anchor = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    with gm.graph.inserting_before(anchor) if anchor is not None else gm.graph.inserting_after(None):
        node = gm.graph.get_attr(name)
    node.meta["val"] = fake_mode.from_tensor(value, static_shapes=True) if fake_mode is not None else \
        torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return node


def fake_mode_of(gm: fx.GraphModule):
    """The fake mode of ``gm``'s metadata (None when no node carries a fake value)."""
    return next((n.meta["val"].fake_mode for n in gm.graph.nodes if isinstance(n.meta.get("val"), FakeTensor)), None)


def drop_unused_constants(gm: fx.GraphModule) -> int:
    """Remove dead nodes, then every ``get_attr`` constant nobody reads (node and attribute)."""
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    dropped = [b for b in list(gm._buffers) if b.startswith(PREFIX) and b not in used]
    for name in dropped:
        delattr(gm, name)
    gm.recompile()
    return len(dropped)


def protect_outputs(gm: fx.GraphModule) -> int:
    """Return a fresh copy of every output that is a constant, so callers can never edit a constant."""
    out = gm.graph.output_node()
    count = 0

    def guard(a):
        nonlocal count
        if isinstance(a, fx.Node) and a.op == "get_attr":
            with gm.graph.inserting_before(out):
                c = gm.graph.call_function(aten.clone.default, (a,))
            c.meta["val"] = a.meta.get("val")
            count += 1
            return c
        return a

    out.args = (pytree.tree_map(guard, out.args[0]),)
    return recompiled(gm, count)


# -- folding -------------------------------------------------------------------------------------
def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def _grows_too_much(args, kwargs, out) -> bool:
    """True when ``out`` is a new allocation much bigger than the constants it was computed from."""
    if not isinstance(out, torch.Tensor):
        return False
    ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    ptr = out.untyped_storage().data_ptr()
    if any(a.untyped_storage().data_ptr() == ptr for a in ins if a.device == out.device):
        return False  # a view: no new memory
    return _storage_bytes(out) > 2 * sum(_storage_bytes(a) for a in ins) + GROWTH_SLACK_BYTES


def fold_constants(gm: fx.GraphModule, fake_mode=None) -> int:
    """Fold every subgraph whose inputs are all constants (``_worth_evaluating``) in place; returns nodes folded."""
    fake_mode = fake_mode or fake_mode_of(gm)
    env: dict = {}
    needed, store = _worth_evaluating(gm)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n in store:   # a tensor constant
            env[n] = constant_value(gm, n)
        if n not in needed or not all(a in env for a in n.all_input_nodes):
            continue
        args, kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
        try:
            with unset_fake_temporarily(), torch.no_grad():
                out = n.target(*args, **kwargs)
        except Exception as e:  # an op that cannot run eagerly here just stays in the graph
            log(5, f"fold: {n.name} ({n.target}) not folded: {e}")
            continue
        if n.all_input_nodes and _grows_too_much(args, kwargs, out):
            log(5, f"fold: {n.name} not folded (result would materialize a large tensor)")
            continue
        env[n] = out
    folded = _materialize(gm, env, fake_mode, store)
    if folded:
        drop_unused_constants(gm)
        log(5, f"fold: {folded} nodes folded")
    return folded


def _worth_evaluating(gm: fx.GraphModule) -> tuple:
    """``(evaluate, store)``: ``store``, foldable ops reading a constant (directly or through such ops), may
    become constants; ``evaluate`` adds the foldable ops feeding them. Constructors alone are neither."""
    foldable, store = set(), set()
    for n in gm.graph.nodes:
        const = n.op == "get_attr" and constant_value(gm, n) is not None
        if const or (n.op == "call_function" and all(a in foldable for a in n.all_input_nodes) and refusal(n) is None):
            foldable.add(n)
            if const or any(a in store for a in n.all_input_nodes):
                store.add(n)
    evaluate, stack = set(), [n for n in store if n.op == "call_function"]
    while stack:
        n = stack.pop()
        if n not in evaluate:
            evaluate.add(n)
            stack.extend(a for a in n.all_input_nodes if a.op == "call_function" and a in foldable)
    return evaluate, store


def _materialize(gm: fx.GraphModule, env: dict, fake_mode, store: set) -> int:
    """Replace each folded tensor in ``store`` read by a non-folded node with a constant; count nodes removed."""
    while drop := [n for n in env if n.op != "get_attr" and not isinstance(env[n], torch.Tensor)
                   and any(u not in env for u in n.users)]:   # read outside the folded set, not a tensor: unfold it
        for n in drop:
            del env[n]
    folded_nodes = [n for n in env if n.op == "call_function"]
    for n in folded_nodes:
        if n in store and isinstance(env[n], torch.Tensor) and any(u not in env for u in n.users):
            n.replace_all_uses_with(add_constant(gm, env[n], fake_mode))
    gm.graph.eliminate_dead_code()
    alive = set(gm.graph.nodes)
    return sum(1 for n in folded_nodes if n not in alive)


# -- helpers of the other folding passes ------------------------------------------------------------
def recompiled(gm: fx.GraphModule, changed: int, dead_code: bool = False) -> int:
    """A pass's count ``changed``; when not 0, ``gm`` recompiled (``dead_code``: its dead nodes dropped first)."""
    if changed and dead_code:
        gm.graph.eliminate_dead_code()
    if changed:
        gm.recompile()
    return changed


def infer_val(node: fx.Node, fake_mode=None):
    """Compute ``node.meta['val']`` from its inputs' vals: under ``fake_mode``, else on the meta device."""
    def meta(a):
        v = a.meta.get("val") if isinstance(a, fx.Node) else a
        if fake_mode is None and isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
            v = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return v

    args, kwargs = pytree.tree_map(meta, (node.args, node.kwargs))
    with (fake_mode if fake_mode is not None else contextlib.nullcontext()):
        node.meta["val"] = out = node.target(*args, **kwargs)
    return out


def call(graph: fx.Graph, fake_mode, target, *args, before=None, **kwargs) -> fx.Node:
    """A new node ``target(*args, **kwargs)`` before ``before`` (None: at the insertion point), its value inferred."""
    with graph.inserting_before(before) if before is not None else contextlib.nullcontext():
        node = graph.call_function(target, args, kwargs)
    infer_val(node, fake_mode)
    return node


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype folds compute in: float32 for low-precision floats, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def like(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` cast to ``old``'s dtype, with ``old``'s strides when those are dense (keeps the layout)."""
    new = new.to(old.dtype)
    order = sorted(range(old.dim()), key=lambda d: old.stride(d), reverse=True)
    if new.shape != old.shape or not old.permute(order).is_contiguous():   # not dense
        return new.contiguous()
    return torch.empty_strided(old.shape, old.stride(), dtype=old.dtype, device=old.device).copy_(new)
