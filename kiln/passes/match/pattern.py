"""The pattern matcher's core: ``Match``, ``MatchContext``, ``PatternExpr``, the leaf patterns binding values
unseen (``Arg``, ``KeywordArg``, ``ExclusiveKeywordArg``, ``Ignored``), and ``replace_with_graph``.
"""
import itertools
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.fx as fx

from kiln.passes.match.fx_lowerings import fake_values, nodes_in, propagate_val
from kiln.passes.match.trace import PatternTraceError, example_value, fwd_only


class Multiple:
    """The ``_users=MULTIPLE`` marker: the node may have any number of users."""

    def __repr__(self):
        return "MULTIPLE"


MULTIPLE = Multiple()
_FAILED = object()


class FailedMatch(RuntimeError):
    """A pattern did not match; ``str(e)`` says why. Falsy, so ``if m:`` tests for a match."""

    def __init__(self, fmt: str, *args):
        super().__init__(fmt % args if args else fmt)

    def __bool__(self):
        return False


def is_match(m) -> bool:
    return isinstance(m, Match)


def _same(a, b) -> bool:
    """Whether two bound values are the same (nodes by identity, constants by type and value)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node) or isinstance(a, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class Match:
    """A successful match: ``nodes`` (inner first, root last), ``args``, ``kwargs``, ``output_nodes()``."""

    def __init__(self, ctx: "MatchContext", pattern: "PatternExpr", args=None, kwargs=None):
        self.pattern, self.ctx, self.replacement_graph = pattern, ctx, None
        self.args: List[Any] = list(args or [])
        self.kwargs: Dict[str, Any] = dict(kwargs or {})
        self.nodes: List[fx.Node] = []
        self.targets: Dict["PatternExpr", Any] = {}   # pattern -> the target it matched

    def __bool__(self):
        return True

    @property
    def graph(self) -> fx.Graph:
        return self.ctx.graph

    def extend(self, other: "Match") -> None:
        for key in set(self.kwargs) & set(other.kwargs):
            if not _same(self.kwargs[key], other.kwargs[key]):
                raise FailedMatch("kwarg mismatch: %s", key)
        self.args.extend(other.args)
        self.nodes.extend(n for n in other.nodes if n not in self.nodes)
        self.kwargs.update(other.kwargs)
        self.targets.update(other.targets)

    def bundle(self) -> "Match":
        """Wrap the positional args in one tuple (``ListOf`` binds one arg per list)."""
        self.args = [tuple(self.args)] if self.args else []
        return self

    def output_nodes(self) -> List[Optional[fx.Node]]:
        bound = [self.ctx.pattern_to_node.get(p, _FAILED) if p is not None else None for p in self.ctx.outputs]
        return [None if n is _FAILED else n for n in bound]

    def output_node(self) -> fx.Node:
        return next(n for n in self.output_nodes() if n is not None)

    def erase_nodes(self) -> None:
        """Erase the matched nodes nothing uses any more (roots last-to-first)."""
        for n in reversed(self.nodes):
            if not n._erased and not n.users:
                n.graph.erase_node(n)

    def replace_with_graph(self, replacement_graph, args: Sequence[Any]) -> bool:
        """Splice ``replacement_graph`` (its placeholders bind ``args``) in for the match."""
        return replace_with_graph(self, self.graph, replacement_graph, args)

    def replace_by_example(self, replacement_fn, args: Sequence[Any], trace_fn=None,
                           run_functional_passes: bool = True) -> bool:
        """Trace ``replacement_fn`` on the example values of ``args`` and splice it in for the match."""
        return replace_by_example(self, replacement_fn, args, trace_fn, run_functional_passes)

    def __repr__(self):
        return f"Match(nodes={[n.name for n in self.nodes]}, args={self.args}, kwargs={self.kwargs})"


class MatchContext:
    """State of one match attempt: which pattern bound which node."""

    def __init__(self, outputs: Sequence[Optional["PatternExpr"]], pattern_to_node=None, graph=None):
        self.outputs, self.graph = list(outputs), graph
        self.pattern_to_node: Dict["PatternExpr", Any] = {} if pattern_to_node is None else pattern_to_node
        self.exclusive_node_set: List[fx.Node] = []

    def match(self, pattern: "PatternExpr", node) -> Any:
        bound = self.pattern_to_node.get(pattern, _FAILED)
        if pattern in self.pattern_to_node:
            if bound is not _FAILED and _same(bound, node):
                return Match(self, pattern)  # a shared sub-pattern, already checked
            return FailedMatch("repeated pattern differs")
        try:
            m = pattern._match(node, self)
        except FailedMatch as e:
            m = e
        self.pattern_to_node[pattern] = node if m else _FAILED
        return m

    def filter_multi_user_patterns(self) -> Dict["PatternExpr", Any]:
        return {p: n for p, n in self.pattern_to_node.items() if p.has_multiple_users() and n is not _FAILED}


class PatternExpr:
    """Base of all pattern expressions; ``match(node)`` returns a ``Match`` or a ``FailedMatch``."""

    def _match(self, node, ctx: MatchContext):
        raise NotImplementedError

    def match(self, node: fx.Node):
        return MatchContext([self], graph=node.graph).match(self, node)

    def has_multiple_users(self) -> bool:
        return False

    def find_anchor_nodes(self, ctx: MatchContext, searched) -> Iterator[fx.Node]:
        bound = ctx.pattern_to_node.get(self, _FAILED)
        if isinstance(bound, fx.Node):
            yield bound

    def __repr__(self):   # Arg(), KeywordArg('x'): also what duplicate checks and uuid() compare
        return f"{type(self).__name__}({', '.join(map(repr, vars(self).values()))})"


class Arg(PatternExpr):
    """Any value, captured positionally (``match.args``)."""

    def _match(self, node, ctx):
        return Match(ctx, self, args=[node])


class Ignored(PatternExpr):
    """Any value, not captured."""

    def _match(self, node, ctx):
        return Match(ctx, self)


class KeywordArg(PatternExpr):
    """Any value, captured as ``match.kwargs[name]``."""

    def __init__(self, name: str):
        self.name = name

    def _match(self, node, ctx):
        return Match(ctx, self, kwargs={self.name: node})

    def find_anchor_nodes(self, ctx, searched):
        # a KeywordArg is bound by name: another instance with the same name anchors too
        for p, n in list(ctx.pattern_to_node.items()):
            if isinstance(p, KeywordArg) and p.name == self.name and isinstance(n, fx.Node):
                yield n
                return


class ExclusiveKeywordArg(KeywordArg):
    """A KeywordArg whose node may be bound only once in a match."""

    def _match(self, node, ctx):
        if isinstance(node, fx.Node):
            if node in ctx.exclusive_node_set:
                return FailedMatch("exclusive arg appears twice")
            ctx.exclusive_node_set.append(node)
        return Match(ctx, self, kwargs={self.name: node})


# -- splicing a replacement in ---------------------------------------------------------------------
def _replace_uses(old: fx.Node, new) -> None:
    if isinstance(new, fx.Node):
        old.replace_all_uses_with(new)
        return
    for user in list(old.users):
        user.args = fx.map_arg(user.args, lambda n: new if n is old else n)
        user.kwargs = fx.map_arg(user.kwargs, lambda n: new if n is old else n)


def replace_with_graph(match, graph: fx.Graph, replacement, args: Sequence[Any]) -> bool:
    """Splice ``replacement`` (its placeholders bind ``args``) in for ``match.output_nodes()``, before the
    first output (joint graphs: after the latest input), then erase matched nodes left without users.
    Returns False, the graph unchanged, when a new output would come after a user of the one it replaces."""
    rgraph = replacement.graph if isinstance(replacement, fx.GraphModule) else replacement
    outputs = match.output_nodes()
    first_out = min(n for n in outputs if n is not None)
    arg_nodes = [n for n in nodes_in(args) if n.graph is graph]
    simple = not arg_nodes or max(arg_nodes) < first_out
    env: Dict[fx.Node, Any] = {}
    placeholders = iter(args)
    inserted: list = []
    result = None
    for n in rgraph.nodes:
        if n.op == "placeholder":
            env[n] = next(placeholders)
        elif n.op == "output":
            result = fx.map_arg(n.args[0], env.__getitem__)
        else:
            inputs = [x for x in nodes_in(fx.map_arg((n.args, n.kwargs), env.__getitem__)) if x.graph is graph]
            where = (graph.inserting_before(first_out) if simple or not inputs
                     else graph.inserting_after(max(inputs)))
            with where:
                env[n] = new = _copy_in(graph, replacement, n, env)
            inserted.append(new)
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(outputs) == 1 and len(results) != 1:
        results = [result]
    pairs = [(old, new) for old, new in zip(outputs, results) if old is not None and new is not None and old is not new]
    if any(isinstance(new, fx.Node) and not all(new < u for u in old.users) for old, new in pairs):
        for node in reversed(inserted):
            graph.erase_node(node)
        return False
    for old, new in pairs:
        _replace_uses(old, new)
    match.erase_nodes()
    return True


def _copy_in(graph: fx.Graph, replacement, n: fx.Node, env) -> fx.Node:
    """Copy one replacement node into ``graph`` at the current insertion point."""
    if n.op == "get_attr":
        value = getattr(replacement, n.target, None) if isinstance(replacement, fx.GraphModule) else None
        owner = graph.owning_module
        if owner is None or value is None:
            raise PatternTraceError("the replacement needs a constant but the graph has no owning module")
        name = free_attr(owner, "_kiln_constant")
        if isinstance(value, torch.Tensor):
            owner.register_buffer(name, value, persistent=False)
        else:
            setattr(owner, name, value)
        return graph.get_attr(name)
    new = graph.node_copy(n, env.__getitem__)
    # the traced values may belong to another fake mode (cached traces): recompute them
    new.meta.pop("val", None)
    new.meta.pop("tensor_meta", None)
    propagate_val(new)
    return new


def free_attr(owner, prefix: str) -> str:
    for i in itertools.count():
        if not hasattr(owner, f"{prefix}{i}"):
            return f"{prefix}{i}"


def replace_by_example(match, fn, args, trace_fn=None, run_functional_passes=True) -> bool:
    """Trace ``fn`` on the example values of ``args`` and splice the result in for ``match``."""
    mode, vals = fake_values([example_value(a) for a in args])
    with mode:
        gm = fwd_only(fn, vals, run_functional_passes=run_functional_passes) if trace_fn is None else trace_fn(fn, vals)
    return replace_with_graph(match, match.graph, gm, args)
