"""The freezing pipeline (kiln/passes/freeze.py): what freezes, statistics, discarding."""
import pytest
import torch
from torch import nn

import kiln
from kiln.passes import freeze
from tests.freezing.helpers import ConvBN, compiled, randomize_bn


@pytest.fixture(autouse=True)
def _clear():
    kiln.counters.clear()


class LinearMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.register_buffer("scale", torch.rand(6) + 0.5)

    def forward(self, x):
        return self.lin(x) * self.scale


def _frozen_compiles():
    """A scope collecting one entry per frozen region compiled in it (the pipeline's 'freeze' stage)."""
    seen = []
    return seen, kiln.debug.observe(lambda event, data: seen.append(1) if event == "graph"
                                    and data["stage"] == "freeze" else None)


def test_statistics_in_counters_and_debug_log(capsys):
    mod = randomize_bn(ConvBN(3, 8, kernel_size=3)).eval()
    x = torch.rand(2, 3, 8, 8)
    with torch.no_grad(), kiln.config.patch(freezing=True, debug=2):
        ref = mod(x)
        out = compiled(lambda m, x: m(x))(mod, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    c = kiln.counters["kiln"]
    assert c["frozen_params"] == 5 and c["conv_bn_folded"] == 1 and c["frozen_constants"] == 2
    err = capsys.readouterr().err
    assert "freezing: 5 params frozen" in err and "1 conv-bn folds" in err
    assert "# after: conv_bn" in err  # each freezing pass shows its graph at level 2


def test_binary_fold_end_to_end():
    mod = LinearMul().eval()
    x = torch.randn(4, 8)
    with torch.no_grad(), kiln.config.patch(freezing=True):
        ref = mod(x)
        out, code = kiln.run_and_get_code(compiled(lambda m, x: m(x)), mod, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert kiln.counters["kiln"]["binary_folded"] == 1
    assert "aten_mul" not in code[-1]


def test_not_frozen_without_the_option_or_with_grad():
    mod = LinearMul().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        compiled(lambda m, x: m(x))(mod, x)
    with kiln.config.patch(freezing=True):
        compiled(lambda m, x: m(x) + 1)(mod, x)
    assert kiln.counters["kiln"]["frozen_params"] == 0


def test_training_bn_under_no_grad_updates_buffers():
    """BatchNorm in train mode mutates its running statistics: those stay inputs, the rest freezes."""
    ref_mod = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    mod = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    mod.load_state_dict(ref_mod.state_dict())
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad(), kiln.config.patch(freezing=True, freezing_discard_parameters=True):
        ref = ref_mod(x)
        out = compiled(lambda m, x: m(x))(mod, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mod[1].running_mean, ref_mod[1].running_mean)
    torch.testing.assert_close(mod[1].running_var, ref_mod[1].running_var)
    assert 0 < kiln.counters["kiln"]["frozen_params"] < 6


def test_without_discard_the_eager_module_still_works():
    mod = randomize_bn(ConvBN(3, 8, kernel_size=3)).eval()
    x = torch.rand(2, 3, 8, 8)
    with torch.no_grad(), kiln.config.patch(freezing=True):
        out = compiled(lambda m, x: m(x))(mod, x)
        torch.testing.assert_close(mod(x), out, atol=1e-5, rtol=1e-5)


def test_discard_compiles_once_and_keeps_working():
    seen, watching = _frozen_compiles()
    mod = randomize_bn(ConvBN(3, 8, kernel_size=3)).eval()
    xs = [torch.rand(2, 3, 8, 8) for _ in range(3)]
    with torch.no_grad():
        refs = [mod(x) for x in xs]
    foo = compiled(lambda m, x: m(x))
    with torch.no_grad(), kiln.config.patch(freezing=True, freezing_discard_parameters=True), watching:
        outs = [foo(mod, x) for x in xs]
    torch.testing.assert_close(outs, refs, atol=1e-5, rtol=1e-5)
    assert len(seen) == 1
    assert isinstance(mod.conv.weight, freeze.ErasedTensor) and isinstance(mod.conv.weight, nn.Parameter)
    assert "ErasedTensor(Conv2d.weight" in repr(mod.conv.weight)


def test_discard_parameters_swaps_every_holder():
    shared = nn.Parameter(torch.randn(3))
    a, b = nn.Linear(3, 3), nn.Module()
    b.register_parameter("p", shared)
    a.extra = shared  # a plain attribute holding the same tensor
    b.register_buffer("buf", torch.ones(2))
    assert freeze.discard_parameters([shared, b.buf]) == 3
    assert isinstance(b.p, freeze.ErasedTensor) and isinstance(a.extra, freeze.ErasedTensor)
    with pytest.raises(RuntimeError, match="Trying to run Pytorch Eager Module after Dynamo Freezing"):
        b.p + 1
    with pytest.raises(RuntimeError, match="freezing_discard_parameters=False"):
        b.buf.sum()


def test_graph_without_module_state_compiles_normally(capsys):
    with torch.no_grad(), kiln.config.patch(freezing=True, debug=1):
        out = compiled(lambda x: x.sin() * 2)(torch.ones(3))
    torch.testing.assert_close(out, torch.ones(3).sin() * 2)
    assert "no parameters or buffers in this graph" in capsys.readouterr().err


def test_cpu_convolutions_are_prepacked_when_mkldnn_is_there():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs mkldnn")
    pytest.importorskip("kiln.passes.patterns.mkldnn")
    mod = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    x = torch.rand(1, 3, 8, 8)
    with torch.no_grad(), kiln.config.patch(freezing=True):
        ref = mod(x)
        out, code = kiln.run_and_get_code(compiled(lambda m, x: m(x)), mod, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert "mkldnn__convolution_pointwise" in code[-1]
