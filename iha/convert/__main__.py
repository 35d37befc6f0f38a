"""`python -m iha.convert SRC DST [options]`: the same as `iha-convert`."""

import sys

from .cli import main


sys.exit(main())
