"""kiln's partitioner: cut AOTAutograd's joint graph into a forward and a backward graph.

``partition_joint`` is the ``partition_fn`` kiln hands to AOTAutograd. ``opts.partitioner`` picks
- ``'default'``: save every forward value the backward uses (eager-like), or
- ``'mincut'``: min-cut rematerialization under ``activation_memory_budget`` /
  ``activation_memory_limit`` (recompute cheap ops in the backward when that saves bytes).

The modules, bottom-up; each imports only modules listed before it:
- ``ops``, ``estimate``, ``extract``: op classes; sizes and runtime estimates; the graphs for a saved set;
- ``joint_info``: facts about the joint graph as arrays; ``default``: the plain partition;
- ``mincut``: the flow network and the recompute policies; ``decisions``: the KILN_DEBUG=3 log of a cut;
- ``peak``: the modelled activation peak of a saved set;
- ``budget``: ``activation_memory_budget``; ``hold``: the backward's hold set; ``limit``:
  ``activation_memory_limit``;
- ``choose``: the saved set for ``opts``; ``report``: what ``kiln.explain_memory`` prints (``kiln/memory.py``
  captures the graph through the pipeline); this file: ``partition_joint``.
``livemem`` (the measured peak of a call) stands apart.
"""
from __future__ import annotations

from typing import Tuple

import torch.fx as fx

from kiln.debug import counters, log, notify
from kiln.options import current
from kiln.partition.choose import choose_saved, gc_paused
from kiln.partition.extract import PartitionError, dce, extract, saved_values  # noqa: F401
from kiln.partition.report import MemoryReport  # noqa: F401


def partition_joint(joint_gm: fx.GraphModule, joint_inputs=None, *, num_fwd_outputs: int, opts=None,
                    **kwargs) -> Tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd ``partition_fn``: return ``(fw_gm, bw_gm)`` for ``joint_gm``.

    ``opts`` is a ``kiln.options.Options`` (None: ``kiln.options.current()``). Extra AOT keywords such as
    ``static_lifetime_input_indices`` are accepted and ignored. The joint graph is cleaned (dead code
    removed) and may gain ``sym_size`` nodes that bind symbolic shapes for the backward.
    """
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
