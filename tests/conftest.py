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


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
