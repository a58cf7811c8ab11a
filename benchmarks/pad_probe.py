"""GPU: is padding a misaligned matmul worth its copies? Times cuBLAS on the lm_head shapes of GPT-2
(vocabulary 50257) aligned and not, and the copies padding adds:
``PYTHONPATH=. python3 benchmarks/pad_probe.py``. Prints one line per shape."""
import torch
from triton.testing import do_bench


def t(fn):
    return do_bench(fn, warmup=25, rep=100)


def main():
    for dt in (torch.float16, torch.bfloat16):
        for M in (4096, 8192):
            K, N, NP = 768, 50257, 50264
            a = torch.randn(M, K, device="cuda", dtype=dt)
            w = torch.randn(N, K, device="cuda", dtype=dt)       # lm_head weight [V, d]
            wp = torch.zeros(NP, K, device="cuda", dtype=dt)
            wp[:N] = w
            g = torch.randn(M, N, device="cuda", dtype=dt)      # the logits' gradient
            gp = torch.zeros(M, NP, device="cuda", dtype=dt)
            gp[:, :N] = g
            out = torch.empty(M, N, device="cuda", dtype=dt)
            rows = {
                "fwd a@w.T (N misaligned)": t(lambda: a @ w.t()),
                "fwd padded": t(lambda: a @ wp.t()),
                "fwd padded + contiguous copy": t(lambda: (a @ wp.t())[:, :N].contiguous()),
                "fwd padded, copy into out": t(lambda: out.copy_((a @ wp.t())[:, :N])),
                "dx g@w (K misaligned)": t(lambda: g @ w),
                "dx padded": t(lambda: gp @ wp),
                "dw g.T@a (M-major misaligned)": t(lambda: g.t() @ a),
                "dw padded": t(lambda: gp.t() @ a),
                "pad g (copy)": t(lambda: torch.nn.functional.pad(g, (0, NP - N))),
            }
            print(f"{dt} M={M}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
