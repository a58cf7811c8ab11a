"""Graph passes by stage; each edits the GraphModule in place and returns how many nodes it removed. Hooks
take a ``torch.fx.Graph``; ``registered`` is the ``registry.snapshot()`` taken when the compile began (a
backward compiled later, outside the registration's scope, runs the same passes as its forward).
"""
import torch.fx as fx

from kiln.debug import counters, log
from kiln.passes.cse import cse
from kiln.passes.empty_mask import drop_empty_masks
from kiln.passes.onehot import scatter_to_where
from kiln.passes.pad_mm import pad_matmuls
from kiln.passes.registry import register, run_stage, snapshot  # noqa: F401


def pre_grad(gm: fx.GraphModule, opts, registered=None) -> int:
    """On Dynamo's torch-level graph: empty attention masks dropped, then the pre_grad hooks."""
    before = len(gm.graph.nodes)
    if opts.drop_empty_masks:
        drop_empty_masks(gm, opts.tuning.empty_mask_max_bytes)
    run_stage("pre_grad", gm, opts.pre_grad_custom_pass, registered)
    return before - len(gm.graph.nodes)


def joint(gm: fx.GraphModule, opts, registered=None) -> int:
    """On the joint (or inference) ATen graph, before partitioning: hooks, CSE, one-hot scatters as compares."""
    before = len(gm.graph.nodes)
    run_stage("joint_pre", gm, opts.joint_custom_pre_pass, registered)
    if opts.cse:
        log(2, f"cse: {cse(gm)} nodes removed")
    if opts.pattern_matcher and (n := scatter_to_where(gm)):
        log(2, f"onehot: {n} scatters became compares")
    run_stage("joint_post", gm, opts.joint_custom_post_pass, registered)
    return before - len(gm.graph.nodes)


def post_grad(gm: fx.GraphModule, opts, registered=None, inference: bool = False) -> int:
    """On each forward / backward / inference graph after partitioning: DCE, hooks, pad_matmuls."""
    before = len(gm.graph.nodes)
    if gm.graph.eliminate_dead_code():   # recompiling a large unchanged graph costs ~0.3 s
        gm.recompile()
    run_stage("post_grad_pre", gm, opts.post_grad_custom_pre_pass, registered)
    if opts.pad_matmuls != "never":
        t, where = opts.tuning, opts.tuning.pad_mm_in_place
        padded = pad_matmuls(gm, devices=None if opts.pad_matmuls == "always" else ("cuda",),
                             kernel_bytes=t.pad_mm_kernel_bytes, min_flops_per_byte=t.pad_mm_min_flops_per_byte,
                             out_blocks=t.pad_mm_out_blocks,
                             in_place=where == "always" or (where == "inference" and inference))
        if padded:
            counters["kiln"]["pad_mm"] += padded
            log(2, f"pad_mm: {padded} matmuls padded to tensor-core alignment")
    run_stage("post_grad_post", gm, opts.post_grad_custom_post_pass, registered)
    return before - len(gm.graph.nodes)
