"""The model card and licenses a converted folder carries (`iha.hub.model_card`, `iha.hub.licenses`): the package's
license beside a base's own, the base's license in the card, sections added and replaced, text written as given."""

from testing_utils import make_source

from iha import conversion as convert
from iha.hub.model_card import parse_model_card, read_model_card, update_model_card


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
