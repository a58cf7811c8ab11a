"""``python -m kiln.bench ...`` is ``kiln bench ...``."""
import sys

from kiln.bench.cli import main

sys.exit(main())
