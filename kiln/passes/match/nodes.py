"""Node patterns, rooted at the node to rewrite: ``CallFunction(aten.relu, Arg())`` matches a call of one of
``fns`` (a packet: any overload) with matching arguments, inner nodes with exactly ``_users`` users
(``MULTIPLE``: any). ``MultiOutputPattern([p0, ...])``: ``p0`` anchors, the others are found among users.
"""
from typing import Any, Iterator, List, Optional, Sequence

import torch
import torch.fx as fx

from kiln.passes.match.pattern import _FAILED, MULTIPLE, FailedMatch, Match, MatchContext, PatternExpr, _same


def _expand_fns(fns) -> List[Any]:
    out = []
    for fn in fns if isinstance(fns, (list, tuple)) else [fns]:
        out += [fn] + ([getattr(fn, o) for o in fn.overloads()] if isinstance(fn, torch._ops.OpOverloadPacket) else [])
    return out


def _flat_patterns(value) -> Iterator[PatternExpr]:
    if isinstance(value, PatternExpr):
        yield value
    elif isinstance(value, (list, tuple, dict)):
        for v in value.values() if isinstance(value, dict) else value:
            yield from _flat_patterns(v)


class _TargetExpr(PatternExpr):
    """A node with an op, a target among ``fns``, arguments and a user count."""

    op = "call_function"

    def __init__(self, fns, *args, _users=1, **kwargs):
        self.fns = _expand_fns(fns)
        self.fns_set = set(self.fns)
        self.args, self.kwargs, self.users = tuple(args), dict(kwargs), _users

    def has_multiple_users(self) -> bool:
        return self.users is MULTIPLE or self.users > 1

    def _match_fns(self, node) -> bool:
        return isinstance(node, fx.Node) and node.op == self.op and _target_of(node) in self.fns_set

    def _node_args(self, node):
        """``node``'s args and the kwargs this pattern names, reconciled by the ATen schema; a kwarg it does
        not name must hold its default or None, else ``(None, None)``. ``pin_memory`` is ignored."""
        args = node.args
        kwargs = {k: v for k, v in node.kwargs.items() if k in self.kwargs}
        if not isinstance(node.target, torch._ops.OpOverload):
            return args, kwargs
        schema = node.target._schema.arguments
        n = len(self.args)
        if len(args) > n and len(args) <= len(schema):
            extra = list(zip(schema[n:len(args)], args[n:]))
            if all(a.name in self.kwargs or (a.has_default_value() and _same(v, a.default_value))
                   for a, v in extra):  # named by the pattern as kwargs, or defaults spelled out
                kwargs.update((a.name, v) for a, v in extra if a.name in self.kwargs)
                args = args[:n]
        elif len(args) < n <= len(schema):  # make_fx drops trailing defaults: fill them back
            filled = list(args)
            for a in schema[len(args):n]:
                if a.name in node.kwargs:
                    filled.append(node.kwargs[a.name])
                elif a.has_default_value():
                    filled.append(a.default_value)
                else:
                    return None, None
            args = tuple(filled)
        for i, a in enumerate(schema):
            if a.name in self.kwargs and a.name not in kwargs and a.has_default_value():
                kwargs[a.name] = a.default_value
            elif a.name in node.kwargs and a.name not in self.kwargs and a.name != "pin_memory" and i >= n:
                v = node.kwargs[a.name]
                if not (a.has_default_value() and _same(v, a.default_value)) and v is not None:
                    return None, None
        return args, kwargs

    def _match(self, node, ctx):
        if not self._match_fns(node):
            return FailedMatch("function_mismatch: %s", getattr(node, "target", node))
        if not (self in ctx.outputs or self.users is MULTIPLE or len(node.users) == self.users):
            return FailedMatch("multiple_users")
        args, kwargs = self._node_args(node)
        if args is None or len(args) != len(self.args) or set(kwargs) != set(self.kwargs):
            return FailedMatch("args_structure")
        m = Match(ctx, self)
        for p, v in [*zip(self.args, args), *((p, kwargs[k]) for k, p in self.kwargs.items())]:
            r = _match_arg(p, v, ctx)
            if not r:
                return r
            m.extend(r)
        m.nodes.append(node)
        m.targets[self] = node.target
        return m

    def find_anchor_nodes(self, ctx, searched):
        bound = ctx.pattern_to_node.get(self, _FAILED)
        if bound is not _FAILED and self in ctx.pattern_to_node:
            if isinstance(bound, fx.Node):
                yield bound
            return
        for p in _flat_patterns((self.args, self.kwargs)):
            for other in p.find_anchor_nodes(ctx, searched):
                if not isinstance(other, fx.Node):
                    continue
                for user in other.users:
                    if user not in searched and self._match_fns(user):
                        searched.add(user)
                        yield user

    def __repr__(self):
        fn = self.fns[0] if len(self.fns) == 1 or isinstance(self.fns[0], torch._ops.OpOverloadPacket) else self.fns
        parts = [repr(fn)] + [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        if self.users != 1:
            parts.append(f"_users={self.users!r}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _target_of(node: fx.Node):
    if node.op == "call_module" and node.graph.owning_module is not None:
        try:
            return type(node.graph.owning_module.get_submodule(node.target))
        except AttributeError:
            return None
    return node.target


def _match_arg(pattern, value, ctx) -> Any:
    """Match one argument: a sub-pattern, a list/tuple of them, or a constant compared by value."""
    if isinstance(pattern, PatternExpr):
        return ctx.match(pattern, value)
    if isinstance(pattern, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(pattern):
            return FailedMatch("args_structure")
        m = Match(ctx, None)
        for p, v in zip(pattern, value):
            r = _match_arg(p, v, ctx)
            if not r:
                return r
            m.extend(r)
        return m
    if isinstance(value, (fx.Node, torch.Tensor)) or isinstance(pattern, torch.Tensor) or pattern != value:
        return FailedMatch("constant_args: %r != %r", pattern, value)
    return Match(ctx, None)


class CallFunction(_TargetExpr):
    """Matches ``call_function`` nodes: ``CallFunction(aten.add, Arg(), 1)``."""


class CallMethod(_TargetExpr):
    """Matches ``call_method`` nodes: ``CallMethod("view", Arg(), Ignored())``."""

    op = "call_method"


class CallModule(_TargetExpr):
    """Matches ``call_module`` nodes by module type: ``CallModule(torch.nn.ReLU, Arg())``."""

    op = "call_module"


class ListOf(PatternExpr):
    """A list or tuple whose every element matches ``pattern`` (``partial=True``: at least one)."""

    def __init__(self, pattern, partial: bool = False):
        self.pattern, self.partial = pattern, partial

    def _match(self, node, ctx):
        if not isinstance(node, (list, tuple)) or not node:
            return FailedMatch("non_list")
        m = Match(ctx, self)
        pattern_to_node = ctx.filter_multi_user_patterns()
        matched = False
        for child_node in node:
            child_ctx = MatchContext(ctx.outputs, pattern_to_node, graph=ctx.graph)
            child = _match_arg(self.pattern, child_node, child_ctx)
            pattern_to_node = child_ctx.filter_multi_user_patterns()
            if not child:
                if not self.partial:
                    return FailedMatch("list[%d]: %s", len(m.args), child)
                continue
            matched = True
            m.extend(child.bundle())
        return FailedMatch("list: no_match") if not matched else m.bundle()

    def __repr__(self):
        return f"ListOf({self.pattern!r}{', partial=True' if self.partial else ''})"


class MultiOutputPattern(PatternExpr):
    """Several roots matched together; ``outputs[0]`` must be a call pattern (it anchors the search)."""

    def __init__(self, outputs: Sequence[Optional[PatternExpr]]):
        outputs = list(outputs)
        if not isinstance(outputs[0], _TargetExpr):
            raise TypeError(f"MultiOutputPattern: the first output must be CallFunction/CallMethod, "
                            f"got {outputs[0]!r}; reorder the outputs")
        self.outputs, self.op, self.fns = outputs, outputs[0].op, outputs[0].fns

    def _match(self, node, ctx):
        m = ctx.match(self.outputs[0], node)
        if not m:
            return m
        for pattern in self.outputs[1:]:
            if pattern is None:
                continue
            child = self._match_from_anchors(pattern, ctx)
            if not child:
                return child
            m.extend(child)
        return m

    @staticmethod
    def _match_from_anchors(pattern, ctx):
        prior = dict(ctx.pattern_to_node)
        m = FailedMatch("no anchor found")
        for node in pattern.find_anchor_nodes(ctx, set()):
            m = ctx.match(pattern, node)
            if m:
                return m
            ctx.pattern_to_node = dict(prior)  # undo the partial match
        return m

    def match(self, node: fx.Node):
        return MatchContext(self.outputs, graph=node.graph).match(self, node)

    def __repr__(self):
        return "MultiOutputPattern([\n  " + ",\n  ".join(repr(o) for o in self.outputs) + "\n])"
