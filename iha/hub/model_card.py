"""Model cards (README.md) for IHA checkpoints, built from an ordered dict of sections: reading, writing, updating.

A card is YAML metadata (what the Hub reads: base model, tags, license, ...), a title, an optional intro and
level-2 sections; huggingface_hub's `ModelCard` / `ModelCardData` write and read the metadata and render the card
from `CARD_TEMPLATE`. Each stage writes its own card with these: the converter the first one
(`iha.conversion.card`), training its output's (`iha.training.card`); later steps (evaluation, the demo, pushing) add or
replace sections with `update_model_card(folder, sections={...})`, which keeps everything else as it was:

```python
>>> from iha.hub.model_card import update_model_card
>>> update_model_card("my-iha-model", sections={"Training": "Fine-tuned for 1 epoch on GSM8K ..."})
```
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..models.iha.version_iha import supported_range_text
from ..utils.atomic_files import write_text_atomic


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
untested one, the first cached forward checks the cache path on a tiny model and refuses to run if it fails."""


def card_license(card: "ModelCardContent | None") -> str | None:
    """The `license:` a model card names (the Hub's identifier, e.g. `apache-2.0`, `gemma`), or None."""
    value = card.metadata.get("license") if card is not None else None
    return value if isinstance(value, str) and value else None


__all__ = [
    "DEFAULT_TAGS",
    "INSTALL_HINT",
    "MODEL_CARD_NAME",
    "ModelCardContent",
    "card_license",
    "how_to_load_section",
    "parse_model_card",
    "read_model_card",
    "render_model_card",
    "update_model_card",
    "write_model_card",
]
