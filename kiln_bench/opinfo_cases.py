"""What the OpInfo sweep runs: ops of PyTorch's ``op_db``, their samples, dtypes and tolerances.

An op is named as PyTorch's own tests name it: ``op.name`` plus ``.variant_test_name`` when the op has
a variant (``softmax.with_dtype``). Samples come from ``op.sample_inputs`` with a fixed seed, so the
i-th sample of an op is the same tensors in every process. Tolerances are the op's own
(``toleranceOverride`` decorators of its OpInfo) where it has them, else ``torch.testing``'s defaults.
"""
from __future__ import annotations

import itertools
import re

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64,
          "int64": torch.int64, "bool": torch.bool, "c64": torch.complex64}   # the last three: ops without fp32
# torch.testing.assert_close's defaults: dtype -> (atol, rtol)
DEFAULT_TOL = {
    torch.float16: (1e-5, 1e-3), torch.bfloat16: (1e-5, 1.6e-2), torch.float32: (1e-5, 1.3e-6),
    torch.float64: (1e-7, 1e-7), torch.complex64: (1e-5, 1.3e-6), torch.complex128: (1e-7, 1e-7),
}
# dtypes whose run is judged against an fp64 run of eager too (see opinfo_sample.compare)
LOW_PRECISION = (torch.float16, torch.bfloat16)


class OpNotFound(LookupError):
    """An op name (``--ops`` or a test's list) matched nothing in ``op_db``: names are PyTorch's OpInfo
    names with the variant after a dot (``max.reduction_with_dim``); ``--list`` prints them."""


def op_db(which: str = "op") -> list:
    """PyTorch's operator database (``"op"``: ``op_db``, importing it takes several seconds), or its
    higher-order ops (``"hop"``: ``hop_db``: cond, map, scan, while_loop, invoke_subgraph, ...)."""
    if which not in ("op", "hop"):
        raise ValueError(f"--db {which!r}: choose op or hop")
    try:
        if which == "hop":
            from torch.testing._internal.hop_db import hop_db
            return hop_db
        from torch.testing._internal.common_methods_invocations import op_db as db
    except ModuleNotFoundError as e:  # torch's test modules need test-only packages (expecttest, ...)
        raise ModuleNotFoundError(
            f"PyTorch's OpInfo database needs {e.name!r}, which torch does not install: "
            f"pip install {e.name} (or pip install 'kiln[test]')", name=e.name) from e
    return db


def full_name(op) -> str:
    """``name.variant`` as PyTorch's tests name the op."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected i/n, e.g. 0/8") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: need 0 <= i < n")
    return i, n


def select(ops_regex: str | None = None, shard: tuple[int, int] = (0, 1), names=None, dbs=("op",)) -> list:
    """The ops to sweep: those of the databases ``dbs`` (see ``op_db``) whose full name matches
    ``ops_regex`` (``re.search``) or is in ``names``; every n-th of them from the i-th for shard (i, n)."""
    db = [op for which in dbs for op in op_db(which)]
    if names is not None:
        by_name = {full_name(op): op for op in db}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise OpNotFound(f"not in op_db: {missing} (`python -m kiln_bench.opinfo --list` prints the names)")
        chosen = [by_name[n] for n in names]
    else:
        pattern = re.compile(ops_regex) if ops_regex else None
        chosen = [op for op in db if pattern is None or pattern.search(full_name(op))]
        if ops_regex and not chosen:
            raise OpNotFound(f"--ops {ops_regex!r} matched no op (`--list` prints the names)")
    i, n = shard
    return chosen[i::n]


def find(name: str):
    """The OpInfo named ``name`` (a full name) in ``op_db``, else in ``hop_db``."""
    for op in op_db() + op_db("hop"):
        if full_name(op) == name:
            return op
    raise OpNotFound(f"{name!r} is not in op_db (`python -m kiln_bench.opinfo --list` prints the names)")


def supports(op, dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether the op runs in ``dtype`` on ``device`` according to its OpInfo."""
    return dtype in op.supported_dtypes(device)


def without_fp32(op, device: str = "cpu") -> bool:
    """Whether the op runs on ``device`` but not in fp32 (integer, bool and complex ops: ``--without-fp32``)."""
    found = op.supported_dtypes(device)
    return bool(found) and torch.float32 not in found


def wants_grad(op, dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether samples of the op in ``dtype`` are made with float inputs requiring grad."""
    return bool(op.supports_autograd) and dtype in op.supported_backward_dtypes(device)


def samples(op, dtype: torch.dtype, cap: int, device: str = "cpu") -> list:
    """The op's first ``cap`` samples in ``dtype`` on ``device`` (seeded: the same tensors in every process)."""
    torch.manual_seed(0)
    grad = wants_grad(op, dtype, device)
    return list(itertools.islice(op.sample_inputs(device, dtype, requires_grad=grad), cap))


def _active(info, dtype, device) -> bool:
    if info.device_type not in (None, device):
        return False
    if info.dtypes is not None and dtype not in info.dtypes:
        return False
    return info.active_if is not False   # callables (per test kwargs) count as active


def tolerance(op, dtype: torch.dtype, device: str = "cpu") -> tuple[float, float, str]:
    """(atol, rtol, source) for comparing the op's results in ``dtype`` on ``device``.

    The op's ``toleranceOverride`` decorators for this dtype and device: those PyTorch gives its inductor
    OpInfo test if any, else the largest of any test's; never below ``torch.testing``'s default."""
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo
    atol, rtol = DEFAULT_TOL.get(dtype, (0.0, 0.0))
    found = []
    for info in getattr(op, "decorators", ()) or ():
        if isinstance(info, DecorateInfo):
            if not _active(info, dtype, device):
                continue
            decs, cls = info.decorators, info.cls_name
        else:
            decs, cls = [info], None
        for dec in decs:
            if isinstance(dec, toleranceOverride) and dtype in dec.d:
                found.append((cls, dec.d[dtype]))
    inductor = [t for cls, t in found if cls == "TestInductorOpInfo"]
    chosen = inductor or [t for _, t in found]
    if not chosen:
        return atol, rtol, "default"
    return (max([atol] + [t.atol for t in chosen]), max([rtol] + [t.rtol for t in chosen]),
            "inductor test" if inductor else "op")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bf16`` (the sweep's short names)."""
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))
