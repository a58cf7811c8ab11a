"""Build, cache and load the C++ emitter's translation units; the functions its launchers call.

``build(unit, opts)`` compiles a ``Unit`` with ``cpp_compiler`` ('auto': $CXX, g++, clang++) and
``cpp_flags`` into ``cpp/`` of kiln's private kernel directory, named by a hash of the source, compiler
version, flags and host CPU flags; a library whose MAC (``.so.mac``) does not verify is built again, never
loaded. A C++ target that cannot build degrades loudly, not fatally: one ``RuntimeWarning`` per cause,
then ``CppBuildError`` (or ``unusable``'s reason) and the graph runs ATen kernels.
"""
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

import torch

from kiln.codegen.text.source import VECTOR_MATH, header_name
from kiln.compat import empty_strided_fn
from kiln.debug import counters, log
from kiln.options import Options, active
from kiln.runtime import private
from kiln.runtime.launch import restride  # noqa: F401  (the C++ launchers call cpp_build.restride)
from kiln.runtime.kernels import subdir

_LOCK = threading.Lock()
_LIBRARIES: dict = {}   # key -> CDLL
_OWNER: dict = {}       # function name -> CDLL holding it
HOW = "set cpp_compiler (KILN_CPP_COMPILER, or $CXX) to a working C++ compiler, or codegen='aten' (KILN_CODEGEN=aten)"


class CppBuildError(RuntimeError):
    """kiln could not build a graph's C++ kernels (no compiler, or the compiler failed); the graph runs
    ATen kernels. Set ``cpp_compiler`` (or $CXX) to a working C++ compiler, or use ``codegen='aten'``."""


def find_compiler(opts: Options) -> str:
    """The compiler ``opts.cpp_compiler`` names (a path or a command), or '' when there is none."""
    spec = opts.cpp_compiler
    candidates = [os.environ.get("CXX", ""), "g++", "clang++"] if spec == "auto" else [spec]
    return next((shutil.which(c) for c in candidates if c and shutil.which(c)), "")


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


def _flags(opts: Options) -> tuple:
    """The compile command's flags (without files) and libraries."""
    mvec = has_libmvec()
    return shlex.split(opts.cpp_flags) + ["-shared", "-fPIC"] + ["-DKILN_LIBMVEC"] * mvec, ["-lmvec"] * mvec


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
    """Why ``codegen='auto'`` cannot pick C++ kernels here ('' when it can): no compiler, or one that cannot build and
    load a small OpenMP library with ``opts.cpp_flags`` (a success is kept on disk); warned once per reason."""
    cxx = find_compiler(opts)
    why = _probe(cxx, opts.cpp_flags) if cxx else missing(opts)
    if why:
        fix = HOW if not cxx else 'correct cpp_flags (KILN_CPP_FLAGS) or cpp_compiler'
        private.warn_once(f"kiln: C++ kernels unavailable: {why}. Graphs on the CPU run ATen kernels instead "
                          f"(codegen='auto'). Fix: {fix}", 4, RuntimeWarning)
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
        try:
            out, error = _run(cxx, opts_flags, [], PROBE, tmp, "probe", 120)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cxx} did not run: {e}"
        if error:
            return f"{cxx} with cpp_flags={flags!r} cannot build a test library: {error[1]}"
        try:
            ctypes.CDLL(out)
        except OSError as e:
            return f"cannot load a test library built by {cxx}: {e}"
    private.write(directory, marker, b"")
    return ""


def _run(cxx, flags, libs, source, tmp, stem, timeout, headers=()):
    """(library path, None or (exit status, first error line)) of compiling ``source`` in folder ``tmp``
    (a private folder of this process's own), beside ``headers`` ((name, text) pairs) it includes."""
    src, out = os.path.join(tmp, stem + ".cpp"), os.path.join(tmp, stem + ".so")
    for name, text in ((stem + ".cpp", source), *headers):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    res = subprocess.run([cxx, *flags, src, "-o", out, *libs], capture_output=True, text=True, timeout=timeout)
    if res.returncode == 0:
        return out, None
    first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:300])
    return out, (res.returncode, first.replace(src, stem + ".cpp").strip())   # one cause, not one per folder


def _fail(cause: str, where: str = "", fix: str = "") -> CppBuildError:
    """The error of a failed build, after one warning per ``cause`` (``where`` is logged only)."""
    counters["codegen"]["cpp_build_failed"] += 1
    private.warn_once(f"kiln: cannot build C++ kernels: {cause}. The graph's kernels run as ATen instead. "
                      f"Fix: {fix or HOW}", 4, RuntimeWarning)
    log(1, f"codegen: C++ build failed ({cause}{where}); the graph runs ATen kernels")
    return CppBuildError(cause + where)


def build(unit, opts: Options = None, binary=None) -> str:
    """Compile (or find in the cache) and load ``unit``; returns the library's path. ``binary``: ``(file
    name, bytes)`` of a library the compile cache kept, used in place of a compile when its name matches."""
    opts = opts or active()
    cxx = find_compiler(opts)
    if not cxx:
        raise _fail(missing(opts))
    flags, libs = _flags(opts)
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
                _compile(cxx, flags, libs, unit, directory, path, opts.cpp_flags)
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
    return os.path.join(subdir("cpp"), f"kiln_{_key(unit, find_compiler(opts), *_flags(opts))}.so")


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


def _compile(cxx, flags, libs, unit, directory, path, opts_flags: str):
    start = time.perf_counter()
    source, headers = unit.source, ((header_name(unit.prelude), unit.prelude),) if unit.prelude else ()
    for name, text in headers:   # beside the kept sources, so that they read (and build) as written
        private.write(directory, name, text)
    with tempfile.TemporaryDirectory(prefix=private.PREFIX, dir=directory) as tmp:
        try:
            out, error = _run(cxx, flags, libs, source, tmp, "unit", 600, headers)
        except (OSError, subprocess.SubprocessError) as e:
            raise _fail(f"{cxx} did not run: {e}") from None
        if error:
            kept = private.write(directory, os.path.basename(path)[:-3] + ".failed.cpp", source)
            raise _fail(f"{os.path.basename(cxx)} exited with {error[0]}: {error[1]} "
                        f"({cxx}, cpp_flags={opts_flags!r})",
                        f" (source: {kept})", "correct cpp_flags (KILN_CPP_FLAGS) or cpp_compiler, or "
                        "codegen='aten' (KILN_CODEGEN=aten)")
        private.write(directory, os.path.basename(path)[:-3] + ".cpp", source)
        _install(private.read(out), path)   # atomic: another process building the same library loses nothing
    counters["codegen"]["cpp_builds"] += 1
    log(2, f"codegen: built {path} in {time.perf_counter() - start:.2f}s")


_EMPTY, _MODES = empty_strided_fn("cpu"), getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)


def empty_cpu(size, stride, dtype):
    """The C++ launchers' allocations: torch's C++ helper, or ``empty_strided`` where a dispatch mode (a memory or
    FLOP counter) is active and must see the tensor made."""
    return torch.empty_strided(size, stride, dtype=dtype) if _MODES() else _EMPTY(size, stride, dtype)


def function(name: str, n_pointers: int, n_sizes: int, checked: bool = False):
    """The C function ``name`` of a loaded library: ``n_pointers`` pointers, ``n_sizes`` int64 sizes and, when
    ``checked``, an error cell's address, returning 0 or the number of a failed check (``bounds.fail``)."""
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
