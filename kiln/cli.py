"""The ``kiln`` command (also ``python -m kiln``): ``kiln demo``, ``kiln bench ...``, ``kiln check-ops ...``
(the OpInfo sweep), ``kiln options``, ``kiln cache info|clear``, ``kiln --version``."""
from __future__ import annotations

import sys


USAGE = ("usage: kiln demo | kiln bench [--suite micro|models|all] [...] | kiln check-ops [--ops REGEX] [...]"
         " | kiln bench-compile [--cases gpt] | kiln options | kiln cache info|clear | kiln --version")


def version() -> str:
    """kiln's version and the versions it runs with."""
    import platform

    import torch

    from kiln import __version__
    try:
        import triton
        tri = triton.__version__
    except ImportError:
        tri = "not installed"
    return f"kiln {__version__} (torch {torch.__version__}, triton {tri}, Python {platform.python_version()})"


def main(argv=None) -> int:
    """Run a ``kiln`` command; one that draws tables or plots without the bench extra says how to get it."""
    try:
        return _main(argv)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in ("rich", "matplotlib"):
            raise
        print(f"kiln: this command needs {top}: pip install 'kiln[bench]'", file=sys.stderr)
        return 1


def _main(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "help"
    if cmd in ("--version", "-V", "version"):
        print(version())
        return 0
    if cmd == "demo":
        from kiln.bench.demo import main as demo
        return demo(argv)
    if cmd == "bench":
        from kiln.bench.cli import main as bench
        return bench(argv)
    if cmd == "check-ops":
        from kiln.bench.opinfo import main as check_ops
        return check_ops(argv)
    if cmd == "bench-compile":
        from kiln.bench.compile_times import main as bench_compile
        return bench_compile(argv)
    if cmd == "cache":
        return cache_command(argv)
    if cmd == "options":
        if argv:   # (``kiln options --help`` printed the options)
            print("usage: kiln options   (every option: default, environment variable, help)")
            return 0 if argv[0] in ("-h", "--help") else 2
        from kiln.options import describe
        print(describe())
        return 0
    if cmd not in ("help", "-h", "--help"):
        print(f"kiln: unknown command {cmd!r}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    print(USAGE)
    return 0


def cache_command(argv) -> int:
    """``kiln cache info`` (where the compile cache is, its entries and size) or ``kiln cache clear``;
    the directory is the options' (``cache_dir``, ``KILN_CACHE_DIR``)."""
    from kiln.cache import store
    from kiln.options import current
    what = argv[0] if argv else "info"
    if what in ("-h", "--help"):
        print("usage: kiln cache info | kiln cache clear")
        return 0
    if what not in ("info", "clear"):
        print(f"kiln cache: unknown command {what!r}; use 'kiln cache info' or 'kiln cache clear'")
        return 2
    opts = current()
    try:
        root = store.directory(opts.cache_dir)
    except (OSError, store.CacheDirError) as e:
        print(f"kiln cache: {e}")
        return 1
    if what == "clear":
        print(f"removed {store.clear(root)} entries from {root}")
        return 0
    i = store.info(root)
    print(f"directory: {i['dir']}\nentries:   {i['entries']}\nsize:      {i['bytes'] / 2**20:.2f} MiB "
          f"(limit {opts.cache_size_mb} MiB)\nenabled:   {opts.cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
