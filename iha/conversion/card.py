"""The model card of a converted folder: the base it came from (and its license), the IHA settings, what changes
against the source, the verification figures and how to load it. Generic card reading and writing is
`iha.hub.model_card`'s."""

from pathlib import Path

import transformers

from ..hub.licenses import license_card_parts
from ..hub.model_card import (
    DEFAULT_TAGS,
    MODEL_CARD_NAME,
    card_license,
    how_to_load_section,
    read_model_card,
    render_model_card,
)
from ..models.iha.layer_iha import is_sliding_layer
from ..utils.atomic_files import write_text_atomic
from .plan import describe_layers
from .report import REPORT_NAME, ConversionReport


def describe_sliding_window(report: ConversionReport, sliding: list[int]) -> str:
    """The card's sliding-window row: the window and the layers it applies to."""
    if not sliding:
        return "none"
    window, num_pseudo = report.sliding_window, report.num_pseudo_heads
    unit = ""
    if any(index in report.iha_layers for index in sliding):
        unit = (
            f" (IHA layers: the paper's flat window of {window * num_pseudo} virtual tokens; the last pseudo-head of a "
            f"token sees exactly its last {window} tokens)"
        )
    return f"{window} tokens{unit}, layers {describe_layers(sliding)}"


def conversion_card_sections(report: ConversionReport, model_id: str) -> dict[str, str]:
    """The model card sections a conversion writes: settings, verification, how to load."""
    iha_layers = report.iha_layers
    standard_layers = [i for i in range(len(report.attention_types)) if i not in iha_layers]
    sliding = [i for i, t in enumerate(report.attention_types) if is_sliding_layer(t)]
    settings = [
        "| setting | value |",
        "|---|---|",
        f"| pseudo-heads per head (P) | {report.num_pseudo_heads} |",
        f"| IHA layers | {describe_layers(iha_layers) or 'none'} (of {len(report.attention_types)}) |",
        f"| standard attention layers | {describe_layers(standard_layers) or 'none'} |",
        f"| sliding window | {describe_sliding_window(report, sliding)} |",
        f"| mask | {report.options.mask_mode} |",
        f"| positions | {report.options.position_mode} |",
        f"| collapse | {report.options.collapse_mode}, initialised to `{report.options.collapse_init}` |",
        f"| head-mixing parameters added | {report.head_mixing_parameters:,} |",
        f"| dtype | {report.dtype} |",
    ]
    if report.exact:
        function = (
            "With these settings the model computes the same function as the source: the head mixing starts at "
            "identity (every pseudo-head is a copy of its head), all pseudo-tokens of a token share its position, "
            "and the collapse reads the last pseudo-head, which under the flat causal mask sees exactly what the "
            "source head saw. Fine-tuning then moves the mixing away from identity."
        )
    else:
        function = "These settings change what the model computes, compared with the source:\n\n" + "\n".join(
            f"- {change}" for change in report.function_changes
        )
    verification = report.verification
    if verification is None:
        checked = "Verification was skipped (`--no-verify`)."
    else:
        inputs = f"a fixed batch of {verification.batch_shape[0]} left-padded sequences"
        if len(verification.by_length) > 1:
            inputs += " and on one longer text"
        checked = "\n".join(
            [
                f"Source and converted model ran in fp32 on {inputs} ({verification.positions} token positions "
                "compared).",
                "",
                "| measure | value |",
                "|---|---|",
                f"| max absolute logit difference | {verification.max_abs_diff:.2e} |",
                f"| top-1 agreement | {100 * verification.top1_agreement:.2f}% |",
                f"| the source against itself (sdpa vs eager attention) | {verification.reference_noise:.2e} |",
                f"| tolerance | {f'{verification.tolerance:.1e}' if verification.tolerance is not None else 'none (not meant to be exact)'} |",
                f"| result | {verification.message.split(':')[0]} |",
            ]
        )
        if len(verification.by_length) > 1:  # settings that change the function: measured on a long input too
            checked += "\n\nBy input length (a changed window only changes the tokens past it):\n\n" + "\n".join(
                ["| input | tokens | max absolute logit difference | top-1 agreement |", "|---|---|---|---|"]
                + [
                    f"| {entry['input']} | {entry['tokens']} | {entry['max_abs_diff']:.2e} | "
                    f"{100 * entry['top1_agreement']:.2f}% |"
                    for entry in verification.by_length
                ]
            )
    source_label = (
        f"`{report.base_model}`" if report.base_model else f"a local checkpoint (`{Path(report.source).name}`)"
    )
    return {
        "IHA settings": "\n".join(settings) + "\n\n" + function,
        "Verification": checked,
        "How to load": how_to_load_section(model_id),
        "Conversion": (
            f"Converted from {source_label} ({report.architecture}) with `iha-convert` "
            f"(the `iha` package, transformers {transformers.__version__}). The folder holds `config.json` (with "
            f"`auto_map`), `configuration_iha.py` and `modeling_iha.py`, the weights as safetensors "
            f"({', '.join(report.weight_files)}), the source's tokenizer and generation config, and "
            f"`{REPORT_NAME}` with these figures."
        ),
    }


def write_conversion_card(
    folder: Path, report: ConversionReport, source_dir: Path, model_id: str | None = None
) -> Path:
    """The model card of a converted folder: its base (and license), the settings and the verification figures."""
    source_card = read_model_card(source_dir)
    metadata = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": list(DEFAULT_TAGS) + (["conversational"] if (folder / "chat_template.jinja").is_file() else []),
    }
    if report.base_model:
        metadata["base_model"] = report.base_model
    base = report.base_model or Path(report.source).name
    metadata["license"], license_section = license_card_parts(folder, card_license(source_card), base)
    intro = (
        f"`{base}` converted to **Interleaved Head Attention** (IHA, arXiv 2602.21371) with "
        f"P = {report.num_pseudo_heads} pseudo-heads per head. "
        + (
            "It computes what the source model computes and is ready to fine-tune."
            if report.exact
            else "These settings change the function (see below): fine-tune before use."
        )
    )
    text = render_model_card(
        {**conversion_card_sections(report, model_id or Path(report.output_dir).name), "License": license_section},
        title=f"{Path(base).name} with Interleaved Head Attention (P={report.num_pseudo_heads})",
        metadata=metadata,
        intro=intro,
    )
    return write_text_atomic(text, folder / MODEL_CARD_NAME)


__all__ = ["conversion_card_sections", "write_conversion_card"]
