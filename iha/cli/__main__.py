"""`python -m iha.cli` is the `iha` command."""

import sys

from .main import main


sys.exit(main())
