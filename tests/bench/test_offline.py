"""kiln_bench.offline on a micro case: the GPU pipeline on meta tensors, no GPU needed."""
import os

from kiln_bench import offline


def test_offline_softmax_emits_the_gpu_kernels(tmp_path):
    """The softmax micro case (8192x8192 fp32, forward and backward) compiled for CUDA on meta tensors:
    the forward's max and sum share one online loop, the re-read rows get L2 policies, and the masks
    over the block-aligned sizes are constant."""
    out = tmp_path / "src"
    offline.main(["softmax", "--sources", str(out), "--set", "pad_matmuls=always"])
    texts = [open(os.path.join(out, f)).read() for f in os.listdir(out) if f.endswith(".py")]
    kernels = [t for t in texts if "@triton.jit" in t]
    assert len(kernels) == 2, [t[:200] for t in texts]
    assert any("tl.maximum(_acc" in k and "* tl.exp((_acc" in k for k in kernels)
    assert all("evict_last" in k and "evict_first" in k for k in kernels)
    assert all("tl.full([1, RBLOCK], True, tl.int1)" in k for k in kernels)


def test_option_values_from_the_command_line():
    """``--set`` reads a value as the type of the option's default, as the environment does."""
    import pytest

    from kiln.options import OptionError, parse_value
    assert parse_value("pad_matmuls", "always") == "always"
    assert parse_value("freezing", "True") is True and parse_value("freezing", "false") is False
    assert parse_value("compile_workers", "3") == 3 and parse_value("activation_memory_budget", "0.5") == 0.5
    with pytest.raises(OptionError, match="unknown kiln option"):
        parse_value("no_such_option", "1")
