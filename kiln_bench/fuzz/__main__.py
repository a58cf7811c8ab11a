"""``python -m kiln_bench.fuzz --target triton --programs 1000 --seed 0 --workers 2 --out DIR``."""
import argparse
import ast
import sys

from kiln_bench.fuzz.runner import Config, main

TARGETS = ("aten", "triton", "cpp")   # kiln's codegen targets (cpp: C++/OpenMP kernels built with g++)


def parse(argv=None) -> Config:
    p = argparse.ArgumentParser(prog="python -m kiln_bench.fuzz", description=__doc__)
    p.add_argument("--target", default="triton", help="aten, triton, cpp, or several: 'aten,triton,cpp'")
    p.add_argument("--programs", type=int, default=100, help="programs per target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="index of the first program")
    p.add_argument("--indices", default="", help="comma-separated program indices (instead of --start/--programs)")
    p.add_argument("--workers", type=int, default=2, help="child processes")
    p.add_argument("--out", default="fuzz_out", help="folder for results.jsonl, summary.md, failures/")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a program may take")
    p.add_argument("--max-ops", type=int, default=8, help="statements per program, at most")
    p.add_argument("--no-shrink", action="store_true", help="write failures as found")
    p.add_argument("--shrink-tries", type=int, default=40, help="candidates tried per shrunk failure")
    p.add_argument("--shrink-per-group", type=int, default=2, help="failures shrunk per failure group")
    p.add_argument("--hook", default=None, help="'module:function' applied to each program in the child")
    p.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                   help="a kiln option for every compile, e.g. --set tuning.persistent_max=64 (a Python literal)")
    p.add_argument("--strict", action="store_true",
                   help="count a kernel that fell back to ATen at run time, or a C++ build that failed (its graph "
                        "then runs ATen), as a failure (and shrink it)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds: then start no new program, end shrinking, and write the summary once the "
                        "programs still running finish (abandoned after --grace more seconds)")
    p.add_argument("--grace", type=float, default=20.0, help="seconds running programs get after --deadline")
    p.add_argument("--summary-every", type=float, default=60.0,
                   help="seconds between the summaries written while the run goes on")
    p.add_argument("--inline", action="store_true", help="run the programs in this process (no children: "
                                                          "for debugging; a crash ends the run)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    targets = tuple(t for t in a.target.split(",") if t)
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        p.error(f"--target {bad[0]!r}: choose from {', '.join(TARGETS)} (or several: 'aten,cpp')")
    options = {}
    for item in a.set:
        name, _, value = item.partition("=")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    return Config(options=options, targets=targets, programs=a.programs, seed=a.seed, start=a.start,
                  workers=a.workers, out=a.out,
                  timeout=a.timeout, max_ops=a.max_ops, shrink=not a.no_shrink, shrink_tries=a.shrink_tries,
                  shrink_per_group=a.shrink_per_group, hook=a.hook, quiet=a.quiet, strict=a.strict,
                  deadline=a.deadline, grace=a.grace, summary_every=a.summary_every, inline=a.inline,
                  indices=tuple(int(i) for i in a.indices.split(",") if i))


if __name__ == "__main__":
    cfg = parse()
    main(cfg)
    print(open(f"{cfg.out}/summary.md").read())
    sys.exit(0)
