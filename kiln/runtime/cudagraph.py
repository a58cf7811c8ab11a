"""``mode="reduce-overhead"``: replay a compiled graph as one CUDA graph.

All graphs on a device share one private memory ``Pool``, so a backward's temporaries reuse its forward's
and a tensor one graph hands to another is read in place. A ``Graphed`` function runs the wrapper at its
first call, captures it at its second and replays from then on. Parameters, buffers and pool tensors are
read in place (if one moves, the call runs the wrapper); other inputs are copied into static buffers.
Outputs alias the graph's static memory: a replay that could overwrite a live alias runs the wrapper
instead (slower, never wrong). A user output found dead when a later graph is captured (a training
forward's logits, dropped before the backward) gives its block back to the pool, so that graph's
temporaries reuse it as the plain path's do; it is copied out at each replay from then on. A backward
reads the parameters its forwards read in place. Non-tensor or CPU inputs, or a failed capture, leave the
wrapper running normally, the reason logged (KILN_DEBUG=1).
"""
import time
import weakref
from typing import List, Optional

import torch

from kiln.debug import counters, log

_use_count = torch._C._storage_Use_Count


class Pool:
    """The CUDA memory pool of one device and the graphs captured in it, in capture order (weakly)."""

    def __init__(self):
        self.handle = None
        self._graphs: list = []

    def ensure(self):
        """The pool's handle; a new one once every graph captured in it has died: the allocator frees a private
        pool with its last graph, and a capture into the freed pool's id fails an internal assert
        (``use_count > 0``; H200, a test capturing after an earlier test's graphs were collected)."""
        if self.handle is None or not self.graphs:
            self.handle = torch.cuda.graph_pool_handle()
        return self.handle

    def add(self, g: "Graphed"):
        self._graphs.append(weakref.ref(g))

    @property
    def graphs(self) -> List["Graphed"]:
        live = [g() for g in self._graphs]
        if None in live:
            self._graphs = [r for r, g in zip(self._graphs, live) if g is not None]
        return [g for g in live if g is not None]

    @property
    def captured(self) -> List["Graphed"]:
        return [g for g in self.graphs if g.graph is not None]

    @property
    def static_ptrs(self) -> set:
        """Addresses of the static inputs (parameters) the live graphs read in place."""
        return {g.direct[i] for g in self.captured for i in g.static if i in g.direct}

    def release_dead(self) -> None:
        """Before a capture: user outputs only kiln holds go back to the pool (see the module docstring)."""
        done = self.captured
        for g in done:   # a block another graph reads or returns stays (storages may differ: compare addresses)
            g.release_dead({p for h in done if h is not g for p in (*h.storages, *h.direct.values())})

    def owns(self, t: torch.Tensor) -> bool:
        """``t``'s storage is an output storage of a graph captured in this pool."""
        ptr = t.untyped_storage().data_ptr()
        return any(ptr in g.out_ptrs for g in self.graphs)


_POOLS: dict = {}


def device_pool(index: Optional[int] = None) -> Pool:
    """The shared pool of CUDA device ``index`` (default: the current device)."""
    index = torch.cuda.current_device() if index is None else index
    return _POOLS.setdefault(index, Pool())


def refusal(example_inputs) -> Optional[str]:
    """Why a wrapper taking ``example_inputs`` cannot be captured (None: it can)."""
    for x in example_inputs:
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            return f"it takes a non-tensor input ({type(x).__name__}: dynamic shapes)"
        if x.device.type != "cuda":
            return f"it takes a {x.device.type} tensor"
    return None


class Graphed:
    """A boxed compiled function replayed as a CUDA graph (see the module docstring)."""

    def __init__(self, compiled, *, name: str, pool: Pool, static: set, mutated: set, n_user: int,
                 host_share: float = 0.0):
        self._boxed_call, self.host_share = True, host_share
        self.compiled, self.name, self.pool = compiled, name, pool
        self.static, self.mutated, self.n_user = set(static), set(mutated), n_user
        self.clone_user = False   # set once a user kept an output past the next call
        self.calls = 0
        self.graph = None
        self.disabled: Optional[str] = None
        self.out_ptrs: set = set()

    def _eager(self, args, why: Optional[str] = None):
        if why:
            counters["cudagraph"]["eager_runs"] += 1
            counters["cudagraph_eager"][f"{self.name}: {why}"] += 1
            log(2, f"cudagraph {self.name}: running the wrapper ({why})")
        return self.compiled(args)

    def _disable(self, why: str):
        self.disabled = why
        _refuse(self.name, why)

    def __call__(self, args):
        self.calls += 1
        if self.disabled or (self.graph is None and self.calls == 1):   # the first: kernels compile
            return self.compiled(args)
        if self.graph is None and self.host_share and self.calls == 2:
            return self._timed(args)
        return self._replay(args) if self.graph is not None else self._capture(args)

    def _timed(self, args):
        """cuda_graphs='auto': one call timed on the host and the device; unless the host took ``host_share`` of
        the device's time, the graph is never captured (a GPU-bound graph gains little and would hold memory)."""
        dev = next((x.device for x in args if isinstance(x, torch.Tensor) and x.is_cuda), None)
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        out = self.compiled(args)
        host = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        gpu = start.elapsed_time(end)
        if host < self.host_share * gpu:
            self._disable(f"GPU-bound: a call took {host:.2f} ms on the host, {gpu:.2f} ms on the device")
        else:
            log(1, f"cudagraph {self.name}: host-bound ({host:.2f} ms on the host, {gpu:.2f} on the device)")
        return out

    def _capture(self, args):
        why = refusal(args)
        if why:
            self._disable(why)
            return self.compiled(args)
        direct, copies = {}, {}
        self.pool.release_dead()
        params = self.pool.static_ptrs
        for i, x in enumerate(args):
            if x is None:
                continue
            if i in self.static or self.pool.owns(x) or x.data_ptr() in params:
                direct[i] = x.data_ptr()
            else:
                copies[i] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
                copies[i].copy_(x)
        ptrs = [x.untyped_storage().data_ptr() for x in args if isinstance(x, torch.Tensor)]
        if self.mutated and len(set(ptrs)) != len(ptrs):
            self._disable("a mutated input shares memory with another input")
            return self.compiled(args)
        inputs = [copies.get(i, x) for i, x in enumerate(args)]
        orig = list(args)
        user_ptrs = {x.untyped_storage().data_ptr() for i, x in enumerate(orig)
                     if isinstance(x, torch.Tensor) and i not in copies}
        args.clear()
        dev = next((x.device for x in orig if isinstance(x, torch.Tensor)), None)
        torch.cuda.synchronize(dev)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream(dev)
        try:
            with torch.cuda.device(dev), torch.cuda.graph(graph, pool=self.pool.ensure()):
                outs = self.compiled(inputs)
        except Exception as e:  # capture-unsafe op (host sync, CPU copy, ...): run normally from now on
            self._disable(f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            _recover(stream)
            return self.compiled(orig)
        del inputs
        keep = [(orig[i], copies[i]) for i in self.mutated if i in copies]
        del orig
        single = not isinstance(outs, (list, tuple))
        outs = [outs] if single else list(outs)
        self._record_outputs(outs, user_ptrs)
        del outs
        self._baseline()
        self.graph, self.direct, self.copies, self.single = graph, direct, copies, single
        self.pool.add(self)
        counters["cudagraph"]["captured"] += 1
        log(1, f"cudagraph {self.name}: captured ({len(direct)} inputs in place, {len(copies)} copied)")
        graph.replay()
        for user, buf in keep:
            user.copy_(buf)
        return self._outputs()

    def _record_outputs(self, outs, user_ptrs: set):
        """Remember each output as (kind, storage, offset, size, stride, dtype) and drop the tensors. Outputs
        in the caller's memory are not checked for liveness (replay writes there only as the program's
        mutation); every other storage is checked against its use count while only kiln holds it."""
        self.specs, self.storages = [], {}
        for j, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                self.specs.append(("value", o))
                continue
            st = o.untyped_storage()
            key = st.data_ptr()
            self.storages.setdefault(key, st)
            kind = "user" if j < self.n_user else "alias"
            self.specs.append((kind, key, o.storage_offset(), tuple(o.shape), tuple(o.stride()), o.dtype))
        self.out_ptrs = set(self.storages) - user_ptrs
        self._watch = {kind: [k for k in {s[1] for s in self.specs if s[0] == kind} if k not in user_ptrs]
                       for kind in ("user", "alias")}

    def release_dead(self, others: set) -> None:
        """User outputs whose storage only kiln holds, at addresses no other graph (``others``) reads or returns,
        become views of their block, copied out at each replay; the storage itself is dropped, so the block is
        free to the capture that follows."""
        dead = {c for c, base in self.use["user"] if _use_count(c) == base}
        keys = [k for k in self._watch["user"] if self.storages[k]._cdata in dead and k not in self._watch["alias"]
                and k not in others]
        gone = {self.storages[k]._cdata for k in keys}
        for k in keys:
            st = self.storages[k]
            self.storages[k] = torch._C._construct_storage_from_data_pointer(k, st.device, st.nbytes())
            self.specs = [("copy", *s[1:]) if s[0] == "user" and s[1] == k else s for s in self.specs]
            self.out_ptrs.discard(k)
        if keys:   # the alias baselines stay: aliases may be alive now (a forward's saved tensors)
            self._watch["user"] = [k for k in self._watch["user"] if k not in keys]
            self.use["user"] = [(c, base) for c, base in self.use["user"] if c not in gone]
            log(2, f"cudagraph {self.name}: {len(keys)} dead user output(s) given back to the pool, copied out")

    def _baseline(self):
        """Use counts of watched storages while kiln alone holds them (call with no alias handed out)."""
        self.use = {kind: [(self.storages[k]._cdata, _use_count(self.storages[k]._cdata)) for k in keys]
                    for kind, keys in self._watch.items()}

    def _outputs(self):
        out = []
        for s in self.specs:
            if s[0] == "value":
                out.append(s[1])
                continue
            kind, key, off, size, stride, dtype = s
            st = self.storages[key]
            t = torch.empty((0,), dtype=dtype, device=st.device).set_(st, off, size, stride)
            if kind == "copy" or kind == "user" and self.clone_user:
                t = torch.empty_strided(size, stride, dtype=dtype, device=st.device).copy_(t)
            out.append(t)
        return out[0] if self.single else out

    def _alive(self) -> Optional[str]:
        """An alias this replay would overwrite is still held by someone."""
        graphs = self.pool.graphs
        for g in graphs[graphs.index(self):]:
            for c, base in g.use["alias"]:
                if _use_count(c) > base:
                    return f"an output of {g.name} from an earlier replay is alive"
            for c, base in g.use["user"]:   # aliases handed out before clone_user was set
                if _use_count(c) > base:
                    g.clone_user = True
                    return f"a user kept an output of {g.name}: it clones user outputs from now on"
        return None

    def _replay(self, args):
        for i, ptr in self.direct.items():
            x = args[i]
            if x.data_ptr() != ptr:
                return self._eager(args, f"input {i} {tuple(x.shape)} moved")
        alive = self._alive()
        if alive:
            return self._eager(args, alive)
        for i, buf in self.copies.items():
            buf.copy_(args[i])
        keep = [(args[i], self.copies[i]) for i in self.mutated if i in self.copies]
        args.clear()
        self.graph.replay()
        for user, buf in keep:
            user.copy_(buf)
        counters["cudagraph"]["replays"] += 1
        return self._outputs()


def _recover(stream) -> None:
    """After a failed capture: restore the stream, and end a clean capture to reset the CUDA generator."""
    torch.cuda.set_stream(stream)
    torch.cuda.synchronize(stream.device)
    try:
        with torch.cuda.device(stream.device), torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.empty(1, device=stream.device).zero_()
    except Exception as e:  # noqa: BLE001  (the device itself is broken: nothing more to do here)
        torch.cuda.set_stream(stream)
        log(1, f"cudagraph: could not reset the CUDA generator after a failed capture: {e}")


def _refuse(name: str, why: str) -> None:
    """A graph not captured: counted (with its reason) and logged."""
    counters["cudagraph"]["refused"] += 1
    counters["cudagraph_refused"][f"{name}: {why}"] += 1
    log(1, f"cudagraph {name}: not captured: {why}")


def wrap(compiled, example_inputs, *, kind: str, n_user: int, mutated: set, pool: Optional[Pool] = None,
         positions=None, host_share: float = 0.0):
    """``compiled`` as a ``Graphed`` function, or unchanged (the reason logged) if it cannot be.
    ``positions``: each input's AOTAutograd position when it takes only some (freezing drops some)."""
    why = refusal(example_inputs)
    if why:
        _refuse(compiled.name, why)
        return compiled
    static = set()
    if kind != "backward":
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        static = set(getattr(meta, "static_input_indices", None) or ())
        if positions is not None:
            static = {j for j, i in enumerate(positions) if i in static}
    n_user = {"inference": 1 << 30, "forward": n_user, "backward": 0}[kind]
    dev = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), None)
    return Graphed(compiled, name=compiled.name, pool=pool or device_pool(dev.index if dev else None),
                   static=static, mutated=mutated, n_user=n_user, host_share=host_share)
