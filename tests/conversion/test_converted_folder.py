"""What a converted folder carries beside its weights: a tokenizer that loads like the source's (also in a process
without the package), the licenses, and a model card whose sections can be added and replaced."""

import json
import os
import subprocess
import sys

import pytest
from testing_utils import make_source

from iha import conversion as convert
from iha.hub.model_card import parse_model_card, read_model_card, update_model_card


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer of a converted folder
# ---------------------------------------------------------------------------------------------------------------

TOKENIZER_PROBE = """
import sys
sys.modules["iha"] = None  # a process that never imports the package
from transformers import AutoTokenizer
trust = {trust}
for folder in sys.argv[1:]:
    tokenizer = AutoTokenizer.from_pretrained(folder, **({{"trust_remote_code": True}} if trust else {{}}))
    print("RESULT", type(tokenizer).__name__, tokenizer.encode("Weng earns 12/60 = $0.2 per minute."), flush=True)
"""


def load_tokenizers_elsewhere(folders, tmp_path, trust_remote_code: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    return subprocess.run(
        [sys.executable, "-I", "-c", TOKENIZER_PROBE.format(trust=trust_remote_code), *map(str, folders)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,  # a prompt would read EOF at once instead of waiting
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("kind", ["llama3", "qwen2_sliding", "mistral_full"])
def test_converted_tokenizer_loads_like_the_source(kind, tmp_path):
    """Same class, same ids as the source's tokenizer, also where the source's tokenizer_config names no class
    (AutoTokenizer then goes by the model type, which differs: `iha` against `llama` / `qwen2`)."""
    from testing_utils import build_tiny_tokenizer

    source = make_source(kind, tmp_path / "source")
    build_tiny_tokenizer(source)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    del tokenizer_config["tokenizer_class"]
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    convert.convert_checkpoint(source, tmp_path / "iha", verify=False, show_progress=False)

    with_remote_code = load_tokenizers_elsewhere([source, tmp_path / "iha"], tmp_path, trust_remote_code=True)
    assert with_remote_code.returncode == 0, with_remote_code.stderr[-3000:]
    source_line, converted_line = [line for line in with_remote_code.stdout.splitlines() if line.startswith("RESULT")]
    assert converted_line == source_line
    assert "Do you wish to run the custom code" not in with_remote_code.stdout + with_remote_code.stderr
    assert "model of type" not in with_remote_code.stderr

    # Without trust_remote_code, transformers reads config.json (whose auto_map names the IHA code) before the
    # tokenizer and asks about remote code; with no one to answer, it must still give the source's tokenizer.
    without = load_tokenizers_elsewhere([tmp_path / "iha"], tmp_path, trust_remote_code=False)
    assert without.returncode == 0, without.stderr[-3000:]
    assert [line for line in without.stdout.splitlines() if "RESULT" in line][0].endswith(source_line)


# ---------------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------------


def test_converted_folder_carries_the_package_license_and_the_base_models_in_its_card(tmp_path):
    from iha.hub.licenses import package_license_text

    # A base under other terms, with its own LICENSE file (as a Gemma or Llama folder has): it stays `LICENSE`, the
    # package's goes beside it, and the card's `license:` is the base's.
    gemma_like = make_source("mistral_full", tmp_path / "gemma-like")
    (gemma_like / "LICENSE").write_text("Gemma Terms of Use\n")
    update_model_card(gemma_like, metadata={"license": "gemma"}, title="gemma-like")
    convert.convert_checkpoint(gemma_like, tmp_path / "gemma-like-iha", show_progress=False)
    folder = tmp_path / "gemma-like-iha"
    assert (folder / "LICENSE").read_text() == "Gemma Terms of Use\n"
    assert (folder / "LICENSE-iha").read_text() == package_license_text()
    card = read_model_card(folder)
    assert card.metadata["license"] == "gemma"
    assert "keep its license, `gemma`" in card.sections["License"] and "`LICENSE-iha`" in card.sections["License"]

    # A base that states no license: the package's Apache-2.0 LICENSE, and a card that says the weights' is unknown.
    convert.convert_checkpoint(
        make_source("mistral_full", tmp_path / "plain"), tmp_path / "plain-iha", show_progress=False
    )
    folder = tmp_path / "plain-iha"
    assert (folder / "LICENSE").read_text() == package_license_text() and not (folder / "LICENSE-iha").exists()
    card = read_model_card(folder)
    assert card.metadata["license"] == "apache-2.0" and "state no license" in card.sections["License"]
    assert "Apache License" in package_license_text() and "Version 2.0" in package_license_text()


def test_model_card_sections_can_be_added_and_replaced(tmp_path):
    source = make_source("llama3", tmp_path / "source")
    report = convert.convert_checkpoint(source, tmp_path / "iha", show_progress=False)
    card = read_model_card(tmp_path / "iha")
    assert list(card.sections) == ["IHA settings", "Verification", "How to load", "Conversion", "License"]
    assert f"{report.verification.max_abs_diff:.2e}" in card.sections["Verification"]
    assert card.metadata["library_name"] == "transformers" and "iha" in card.metadata["tags"]

    update_model_card(
        tmp_path / "iha",
        sections={"Training": "Fine-tuned on GSM8K.\n\n```bash\n## not a heading\n```", "Verification": "redone"},
        metadata={"tags": ["sft"], "datasets": ["openai/gsm8k"]},
    )
    updated = parse_model_card((tmp_path / "iha" / "README.md").read_text())
    assert list(updated.sections) == [
        "IHA settings",
        "Verification",
        "How to load",
        "Conversion",
        "License",
        "Training",
    ]
    assert updated.sections["Verification"] == "redone"
    assert updated.sections["Training"].endswith("## not a heading\n```")
    assert updated.sections["IHA settings"] == card.sections["IHA settings"]
    assert updated.metadata["tags"] == card.metadata["tags"] + ["sft"]
    assert updated.metadata["datasets"] == ["openai/gsm8k"]
    assert updated.title == card.title and updated.intro == card.intro


def test_model_card_text_is_written_as_given(tmp_path):
    # The card is rendered from a Jinja template: text that looks like Jinja stays text, and a card without metadata
    # gets no YAML block (not an empty `{}` one).
    sections = {"Prompt": "The chat template uses {{ messages }} and {% for m in messages %}.", "Empty": ""}
    update_model_card(tmp_path, title="plain {{ title }}", intro="no metadata", sections=sections)
    text = (tmp_path / "README.md").read_text()
    assert text == (
        "# plain {{ title }}\n\nno metadata\n\n## Prompt\n\n"
        "The chat template uses {{ messages }} and {% for m in messages %}.\n\n## Empty\n\n\n"
    )
    update_model_card(tmp_path, metadata={"license": "apache-2.0"})
    assert (tmp_path / "README.md").read_text() == "---\nlicense: apache-2.0\n---\n\n" + text
    assert parse_model_card((tmp_path / "README.md").read_text()).sections == sections
