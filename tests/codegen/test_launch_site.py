"""The launch-site cache: a compiled kernel is reused only for arguments that specialize alike."""
import torch

from kiln.codegen import launch


class FakeCompiled:
    function, packed_metadata = 0, None

    def __init__(self):
        self.runs = 0

    def run(self, *args):
        self.runs += 1


def _setup(monkeypatch):
    slow = []
    ck = FakeCompiled()

    def fake_general(kernel, grid, args, consts, warps):
        slow.append(args)
        return ck
    monkeypatch.setattr(launch, "_launch", fake_general)
    monkeypatch.setattr(launch, "_SITES", {})
    monkeypatch.setattr(launch, "_stream", lambda: 0)
    monkeypatch.setattr(launch, "_hooks_on", lambda: False)
    return slow, ck


def test_site_reuses_the_kernel_for_aligned_tensors_and_generic_seeds(monkeypatch):
    slow, ck = _setup(monkeypatch)
    kernel = object()
    buf = torch.empty(64)
    launch.launch(kernel, (buf, buf, 12345), (4,), (16,), 4)    # first call: the general path
    launch.launch(kernel, (buf, buf, 777), (4,), (16,), 4)      # then the site
    assert len(slow) == 1 and ck.runs == 1


def test_site_falls_back_for_misaligned_tensors_and_special_integers(monkeypatch):
    slow, ck = _setup(monkeypatch)
    kernel = object()
    buf = torch.empty(64)
    launch.launch(kernel, (buf, 12345), (4,), (16,), 4)
    launch.launch(kernel, (buf[1:], 12345), (4,), (16,), 4)   # 4 bytes off alignment
    launch.launch(kernel, (buf, 32), (4,), (16,), 4)          # a seed divisible by 16
    launch.launch(kernel, (buf, 1), (4,), (16,), 4)           # a seed equal to 1
    assert len(slow) == 4 and ck.runs == 0


def test_no_site_is_made_from_a_misaligned_first_call(monkeypatch):
    slow, ck = _setup(monkeypatch)
    kernel = object()
    buf = torch.empty(64)
    launch.launch(kernel, (buf[1:],), (4,), (16,), 4)
    launch.launch(kernel, (buf,), (4,), (16,), 4)
    assert len(slow) == 2 and ck.runs == 0
    launch.launch(kernel, (buf,), (4,), (16,), 4)
    assert ck.runs == 1
