"""Pattern passes: ``PatternMatcherPass`` and its entries, one kind per way to register a rewrite.

``apply(graph)`` tries every pattern registered for a candidate root's (op, target), roots last to first;
it rejects a match when an in-place op between its nodes writes a storage the match reads (``alias.py``),
then runs ``extra_check`` and the rewrite, counted in ``counters["kiln"]["pattern_matcher_count"]``.
"""
import collections
import hashlib
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.fx as fx

from kiln import debug
from kiln.debug import log
from kiln.passes.alias import AliasAnalysis, written_args
from kiln.passes.match.fx_lowerings import LoweringError, inserting
from kiln.passes.match.nodes import MultiOutputPattern
from kiln.passes.match.pattern import Match, PatternExpr
from kiln.options import UserError


class DuplicatePatternError(ValueError, UserError):
    """The same pattern was registered twice into one pass. The second copy could never fire (the
    first one rewrites the graph first); drop it or pass ``skip_duplicates=True``."""


def _return_true(match) -> bool:
    return True


class PatternEntry:
    """A pattern, its extra check, and how to apply a match (subclasses)."""

    def __init__(self, pattern: PatternExpr, extra_check: Callable = _return_true):
        self.pattern, self.extra_check = pattern, extra_check

    def apply(self, match: Match, graph: fx.Graph, node: fx.Node) -> bool:
        raise NotImplementedError

    def register(self, pass_dicts, target=None, prepend: bool = False) -> None:
        if target is None:
            for fn in self.pattern.fns:
                self.register(pass_dicts, fn, prepend)
            return
        if isinstance(pass_dicts, (dict, PatternMatcherPass)):
            entries = pass_dicts[(self.pattern.op, target)]
            entries.insert(0 if prepend else len(entries), self)
            return
        for d in pass_dicts:
            self.register(d, target, prepend)

    def describe(self) -> str:
        return repr(self.pattern)


class GraphPatternEntry(PatternEntry):
    def __init__(self, pattern, handler, extra_check=_return_true):
        super().__init__(pattern, extra_check)
        self.handler = handler

    def apply(self, match, graph, node):
        self.handler(match, *match.args, **match.kwargs)
        return True

    def describe(self):
        return f"{repr(self.pattern)} -> {_source_hash(self.handler)}"


class LoweringPatternEntry(GraphPatternEntry):
    """The handler returns an FX node built with the FX lowerings; it replaces the match root."""

    def apply(self, match, graph, node):
        if isinstance(self.pattern, MultiOutputPattern):
            raise LoweringError("register_lowering_pattern: MultiOutputPattern is not supported; "
                                "use register_graph_pattern and replace each output")
        before = set(graph.nodes)
        with inserting(graph, before=node):
            result = self.handler(match, *match.args, **match.kwargs)
        if result is None or result is node:
            for n in reversed([n for n in graph.nodes if n not in before]):
                if not n.users:
                    graph.erase_node(n)
            return False
        if isinstance(result, fx.Node):
            for k, v in node.meta.items():  # provenance (stack trace, module stack), not values
                if k not in ("val", "example_value", "tensor_meta"):
                    result.meta.setdefault(k, v)
            node.replace_all_uses_with(result)
        else:
            raise LoweringError(f"lowering pattern handler returned {type(result).__name__}; return the "
                                f"fx.Node built with kiln.pattern_matcher.lowerings (L[op](...))")
        match.erase_nodes()
        return True


class ReplacementPatternEntry(PatternEntry):
    """Replace the match with ``match.replacement_graph`` (set by the extra check)."""

    def __init__(self, pattern, extra_check, normalize_args: Callable):
        super().__init__(pattern, extra_check)
        self.normalize_args = normalize_args

    def apply(self, match, graph, node):
        return match.replace_with_graph(match.replacement_graph, self.normalize_args(**match.kwargs))


def _source_hash(fn) -> str:
    if hasattr(fn, "uuid"):
        return str(fn.uuid())
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        src = getattr(getattr(fn, "__code__", None), "co_code", repr(fn))
    return hashlib.sha256(src.encode() if isinstance(src, str) else bytes(src)).hexdigest()[:16]


class PatternMatcherPass:
    """Patterns keyed by the root's (op, target); ``apply(graph)``/``pass(graph)`` returns the match count."""

    def __init__(self, pass_name: Optional[str] = None, prevent_match_across_mutations: bool = True):
        self.patterns: Dict[Tuple[str, Any], List[PatternEntry]] = collections.defaultdict(list)
        self.pass_name, self.prevent_match_across_mutations = pass_name, prevent_match_across_mutations
        self.seen_patterns: set = set()

    def __getitem__(self, item) -> List[PatternEntry]:
        return self.patterns[item]

    def __call__(self, graph) -> int:
        return self.apply(graph)

    def uuid(self) -> str:
        h = hashlib.sha256(type(self).__qualname__.encode())
        for key in sorted(self.patterns, key=repr):
            for entry in self.patterns[key]:
                h.update(entry.describe().encode())
        return h.hexdigest()[:16]

    def apply(self, gm) -> int:
        graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
        if not isinstance(graph, fx.Graph):
            raise TypeError(f"{self.name}: expected a torch.fx.Graph or GraphModule, got {type(gm).__name__}")
        if not self.patterns:
            return 0
        candidates = []
        for op, target in self.patterns:
            if op != "call_module":
                candidates += graph.find_nodes(op=op, target=target, sort=False)
        if any(op == "call_module" for op, _ in self.patterns):
            candidates += graph.find_nodes(op="call_module", sort=False)
        guard = _MutationGuard(graph) if self.prevent_match_across_mutations else None
        count = 0
        for node in sorted(set(candidates), reverse=True):
            if node._erased:
                continue
            target = node.target
            if node.op == "call_module":
                target = type(graph.owning_module.get_submodule(node.target)) if graph.owning_module else None
            for entry in self.patterns.get((node.op, target), ()):
                if node._erased:
                    break
                m = entry.pattern.match(node)
                if not m:
                    continue
                if guard is not None and guard.spans_mutation(m):
                    log(5, f"{self.name}: {node.name}: match rejected, an in-place op between its nodes "
                           f"writes a value it reads")
                    continue
                if not entry.extra_check(m) or entry.apply(m, graph, node) is False:
                    continue
                count += 1
                debug.counters["kiln"]["pattern_matcher_count"] += 1
                debug.counters["kiln"]["pattern_matcher_nodes"] += len(m.nodes)
                log(5, f"{self.name}: matched {len(m.nodes)} nodes at {node.name}: {entry.pattern!r}")
        if count and isinstance(gm, fx.GraphModule):
            gm.recompile()
        return count

    @property
    def name(self) -> str:
        return self.pass_name or "pattern_matcher"


class _MutationGuard:
    """Answers: does an in-place op placed among a match's nodes write a storage the match reads?"""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.writers = [n for n in graph.nodes if written_args(n)]
        self._alias: Optional[AliasAnalysis] = None

    def spans_mutation(self, m: Match) -> bool:
        if not self.writers:
            return False
        nodes = [n for n in m.nodes if not n._erased]
        if not nodes:
            return False
        lo, hi, inside = min(nodes), max(nodes), set(nodes)
        between = [w for w in self.writers if not w._erased and w not in inside and lo < w < hi]
        if not between:
            return False
        if self._alias is None:
            self._alias = AliasAnalysis(self.graph)
        read = frozenset().union(*(self._alias.reads(n) for n in nodes), *(self._alias.of(n) for n in nodes))
        for w in between:
            if w not in self._alias.writes:
                self._alias.add(w)
            if self._alias.writes.get(w, frozenset()) & read:
                return True
        return False
