"""`python -m research.polynomial_filter` (research/polynomial_filter/cli.py)."""

import sys

from .cli import main


sys.exit(main())
