"""`python -m research.ab`: a controlled A/B of SFT on a Llama-style model as it is against SFT on its IHA conversion.

One job per module:

    config.py       the two arms, ABConfig and its presets
    data.py         the training rows and a fixed validation split, the test problems and their reference solutions
    measures.py     what a run measures: step trace, per-row losses, mixing drift, the conversion check
    runs.py         one arm with one seed: training, evaluation, reference-solution loss (and the output folder)
    experiment.py   the whole comparison, step by step (`run_ab`)
    summary.py      report.json: per-arm metrics, the paired tests and the power of the run
    report.py       report.md and the plots
    cli.py          the command line, `python -m research.ab` (__main__.py)

Its paired tests, intervals and detectable differences are `research.statistics`.
"""

from .config import PRESETS, ABConfig, preset_config


__all__ = ["ABConfig", "PRESETS", "preset_config"]
