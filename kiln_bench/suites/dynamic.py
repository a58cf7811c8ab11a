"""The dynamic suite (``kiln bench --suite dynamic``): a new size on almost every call (issue #35).

* ``gpt2_varlen``: HF ``GPT2LMHeadModel`` (``models.GPT`` without transformers, and at size tiny), 4 layers,
  d 768, vocab 50304, batch 8, bf16 autocast, forward+backward at lengths 200, 333, 517, 801, 640, 256, 999,
  410 (CPU: 2 layers, d 128, vocab 4096, fp32, the lengths / 4);
* ``cnn_batches``: torchvision's resnet18 (else ``models.ResNet18``), 128x128, forward+backward at batches
  8, 16, 12, 32, 24, 4 (CPU: ``models.CNN`` 'cpu', 32x32, batches 4, 8, 6, 16, 12, 2);
* ``cnn_images``, ``cnn_images_infer``: the same CNN with batch, height and width all changing (H != W: three
  symbols in the dynamic graph), training as above, or inference (eval mode, no_grad); GPU 128-pixel images
  around (b, h, w) = (16, 128, 112), CPU ``models.CNN`` 'cpu' at (8, 32, 32), (6, 40, 28), (8, 28, 36),
  (12, 36, 24), (4, 44, 40), (16, 24, 32);
* ``encoder_varlen``: ``nn.TransformerEncoder`` (2 layers, d 512; CPU d 128) over 1 to 4 sequences packed in
  one row, attention kept within each by a block-diagonal mask (no padding), forward+backward;
* ``decode_kvcache``: a decoder (4 layers, d 768; CPU 2, d 128), one new token per call against a KV cache
  growing from 16 to 16+N (N 64; CPU 16), no_grad.

Models train as users train them: the timed steps keep each model's own dropout. A backend first checks its
values at the first and last size against eager's in a compile of its own with every dropout probability at 0
(``kiln_bench.dropout.no_random``), then, after ``torch._dynamo.reset()``, runs the sizes once in order with
dropout on (the first pass: the compiles counted), then times each size (median of ``--iters`` steps, default 5). ``shared``: every
backend in this process, ``torch._dynamo.reset()`` between; ``fresh``: each (case, backend) in its own process
with its own caches. Both turn Dynamo's profile-guided automatic-dynamic state off.
"""
from __future__ import annotations

import collections
import copy
import fnmatch
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln_bench import backends as B, load, measure as M, models, report, runner
from kiln_bench.case import TOLERANCE, tensors
from kiln_bench.cores import fast_cores, pinned
from kiln_bench.dropout import no_random

_CORES: list = []   # host cores the timed steps run on (``cores.fast_cores``), for fresh processes too

GPT_LENGTHS = [200, 333, 517, 801, 640, 256, 999, 410]
PACKS = [(512,), (130, 300), (77, 200, 401), (64, 64, 128, 256), (333,), (250, 250, 90), (100, 411, 37, 180)]
PGO = ("automatic_dynamic_local_pgo", "automatic_dynamic_remote_pgo")


# a case at one device and size: the pristine model (CPU), size labels, ``inputs(i)`` (seeded, on the device),
# ``run(f, inputs)`` (the loss when training, else the output), ``train``, the model's name
Built = collections.namedtuple("Built", "model sizes inputs run train what")


def _gen(i):
    return torch.Generator().manual_seed(1000 + i)


def _gpt(device, size):
    lengths = {"gpu": GPT_LENGTHS, "cpu": [n // 4 for n in GPT_LENGTHS], "tiny": [20, 33]}[size]
    layers, d, heads, vocab, batch = {"gpu": (4, 768, 12, 50304, 8), "cpu": (2, 128, 4, 4096, 8),
                                      "tiny": (1, 32, 2, 256, 2)}[size]
    torch.manual_seed(0)
    if size != "tiny" and importlib.util.find_spec("transformers"):
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=max(lengths), n_embd=d, n_layer=layers,
                                           n_head=heads, use_cache=False, bos_token_id=0, eos_token_id=0))
        what, run = "transformers GPT2LMHeadModel", lambda f, xs: f(input_ids=xs[0], labels=xs[0]).loss
    else:
        model = models.GPT(models.GPTConfig(vocab, max(lengths), layers, heads, d, batch, sdpa=device == "cuda"))
        what, run = "kiln_bench.models.GPT", lambda f, xs: f(xs[0][:, :-1], xs[0][:, 1:])
    ids = lambda i: (torch.randint(0, vocab, (batch, lengths[i]), generator=_gen(i)).to(device),)  # noqa: E731
    return Built(model, lengths, ids, run, True, f"{what} ({layers} layers, d {d}, vocab {vocab}, batch {batch})")


def _cnn(device, size):
    batches, hw = {"gpu": ([8, 16, 12, 32, 24, 4], 128), "cpu": ([4, 8, 6, 16, 12, 2], 32), "tiny": ([2, 3], 16)}[size]
    torch.manual_seed(0)
    model, what = (models.CNN(models.CNN_SIZES[size]), f"kiln_bench.models.CNN '{size}'") if size != "gpu" else \
        (models.ResNet18(), "kiln_bench.models.ResNet18")
    if size == "gpu" and importlib.util.find_spec("torchvision"):
        import torchvision
        model, what = torchvision.models.resnet18(), "torchvision resnet18"

    def inputs(i):
        g = _gen(i)
        return (torch.randn(batches[i], 3, hw, hw, generator=g).to(device),
                torch.randint(0, 10, (batches[i],), generator=g).to(device))
    return Built(model, batches, inputs, lambda f, xs: F.cross_entropy(f(xs[0]).float(), xs[1]), True,
                 f"{what}, {hw}x{hw}, cross-entropy")


IMAGES = {"gpu": [(16, 128, 128), (12, 160, 112), (16, 112, 144), (24, 144, 96), (8, 176, 160), (32, 96, 128)],
          "cpu": [(8, 32, 32), (6, 40, 28), (8, 28, 36), (12, 36, 24), (4, 44, 40), (16, 24, 32)],
          "tiny": [(2, 16, 16), (3, 20, 12)]}


def _cnn_images(device, size, train=True):
    b = _cnn(device, size)
    sizes = IMAGES[size]

    def inputs(i):
        g, (n, h, w) = _gen(i), sizes[i]
        return torch.randn(n, 3, h, w, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)
    return b._replace(model=b.model.train(train), sizes=["x".join(map(str, s)) for s in sizes], inputs=inputs,
                      run=b.run if train else lambda f, xs: f(xs[0]), train=train,
                      what=b.what.split(",")[0] + (", batch x height x width, " +
                                                   ("cross-entropy" if train else "inference (eval, no_grad)")))


def _encoder(device, size):
    d, heads, layers = {"gpu": (512, 8, 2), "cpu": (128, 4, 2), "tiny": (32, 2, 1)}[size]
    packs = {"gpu": PACKS, "cpu": [tuple(n // 4 for n in p) for p in PACKS], "tiny": [(8,), (5, 7)]}[size]
    torch.manual_seed(0)

    def inputs(i):   # one row of packed sequences, a float mask that keeps attention within each
        doc = torch.repeat_interleave(torch.arange(len(packs[i])), torch.tensor(packs[i]))
        mask = torch.zeros(len(doc), len(doc)).masked_fill(doc[:, None] != doc[None, :], float("-inf"))
        return torch.randn(1, len(doc), d, generator=_gen(i)).to(device), mask.to(device)
    run = lambda f, xs: f(xs[0], mask=xs[1], is_causal=False).float().square().mean()  # noqa: E731
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True),
                                    layers, enable_nested_tensor=False)
    return Built(encoder, [f"{len(p)}:{sum(p)}" for p in packs], inputs, run, True,
                 f"nn.TransformerEncoder ({layers} layers, d {d}), sizes sequences:tokens, mean-square loss")


class Decoder(nn.Module):
    """``forward(ids [B, 1], cache [L, 2, B, H, T, D])`` -> (logits, the cache one token longer): pre-norm
    blocks, the new token's attention over the cache and itself, then an MLP."""

    def __init__(self, vocab, d, heads, layers):
        super().__init__()
        self.heads, self.tok, self.ln, self.head = heads, nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d),
                                                   nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                                                                  nn.Linear(4 * d, d))])
                                    for _ in range(layers))

    def forward(self, ids, cache):
        x, new = self.tok(ids), []
        b, _, d = x.shape
        for (ln1, qkv, o, ln2, mlp), kv in zip(self.blocks, cache):
            q, k, v = (t.view(b, 1, self.heads, -1).transpose(1, 2) for t in qkv(ln1(x)).chunk(3, -1))
            k, v = (torch.cat([c, t.to(c.dtype)], 2) for c, t in zip(kv, (k, v)))
            x = x + o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, 1, d))
            x = x + mlp(ln2(x))
            new.append(torch.stack([k, v]))
        return self.head(self.ln(x)), torch.stack(new)


def _decode(device, size):
    layers, d, heads, vocab, batch, n = {"gpu": (4, 768, 12, 50304, 8, 64), "cpu": (2, 128, 4, 4096, 4, 16),
                                         "tiny": (1, 32, 2, 64, 2, 2)}[size]
    lengths, dtype = list(range(16, 16 + n)), torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)

    def inputs(i):
        g = _gen(i)
        return (torch.randint(0, vocab, (batch, 1), generator=g).to(device),
                torch.randn(layers, 2, batch, heads, lengths[i], d // heads, generator=g).to(device, dtype))
    return Built(Decoder(vocab, d, heads, layers), lengths, inputs, lambda f, xs: f(*xs), False,
                 f"decoder ({layers} layers, d {d}, vocab {vocab}, batch {batch}), cache lengths {lengths[0]}.."
                 f"{lengths[-1]}, {str(dtype)[6:]}")


CASES = {"gpt2_varlen": _gpt, "cnn_batches": _cnn, "cnn_images": _cnn_images,
         "cnn_images_infer": lambda device, size: _cnn_images(device, size, False), "encoder_varlen": _encoder,
         "decode_kvcache": _decode}


def no_pgo() -> list:
    """Turn off Dynamo's profile-guided automatic-dynamic state (torch >= 2.6 has it); returns what was set."""
    import torch._dynamo.config as dc
    return [setattr(dc, k, False) or k for k in PGO if hasattr(dc, k)]


def _step(b, model, f, xs, device, keep=False, amp=True):
    """One forward (and backward when training) under bf16 autocast on CUDA; gradients dropped after.
    ``keep``: return the output and the gradients, in CPU memory."""
    with torch.autocast(device, torch.bfloat16, enabled=amp and device == "cuda"), torch.set_grad_enabled(b.train):
        out = b.run(f, xs)
        if b.train:
            out.backward()
    res = [t.detach().cpu() for t in tensors(out)] if keep else []
    res += [p.grad.cpu() for p in model.parameters() if p.grad is not None] if keep and b.train else []
    model.zero_grad(set_to_none=True)
    return res


def _peak(device, reset=False) -> int:
    """CUDA max allocated bytes since the last reset (0 on the CPU); ``reset`` starts a new window."""
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    if reset and device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return peak


def measure(name: str, backend: str, device: str, size: str, steps: int, mode: str) -> dict:
    """One row: compiles, first pass, check against eager, per-size median steps, CUDA peak."""
    row = {"case": name, "backend": backend, "mode": mode, "status": "ok", "stage": "build"}
    model = f = None
    try:
        b = CASES[name](device, size)
        row.update(model=b.what, sizes=[str(s) for s in b.sizes], dtype="amp_bf16" if device == "cuda" else "fp32")
        model, n, checked = copy.deepcopy(b.model).to(device), len(b.sizes), (0, len(b.sizes) - 1)
        runner._cleanup(device)

        def run64(i, compiled=False):
            """Float64, no autocast: eager's run (the referee when a check fails), or with ``compiled`` the
            backend's own compile of the float64 model (the referee's referee)."""
            m = copy.deepcopy(b.model).double().to(device)
            xs = tuple(t.double() if t.is_floating_point() else t for t in b.inputs(i))
            if compiled:
                torch._dynamo.reset()
            try:
                with no_random(m):
                    return _step(b, m, B.compile_model(backend, m) if compiled else m, xs, device, True, False)
            finally:
                if compiled:
                    torch._dynamo.reset()

        def timed(xs):
            return M.timed(lambda: _step(b, model, f, xs, device), device)[1]
        with B.scope(backend):
            if backend != "eager":   # values first, in a compile of their own with dropout off
                row["stage"] = "check"
                with no_random(model):
                    ref = [_step(b, model, model, b.inputs(i), device, True) for i in checked]
                    fc = B.compile_model(backend, model)
                    got = [_step(b, model, fc, b.inputs(i), device, True) for i in checked]
                    fc = None   # the referees below may compile again (after a reset)
                    res = [M.compare(r, g, TOLERANCE[row["dtype"]], lambda i=i: run64(i), lambda i=i: run64(i, True))
                           for r, g, i in zip(ref, got, checked)]
                row.update(ok=all(r["ok"] for r in res), err=max(r["err"] or 0.0 for r in res),
                           check="; ".join(f"{b.sizes[i]}: {r['check']}" for i, r in zip(checked, res)))
                ref = got = None
                torch._dynamo.reset()   # the timed compile starts afresh, with the model's own dropout on
            runner._cleanup(device)
            no_pgo()
            row["stage"] = "first pass"
            f, (g0, k0), _ = B.compile_model(backend, model), runner._dynamo_counts(), _peak(device, reset=True)
            first = [timed(b.inputs(i)) for i in range(n)]
            (g1, _), peak = runner._dynamo_counts(), _peak(device, reset=True)
            row["stage"] = "timed"
            with pinned(_CORES):
                ms = [1e3 * statistics.median(timed(xs) for _ in range(steps)) for xs in map(b.inputs, range(n))]
            worst, (g2, k2) = max(range(n), key=ms.__getitem__), runner._dynamo_counts()
            row.update(ms_per_size=ms, first_s=first, first_pass_s=sum(first), compile_s=sum(first) - sum(ms) / 1e3,
                       mean_ms=sum(ms) / n, worst_ms=ms[worst], worst_size=str(b.sizes[worst]), compiles=g2 - g0,
                       late_compiles=g2 - g1, graph_breaks=k2 - k0, ms=sum(ms) / n,
                       peak_bytes=max(peak, _peak(device)) if device == "cuda" else None)
        del row["stage"]
    except Exception as e:
        row.update(status="error", error=runner._error(e))
    finally:
        model = f = None   # noqa: F841  the compiled graphs go before the next row
        runner._cleanup(device)
    return row


def child(spec: str) -> None:
    """A fresh-mode process: one (case, backend) row, as JSON to ``spec['out']``; under ``--caches fresh`` with
    empty caches of its own (the shared run's on-disk Inductor and kiln caches would make its compiles warm)."""
    s = json.loads(spec)
    torch.set_num_threads(s["threads"])
    _CORES[:] = s.get("cores", ())
    with B.fresh_caches(bool(os.environ.get(B.FRESH_ROOT))):
        B.prime([s["backend"]], s["device"])
        row = measure(s["case"], s["backend"], s["device"], s["size"], s["steps"], "fresh")
    report.write_json(s["out"], {}, [row])


def _fresh(name, backend, device, size, steps) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="kiln-dyn-") as d:
        out = os.path.join(d, "row.json")
        spec = json.dumps(dict(case=name, backend=backend, device=device, size=size, steps=steps, out=out,
                               threads=torch.get_num_threads(), cores=list(_CORES)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        code = "import sys; from kiln_bench.suites import dynamic; dynamic.child(sys.argv[1])"
        p = subprocess.run([sys.executable, "-c", code, spec], env=env, capture_output=True, text=True)
        if p.returncode or not os.path.exists(out):
            return {"case": name, "backend": backend, "mode": "fresh", "status": "error", "error": f"process "
                    f"exited {p.returncode}: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])}
        return report.read_json(out)[1][0]


def _n(x, unit=1.0):
    return "-" if x is None else f"{x / unit:.3g}" if abs(x / unit) < 100 else f"{x / unit:.0f}"


CELLS = {"compiles (+late)": lambda r: f"{r['compiles']} (+{r['late_compiles']})",
         "compile s": lambda r: _n(r["compile_s"]), "mean ms": lambda r: _n(r["mean_ms"]),
         "worst ms @size": lambda r: f"{_n(r['worst_ms'])} @{r['worst_size']}",
         "peak GiB": lambda r: _n(r.get("peak_bytes"), 2**30),
         "check": lambda r: f"{'ok' if r['ok'] else 'FAIL'} {r['err']:.0e}" if "check" in r else "ref"}


def live_line(r) -> str:
    head = f"{r['case']:15} {r['backend']:9} {r['mode']:6} "
    if r["status"] != "ok":
        return head + f"ERROR in {r.get('stage', '')}: {r['error']}"
    return head + "  ".join(f"{k} {fn(r)}" for k, fn in CELLS.items() if k != "peak GiB" or r.get("peak_bytes"))


def markdown(meta: dict, rows: list) -> str:
    """The RESULTS.md section: one line per (case, backend), each cell ``shared / fresh``."""
    modes = [m for m in ("shared", "fresh") if any(r["mode"] == m for r in rows)]   # rows of several runs too
    load_note = report._load_note(meta, rows)
    lines = [f"## {meta['date']} · {meta['device_name']} · torch {meta['torch']} · triton {meta['triton']} · "
             f"kiln {meta['kiln']}", "", f"`{meta['command']}`  ",
             f"suite dynamic, size {meta['size']}, caches {meta['caches']}, threads {meta['threads']}, "
             f"{meta.get('elapsed_s', 0):.0f} s. Cells: {' / '.join(modes)} (shared: all backends in one process, "
             f"torch._dynamo.reset() between; fresh: each case and backend in its own process). **Dynamo's profile-"
             f"guided automatic-dynamic state off** ({', '.join(f'{k}=False' for k in meta['pgo_off'])}): no backend "
             f"inherits another's dynamic decisions. Compiles: new Dynamo graphs (counters['stats']['unique_graphs']), "
             f"+late: after the first pass over the sizes. Compile s: the first pass's wall time minus the backend's "
             f"own median steps at those sizes. Step: median of {meta['steps']} steps per size; mean over the sizes; "
             f"worst: the slowest size. Check: max error relative to eager's max at the first and last size. Peak: "
             f"CUDA max allocated." + (f"\n\n{load_note}" if load_note else ""), ""]
    head = ["case", "backend", *CELLS, "mean shared/fresh"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ok = {(r["case"], r["backend"], r["mode"]): r for r in rows if r["status"] == "ok"}
    for case, backend in itertools.product(*(dict.fromkeys(r[k] for r in rows) for k in ("case", "backend"))):
        got = {r["mode"] for r in rows if r["case"] == case and r["backend"] == backend}
        s, f = ok.get((case, backend, "shared")), ok.get((case, backend, "fresh"))
        cells = [" / ".join(fn(ok[case, backend, m]) if (case, backend, m) in ok else "err" if m in got else "-"
                            for m in modes) for fn in CELLS.values()] + [_n(s and f and s["mean_ms"] / f["mean_ms"])]
        lines += [f"| {case} | {backend} | " + " | ".join(cells) + " |"] if got else []
    lines.append("")
    for (case, backend, mode), r in ok.items():
        ind = ok.get((case, "inductor", mode))
        if backend == "kiln" and ind:
            x = [k / i for k, i in zip(r["ms_per_size"], ind["ms_per_size"])]
            j = max(range(len(x)), key=x.__getitem__)
            lines.append(f"- {case} ({mode}): kiln slower than inductor at {sum(v > 1 for v in x)}/{len(x)} sizes, "
                         f"worst {x[j]:.2f}x at {r['sizes'][j]}")
    lines += [f"- {case}: {what}" for case, what in {r["case"]: r.get("model") for r in rows if r.get("model")}.items()]
    lines += [f"- error: {r['case']} {r['backend']} ({r['mode']}) in {r.get('stage', '?')}: {r['error']}"
              for r in rows if r["status"] != "ok"]
    lines += [f"- check failed: {r['case']} {r['backend']} ({r['mode']}): {r['check']}"
              for r in rows if r.get("ok") is False]
    return "\n".join(lines) + "\n"


def finish(args, meta, rows, console) -> int:
    """Print the section; write --json, --md, --record(-dir); exit 1 on an error or a failed check."""
    text = markdown(meta, rows)
    console.print("\n" + text, markup=False, highlight=False)
    report.write_outputs(args, meta, rows, text, console)
    return 1 if any(r["status"] != "ok" or r.get("ok") is False for r in rows) and not args.no_guard else 0


def main(args, argv, console) -> int:
    """``kiln bench --suite dynamic``: the cases of ``--cases`` for ``--backends`` in ``--dynamic-mode``."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = [c for c in CASES if not args.cases or any(fnmatch.fnmatchcase(c, p) for p in args.cases)]
    why = (not names and f"--cases {args.cases} matched nothing in suite 'dynamic'; cases: {list(CASES)}") or \
        (device == "cuda" and not torch.cuda.is_available() and "--device cuda: no CUDA device here; use --device cpu")
    if args.list or why:
        console.print("\n".join(f"dynamic {c}" for c in CASES) if args.list else why, markup=False, highlight=False)
        return 0 if args.list else 2
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = ["shared", "fresh"] if args.dynamic_mode == "both" else [args.dynamic_mode]
    size, steps = args.size or ("gpu" if device == "cuda" else "cpu"), args.iters or 5
    meta = {**B.versions(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "t0": time.time(),
            "device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "size": size, "suite": "dynamic", "threads": torch.get_num_threads(), "backends": args.backends,
            "modes": modes, "steps": steps, "caches": args.caches, "command": "kiln bench " + " ".join(argv),
            "cases": names, "pgo_off": no_pgo(), "load": load.sample()}
    rows = []
    with B.fresh_caches(args.caches == "fresh"):
        meta["host_cores"] = fast_cores(device)
        _CORES[:] = meta["host_cores"].get("cores", ())
        B.prime(args.backends if "shared" in modes else [], device)
        for mode, name, backend in itertools.product(modes, names, args.backends):
            row = measure(name, backend, device, size, steps, mode) if mode == "shared" else \
                _fresh(name, backend, device, size, steps)
            rows.append(dict(row, load1=(load.sample() or {}).get("load1")))
            console.print(live_line(row), markup=False, highlight=False)
            if args.json:
                report.write_json(args.json, {**meta, "partial": True}, rows)
    meta.update(elapsed_s=time.time() - meta["t0"],
                load_end=load.sample(own=torch.get_num_threads() if device == "cpu" else 1))
    return finish(args, meta, rows, console)
