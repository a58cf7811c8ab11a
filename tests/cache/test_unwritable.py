"""A compile cache that cannot write never degrades silently: a directory that is a file, lies under a file or
is a dangling link turns the cache off with one warning naming the option (``cache_dir``, ``KILN_CACHE_DIR``)
and the directory, not an OS error alone, and ``kiln cache info`` says why; an entry that cannot be written
warns once, naming the directory and the option. (A read-only directory: tests/cache/test_cache.py.)"""
import os
import warnings

import pytest
import torch

import kiln
from kiln.cache import store
from kiln.cli import main
from tests.cache.test_cache import _cache, _count, _counters, _model, _train_step  # noqa: F401


@pytest.mark.parametrize("kind", ["file", "under_a_file", "dangling_link"])
def test_a_cache_dir_that_cannot_be_a_directory_warns_naming_the_option(tmp_path, capsys, kind):
    (tmp_path / "afile").write_text("")
    if kind == "dangling_link":
        os.symlink(tmp_path / "nowhere", tmp_path / "link")
    path = str(tmp_path / {"file": "afile", "under_a_file": "afile/sub", "dangling_link": "link"}[kind])
    m, x = _model(), torch.randn(8, 16)
    with pytest.warns(UserWarning, match=r"compile cache disabled: .*Fix: set cache_dir \(KILN_CACHE_DIR\)") as w:
        _train_step(m, x, codegen="aten", cache=True, cache_dir=path)
    (msg,) = [str(m.message) for m in w if "compile cache" in str(m.message)]
    assert path in msg and "Errno" not in msg, msg
    assert _count("off") == 1 and _count("saved") == 0
    with kiln.config.patch(cache_dir=path):
        assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "enabled:   no: directory not usable: " in out and "cache_dir (KILN_CACHE_DIR)" in out, out


def test_an_entry_that_cannot_be_written_warns_once(tmp_path):
    m, x = _model(), torch.randn(8, 16)
    _train_step(m, x, codegen="aten", **_cache(tmp_path))
    root = str(tmp_path / "cache")
    (path,) = [p for p, _, _ in store.entries(root)]
    os.remove(path)
    os.mkdir(path)   # the entry's name taken by a directory: the entry cannot be written there
    with pytest.warns(UserWarning, match=r"compile cache: cannot write an entry to .* Set cache_dir "
                                         r"\(KILN_CACHE_DIR\) to a writable directory") as w:
        again, stages = _train_step(m, x, codegen="aten", **_cache(tmp_path))
    assert root in str(w[0].message) and stages and _count("write_failed") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once per process
        _train_step(m, x, codegen="aten", **_cache(tmp_path))
    assert _count("write_failed") == 2 and _count("hit") == 0
