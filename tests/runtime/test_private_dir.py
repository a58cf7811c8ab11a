"""kiln writes only into private directories (#32 item 4): by default under the user's cache directory, made
0700; a directory another user owns or others may write to is refused with one warning naming the variable
and nothing is written to or loaded from it; files are written under fresh random names and never through
a link; a built library is loaded only when its MAC (under the directory's key) verifies."""
import ctypes
import os
import stat
import subprocess
import uuid

import pytest
import torch

import kiln
from kiln.cache import store
from kiln.codegen.text.source import Unit
from kiln.runtime import cpp_build, kernels


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def _cpp_graph(x):
    """A graph the C++ target compiles (a new kernel per call: ``x``'s size is in its source)."""
    torch._dynamo.reset()
    f = kiln.compile(lambda t: (t.sin() * 2 + 1).sum(-1), codegen="cpp", cache=False)
    torch.testing.assert_close(f(x), (x.sin() * 2 + 1).sum(-1))


def test_default_directories_are_the_users_private_ones(tmp_path, monkeypatch):
    """Not a predictable name in the shared /tmp: ``$XDG_CACHE_HOME/kiln/{kernels,graphs}``, mode 0700."""
    monkeypatch.delenv("KILN_KERNEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = kernels.cache_dir()
    assert root == str(tmp_path / "xdg" / "kiln" / "kernels") and _mode(root) == 0o700
    assert _mode(kernels.subdir("cpp")) == 0o700
    assert store.directory() == str(tmp_path / "xdg" / "kiln" / "graphs") and _mode(store.directory()) == 0o700


def test_a_refused_kernel_directory_is_not_used(tmp_path, monkeypatch):
    """A kernel directory others may write to (or made by another user first) is refused with one warning
    naming KILN_KERNEL_DIR; kernels are built in a private temporary directory; nothing lands in it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("KILN_KERNEL_DIR", str(shared))
    with pytest.warns(UserWarning, match=r"writable by other users.*KILN_KERNEL_DIR") as caught:
        _cpp_graph(torch.randn(3, 5))
        _cpp_graph(torch.randn(3, 7))
    assert len([w for w in caught if "KILN_KERNEL_DIR" in str(w.message)]) == 1
    assert os.listdir(shared) == [] and kernels.cache_dir() != str(shared)
    assert _mode(kernels.cache_dir()) == 0o700
    if os.getuid() == 0:   # another user's directory (root can make one)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        monkeypatch.setenv("KILN_KERNEL_DIR", str(theirs))
        with pytest.warns(UserWarning, match=r"belongs to another user.*KILN_KERNEL_DIR"):
            assert kernels.cache_dir() != str(theirs)


_EVIL = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {{ FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}
extern "C" int {name}(void) {{ return 666; }}
"""


def test_a_planted_library_is_never_loaded(tmp_path, monkeypatch):
    """A library at the name kiln would load, written by someone else (no valid MAC), is not loaded (its
    constructor would run in this process): kiln builds its own. Writes replace links, never follow them."""
    monkeypatch.setenv("KILN_KERNEL_DIR", str(tmp_path / "kernels"))
    name = f"kiln_test_{uuid.uuid4().hex[:12]}"
    unit = Unit(f'extern "C" int {name}(void) {{ return 42; }}\n', (name,))
    path = cpp_build.library_path(unit)
    marker, victim = tmp_path / "constructor_ran", tmp_path / "victim.txt"
    victim.write_text("precious")
    src = tmp_path / "evil.cpp"
    src.write_text(_EVIL.format(marker=marker, name=name))
    cxx = cpp_build.find_compiler(kiln.options.current())
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", path], check=True)
    with open(path + ".mac", "w") as f:
        f.write("0" * 64)
    os.symlink(victim, path[:-3] + ".cpp")   # the source copy kiln writes beside its library
    before = kiln.counters["codegen"]["cpp_unauthenticated"]
    built = cpp_build.build(unit)
    assert not marker.exists(), "the planted library was loaded"
    assert kiln.counters["codegen"]["cpp_unauthenticated"] == before + 1
    assert getattr(ctypes.CDLL(built), name)() == 42
    assert victim.read_text() == "precious" and not os.path.islink(path[:-3] + ".cpp")
    assert _mode(os.path.join(kernels.cache_dir(), "kiln_secret.key")) == 0o600


def test_kernel_modules_are_written_under_random_names(tmp_path, monkeypatch):
    """The temporary file a kernel module is written to has a random name made exclusively: a link
    planted at a predictable name (``<path>.<pid>.<thread>.tmp``) is not followed."""
    import threading
    root = tmp_path / "kernels"
    monkeypatch.setenv("KILN_KERNEL_DIR", str(root))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = os.path.join(kernels.cache_dir(), "kiln_pw_test.py")
    os.symlink(victim, f"{target}.{os.getpid()}.{threading.get_ident()}.tmp")
    os.symlink(victim, target)
    path = kernels.module_file("kiln_pw_test", "X = 1\n")
    assert victim.read_text() == "precious" and open(path).read() == "X = 1\n" and not os.path.islink(path)


def test_a_key_file_others_can_read_is_refused(tmp_path):
    """A key others may read could sign their files: the directory is not used."""
    root = tmp_path / "c"
    root.mkdir(mode=0o700)
    (root / "kiln_secret.key").write_bytes(os.urandom(32))
    os.chmod(root / "kiln_secret.key", 0o644)
    with pytest.raises(store.CacheDirError, match="private key file"):
        store.directory(root)
