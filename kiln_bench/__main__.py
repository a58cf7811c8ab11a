"""``python -m kiln_bench ...`` is ``kiln bench ...``."""
import sys

from kiln_bench.cli import main

sys.exit(main())
