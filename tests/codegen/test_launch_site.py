"""The launch-site cache: a compiled kernel is reused only for arguments that specialize alike."""
import torch

from kiln.codegen import launch


class Kernel:
    """Stands for a JITFunction: the site is kept as an attribute of the kernel."""


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
    monkeypatch.setattr(launch, "_device", lambda: 0)
    monkeypatch.setattr(launch, "_stream_of", lambda dev: 0)
    monkeypatch.setattr(launch, "_hooks_on", lambda: False)
    return slow, ck


def test_site_reuses_the_kernel_for_aligned_tensors_and_generic_seeds(monkeypatch):
    slow, ck = _setup(monkeypatch)
    kernel = Kernel()
    buf = torch.empty(64)
    launch.launch(kernel, (buf, buf, 12345), (4,), (16,), 4)    # first call: the general path
    launch.launch(kernel, (buf, buf, 777), (4,), (16,), 4)      # then the site
    assert len(slow) == 1 and ck.runs == 1


def test_site_falls_back_for_misaligned_tensors_and_special_integers(monkeypatch):
    slow, ck = _setup(monkeypatch)
    kernel = Kernel()
    buf = torch.empty(64)
    launch.launch(kernel, (buf, 12345), (4,), (16,), 4)
    launch.launch(kernel, (buf[1:], 12345), (4,), (16,), 4)   # 4 bytes off alignment
    launch.launch(kernel, (buf, 32), (4,), (16,), 4)          # a seed divisible by 16
    launch.launch(kernel, (buf, 1), (4,), (16,), 4)           # a seed equal to 1
    assert len(slow) == 4 and ck.runs == 0


def test_no_site_is_made_from_a_misaligned_first_call(monkeypatch):
    slow, ck = _setup(monkeypatch)
    kernel = Kernel()
    buf = torch.empty(64)
    launch.launch(kernel, (buf[1:],), (4,), (16,), 4)
    launch.launch(kernel, (buf,), (4,), (16,), 4)
    assert len(slow) == 2 and ck.runs == 0
    launch.launch(kernel, (buf,), (4,), (16,), 4)
    assert ck.runs == 1


def test_a_site_is_bound_to_its_device(monkeypatch):
    slow, ck = _setup(monkeypatch)
    kernel = Kernel()
    buf = torch.empty(64)
    launch.launch(kernel, (buf,), (4,), (16,), 4)
    monkeypatch.setattr(launch, "_device", lambda: 1)      # the same kernel launched on another GPU
    launch.launch(kernel, (buf,), (4,), (16,), 4)
    assert len(slow) == 2 and ck.runs == 0


class FakeCLauncher:
    """Triton 3.6's CudaLauncher: a C ``launch`` plus the fields its Python ``__call__`` reads."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, False

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)

    def __call__(self, *args):
        raise AssertionError("the site should call the C launcher directly")


def test_site_calls_the_c_launcher_with_its_argument_layout(monkeypatch):
    slow, _ = _setup(monkeypatch)
    monkeypatch.setattr(launch, "_c_launcher_ok", lambda: True)
    ck = FakeCompiled()
    ck.run, ck.function, ck.packed_metadata = FakeCLauncher(), 77, (4, 1, 0)
    monkeypatch.setattr(launch, "_launch", lambda *a: slow.append(a) or ck)
    kernel = Kernel()
    buf = torch.empty(64)
    launch.launch(kernel, (buf, 12345), (3,), (16,), 4)
    launch.launch(kernel, (buf, 777), (3,), (16,), 4)
    assert len(slow) == 1
    # grid, stream, function, cooperative, pdl, scratch x2, metadata, launch metadata, hooks x2, args
    assert ck.run.calls == [(3, 1, 1, 0, 77, False, False, None, None, (4, 1, 0), None, None, None, buf, 777, 16)]


def test_scratch_memory_keeps_the_python_launcher(monkeypatch):
    slow, _ = _setup(monkeypatch)
    ck = FakeCompiled()
    ck.run = FakeCLauncher()
    ck.run.global_scratch_size = 128
    fn, head, pm = launch._launcher(ck)
    assert fn is not ck.run.launch and head == (ck.function,)
