"""Remat decisions in words: the ``KILN_DEBUG=3`` log of what a cut saves and recomputes.

``log_decisions`` prints, for one saved set, every saved value (bytes and why: ``mincut.ban_reason``
or "cheapest cut") and every forward op the backward runs again, each with the user's source line
(``source_line``, from ``meta['stack_trace']``; report.py prints the same lines).
"""
from __future__ import annotations

import torch.fx as fx

from kiln import logs
from kiln.debug import log, wanted
from kiln.partition.joint_info import JointInfo
from kiln.partition.mincut import Policy, ban_reason


REMAT = "kiln_remat"   # the artifact (torch's logging) of remat decisions


def source_line(n: fx.Node) -> str:
    """The user's source line that produced ``n`` (from meta['stack_trace'])."""
    st = n.meta.get("stack_trace")
    if not st:
        return ""
    lines = [s.strip() for s in st.strip().splitlines()]
    lines = [s for s in lines if s and set(s) - set("^~ ")]  # drop caret/tilde marker lines
    files = [i for i, s in enumerate(lines) if s.startswith("File ")]
    if not files:
        return lines[-1] if lines else ""
    i = files[-1]
    where = lines[i].split(", in ")[0].replace("File ", "").strip('"')
    code = lines[i + 1] if i + 1 < len(lines) else ""
    return f"{where}: {code}"


def log_decisions(info: JointInfo, saved, policy: Policy, tag: str) -> None:
    """KILN_DEBUG=3 (the ``kiln_remat`` artifact, a ``kiln_remat`` trace entry): what is saved (bytes, why)
    and what the backward recomputes, with source lines."""
    if not wanted(3, REMAT) and not logs.tracing():
        return
    saved_set = set(saved)
    lines = [f"remat[{tag}]: save {n.name} ({info.size.get(n, 0)} B, "
             f"{ban_reason(info, n, policy) or 'cheapest cut'}){_at(n)}" for n in saved]
    lines += [f"remat[{tag}]: recompute {n.name} ({info.size.get(n, 0)} B){_at(n)}" for n in info.fw
              if n not in saved_set and n.op == "call_function" and _recomputed(info, n, saved_set)]
    for line in lines:
        log(3, line, artifact=REMAT)
    logs.trace(f"kiln_remat_{tag}", lambda: "\n".join(lines))


def _recomputed(info: JointInfo, n: fx.Node, saved_set: set) -> bool:
    """Some backward node or gradient needs ``n`` through values that are not saved."""
    stack, seen = [n], set()
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u in info.tang or u in info.grads:
                return True
            if u not in seen and u not in saved_set and u in info.size:
                seen.add(u)
                stack.append(u)
    return False


def _at(n: fx.Node) -> str:
    line = source_line(n)
    return f" at {line}" if line else ""
