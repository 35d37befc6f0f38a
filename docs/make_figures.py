"""Draw the README's pictures of IHA's attention patterns from the model's own mask functions.

python docs/make_figures.py            # writes docs/images/iha_masks.png
"""

from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from iha.models.iha.masking_iha import (  # noqa: E402
    flat_causal_mask_function,
    token_causal_mask_function,
    virtual_window_overlay,
)
from iha.utils.atomic_files import save_figure_atomic  # noqa: E402


def pattern(mask_function, num_tokens: int, num_pseudo: int) -> torch.Tensor:
    virtual = torch.arange(num_tokens * num_pseudo)
    return mask_function(0, 0, virtual[:, None], virtual[None, :]).float()


def main(output: Path = Path(__file__).parent / "images" / "iha_masks.png") -> Path:
    num_tokens, num_pseudo, window = 5, 2, 2
    flat, token = flat_causal_mask_function(num_pseudo), token_causal_mask_function(num_pseudo)
    virtual_window = virtual_window_overlay(window * num_pseudo)

    def sliding_flat(b, h, q, k):
        return flat(b, h, q, k) & virtual_window(b, h, q, k)

    def sliding_token_causal(b, h, q, k):
        return token(b, h, q, k) & virtual_window(b, h, q, k)

    panels = [
        ("flat causal (paper, default)", pattern(flat, num_tokens, num_pseudo)),
        ("token causal", pattern(token, num_tokens, num_pseudo)),
        (
            f"sliding W={window} (paper): last W*P={window * num_pseudo} virtual",
            pattern(sliding_flat, num_tokens, num_pseudo),
        ),
        (
            f"token causal, sliding W={window}",
            pattern(sliding_token_causal, num_tokens, num_pseudo),
        ),
    ]
    labels = [f"t{n}.p{p}" for n in range(num_tokens) for p in range(num_pseudo)]
    figure, axes = plt.subplots(1, 4, figsize=(17, 4.9))
    for axis, (title, allowed) in zip(axes, panels):
        axis.imshow(allowed, cmap="Blues", vmin=0, vmax=1.3)
        axis.set_title(title)
        axis.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        axis.set_yticks(range(len(labels)), labels, fontsize=7)
        axis.set_xlabel("key (token.pseudo-head)")
        for boundary in range(num_pseudo, len(labels), num_pseudo):
            axis.axhline(boundary - 0.5, color="grey", linewidth=0.4)
            axis.axvline(boundary - 0.5, color="grey", linewidth=0.4)
    axes[0].set_ylabel("query (token.pseudo-head)")
    figure.suptitle(f"IHA attention over N*P = {num_tokens}*{num_pseudo} interleaved pseudo-tokens (blue: may attend)")
    figure.tight_layout()
    return save_figure_atomic(figure, output, dpi=110)


if __name__ == "__main__":
    print(main())
