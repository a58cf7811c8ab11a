"""Runtime: load generated wrapper modules and keep the registry that run_and_get_code reads."""
from kiln.runtime.load import load, Compiled  # noqa: F401
