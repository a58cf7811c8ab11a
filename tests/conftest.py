import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("KILN_CACHE", "0")   # compiles in tests are cold; tests/cache turns the cache on
os.environ.setdefault("KILN_ON_ERROR", "raise")   # a graph kiln fails to compile fails its test (no eager fallback)
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
