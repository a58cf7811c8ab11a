"""The core of the pattern matcher: ``Match``, ``MatchContext``, ``PatternExpr`` and the leaf patterns.

Leaf patterns bind values without looking at them: ``Arg()`` (positional), ``KeywordArg(name)``,
``ExclusiveKeywordArg(name)`` and ``Ignored()``. Node patterns (``CallFunction`` and friends) are in
``nodes.py``. A ``Match`` rewrites the graph through ``replace.py`` (``replace_by_example``,
``replace_with_graph``), which knows matches only by their methods and imports nothing from here.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.fx as fx

from kiln.passes.match import replace


class Multiple:
    """The ``_users=MULTIPLE`` marker: the node may have any number of users."""

    def __repr__(self):
        return "MULTIPLE"


MULTIPLE = Multiple()
_FAILED = object()


class FailedMatch(RuntimeError):
    """A pattern did not match; ``str(e)`` says why. Falsy, so ``if m:`` tests for a match."""

    def __init__(self, fmt: str, *args):
        self.format_string, self.args_ = fmt, args
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
        self.pattern = pattern
        self.args: List[Any] = list(args or [])
        self.kwargs: Dict[str, Any] = dict(kwargs or {})
        self.nodes: List[fx.Node] = []
        self.targets: Dict["PatternExpr", Any] = {}
        self.ctx = ctx
        self.replacement_graph: Optional[fx.GraphModule] = None

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
        out = []
        for p in self.ctx.outputs:
            n = self.ctx.pattern_to_node.get(p, _FAILED) if p is not None else None
            out.append(None if n is _FAILED else n)
        return out

    def output_node(self) -> fx.Node:
        return next(n for n in self.output_nodes() if n is not None)

    def erase_nodes(self) -> None:
        """Erase the matched nodes nothing uses any more (roots last-to-first)."""
        for n in reversed(self.nodes):
            if not n._erased and not n.users:
                n.graph.erase_node(n)

    def replace_with_graph(self, replacement_graph, args: Sequence[Any]) -> bool:
        """Splice ``replacement_graph`` (its placeholders bind ``args``) in for the match."""
        return replace.replace_with_graph(self, self.graph, replacement_graph, args)

    def replace_by_example(self, replacement_fn, args: Sequence[Any], trace_fn=None,
                           run_functional_passes: bool = True) -> bool:
        """Trace ``replacement_fn`` on the example values of ``args`` and splice it in for the match."""
        return replace.replace_by_example(self, replacement_fn, args, trace_fn, run_functional_passes)

    def __repr__(self):
        return f"Match(nodes={[n.name for n in self.nodes]}, args={self.args}, kwargs={self.kwargs})"


class MatchContext:
    """State of one match attempt: which pattern bound which node."""

    def __init__(self, outputs: Sequence[Optional["PatternExpr"]], pattern_to_node=None, graph=None):
        self.outputs = list(outputs)
        self.pattern_to_node: Dict["PatternExpr", Any] = {} if pattern_to_node is None else pattern_to_node
        self.graph = graph
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


class Arg(PatternExpr):
    """Any value, captured positionally (``match.args``)."""

    def _match(self, node, ctx):
        return Match(ctx, self, args=[node])

    def __repr__(self):
        return "Arg()"


class Ignored(PatternExpr):
    """Any value, not captured."""

    def _match(self, node, ctx):
        return Match(ctx, self)

    def __repr__(self):
        return "Ignored()"


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

    def __repr__(self):
        return f"KeywordArg({self.name!r})"


class ExclusiveKeywordArg(KeywordArg):
    """A KeywordArg whose node may be bound only once in a match."""

    def _match(self, node, ctx):
        if isinstance(node, fx.Node):
            if node in ctx.exclusive_node_set:
                return FailedMatch("exclusive arg appears twice")
            ctx.exclusive_node_set.append(node)
        return Match(ctx, self, kwargs={self.name: node})

    def __repr__(self):
        return f"ExclusiveKeywordArg({self.name!r})"
