"""kiln's options: one frozen dataclass, each field with a default, one line of help and ``KILN_<NAME>``.
``kiln.config.patch(**overrides)`` scopes overrides in a context variable (no module global, no leak between
threads). Tuning constants are the nested frozen ``Options.tuning``, named ``tuning.<name>`` everywhere:
``patch(tuning={"x": 1})``, ``KILN_TUNING_<NAME>``, ``--set tuning.<name>=V``, ``kiln options``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import inspect
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from kiln import compat


class UserError(Exception):
    """Base of the errors that name a mistake in what the user asked for (an option, a pass, a pattern, a
    memory limit): they always propagate. Any other error while a graph compiles makes kiln run that
    graph as eager does, with a warning (``on_error='eager'``, the default)."""


class OptionError(ValueError, UserError):
    """An option name or value is not valid; the message lists what is."""


class OptionTypeError(OptionError, TypeError):
    """An option's value has the wrong type; the message names the type expected and the one it got."""


def _opt(default, help, choices=None, env=True, cache=True, check=None):
    """A field: ``choices`` lists the valid values; ``check``: 'pos', 'nonneg', 'pow2', 'warps' (a power of two
    up to 32), a range (lo, hi), 'path'; ``cache``: whether the value changes what a compile produces."""
    return field(default=default, metadata={"help": help, "choices": choices, "env": env, "cache": cache,
                                            "check": check})


HOOK = (type(None), "callable")
TUNING = "tuning"
# a field's declared type -> (the types its values may have, how a message names it)
_TYPES = {"bool": ((bool,), "True or False"), "int": ((int,), "an integer"), "str": ((str,), "a str"),
          "float": ((int, float), "a number (float)"), "Optional[str]": ((str, type(None)), "a str or None"),
          "path": ((str, os.PathLike, type(None)), "a directory path (a str) or None")}


def _check_value(f, value, name):
    """Check ``value``'s type against ``f``'s declared type (OptionTypeError), then its choices and range."""
    choices, check = f.metadata.get("choices"), f.metadata.get("check")
    if name == "activation_memory_limit":
        if value is not None:
            parse_bytes(value)
        return
    if name == TUNING:
        if not isinstance(value, Tuning):
            raise OptionTypeError(f"tuning={value!r} must be a kiln.options.Tuning (or a dict of its fields in "
                                  f"Options.replace / config.patch), got {type(value).__name__}")
        return
    if choices is HOOK:
        ok, kind = value is None or callable(value), "None or a callable taking a torch.fx.Graph"
    elif choices is not None and "callable" in choices:
        ok, kind = isinstance(value, str) or callable(value), f"one of {list(choices[:-1])} or a callable"
    else:
        types, kind = _TYPES["path" if check == "path" else f.type]
        ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
        kind += f" (one of {list(choices)})" if choices else ""
    if not ok:
        raise OptionTypeError(f"{name}={value!r} must be {kind}, got {type(value).__name__}")
    if choices not in (None, HOOK) and value not in choices and not callable(value):
        raise OptionError(f"{name}={value!r} is not valid; choose one of {list(choices)}")
    if name == "compile_workers" and value < -1:
        raise OptionError(f"compile_workers={value!r}: use -1 (as many as suit the machine), 0 (off) or a "
                          f"number of processes")
    if isinstance(check, tuple) and not check[0] <= value <= check[1]:
        raise OptionError(f"{name}={value!r} is outside the valid range [{check[0]}, {check[1]}]")
    least = {"nonneg": 0, "pos": 1}.get(check)
    if least is not None and value < least:
        raise OptionError(f"{name}={value!r} must be at least {least}")
    if check in ("pow2", "warps") and (value < 1 or value & (value - 1)):
        raise OptionError(f"{name}={value!r} must be a power of two")
    if check == "warps" and value > 32:
        raise OptionError(f"{name}={value!r}: a kernel has at most 32 warps")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value) -> int:
    """'4GiB' -> 4294967296; an int passes through."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    s = value.strip().upper().replace(" ", "") if isinstance(value, str) else ""
    num = s.rstrip("KMGTIB")
    if num and s[len(num):] in _UNITS:
        try:
            amount = float(num) * _UNITS[s[len(num):]]
        except ValueError:
            amount = -1
        if math.isfinite(amount) and amount >= 0:
            return int(amount)
    raise (OptionError if type(value) in (int, str) else OptionTypeError)(
        f"activation_memory_limit={value!r} is not a byte count; use a non-negative int or a string like '4GiB' "
        f"or '512MB' (units: {sorted(k for k in _UNITS if k)}), got {type(value).__name__}")


@dataclass(frozen=True)
class Tuning:
    """Tuning constants of code generation and passes (``Options.tuning``): they change code, never results."""
    # kernel shapes (Triton)
    persistent_max: int = _opt(4096, "static rows up to this many elements stay in registers (a persistent row "
                                     "kernel); also the longest row a folded column reduction keeps", check="pos")
    outer_persistent_max: int = _opt(64, "... for reductions over a non-innermost dim: columns up to this long",
                                     check="pos")
    outer_max: int = _opt(1 << 18, "a row kernel reducing all its rows runs as one program up to this many "
                                   "elements; above, the last program to finish combines the partials", check="pos")
    parts_block: int = _opt(1024, "partial results the last program combines per step", check="pow2")
    pw_xblock: int = _opt(1024, "elements of a pointwise kernel's tile", check="pow2")
    pw_warps: int = _opt(8, "warps of a pointwise kernel (4-byte data)", check="warps")
    pw_warps_narrow: int = _opt(4, "warps of a pointwise kernel reading or writing 2-byte data", check="warps")
    outer_xblock: int = _opt(32, "columns of a column reduction's tile", check="pow2")
    outer_rblock: int = _opt(64, "rows of a column reduction's tile", check="pow2")
    outer_warps: int = _opt(16, "warps of a column reduction over 1024 rows or more", check="warps")
    xblock_max: int = _opt(1 << 14, "rows of any kernel's tile, at most (small: rows spread over many programs)",
                           check="pow2")
    even_masks: bool = _opt(True, "a mask over a static size that the block divides is constant-true")
    online_softmax: bool = _opt(True, "looped rows: a softmax's max and sum of exponentials in one pass")
    evict_policies: bool = _opt(True, "L2 eviction policies on loads of kernels with several row loops")
    evict_single_pass: bool = _opt(False, "also stream (evict_first) buffers a kernel reads in one pass only")
    # C++ kernels (codegen="cpp")
    cpp_parallel_min: int = _opt(32768, "C++ kernels run their rows on OpenMP threads from this many elements read on",
                                 check="nonneg")
    cpp_block: int = _opt(4096, "elements of a C++ pointwise kernel's vectorized block (a thread's unit of work)",
                          check="pos")
    cpp_min_inner: int = _opt(4, "a C++ pointwise kernel loops over its innermost dim apart (contiguous, no "
                                 "division per element) when it has at least this many elements (4: channels-last "
                                 "per-channel ops at 4-12 channels 1.5-3.6x faster than at 16)", check="pos")
    cpp_interior_min: int = _opt(8, "a C++ pointwise kernel whose innermost dim has bounds checks (a padded "
                                     "window's edges) runs the span where all hold, if this long, without them; "
                                     "0: never", check="nonneg")
    cpp_col_block: int = _opt(64, "adjacent columns a C++ reduction over a non-innermost dim reduces at once",
                              check="pos")
    cpp_outer_chunks: int = _opt(64, "chunks of rows whose partials a C++ reduction over all rows combines",
                                 check="pos")
    cpp_row_cache: int = _opt(16384, "a C++ reduction row of at most this many elements keeps the exponentials "
                                     "(vector math) one loop computes for the next loops; 0: never", check="nonneg")
    cpp_row_split: int = _opt(16, "a C++ reduction row read at r / K and r % K (NCHW BatchNorm: batch, pixels) "
                                  "loops over K contiguous elements inside when K is at least this; 0: never",
                              check="nonneg")
    cpp_double_columns: bool = _opt(True, "C++ float sums down a column (over rows) add in double, as accurate as "
                                          "eager's cascaded sums")
    cpp_vector_math: bool = _opt(True, "C++ kernels call glibc's vector math (libmvec) where no comparison, "
                                       "rounding or max depends on the result (false: scalar math everywhere, "
                                       "the same bits in every kernel)")
    flex_decode_q: int = _opt(16, "FlexAttention (Triton): queries of at most this many tokens over a long key/value "
                                  "cache run the split-KV decoding kernels; 0: never", check="nonneg")
    # reductions split in two kernels
    split_min_r: int = _opt(4096, "split a reduction only when its rows are at least this long ...", check="pos")
    split_min_numel: int = _opt(1 << 20, "... and it reads at least this many elements", check="pos")
    split_min_chunk: int = _opt(1024, "elements of a row each partial of a split reduction reduces, at least",
                                check="pos")
    split_min_chunk_outer: int = _opt(512, "... of a column (H200, GPT-2's layer norm backward: 512 best)", check="pos")
    split_max_rows: int = _opt(16, "inner reductions with more rows than this are never split", check="nonneg")
    split_target_inner: int = _opt(1024, "rows x chunks a split inner reduction aims at", check="pos")
    split_target_outer: int = _opt(8192, "columns x chunks a split column reduction aims at", check="pos")
    # column reductions folded into row kernels
    fold: str = _opt("shared", "fold column reductions of short rows into the row kernel reading the rows: "
                              "'shared' (where a row reduction there reads a buffer they read), 'always', 'never'",
                     ("shared", "always", "never"))
    fold_programs: int = _opt(256, "programs (row chunks) of a folded column reduction, at most", check="pow2")
    fold_min_chunk: int = _opt(16, "rows each program of a folded column reduction reduces, at least", check="pos")
    fold_min_r: int = _opt(0, "fold column reductions of this many rows or more, whatever their size; 0: where a "
                              "split would pay (split_min_r, split_min_numel), on C++ at any size", check="nonneg")
    # chained kernels
    chain: bool = _opt(True, "run a small kernel that reads one kernel's results in that kernel's last program")
    tail_max: int = _opt(1 << 16, "elements a chained tail may reduce or write", check="pos")
    tail_tile: int = _opt(4096, "elements of a reducing chained tail's tile on the GPU", check="pow2")
    # grouped kernels
    group_kernels: bool = _opt(True, "launch independent pointwise kernels as one (Triton): those reading graph "
                                     "inputs only (a training step's weight casts), and those whose results only "
                                     "the graph returns (its gradients' casts)")
    group_max: int = _opt(16, "kernels per grouped kernel, at most", check="pos")
    group_live_bytes: int = _opt(32 << 20, "bytes a grouped kernel keeps alive beyond its members' own kernels, at "
                                           "most (results made early, inputs freed late)", check="nonneg")
    # fusion
    max_group: int = _opt(64, "buffers per kernel, at most", check="pos")
    near: int = _opt(32, "graph nodes between a kernel's members, at most (see schedule's _far rule)", check="pos")
    cheap_ops: int = _opt(8, "a pointwise value read by several users is recomputed in each when it has at "
                             "most this many ops, else stored", check="nonneg")
    cheap_loads: int = _opt(1 << 30, "... and reads at most this many buffers at every element (a residual stream "
                                     "over many layers reads them all), in forward and backward graphs", check="nonneg")
    cheap_loads_inference: int = _opt(2, "cheap_loads in inference graphs, where each layer's output dies once read: "
                                         "recomputing a residual stream from them keeps them all alive", check="nonneg")
    remat_max_reads: int = _opt(4, "the partition's default cut saves a value whose recompute would read more than "
                                   "this many saved tensors of half its size or more (a residual stream summed "
                                   "again from every block's outputs)", check="pos")
    fuse_stored_views: bool = _opt(True, "read views of stored tensors inside kernels (else ATen views)")
    reuse_inputs: bool = _opt(True, "a kernel may write its output into an input that dies at the call")
    merge_updates: int = _opt(4096, "merge pointwise kernels over one domain of at most this many elements whose "
                                    "outputs all update graph inputs (an optimizer's per-parameter steps) into one "
                                    "kernel; 0: never", check="nonneg")
    write_mutations: bool = _opt(True, "a kernel writes a graph input's new value into the input itself (no copy "
                                       "back) where nothing reads the old value after it")
    # passes
    graph_host_share: float = _opt(0.6, "cuda_graphs='auto' captures a graph whose timed call took at least this "
                                        "share of its GPU time on the host", check="nonneg")
    pad_mm_kernel_bytes: float = _opt(30e6, "pad_mm: a kernel padding adds counts as this many bytes", check="nonneg")
    pad_mm_min_flops_per_byte: float = _opt(80.0, "pad_mm: pad from this many FLOPs per byte copied", check="nonneg")
    empty_mask_max_bytes: int = _opt(1 << 28, "drop_empty_masks: evaluate (at compile time, on its device) only "
                                              "masks of at most this many bytes", check="nonneg")
    pad_mm_out_blocks: int = _opt(8, "pad_mm: a padded matmul whose result the graph returns is computed in this "
                                     "many blocks (of rows: one block's padding alive, not a second result; of "
                                     "columns when only N is misaligned)", check="pos")
    pad_mm_in_place: str = _opt("inference", "pad_mm: where a returned product's column blocks are computed in the "
                                             "result's own storage (nothing allocated beside it; more, smaller "
                                             "products): 'inference' graphs, 'always', 'never'",
                                ("inference", "always", "never"))
    # partitioner
    knapsack_dp_cells: int = _opt(5 * 10 ** 7, "the activation budget's knapsack is solved by exact dynamic "
                                               "programming up to this many items x capacity units, else by "
                                               "HiGHS (a MILP)", check="nonneg")
    # kernel precompilation (no effect on the kernels)
    precompile_min_kernels: int = _opt(4, "fewer new kernels than this (and no worker pool yet) compile in place",
                                       cache=False, check="nonneg")
    precompile_timeout_s: float = _opt(60.0, "seconds to wait for the precompile workers, at most", cache=False,
                                       check="nonneg")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_value(f, getattr(self, f.name), f"{TUNING}.{f.name}")


@dataclass(frozen=True)
class Options:
    """Every option of a compile (frozen), each with a default, help and a ``KILN_<NAME>`` (``kiln options``)."""
    # graph passes
    pattern_matcher: bool = _opt(True, "run kiln's built-in pattern rewrites (user hooks always run)")
    cse: bool = _opt(True, "common-subexpression elimination on the joint and inference graphs")
    pad_matmuls: str = _opt("auto", "pad misaligned large matmuls to tensor-core alignment: 'auto' (CUDA only), "
                            "'always' (any device), 'never'", ("auto", "always", "never"))
    drop_empty_masks: bool = _opt(True, "attention masks computed from constants alone that mask nothing (a model "
                                        "called without attention_mask) are dropped, so SDPA may run its flash kernel "
                                        "as in eager")
    pre_grad_custom_pass: Any = _opt(None, "callable(graph) run on Dynamo's torch-level graph", HOOK, env=False)
    joint_custom_pre_pass: Any = _opt(None, "callable(graph) run first on the joint graph", HOOK, env=False)
    joint_custom_post_pass: Any = _opt(None, "callable(graph) run last on the joint graph", HOOK, env=False)
    post_grad_custom_pre_pass: Any = _opt(None, "callable(graph) run first on forward/backward graphs", HOOK, env=False)
    post_grad_custom_post_pass: Any = _opt(None, "callable(graph) run last on forward/backward graphs", HOOK, env=False)
    # freezing and layout
    freezing: bool = _opt(False, "inference: turn parameters into constants and fold them")
    freezing_discard_parameters: bool = _opt(False, "with freezing: drop the eager module's parameters")
    fold_constants: bool = _opt(True, "fold subgraphs that read no input (e.g. a mask built from Python numbers) "
                                      "into constants, with or without freezing")
    layout_optimization: bool = _opt(True, "pick channels-last for convolution nets")
    layout_devices: str = _opt("auto", "where layout_optimization acts: 'auto' (where channels-last pays: CUDA, and "
                                       "the CPU for C++ kernels, whose convolutions run in oneDNN), 'cuda' or 'any' "
                                       "(every graph, e.g. to test it)", ("auto", "cuda", "any"))
    cpp_wrapper: bool = _opt(False, "accepted for compatibility; kiln runs its Python wrapper")
    # partitioner
    activation_memory_budget: float = _opt(1.0, "fraction of the runtime-optimal saved bytes to keep, in [0, 1]",
                                           check=(0, 1))
    activation_memory_budget_runtime_estimator: Any = _opt(
        "flops", "how recompute cost is estimated: 'flops', 'profile' or callable(node)",
        ("flops", "profile", "callable"))
    activation_memory_limit: Any = _opt(None, "cap on modelled peak activation memory, bytes or '4GiB'")
    partitioner: str = _opt("mincut", "'mincut' (remat) or 'default' (save what the backward needs)",
                            ("mincut", "default"))
    # code generation
    codegen: str = _opt("auto", "kernel target: 'auto' (triton on cuda; cpp on cpu when a C++ compiler works, "
                                "else aten), 'aten' (ATen ops), 'triton' (cpu: its interpreter), 'cpp' (C++/OpenMP "
                                "kernels for CPU graphs)", ("auto", "aten", "triton", "cpp"))
    cpp_compiler: str = _opt("auto", "C++ compiler of codegen='cpp': 'auto' ($CXX, else g++, else clang++) or a "
                                     "command or path")
    cpp_flags: str = _opt("-O3 -march=native -fopenmp -ffp-contract=off -fno-math-errno -fno-trapping-math",
                          "flags of codegen='cpp' builds (no fast-math: NaN and signed zeros as eager)")
    emit_for: str = _opt("auto", "Triton kernels for CPU tensors: 'auto' (run in Triton's interpreter) or 'cuda' "
                                 "(written as for a GPU, to read them on a machine without one; they cannot run)",
                         ("auto", "cuda"))
    index_checks: str = _opt("auto", "bounds checks of indirect indices (x[i], embedding, gather, nll_loss targets...): "
                                     "'auto' (check what kiln cannot prove in range; C++ raises eager's IndexError, "
                                     "Triton asserts on the device), 'always' (check every one), 'never' (no checks: "
                                     "an out-of-range index reads out of bounds)", ("auto", "always", "never"))
    round_low_precision: bool = _opt(True, "fused kernels round each float16/bfloat16 op's result to its dtype, as "
                                           "eager's ops do (False: keep float32 until the store, inductor's default)")
    max_autotune: bool = _opt(False, "benchmark launch configurations for generated kernels")
    compile_workers: int = _opt(-1, "processes compiling Triton kernels before their first launch: "
                                    "-1 auto (CUDA only), 0 off")
    mode: Optional[str] = _opt(None, "torch.compile mode: None, 'default', 'reduce-overhead', 'max-autotune'",
                               (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    cuda_graphs: str = _opt("mode", "replay compiled graphs as CUDA graphs (Triton target on CUDA): 'mode' (under "
                                    "mode='reduce-overhead'), 'auto' (each graph whose second call shows it host-bound: "
                                    "tuning.graph_host_share), 'always', 'never'", ("mode", "auto", "always", "never"))
    tuning: Tuning = _opt(Tuning(), "tuning constants of code generation and passes: the tuning.* rows", env=False)
    # the compile cache (kiln/cache): compiled graphs kept on disk for later processes
    cache: bool = _opt(True, "reuse graphs compiled by earlier processes (and keep new ones) in cache_dir", cache=False)
    cache_dir: Optional[str] = _opt(None, "the compile cache's directory (made 0700); None: $XDG_CACHE_HOME/kiln/graphs "
                                          "or ~/.cache/kiln/graphs", cache=False, check="path")
    cache_size_mb: int = _opt(2048, "the compile cache's size limit in MB: the entries used longest ago go first",
                              cache=False, check="pos")
    # debugging
    on_error: str = _opt("eager", "when compiling a graph raises (in AOTAutograd or kiln): 'eager' (run that graph "
                                  "as eager does, warning with the error) or 'raise'", ("eager", "raise"), cache=False)
    debug: int = _opt(0, "0..5: stage names, graphs, remat decisions, kernels, rules", cache=False, check=(0, 5))
    dump_dir: Optional[str] = _opt(None, "write every stage's graph, kernels and a repro here", cache=False,
                                   check="path")
    verify: bool = _opt(False, "run graph lint after every stage", cache=False)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_value(f, getattr(self, f.name), f.name)

    @property
    def graphs_asked(self) -> bool:
        """CUDA graphs asked for (``cuda_graphs``, or ``mode="reduce-overhead"`` under cuda_graphs='mode')."""
        return self.cuda_graphs in ("auto", "always") or self.cuda_graphs == "mode" and self.mode == "reduce-overhead"

    def replace(self, **overrides) -> "Options":
        """A copy with ``overrides`` (names as for ``patch``; tuning entries merge into this tuning)."""
        return _build({**flat_options(self), **_flatten(overrides)})

    def cache_key(self) -> str:
        """Hash of every field that changes the output (hooks by their uuid() or source)."""
        h = hashlib.sha256()
        for f in dataclasses.fields(self):
            if f.metadata.get("cache"):
                h.update(f"{f.name}={_stable_repr(getattr(self, f.name))};".encode())
        return h.hexdigest()[:16]


# -- names ------------------------------------------------------------------------------------------------
# {name: field} of every option, tuning ones as ``tuning.<name>``, in declaration order
FIELDS = {name: f for top in dataclasses.fields(Options) for name, f in
          ([(f"{TUNING}.{t.name}", t) for t in dataclasses.fields(Tuning)] if top.name == TUNING else [(top.name, top)])}
ENV_NAMES = {name: "KILN_" + name.replace(".", "_").upper() for name in FIELDS}
ENV_NAMES["debug"] = "KILN_DEBUG"
ENV_NAMES["dump_dir"] = "KILN_DUMP"


def _flatten(overrides: dict) -> dict:
    """Overrides with ``tuning=`` (a dict or a Tuning) spelled as ``tuning.<name>`` entries."""
    out = {}
    for name, value in overrides.items():
        if name == TUNING:
            if isinstance(value, Tuning):
                value = {f.name: getattr(value, f.name) for f in dataclasses.fields(Tuning)}
            if not isinstance(value, dict):
                raise OptionTypeError(f"tuning={value!r} must be a dict of tuning fields or a kiln.options.Tuning")
            out.update({f"{TUNING}.{k}": v for k, v in value.items()})
        else:
            out[name] = value
    _check_names(out)
    return out


def flat_options(opts: Options) -> dict:
    """``opts`` as {name: value}, tuning fields as ``tuning.<name>``."""
    return {name: (getattr(opts.tuning, name[len(TUNING) + 1:]) if name.startswith(TUNING + ".")
                   else getattr(opts, name)) for name in FIELDS}


def _build(flat: dict) -> Options:
    prefix = TUNING + "."
    tuning = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    top = {k: v for k, v in flat.items() if not k.startswith(prefix)}
    return Options(**top, tuning=Tuning(**tuning))


def _check_names(overrides):
    for name in overrides:
        if name not in FIELDS:
            near = suggest(name)
            listed = sorted(n for n in FIELDS if not n.startswith(TUNING + "."))
            raise OptionError(f"unknown kiln option {name!r}; " + (
                f"did you mean {' or '.join(near)}? (`kiln options` lists them all)" if near else
                f"valid options: {listed} and the tuning.* fields (`kiln options`)"))


def suggest(name: str) -> list:
    """The option names closest to ``name`` by edit distance, else those containing all of its words."""
    dist = {n: min(_distance(name, n), _distance(name, n.split(".")[-1])) for n in FIELDS}
    best = min(dist.values())
    if best <= max(2, len(name) // 4):
        return [n for n in FIELDS if dist[n] == best]
    words = set(name.replace(".", "_").split("_"))
    return [n for n in FIELDS if words <= set(n.replace(".", "_").split("_"))][:5]


def _distance(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap two adjacent letters) that turn ``a`` into ``b``."""
    before, row = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        new = [i]
        for j, cb in enumerate(b, 1):
            d = min(row[j] + 1, new[j - 1] + 1, row[j - 1] + (ca != cb))
            if before and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                d = min(d, before[j - 2] + 1)
            new.append(d)
        before, row = row, new
    return row[-1]


# -- values -----------------------------------------------------------------------------------------------
def _stable_repr(value) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "{" + ",".join(f"{f.name}={_stable_repr(getattr(value, f.name))}" for f in dataclasses.fields(value)
                              if f.metadata.get("cache", True)) + "}"
    if hasattr(value, "uuid"):
        return f"uuid:{value.uuid()}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_stable_repr(v) for v in value) + "]"
    try:
        return "src:" + hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return f"id:{id(value)}"


def parse_value(name: str, raw: str):
    """Option ``name``'s value from text, as the type of its default (bools: 1/true/yes/on, 0/false/no/off)."""
    _check_names([name])
    f = FIELDS[name]
    kind = type(f.default)
    low = raw.strip().lower()
    try:
        if kind is bool and low not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
            raise ValueError(raw)
        value = (low in ("1", "true", "yes", "on")) if kind is bool else kind(raw) if kind in (int, float) else raw
    except ValueError:
        raise OptionTypeError(f"{name} must be {_TYPES[f.type][1]}; cannot read {raw!r} as one") from None
    _check_value(f, value, name)
    return value


def _from_env() -> dict:
    out = {}
    for name, f in FIELDS.items():
        var = ENV_NAMES[name]
        if f.metadata.get("env") and (raw := os.environ.get(var)):
            try:
                out[name] = parse_value(name, raw)
            except OptionError as e:
                raise type(e)(f"environment variable {var}={raw!r}: {e}") from None
    return out


_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("kiln_options", default={})
_ACTIVE: contextvars.ContextVar[Optional[Options]] = contextvars.ContextVar("kiln_active", default=None)


@contextlib.contextmanager
def using(opts: Options):
    """Mark ``opts`` as the options of the compile running in this scope (read by kiln.debug)."""
    token = _ACTIVE.set(opts)
    try:
        yield opts
    finally:
        _ACTIVE.reset(token)


def active() -> Options:
    """The options of the compile in progress, else ``current()``."""
    return _ACTIVE.get() or current()


def current(**extra) -> Options:
    """The options in force here: defaults < torch's knobs (``torch._functorch.config.activation_memory_budget``
    when not 1.0, ``TORCH_COMPILE_DEBUG=1``: dumps to ``kiln/`` in torch's debug folder) < environment <
    config.patch scopes < extra."""
    folder = compat.compile_debug_dir()
    torch_knobs = {**_from_functorch(), **({} if folder is None else {"dump_dir": os.path.join(folder, "kiln")})}
    return _build({**torch_knobs, **_from_env(), **_OVERRIDES.get(), **_flatten(extra)})


def _from_functorch() -> dict:
    """The budget inductor's users set in ``torch._functorch.config``, taken when not the default 1.0."""
    import torch._functorch.config as fconfig
    budget = getattr(fconfig, "activation_memory_budget", 1.0)
    if budget == 1.0:
        return {}
    try:
        _check_value(FIELDS["activation_memory_budget"], budget, "activation_memory_budget")
    except OptionError as e:
        raise OptionError(f"torch._functorch.config: {e}") from None
    return {"activation_memory_budget": budget}


class _Patch(contextlib.ContextDecorator):
    """A scope of option overrides. Each use as a decorator enters a fresh copy (``_recreate_cm``), and each
    thread its own stack of entries: threads sharing one patch object restore their own options."""

    def __init__(self, overrides, _checked=False):
        self.overrides = overrides if _checked else _flatten(overrides)
        if not _checked:
            _build({**_OVERRIDES.get(), **self.overrides})  # validate values now
        self._local = threading.local()

    def _recreate_cm(self):
        return _Patch(self.overrides, _checked=True)

    def __enter__(self):
        stack = self._local.__dict__.setdefault("tokens", [])
        stack.append(_OVERRIDES.set({**_OVERRIDES.get(), **self.overrides}))
        return self

    def __exit__(self, *exc):
        _OVERRIDES.reset(self._local.tokens.pop())
        return False


def patch(**overrides) -> _Patch:
    """Override options within a scope: ``with kiln.config.patch(freezing=True): ...`` or as a decorator.
    Tuning fields: ``patch(tuning={"persistent_max": 1024})`` or ``patch(**{"tuning.persistent_max": 1024})``."""
    return _Patch(overrides)


def describe() -> str:
    """One line per option: name, default, env var, help (tuning fields as ``tuning.<name>``)."""
    return "\n".join(f"{name:45s} {f.default!r:10} {ENV_NAMES[name] if f.metadata.get('env') else '-':45s} "
                     f"{f.metadata['help']}" for name, f in FIELDS.items())
