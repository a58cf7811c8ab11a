"""One FlexAttention op's subgraphs, translated for one kernel: ``Mods(call, dialect, index)``.

``index`` names the kernel's values of ``b``, ``h``, ``q_idx`` and ``kv_idx`` (``translate.Val``: a name
and the tile axes it varies along), so one ``Mods`` writes the forward's ``[q, kv]`` tiles, the
backward's transposed ``[kv, q]`` ones or the decoding kernel's rows of several heads alike. Captured
operands are the kernel's ``BUF<i>`` (score_mod's first, then mask_mod's), with ``BUF<i>_stride<d>`` and
``BUF<i>_size<d>`` beside each tensor.
"""
from __future__ import annotations

import torch

from kiln.codegen.flex.hop import FlexCall, buffer_kind
from kiln.codegen.flex.translate import Ref, Scatter, Unsupported, Val, is_identity, is_true, translate


def indices(b: str, h: str, q: str, kv: str, h_rows: bool = False) -> dict:
    """The ``index`` of a kernel whose values of b, h, q_idx and kv_idx are named so (int32, not negative);
    ``h_rows``: h varies along the query axis (rows of several heads)."""
    i32 = torch.int32
    return {"b": Val(b, i32, nonneg=True), "h": Val(h, i32, frozenset({"q"}) if h_rows else frozenset(), nonneg=True),
            "q": Val(q, i32, frozenset({"q"}), nonneg=True), "kv": Val(kv, i32, frozenset({"kv"}), nonneg=True)}


def buffer_names(call: FlexCall) -> list:
    return [f"BUF{i}" for i in range(len(call.score_bufs) + len(call.mask_bufs))]


def _inputs(bufs, first: int) -> list:
    out = []
    for i, b in enumerate(bufs, first):
        if buffer_kind(b) == "tensor":
            v = b.meta["val"]
            out.append(Ref(i, v.dim(), v.dtype))
        else:
            out.append(Val(f"BUF{i}", torch.int64))
    return out


class Mods:
    """Statements for the score_mod, mask_mod and joint graph of ``call`` (see the module docstring)."""

    def __init__(self, call: FlexCall, dialect, index: dict):
        self.call, self.d, self.index = call, dialect, index
        self.names = buffer_names(call)
        self.identity = is_identity(call.score)

    def _idx(self):
        return [self.index[k] for k in ("b", "h", "q", "kv")]

    def score(self, src: Val, tag: str):
        """(lines, Val): the score after score_mod of pre-mod score ``src`` (float)."""
        if self.identity:
            return [], src
        lines, out = translate(self.call.score, [src] + self._idx() + _inputs(self.call.score_bufs, 0), self.d,
                               f"sc{tag}_", self.names)
        return lines, self._float(out, lines)

    def _float(self, v, lines):
        if not isinstance(v, Val):
            raise Unsupported("flex: score_mod returns no value")
        if v.dtype == self.d.compute:
            return v
        name = f"scf_{len(lines)}"
        lines.append(self.d.assign(name, self.d.cast(v.code, v.dtype, self.d.compute), self.d.compute))
        return Val(name, self.d.compute, v.axes)

    def mask(self, tag: str):
        """(lines, Val or None): mask_mod's verdict (bool), None where it is constant True."""
        n = len(self.call.score_bufs)
        lines, out = translate(self.call.mask, self._idx() + _inputs(self.call.mask_bufs, n), self.d, f"mk{tag}_",
                               self.names)
        if is_true(out):
            return [], None
        if not isinstance(out, Val):
            raise Unsupported("flex: mask_mod returns no value")
        if out.dtype != torch.bool:
            name = f"mkb{tag}"
            lines.append(self.d.assign(name, self.d.cast(out.code, out.dtype, torch.bool), torch.bool))
            out = Val(name, torch.bool, out.axes)
        return lines, out

    def joint(self, score: Val, grad: Val, tag: str):
        """(lines, dscore Val or None, {buffer index: Scatter}): the joint graph at pre-mod ``score`` with the
        gradient ``grad`` of the post-mod score."""
        if self.identity and not self.call.score_bufs:
            return [], grad, {}
        lines, outs = translate(self.call.joint, [score] + self._idx() + [grad] + _inputs(self.call.score_bufs, 0),
                                self.d, f"jt{tag}_", self.names)
        if not isinstance(outs, list) or len(outs) < 5:
            raise Unsupported("flex: a joint graph without its five leading gradients")
        dscore = outs[0]
        if dscore is not None and not isinstance(dscore, Val):
            raise Unsupported("flex: the joint graph's score gradient is not a value")
        if dscore is not None:
            dscore = self._float(dscore, lines)
        scatters = {}
        for j, g in enumerate(outs[5:]):
            if g is None:
                continue
            b = self.call.score_bufs[j]
            if buffer_kind(b) != "tensor":
                raise Unsupported("flex: a gradient of a captured integer")
            shape = tuple(int(s) for s in b.meta["val"].shape)
            if isinstance(g, Val) and shape == ():
                g = Scatter((), [([], g)])
            if not isinstance(g, Scatter) or g.shape != shape:
                raise Unsupported("flex: a captured-tensor gradient other than scatters of the score's gradient")
            scatters[j] = g
        return lines, dscore, scatters


__all__ = ["Mods", "buffer_names", "indices"]
