"""Freezing is per module instance (issue 32, item 2): two instances of one class share Dynamo's compiled
frame (a parameter input is guarded by shape, not identity), so a frozen graph must not serve the other
instance with its own weights. And a training graph that asks for freezing says that it froze nothing."""
import warnings

import pytest
import torch
from torch import nn

import kiln
from tests.freezing.helpers import DEVICES, compiled, cuda_ok, randomize_bn


@pytest.fixture(autouse=True)
def _clear():
    kiln.counters.clear()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x))) * 2


def _nets(n):
    """``n`` eval-mode instances of one class, each with weights and statistics of its own."""
    nets = []
    for i in range(n):
        torch.manual_seed(i)
        nets.append(randomize_bn(Net()).eval())
        with torch.no_grad():
            nets[-1].bn.running_mean.normal_()
    return nets


def _alternate(calls, nets, x, rounds=3):
    """Call each compiled instance in turn, ``rounds`` times; every output must be its own eager one's."""
    with torch.no_grad():
        refs = [m(x) for m in nets]
        for _ in range(rounds):
            for call, ref in zip(calls, refs):
                torch.testing.assert_close(call(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_options_form_each_instance_its_own_weights(device):
    cuda_ok(device)
    nets, x = [m.to(device) for m in _nets(2)], torch.randn(4, 8, device=device)
    calls = [torch.compile(m, backend="kiln", options={"freezing": True}) for m in nets]
    _alternate(calls, nets, x)
    assert kiln.counters["kiln"]["frozen_params"] == 2 * 6   # each instance froze its own, once


@pytest.mark.parametrize("discard", [False, True], ids=["keep", "discard"])
def test_config_patch_form_each_instance_its_own_weights(discard):
    nets, x = _nets(2), torch.randn(4, 8)
    with torch.no_grad():
        refs = [m(x) for m in nets]
    calls = [torch.compile(m, backend="kiln") for m in nets]
    with kiln.config.patch(freezing=True, freezing_discard_parameters=discard), torch.no_grad():
        for _ in range(3):
            for call, ref in zip(calls, refs):
                torch.testing.assert_close(call(x), ref, atol=1e-5, rtol=1e-5)
    assert kiln.counters["kiln"]["frozen_params"] == 2 * 6


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "no_inline"])
def test_one_compiled_function_over_two_modules(inline):
    """One compiled function (one backend object: ``kiln.compile``'s too) called with either module."""
    nets, x = _nets(2), torch.randn(4, 8)
    fn = kiln.compile(lambda m, x: m(x), freezing=True)
    with torch._dynamo.config.patch(inline_inbuilt_nn_modules=inline):
        _alternate([lambda x, m=m: fn(m, x) for m in nets], nets, x)


def test_more_instances_than_the_recompile_limit():
    """Each instance's frozen frame counts against Dynamo's limit per module object: none runs eager."""
    nets, x = _nets(3), torch.randn(4, 8)
    calls = [torch.compile(m, backend="kiln", options={"freezing": True}) for m in nets]
    with torch._dynamo.config.patch(recompile_limit=2):
        _alternate(calls, nets, x, rounds=2)
    assert kiln.counters["kiln"]["frozen_params"] == 3 * 6


def test_a_replaced_parameter_recompiles_an_in_place_update_does_not():
    (net,), x = _nets(1), torch.randn(4, 8)
    call = torch.compile(net, backend="kiln", options={"freezing": True})
    _alternate([call], [net], x, rounds=1)
    net.lin.weight = nn.Parameter(torch.randn(6, 8))   # a new tensor: Dynamo's identity guard fails
    _alternate([call], [net], x, rounds=1)
    assert kiln.counters["kiln"]["frozen_params"] == 2 * 6
    with torch.no_grad():
        before = call(x)
        net.bn.running_var.mul_(4)   # in place: the frozen graph keeps the old (folded) statistics
        torch.testing.assert_close(call(x), before)
        assert not torch.allclose(net(x), before, atol=1e-3)
        torch.compiler.reset()   # as the README says: compile anew
        torch.testing.assert_close(call(x), net(x), atol=1e-5, rtol=1e-5)


def test_training_graph_warns_that_it_froze_nothing():
    (net,), x = _nets(1), torch.randn(4, 8)
    call = torch.compile(net.train(), backend="kiln", options={"freezing": True})
    with pytest.warns(UserWarning, match="froze nothing .* freezing applies to inference graphs only"):
        call(x).sum().backward()
    assert kiln.counters["kiln"]["frozen_params"] == 0
    assert kiln.counters["kiln"]["freezing_skipped_training"] == 1
    net.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # an inference graph: frozen, no warning
        with torch.no_grad():
            torch.testing.assert_close(call(x), net(x), atol=1e-5, rtol=1e-5)
    assert kiln.counters["kiln"]["frozen_params"] == 6


def test_a_graph_without_freezing_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = compiled(lambda x: x.sin() * 2)(torch.ones(3, requires_grad=True))
    torch.testing.assert_close(out, torch.ones(3).sin() * 2)


def test_a_module_passed_in_a_tuple_compiles_once():
    """Only a local that is the module itself gets an identity guard: a module inside ``*args`` (a new
    tuple at every call) is guarded through its parameters, so calls do not recompile."""
    nets, x = _nets(2), torch.randn(4, 8)
    fn = torch.compile(lambda *a: a[0](a[1]), backend="kiln", options={"freezing": True})
    _alternate([lambda x, m=m: fn(m, x) for m in nets], nets, x)
    assert kiln.counters["kiln"]["frozen_params"] == 2 * 6
