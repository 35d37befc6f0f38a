"""The tiny relation-composition comparison the synthetic training and report tests read (trained once per module)."""

import pytest
import torch

from iha.synthetic import TINY, run_comparison


@pytest.fixture(scope="module")
def tiny_results():
    torch.manual_seed(0)
    return run_comparison(TINY, progress=False)
