"""`python -m iha.sft` (what `accelerate launch -m iha.sft` runs): the `iha-sft` command."""

import sys

from .cli import main


sys.exit(main())
