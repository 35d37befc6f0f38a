"""`python -m research.ab` (research/ab/cli.py)."""

import sys

from .cli import main


sys.exit(main())
