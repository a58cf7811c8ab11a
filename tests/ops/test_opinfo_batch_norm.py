"""The batch-norm OpInfo samples of the 2026-11-27 repro list (``_native_batch_norm_legit``,
``_batch_norm_with_update``, ``native_batch_norm``, ``nn.functional.batch_norm``): op_db's own first two
float32 samples on the CPU, through ``torch.compile(backend="kiln")`` with default options (the C++ target
where a compiler is found), against eager: outputs, input gradients and the running statistics the op
updates in place.

The repro's "modified by an inplace operation ... is at version 2; expected version 1" came from its harness,
not from kiln: it ran eager's forward and the compiled forward on the *same* sample tensors and then eager's
backward. A compiled graph that writes an input (here the running statistics) bumps its version counter
(AOTAutograd's runtime wrapper does, for every backend: aot_eager and inductor fail the same way), while
eager's batch-norm kernel updates them without a bump, so eager's pending backward, which saved them, refuses
to run. Each run here has its own copies, as ``kiln_bench.opinfo_sample`` does; the last test pins the
version-counter behaviour to AOTAutograd's.
"""
import pytest
import torch
from torch.utils import _pytree as pytree

from kiln_bench import opinfo_cases, opinfo_sample

OPS = ["_native_batch_norm_legit", "_batch_norm_with_update", "native_batch_norm", "nn.functional.batch_norm"]


def _run(fn, sample, cots=None, dtype=None):
    """(outputs, input gradients, tensor inputs after the call) of ``fn`` on fresh copies of ``sample``."""
    args, kwargs, leaves = opinfo_sample.copy_sample(sample, dtype, grad=cots is not None)
    out = fn(*args, **kwargs)
    grads = None
    if cots is not None:
        outs = [t for t in pytree.tree_leaves(sample.output_process_fn_grad(out))
                if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(outs, leaves, [c.to(o.dtype) for c, o in zip(cots, outs)], allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves)]
    after = [t.detach() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return out, grads, after


def _cotangents(fn, sample):
    args, kwargs, _ = opinfo_sample.copy_sample(sample)
    outs = [t for t in pytree.tree_leaves(sample.output_process_fn_grad(fn(*args, **kwargs)))
            if isinstance(t, torch.Tensor) and t.requires_grad]
    return opinfo_sample.cotangents(outs)


@pytest.mark.parametrize("name", OPS)
def test_batch_norm_samples_match_eager(name):
    """Values, gradients and updated running statistics within the op's tolerance of eager's (or no more
    than twice as far from an fp64 run as eager's, the sweep's arbiter for reordered sums)."""
    op = opinfo_cases.find(name)
    atol, rtol, _ = opinfo_cases.tolerance(op, torch.float32)
    func = op.get_op()

    def fn(*args, **kwargs):
        return func(*args, **kwargs)

    samples = opinfo_cases.samples(op, torch.float32, 2)
    assert len(samples) == 2 and all(opinfo_sample.modes(s) == ["forward", "backward"] for s in samples)
    checked = 0
    for i, sample in enumerate(samples):
        for cots in (None, _cotangents(fn, sample)):
            want = _run(fn, sample, cots)
            ref64 = _run(fn, sample, None if cots is None else [c.double() for c in cots], torch.float64)
            torch._dynamo.reset()
            got = _run(torch.compile(fn, backend="kiln"), sample, cots)
            for part, g, w, r in zip(("outputs", "gradients", "inputs after the call"), got, want, ref64):
                if w is None:
                    continue
                ok, err, why = opinfo_sample.compare(g, w, atol, rtol, r)
                assert ok, f"{name} sample {i} {'backward' if cots else 'forward'}: {part}: {why}"
                checked += 1
    assert checked == 2 * 2 + 2 * 3   # forward: outputs and inputs; backward: outputs, gradients, inputs


@pytest.mark.parametrize("backend", ["kiln", "aot_eager"])
def test_shared_running_stats_are_bumped_as_aot_autograd_does(backend):
    """The repro's harness order on one set of tensors: eager forward, compiled forward, eager backward. The
    compiled write of the running statistics bumps their version (AOTAutograd's rule for inputs a graph
    mutates), so eager's pending backward refuses, under aot_eager as under kiln; with eager twice it runs."""
    op = opinfo_cases.find("native_batch_norm")
    sample = opinfo_cases.samples(op, torch.float32, 1)[0]
    assert sample.args[4] is True   # training: running_mean and running_var are updated in place
    args, kwargs, leaves = opinfo_sample.copy_sample(sample)
    running_mean = args[3]
    first = torch.native_batch_norm(*args, **kwargs)[0]
    version = running_mean._version
    torch.native_batch_norm(*args, **kwargs)   # eager again: no bump, the first backward would still run
    assert running_mean._version == version
    torch.compile(lambda *a: torch.native_batch_norm(*a), backend=backend)(*args)
    assert running_mean._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(first.sum(), leaves)
