"""``kiln.config``: the scoped option API (``patch``, ``current``, ``describe``; ``parse_value`` reads an
option's value from text, as ``KILN_*`` variables and the tools' ``--set name=value`` give it)."""
from kiln.options import Options, OptionError, current, describe, parse_bytes, parse_value, patch  # noqa: F401
