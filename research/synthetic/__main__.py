"""`python -m research.synthetic` (research/synthetic/cli.py)."""

import sys

from .cli import main


sys.exit(main())
