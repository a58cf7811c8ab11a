"""Op classes the min-cut partitioner needs: ``HEAVY`` (matmul, convolution, attention) are not recomputed
unless the knapsack lets them, random ops never; recomputable: cheap ops (pointwise, casts, views, size
math...); fusible: recomputable and no library call.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten


def _packets(*names):
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


HEAVY = _packets(
    "mm", "bmm", "addmm", "baddbmm", "_scaled_mm", "convolution", "_convolution", "convolution_backward",
    "cudnn_convolution", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward", "upsample_bilinear2d", "_int_mm")

CHEAP_REDUCTIONS = _packets("sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "prod",
                            "argmax", "argmin", "any", "all", "logsumexp")

CASTS_AND_COPIES = _packets("_to_copy", "clone", "detach", "alias", "lift_fresh_copy", "_unsafe_view",
                            "convert_element_type", "contiguous")

CONSTRUCTORS = _packets("full", "zeros", "ones", "empty", "empty_like", "full_like", "zeros_like",
                        "ones_like", "arange", "scalar_tensor", "new_zeros", "new_ones", "new_full",
                        "new_empty", "empty_strided", "iota")

INDEXING = _packets("index", "gather", "index_select", "slice", "select", "slice_scatter", "select_scatter",
                    "index_put", "narrow", "embedding", "cat", "stack", "where", "masked_fill",
                    "constant_pad_nd", "split", "split_with_sizes", "unbind", "squeeze", "unsqueeze")

SYM_OPS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
           operator.neg, operator.pow, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
           operator.ge, operator.and_, operator.or_, torch.sym_float, torch.sym_int, torch.sym_max,
           torch.sym_min, torch.sym_not, torch.sym_sqrt}
SYM_OPS |= {getattr(torch.ops.aten.sym_size, "int", None), getattr(torch.ops.aten.sym_stride, "int", None),
            getattr(torch.ops.aten.sym_numel, "default", None), getattr(torch.ops.aten.sym_storage_offset,
                                                                        "default", None)}


class OpClass:
    """Facts about one op target, computed once (op targets hash slowly; lookups go by id)."""
    __slots__ = ("target", "view", "seeded", "heavy", "pointwise", "reduction", "cheap", "cat", "dropout_arg")

    def __init__(self, target):
        tags = getattr(target, "tags", ()) or ()
        p = getattr(target, "overloadpacket", None)
        self.target = target
        self.view = bool(getattr(target, "is_view", False))
        self.seeded = torch.Tag.nondeterministic_seeded in tags
        self.heavy = p in HEAVY
        self.pointwise = torch.Tag.pointwise in tags
        self.reduction = torch.Tag.reduction in tags
        self.cat = p is aten.cat
        self.cheap = (target in SYM_OPS or self.view or self.pointwise or p in CHEAP_REDUCTIONS
                      or p in CASTS_AND_COPIES or p in CONSTRUCTORS or p in INDEXING)
        schema = getattr(target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        self.dropout_arg = names.index("dropout_p") if "dropout_p" in names else None


_CLASSES: dict = {}


def op_class(node: fx.Node) -> OpClass:
    t = node.target
    c = _CLASSES.get(id(t))
    if c is None or c.target is not t:
        c = _CLASSES[id(t)] = OpClass(t)
    return c


def is_view(node: fx.Node) -> bool:
    """The op returns an alias of its input (view, t, expand, permute, ...)."""
    return node.op == "call_function" and op_class(node).view


def is_random(node: fx.Node) -> bool:
    """Draws random numbers (attention kernels only when their dropout_p is not 0)."""
    if node.op != "call_function":
        return False
    c = op_class(node)
    if not c.seeded:
        return False
    if c.dropout_arg is not None:
        i = c.dropout_arg
        p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


def is_heavy(node: fx.Node) -> bool:
    return node.op == "call_function" and op_class(node).heavy


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def is_big_reduction(node: fx.Node, size_of) -> bool:
    """A reduction whose output is more than 4x smaller than its input: cheap to save, costly to redo."""
    if node.op != "call_function" or not op_class(node).reduction:
        return False
    ins = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    return bool(ins) and size_of(node) * 4 < size_of(ins[0])


def node_facts(node: fx.Node, parent_facts=None) -> tuple:
    """(view, random, heavy, recomputable, fusible_op, cat, reduction) for ``node``; a getitem takes its
    producer's ``parent_facts`` for all but view/cat/reduction. Fusible: recomputable and no library call."""
    if node.op != "call_function":
        return (False, False, False, False, False, False, False)
    if node.target is operator.getitem:
        p = parent_facts if parent_facts is not None else node_facts(node.args[0])
        return (False, p[1], p[2], p[3], p[4], False, False)
    c = op_class(node)
    rnd = c.seeded and is_random(node)
    cheap = (c.cheap or constant_object(node)) and not rnd
    return (c.view, rnd, c.heavy, cheap, cheap and not c.heavy, c.cat, c.reduction)


def constant_object(node: fx.Node) -> bool:
    """A non-tensor value made from no inputs (``invoke_quant_packed``'s options): it cannot be saved and
    costs nothing to make again (banning it left no finite cut)."""
    return not node.all_input_nodes and not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list))


def written_placeholders_of(n: fx.Node) -> set:
    """The placeholders node ``n`` writes to (through views as well)."""
    out = set()
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return out
    for i, a in enumerate(n.target._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
        while isinstance(v, fx.Node) and v.op != "placeholder" and is_view(v) and v.args:
            v = v.args[0]
        if isinstance(v, fx.Node) and v.op == "placeholder":
            out.add(v)
    return out


def written_placeholders(graph: fx.Graph) -> set:
    """Placeholders of ``graph`` that its ops write to (through views as well)."""
    return set().union(*[written_placeholders_of(n) for n in graph.nodes])


def mutated_inputs(gm: fx.GraphModule) -> set:
    """Positions of the placeholders that ops in ``gm`` write to (through views as well)."""
    written = written_placeholders(gm.graph)
    return {i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder") if n in written}
