"""The paper's head-count separations: the polynomial filter [X, AX, ..., A^(k-1) X] (ceil(sqrt(k)) IHA heads against
k MHA heads), exact with hand-set weights and trained from random initialisations, and a prefix-count task of our
own built on the same layer.

One job per module:

    constructions.py  the task, the one-layer `FilterAttention`, the hand-set IHA and MHA filters, the MHA bound
    cpm.py            a prefix-count task of our own (not the paper's CPM-3) and its hand-set IHA and MHA layers
    config.py         the trained comparison's settings (`PolynomialConfig`), models and graphs
    runs.py           one trained run (`train_filter`) and the runs saved by earlier calls
    summary.py        the report's numbers: final errors over seeds, IHA against each MHA paired by seed
    report.py         report.md and error.png
    experiment.py     the whole trained comparison, resumable (`run_experiment`)
    cli.py            the command line, `python -m research.polynomial_filter` (__main__.py)
"""

from .config import PolynomialConfig
from .constructions import FilterAttention, filter_target, hand_set_iha_filter, hand_set_mha_filter
from .experiment import run_experiment


__all__ = [
    "FilterAttention",
    "PolynomialConfig",
    "filter_target",
    "hand_set_iha_filter",
    "hand_set_mha_filter",
    "run_experiment",
]
