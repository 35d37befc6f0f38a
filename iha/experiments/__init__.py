"""Experiments that measure IHA: the A/B of SFT (`ab`), the paper's synthetic tasks (`synthetic`), and the paired
statistics both report with (`statistics`)."""
