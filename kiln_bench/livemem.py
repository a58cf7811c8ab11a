"""Measured activation memory on any device: the peak of live tensor-storage bytes created during a call
(a tool beside the compiler: kiln itself never measures, it models peaks in kiln/partition/peak.py).

``measure_peak(step)`` runs ``step()`` under a ``TorchDispatchMode`` that sees every ATen op (forward,
backward, kiln's wrappers, the outputs Triton's interpreter writes into). After each op it forgets the
tracked storages that died, tracks each output storage that is new (not an input of the op, not seen
before: views, in-place results and ``out=`` buffers are not counted twice) and records the sum of live
bytes. Storages alive before the call (parameters, inputs, old gradients) are first seen as inputs and
never counted. Not seen: memory an op allocates and frees inside itself, memory outside torch, a resize
after creation; a storage freed between two ops counts until the next op (when an allocator would reuse
it). The mode declares ``ignore_compile_internals``: Dynamo compiles with it off and the compiled code
runs under it. Run the step once before measuring, so that compile-time tensors are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class LiveMem:
    """Result of ``measure_peak``: ``peak`` and ``end`` live bytes above the pre-call state."""
    peak: int = 0
    end: int = 0


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

    def __init__(self):
        super().__init__()
        self.live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self.old: Dict[int, StorageWeakRef] = {}
        self.cur = self.peak = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
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
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.cur -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_keys = set()
        for s in _storages((args, kwargs)):
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
        return out


def measure_peak(step: Callable[[], object]) -> LiveMem:
    """Run ``step()`` and return the peak (and final) live bytes of the storages it created."""
    mode = LiveBytesMode()
    with mode:
        step()   # its result dies here
    mode._prune()
    return LiveMem(peak=mode.peak, end=mode.cur)
