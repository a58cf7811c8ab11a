"""Which kernel each random op of a training model draws in, on the C++ target and the Triton target (#31's
closing list): each op compiled alone beside one pointwise consumer, kernels read from ``run_and_get_code``,
``counters['random']`` saying whether the draw was fused (``fused``) or left to ATen (``aten``).

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/random_kernels.py      # (the GPU runs Triton itself)
"""
import re

import torch
import torch.nn.functional as F

import kiln
from kiln.debug import counters

N = 1 << 10
OPS = {
    "F.dropout": lambda x, p: F.dropout(x, 0.2, True) * 2,
    "F.dropout2d": lambda x, p: F.dropout2d(x.view(4, 16, 4, 4), 0.3, True).reshape(-1) * 2,
    "F.alpha_dropout": lambda x, p: F.alpha_dropout(x, 0.2, True) * 2,
    "drop path (bernoulli_ on [B, 1])": lambda x, p: x * x.new_empty((64, 1)).bernoulli_(0.75).div_(0.75)
    .expand(64, N // 64).reshape(-1),
    "torch.bernoulli(p tensor)": lambda x, p: torch.bernoulli(p) * x,
    "Tensor.bernoulli_(p tensor)": lambda x, p: torch.empty_like(x).bernoulli_(p) * x,
    "torch.bernoulli(x, p=float)": lambda x, p: torch.bernoulli(x, p=0.3) + x,
    "torch.rand": lambda x, p: torch.rand(N) + x,
    "torch.rand_like": lambda x, p: torch.rand_like(x) + x,
    "torch.randn_like": lambda x, p: torch.randn_like(x) + x,
    "torch.randint": lambda x, p: torch.randint(3, 10, (N,)) + x,
    "torch.randint_like": lambda x, p: torch.randint_like(x, 7) + x,
    "Tensor.uniform_": lambda x, p: torch.empty_like(x).uniform_(-2, 3) + x,
    "Tensor.normal_": lambda x, p: torch.empty_like(x).normal_(1, 2) + x,
    "torch.normal(tensor, float)": lambda x, p: torch.normal(torch.full_like(x, 4.0), 0.5) + x,
    "Tensor.exponential_": lambda x, p: torch.empty_like(x).exponential_(2.0) + x,
}


def kernels(fn, target: str, device: str) -> str:
    counters.clear()
    x, p = torch.ones(N, device=device), torch.full((N,), 0.25, device=device)
    with kiln.config.patch(codegen=target, on_error="raise", cache=False):   # counters count compiles
        _, sources = kiln.run_and_get_code(torch.compile(fn, backend="kiln"), x, p)
    names = sorted({m for s in sources for m in re.findall(r"\b(kiln_(?:pw|red|grp|scatter)_\w+)", s)})
    r = counters["random"]
    return f"{len(names)} kernel ({', '.join(n.split('_')[1] for n in names)}); fused {r['fused']}, ATen {r['aten']}"


def main():
    print("| random op | C++ target (CPU) | Triton target |\n|---|---|---|")
    triton_device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, fn in OPS.items():
        print(f"| {name} | {kernels(fn, 'cpp', 'cpu')} | {kernels(fn, 'triton', triton_device)} |", flush=True)


if __name__ == "__main__":
    main()
