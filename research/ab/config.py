"""What an A/B run does: its two arms (`ARM_A`, `ARM_B`), `ABConfig`, and the presets `tiny` (tests), `cpu`
(2 cores) and `gpu` (one CUDA device).

Every field is the same for both arms; the only difference between the arms is the conversion to IHA (and the
mixing learning rate, which only arm B has parameters for). The settings are composed: `ABConfig` holds its own
(data, arms, measures), `ABTraining` (fields of TRL's `SFTConfig` under their names there, handed to
`IHASFTConfig` as they are) and the evaluation's `SamplingConfig`; written out (`to_dict`) they are one flat record,
a name per setting, as the command's flags are.
"""

import dataclasses
from dataclasses import dataclass, field

from iha.evaluation.settings import SamplingConfig


ARM_A = "base"  # the source model, trained as it is
ARM_B = "iha"  # its IHA conversion (identity mixing: the same function before training)


@dataclass
class ABTraining:
    """The SFT settings of both arms: fields of TRL's `SFTConfig` under their names there, so that
    `IHASFTConfig(**dataclasses.asdict(training), ...)` takes them as they are (and renames what transformers
    renamed, `gradient_checkpointing`, in its one place)."""

    learning_rate: float = field(default=5e-5, metadata={"help": "peak learning rate of every other weight"})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "learning-rate schedule"})
    warmup_steps: float = field(default=0.1, metadata={"help": "warm-up steps, or a fraction < 1 of all steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not on the mixing coefficients)"})
    num_train_epochs: float = field(default=1.0, metadata={"help": "epochs over the training rows"})
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps (> 0 overrides num_train_epochs)"})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "packed rows per step"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_length: int = field(default=1024, metadata={"help": "tokens per packed row; longer conversations are dropped"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in backward"})
    save_steps: int = field(default=50, metadata={"help": "checkpoint every N steps (an interrupted run resumes)"})


def ab_sampling(**overrides) -> SamplingConfig:
    """The A/B's sampled pass (when `num_samples` > 1; every run is also answered greedily): the paper's temperature
    and our top-p, answers of at most 384 new tokens."""
    return SamplingConfig(**{"temperature": 0.6, "top_p": 0.95, "num_samples": 1, "max_new_tokens": 384, **overrides})


@dataclass
class ABConfig:
    """Settings of `python -m research.ab`. Data, training and evaluation are identical for arm A (the source model as it is) and
    arm B (its IHA conversion)."""

    # Model and data
    model: str | None = field(
        default=None, metadata={"help": "Llama-style folder or Hub id (default: built-in SmolLM2-135M-Instruct)"}
    )
    train_data: str = field(
        default="openai/gsm8k",
        metadata={
            "help": "training rows: GSM8K-style (question, answer) or any schema iha-sft reads; Hub id or .jsonl"
        },
    )
    test_data: str = field(default="openai/gsm8k", metadata={"help": "held-out GSM8K test problems: Hub id or .jsonl"})
    math500_data: str | None = field(
        default=None, metadata={"help": "also evaluate on MATH-500 (HuggingFaceH4/MATH-500 or a .jsonl)"}
    )
    num_train_rows: int | None = field(
        default=None, metadata={"help": "training rows (default: all left after the validation split)"}
    )
    num_validation_rows: int = field(default=200, metadata={"help": "validation rows carved from the training data"})
    num_test_problems: int | None = field(
        default=None, metadata={"help": "first N test problems answered by generation (default: all)"}
    )
    num_reference_problems: int | None = field(
        default=None,
        metadata={
            "help": "first N test problems whose reference solutions are scored teacher-forced (per-token loss, "
            "paired per problem; the headline measure) (default: all)"
        },
    )
    split_seed: int = field(default=0, metadata={"help": "seed of the shuffle that carves the validation split"})
    keep_system_prompt: bool = field(
        default=True,
        metadata={"help": "keep the OpenThoughts system prompt of the rows (and in evaluation prompts)"},
    )
    # Arms
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "training seeds, the same per arm"})
    num_pseudo_heads: int = field(default=2, metadata={"help": "IHA pseudo-heads P of arm B's conversion"})
    mixing_learning_rates: list[float] = field(
        default_factory=lambda: [1e-3, 1e-2],
        metadata={
            "help": "candidate learning rates of arm B's mixing coefficients, chosen on validation loss (never on "
            "the test problems the headline loss is measured on)"
        },
    )
    # Training and sampling: settings of their own kinds
    training: ABTraining = field(default_factory=ABTraining)
    sampling: SamplingConfig = field(default_factory=ab_sampling)
    # Evaluation
    validation_batch_size: int = field(default=8, metadata={"help": "rows per forward pass of the validation loss"})
    eval_batch_size: int = field(default=16, metadata={"help": "prompts per generate call"})
    num_bootstrap: int = field(default=10_000, metadata={"help": "bootstrap resamples of the confidence intervals"})

    def __post_init__(self):
        checks = [
            (bool(self.seeds), "--seeds needs at least one seed"),
            (len(set(self.seeds)) == len(self.seeds), "--seeds must not repeat a seed"),
            (bool(self.mixing_learning_rates), "--mixing-learning-rates needs at least one value"),
            (all(lr > 0 for lr in self.mixing_learning_rates), "--mixing-learning-rates must be > 0"),
            (self.num_validation_rows >= 1, "--num-validation-rows must be >= 1"),
            (self.num_train_rows is None or self.num_train_rows >= 1, "--num-train-rows must be >= 1"),
            (self.num_test_problems is None or self.num_test_problems >= 1, "--num-test-problems must be >= 1"),
            (
                self.num_reference_problems is None or self.num_reference_problems >= 1,
                "--num-reference-problems must be >= 1",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.mixing_learning_rates = [float(lr) for lr in self.mixing_learning_rates]

    def to_dict(self) -> dict:
        """Every setting under its own name, in one flat record (the names of the three kinds never collide)."""
        own = {name: value for name, value in dataclasses.asdict(self).items() if name not in NESTED}
        return {**own, **dataclasses.asdict(self.training), **dataclasses.asdict(self.sampling)}


# The fields of `ABConfig` that hold settings of another kind, and their types.
NESTED = {"training": ABTraining, "sampling": SamplingConfig}


# Sized from measurements on the 2-core CPU machine this project is developed on, shared with other jobs, torch on
# one thread (`python -m research.ab --threads 1`; two threads on busy cores made generation ~10x slower per CPU-second). Per CPU-
# second of one core: a training step of ~900 packed tokens (SmolLM2-135M-Instruct, fp32, no activation
# checkpointing) 15.6 s (A) / 16.8 s (B); validation loss 1.3 s (A) / 1.8 s (B) per row; teacher-forced scoring of a
# GSM8K test reference solution (~190 loss tokens, batches of 8, measured under heavier load) 2.2 s (A) / 2.8 s (B);
# greedy generation of 16 problems 7-9 s of prefill plus 0.19 s (A) / 0.31 s (B) per new token. Rows without the
# OpenThoughts system prompt (the chat template's own short one instead) are ~280 tokens, not ~510: 1.8x more rows
# for the same time.
#
# The headline is the reference-solution loss, paired per problem, sized to detect 0.0005 nats/token: the earlier
# cpu run's validation loss (64 rows of ~183 loss tokens, per-row losses averaged over its 2 seeds, after ~20 steps)
# had a paired standard error of 0.000546, so one row contributes sd ~0.0044 and the detectable difference at alpha
# 0.05 with power 0.8 is 2.80 * 0.0044 / sqrt(n): 0.0005 needs n >= 600 (`stats.items_needed`); 1,000 problems give
# ~0.0004 (room for a test set noisier than the validation rows). That is the paired-per-problem test, which holds
# the trained models fixed; with 2 seeds the seed-by-seed test cannot resolve it (its sign-flip p is at least 0.5).
# Cost: 5 trainings (2 of A, 2 mixing-lr candidates, 10x and 100x the other weights', and 1 more seed of B) x ~20
# steps ~ 1,600 s, validation 5 x 64 rows ~ 510 s, reference scoring 4 x 1,000 problems ~ 10,000 s, 4 generations x
# 48 problems at up to 320 new tokens (98.9% of GSM8K test reference solutions in this format fit) ~ 1,070 s,
# loading, saving and the conversion check ~ 200 s: ~13,400 CPU-seconds (about 3.7 hours of one core; the run
# before the reference loss, ~3,400 CPU-s, took 1.1-1.5x as long in wall-clock time on the shared cores).
# benchmarks/ab/README.md has the figures.
CPU = ABConfig(
    num_train_rows=64,
    num_validation_rows=64,
    num_test_problems=48,
    num_reference_problems=1_000,
    keep_system_prompt=False,
    seeds=[0, 1],
    # 10x and 100x the other weights' (`IHASFTConfig.mixing_learning_rate`: the few mixing coefficients start at
    # identity and need a larger rate to move in a short SFT); validation picks.
    mixing_learning_rates=[1e-3, 1e-2],
    eval_batch_size=16,
    training=ABTraining(learning_rate=1e-4, max_length=1024, per_device_train_batch_size=1, save_steps=10),
    sampling=ab_sampling(max_new_tokens=320),
)

# One CUDA device in about an hour (estimated, not measured: this project has no GPU to time it on): all of GSM8K
# train (less 500 validation rows) for one epoch (~7k rows of ~510 tokens, ~220 packed steps of 4 x 4,096 tokens) in
# 8 trainings (3 mixing-lr candidates, 3 seeds of A, 2 more of B); every final run scores all 1,319 test reference
# solutions teacher-forced (the headline; forward passes only, ~0.7M tokens a run) and answers the first 500 test
# problems greedily (up to 1,024 new tokens). The paper's sampling (temperature 0.6, top-p 0.95, 16 samples: pass@1
# and maj@16) multiplies the generation by 16 samples per problem: `--num_samples 16` (with all 1,319 problems,
# ~20x the greedy generation time: several hours on one GPU).
GPU = ABConfig(
    num_train_rows=None,
    num_validation_rows=500,
    num_test_problems=500,
    num_reference_problems=None,
    keep_system_prompt=True,
    seeds=[0, 1, 2],
    mixing_learning_rates=[5e-4, 5e-3, 5e-2],
    validation_batch_size=32,
    eval_batch_size=64,
    training=ABTraining(learning_rate=5e-5, max_length=4096, per_device_train_batch_size=4, save_steps=50),
    sampling=ab_sampling(max_new_tokens=1024, num_samples=1),
)

# The tests: a tiny model (give --model), a few rows, a few steps, short answers; seconds on a CPU.
TINY = ABConfig(
    num_train_rows=12,
    num_validation_rows=4,
    num_test_problems=4,
    num_reference_problems=4,
    keep_system_prompt=False,
    seeds=[0, 1],
    mixing_learning_rates=[1e-3, 1e-1],
    validation_batch_size=4,
    eval_batch_size=4,
    num_bootstrap=200,
    training=ABTraining(learning_rate=1e-3, max_steps=3, max_length=512, per_device_train_batch_size=1, save_steps=2),
    sampling=ab_sampling(max_new_tokens=8),
)

PRESETS = {"tiny": TINY, "cpu": CPU, "gpu": GPU}


def preset_config(name: str, **overrides) -> ABConfig:
    """A preset with some settings replaced, each named by its own name whatever kind holds it (`learning_rate`,
    `temperature`, `seeds`); None values are ignored: they mean "the preset's value"."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}: choose one of {sorted(PRESETS)}.")
    preset = PRESETS[name]
    given = {key: value for key, value in overrides.items() if value is not None}
    nested = {}
    for field_name, kind in NESTED.items():
        names = {setting.name for setting in dataclasses.fields(kind)}
        nested[field_name] = dataclasses.replace(
            getattr(preset, field_name), **{key: given.pop(key) for key in list(given) if key in names}
        )
    return dataclasses.replace(preset, **given, **nested)


__all__ = ["ARM_A", "ARM_B", "ABConfig", "ABTraining", "NESTED", "PRESETS", "ab_sampling", "preset_config"]
