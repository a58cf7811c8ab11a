"""The ``kiln`` console script: ``kiln --version`` answers at once, every other command runs ``kiln.cli.main``.

``kiln.cli`` lives inside the ``kiln`` package, whose ``__init__`` imports torch (seconds); this launcher sits
outside it, so ``kiln --version`` reads the versions without importing torch, Triton or any of kiln: kiln's
from the source it would run (``kiln/__init__.py``'s ``__version__``), the others from their installed
metadata. ``python -m kiln --version`` (through ``kiln.cli``) prints the same line.
"""
from __future__ import annotations

import sys

VERSION_FLAGS = ("--version", "-V", "version")


def _kiln_version() -> str:
    """``__version__`` as written in the kiln package that ``import kiln`` would load (not executed)."""
    import importlib.util
    import re
    spec = importlib.util.find_spec("kiln")   # finds the package without running its __init__
    try:
        with open(spec.origin) as fh:
            found = re.search(r'^__version__ = "([^"]+)"', fh.read(), re.M)
        if found:
            return found.group(1)
    except (AttributeError, TypeError, OSError):
        pass
    return _installed("kiln") or "unknown"


def _installed(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version() -> str:
    """The line ``kiln --version`` prints: kiln's version and those of torch, Triton and Python."""
    import platform
    return (f"kiln {_kiln_version()} (torch {_installed('torch') or 'not installed'}, "
            f"triton {_installed('triton') or 'not installed'}, Python {platform.python_version()})")


def main(argv=None) -> int:
    """Entry point of the ``kiln`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in VERSION_FLAGS:
        print(version())
        return 0
    from kiln_bench._internal import cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
