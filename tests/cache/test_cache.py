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


def test_a_graph_gone_dynamic_hits_at_other_sizes(tmp_path):
    """A training graph that went dynamic on the batch at size 5 serves a later compile that goes dynamic at 9
    (the bench's check pass, then its timed pass): the key holds Dynamo's symbolic sizes, not the example
    tensors' (a resnet18 compiled again for 23 s on the H200, #35)."""
    m = _model()
    for sizes, hits in (((4, 5), 0), ((4, 9, 3), 2)):
        torch._dynamo.reset()
        f = kiln.compile(m, codegen="aten", **_cache(tmp_path))
        for n in sizes:
            x = torch.full((n, 16), 0.5)
            f(x).sum().backward()
            grads = [p.grad.clone() for p in m.parameters()]
            m.zero_grad()
            m(x).sum().backward()
            assert all(torch.allclose(a, p.grad) for a, p in zip(grads, m.parameters()))
            m.zero_grad()
        assert (_count("miss"), _count("hit")) == (2, hits), (sizes, kiln.counters["cache"])


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

    def plain(graph):   # without uuid(): a helper it calls could change behind the same source
        pass
    _train_step(m, x, codegen="aten", post_grad_custom_pre_pass=plain, **_cache(tmp_path))
    assert (_count("miss"), _count("hit"), _count("bypass")) == (5, 1, 1)


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
    assert sorted(os.path.basename(p) for p, _, _ in store.entries(root)) == ["kiln_k3.kiln", "kiln_k4.kiln"]
    assert store.read(root, "k4")[0] == bytes(1000)
    assert store.clear(root) == 2 and store.info(root)["entries"] == 0


def test_the_cache_deletes_only_files_it_named(tmp_path):
    """#32 item 7: a cache directory holding other files (``cache_dir=$PWD`` passes the directory check)
    keeps them through stores, eviction and ``kiln cache clear``; kiln's own stale temporary files go."""
    project = tmp_path / "project"
    project.mkdir(mode=0o755)
    theirs = {"notes.tmp": b"draft", "data.kiln": b"user data", "k1.kiln": b"x", "report.txt": b"r"}
    for name, data in theirs.items():
        (project / name).write_bytes(data)
    stale = project / "kiln_dead.tmp"
    stale.write_bytes(b"")
    for p in [project / "notes.tmp", stale]:
        os.utime(p, (1000, 1000))   # hours old
    root = store.directory(project)
    store.write(root, "k1", bytes(100))
    store.write(root, "k2", bytes(100))
    assert store.evict(root, 300) == 1 and not stale.exists()
    assert store.clear(root) == 1 and store.info(root)["entries"] == 0
    for name, data in theirs.items():
        assert (project / name).read_bytes() == data, name


def test_an_entry_signed_with_another_key_is_not_loaded(tmp_path):
    """#32 item 4: entries are authenticated (HMAC under the directory's key), not only hashed: an entry
    someone else wrote, whole and well formed, is refused, deleted and compiled again."""
    mine, theirs = store.directory(tmp_path / "mine"), store.directory(tmp_path / "theirs")
    store.write(theirs, "k", b"payload of theirs")
    assert store.read(theirs, "k") == (b"payload of theirs", None)
    os.replace(store.entry_path(theirs, "k"), store.entry_path(mine, "k"))
    payload, why = store.read(mine, "k")
    assert payload is None and "MAC" in why and not os.path.exists(store.entry_path(mine, "k"))
    assert stat.S_IMODE(os.stat(os.path.join(mine, "kiln_secret.key")).st_mode) == 0o600


def _read_only_dir(tmp_path):
    """A directory of this user's that takes no new file (for root, whom modes do not stop: /proc's)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    return str(ro) if not os.access(ro, os.W_OK) else "/proc/self/fdinfo"


def test_read_only_cache_dir_warns_once_and_info_says_why(tmp_path, capsys):
    ro = _read_only_dir(tmp_path)
    m, x = _model(), torch.randn(8, 16)
    with pytest.warns(UserWarning, match=r"compile cache disabled: .*takes no new file.*cache_dir \(KILN_CACHE_DIR\)"):
        _train_step(m, x, codegen="aten", cache=True, cache_dir=ro)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # one warning, not one per graph
        _, stages = _train_step(m, x, codegen="aten", cache=True, cache_dir=ro)
    assert stages and _count("off") == 2 and _count("saved") == 0
    from kiln.cli import main
    with kiln.config.patch(cache_dir=ro):
        assert main(["cache", "info"]) == 0
        assert main(["cache", "clear"]) == 1
    out = capsys.readouterr().out
    assert f"directory: {ro}" in out and "enabled:   no: directory not usable" in out and "takes no new file" in out
    assert "kernels:" in out


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
