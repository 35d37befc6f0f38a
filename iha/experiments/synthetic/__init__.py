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
attention (`iha.experiments.synthetic.simplicial_attention`: trilinear scores over pairs of keys, two more projections); or IHA: the
MHA projections plus `iha.models.iha.modeling_iha.IHAHeadMixing` (alpha_q/k/v [H, H, P], per-head collapse [H, P]), softmax
attention over the m^2 * P interleaved pseudo-tokens (the padding mask repeated over each token's P pseudo-tokens),
then the collapse back to H heads. IHA here is trained from scratch, so its mixing does not start at identity
(which would keep every pseudo-copy of a key identical forever under a mask-free attention): alphas are drawn like
fresh linear weights over heads, N(0, 1/H), and the collapse weights N(0, 1/P).

Training: AdamW (weight decay 0.01), per-epoch validation, early stopping on validation accuracy (patience 10 by
default), the best validation checkpoint is tested. Metrics: per-position accuracy (the paper's) and per-matrix
exact match, overall and per m. Runs on CUDA when there is one.
"""

from ...utils.lazy_imports import lazy_attributes


# Public name -> the module that defines it, imported on first use: the command line's parser
# (`iha synthetic --help`) does not import the training and plotting code.
_EXPORTS = {
    "CPU": "config",
    "FIXED": "config",
    "PAPER": "config",
    "PAPER_REGIME": "config",
    "PAPER_TERNARY": "config",
    "PRESET_SEEDS": "config",
    "PRESETS": "config",
    "TASKS": "config",
    "TINY": "config",
    "SyntheticConfig": "config",
    "ATTENTIONS": "models",
    "BidirectionalAttention": "models",
    "CompositionModel": "models",
    "build_model": "models",
    "count_parameters": "models",
    "relation_tests": "relations",
    "results_table": "report",
    "seed_summary": "report",
    "write_outputs": "outputs",
    "write_seed_summary": "outputs",
    "TwoSimplicialAttention": "simplicial_attention",
    "two_simplicial_attention": "simplicial_attention",
    "CompositionData": "task",
    "compose_relation": "task",
    "make_composition_data": "task",
    "valid_positions": "task",
    "comparison_data": "train",
    "epoch_batches": "train",
    "evaluate": "train",
    "evaluate_relations": "train",
    "masked_loss": "train",
    "run_comparison": "train",
    "runs_in_progress": "train",
    "train_one": "train",
}

__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
