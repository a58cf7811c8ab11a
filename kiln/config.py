"""``kiln.config``: the scoped option API (``patch``, ``current``, ``describe``)."""
from kiln.options import Options, OptionError, current, describe, parse_bytes, patch  # noqa: F401
