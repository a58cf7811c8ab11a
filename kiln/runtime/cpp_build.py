"""Build, cache and load the C++ emitter's translation units; the functions its launchers call.

``build(unit, opts)`` compiles a ``Unit`` (``codegen.text.source``) with the system compiler (``Options.cpp_compiler``: 'auto'
is $CXX, else g++, else clang++) and ``Options.cpp_flags`` into a shared library in the ``cpp/`` folder of
kiln's private kernel directory (``kernels.cache_dir``), named by a hash of the source, the compiler's
version, the flags and this host's CPU flags (``-march=native`` builds for the build host: a cache
directory shared with another machine never hands it a library for another ISA). A library is written
under a temporary name and renamed into place, so processes building the same one race harmlessly; its
MAC under the directory's key (``private.sign``) goes beside it (``.so.mac``), and a library whose MAC
does not verify is never loaded: it is built again (logged, ``counters['codegen']['cpp_unauthenticated']``).
With glibc's vector math library present,
math calls in ``omp simd`` loops use its vector variants (``KILN_LIBMVEC``).

A C++ target that cannot build degrades loudly, not fatally: a missing compiler is not a mistake in what the
user asked for (a machine without g++ is normal), and flags are checked by the compiler, so kiln runs ATen
kernels instead, after one warning per process and cause (``RuntimeWarning``) naming the option or the
missing program, the compiler's first error line and what kiln does instead. ``unusable`` (``codegen='auto'``:
no compiler, or one that cannot build a test library with ``cpp_flags``) warns so; in ``build``
(``codegen='cpp'``) a missing compiler or a failed build raises ``CppBuildError`` after that warning, and the
caller (``codegen.target.CppTarget``) leaves the graph to ATen. ``function(name, ...)`` is how a kernel's launcher finds
its function among the loaded libraries.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import warnings

from kiln.codegen.text.source import VECTOR_MATH
from kiln.debug import counters, log
from kiln.options import Options, active
from kiln.runtime import private
from kiln.runtime.launch import restride  # noqa: F401  (the C++ launchers call cpp_build.restride)
from kiln.runtime.kernels import subdir

_LOCK = threading.Lock()
_LIBRARIES: dict = {}   # key -> CDLL
_OWNER: dict = {}       # function name -> CDLL holding it
_WARNED: set = set()
HOW = "set cpp_compiler (KILN_CPP_COMPILER, or $CXX) to a working C++ compiler, or codegen='aten' (KILN_CODEGEN=aten)"


class CppBuildError(RuntimeError):
    """kiln could not build a graph's C++ kernels (no compiler, or the compiler failed); the graph runs
    ATen kernels. Set ``cpp_compiler`` (or $CXX) to a working C++ compiler, or use ``codegen='aten'``."""


def find_compiler(opts: Options) -> str:
    """The compiler ``opts.cpp_compiler`` names (a path or a command), or '' when there is none."""
    spec = opts.cpp_compiler
    candidates = [os.environ.get("CXX", ""), "g++", "clang++"] if spec == "auto" else [spec]
    for c in candidates:
        if c and shutil.which(c):
            return shutil.which(c)
    return ""


@functools.lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout.splitlines() or [""])[0]


@functools.lru_cache(maxsize=None)
def host_isa() -> str:
    """This host's CPU flags (a hash of them), which ``-march=native`` builds for."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    import platform
    return hashlib.sha256(f"{platform.machine()}|{flags}".encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def has_libmvec() -> bool:
    """Whether glibc's vector math library provides every function the emitter declares vectorizable."""
    name = ctypes.util.find_library("mvec")
    if not name:
        return False
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return False
    wanted = [f"_ZGVbN4v_{f}f" for f in VECTOR_MATH] + [f"_ZGVbN2v_{f}" for f in VECTOR_MATH]
    return all(hasattr(lib, w) for w in wanted)


def command(cxx: str, opts: Options) -> list:
    """The compile command's flags (without files)."""
    flags = shlex.split(opts.cpp_flags) + ["-shared", "-fPIC"]
    return flags + (["-DKILN_LIBMVEC"] if has_libmvec() else [])


PROBE = """#include <cmath>
#include <cstdint>
extern "C" void kiln_probe(float* x, int64_t n) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; i++) x[i] = std::exp(x[i]);
}
"""


def missing(opts: Options) -> str:
    """Why no compiler is found, naming the option (or $CXX) and the programs looked for."""
    if opts.cpp_compiler != "auto":
        return f"no C++ compiler: cpp_compiler={opts.cpp_compiler!r} is not a program on this machine"
    cxx = os.environ.get("CXX", "")
    return f"no C++ compiler found ({f'$CXX={cxx!r}, ' if cxx else ''}g++ and clang++ are not on PATH)"


def unusable(opts: Options) -> str:
    """Why ``codegen='auto'`` cannot pick C++ kernels here ('' when it can): no compiler, or one that
    cannot build and load a small OpenMP library with ``opts.cpp_flags``. The answer is kept per
    process and, once a probe succeeded, on disk (by compiler version, flags and CPU). The first time a
    reason is found in a process it is also a warning, saying that the CPU's graphs run ATen kernels."""
    cxx = find_compiler(opts)
    why = _probe(cxx, opts.cpp_flags) if cxx else missing(opts)
    if why:
        _warn(f"kiln: C++ kernels unavailable: {why}. Graphs on the CPU run ATen kernels instead (codegen='auto'). "
              f"Fix: {HOW if not cxx else 'correct cpp_flags (KILN_CPP_FLAGS) or cpp_compiler'}", stacklevel=3)
    return why


@functools.lru_cache(maxsize=None)
def _probe(cxx: str, flags: str) -> str:
    try:
        version = compiler_version(cxx)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx} --version failed: {e}"
    opts_flags = shlex.split(flags) + ["-shared", "-fPIC"]
    key = hashlib.sha256("\0".join([version, *opts_flags, host_isa()]).encode()).hexdigest()[:20]
    directory = subdir("cpp")
    marker = f"kiln_probe_{key}.ok"
    if os.path.exists(os.path.join(directory, marker)):
        return ""
    with tempfile.TemporaryDirectory(prefix=private.PREFIX, dir=directory) as tmp:
        src, out = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(PROBE)
        try:
            res = subprocess.run([cxx, *opts_flags, src, "-o", out], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cxx} did not run: {e}"
        if res.returncode != 0:
            first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:300])
            first = first.replace(src, "probe.cpp").strip()
            return f"{cxx} with cpp_flags={flags!r} cannot build a test library: {first}"
        try:
            ctypes.CDLL(out)
        except OSError as e:
            return f"cannot load a test library built by {cxx}: {e}"
    private.write(directory, marker, b"")
    return ""


def _warn(message: str, stacklevel: int = 2) -> None:
    """``message`` as a RuntimeWarning, once per process."""
    with _LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def _fail(cause: str, where: str = "", fix: str = "") -> CppBuildError:
    """The error of a failed build, after one warning per ``cause`` (``where``, the unit's kept source,
    is logged only: a warning per unit would repeat one cause for every graph)."""
    counters["codegen"]["cpp_build_failed"] += 1
    _warn(f"kiln: cannot build C++ kernels: {cause}. The graph's kernels run as ATen instead. "
          f"Fix: {fix or HOW}", stacklevel=3)
    log(1, f"codegen: C++ build failed ({cause}{where}); the graph runs ATen kernels")
    return CppBuildError(cause + where)


def build(unit, opts: Options = None, binary=None) -> str:
    """Compile (or find in the cache) and load ``unit`` (a ``codegen.text.source.Unit``); returns the library's path.
    ``binary``: ``(file name, bytes)`` of the library a build with the same key made (the compile
    cache keeps them), written in place of a compile when its name is this build's."""
    opts = opts or active()
    cxx = find_compiler(opts)
    if not cxx:
        raise _fail(missing(opts))
    flags = command(cxx, opts)
    libs = ["-lmvec"] if has_libmvec() else []
    key = _key(unit, cxx, flags, libs)
    with _LOCK:
        lib = _LIBRARIES.get(key)
    if lib is None:
        directory = subdir("cpp")
        path = os.path.join(directory, f"kiln_{key}.so")
        try:
            private.secret(_root(path))
        except private.DirRefused as e:   # a key file that is not this user's private one
            raise _fail(str(e)) from None
        if not _authentic(path):
            if binary is not None and binary[0] == os.path.basename(path):
                _install(binary[1], path)
            else:
                _compile(cxx, flags, libs, unit.source, directory, path, opts.cpp_flags)
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise _fail(f"cannot load {path}: {e}") from None
        with _LOCK:
            _LIBRARIES[key] = lib
    with _LOCK:
        for name in unit.functions:
            _OWNER.setdefault(name, lib)
    return lib._name


def _key(unit, cxx: str, flags, libs) -> str:
    return hashlib.sha256("\0".join([unit.source, compiler_version(cxx), *flags, *libs, host_isa()]).encode()
                          ).hexdigest()[:20]


def library_path(unit, opts: Options = None) -> str:
    """Where ``build`` keeps (or would keep) the library of ``unit``."""
    opts = opts or active()
    cxx = find_compiler(opts)
    key = _key(unit, cxx, command(cxx, opts), ["-lmvec"] if has_libmvec() else [])
    return os.path.join(subdir("cpp"), f"kiln_{key}.so")


def _root(path: str) -> str:
    """The kernel directory whose key signs the libraries of ``path``'s folder."""
    return os.path.dirname(os.path.dirname(path))


def _authentic(path: str) -> bool:
    """Whether library ``path`` is there with a MAC (``path.mac``) that verifies under the directory's key."""
    try:
        data = private.read(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        log(1, f"codegen: {path} is not readable as a file ({e}); building it again")
        return False
    try:
        ok = private.verify(_root(path), data, private.read(path + ".mac"))
    except OSError:
        ok = False
    if not ok:
        counters["codegen"]["cpp_unauthenticated"] += 1
        log(1, f"codegen: {path} has no valid MAC (kiln did not build it for this user); building it again")
    return ok


def _install(data: bytes, path: str) -> None:
    """Put library bytes (``data``: built here, or from an authenticated cache entry) at ``path``, signed."""
    directory, name = os.path.split(path)
    private.write(directory, name, data)
    private.write(directory, name + ".mac", private.sign(_root(path), data))


def _compile(cxx, flags, libs, source, directory, path, opts_flags: str):
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=private.PREFIX, dir=directory) as tmp:
        src = os.path.join(tmp, "unit.cpp")
        with open(src, "w") as f:
            f.write(source)
        out = os.path.join(tmp, "unit.so")
        try:
            res = subprocess.run([cxx, *flags, src, "-o", out, *libs], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise _fail(f"{cxx} did not run: {e}") from None
        if res.returncode != 0:
            kept = private.write(directory, os.path.basename(path)[:-3] + ".failed.cpp", source)
            first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:300])
            first = first.replace(src, "unit.cpp").strip()   # not the temporary folder's name: one cause
            raise _fail(f"{os.path.basename(cxx)} exited with {res.returncode}: {first} ({cxx}, cpp_flags={opts_flags!r})",
                        f" (source: {kept})", "correct cpp_flags (KILN_CPP_FLAGS) or cpp_compiler, or "
                        "codegen='aten' (KILN_CODEGEN=aten)")
        private.write(directory, os.path.basename(path)[:-3] + ".cpp", source)
        with open(out, "rb") as f:   # in this process's own temporary folder
            data = f.read()
        _install(data, path)   # atomic: another process building the same library loses nothing
    counters["codegen"]["cpp_builds"] += 1
    log(2, f"codegen: built {path} in {time.perf_counter() - start:.2f}s")


def function(name: str, n_pointers: int, n_sizes: int, checked: bool = False):
    """The C function ``name`` of a library ``build`` loaded, taking ``n_pointers`` pointers then
    ``n_sizes`` int64 sizes; ``checked``: a function checking indirect indices, which takes the address of an
    int64 error cell last and returns an int (0, or the number of a failed check: ``kiln.runtime.bounds.fail``)."""
    with _LOCK:
        lib = _OWNER.get(name)
    if lib is None:
        raise CppBuildError(f"C++ kernel {name} is not in any library built by this process")
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p] * n_pointers + [ctypes.c_int64] * n_sizes + [ctypes.c_void_p] * checked
    fn.restype = ctypes.c_int if checked else None
    return fn


def library(name: str) -> str:
    """The path of the loaded library holding function ``name``."""
    with _LOCK:
        return _OWNER[name]._name


__all__ = ["CppBuildError", "build", "unusable", "function", "library", "restride", "find_compiler", "has_libmvec",
           "host_isa"]
