"""A/B of one code-generation constant on the micro suite, in one process per setting (GPU).

    PYTHONPATH=. python benchmarks/ab_probe.py kiln.codegen.triton PERSISTENT_MAX 2048 4096 --cases layer_norm

Each value runs ``kiln bench --suite micro --backends kiln`` with the constant set, so the rows of
both settings come from the same machine minutes apart (compare within one call).
"""
import argparse
import importlib
import subprocess
import sys

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("module")
    p.add_argument("name")
    p.add_argument("values", nargs="+")
    p.add_argument("--cases", default="layer_norm,t5_rmsnorm,softmax")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--child", action="store_true")
    a, rest = p.parse_known_args()
    if a.child:
        mod = importlib.import_module(a.module)
        old = getattr(mod, a.name)
        v = a.values[0]
        setattr(mod, a.name, v.lower() in ("1", "true") if isinstance(old, bool) else type(old)(v))
        from kiln.bench.cli import main
        sys.exit(main(["--suite", "micro", "--backends", "kiln", "--device", "cuda", "--dtype", a.dtype,
                       "--cases", a.cases, "--no-warm", "--no-record"]))
    for v in a.values:
        print(f"== {a.module}.{a.name} = {v}", flush=True)
        out = subprocess.run([sys.executable, __file__, a.module, a.name, v, "--cases", a.cases, "--dtype", a.dtype,
                              "--child"], capture_output=True, text=True)
        print("\n".join(ln for ln in out.stdout.splitlines() if ln.startswith("| ")) or out.stderr[-2000:], flush=True)
