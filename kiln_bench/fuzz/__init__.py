"""Random-program fuzzing of kiln against eager PyTorch (issue #18).

- ``program``: a program as plain data (inputs, statements, returns), its source and its edits;
- ``generate`` + ``ops``/``ops_shape``: hypothesis strategies that build programs statement by statement
  (pointwise, reductions, views, indexing, scatters, concatenation, in-place, complex, matmul), each
  statement checked against eager as it is drawn; ``program_for(seed, i)`` is program ``i`` of a run;
- ``harness``: run eagerly, in float64 (the arbiter) and with kiln (``check_program``, what reproducers
  call); ``compare``: outputs, gradients and mutated inputs against eager and the arbiter; ``watch``: how
  eager computed (writes through memory that overlaps itself: discarded; less precise floats on the way);
- ``child``: run a program in this process; ``reduce``: shrink a failing program;
- ``runner`` (``python -m kiln_bench.fuzz``): child processes, crash and hang attribution, shrinking,
  the reproducers and summary that ``report`` writes.

Usage: ``python -m kiln_bench.fuzz --target triton --programs 1000 --seed 0 --workers 2 --out DIR``
(``--target`` aten, triton or cpp, or several: ``aten,triton,cpp``;
``--indices 5,17`` some programs, ``--strict`` ATen fallbacks as failures, ``--set tuning.x=v`` options,
``--deadline S`` start no program after S seconds, ``--inline`` no child processes). ``DIR/summary.md``
(passed, failed, discarded by reason, upstream, crashes, ATen fallbacks by reason) is rewritten every
minute, at the deadline and on SIGTERM. One program in this process:
``child.run_program(generate.program_for(0, 17), "triton")``.
"""
