"""The paper's trained synthetic tasks: relation composition with one attention layer, MHA, 2-simplicial and IHA.

Task (paper, appendix): a random boolean relation R on {0..m-1} (each pair related with probability `density`) is
flattened row-major into m^2 tokens (token (i, j) is the bit R[i, j]). The label of position (i, j) is
(R o R)[i, j] = OR_k R[i, k] AND R[k, j] ("binary" composition) or (R o R o R)[i, j] ("ternary"). Solving position
(i, j) needs row i and column j (and, for ternary, the pairs in between), so attention is bidirectional. As in the
paper, m is drawn per example (binary m ~ U{6..10} at density 0.325, ternary m ~ U{5..8} at density 0.264; a fixed
m is an option), a batch is right-padded to its largest m^2 and padded keys are masked out of the attention; loss
and accuracy count the real positions only, and accuracy is also reported per m.

Model (identical for every attention; our choices where the paper is silent):

* embedding = bit embedding + learned row embedding (i) + learned column embedding (j): the model knows where each
  bit sits without any order bias (no RoPE, no causal mask);
* one pre-norm transformer block: x + Attention(LayerNorm(x)), then x + MLP(LayerNorm(x)) (GELU, 4x width);
* a final LayerNorm and a linear readout to one logit per position (binary cross-entropy).

The attention is plain bidirectional softmax attention with H heads over the m^2 tokens (MHA); 2-simplicial
attention (`research.synthetic.simplicial_attention`: trilinear scores over pairs of keys, two more projections); or IHA: the
MHA projections plus `iha.models.iha.modeling_iha.IHAHeadMixing` (alpha_q/k/v [H, H, P], per-head collapse [H, P]), softmax
attention over the m^2 * P interleaved pseudo-tokens (the padding mask repeated over each token's P pseudo-tokens),
then the collapse back to H heads. IHA here is trained from scratch, so its mixing does not start at identity
(which would keep every pseudo-copy of a key identical forever under a mask-free attention): alphas are drawn like
fresh linear weights over heads, N(0, 1/H), and the collapse weights N(0, 1/P).

Training: AdamW (weight decay 0.01), per-epoch validation, early stopping on validation accuracy (patience 10 by
default), the best validation checkpoint is tested. Metrics: per-position accuracy (the paper's) and per-matrix
exact match, overall and per m. Runs on CUDA when there is one.

One job per module:

    config.py                the tasks, `SyntheticConfig` and the presets
    task.py                  the relations, their composition and the padded batches
    models.py                the one-layer model with MHA, IHA or 2-simplicial attention (`simplicial_attention.py`)
    train.py                 one run with early stopping, and a comparison's runs (`run_comparison`)
    checkpoints.py           a comparison's files while it runs: finished runs, epoch states, weights, claims
    states.py                a run's epoch state and its saved weights (safetensors and JSON)
    experiment.py            a whole `python -m research.synthetic` call: every seed, resumed; the summary; a report so far
    summary.py               the numbers over seeds: selected runs, paired tests, equal epochs, what is unfinished
    relations.py             per-relation tests from saved weights (McNemar within a seed) and the data the seeds share
    report.py, progress.py   their markdown (progress.py: the runs not finished yet)
    figures.py, outputs.py   their pictures, and the files a comparison writes
    cli.py                   the command line, `python -m research.synthetic` (__main__.py)

The polynomial-filter claim, on the same kind of one-layer model, is `research.polynomial_filter`.
"""

from .config import PRESET_SEEDS, PRESETS, SyntheticConfig
from .experiment import run_seeds
from .models import build_model
from .outputs import write_outputs, write_seed_summary
from .relations import relation_tests
from .train import run_comparison


__all__ = [
    "PRESETS",
    "PRESET_SEEDS",
    "SyntheticConfig",
    "build_model",
    "relation_tests",
    "run_comparison",
    "run_seeds",
    "write_outputs",
    "write_seed_summary",
]
