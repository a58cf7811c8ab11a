"""A compiled graph (``runtime.load.Compiled``) as bytes and back: its wrapper's source and globals, pickled
by a pickler knowing kiln's and torch's objects (else ``NotCacheable``), and its kernels' C++ units.
"""
import io
import os
import pickle

import torch

from kiln.codegen.fallback import Fallback
from kiln.codegen.text.source import KernelRef, Unit, Wrapper
from kiln.runtime import cpp_build
from kiln.runtime.load import Compiled, load

MAX_CONSTANT_BYTES = 1 << 24   # larger tensor constants are not copied into the cache


class NotCacheable(Exception):
    """A compiled graph holds something the cache cannot store; the message says what."""


def _overload(ns, op, overload):
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _packet(ns, op):
    return getattr(getattr(torch.ops, ns), op)


def _higher_order(name):
    return getattr(torch.ops.higher_order, name)


class StoredFallback(Fallback):
    """A kernel's ATen fallback read from the cache, unpickled when it first runs (most never do)."""

    def __init__(self, data: bytes):
        self._data, self._gm = data, None
        self.__name__ = "aten_fallback"

    @property
    def module(self):
        if self._gm is None:
            self._gm = pickle.loads(self._data)
        return self._gm

    @property
    def graph(self):
        return self.module.graph


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _overload, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _packet, (obj._qualified_op_name.split("::")[0], obj.__name__)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, StoredFallback):
            return StoredFallback, (obj._data,)
        if isinstance(obj, Fallback):
            return StoredFallback, (dumps(obj.module),)
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type == "meta":
                raise NotCacheable(f"a constant of type {type(obj).__name__} on {obj.device}")
            if obj.untyped_storage().nbytes() > MAX_CONSTANT_BYTES:
                raise NotCacheable(f"a constant of {obj.untyped_storage().nbytes()} bytes")
        return NotImplemented


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except NotCacheable:
        raise
    except Exception as e:   # a local function, an object without pickling support
        raise NotCacheable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return buf.getvalue()


def pack(compiled: Compiled, units=()) -> dict:
    """What ``unpack`` needs to rebuild ``compiled``: a dict of picklable parts (``dumps`` it)."""
    w = compiled.wrapper
    globals_ = {**w.globals, **w.handles}   # each handle's overload; ``unpack`` binds the handle again
    fallback = compiled.fallback
    return {"name": w.name, "source": w.source, "globals": globals_, "handles": sorted(w.handles),
            "known_outputs": list(w.known_outputs), "written": list(w.written),
            "fallback": None if fallback is None else StoredFallback(dumps(fallback)),
            "units": [(u.source, tuple(u.functions), _binary(u), u.prelude) for u in units]}


def _binary(unit):
    """``(file name, bytes)`` of ``unit``'s library (a reboot empties /tmp's kernel directory), or None."""
    try:
        path = cpp_build.library(unit.functions[0])
        with open(path, "rb") as f:
            return os.path.basename(path), f.read()
    except (KeyError, IndexError, OSError):
        return None


def unpack(part: dict, opts) -> Compiled:
    """The ``Compiled`` of a stored graph: its C++ units built or loaded, its wrapper executed."""
    units = [Unit(source, functions, prelude) for source, functions, _, prelude in part["units"]]
    for unit, (_, _, binary, _) in zip(units, part["units"]):
        cpp_build.build(unit, opts, binary=binary)
    globals_ = dict(part["globals"])
    for name in part["handles"]:
        globals_[name] = globals_[name]._op
    kernels, seen = [], set()
    for obj in globals_.values():
        if isinstance(obj, KernelRef) and obj.name not in seen:
            seen.add(obj.name)
            kernels.append(obj)
    w = Wrapper(name=part["name"], source=part["source"], globals=globals_, kernels=kernels,
                known_outputs=part["known_outputs"], written=part["written"])
    return load(w, part["fallback"], units)
