# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""The transformers releases IHA models run on (`make matrix` tests them): an older one is refused with the command
that fixes it, before other imports fail with unrelated errors; a newer one gets one warning and runs. Travels with the
weights; imports transformers' version and `packaging` (a dependency of transformers), no torch.
"""

import re

import transformers
from packaging.version import Version
from transformers.utils import logging


# The supported transformers releases, written once: `setup.py` reads this line as text (its `install_requires`),
# `scripts/transformers_matrix.py` tests its two ends, and everything below derives from it. The upper bound is the
# next release line after the newest one the version matrix ran (patch releases of that line count as tested).
SUPPORTED_TRANSFORMERS = "transformers>=5.4.0,<5.26"
INSTALL_COMMAND = f'pip install "{SUPPORTED_TRANSFORMERS}"'

_BOUNDS = re.fullmatch(r"transformers>=([\d.]+),<(\d+\.\d+)", SUPPORTED_TRANSFORMERS)
# The oldest supported release, and the first release line past the tested ones.
MINIMUM_TRANSFORMERS = Version(_BOUNDS.group(1))
FIRST_UNTESTED_TRANSFORMERS = Version(_BOUNDS.group(2))

logger = logging.get_logger(__name__)


class UnsupportedTransformersError(ImportError):
    """The installed transformers cannot run IHA models."""


def newest_tested_line() -> str:
    """The newest release line the matrix ran, "5.25"."""
    return f"{FIRST_UNTESTED_TRANSFORMERS.major}.{FIRST_UNTESTED_TRANSFORMERS.minor - 1}"


def supported_range_text() -> str:
    return f"transformers >= {MINIMUM_TRANSFORMERS} (tested up to {newest_tested_line()}.x)"


def supported_requirement(minimum: str | None = None) -> str:
    """The pip requirement of the supported range; `minimum` raises its lower bound (a feature of a newer release)."""
    if minimum is None:
        return SUPPORTED_TRANSFORMERS
    return f"transformers>={minimum},<{FIRST_UNTESTED_TRANSFORMERS}"


def check_transformers_release(version: str = transformers.__version__) -> None:
    """Refuse a release below the supported range; warn once about one above the tested releases."""
    release = Version(version).release
    if release < MINIMUM_TRANSFORMERS.release:
        raise UnsupportedTransformersError(
            f"IHA models need {supported_range_text()}, but transformers {version} is installed. Fix: {INSTALL_COMMAND}"
        )
    if release[:2] >= FIRST_UNTESTED_TRANSFORMERS.release[:2]:
        logger.warning_once(
            f"transformers {version} is newer than the releases IHA models were tested with "
            f"({supported_range_text()}): if outputs look wrong, {INSTALL_COMMAND}."
        )


check_transformers_release()
