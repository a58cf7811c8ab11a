"""Common-subexpression elimination on FX graphs: nodes calling the same target with structurally equal
arguments merge (``x + 1`` and ``x + 1.0`` stay apart), never impure ones (random, ``empty*``, higher-order
ops) nor a node whose storage is written or returned. Each read is stamped with its storage's write count
(``alias.py``): ``x.cos(); y.add_(1); x.cos()`` merges, ``x.cos(); x.add_(1); x.cos()`` does not.
"""
import contextlib
import copy
import gc
import time
from typing import Dict

import torch
import torch.fx as fx

from kiln.debug import log
from kiln.passes.alias import EMPTY, AliasAnalysis, storages_of_outputs, target_name

RANDOM_OPS = frozenset({
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm",
    "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
    "dropout1d", "dropout2d", "dropout3d", "_fused_dropout", "fused_dropout",
    "bernoulli", "normal", "multinomial", "poisson", "binomial", "rrelu", "rrelu_with_noise",
    "_standard_gamma", "_sample_dirichlet", "uniform", "exponential", "geometric", "log_normal",
    "cauchy", "random", "seed", "philox_rand",
})
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"})
NEVER = frozenset({"placeholder", "output", "get_attr"})


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (by name, module type, or the ATen tag)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags:
        return True
    name = target_name(node)
    bare = name.strip("_")
    return (name.rstrip("_") in RANDOM_OPS or bare in RANDOM_OPS or bare.startswith("rand")
            or "dropout" in bare or "rrelu" in bare)


_IMPURE_CACHE: Dict[object, bool] = {}


def _unmergeable(node: fx.Node) -> bool:
    if node.op in NEVER:
        return True
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):   # depends on the target only
        if t not in _IMPURE_CACHE:
            _IMPURE_CACHE[t] = _unmergeable_uncached(node)
        return _IMPURE_CACHE[t]
    return _unmergeable_uncached(node)


def _unmergeable_uncached(node: fx.Node) -> bool:
    t = node.target
    if isinstance(t, torch._ops.HigherOrderOperator) or is_random(node) or target_name(node) in UNINITIALIZED:
        return True
    if node.op == "call_module":
        mod = node.graph.owning_module.get_submodule(t) if node.graph.owning_module is not None else None
        if mod is None or (mod.training and any(True for _ in mod.buffers())):
            return True
    try:
        return node.is_impure()
    except Exception:  # is_impure needs an owning module for call_module nodes
        return True


def _key(value, rep: Dict[fx.Node, fx.Node]):
    """A hashable, type-aware key for an FX argument."""
    tp = type(value)
    if tp is fx.Node:
        return rep.get(value, value)
    if tp in (int, bool, str) or value is None:
        return (tp, value)
    if tp is float:
        return (float, value.hex())
    if isinstance(value, (list, tuple)):
        return ("T" if isinstance(value, tuple) else "L", tuple(_key(v, rep) for v in value))
    if isinstance(value, dict):
        return ("D", tuple((k, _key(v, rep)) for k, v in value.items()))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (tp, value.node)
    if isinstance(value, complex):
        return (complex, value.real.hex(), value.imag.hex())
    if isinstance(value, slice):
        return (slice, _key(value.start, rep), _key(value.stop, rep), _key(value.step, rep))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return ("id", id(value)) if isinstance(value, torch.Tensor) else (tp, value)


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic GC: its passes over a big FX graph dominate per-node loops that free nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@gc_paused()
def find_duplicates(graph: fx.Graph) -> Dict[fx.Node, fx.Node]:
    """Map every node that repeats an earlier computation to that earlier node (its representative)."""
    alias = AliasAnalysis(graph)
    returned = storages_of_outputs(graph, alias)
    mutated = alias.mutated
    version: Dict[object, int] = {}
    rep: Dict[fx.Node, fx.Node] = {}
    seen: Dict[object, fx.Node] = {}
    for node in graph.nodes:
        own = alias.storages.get(node, EMPTY)
        writes = alias.writes.get(node)
        mergeable = not (writes or _unmergeable(node) or own & returned or own & mutated)
        if mergeable:
            stamp = EMPTY
            if mutated:
                stamp = frozenset((s, version.get(s, 0)) for s in alias.reads(node) & mutated)
            key = (node.op, node.target, _key(node.args, rep), _key(node.kwargs, rep), stamp)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable target
                first = None
                key = None
            if first is not None:
                rep[node] = first
            elif key is not None:
                seen[key] = node
        for s in writes or ():
            version[s] = version.get(s, 0) + 1
    return rep


def fx_graph_cse(graph: fx.Graph) -> fx.Graph:
    """Return a NEW graph in which identical computations appear once (``graph`` is untouched)."""
    rep = find_duplicates(graph)
    new_graph = fx.Graph()
    new_graph._codegen = graph._codegen
    env: Dict[fx.Node, fx.Node] = {}
    with gc_paused():
        for node in graph.nodes:
            env[node] = env[rep[node]] if node in rep else _copy_node(new_graph, node, env)
    log(5, f"fx_graph_cse: {len(rep)} of {len(graph.nodes)} nodes merged")
    return new_graph


def _copy_node(new_graph: fx.Graph, node: fx.Node, env: Dict[fx.Node, fx.Node]) -> fx.Node:
    """``Graph.node_copy`` without its per-argument pytree walk (a third of the copy time)."""
    new = new_graph.create_node(node.op, node.target, None, None, node.name, node.type)
    if node.args:
        new.args = fx.map_arg(node.args, env.__getitem__)
    if node.kwargs:
        new.kwargs = fx.map_arg(node.kwargs, env.__getitem__)
    new.meta = copy.copy(node.meta)
    return new


def cse(gm) -> int:
    """Merge repeated computations of ``gm`` (a GraphModule or Graph) in place; return nodes removed."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    start = time.perf_counter()
    rep = find_duplicates(graph)
    for node, first in rep.items():
        node.replace_all_uses_with(first)
    for node in reversed(list(rep)):
        graph.erase_node(node)
    if isinstance(gm, fx.GraphModule) and rep:
        gm.recompile()
    log(5, f"cse: {len(rep)} nodes removed in {time.perf_counter() - start:.3f}s")
    return len(rep)
