"""Constant folding on an ATen graph whose frozen parameters are ``get_attr`` constants.

A node folds when every node it reads is a constant (a ``get_attr`` or a node that folds) and no rule in
``NEVER_FOLD`` refuses it. Folded values are computed once, eagerly, on real tensors. Each folded value
still read by a node that does not fold becomes a new constant (``_frozen_paramN``) and the subgraph
behind it is removed. Placeholders are never constants, so nothing that depends on an input or on a
SymInt folds.

Shared helpers for the other folding passes live here too: ``add_constant`` (a new ``get_attr`` with a
fake ``val``), ``constant_value`` (the tensor behind a ``get_attr``) and ``drop_unused_constants``.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from kiln.debug import log

aten = torch.ops.aten

PREFIX = "_frozen_param"
# A fold may not allocate more than this many bytes beyond twice the storage it reads: folding must not
# materialize a large expanded or broadcast tensor that eager never keeps around.
GROWTH_SLACK_BYTES = 4096
UNINITIALIZED = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                 aten.new_empty.default, aten.new_empty_strided.default}


def _tags(n: fx.Node):
    return getattr(n.target, "tags", ())


def _mutates(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _symbolic(n: fx.Node) -> bool:
    val = n.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    for v in vals:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape):
            return True
    return False


# (reason, predicate(node) -> True when the node must stay in the graph). Rules are data: one line each.
NEVER_FOLD = [
    ("random", lambda n: torch.Tag.nondeterministic_seeded in _tags(n)),  # rand, dropout: new values per call
    ("side effect", lambda n: _mutates(n) or n.is_impure()),               # copy_, in-place ops, prints
    ("higher-order op", lambda n: isinstance(n.target, torch._ops.HigherOrderOperator)),
    ("uninitialized", lambda n: n.target in UNINITIALIZED),                 # empty: no value to keep
    ("symbolic shape", _symbolic),                                          # depends on a SymInt
]


def refusal(n: fx.Node):
    """The reason ``n`` may never fold, or None."""
    for reason, pred in NEVER_FOLD:
        if pred(n):
            return reason
    return None


# -- constants -----------------------------------------------------------------------------------
def constant_value(gm: fx.GraphModule, n) -> "torch.Tensor | None":
    """The tensor a ``get_attr`` node holds, or None when ``n`` is not a tensor constant."""
    if not isinstance(n, fx.Node) or n.op != "get_attr":
        return None
    obj = gm
    for part in n.target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def _fake_of(value: torch.Tensor, fake_mode):
    if fake_mode is not None:
        return fake_mode.from_tensor(value, static_shapes=True)
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def add_constant(gm: fx.GraphModule, value: torch.Tensor, fake_mode=None) -> fx.Node:
    """Register ``value`` on ``gm`` as ``_frozen_paramN`` and return a new ``get_attr`` node reading it.

    The node goes right after the placeholders; its ``meta['val']`` is a fake (static-shape) copy.
    """
    k = getattr(gm, "_kiln_constant_count", 0)
    while hasattr(gm, f"{PREFIX}{k}"):
        k += 1
    name = f"{PREFIX}{k}"
    gm._kiln_constant_count = k + 1
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        gm.register_buffer(name, value.detach(), persistent=False)
    anchor = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    ctx = gm.graph.inserting_before(anchor) if anchor is not None else gm.graph.inserting_after(None)
    with ctx:
        node = gm.graph.get_attr(name)
    node.meta["val"] = _fake_of(value, fake_mode)
    return node


def fake_mode_of(gm: fx.GraphModule):
    """The fake mode of ``gm``'s metadata (None when no node carries a fake value)."""
    from torch._subclasses.fake_tensor import FakeTensor
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def drop_unused_constants(gm: fx.GraphModule) -> int:
    """Remove dead nodes, then every ``get_attr`` constant nobody reads (node and attribute)."""
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    dropped = 0
    for name in [b for b in list(gm._buffers) if b.startswith(PREFIX) and b not in used]:
        delattr(gm, name)
        dropped += 1
    gm.recompile()
    return dropped


def protect_outputs(gm: fx.GraphModule) -> int:
    """Return a fresh copy of every output that is a constant, so callers can never edit a constant."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
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
    if count:
        gm.recompile()
    return count


# -- folding -------------------------------------------------------------------------------------
def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def _grows_too_much(n: fx.Node, args, kwargs, out) -> bool:
    """True when ``out`` is a new allocation much bigger than the constants it was computed from."""
    if not isinstance(out, torch.Tensor):
        return False
    ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    ptr = out.untyped_storage().data_ptr()
    if any(a.untyped_storage().data_ptr() == ptr for a in ins if a.device == out.device):
        return False  # a view: no new memory
    read = sum(_storage_bytes(a) for a in ins)
    return _storage_bytes(out) > 2 * read + GROWTH_SLACK_BYTES


def _evaluate(n: fx.Node, env: dict):
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    args, kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
    with unset_fake_temporarily(), torch.no_grad():
        out = n.target(*args, **kwargs)
    return args, kwargs, out


def fold_constants(gm: fx.GraphModule, fake_mode=None) -> int:
    """Fold every subgraph whose inputs are all constants; edits ``gm`` in place.

    Returns the number of nodes folded away. Constructors (``full``, ``arange``) seed folds, but only values
    that also read a constant are evaluated and stored (``_worth_evaluating``): a mask made by writing Python
    numbers (constants) into slices of ``zeros`` folds into one constant; ``arange(n).view(1, n)`` stays.
    """
    fake_mode = fake_mode or fake_mode_of(gm)
    env: dict = {}
    needed, store = _worth_evaluating(gm)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n in store:   # a tensor constant
            env[n] = constant_value(gm, n)
        if n not in needed or not all(a in env for a in n.all_input_nodes):
            continue
        try:
            args, kwargs, out = _evaluate(n, env)
        except Exception as e:  # an op that cannot run eagerly here just stays in the graph
            log(5, f"fold: {n.name} ({n.target}) not folded: {e}")
            continue
        if n.all_input_nodes and _grows_too_much(n, args, kwargs, out):
            log(5, f"fold: {n.name} not folded (result would materialize a large tensor)")
            continue
        env[n] = out
    folded = _materialize(gm, env, fake_mode, store)
    if folded:
        drop_unused_constants(gm)
        log(5, f"fold: {folded} nodes folded")
    return folded


def _worth_evaluating(gm: fx.GraphModule) -> tuple:
    """``(evaluate, store)``: the ops that may fold (constant inputs only, no ``refusal``) and read a constant,
    directly or through such ops (``store``: only these may become constants), and those plus the foldable
    ops feeding them (``evaluate``). Constructors and what only they feed are neither: running them wastes
    work (a backward's logits-sized ``full``, at every compile); storing ``arange(n).view(1, n)`` would hide
    its index arithmetic from the code generators (one-hot rows)."""
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
    changed = True
    while changed:  # a non-tensor value read outside the folded set cannot become a constant: unfold it
        changed = False
        for n in list(env):
            if n.op == "get_attr" or isinstance(env[n], torch.Tensor):
                continue
            if any(u not in env for u in n.users):
                del env[n]
                changed = True
    folded_nodes = [n for n in env if n.op == "call_function"]
    for n in folded_nodes:
        if n in store and isinstance(env[n], torch.Tensor) and any(u not in env for u in n.users):
            const = add_constant(gm, env[n], fake_mode)
            n.replace_all_uses_with(const)
    gm.graph.eliminate_dead_code()
    alive = set(gm.graph.nodes)
    return sum(1 for n in folded_nodes if n not in alive)


def count_ops(gm: fx.GraphModule, target) -> int:
    """How many call_function nodes of ``gm`` call ``target`` (an OpOverload or packet)."""
    def match(t):
        return t == target or getattr(t, "overloadpacket", None) == target
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and match(n.target))


__all__ = ["fold_constants", "add_constant", "constant_value", "drop_unused_constants", "protect_outputs",
           "NEVER_FOLD", "refusal", "fake_mode_of", "count_ops", "infer_val", "compute_dtype", "like"]


def infer_val(node: fx.Node, fake_mode=None):
    """Compute ``node.meta['val']`` from its inputs' vals: under ``fake_mode``, else on the meta device."""
    import contextlib
    from torch._subclasses.fake_tensor import FakeTensor

    def val(a):
        v = a.meta.get("val") if isinstance(a, fx.Node) else a
        if fake_mode is None and isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
            v = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return v

    args, kwargs = pytree.tree_map(val, (node.args, node.kwargs))
    with (fake_mode if fake_mode is not None else contextlib.nullcontext()):
        out = node.target(*args, **kwargs)
    node.meta["val"] = out
    return out


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype folds compute in: float32 for low-precision floats, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of ``t`` is contiguous."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    return t.permute(order).is_contiguous()


def like(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` cast to ``old``'s dtype, with ``old``'s strides when those are dense (keeps the layout)."""
    new = new.to(old.dtype)
    if new.shape != old.shape or not _dense(old):
        return new.contiguous()
    out = torch.empty_strided(old.shape, old.stride(), dtype=old.dtype, device=old.device)
    return out.copy_(new)
