"""The internals of kiln the tools read, all in this one place.

Everything else the tools do goes through kiln's public API: ``kiln.compile`` (or ``torch.compile(...,
backend="kiln", options=...)``), ``kiln.Options``, ``kiln.config`` (``patch``, ``parse_value``),
``kiln.counters``, ``kiln.run_and_get_code``, ``kiln.explain``, ``kiln.explain_memory`` and the pipeline's
events and log (``kiln.debug.observe``, ``kiln.debug.log``); ``tests/test_layers.py`` checks that no
other module of ``kiln_bench`` imports more of kiln. Each name below is here because no public entry
point gives it; a change to one of them in kiln breaks the tool named beside it.
"""
from __future__ import annotations

# offline (and graph_peak through it): kiln's pipeline on one captured graph over fake CPU tensors, emitting
# the kernels a GPU would get; every source it generates meanwhile (``--sources``)
from kiln.pipeline import compile_graph  # noqa: F401
from kiln.runtime.load import collect_sources  # noqa: F401

# profile --launch: a compiled graph's generated function, called below Dynamo and AOTAutograd
from kiln.runtime.load import Compiled  # noqa: F401

# the kernels this process compiled: ``kernels.reset()`` makes the next compile cold (bench rows under
# --fresh-caches, each fuzz program); ``kernel_cache`` holds their text by name (profile --sources)
from kiln.runtime import kernels  # noqa: F401
from kiln.runtime.kernels import _CACHE as kernel_cache  # noqa: F401

# peak_sweep: the partitioner's model of a saved set's peak
from kiln.partition.peak import model_peak  # noqa: F401

# graph_peak: which nodes are views of their input (``ops.is_view``), as the partitioner counts them
from kiln.partition import ops  # noqa: F401

# launch: the ``kiln`` command itself, which the console script runs for every command but ``--version``
from kiln.cli import main as cli_main  # noqa: F401
