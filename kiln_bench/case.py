"""Cases and workloads: what one benchmark row runs.

A ``Case`` is data (name, suite, dtypes, devices, whether it trains) plus a ``build(device, dtype,
size)`` that returns a ``Workload``. A workload owns a pristine model and its inputs and knows
how to run one measured ``step(f)`` and one ``check(f)`` (forward and backward without the
optimizer step, returning the tensors compared against eager). Every backend gets its own
``fresh()`` copy of the model, so optimizer steps of one backend never change another's weights.

Steps train as users train, with the model's own dropout and stochastic depth; ``check`` runs with
every dropout probability at 0 (``dropout.no_random``), so its values are deterministic. A compiled
function first called in ``check`` has those zeros baked in: the runner compiles again for the steps.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from kiln_bench.dropout import no_random

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2, "amp_bf16": 5e-2, "amp_fp16": 5e-2}


@dataclass
class Case:
    """One benchmark case; ``build(device, dtype, size) -> Workload``.

    ``dtypes`` are the dtype labels the case runs in (micro: fp32/bf16, models: one fixed label
    such as ``amp_bf16``); ``options`` are passed to compiled backends (e.g. ``{"freezing": True}``);
    ``needs`` are importable modules without which the case is skipped (listed, not failed).
    """
    name: str
    suite: str
    build: Callable[..., "Workload"]
    dtypes: tuple = ("fp32", "bf16")
    devices: tuple = ("cpu", "cuda")
    train: bool = True
    memory_bound: bool = False
    options: dict = field(default_factory=dict)
    needs: tuple = ()
    about: Union[str, Callable[[str], str]] = ""   # a text, or the text at a size ('cpu', 'gpu', 'tiny')

    def missing(self) -> list[str]:
        """The modules in ``needs`` that cannot be imported here."""
        import importlib.util
        return [m for m in self.needs if importlib.util.find_spec(m) is None]


def tensors(obj) -> list:
    """Every tensor in an output: tensors, tuples/lists, dicts and HuggingFace ModelOutputs."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict) or hasattr(obj, "to_tuple"):
        obj = list(obj.values()) if isinstance(obj, dict) else list(obj.to_tuple())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors(o)]
    return []


def _to64(t):
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().double().requires_grad_(t.requires_grad)
    return t


def nbytes(ts) -> int:
    """Bytes of the listed tensors (element count times element size)."""
    return sum(t.numel() * t.element_size() for t in ts)


class Workload:
    """Base class; subclasses set ``model``, ``inputs``, ``train``, ``dtype`` and implement steps."""
    model = None
    inputs: tuple = ()
    train: bool = True
    dtype: str = "fp32"
    min_bytes: Optional[int] = None

    device = None  # set by park(): where fresh copies of a parked model go

    def fresh(self) -> "Workload":
        """A copy whose model (parameters, buffers) is a deep copy; inputs are shared."""
        new = copy.copy(self)
        if isinstance(self.model, torch.nn.Module):
            new.model = copy.deepcopy(self.model)
            if self.device is not None:
                new.model.to(self.device)
        new._opt = None
        return new

    def park(self) -> None:
        """Keep the pristine model in CPU memory so it never counts in a backend's GPU peak."""
        if isinstance(self.model, torch.nn.Module) and self.device is None:
            param = next(iter(self.model.parameters()), None)
            if param is not None and param.device.type != "cpu":
                self.device = param.device
                self.model.to("cpu")

    def state(self) -> list:
        """Tensors that count as inputs (never as saved activations): inputs, parameters, buffers."""
        out = list(t for t in self.inputs if isinstance(t, torch.Tensor))
        if isinstance(self.model, torch.nn.Module):
            out += list(self.model.parameters()) + list(self.model.buffers())
        return out

    @property
    def tol(self) -> float:
        return TOLERANCE.get(self.dtype, 5e-2)

    def check(self, f) -> list:  # pragma: no cover - interface
        """The tensors compared against eager, computed with every dropout probability at 0."""
        raise NotImplementedError

    def step(self, f) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def forward_for_memory(self, f):
        """Run the forward whose saved tensors are measured; returns what ``backward_for_memory`` takes."""
        raise NotImplementedError

    def reference64(self) -> list:
        """``check`` of a float64 copy (model, inputs; no autocast): the referee when a backend and
        eager disagree in low precision. Results are in the same order as ``check``."""
        wl = self.fresh()
        if isinstance(wl.model, torch.nn.Module):
            wl.model = wl.model.double()
        wl.inputs = tuple(_to64(t) for t in self.inputs)
        wl._to64()
        return wl.check(wl.model)

    def _to64(self) -> None:
        pass

    def backward_for_memory(self, out) -> None:
        raise NotImplementedError


class FnWorkload(Workload):
    """A function (or small module) of leaf inputs: forward, then ``out.backward(grad)``.

    The grad-output is a fixed seeded tensor so every backend differentiates the same thing.
    ``min_bytes`` is the minimal traffic of one forward+backward: the forward reads the inputs and
    writes the outputs; the backward reads the grad-output and the inputs and writes the grads.
    """

    def __init__(self, fn, inputs, dtype: str, train: bool = True, seed: int = 0):
        self.model, self.inputs, self.dtype, self.train = fn, tuple(inputs), dtype, train
        with torch.no_grad():
            out = fn(*self.inputs)
        if out.device.type == "meta":   # kiln_bench.offline: shapes only
            self.grad = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        else:
            gen = torch.Generator(device=out.device).manual_seed(seed + 1)
            self.grad = torch.randn(out.shape, dtype=out.dtype, device=out.device, generator=gen)
        ins = self.state()
        grads = [t for t in self.state() if t.requires_grad]
        self.min_bytes = nbytes(ins) + nbytes([out]) + (nbytes([out]) + nbytes(ins) + nbytes(grads) if train else 0)
        self._opt = None

    def _to64(self) -> None:
        self.grad = self.grad.double()

    def _zero(self):
        for t in self.state():
            t.grad = None

    def check(self, f) -> list:
        """Output and input gradients of one forward and backward, dropout off (see ``no_random``)."""
        with no_random(self.model):
            return self._check(f)

    def _check(self, f) -> list:
        self._zero()
        out = f(*self.inputs)
        if not self.train:
            return [out.detach()]
        out.backward(self.grad)
        res = [out.detach()] + [t.grad for t in self.state() if t.requires_grad]
        self._zero()
        return res

    def step(self, f) -> None:
        self._zero()
        if self.train:
            f(*self.inputs).backward(self.grad)
        else:
            with torch.no_grad():
                f(*self.inputs)

    def forward_for_memory(self, f):
        self._zero()
        return f(*self.inputs)

    def backward_for_memory(self, out) -> None:
        out.backward(self.grad)
        self._zero()


class ModelWorkload(Workload):
    """An nn.Module on a batch: a training step (loss, backward, optimizer) or an inference step.

    ``loss(out, batch)`` turns the model output into a scalar; ``optimizer(params)`` builds the
    optimizer lazily per fresh copy; ``autocast`` is a dtype for ``torch.autocast`` or None.
    """

    def __init__(self, model, batch, dtype: str, loss=None, optimizer=None, autocast=None,
                 train: bool = True, call=None):
        self.model, self.inputs, self.dtype, self.train = model, tuple(batch), dtype, train
        self.loss, self.optimizer, self.autocast = loss, optimizer, autocast
        self.call = call or (lambda f, batch: f(*batch))
        self._opt = None
        if not train:
            self.model.eval()

    def _to64(self) -> None:
        self.autocast = None

    def _ctx(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=self.autocast)

    def _loss(self, f):
        with self._ctx():
            out = self.call(f, self.inputs)
            return self.loss(out, self.inputs) if self.loss else out

    def check(self, f) -> list:
        """Loss and parameter gradients (training) or the outputs (inference), dropout off (``no_random``)."""
        with no_random(self.model):
            return self._check(f)

    def _check(self, f) -> list:
        if not self.train:
            with torch.no_grad(), self._ctx():
                return [t.detach() for t in tensors(self.call(f, self.inputs))]
        self.model.zero_grad(set_to_none=True)
        loss = self._loss(f)
        loss.backward()
        res = [loss.detach()] + [p.grad.clone() for p in self.model.parameters() if p.grad is not None]
        self.model.zero_grad(set_to_none=True)
        return res

    def step(self, f) -> None:
        if not self.train:
            with torch.no_grad(), self._ctx():
                self.call(f, self.inputs)
            return
        if self._opt is None and self.optimizer is not None:
            self._opt = self.optimizer([p for p in self.model.parameters() if p.requires_grad])
        self._loss(f).backward()
        if self._opt is not None:
            self._opt.step()
            self._opt.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)

    def forward_for_memory(self, f):
        self.model.zero_grad(set_to_none=True)
        return self._loss(f)

    def backward_for_memory(self, out) -> None:
        out.backward()
        self.model.zero_grad(set_to_none=True)
