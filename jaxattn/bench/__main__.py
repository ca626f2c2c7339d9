"""`python -m jaxattn.bench decode|extend|plot ...`: see jaxattn.bench.cli."""

import sys

from .cli import main

sys.exit(main())
