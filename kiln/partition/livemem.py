"""Measured activation memory on any device: the peak of live tensor-storage bytes created during a call.

``measure_peak(step)`` runs ``step()`` under a ``TorchDispatchMode`` that sees every ATen op (forward,
autograd backward, kiln's wrappers, and the ``torch.empty_strided`` outputs that Triton kernels in
interpreter mode write into). After each op it
- forgets tracked storages that died (``StorageWeakRef.expired()``),
- tracks each output storage that is new: not an input of that op and not seen before (so views,
  in-place results and ``out=`` buffers of existing storages are not counted twice),
- records the sum of tracked live bytes; the peak is the largest such sum.

Storages alive before the call (parameters, inputs, old gradients) are never counted: they show up only
as op inputs, and a storage first seen as an input is marked as pre-existing. Memory that an op allocates
and frees inside itself, and memory outside torch (numpy, Triton's interpreter), is not seen; a storage
resized after creation is counted at its size when created. Live bytes are checked only when an op runs,
so a storage freed between two ops counts until the next op: that is the same instant an allocator
would reuse it.

The mode declares ``ignore_compile_internals``: Dynamo still compiles (with the mode off) and the
compiled code runs under the mode, so what is measured is what the compiled step allocates. Compile
(run the step once) before measuring all the same, so that compile-time tensors are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class LiveMem:
    """Result of ``measure_peak``: ``peak`` and ``end`` live bytes above the pre-call state."""
    peak: int = 0
    end: int = 0
    ops: int = 0
    trace: List[Tuple[str, int]] = field(default_factory=list)  # (op, live bytes) when record=True


def _storages(x) -> list:
    out = []
    for t in tree_flatten(x)[0]:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):  # sparse / functional wrappers have none
                pass
    return out


class LiveBytesMode(TorchDispatchMode):
    """Tracks the live bytes of storages created while it is active (see module docstring)."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self.old: Dict[int, StorageWeakRef] = {}
        self.cur = self.peak = self.ops = 0
        self.record = record
        self.trace: List[Tuple[str, int]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let Dynamo compile and run compiled code while measuring (the mode is off while compiling)."""
        return True

    def _known(self, key: int, table: dict) -> bool:
        hit = table.get(key)
        if hit is None:
            return False
        ref = hit[0] if isinstance(hit, tuple) else hit
        if ref.expired():  # a dead storage whose address was reused
            del table[key]
            if table is self.live:
                self.cur -= hit[1]
            return False
        return True

    def _prune(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.cur -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = _storages((args, kwargs))
        in_keys = set()
        for s in ins:
            key = StorageWeakRef(s).cdata
            in_keys.add(key)
            if not self._known(key, self.live) and not self._known(key, self.old):
                self.old[key] = StorageWeakRef(s)
        out = func(*args, **kwargs)
        self._prune()
        for s in _storages(out):
            ref = StorageWeakRef(s)
            key = ref.cdata
            if key in in_keys or self._known(key, self.live) or self._known(key, self.old):
                continue
            nb = s.nbytes()
            self.live[key] = (ref, nb)
            self.cur += nb
        self.peak = max(self.peak, self.cur)
        self.ops += 1
        if self.record:
            self.trace.append((str(func), self.cur))
        return out


def measure_peak(step: Callable[[], object], record: bool = False) -> LiveMem:
    """Run ``step()`` and return the peak (and final) live bytes of the storages it created."""
    mode = LiveBytesMode(record=record)
    with mode:
        result = step()
    del result
    mode._prune()
    return LiveMem(peak=mode.peak, end=mode.cur, ops=mode.ops, trace=mode.trace)
