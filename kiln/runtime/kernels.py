"""Loaded kernels: what a fused graph's kernel references (``codegen.text.source.KernelRef``) are bound to.

A ``Kernel`` (cached by name, so identical layers share one and compile once) loads its module on first
call. A reference binds to a ``KernelCall``: the kernel plus its call site's ATen fallback, which runs
from then on, at every call site, when the kernel fails on its first call (logged, counted in
``counters['codegen']['runtime_fallback']``). ``@triton.jit`` decides between compiling and interpreting
when a module executes (``TRITON_INTERPRET``), so each module is executed with it set just for that import.
"""
import contextlib
import importlib.util
import os
import sys
import threading

from kiln.debug import counters, log
from kiln.runtime import private

_CACHE: dict = {}
_LOCK = threading.Lock()
_RESETS: list = []   # functions clearing other caches of compiled kernels (``on_reset``)


class KernelLoadError(RuntimeError):
    """A generated kernel module failed to import; the message names the file to inspect."""


def cache_dir() -> str:
    """``$KILN_KERNEL_DIR``, else ``kernels/`` in the user's cache directory, made 0700 and checked; a
    refused one is not used at all: kernels go to a private temporary directory, after one warning."""
    return _checked(os.environ.get("KILN_KERNEL_DIR") or private.user_dir("kernels"))


def subdir(name: str) -> str:
    """Folder ``name`` of the kernel directory (made 0700, checked as the directory is)."""
    return _checked(cache_dir(), name)


def _checked(path: str, name: str = "") -> str:
    try:
        return private.directory(os.path.join(path, name), "KILN_KERNEL_DIR")
    except (OSError, private.DirRefused) as e:
        fallback = private.fallback("kernel directory", e, "KILN_KERNEL_DIR")
        return private.directory(os.path.join(fallback, name), "KILN_KERNEL_DIR") if name else fallback


@contextlib.contextmanager
def interpret_mode(flag: bool):
    """Make ``@triton.jit`` build interpreter (True) or compiled (False) kernels in this scope."""
    import triton
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved_attr = runtime.__dict__.pop("interpret", None) if runtime is not None else None
    os.environ["TRITON_INTERPRET"] = "1" if flag else "0"
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_attr is not None:
            runtime.__dict__["interpret"] = saved_attr


class Kernel:
    """One generated kernel module, loaded on first call."""

    def __init__(self, name: str, source: str, interpret: bool):
        self.name, self.source, self.interpret = name, source, interpret
        self.__name__ = name
        self._call = None
        self.ran = False      # has completed a call (later errors are real errors)
        self.failed = None    # the exception of a failed first call (see fallback.KernelCall)

    def load(self):
        if self._call is None:
            with _LOCK:
                if self._call is None:
                    self._call = _load_module(self.name, self.source, self.interpret).call
        return self._call

    def __call__(self, *args, **kwargs):
        return (self._call or self.load())(*args, **kwargs)

    def __repr__(self):
        return f"<kiln kernel {self.name}>"


def module_file(name: str, source: str, directory=None, overwrite: bool = False) -> str:
    """The path of kernel module ``name``, (re)written unless it holds ``source`` exactly."""
    directory = directory or cache_dir()
    path = os.path.join(directory, f"{name}.py")
    try:
        fresh = not overwrite and private.read(path) == source.encode()
    except OSError:
        fresh = False
    if not fresh:
        private.write(directory, f"{name}.py", source)
    return path


def import_file(modname: str, path: str, interpret: bool, source=None):
    """A new module (not in ``sys.modules``) executed from ``path``, ``@triton.jit`` building interpreter
    (True) or compiled (False) kernels (None: no Triton kernels). ``source``: the text checked by
    ``module_file`` (what runs is what was checked), else the file's, read without following a link."""
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    text = private.read(path).decode() if source is None else source
    with interpret_mode(interpret) if interpret is not None else contextlib.nullcontext():
        exec(compile(text, path, "exec"), mod.__dict__)   # noqa: S102  (a module kiln generated)
    return mod


def _load_module(name, source, interpret):
    path = module_file(name, source)
    try:
        mod = import_file(f"kiln_kernels.{name}", path, interpret, source)
    except Exception as e:
        raise KernelLoadError(f"codegen: kernel {name} failed to load ({e}); see {path}") from e
    sys.modules[mod.__name__] = mod
    return mod


def on_reset(fn) -> None:
    """Have ``reset`` call ``fn()`` too (a module keeping its own table of compiled kernels)."""
    _RESETS.append(fn)


def reset() -> None:
    """Forget every kernel this process loaded or compiled (compiled functions keep theirs)."""
    with _LOCK:
        _CACHE.clear()
    for fn in _RESETS:
        fn()


def kernel_named(name: str, source: str, interpret: bool) -> Kernel:
    """The cached Kernel ``name`` whose module text is ``source``."""
    with _LOCK:
        k = _CACHE.get(name)
        if k is None or k.source != source:
            k = _CACHE[name] = Kernel(name, source, interpret)
    return k


def bind(ref) -> "KernelCall":
    """What a kernel reference calls: its cached ``Kernel`` with the call site's ATen fallback (or None)."""
    return KernelCall(kernel_named(ref.name, ref.source, ref.interpret), ref.fallback)


class KernelFailed(RuntimeError):
    """A generated kernel failed on its first call at a call site with no ATen fallback of its own; the
    compiled graph (``runtime.load.Compiled``) then runs its whole ATen graph instead."""


class KernelCall:
    """The FX target of one kernel node: ``kernel``, or ``fallback`` once the kernel failed on its first
    call (``KernelFailed`` when this site has none). The kernel's attributes read through."""

    def __init__(self, kernel, fallback):
        self.kernel, self.fallback = kernel, fallback
        self.__name__ = kernel.name

    def __getattr__(self, attr):
        if attr == "kernel":   # not set yet (unpickling, copying)
            raise AttributeError(attr)
        return getattr(self.kernel, attr)

    def __call__(self, *args, **kwargs):
        k = self.kernel
        if k.ran:   # the loaded module's call, without Kernel.__call__ (a C++ kernel's launch is a few us)
            return k._call(*args, **kwargs)
        if k.failed is not None and self.fallback is not None:
            return self.fallback(*args)
        try:
            out = k(*args, **kwargs)
        except Exception as e:
            if getattr(e, "kiln_index_check", False):   # an out-of-range index: eager's error, the kernel is fine
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            if k.failed is None:
                k.failed = e
                counters["codegen"]["runtime_fallback"] += 1
                log(1, f"codegen: kernel {k.name} failed on its first call, running its ATen nodes "
                       f"instead ({type(e).__name__}: {first})")
            if self.fallback is None:
                raise KernelFailed(f"kernel {k.name} failed on its first call ({type(e).__name__}: {first}) "
                                   f"and has no ATen fallback of its own") from e
            return self.fallback(*args)
        k.ran = True
        return out

    def __repr__(self):
        return f"<kiln kernel call {self.kernel.name}{'' if self.fallback is not None else ' (no fallback)'}>"
