"""The Triton emitter: a plan as a module of ``@triton.jit`` functions and a launcher (``module.write_module``)."""
