"""kiln's partitioner: cut AOTAutograd's joint graph into a forward and a backward graph.

``partition_joint`` is the ``partition_fn`` kiln hands to AOTAutograd. ``opts.partitioner`` picks
- ``'default'``: save every forward value the backward uses (eager-like), or
- ``'mincut'``: min-cut rematerialization under ``activation_memory_budget`` /
  ``activation_memory_limit`` (recompute cheap ops in the backward when that saves bytes).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Tuple

import torch.fx as fx

from kiln.debug import counters, log
from kiln.partition.extract import PartitionError, dce, extract, saved_values  # noqa: F401


@contextlib.contextmanager
def _gc_paused():
    """Cyclic GC passes over a big fx graph dominate per-node loops; pause it while partitioning."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def choose_saved(joint_gm: fx.GraphModule, *, num_fwd_outputs: int, opts) -> list:
    """The forward values to save, according to ``opts.partitioner`` (no graphs are built)."""
    with _gc_paused():
        if opts.partitioner == "default":
            from kiln.partition.default import default_saved
            return default_saved(joint_gm, num_fwd_outputs)
        from kiln.partition.mincut import mincut_saved
        return mincut_saved(joint_gm, num_fwd_outputs=num_fwd_outputs, opts=opts)


def partition_joint(joint_gm: fx.GraphModule, joint_inputs=None, *, num_fwd_outputs: int, opts=None,
                    **kwargs) -> Tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd ``partition_fn``: return ``(fw_gm, bw_gm)`` for ``joint_gm``.

    ``opts`` is a ``kiln.options.Options`` (None: ``kiln.options.current()``). Extra AOT keywords such as
    ``static_lifetime_input_indices`` are accepted and ignored. The joint graph is cleaned (dead code
    removed) and may gain ``sym_size`` nodes that bind symbolic shapes for the backward.
    """
    from kiln.options import current
    opts = opts if opts is not None else current()
    dce(joint_gm.graph)
    saved = choose_saved(joint_gm, num_fwd_outputs=num_fwd_outputs, opts=opts)
    with _gc_paused():
        fw, bw = extract(joint_gm, saved, num_fwd_outputs=num_fwd_outputs)
    kept = saved_values(fw, num_fwd_outputs)
    counters["partition"]["graphs"] += 1
    counters["partition"]["saved"] += len(kept)
    log(3, f"partition ({opts.partitioner}): saved {[n.name for n in kept]}")
    return fw, bw


def explain_memory(fn, *args, **kwargs):
    """Report of what ``fn(*args)`` saves and recomputes for backward (see kiln.partition.report)."""
    from kiln.partition.report import explain_memory as _explain
    return _explain(fn, *args, **kwargs)
