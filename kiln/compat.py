"""Every difference between the torch versions kiln supports (2.11 to 2.14) is guarded here."""
import logging
import os
import re
import warnings

import torch

SUPPORTED_TORCH = ((2, 11), (2, 15))   # the torch versions kiln supports: from the first, up to the second


def check_torch_version(version: str = torch.__version__) -> bool:
    """Whether kiln supports torch ``version``; if not, warn naming it and the supported range."""
    (a, b), (c, d) = SUPPORTED_TORCH
    if (a, b) <= tuple(map(int, re.match(r"(\d+)\.(\d+)", version).groups())) < (c, d):   # '2.13.0+cpu': (2, 13)
        return True
    wanted = f"torch>={a}.{b},<{c}.{d}"
    warnings.warn(f"kiln supports {wanted} ({a}.{b} to {c}.{d - 1}); this is torch {version}: compiles may fail "
                  f"or differ from eager. Install a supported torch: pip install '{wanted}'", UserWarning, stacklevel=3)
    return False


def size_hint(s) -> int:
    """A concrete value for an int or SymInt without adding a guard."""
    if isinstance(s, int):
        return s
    try:  # torch >= 2.12
        from torch.fx.experimental.symbolic_shapes import optimization_hint
        return int(optimization_hint(s))
    except ImportError:
        pass
    node = getattr(s, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else int(node.shape_env.size_hint(node.expr))


def _reinterpret_fallback(t, size, stride, offset):
    return torch.as_strided(t, size, stride, t.storage_offset() + offset)


def reinterpret_fn():
    """``f(t, size, stride, offset)``: a view of ``t``'s storage ``offset`` elements past its start through
    torch's C++ helper (0.7 us against 2.5 for ``aten.view``), else ``torch.as_strided``."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    return getattr(guards, "_reinterpret_tensor", None) or _reinterpret_fallback


def empty_strided_fn(device: str = "cuda"):
    """``f(size, stride, dtype)`` on the current CUDA device (or the CPU), through torch's C++ helper (a third
    of ``empty_strided``'s time: no dispatcher, no argument parsing), else ``empty_strided``."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    return getattr(guards, f"_empty_strided_{device}", None) or \
        (lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device=device))


def triton_c_launcher_ok(version: str) -> bool:
    """Whether Triton's C launcher takes kiln's launch-site arguments (3.6's; others: the Python ``__call__``)."""
    return version.split(".")[:2] == ["3", "6"]


def aot_runtime_wrappers(fw, bw, meta, n_saved, n_symints, detach):
    """AOTAutograd's post-compile steps on ``fw`` and ``bw`` (None: inference) of a graph the cache accepts;
    returns the boxed callable. ``post_compile``'s spec is an object from torch 2.13 on, positional before."""
    import dataclasses
    from torch._functorch._aot_autograd import runtime_wrappers as rw
    from torch._functorch._aot_autograd.schemas import AOTConfig
    wanted = dict(fw_compiler=None, bw_compiler=None, inference_compiler=None, partition_fn=None, decompositions={},
                  num_params_buffers=0, aot_id=next(torch._functorch.aot_autograd.AOT_COUNTER),
                  keep_inference_input_mutations=True, dynamic_shapes=False, aot_autograd_arg_pos_to_source=None,
                  is_export=False, no_tangents=False, enable_log=False)
    names = {f.name for f in dataclasses.fields(AOTConfig)}
    config = AOTConfig(**{k: v for k, v in wanted.items() if k in names})
    training = bw is not None
    fw = rw.AOTDispatchSubclassWrapper(trace_joint=training, fw_only=None, maybe_subclass_meta=None,
                                       num_fw_outs_saved_for_bw=n_saved if training else None
                                       ).post_compile(fw, config, runtime_metadata=meta)
    fw = rw.FunctionalizedRngRuntimeWrapper(return_new_outs=not training).post_compile(
        fw, config, runtime_metadata=meta)
    fw._boxed_call = True
    disable_amp = torch._C._is_any_autocast_enabled()
    if not training:
        return rw.RuntimeWrapper(indices_of_inps_to_detach=detach, trace_joint=False, disable_amp=disable_amp
                                 ).post_compile(fw, config, runtime_metadata=meta)
    spec = dict(compiled_fw_func=fw, compiled_bw_func=bw, maybe_subclass_meta=None, num_symints_saved_for_bw=n_symints,
                backward_state_indices=[], disable_amp=disable_amp, indices_of_inps_to_detach=detach,
                lazy_backward_info=None, bw_compiler=None, aot_config=config, fw_metadata=meta,
                try_save_cache_entry=None)
    Spec = getattr(rw, "AOTDispatchAutogradCompileSpec", None)
    if Spec is not None:
        return rw.AOTDispatchAutograd.post_compile(Spec(**spec))
    spec.pop("bw_compiler")
    spec["num_symints_saved_for_bw_"] = spec.pop("num_symints_saved_for_bw")
    return rw.AOTDispatchAutograd.post_compile(**spec)


def aot_call(fn, *args, keep: bool):
    """``fn(*args)``, an AOTAutograd call; unless ``keep`` or TORCH_LOGS shows its graphs, its config has
    ``enable_log=False`` (``aot_module_simplified`` takes none): it does not ``print_readable`` graphs nobody reads."""
    from torch._functorch._aot_autograd import graph_compile as gc, utils
    aot, made = torch._functorch.aot_autograd, torch._functorch.aot_autograd.AOTConfig
    shown = [vars(gc).get("aot_graphs_log"), vars(gc).get("aot_joint_log"), vars(utils).get("aot_graphs_effects_log")]
    if not keep and not any(lg is None or lg.isEnabledFor(logging.INFO) for lg in shown):
        aot.AOTConfig = lambda *a, **k: made(*a, **{"enable_log": False, **k})
    try:
        return fn(*args)
    finally:
        aot.AOTConfig = made


def dynamo_frame_times() -> list:
    """Seconds of each Dynamo frame compile of this process: ``dynamo_timed``'s ``_compile.compile_inner``."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return []
    return list(compilation_time_metrics.get("_compile.compile_inner", ()))


def compile_debug_dir():
    """torch's debug folder of this process when ``TORCH_COMPILE_DEBUG=1``, else None."""
    if os.environ.get("TORCH_COMPILE_DEBUG", "0") != "1":
        return None
    from torch._dynamo.utils import get_debug_dir
    return get_debug_dir()
