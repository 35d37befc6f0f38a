"""`iha ab`: a controlled A/B of SFT on a Llama-style model as it is against SFT on its IHA conversion.

`config` (ABConfig, presets), `stats` (bootstrap, exact McNemar, detectable differences), `run` (one arm / seed:
training, validation loss, evaluation), `experiment` (the whole comparison), `report` (report.md / .json, plots),
`cli` (`iha ab`).
"""

from .config import PRESETS, ABConfig, preset_config


__all__ = ["ABConfig", "PRESETS", "preset_config"]
