"""Budget sweep curves: memory and step time against activation_memory_budget, per case.

One PNG per (case, dtype) that ran at two or more budgets: left panel memory (MiB; CUDA peak on the
GPU, with the saved-for-backward bytes dotted, saved-for-backward bytes on the CPU), right panel median step time (ms); one line per compiled
backend on the same axes, eager as a dashed horizontal line. Drawn with matplotlib's Agg backend.
"""
from __future__ import annotations

import os

STYLE = {"kiln": ("tab:red", "o"), "inductor": ("tab:blue", "s"), "kiln-cg": ("tab:orange", "^"),
         "inductor-cg": ("tab:cyan", "v")}


def sweeps(rows) -> dict:
    """``{(case, dtype): {backend: [(budget, mem_bytes, ms)], 'eager': row}}`` for swept cases."""
    out: dict = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        k = (r["case"], r["dtype"])
        if r["backend"] == "eager":
            out.setdefault(k, {})["eager"] = r
        elif r.get("budget") is not None:
            out.setdefault(k, {}).setdefault(r["backend"], []).append(
                (r["budget"], r.get("mem_bytes"), r["ms"], r.get("saved_bytes") if r.get("peak_bytes") else None))
    return {k: v for k, v in out.items() if any(len(p) >= 2 for b, p in v.items() if b != "eager")}


def plot_budgets(rows, out_dir: str, device: str, mem_label: str) -> list:
    """Write ``budget_<case>[_<dtype>]_<device>.png`` for every swept case; returns the paths."""
    found = sweeps(rows)
    if not found:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    dtypes_per_case: dict = {}
    for case, dtype in found:
        dtypes_per_case.setdefault(case, set()).add(dtype)
    paths = []
    for (case, dtype), series in found.items():
        fig, (ax_mem, ax_ms) = plt.subplots(1, 2, figsize=(10, 4))
        for backend, pts in series.items():
            if backend == "eager":
                continue
            pts = sorted(pts)
            color, marker = STYLE.get(backend, ("tab:gray", "^"))
            xs = [p[0] for p in pts]
            if all(p[1] is not None for p in pts):
                ax_mem.plot(xs, [p[1] / 2**20 for p in pts], marker=marker, color=color, label=backend)
            if all(p[3] is not None for p in pts):  # on the GPU also the bytes saved for backward
                ax_mem.plot(xs, [p[3] / 2**20 for p in pts], marker=marker, color=color, ls=":",
                            label=f"{backend} saved for backward")
            ax_ms.plot(xs, [p[2] for p in pts], marker=marker, color=color, label=backend)
        eager = series.get("eager")
        if eager:
            if eager.get("mem_bytes") is not None:
                ax_mem.axhline(eager["mem_bytes"] / 2**20, color="black", ls="--", label="eager")
            if eager.get("peak_bytes") and eager.get("saved_bytes") is not None:
                ax_mem.axhline(eager["saved_bytes"] / 2**20, color="black", ls=":", label="eager saved for backward")
            ax_ms.axhline(eager["ms"], color="black", ls="--", label="eager")
        ax_mem.set(xlabel="activation_memory_budget", ylabel=f"{mem_label} (MiB)", title=f"{case} {dtype}: memory")
        ax_ms.set(xlabel="activation_memory_budget", ylabel="step time (ms, median)", title=f"{case} {dtype}: time")
        for ax in (ax_mem, ax_ms):
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
            ax.set_ylim(bottom=0)
        fig.tight_layout()
        name = f"budget_{case}_{dtype}_{device}.png" if len(dtypes_per_case[case]) > 1 else f"budget_{case}_{device}.png"
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
