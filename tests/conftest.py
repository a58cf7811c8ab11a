import gc
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("KILN_CACHE", "0")   # compiles in tests are cold; tests/cache turns the cache on
os.environ.setdefault("KILN_ON_ERROR", "raise")   # a graph kiln fails to compile fails its test (no eager fallback)
torch.set_num_threads(min(2, torch.get_num_threads()))


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


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
