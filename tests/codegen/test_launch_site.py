"""The launch-site cache: a compiled kernel is reused only for arguments that specialize alike."""
import torch

from kiln.runtime import launch


class Kernel:
    """Stands for a JITFunction: the site is kept as an attribute of the kernel."""


class FakeCompiled:
    function, packed_metadata = 0, None

    def __init__(self):
        self.runs = 0

    def run(self, *args):
        self.runs += 1


class Driver:
    """Stand-ins for the CUDA driver's functions (``launch.Sites``): device 0, stream 0, no hooks, and
    a general path that records its calls and returns ``ck``."""

    def __init__(self, ck=None):
        self.slow, self.ck, self.dev = [], ck or FakeCompiled(), 0
        self.c_ok = False

    def general(self, kernel, grid, args, consts, warps):
        self.slow.append(args)
        return self.ck

    def sites(self):
        return launch.Sites(lambda: self.dev, lambda dev: 0, lambda: False, self.general, lambda: self.c_ok)


def test_site_reuses_the_kernel_for_aligned_tensors_and_generic_seeds():
    d = Driver()
    sites, kernel, buf = d.sites(), Kernel(), torch.empty(64)
    sites.launch(kernel, (buf, buf, 12345), (4,), (16,), 4)    # first call: the general path
    sites.launch(kernel, (buf, buf, 777), (4,), (16,), 4)      # then the site
    assert len(d.slow) == 1 and d.ck.runs == 1


def test_site_falls_back_for_misaligned_tensors_and_special_integers():
    d = Driver()
    sites, kernel, buf = d.sites(), Kernel(), torch.empty(64)
    sites.launch(kernel, (buf, 12345), (4,), (16,), 4)
    sites.launch(kernel, (buf[1:], 12345), (4,), (16,), 4)   # 4 bytes off alignment
    sites.launch(kernel, (buf, 32), (4,), (16,), 4)          # a seed divisible by 16
    sites.launch(kernel, (buf, 1), (4,), (16,), 4)           # a seed equal to 1
    assert len(d.slow) == 4 and d.ck.runs == 0


def test_no_site_is_made_from_a_misaligned_first_call():
    d = Driver()
    sites, kernel, buf = d.sites(), Kernel(), torch.empty(64)
    sites.launch(kernel, (buf[1:],), (4,), (16,), 4)
    sites.launch(kernel, (buf,), (4,), (16,), 4)
    assert len(d.slow) == 2 and d.ck.runs == 0
    sites.launch(kernel, (buf,), (4,), (16,), 4)
    assert d.ck.runs == 1


def test_a_site_is_bound_to_its_device():
    d = Driver()
    sites, kernel, buf = d.sites(), Kernel(), torch.empty(64)
    sites.launch(kernel, (buf,), (4,), (16,), 4)
    d.dev = 1      # the same kernel launched on another GPU
    sites.launch(kernel, (buf,), (4,), (16,), 4)
    assert len(d.slow) == 2 and d.ck.runs == 0


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


def test_site_calls_the_c_launcher_with_its_argument_layout():
    ck = FakeCompiled()
    ck.run, ck.function, ck.packed_metadata = FakeCLauncher(), 77, (4, 1, 0)
    d = Driver(ck)
    d.c_ok = True
    sites, kernel, buf = d.sites(), Kernel(), torch.empty(64)
    sites.launch(kernel, (buf, 12345), (3,), (16,), 4)
    sites.launch(kernel, (buf, 777), (3,), (16,), 4)
    assert len(d.slow) == 1
    # grid, stream, function, cooperative, pdl, scratch x2, metadata, launch metadata, hooks x2, args
    assert ck.run.calls == [(3, 1, 1, 0, 77, False, False, None, None, (4, 1, 0), None, None, None, buf, 777, 16)]


def test_scratch_memory_keeps_the_python_launcher():
    ck = FakeCompiled()
    ck.run = FakeCLauncher()
    ck.run.global_scratch_size = 128
    d = Driver(ck)
    d.c_ok = True
    fn, head, pm = d.sites().launcher(ck)
    assert fn is not ck.run.launch and head == (ck.function,)
