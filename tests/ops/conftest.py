"""Keep the OpInfo tests light on the shared 2-core machine, and leave torch as the other tests expect it:
importing torch's test utilities (``op_db``) freezes ``torch.backends``' global flags for torch's own suite,
after which kiln's tests that set a flag directly would fail."""
import pytest
import torch
import torch.backends


@pytest.fixture(autouse=True)
def _one_thread_and_mutable_backend_flags():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
