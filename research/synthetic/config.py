"""The tasks (`TASKS`, the paper's sizes and densities), the settings of a comparison (`SyntheticConfig`) and the
presets: paper, paper-regime, paper-ternary, paper-ternary-mha, cpu, fixed, tiny."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


# Paper, appendix: binary composition with m in 6..10 at density 0.325, ternary with m in 5..8 at density 0.264.
TASKS = {
    "binary": {"order": 2, "density": 0.325, "m": [6, 10]},
    "ternary": {"order": 3, "density": 0.264, "m": [5, 8]},
}


DATA_STREAMS = ("independent", "shifted")
# The value a results file written before a field existed stands for (`config_from_saved`): those files ran
# without the 2-simplicial baseline, on batches of mixed m, with shifted data streams.
BEFORE_THE_FIELD_EXISTED = {"simplicial": False, "group_by_m": False, "data_streams": "shifted"}


@dataclass
class SyntheticConfig:
    """The settings of one comparison (`python -m research.synthetic` makes a flag of each field but `m`, which `--m` reads)."""

    tasks: list[str] = field(
        default_factory=lambda: ["binary", "ternary"], metadata={"help": "tasks to run", "choices": sorted(TASKS)}
    )
    # Matrix size per task, [low, high]: m drawn uniformly per example (low == high: every example the same m).
    m: dict[str, list[int]] = field(default_factory=lambda: {task: list(TASKS[task]["m"]) for task in TASKS})
    num_train: int = field(default=40_000, metadata={"help": "training examples"})
    num_val: int = field(default=5_000, metadata={"help": "validation examples (early stopping)"})
    num_test: int = field(default=5_000, metadata={"help": "test examples"})
    hidden_size: int = field(default=128, metadata={"help": "model width"})
    num_heads: int = field(default=8, metadata={"help": "attention heads"})
    pseudo_heads: list[int] = field(
        default_factory=lambda: [2, 8], metadata={"help": "IHA variants (P values); MHA always runs"}
    )
    simplicial: bool = field(default=True, metadata={"help": "also train the 2-simplicial attention baseline"})
    learning_rates: list[float] = field(default_factory=lambda: [1e-3, 1e-4], metadata={"help": "one run per rate"})
    batch_size: int = field(default=128, metadata={"help": "examples per batch"})
    # Every training batch holds examples of one m (shuffled within each m, batches shuffled across m), so that a
    # batch pads to nothing instead of to its largest m; False: random batches padded to their largest m (how the
    # results written before this field existed were trained).
    group_by_m: bool = field(default=True, metadata={"help": "batch examples of one m together (no padding)"})
    max_epochs: int = field(default=200, metadata={"help": "epoch budget of a run"})
    patience: int = field(default=10, metadata={"help": "epochs without a better validation accuracy before stopping"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    seed: int = field(default=0, metadata={"help": "one comparison with this seed (data, order and initial weights)"})
    # How a seed's train / validation / test sets are drawn (`task.split_seeds`). "independent": one stream per
    # (seed, task, split) from numpy's SeedSequence, so no two seeds or splits share draws; "shifted": generator
    # seeds s, s + 1, s + 2 (and + 1000 per task), how every comparison before this field was drawn: seed s + 1's
    # validation set is then seed s's test set. paper-ternary keeps "shifted" so that its runs pair with the ones
    # finished before.
    data_streams: str = field(
        default="independent",
        metadata={"help": "how each seed's splits are drawn", "choices": sorted(DATA_STREAMS)},
    )

    def __post_init__(self):
        unknown = [task for task in self.tasks if task not in TASKS]
        if unknown:
            raise ValueError(f"Unknown task(s) {unknown}: choose from {sorted(TASKS)}.")
        missing = [task for task in self.tasks if task not in self.m]
        if missing:
            raise ValueError(f"No matrix size `m` given for task(s) {missing}.")
        # A single size (results written before ranges existed) is the range [m, m].
        self.m = {task: [size, size] if isinstance(size, int) else list(size) for task, size in self.m.items()}
        for task, (low, high) in self.m.items():
            if not 2 <= low <= high:
                raise ValueError(f"`m` of {task} must be a range [low, high] with 2 <= low <= high, got {[low, high]}.")
        if self.data_streams not in DATA_STREAMS:
            raise ValueError(f"`data_streams` must be one of {list(DATA_STREAMS)}, got {self.data_streams!r}.")
        if any(p < 1 for p in self.pseudo_heads):
            raise ValueError(f"Every pseudo-head count must be >= 1, got {self.pseudo_heads}.")
        for name in ("num_train", "num_val", "num_test", "batch_size", "max_epochs", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")


def config_from_saved(saved: dict) -> SyntheticConfig:
    """The config a results file or epoch state was written with; a field it lacks has the value it had before
    the field existed (`BEFORE_THE_FIELD_EXISTED`)."""
    return SyntheticConfig(**{**BEFORE_THE_FIELD_EXISTED, **saved})


def model_variants(config: SyntheticConfig) -> list[tuple[str, str, int | None]]:
    """(name, attention, P) of every model the comparison trains."""
    variants = [("MHA", "mha", None)]
    if config.simplicial:
        variants.append(("2-simplicial", "simplicial", None))
    return variants + [(f"IHA P={p}", "iha", p) for p in config.pseudo_heads]


def describe_m(low_high: list[int] | int) -> str:
    low, high = (low_high, low_high) if isinstance(low_high, int) else low_high
    return str(low) if low == high else f"{low}..{high}"


# The paper's scale as far as the paper states it: m per example from its ranges, width 128, H = 8, IHA with
# P = 8 (and P = 2), 40k/5k/5k examples, lr 1e-3 and 1e-4, early stopping with patience 10. Our choices where it is
# silent: batch 128, AdamW with weight decay 0.01, at most 200 epochs (the length Kozachinskiy et al. 2025 train
# binary composition for), seeds 0, 1, 2. Sized for a GPU (the device is picked automatically): on 2 CPU cores one
# epoch of IHA P = 8 or 2-simplicial at m = 10 takes tens of minutes.
PAPER = SyntheticConfig()
# The full comparison of PAPER (MHA, 2-simplicial, IHA P = 2 and 8; both tasks with the paper's m ranges; H = 8;
# seeds 0, 1, 2; patience 10) shrunk for 2 shared CPU cores. IHA P = 8 (8 m^2 pseudo-tokens) and 2-simplicial (m^4
# pairs of keys per query) take almost all of the time. What had to give, in order: lr 1e-3 only (the rate validation
# picked for every model in the fixed-m runs; lr 1e-4 needs many more epochs), width 32 (head dim 4), 320 / 160 /
# 1,000 examples. Batch 8 (40 steps an epoch) so that runs end by patience rather than by the budget: with batch 32
# and at most 60 epochs every run hit the budget; with batch 8 all 24 runs stopped by patience, after 43-118 epochs
# (one thread on cores shared with other jobs: MHA and IHA P = 2 0.5-4 minutes a run; ternary 2-simplicial and
# IHA P = 8 9-12 minutes; binary 2-simplicial 23-59 and binary IHA P = 8 16-24 minutes; 75-107 minutes a seed).
# Several seeds train every seed's MHA and IHA P = 2 first, then the costly models (ternary before binary). With busy cores pass
# `--threads 1`: small ops ran 3-5x faster on one thread than on two, the costly ones as fast.
CPU = replace(
    PAPER,
    num_train=320,
    num_val=160,
    num_test=1_000,
    hidden_size=32,
    learning_rates=[1e-3],
    batch_size=8,
    max_epochs=150,
)
# The setting before the paper's ranges: every example at the small end (binary m = 6, ternary m = 5), MHA and
# IHA only, width 32, at most 6 epochs with patience 2 (about 22 minutes on 2 cores).
FIXED = replace(
    PAPER,
    m={"binary": [6, 6], "ternary": [5, 5]},
    hidden_size=32,
    pseudo_heads=[8, 2],
    simplicial=False,
    max_epochs=6,
    patience=2,
)
# The affordable part of the paper's regime on a CPU: ternary composition at fixed m = 5 (the small end of its range)
# with the paper's data (40k / 5k / 5k), width 128 and H = 8; MHA, IHA P = 2, IHA P = 8 (the paper's P = H) and
# 2-simplicial, lr 1e-3, patience 10. Measured per epoch on one idle thread: MHA 0.4 min, IHA P = 2 0.9, IHA P = 8
# 3.3, 2-simplicial 2.8. At most 100 epochs (our choice: the budget of one P = 8 run is then at most ~5.5 hours; the
# results say how every run stopped). Several seeds train MHA and IHA P = 2 over all seeds first, then IHA P = 8,
# then 2-simplicial; two processes of the same command share the work run by run.
PAPER_TERNARY = replace(
    PAPER,
    tasks=["ternary"],
    m={"ternary": [5, 5]},
    learning_rates=[1e-3],
    max_epochs=100,
    data_streams="shifted",
)
# paper-ternary's MHA at the budget of its IHA P = 8 runs: 100 epochs with no early stopping (patience 100 cannot act
# within 100 epochs; the best validation epoch is still the one tested and saved), MHA alone, the same data, seeds and
# initial weights, so that every epoch up to paper-ternary's own MHA stop repeats that run and the rest extends it.
# Compared with paper-ternary's IHA P = 8 at equal epochs and per relation (McNemar within a seed, from the weights).
PAPER_TERNARY_MHA = replace(PAPER_TERNARY, pseudo_heads=[], simplicial=False, patience=100)
# The paper's own regime, sized for one GPU: both tasks with the paper's m distributions (binary m ~ U{6..10},
# ternary m ~ U{5..8}), 40k / 5k / 5k relations, width 128, H = 8, both learning rates (1e-3, 1e-4), MHA, IHA at the
# paper's P = H = 8 and 2-simplicial, patience 10, independent data streams (the default), seeds 0, 1, 2. At most 10
# epochs a run (our cap, to fit minutes of one GPU; the paper does not state its length, and lr 1e-4 will not have
# converged by then: every run says how it stopped). Under that cap patience 10 can never act: every run trains 10
# epochs and is tested at its best validation epoch, which is where this preset differs from the paper's training.
# The first estimate scaled the idle one-thread paper-ternary epochs (m = 5: MHA 0.4 min, IHA P = 8 3.3,
# 2-simplicial 2.8) by each model's FLOPs to the m ranges (token-linear work by E[m^2], IHA's (P m^2)^2 attention by
# E[m^4], 2-simplicial's m^6 by E[m^6]): per epoch about 1 (MHA), 2-4 (IHA P = 8) and 4-15 (2-simplicial) seconds on
# a GPU at ~10-20 TFLOP/s, with a floor of ~1 s for the 313 steps' kernel launches. The paper-ternary runs' recorded
# epochs on shared cores were 0.74-1.00x the idle figure for IHA P = 8 and 0.70-0.74x for 2-simplicial (MHA 5.2-7.2x,
# but MHA sits at the launch floor): scaled the same way, 1.5-4 (IHA P = 8) and 2.8-11 (2-simplicial) seconds, so
# 21-64 s an epoch for the 12 runs of a seed: 4-11 minutes a seed, 11-32 for the grid. The GPU check's
# `paper_regime` step measures the real epoch times (one epoch of seed 0's 12 runs) and projects the grid. On a CPU
# the same command runs (days) and resumes after every epoch.
PAPER_REGIME = replace(PAPER, pseudo_heads=[8], max_epochs=10)
# Seconds, for the tests.
TINY = SyntheticConfig(
    m={"binary": [3, 4], "ternary": [3, 4]},
    num_train=256,
    num_val=64,
    num_test=64,
    hidden_size=16,
    num_heads=4,
    pseudo_heads=[2],
    simplicial=True,
    learning_rates=[1e-2],
    batch_size=64,
    max_epochs=3,
    patience=2,
)
PRESETS = {
    "paper": PAPER,
    "paper-regime": PAPER_REGIME,
    "paper-ternary": PAPER_TERNARY,
    "paper-ternary-mha": PAPER_TERNARY_MHA,
    "cpu": CPU,
    "fixed": FIXED,
    "tiny": TINY,
}
# Seeds a preset runs when neither --seed nor --seeds is given.
PRESET_SEEDS = {
    "paper": [0, 1, 2],
    "paper-regime": [0, 1, 2],
    "paper-ternary": [0, 1, 2],
    "paper-ternary-mha": [0, 1, 2],
    "cpu": [0, 1, 2],
    "fixed": [0],
    "tiny": [0],
}
