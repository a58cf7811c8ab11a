"""The compile cache (kiln/cache): hits skip the compile and give bitwise-equal results, in this process
after ``torch._dynamo.reset()`` and in new processes; damaged entries are rebuilt; processes fill one
cache at once; the directory is private; what changes a compile changes the key."""
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln
from kiln import debug
from kiln.cache import store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4))


def _train_step(model, x, **options):
    """Outputs and gradients of one compiled step, and the pipeline stages that ran after capture."""
    torch._dynamo.reset()
    stages = []
    f = kiln.compile(model, **options)
    model.zero_grad(set_to_none=True)
    with debug.observe(lambda event, data: stages.append(data.get("stage", event))):
        out = f(x)
        out.sum().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters()], [s for s in stages if s != "capture"]


def _cache(tmp_path, **more):
    return dict(cache=True, cache_dir=str(tmp_path / "cache"), **more)


def _count(key):
    return kiln.counters["cache"][key]


@pytest.fixture(autouse=True)
def _counters():
    kiln.counters["cache"].clear()
    yield


@pytest.mark.parametrize("codegen", ["aten", "cpp", "triton"])
def test_hit_skips_the_compile_and_is_bitwise_equal(tmp_path, codegen):
    m, x = _model(), torch.randn(8, 16)
    first, stages = _train_step(m, x, codegen=codegen, **_cache(tmp_path))
    assert (_count("miss"), _count("saved"), _count("hit")) == (1, 1, 0)
    assert stages, "a miss runs the pipeline"
    again, stages = _train_step(m, x, codegen=codegen, **_cache(tmp_path))
    assert _count("hit") == 1 and not stages, "a hit runs no stage of the pipeline"
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len(first) == 1 + len(list(m.parameters()))


def test_inference_and_dynamic_shapes_hit(tmp_path):
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1) * x.shape[0]
    w = torch.randn(16, 8)
    results = []
    for _ in range(2):
        torch._dynamo.reset()
        g = kiln.compile(f, dynamic=True, **_cache(tmp_path))
        with torch.no_grad():
            results.append([g(torch.ones(n, 16), w) for n in (3, 5, 9)])
    assert (_count("miss"), _count("hit")) == (1, 1)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert [r.shape[0] for r in results[1]] == [3, 5, 9]


def test_changed_option_or_pass_misses(tmp_path):
    m, x = _model(), torch.randn(8, 16)
    _train_step(m, x, codegen="aten", **_cache(tmp_path))
    _train_step(m, x, codegen="aten", activation_memory_budget=0.5, **_cache(tmp_path))
    assert (_count("miss"), _count("hit")) == (2, 0)
    _train_step(m, x, codegen="aten", **{"tuning.persistent_max": 64}, **_cache(tmp_path))
    assert _count("miss") == 3

    class Noop:   # a custom pass keyed by its uuid
        def __init__(self, v):
            self.v = v

        def __call__(self, graph):
            pass

        def uuid(self):
            return self.v
    _train_step(m, x, codegen="aten", joint_custom_post_pass=Noop("a"), **_cache(tmp_path))
    _train_step(m, x, codegen="aten", joint_custom_post_pass=Noop("a"), **_cache(tmp_path))
    _train_step(m, x, codegen="aten", joint_custom_post_pass=Noop("b"), **_cache(tmp_path))
    assert (_count("miss"), _count("hit")) == (5, 1)

    def plain(graph):   # a plain function is keyed by its source
        pass
    _train_step(m, x, codegen="aten", post_grad_custom_pre_pass=plain, **_cache(tmp_path))
    _train_step(m, x, codegen="aten", post_grad_custom_pre_pass=plain, **_cache(tmp_path))
    assert (_count("miss"), _count("hit")) == (6, 2)
    scale = 2.0

    def closure(graph):   # its closure could differ between processes behind the same source
        return scale
    _train_step(m, x, codegen="aten", post_grad_custom_pre_pass=closure, **_cache(tmp_path))
    assert (_count("miss"), _count("hit"), _count("bypass")) == (6, 2, 1)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_entry_is_rebuilt_not_loaded(tmp_path, damage):
    m, x = _model(), torch.randn(8, 16)
    first, _ = _train_step(m, x, codegen="cpp", **_cache(tmp_path))
    (path,) = [p for p, _, _ in store.entries(str(tmp_path / "cache"))]
    data = open(path, "rb").read()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data = data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:]
    else:
        data = b"not a cache entry at all"
    open(path, "wb").write(data)
    again, stages = _train_step(m, x, codegen="cpp", **_cache(tmp_path))
    assert _count("damaged") == 1 and _count("hit") == 0 and stages, "a damaged entry compiles again"
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert _count("saved") == 2, "and is written again"
    _, stages = _train_step(m, x, codegen="cpp", **_cache(tmp_path))
    assert _count("hit") == 1 and not stages


def test_directory_is_private(tmp_path):
    root = store.directory(tmp_path / "new" / "cache")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(store.CacheDirError, match="writable by other users"):
        store.directory(shared)
    m, x = _model(), torch.randn(8, 16)
    with pytest.warns(UserWarning, match="compile cache disabled"):
        out, stages = _train_step(m, x, codegen="aten", cache=True, cache_dir=str(shared))
    assert stages and not os.listdir(shared), "the compile goes on without the cache"


def test_eviction_keeps_the_newest(tmp_path):
    root = store.directory(tmp_path / "c")
    for i in range(5):
        store.write(root, f"k{i}", bytes(1000))
        os.utime(store.entry_path(root, f"k{i}"), (1000 + i, 1000 + i))
    assert store.evict(root, 2500) == 3
    assert sorted(os.path.basename(p) for p, _, _ in store.entries(root)) == ["k3.kiln", "k4.kiln"]
    assert store.read(root, "k4")[0] == bytes(1000)
    assert store.clear(root) == 2 and store.info(root)["entries"] == 0


def test_not_cacheable_graphs_compile_as_usual(tmp_path):
    m = _model().eval()
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    f = kiln.compile(m, freezing=True, **_cache(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x))
    assert _count("bypass") == 1 and _count("saved") == 0


_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, kiln
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    f = kiln.compile(m, codegen="cpp", cache=True, cache_dir=sys.argv[1])
    gate, n = sys.argv[3], int(sys.argv[4])   # a start barrier: the processes look up the cache together
    open(os.path.join(gate, str(os.getpid())), "w").close()
    deadline = time.time() + 120
    while len(os.listdir(gate)) < n and time.time() < deadline:
        time.sleep(0.01)
    out = f(x)
    out.sum().backward()
    torch.save([out.detach()] + [p.grad for p in m.parameters()], sys.argv[2])
    c = kiln.counters["cache"]
    print("COUNTS", c["hit"], c["miss"], c["saved"], kiln.counters["codegen"]["cpp_builds"])
""")


def test_processes_fill_one_cache_then_hit(tmp_path):
    """Two processes start on an empty cache at once (both miss and write the same entry); a third
    process, with an empty kernel directory (/tmp emptied by a reboot), hits without running the C++
    compiler, with results bitwise equal to theirs."""
    script = tmp_path / "step.py"
    script.write_text(_SCRIPT)
    cache = str(tmp_path / "cache")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("KILN_CACHE", None)

    def start(i):
        env["KILN_KERNEL_DIR"] = str(tmp_path / f"kernels{i // 2}")
        gate = tmp_path / f"gate{i // 2}"
        gate.mkdir(exist_ok=True)
        return subprocess.Popen([sys.executable, str(script), cache, str(tmp_path / f"r{i}.pt"), str(gate),
                                 "2" if i < 2 else "1"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(p):
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        return tuple(int(v) for v in out.split("COUNTS")[1].split())

    both = [start(0), start(1)]
    counts = [finish(p) for p in both]
    assert all(c[0] == 0 for c in counts) and all(c[2] == 1 for c in counts), counts
    assert finish(start(2)) == (1, 0, 0, 0)
    results = [torch.load(tmp_path / f"r{i}.pt") for i in range(3)]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))
    assert len(store.entries(cache)) == 1 and not [n for n in os.listdir(cache) if n.endswith(".tmp")]


def test_a_compiled_function_keeps_no_example_input_alive(tmp_path):
    """The cache's session lives as long as the compiled function (the lazy backward compile records into
    it); it must not hold the first call's tensors: on the GPU those were a step's logits, alive for good."""
    import gc
    import weakref

    torch._dynamo.reset()
    f = kiln.compile(lambda x, w: torch.tanh(x @ w).sum(), **_cache(tmp_path))
    x, w = torch.randn(64, 16), torch.randn(16, 8, requires_grad=True)
    gone = weakref.ref(x)
    f(x, w).backward()
    assert _count("miss") == 1
    del x
    gc.collect()
    assert gone() is None
