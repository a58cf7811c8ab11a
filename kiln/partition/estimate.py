"""Sizes (``size_bytes``; symbolic sizes by their hints) and runtime estimates of joint-graph nodes
(``activation_memory_budget_runtime_estimator``): 'flops', 'profile' or a ``callable(node) -> float``.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from kiln import compat
from kiln.options import UserError

UNBACKED_HINT = 4096  # hint for sizes with no hint (unbacked SymInts)


class EstimatorError(ValueError, UserError):
    """``activation_memory_budget_runtime_estimator`` is not 'flops', 'profile' or a callable returning a float >= 0."""


def hint(x) -> int:
    """A concrete int for an int/SymInt/sympy expression, without guards."""
    if isinstance(x, int):
        return x
    try:
        return compat.size_hint(x)
    except Exception:  # unbacked or otherwise unhintable
        return UNBACKED_HINT


def tensor_bytes(val) -> int:
    """Bytes of a (fake) tensor's elements; tuples and lists are summed; non-tensors weigh 0."""
    if isinstance(val, torch.Tensor):
        n = val.numel()
        return (n if isinstance(n, int) else math.prod(hint(s) for s in val.shape)) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def size_bytes(node: fx.Node) -> int:
    """Bytes of the value ``node`` produces (0 for SymInts and other non-tensors)."""
    return tensor_bytes(node.meta.get("val"))


# ----------------------------------------------------------------------------- runtime estimators
# FLOP formulas (taking shapes) for ops PyTorch's registry lacks; pass as FlopCounterMode(custom_mapping=...).
EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad_out, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad_out, q, k, v),
}


def _shapes(x):
    return torch.utils._pytree.tree_map(lambda v: v.shape if isinstance(v, torch.Tensor) else v, x)


_FLOPS_MEMO: dict = {}


def node_flops(node: fx.Node) -> float:
    """FLOPs of ``node`` from PyTorch's FLOP formulas (0 for ops without one, such as pointwise)."""
    if node.op != "call_function":
        return 0.0
    packet = getattr(node.target, "overloadpacket", node.target)
    if packet not in flop_registry and packet not in EXTRA_FLOPS:
        return 0.0
    key = _flops_key(node)
    hit = _FLOPS_MEMO.get(key) if key is not None else None
    if hit is not None:
        return hit
    val = node.meta.get("val")
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    if key is None:
        key = (node.target, str(torch.utils._pytree.tree_map(_hinted, (args, kwargs, val))))
    hit = _FLOPS_MEMO.get(key)
    if hit is None:
        if len(_FLOPS_MEMO) > 10000:
            _FLOPS_MEMO.clear()
        hit = _FLOPS_MEMO[key] = _flops(packet, args, kwargs, val)
    return hit


def _flops_key(node: fx.Node):
    """A cheap memo key when every argument is a node holding a tensor, or a plain scalar."""
    if node.kwargs:
        return None
    parts = [node.target]
    for a in node.args:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return None
            shape = tuple(v.shape)
            parts.append((shape, v.dtype) if all(type(d) is int for d in shape) else _hinted(v))
        elif isinstance(a, (int, float, bool, str)) or a is None:
            parts.append(a)
        else:
            return None
    return tuple(parts)


def _hinted(v):
    if isinstance(v, torch.Tensor):
        return (tuple(hint(s) for s in v.shape), tuple(hint(s) for s in v.stride()), v.dtype)
    return hint(v) if isinstance(v, torch.SymInt) else v


def _flops(packet, args, kwargs, val) -> float:
    try:   # (node_flops calls this for the ops of either table only)
        out = flop_registry[packet](*args, out_val=val, **kwargs) if packet in flop_registry else \
            EXTRA_FLOPS[packet](*_shapes(args), out_shape=_shapes(val), **_shapes(kwargs))
    except Exception:
        return 0.0
    return float(hint(out))


def _real(val):
    if isinstance(val, torch.Tensor):
        shape, dev = [hint(s) for s in val.shape], val.device
        if val.dtype.is_floating_point or val.dtype.is_complex:
            return torch.randn(shape, dtype=val.dtype, device=dev)
        if val.dtype == torch.bool:
            return torch.rand(shape, device=dev) > 0.5
        return torch.randint(0, 2, shape, dtype=val.dtype, device=dev)
    if isinstance(val, (torch.SymInt, torch.SymFloat)):
        return hint(val)
    if isinstance(val, (tuple, list)):
        return type(val)(_real(v) for v in val)
    return val


def node_profile(node: fx.Node, reps: int = 3) -> float:
    """Measured runtime (seconds, best of ``reps``) of ``node`` on its device with random inputs."""
    if node.op != "call_function" or not callable(node.target):
        return 0.0
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _real(n.meta.get("val")))
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in torch.utils._pytree.tree_leaves(args))
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        best = float("inf")
        try:
            with torch.no_grad():
                for _ in range(reps + 1):
                    sync()
                    t0 = time.perf_counter()
                    node.target(*args, **kwargs)
                    sync()
                    best = min(best, time.perf_counter() - t0)
        except Exception:
            return 0.0
    return best


def runtime_estimator(spec) -> Callable[[fx.Node], float]:
    """The estimator named by ``activation_memory_budget_runtime_estimator``."""
    if spec in ("flops", "profile"):
        return node_flops if spec == "flops" else node_profile
    if callable(spec):
        def checked(node):
            v = spec(node)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise EstimatorError(f"partition: runtime estimator {spec!r} returned {v!r} for {node.name}; "
                                     f"it must return a non-negative float")
            return float(v)
        return checked
    raise EstimatorError(f"activation_memory_budget_runtime_estimator={spec!r}; use 'flops', 'profile' "
                         f"or a callable(node) -> float")
