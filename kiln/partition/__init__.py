"""kiln's partitioner: ``partition_joint``, AOTAutograd's ``partition_fn``, cuts the joint graph in two;
``opts.partitioner``: ``'default'`` (save what the backward uses) or ``'mincut'`` (rematerialization).
"""
from __future__ import annotations

from typing import Tuple

import torch.fx as fx

from kiln.debug import counters, log, notify
from kiln.options import current
from kiln.passes.cse import gc_paused
from kiln.partition.limit import choose_saved
from kiln.partition.extract import PartitionError, dce, extract, saved_values  # noqa: F401
from kiln.partition.report import MemoryReport  # noqa: F401


def partition_joint(joint_gm: fx.GraphModule, joint_inputs=None, *, num_fwd_outputs: int, opts=None,
                    **kwargs) -> Tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd ``partition_fn``: ``(fw_gm, bw_gm)`` (the joint graph loses dead code, may gain ``sym_size``)."""
    opts = opts if opts is not None else current()
    dce(joint_gm.graph)
    saved = choose_saved(joint_gm, num_fwd_outputs=num_fwd_outputs, opts=opts)
    notify("partition", joint=joint_gm, saved=saved, num_fwd_outputs=num_fwd_outputs)
    with gc_paused():
        fw, bw = extract(joint_gm, saved, num_fwd_outputs=num_fwd_outputs)
    kept = saved_values(fw, num_fwd_outputs)
    counters["partition"]["graphs"] += 1
    counters["partition"]["saved"] += len(kept)
    log(3, f"partition ({opts.partitioner}): saved {[n.name for n in kept]}", artifact="kiln_remat")
    return fw, bw
