"""A single-pseudo-head (P = 1) IHA folder as a stock Llama, Mistral, Qwen2 or SmolLM3 folder.

With one pseudo-head per head there is no interleave: the virtual sequence is the token sequence, virtual positions
are token positions, both masks are the causal mask and a window of W tokens is a window of W virtual tokens. What
is left of IHA is linear across heads: `Q~[n, h] = sum_m alpha_q[m, h] * Q[n, m]` (likewise K~ among the KV heads,
V~) and the collapse `o[n, h] = sum_m R[h, m] * o~[n, m]` (global) or `R[h] * o~[n, h]` (per head). RoPE rotates
every head by the same angle, so it commutes with the mixing; the mixing folds into the rows of `q_proj`, `k_proj`,
`v_proj` (and their biases) and the collapse into the columns of `o_proj`, exactly (in float64, rounded once to the
folder's dtype). The vLLM plugin folds the same way at load time: both use `iha.models.folding`.

What does not fold is refused: P > 1 (attention over N * P interleaved pseudo-tokens is not a stock attention), and
a per-head q/k norm before the mixing (Qwen3, Gemma 3: a norm of each head does not commute with mixing heads).
"""

import json
import logging
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..conversion.readers import LICENSE_FILE_PATTERNS, TOKENIZER_FILES, find_weight_files
from ..conversion.report import REPORT_NAME
from ..models.folding import fold_collapse_into_output, fold_mixing_into_projection
from ..models.iha.layer_iha import FIELD_DEFAULTS, RETIRED_WINDOW_FIELD, is_iha_layer, is_sliding_layer
from ..utils.atomic_folders import staged_folder
from .errors import ExportError
from .folders import read_iha_config


logger = logging.getLogger(__name__)

# The architectures a P = 1 folder exports to: architecture -> model_type.
EXPORT_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "SmolLM3ForCausalLM": "smollm3",
}
# What no stock architecture of these computes once folded, by the source architecture `iha_conversion.json` names.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
# IHA config fields that have no place in the exported config (every stock config ignores them, but a folder that
# says `iha_mask_mode` would read as an IHA model): the IHA fields, the retired window unit of older folders, and the
# Llama-family switches only IHA's config carries.
IHA_ONLY_FIELDS = (
    *FIELD_DEFAULTS,
    RETIRED_WINDOW_FIELD,
    "qkv_bias",
    "o_proj_bias",
    "use_qk_norm",
    "no_rope_layers",
    "auto_map",
    "model_file",
)
MIXING_NAMES = ("alpha_q", "alpha_k", "alpha_v", "collapse")
EXPORT_CARD = """---
library_name: transformers
tags:
- iha
- interleaved-head-attention
---

# {name}

A stock `{architecture}` exported by `iha export llama` from an Interleaved Head Attention (IHA) folder with one
pseudo-head per head (P = 1): the learned head mixing and collapse are folded into `q_proj`, `k_proj`, `v_proj` and
`o_proj`, so this folder computes what the IHA folder computed (max |logit difference| {max_abs_diff:.2e} in float32
when it was exported) and loads wherever a `{model_type}` model loads, without remote code.
"""


@dataclass
class ExportReport:
    source: str
    output_dir: str
    architecture: str
    folded_layers: list[int]
    dtype: str
    max_abs_diff: float | None = None
    top1_agreement: float | None = None
    notes: list[str] = field(default_factory=list)


GEMMA3_REFUSAL = (
    "Gemma 3 IHA folders cannot be folded into a stock model: Gemma 3 normalises each query and key head "
    "(q_norm, k_norm) before the head mixing, and a per-head norm does not commute with mixing heads."
)


def source_architecture(folder: Path, config: dict) -> str:
    """The architecture the folder was converted from (`iha_conversion.json`), or the one its config describes
    (a folder trained from scratch has no conversion report)."""
    report_path = folder / REPORT_NAME
    if report_path.is_file():
        architecture = json.loads(report_path.read_text(encoding="utf-8")).get("architecture")
        if architecture:
            return architecture
    if 0 in (config.get("no_rope_layers") or []):
        return "SmolLM3ForCausalLM"
    if config.get("qkv_bias") and not config.get("o_proj_bias"):
        return "Qwen2ForCausalLM"
    if config.get("sliding_window") is not None and all(map(is_sliding_layer, config["attention_types"])):
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def check_foldable(config: dict, architecture: str) -> None:
    """Refuse, in one line that says why, a folder whose IHA layers do not fold into a stock attention."""
    iha_layers = [i for i, attention_type in enumerate(config["attention_types"]) if is_iha_layer(attention_type)]
    num_pseudo_heads = config.get("num_pseudo_heads", FIELD_DEFAULTS["num_pseudo_heads"])
    if iha_layers and num_pseudo_heads != 1:
        raise ExportError(
            f"This folder has P = {num_pseudo_heads} pseudo-heads per head: its IHA layers attend over N * "
            f"{num_pseudo_heads} interleaved pseudo-tokens, which no stock attention computes, so only P = 1 folds into "
            "a plain model (train or convert with num_pseudo_heads=1 to export; `iha export mlx` runs P > 1 on MLX)."
        )
    if config.get("use_qk_norm") or architecture in QK_NORM_ARCHITECTURES:
        raise ExportError(
            f"{architecture} normalises each query and key head (q_norm, k_norm) before the head mixing, and a "
            "per-head norm does not commute with mixing heads, so the mixing cannot fold into q_proj and k_proj."
        )
    if architecture not in EXPORT_ARCHITECTURES:
        raise ExportError(
            f"iha export llama writes {', '.join(EXPORT_ARCHITECTURES)}; the folder comes from {architecture}."
        )


def layer_windows(config: dict) -> list[int | None]:
    return [config.get("sliding_window") if is_sliding_layer(t) else None for t in config["attention_types"]]


def target_config_fields(config: dict, architecture: str) -> dict:
    """The fields of the stock config that describe what the folded IHA folder computes, or one clear refusal when
    the architecture cannot hold its layout (sliding layers) or its biases."""
    windows = layer_windows(config)
    sliding = sorted({window for window in windows if window is not None})
    sliding_layers = [i for i, window in enumerate(windows) if window is not None]
    qkv_bias, o_proj_bias = bool(config.get("qkv_bias")), bool(config.get("o_proj_bias"))
    mlp_bias = bool(config.get("mlp_bias"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    default_head_dim = config["hidden_size"] // config["num_attention_heads"]
    name = architecture.removesuffix("ForCausalLM")
    extra = {}
    if architecture in ("LlamaForCausalLM", "SmolLM3ForCausalLM"):
        if sliding:
            raise ExportError(
                f"{name} has no sliding-window layers, and layers {sliding_layers} of this folder attend to the last "
                f"{sliding[0]} tokens only; export a folder whose layers all attend fully."
            )
        if qkv_bias != o_proj_bias:
            raise ExportError(
                f"{name} has one attention_bias for q/k/v and o_proj; this folder has {qkv_bias=}, {o_proj_bias=}."
            )
        extra.update(attention_bias=qkv_bias, mlp_bias=mlp_bias)
        if architecture == "SmolLM3ForCausalLM":
            extra.update(no_rope_layers=list(config["no_rope_layers"]), use_sliding_window=False, sliding_window=None)
    elif architecture == "MistralForCausalLM":
        if sliding and len(sliding_layers) != len(windows):
            raise ExportError(
                f"Mistral applies one sliding window to every layer, and only layers {sliding_layers} of this folder "
                "are windowed."
            )
        if qkv_bias or o_proj_bias or mlp_bias:
            raise ExportError("Mistral has no attention or MLP biases, and this folder has some.")
        extra.update(sliding_window=sliding[0] if sliding else None, head_dim=head_dim)
    elif architecture == "Qwen2ForCausalLM":
        if o_proj_bias or mlp_bias:
            raise ExportError("Qwen2 has q/k/v biases only; this folder has an o_proj or MLP bias.")
        extra.update(
            use_sliding_window=bool(sliding),
            sliding_window=sliding[0] if sliding else None,
            layer_types=["sliding_attention" if window else "full_attention" for window in windows],
            # vLLM's Qwen2 reads the first windowed layer from max_window_layers.
            max_window_layers=sliding_layers[0] if sliding_layers else config["num_hidden_layers"],
        )
    if architecture in ("Qwen2ForCausalLM", "SmolLM3ForCausalLM") and head_dim != default_head_dim:
        raise ExportError(
            f"{name} derives head_dim as hidden_size / num_attention_heads ({default_head_dim}); this folder's is {head_dim}."
        )
    return extra


def stock_config(config: dict, architecture: str):
    from transformers import AutoConfig

    model_type = EXPORT_ARCHITECTURES[architecture]
    extra = target_config_fields(config, architecture)
    config_class = type(AutoConfig.for_model(model_type))
    known = {f.name for f in fields(config_class)}
    copied = {
        key: value
        for key, value in config.items()
        if key in known
        and key not in IHA_ONLY_FIELDS
        and key not in extra
        and key not in ("architectures", "transformers_version", "layer_types")
    }
    target = config_class(**copied, **extra)
    target.architectures = [architecture]
    return target


def add_legacy_rope_keys(config_path: Path) -> None:
    """Also write RoPE as `rope_theta` and `rope_scaling`, the keys configs had before transformers 5's
    `rope_parameters`: runtimes that read only those (mlx-lm 0.32) would otherwise take their default base and no
    scaling. transformers reads `rope_parameters` first."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" not in rope:
        return
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    try:
        _, weight_files = find_weight_files(folder, allow_pickle=False)
    except ValueError as error:
        raise ExportError(str(error)) from None
    state_dict = {}
    for path in weight_files:
        state_dict.update(load_file(path))
    return state_dict


def fold_state_dict(state_dict: dict[str, torch.Tensor], config: dict, add_qkv_bias: bool) -> tuple[dict, list[int]]:
    """The IHA layers' mixing folded into their projections (float64, rounded once to each weight's dtype); the
    `head_mixing` tensors gone. `add_qkv_bias`: zero q/k/v biases where the folder has none (Qwen2 always has them)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    folded = dict(state_dict)
    folded_layers = []
    for layer_idx, attention_type in enumerate(config["attention_types"]):
        prefix = f"model.layers.{layer_idx}.self_attn."
        if is_iha_layer(attention_type):
            mixing = {name: folded.pop(f"{prefix}head_mixing.{name}") for name in MIXING_NAMES}
            for projection, alpha in (("q_proj", "alpha_q"), ("k_proj", "alpha_k"), ("v_proj", "alpha_v")):
                weight = folded[f"{prefix}{projection}.weight"]
                bias = folded.get(f"{prefix}{projection}.bias")
                new_weight, new_bias = fold_mixing_into_projection(weight, bias, mixing[alpha], head_dim)
                folded[f"{prefix}{projection}.weight"] = new_weight.to(weight.dtype).contiguous()
                if bias is not None:
                    folded[f"{prefix}{projection}.bias"] = new_bias.to(bias.dtype).contiguous()
            weight = folded[f"{prefix}o_proj.weight"]
            folded[f"{prefix}o_proj.weight"] = fold_collapse_into_output(weight, mixing["collapse"], head_dim).to(
                weight.dtype
            )
            folded_layers.append(layer_idx)
        if add_qkv_bias:
            for projection in ("q_proj", "k_proj", "v_proj"):
                weight = folded[f"{prefix}{projection}.weight"]
                folded.setdefault(f"{prefix}{projection}.bias", torch.zeros(weight.shape[0], dtype=weight.dtype))
    leftover = sorted(name for name in folded if ".head_mixing." in name)
    if leftover:
        raise ExportError(
            f"Mixing tensors on layers that are not IHA layers: {leftover[:4]}; the folder is inconsistent."
        )
    return folded, folded_layers


def copy_folder_files(folder: Path, staging: Path) -> None:
    """The tokenizer, generation config and license files: what a stock folder carries beside config and weights."""
    names = [name for name in (*TOKENIZER_FILES, "generation_config.json") if (folder / name).is_file()]
    for pattern in LICENSE_FILE_PATTERNS:
        names += [path.name for path in folder.glob(pattern) if path.is_file()]
    for name in names:
        shutil.copyfile(folder / name, staging / name)


def compare_logits(iha_folder: Path, exported_folder: Path, vocab_size: int) -> tuple[float, float, float]:
    """(max |logit difference|, top-1 agreement, max |logit|) of the two folders in float32 on a fixed left-padded
    batch of seeded random tokens."""
    from transformers import AutoModelForCausalLM

    from ..conversion.plan import iha_causal_lm_class

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (2, 40), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :9] = 0
    logits = []
    for model_class, model_folder in (
        (iha_causal_lm_class("iha"), iha_folder),
        (AutoModelForCausalLM, exported_folder),
    ):
        model = model_class.from_pretrained(model_folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=input_ids, attention_mask=attention_mask).logits[attention_mask.bool()])
        del model
    iha_logits, exported_logits = logits
    max_abs_diff = (iha_logits - exported_logits).abs().max().item()
    agreement = (iha_logits.argmax(-1) == exported_logits.argmax(-1)).double().mean().item()
    return max_abs_diff, agreement, iha_logits.abs().max().item()


def export_llama(
    folder: str | Path, output_dir: str | Path, *, overwrite: bool = False, verify: bool = True
) -> ExportReport:
    """Write the P = 1 IHA `folder` as a stock folder of its source architecture into `output_dir`.

    The weights keep the folder's dtype (the folded ones are computed in float64 and rounded once). `verify` runs
    both folders in float32 and compares their logits: a float32 folder must agree to float32 rounding.
    """
    folder, output_dir = Path(folder), Path(output_dir)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder: give the folder of a converted or trained IHA model.")
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())) and not overwrite:
        raise ExportError(
            f"The output folder {output_dir} exists and is not empty; choose another, or pass --overwrite."
        )
    config = read_iha_config(folder, GEMMA3_REFUSAL)
    architecture = source_architecture(folder, config)
    check_foldable(config, architecture)
    target = stock_config(config, architecture)
    state_dict = read_state_dict(folder)
    folded, folded_layers = fold_state_dict(
        state_dict, config, add_qkv_bias=architecture == "Qwen2ForCausalLM" and not config.get("qkv_bias")
    )
    if target.tie_word_embeddings:
        folded.pop("lm_head.weight", None)
    dtypes = sorted(
        {str(tensor.dtype).removeprefix("torch.") for tensor in folded.values() if tensor.is_floating_point()}
    )
    report = ExportReport(str(folder), str(output_dir), architecture, folded_layers, ",".join(dtypes))

    from huggingface_hub import save_torch_state_dict

    with staged_folder(output_dir, "iha-export", replace=overwrite) as staging:
        target.save_pretrained(staging)
        add_legacy_rope_keys(staging / "config.json")
        save_torch_state_dict(folded, staging, metadata={"format": "pt"})
        copy_folder_files(folder, staging)
        if verify:
            max_abs_diff, agreement, largest = compare_logits(folder, staging, config["vocab_size"])
            report.max_abs_diff, report.top1_agreement = max_abs_diff, agreement
            # float32 weights: equal to float32 rounding (a few units of 1e-7 of the largest logit per operation).
            tolerance = 1e-5 * max(1.0, largest)
            if dtypes == ["float32"] and max_abs_diff > tolerance:
                raise ExportError(
                    f"The exported folder's logits differ from the IHA folder's by {max_abs_diff:.2e} (tolerance "
                    f"{tolerance:.1e}); nothing was written."
                )
            if dtypes != ["float32"]:
                report.notes.append(
                    f"the folded projections are rounded once to {report.dtype}: max |logit difference| "
                    f"{max_abs_diff:.2e}, top-1 agreement {100 * agreement:.2f}% in float32 (float32 weights fold "
                    "exactly)"
                )
        (staging / "README.md").write_text(
            EXPORT_CARD.format(
                name=output_dir.name,
                architecture=architecture,
                model_type=target.model_type,
                max_abs_diff=report.max_abs_diff if report.max_abs_diff is not None else float("nan"),
            )
        )
    return report


__all__ = ["EXPORT_ARCHITECTURES", "ExportReport", "export_llama"]
