"""The ``kiln`` command: ``kiln demo``, ``kiln bench ...``, ``kiln check-ops ...`` (the OpInfo sweep),
``kiln options``."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "help"
    if cmd == "demo":
        from kiln.bench.demo import main as demo
        return demo(argv)
    if cmd == "bench":
        from kiln.bench.cli import main as bench
        return bench(argv)
    if cmd == "check-ops":
        from kiln.bench.opinfo import main as check_ops
        return check_ops(argv)
    if cmd == "options":
        from kiln.options import describe
        print(describe())
        return 0
    print("usage: kiln demo | kiln bench [--suite micro|models|all] [...] | kiln check-ops [--ops REGEX] [...]"
          " | kiln options")
    return 0 if cmd in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
