"""What every test starts from, whatever ran before it in its process: ``make test`` runs the suite in two
pytest-xdist workers (one per core), which take the test modules in an order that changes from run to run.

* one torch / OpenMP thread per test process (kiln's C++ kernels share torch's libgomp, so
  ``torch.set_num_threads`` sets theirs too); a test that changes it gets it back afterwards;
* seeded RNGs (torch, Python's ``random``, numpy's global one) and a fresh Dynamo;
* ``os.environ`` as it was (tools run in-process, such as the fuzz runner's ``main``, set variables for the rest of
  their process);
* ``torch.backends``' global flags settable: importing torch's test utilities (OpInfo's ``op_db``) freezes them
  for torch's own suite, and kiln's tests set flags directly (restoring them).
"""
import gc
import os
import random

import numpy as np
import pytest
import torch
import torch.backends

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("KILN_CACHE", "0")   # compiles in tests are cold; tests/cache turns the cache on
os.environ.setdefault("KILN_ON_ERROR", "raise")   # a graph kiln fails to compile fails its test (no eager fallback)
THREADS = 1
torch.set_num_threads(THREADS)


def pytest_configure(config):
    # masked-off lanes of interpreted kernels may compute log(0) and the like; they are never stored
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")


def pytest_collection_modifyitems(config, items):
    """``-m gpu`` on a machine without CUDA skips the GPU tests (plain runs deselect them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_FROZEN_AT = [None]


def pytest_runtest_setup(item):
    """At each test module's first test, collect and then freeze what is alive (torch, kiln and the imports the
    earlier modules' compiles pulled in): the cyclic GC no longer walks those objects at every full collection
    (a tenth of the suite's time went to it, most in the bench's ``gc.collect()`` per row). What a test makes
    is collected as before; the module fixtures of the module before are torn down by then."""
    if item.module is not _FROZEN_AT[0]:
        _FROZEN_AT[0] = item.module
        gc.collect()
        gc.freeze()


def _backend_flags_settable() -> None:
    """Undo ``torch.backends.disable_global_flags()`` (run by ``torch.testing._internal.common_utils`` on import).
    The flag is a global of ``torch/backends/__init__.py``, reached through a function's globals: ``torch.backends``
    may be a wrapper module (it is in torch 2.13), on which ``setattr`` sets an attribute nothing reads."""
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    env = dict(os.environ)
    torch._dynamo.reset()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    yield
    torch._dynamo.reset()
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)
    if torch.backends.flags_frozen():
        _backend_flags_settable()
