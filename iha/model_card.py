# Copyright 2026 The iha authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Model cards (README.md) for IHA checkpoints, built from an ordered dict of sections.

A card is YAML metadata (what the Hub reads: base model, tags, license, ...), a title, an optional intro and
level-2 sections; huggingface_hub's `ModelCard` / `ModelCardData` write and read the metadata and render the card
from `CARD_TEMPLATE`. The converter writes the first card; later steps (fine-tuning, evaluation, pushing) add or
replace sections with `update_model_card(folder, sections={...})`, which keeps everything else as it was:

```python
>>> from iha.model_card import update_model_card
>>> update_model_card("my-iha-model", sections={"Training": "Fine-tuned for 1 epoch on GSM8K ..."})
```
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

from .arguments import ArgumentParser
from .atomic_files import write_text_atomic
from .licenses import license_card_parts


MODEL_CARD_NAME = "README.md"
DEFAULT_TAGS = ["iha", "interleaved-head-attention"]
# How a card tells its reader to install the package; it is not on a package index yet, so from its source.
INSTALL_HINT = "`pip install .` in a copy of its source repository; `iha-transformers` is not on PyPI yet"


@dataclass
class ModelCardContent:
    """The parts of a model card: `sections` maps each level-2 heading to its markdown body, in order."""

    title: str
    metadata: dict = field(default_factory=dict)
    intro: str = ""
    sections: dict[str, str] = field(default_factory=dict)


# The layout of every card the package writes, rendered by huggingface_hub (`ModelCard.from_template`, Jinja) under
# the YAML metadata block it writes from `ModelCardData`.
CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}
{% if intro %}
{{ intro }}
{% endif %}{% for heading, body in sections.items() %}
## {{ heading }}

{{ body }}
{% endfor %}"""


def render_model_card(sections: dict[str, str], *, title: str, metadata: dict | None = None, intro: str = "") -> str:
    """README.md text: YAML metadata, `# title`, intro, then `## heading` sections (huggingface_hub's `ModelCard`)."""
    from huggingface_hub import ModelCard, ModelCardData

    for heading in sections:
        if "\n" in heading or heading.startswith("#"):
            raise ValueError(f"A section heading must be one line of plain text, got {heading!r}.")
    card = ModelCard.from_template(
        ModelCardData(**(metadata or {})),
        template_str=CARD_TEMPLATE,
        title=title,
        intro=intro.strip(),
        sections={heading: body.strip() for heading, body in sections.items()},
    )
    # Without metadata, no YAML block at all (huggingface_hub would write an empty `{}` one).
    return str(card) if metadata else card.text.lstrip("\n")


def parse_model_card(text: str) -> ModelCardContent:
    """Split README.md text into metadata, title, intro and sections (the inverse of `render_model_card`).

    huggingface_hub's `ModelCard` separates the metadata from the markdown; it has no notion of sections, so the
    markdown is split here: only `## ` lines outside code fences start a section (code blocks with `## comments`
    stay whole), and a card's own sections, written by a user or a trainer, are kept in their order.
    """
    from huggingface_hub import ModelCard

    card = ModelCard(text, ignore_metadata_errors=True)
    metadata = card.data.to_dict() if card.data is not None else {}
    title, intro_lines, sections = "", [], {}
    current_heading, current_lines = None, []
    in_fence = False
    for line in card.text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if not in_fence and line.startswith("## "):
            if current_heading is not None:
                sections[current_heading] = "\n".join(current_lines).strip()
            current_heading, current_lines = line[3:].strip(), []
        elif current_heading is not None:
            current_lines.append(line)
        elif not in_fence and not title and line.startswith("# "):
            title = line[2:].strip()
        else:
            intro_lines.append(line)
    if current_heading is not None:
        sections[current_heading] = "\n".join(current_lines).strip()
    return ModelCardContent(title=title, metadata=metadata, intro="\n".join(intro_lines).strip(), sections=sections)


def write_model_card(folder: str | os.PathLike, content: ModelCardContent) -> Path:
    """Write `folder/README.md` atomically (temporary file in the same folder, then rename)."""
    path = Path(folder) / MODEL_CARD_NAME
    text = render_model_card(content.sections, title=content.title, metadata=content.metadata, intro=content.intro)
    return write_text_atomic(text, path)


def read_model_card(folder: str | os.PathLike) -> ModelCardContent | None:
    path = Path(folder) / MODEL_CARD_NAME
    if not path.is_file():
        return None
    return parse_model_card(path.read_text(encoding="utf-8"))


def update_model_card(
    folder: str | os.PathLike,
    *,
    sections: dict[str, str] | None = None,
    metadata: dict | None = None,
    title: str | None = None,
    intro: str | None = None,
    remove_sections: tuple[str, ...] = (),
) -> Path:
    """Add or replace sections / metadata keys of `folder/README.md`, keeping the rest; creates the card if absent.

    A replaced section keeps its place; new sections go at the end, in the order given. Metadata lists such as
    `tags` are merged (old entries first), other metadata keys are replaced.
    """
    content = read_model_card(folder) or ModelCardContent(title=title or Path(folder).resolve().name)
    if title is not None:
        content.title = title
    if intro is not None:
        content.intro = intro
    for key, value in (metadata or {}).items():
        old = content.metadata.get(key)
        if isinstance(old, list) and isinstance(value, list):
            content.metadata[key] = old + [item for item in value if item not in old]
        else:
            content.metadata[key] = value
    for heading in remove_sections:
        content.sections.pop(heading, None)
    content.sections.update(sections or {})
    return write_model_card(folder, content)


def how_to_load_section(model_id: str) -> str:
    """The "How to load" section: with the `iha` package, and through remote code without it."""
    from .compat_iha import supported_range_text  # imports transformers (and torch)

    return f"""With the `iha` package installed ({INSTALL_HINT}):

```python
import iha  # registers the IHA classes with the Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{model_id}")
tokenizer = AutoTokenizer.from_pretrained("{model_id}")
```

Without it, the modeling code stored next to the weights is used:

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{model_id}", trust_remote_code=True)
messages = [{{"role": "user", "content": "What is 7 * 6?"}}]
print(generator(messages, max_new_tokens=64)[0]["generated_text"][-1]["content"])
```

Supported: {supported_range_text()}. On an older release, loading stops with the command that fixes it; on a newer,
untested one, the code files first check their cache path on a tiny model and refuse to run if it fails."""


def how_to_load_adapter_section(adapter_path: str) -> str:
    """The "How to load" section of a LoRA output: the adapter on its IHA base, or merged into it."""
    return f"""A LoRA adapter (with the trained IHA mixing weights) for an IHA model. Load it on its base with the `iha`
package ({INSTALL_HINT}), which rebuilds the base recorded in `iha_sft_base.json`:

```python
from iha.sft import load_sft_output

model = load_sft_output("{adapter_path}")              # PeftModel on the IHA base
merged = load_sft_output("{adapter_path}", merge=True)  # a plain IHAForCausalLM
```"""


def conversion_card_sections(report, model_id: str) -> dict[str, str]:
    """The model card sections a conversion writes (`report` is its `iha.convert.ConversionReport`): settings,
    verification, how to load."""
    from .configuration_iha import is_sliding_layer
    from .convert.checkpoint import REPORT_NAME
    from .convert.plan import describe_layers

    iha_layers = report.iha_layers
    standard_layers = [i for i in range(len(report.attention_types)) if i not in iha_layers]
    sliding = [i for i, t in enumerate(report.attention_types) if is_sliding_layer(t)]
    settings = [
        "| setting | value |",
        "|---|---|",
        f"| pseudo-heads per head (P) | {report.num_pseudo_heads} |",
        f"| IHA layers | {describe_layers(iha_layers) or 'none'} (of {len(report.attention_types)}) |",
        f"| standard attention layers | {describe_layers(standard_layers) or 'none'} |",
        f"| sliding window | {f'{report.sliding_window} tokens, layers {describe_layers(sliding)}' if sliding else 'none'} |",
        f"| mask | {report.mask_mode} |",
        f"| positions | {report.position_mode} |",
        f"| collapse | {report.collapse_mode}, initialised to `{report.collapse_init}` |",
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
            f"(the `iha` package, transformers {transformers_version()}). The folder holds `config.json` (with "
            f"`auto_map`), `configuration_iha.py` and `modeling_iha.py`, the weights as safetensors "
            f"({', '.join(report.weight_files)}), the source's tokenizer and generation config, and "
            f"`{REPORT_NAME}` with these figures."
        ),
    }


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def write_conversion_card(folder: Path, report, source_dir: Path, model_id: str | None = None) -> Path:
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
    base_link = f"[{base}](https://huggingface.co/{base})" if report.base_model else f"`{base}`"
    intro = (
        f"{base_link} converted to **Interleaved Head Attention** (IHA, "
        f"[arXiv 2602.21371](https://arxiv.org/abs/2602.21371)) with P = {report.num_pseudo_heads} pseudo-heads per "
        "head. "
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


def card_license(card: "ModelCardContent | None") -> str | None:
    """The `license:` a model card names (the Hub's identifier, e.g. `apache-2.0`, `gemma`), or None."""
    value = card.metadata.get("license") if card is not None else None
    return value if isinstance(value, str) and value else None


def hub_base_model(source) -> str | None:
    """The Hub id to name as `base_model` in a card's metadata, or None: the Hub only accepts repository ids there.

    A Hub id is itself; a local folder gives the base its own card names (a converted folder records its source),
    or the one `iha.builtin` stamped into it; any other local path gives None.
    """
    from .builtin import builtin_base_model
    from .convert.readers import looks_like_hub_id

    if source is None:
        return None
    path = Path(str(source)).expanduser()
    if not path.exists():
        return str(source) if looks_like_hub_id(str(source)) else None
    card = read_model_card(path)
    if card is not None and isinstance(card.metadata.get("base_model"), str):
        return card.metadata["base_model"]
    return builtin_base_model(path)


def finetuned_intro(
    base, *, adapter: bool = False, converted: bool = False, trainer: str = "TRL's `SFTTrainer`"
) -> str:
    """The intro of a training output's card: what it was trained from (a Hub link where the base has an id)."""
    hub_base = hub_base_model(base)
    base_label = f"[{hub_base}](https://huggingface.co/{hub_base})" if hub_base else f"`{Path(str(base)).name}`"
    what = "A LoRA adapter for" if adapter else "A fine-tuned version of"
    return (
        f"{what} {base_label}" + (" converted" if converted else "") + " with **Interleaved Head Attention** (IHA, "
        f"[arXiv 2602.21371](https://arxiv.org/abs/2602.21371)), trained with {trainer}. The modeling code is stored "
        "next to the weights: load with `trust_remote_code=True`, or with `import iha`."
    )


def rewrite_trainer_card(folder: str | os.PathLike, base: str) -> Path:
    """Turn the generic card a trainer wrote (TRL's "fine-tuned version of None", a quick start without
    `trust_remote_code`) into an IHA card: the base named (Hub metadata only for a Hub id), how to load it, the
    base's IHA settings. The trainer's other sections (training procedure, versions, citations) are kept."""
    folder = Path(folder)
    card = read_model_card(folder) or ModelCardContent(title=folder.resolve().name)
    hub_base = hub_base_model(base)
    card.metadata.pop("base_model", None)
    if hub_base is not None:
        card.metadata["base_model"] = hub_base
    card.metadata["tags"] = [*DEFAULT_TAGS, *[tag for tag in card.metadata.get("tags", []) if tag not in DEFAULT_TAGS]]
    card.metadata.setdefault("pipeline_tag", "text-generation")
    card.title = f"{folder.resolve().name} (IHA, fine-tuned)"
    card.intro = finetuned_intro(base, trainer="TRL")
    sections = {"How to load": how_to_load_section(str(folder))}
    base_card = read_model_card(base) if Path(str(base)).is_dir() else None
    if base_card is not None and "IHA settings" in base_card.sections:
        sections["IHA settings"] = base_card.sections["IHA settings"]
    sections.update((heading, body) for heading, body in card.sections.items() if heading not in ("Quick start",))
    card.metadata["license"], sections["License"] = license_card_parts(folder, card_license(base_card), str(base))
    card.sections = sections
    return write_model_card(folder, card)


def make_parser() -> ArgumentParser:
    """`iha card FOLDER --base-model BASE`."""
    parser = ArgumentParser(
        prog="iha card",
        description="Rewrite the model card a trainer wrote into FOLDER (e.g. `trl sft`, whose card names no local "
        "base and loads without trust_remote_code) as an IHA card; the trainer's other sections are kept.",
    )
    parser.add_argument("folder", help="the training output folder (its README.md is rewritten in place)")
    parser.add_argument("--base-model", required=True, help="the IHA model it was trained from: folder or Hub id")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`iha card FOLDER --base-model BASE`: the IHA card for a folder `trl sft` (or another trainer) wrote."""
    import sys

    args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not (Path(args.folder) / "config.json").is_file() and not (Path(args.folder) / "adapter_config.json").is_file():
        print(
            f"iha card: error: {args.folder} holds no model (no config.json or adapter_config.json).", file=sys.stderr
        )
        return 2
    print(f"Wrote {rewrite_trainer_card(args.folder, args.base_model)}")
    return 0


__all__ = [
    "ModelCardContent",
    "conversion_card_sections",
    "finetuned_intro",
    "how_to_load_adapter_section",
    "how_to_load_section",
    "hub_base_model",
    "make_parser",
    "parse_model_card",
    "read_model_card",
    "render_model_card",
    "rewrite_trainer_card",
    "update_model_card",
    "write_conversion_card",
    "write_model_card",
]
