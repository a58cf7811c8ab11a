"""A/B of one kiln option (a code-generation constant, say) on the micro suite, one process per value (GPU).

    PYTHONPATH=. python benchmarks/ab_probe.py tuning.persistent_max 2048 4096 --cases layer_norm

Each value runs ``kiln bench --suite micro --backends kiln`` with the option set through its environment
variable (``kiln options`` lists them), so the rows of both settings come from the same machine minutes
apart (compare within one call).
"""
import argparse
import os
import subprocess
import sys

from kiln.options import ENV_NAMES, parse_value

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("option", help="an option name, e.g. tuning.persistent_max")
    p.add_argument("values", nargs="+")
    p.add_argument("--cases", default="layer_norm,t5_rmsnorm,softmax")
    p.add_argument("--dtype", default="fp32")
    a = p.parse_args()
    for v in a.values:
        parse_value(a.option, v)   # a bad name or value fails here, listing what is valid
        print(f"== {a.option} = {v}", flush=True)
        env = {**os.environ, ENV_NAMES[a.option]: v}
        out = subprocess.run([sys.executable, "-m", "kiln_bench", "--suite", "micro", "--backends", "kiln", "--device",
                              "cuda", "--dtype", a.dtype, "--cases", a.cases, "--no-warm", "--no-record"],
                             capture_output=True, text=True, env=env)
        print("\n".join(ln for ln in out.stdout.splitlines() if ln.startswith("| ")) or out.stderr[-2000:], flush=True)
