"""The ``kiln`` command (also ``python -m kiln``): ``kiln demo``, ``kiln bench ...``, ``kiln check-ops ...``
(the OpInfo sweep), ``kiln options [NAME]``, ``kiln cache info|clear``, ``kiln --version``."""
import sys


USAGE = ("usage: kiln demo | kiln bench [--suite micro|models|user|all] [...] | kiln check-ops [--ops REGEX] [...]"
         " | kiln bench-compile [--cases gpt] | kiln options [NAME] | kiln cache info|clear | kiln --version")


# The tools' commands (kiln_bench), imported only when run: kiln never imports the tools (test_layers checks)
TOOLS = {"demo": "kiln_bench.demo", "bench": "kiln_bench.cli", "check-ops": "kiln_bench.opinfo",
         "bench-compile": "kiln_bench.compile_times"}


def tool(cmd: str):
    """The ``main(argv)`` of the tool behind ``kiln cmd``; a clear error when the tools are not installed."""
    import importlib
    try:
        importlib.import_module("kiln_bench")
    except ModuleNotFoundError as e:
        if e.name != "kiln_bench":
            raise
        raise ModuleNotFoundError(
            f"kiln {cmd}: the tools (the kiln_bench package) are not installed; they come with kiln's source: "
            f"pip install -e . in a checkout of kiln (or run from its root)", name=e.name) from None
    return importlib.import_module(TOOLS[cmd]).main


def version() -> str:
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
    """Run a ``kiln`` command (one that lacks the bench extra or the tools says how to get them)."""
    try:
        return _main(argv)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if e.name == "kiln_bench":   # (raised by ``tool``)
            print(f"kiln: {e}", file=sys.stderr)
            return 1
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
    if cmd in TOOLS:
        return tool(cmd)(argv)
    if cmd == "cache":
        return cache_command(argv)
    if cmd == "options":
        if argv[:1] in (["-h"], ["--help"]):   # (``kiln options --help`` printed the options)
            return print("usage: kiln options [NAME ...]   (all options, or the named ones, with their help)") or 0
        from kiln.options import describe
        if not argv:
            print(describe())
        return max(map(show_option, argv), default=0)
    if cmd not in ("help", "-h", "--help"):
        print(f"kiln: unknown command {cmd!r}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    print(USAGE)
    return 0


def show_option(name: str) -> int:
    """``kiln options NAME``: its help, default, environment variable and choices; else the nearest names (exit 2)."""
    from kiln.options import ENV_NAMES, FIELDS, suggest
    f, near = FIELDS.get(name), " or ".join(suggest(name))
    if f is None:
        print(f"kiln options: no option {name!r}; " + (f"did you mean {near}?" if near else "`kiln options` lists "
              "them all"), file=sys.stderr)
        return 2
    ch = ", ".join("a callable" if c == "callable" else "None" if c in (None, type(None)) else repr(c)
                   for c in f.metadata["choices"] or ())
    print(f"{name}: {f.metadata['help']}\n  default:     {f.default!r}\n  environment: "
          f"{ENV_NAMES[name] if f.metadata['env'] else '- (set in code)'}" + (f"\n  choices:     {ch}" if ch else ""))
    return 0


def cache_command(argv) -> int:
    """``kiln cache info`` (directories, entries, size, why off) or ``kiln cache clear`` (only its entries)."""
    import os

    from kiln import cache
    from kiln.cache import store
    from kiln.options import current
    from kiln.runtime import private
    what = argv[0] if argv else "info"
    if what in ("-h", "--help"):
        print("usage: kiln cache info | kiln cache clear")
        return 0
    if what not in ("info", "clear"):
        print(f"kiln cache: unknown command {what!r}; use 'kiln cache info' or 'kiln cache clear'")
        return 2
    opts = current()
    root, why = cache.status(opts)
    usable = not why or why.startswith("cache=False")
    if what == "clear":
        if not usable:
            print(f"kiln cache: {why}")
            return 1
        print(f"removed {store.clear(root)} entries from {root}")
        return 0
    kernels = os.environ.get("KILN_KERNEL_DIR") or private.user_dir("kernels")
    try:
        private.directory(kernels, "KILN_KERNEL_DIR")
        kernel_note = ""
    except (OSError, private.DirRefused) as e:
        kernel_note = f"\n           refused ({e}): kernels go to a private temporary directory per process"
    i = store.info(root) if usable else {"entries": 0, "bytes": 0}
    print(f"kernels:   {kernels}{kernel_note}\ndirectory: {root}\nentries:   {i['entries']}\n"
          f"size:      {i['bytes'] / 2**20:.2f} MiB (limit {opts.cache_size_mb} MiB)\n"
          f"enabled:   {'yes' if not why else 'no: ' + why}")
    return 0
