"""Graph passes by stage. Each runner edits the GraphModule in place and returns how many nodes changed.

Order (the hook contract PyTorch's users know):
  pre_grad : attention masks that mask nothing dropped (option drop_empty_masks), pre_grad_custom_pass
             (and registered 'pre_grad' passes) on Dynamo's torch-level graph
  joint    : joint_custom_pre_pass, CSE, one-hot scatters as compares, built-in patterns,
             joint_custom_post_pass (before partitioning)
  post_grad: DCE, post_grad_custom_pre_pass, built-in patterns, pad_matmuls (option pad_matmuls),
             post_grad_custom_post_pass
Hooks receive a ``torch.fx.Graph`` and may edit it in place. ``pattern_matcher=False`` turns off
kiln's built-in patterns, never user hooks. ``registered``: the passes registered through
``kiln.passes.register`` when the compile began (``registry.snapshot()``), so that a backward compiled
later, outside the registration's scope, runs the same passes as its forward (None: those in force now).
"""
from __future__ import annotations

import torch.fx as fx

from kiln.debug import counters, log
from kiln.passes.cse import cse
from kiln.passes.empty_mask import drop_empty_masks
from kiln.passes.match.trace import remove_noop_aliases
from kiln.passes.onehot import scatter_to_where
from kiln.passes.pad_mm import pad_matmuls
from kiln.passes.patterns import BUILTIN
from kiln.passes.registry import STAGES, cache_key, passes_for, register, run_stage, snapshot  # noqa: F401


def _run(stage: str, gm: fx.GraphModule, hook, registered) -> None:
    run_stage(stage, gm, hook, registered)


def _delta(gm: fx.GraphModule, before: int) -> int:
    return before - len(gm.graph.nodes)


def pre_grad(gm: fx.GraphModule, opts, registered=None) -> int:
    """Drop attention masks that mask nothing (option ``drop_empty_masks``), then run user passes on Dynamo's
    torch-level graph (nodes carry meta['example_value'])."""
    before = len(gm.graph.nodes)
    if opts.drop_empty_masks:
        drop_empty_masks(gm, opts.tuning.empty_mask_max_bytes)
    _run("pre_grad", gm, opts.pre_grad_custom_pass, registered)
    return _delta(gm, before)


def joint(gm: fx.GraphModule, opts, registered=None) -> int:
    """Passes on the joint (or inference) ATen graph, before partitioning."""
    before = len(gm.graph.nodes)
    _run("joint_pre", gm, opts.joint_custom_pre_pass, registered)
    if opts.cse:
        _cse(gm)
    if opts.pattern_matcher:
        _onehot(gm)
        _builtin("joint", gm)
    _run("joint_post", gm, opts.joint_custom_post_pass, registered)
    return _delta(gm, before)


def post_grad(gm: fx.GraphModule, opts, registered=None, inference: bool = False) -> int:
    """Passes on each forward / backward / inference graph (``inference``) after partitioning."""
    before = len(gm.graph.nodes)
    if gm.graph.eliminate_dead_code():   # recompiling a large unchanged graph costs ~0.3 s
        gm.recompile()
    _run("post_grad_pre", gm, opts.post_grad_custom_pre_pass, registered)
    if opts.pattern_matcher:
        _builtin("post_grad", gm)
    if opts.pad_matmuls != "never":
        _pad_matmuls(gm, opts, inference)
    _run("post_grad_post", gm, opts.post_grad_custom_post_pass, registered)
    return _delta(gm, before)


def _cse(gm: fx.GraphModule) -> None:
    removed = cse(gm)
    log(2, f"cse: {removed} nodes removed")


def _onehot(gm: fx.GraphModule) -> None:
    n = scatter_to_where(gm)
    if n:
        log(2, f"onehot: {n} scatters became compares")


def _pad_matmuls(gm: fx.GraphModule, opts, inference: bool) -> None:
    where = opts.tuning.pad_mm_in_place
    padded = pad_matmuls(gm, devices=None if opts.pad_matmuls == "always" else ("cuda",),
                         min_flops=opts.tuning.pad_mm_min_flops,
                         min_flops_per_byte=opts.tuning.pad_mm_min_flops_per_byte,
                         out_blocks=opts.tuning.pad_mm_out_blocks,
                         in_place=where == "always" or (where == "inference" and inference))
    if padded:
        counters["kiln"]["pad_mm"] += padded
        log(2, f"pad_mm: {padded} matmuls padded to tensor-core alignment")


def _builtin(stage: str, gm: fx.GraphModule) -> None:
    """kiln's own pattern lists for ``stage`` (kiln/passes/patterns/)."""
    if not BUILTIN.get(stage):
        return
    if stage == "joint":  # patterns are traced without AOT's no-op alias nodes
        remove_noop_aliases(gm.graph)
    for p in BUILTIN[stage]:
        n = p.apply(gm.graph)
        if n:
            gm.recompile()
            log(2, f"patterns[{stage}]: {n} matches")
